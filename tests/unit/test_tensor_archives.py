"""DCP's tensor items read without ``torch.load``: the same tensors, and ``torch.load`` for anything else.

:func:`hp_lightning.checkpoint.unpickle.read_plain_tensor` decodes the one-tensor ``torch.save``
archives DCP writes into its shard files (most of a resume's time is ``torch.load``'s per-archive
cost). Checked here against ``torch.load`` itself, archive by archive, each at an offset inside a
larger file as in a shard: every plain dtype, 0-d, empty, non-contiguous and offset views; and
that anything else (a newer dtype's v3 rebuild, a foreign global, a view reaching past its
storage, a damaged archive) is left to ``torch.load`` (None), never decoded into a wrong tensor.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from hp_lightning.checkpoint.unpickle import read_plain_tensor

LEAD = b"x" * 37  # the archive does not start at offset 0 of a shard file


def _archive(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _read(tmp_path: Path, archive: bytes) -> torch.Tensor | None:
    path = tmp_path / "shard.distcp"
    path.write_bytes(LEAD + archive + b"tail")
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_plain_tensor(fd, len(LEAD), len(archive))
    finally:
        os.close(fd)


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(64, 300)  # 75 KiB: above the size whose CRC-32 the manifest takes from torch's zip
    out: dict[str, torch.Tensor] = {
        "float32": base,
        "transposed": base.t(),  # non-contiguous, the whole storage
        "narrowed_clone": base[3:9, 5:].clone(),
        "view_with_offset": base[3:9, 5:],  # torch saves the whole storage and the view's offset into it
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "step": torch.tensor(7.0),
    }
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.complex64):
        out[str(dtype)] = (torch.randn(5, 7) * 10).to(dtype)
    return out


@pytest.mark.parametrize("name", list(_tensors()))
def test_plain_tensors_read_exactly_as_torch_load_reads_them(tmp_path: Path, name: str) -> None:
    tensor = _tensors()[name]
    archive = _archive(tensor)
    expected = torch.load(io.BytesIO(archive), weights_only=True)
    got = _read(tmp_path, archive)
    assert got is not None, name
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
    assert got.storage_offset() == expected.storage_offset() and got.untyped_storage().nbytes() == expected.untyped_storage().nbytes()
    assert torch.equal(got, expected)


def _with_pickle(archive: bytes, data_pkl: bytes) -> bytes:
    """The archive with its ``data.pkl`` replaced (everything else as torch wrote it)."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            target.writestr(info.filename, data_pkl if info.filename.endswith("/data.pkl") else source.read(info.filename))
    return out.getvalue()


class _Storage:  # stands for torch's typed storage in a hand-written pickle
    pass


def _crafted_pickle(size: tuple[int, ...], stride: tuple[int, ...], rebuild: object = torch._utils._rebuild_tensor_v2) -> bytes:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", torch.FloatStorage, "0", "cpu", 4) if isinstance(obj, _Storage) else None

    class Crafted:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return rebuild, (_Storage(), 0, size, stride, False, collections.OrderedDict())

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(Crafted())
    return buffer.getvalue()


def test_anything_but_a_plain_tensor_archive_is_left_to_torch_load(tmp_path: Path) -> None:
    four = _archive(torch.arange(4.0))  # its data record holds 4 floats
    # A view reaching past its storage (Tensor.set_ would accept it and read foreign memory): not decoded.
    assert _read(tmp_path, _with_pickle(four, _crafted_pickle((100,), (1,)))) is None
    assert _read(tmp_path, _with_pickle(four, _crafted_pickle((2, 2), (1, 3)))) is None  # reaches element 4 of 0..3
    exact = _read(tmp_path, _with_pickle(four, _crafted_pickle((2, 2), (1, 2))))  # the last element it reaches is 3
    assert exact is not None and torch.equal(exact, torch.arange(4.0).as_strided((2, 2), (1, 2)))
    # A global outside the allowlist (here a harmless one; os.system would be the same path): not decoded, not called.
    assert _read(tmp_path, _with_pickle(four, _crafted_pickle((4,), (1,), rebuild=collections.Counter))) is None
    # A dtype torch saves with its v3 rebuild and untyped storage: torch.load's to read.
    assert _read(tmp_path, _archive(torch.ones(3, dtype=torch.float8_e4m3fn))) is None
    # Not a tensor, damaged, cut short: None (DCP's path then raises torch's own error, the CRC check names the file).
    assert _read(tmp_path, _archive({"a": 1})) is None
    damaged = bytearray(four)
    damaged[-30:] = b"\0" * 30  # the end of central directory gone
    assert _read(tmp_path, bytes(damaged)) is None
    assert _read(tmp_path, four[: len(four) // 2]) is None


class _Ref:
    """A storage reference in a hand-written pickle: ``("storage", <class>, key, "cpu", numel)``."""

    def __init__(self, storage_class: object, numel: int) -> None:
        self.storage_class, self.numel = storage_class, numel


class _Rebuild:
    """``_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``, then a BUILD ``state`` if given."""

    def __init__(self, ref: _Ref, size: tuple[int, ...], state: object = None) -> None:
        self.ref, self.size, self.state = ref, size, state

    def __reduce__(self) -> tuple[object, ...]:
        args = (self.ref, 0, self.size, (1,) * len(self.size), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args) + ((self.state,) if self.state is not None else ())


def _pickled(value: object) -> bytes:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", obj.storage_class, "0", "cpu", obj.numel) if isinstance(obj, _Ref) else None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(value)
    return buffer.getvalue()


def test_what_the_pickle_does_after_the_rebuild_cannot_grow_or_mark_the_tensor(tmp_path: Path) -> None:
    """The pickle's BUILD opcode runs ``Tensor.__setstate__`` on the rebuilt tensor; torch.load refuses these."""
    four = _archive(torch.arange(4.0))
    floats = _Ref(torch.FloatStorage, 4)
    grown = _Rebuild(floats, (2,), state=(_Rebuild(floats, (4,)), 0, (1 << 20,), (1,)))  # set_(..., (2**20,)): grow the storage
    assert _read(tmp_path, _with_pickle(four, _pickled(grown))) is None
    marked = _Rebuild(floats, (4,), state=(True, None, collections.OrderedDict()))  # requires_grad and hooks set afterwards
    assert _read(tmp_path, _with_pickle(four, _pickled(marked))) is None
    as_bytes = _Rebuild(_Ref(torch.ByteStorage, 16), (16,))  # the same storage named again with another dtype
    assert _read(tmp_path, _with_pickle(four, _pickled(collections.OrderedDict(a=_Rebuild(floats, (4,)), b=as_bytes)))) is None
    with pytest.raises(Exception):  # noqa: B017 - what torch does with each: refuses (the fast path never decodes them)
        torch.load(io.BytesIO(_with_pickle(four, _pickled(grown))), weights_only=True)
