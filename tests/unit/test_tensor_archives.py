"""DCP's tensor items, decoded by torch's own reader: the same tensors, every declared size checked first.

DCP writes each tensor as a one-tensor ``torch.save`` archive inside a shard file, and its own
``FileSystemReader.read_data`` reads it back with ``torch.load(weights_only=True)``. hp_lightning
keeps torch's decoding and adds checks through public hooks: :func:`check_archive` bounds each
archive's records before torch allocates for them, and :class:`SafeLoadPlanner` refuses a loaded
tensor that is not the chunk the index promised. Checked here: every plain dtype and layout torch
saves round-trips exactly through a real DCP directory read with those checks (nothing honest is
refused), and :func:`check_archive` on the archives torch writes and on edited ones.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hp_lightning.checkpoint import CorruptCheckpointError, UnsafeCheckpointError
from hp_lightning.checkpoint.integrity import MAX_COMPRESSION_RATIO, SIZED_TOKENS, check_archive
from hp_lightning.checkpoint.read import read_dcp
from tests.unit.test_crafted_checkpoints import SIZED_PICKLES


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(64, 300)  # 75 KiB: above the size whose CRC-32 the manifest takes from torch's zip
    out: dict[str, torch.Tensor] = {
        "float32": base,
        "transposed": base.t(),  # non-contiguous: DCP saves its layout as it is
        "narrowed_clone": base[3:9, 5:].clone(),
        "view_with_offset": base[3:9, 5:],  # a view into a larger storage: DCP saves a copy of just the view
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "float8": torch.ones(3, dtype=torch.float8_e4m3fn),  # a dtype torch saves with its v3 rebuild
    }
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.complex64):
        out[str(dtype)] = (torch.randn(5, 7) * 10).to(dtype)
    return out


def test_every_dtype_and_layout_round_trips_through_the_checked_reader(tmp_path: Path) -> None:
    tensors = _tensors()
    dcp.save({"t": dict(tensors)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    loaded = read_dcp(tmp_path / "dcp")["t"]
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).contiguous().view(torch.uint8)), name  # bit for bit


def _archive(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rezip(archive: bytes, *, replace: bytes | None = None, deflate: bool = False) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            data = replace if replace is not None and info.filename.endswith("data.pkl") else source.read(info.filename)
            kind = zipfile.ZIP_DEFLATED if deflate and "/data/" in info.filename else zipfile.ZIP_STORED
            target.writestr(info.filename, data, compress_type=kind)
    return out.getvalue()


def _check(archive: bytes, *, compressed: bool = False, length: int | None = None) -> None:
    check_archive(io.BytesIO(archive), len(archive) if length is None else length, "item", compressed=compressed)


def test_check_archive_accepts_what_torch_writes_and_bounds_the_rest() -> None:
    for tensor in _tensors().values():
        _check(_archive(tensor))
    plain = _archive(torch.randn(1000))
    # Compressed records: never in a DCP item; in a full file only within MAX_COMPRESSION_RATIO (a zip bomb is far beyond).
    with pytest.raises(CorruptCheckpointError, match="is compressed"):
        _check(_rezip(plain, deflate=True))
    _check(_rezip(plain, deflate=True), compressed=True)
    bomb = _rezip(_archive(torch.zeros(1 << 20)), deflate=True)
    with pytest.raises(CorruptCheckpointError, match="is compressed"):
        _check(bomb, compressed=True)
    assert MAX_COMPRESSION_RATIO < 100
    # A record reaching past the bytes DCP's index gives the item (the directory found in a longer window).
    with pytest.raises(CorruptCheckpointError, match="reaches past the end"):
        _check(plain, length=len(plain) - 4200)
    # The legacy constructor torch's safe loader allows, which allocates what it declares: refused, whichever opcode names it.
    for pickle_bytes in (b"\x80\x02ctorch\nTensor\nK\x04J\x00\x00\x00@\x86R.", b"\x80\x04\x8c\x05torch\x94\x8c\x06Tensor\x94\x93K\x04\x85R."):
        with pytest.raises(UnsafeCheckpointError, match="torch.Tensor"):
            _check(_rezip(plain, replace=pickle_bytes))
    # Every other constructor that reserves a declared size, in a DCP item's fast path and in a full file's walk alike.
    small = _archive(torch.ones(4))
    for name, pickle_bytes in SIZED_PICKLES.items():
        crafted = _rezip(small, replace=pickle_bytes)
        for whole in (crafted, None):
            with pytest.raises(UnsafeCheckpointError, match="reserves whatever size"):
                check_archive(io.BytesIO(crafted), len(crafted), name, whole=whole)
    with pytest.raises(CorruptCheckpointError, match="not a readable torch.save archive"):
        _check(plain[: len(plain) // 2])


def test_what_torch_writes_with_the_constructors_named_is_not_refused() -> None:
    """The constructors are refused only when called with a size: torch.save names ``torch.Tensor`` as a type (a tensor
    with Python attributes), ``torch.UntypedStorage`` as a storage type, calls ``bytearray`` on a string, and rebuilds a
    quantized tensor with ``_rebuild_qtensor`` over a storage holding its values; each is checked, then loads."""
    import warnings

    with_attribute = torch.arange(3.0)
    with_attribute.note = "kept"  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates its quantized dtypes
        values = [
            with_attribute,
            torch.UntypedStorage(8),
            bytearray(b"any bytes"),
            torch.quantize_per_tensor(torch.rand(8, 4), 0.1, 3, torch.quint8),
            torch.quantize_per_tensor(torch.rand(9), 0.1, 3, torch.quint4x2),
            torch.quantize_per_channel(torch.rand(4, 3), torch.rand(4) + 0.1, torch.zeros(4, dtype=torch.long), 0, torch.qint8),
        ]
        for value in values:
            archive = _archive(value)
            assert any(token in archive for token in SIZED_TOKENS), type(value)  # the walk runs, not the fast path
            for whole in (archive, None):
                check_archive(io.BytesIO(archive), len(archive), "item", whole=whole)
            loaded = torch.load(io.BytesIO(archive), weights_only=True)
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded.int_repr() if value.is_quantized else loaded, value.int_repr() if value.is_quantized else value)
            else:
                assert bytes(loaded) == bytes(value)  # a storage comes back typed (uint8): the same bytes
    assert torch.load(io.BytesIO(_archive(with_attribute)), weights_only=True).note == "kept"
