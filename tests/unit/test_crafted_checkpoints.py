"""Checkpoints built to mislead the readers: each is refused clearly (or decoded right), within seconds and bounded memory.

Real checkpoints of a small model are written in this process (``save_checkpoint``, ``dcp.save``,
``torch.save``), then edited as an attacker would; where the manifest's CRC-32s would catch the
edit they are signed again, so what is tested is the readers themselves. Every entry point:
``load_checkpoint``, ``load_weights``, ``load_from_checkpoint``, ``read_full_file``, ``read_sharded``
/ ``read_dcp`` and the converter CLI; every layout: hp_lightning's sharded directory, Lightning's,
plain DCP and full files. The memory cases run in one child process under ``RLIMIT_AS``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from hp_lightning.checkpoint import CorruptCheckpointError, UnsafeCheckpointError, layout, load_checkpoint, load_weights, read_full_file, save_checkpoint
from hp_lightning.checkpoint.__main__ import main as cli
from hp_lightning.checkpoint.integrity import file_record
from hp_lightning.checkpoint.layout import DCP_METADATA_FILE, MANIFEST_FILE
from hp_lightning.checkpoint.read import read_dcp, read_sharded

WEIGHTS = {"weight": torch.arange(16.0).reshape(4, 4), "bias": torch.arange(4.0) - 2}


def _archive(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rezip(archive: bytes, *, replace: dict[str, bytes] | None = None, deflate: str = "") -> bytes:
    """The archive with records (by name suffix) replaced, or one deflate-compressed; the rest as torch wrote it."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            data = source.read(info.filename)
            for suffix, new in (replace or {}).items():
                if info.filename.endswith(suffix):
                    data = new
            kind = zipfile.ZIP_DEFLATED if deflate and info.filename.endswith(deflate) else zipfile.ZIP_STORED
            target.writestr(info.filename, data, compress_type=kind)
    return out.getvalue()


#: A pickle calling the legacy constructor ``torch.Tensor(4, 2**30)`` (16 GiB), which torch's safe loader allows.
HUGE_CONSTRUCTOR = b"\x80\x02ctorch\nTensor\nK\x04J\x00\x00\x00@\x86R."
#: The same call with the name escaped (``STACK_GLOBAL`` of unicode-escaped strings: no literal ``Tensor`` in the
#: bytes). Python's unpickler builds the 16 GiB tensor; torch's safe loader has no such opcodes and refuses it.
ESCAPED_CONSTRUCTOR = b"\x80\x04Vtorch\nV\\u0054ensor\n\x93K\x04J\x00\x00\x00@\x86R."


def _zip_bomb() -> bytes:
    """A one-tensor archive whose data record is 64 MiB of zeros deflated to about 64 KiB."""
    big = _archive(torch.zeros(16 << 20))
    return _rezip(big, deflate="data/0")


def _sharded(tmp_path: Path, name: str = "ckpt") -> Path:
    path = tmp_path / name
    save_checkpoint({"state_dict": dict(WEIGHTS), "global_step": 1, "pytorch-lightning_version": "2.6.6"}, path, sharded=True)
    return path


def _lightning(tmp_path: Path, name: str = "lightning") -> Path:
    """Lightning's ModelParallelStrategy layout: DCP's files and a meta.pt, no manifest."""
    path = tmp_path / name
    dcp.save({"state_dict": dict(WEIGHTS)}, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 1, "pytorch-lightning_version": "2.6.6"}, path / "meta.pt")
    return path


def _resign(root: Path) -> None:
    if (root / MANIFEST_FILE).exists():
        manifest = json.loads((root / MANIFEST_FILE).read_text())
        manifest["files"] = {name: file_record(root / name, checksum=False) for name in manifest["files"]}
        (root / MANIFEST_FILE).write_text(json.dumps(manifest))


def _edit_index(root: Path, edit: Callable[[Any], None]) -> None:
    with open(root / DCP_METADATA_FILE, "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - our own test file
    edit(metadata)
    with open(root / DCP_METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    _resign(root)


def _replace_item(root: Path, leaf: str, data: bytes) -> None:
    """Append ``data`` to the entry's shard file and point DCP's index at it (the manifest signed again)."""
    def edit(metadata: Any) -> None:
        key = next(k for k in metadata.storage_data if k.fqn.endswith(leaf))
        info = metadata.storage_data[key]
        shard = root / info.relative_path
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(data)
        metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(data))

    _edit_index(root, edit)


def _entry(metadata: Any, leaf: str) -> Any:
    return next(v for k, v in metadata.state_dict_metadata.items() if k.endswith(leaf))


def _load_into_model(path: Path) -> nn.Linear:
    model = nn.Linear(4, 4)
    load_checkpoint(path, model, [])
    return model


def _cli_consolidate(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli(["consolidate", str(path), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


# ---------------------------------------------------------------- the tensor read is the tensor the index promised

ITEM_CASES = {
    "8x8 float32 for a 4x4 slot": (lambda: _archive(torch.ones(8, 8)), CorruptCheckpointError, "is not the (4, 4)"),
    "float64 1e300 for float32": (lambda: _archive(torch.full((4, 4), 1e300, dtype=torch.float64)), CorruptCheckpointError, "torch.float64 tensor where"),
    "int64 for float32": (lambda: _archive(torch.ones(4, 4, dtype=torch.int64)), CorruptCheckpointError, "torch.int64 tensor where"),
    "transposed view over too much": (lambda: _archive(torch.ones(4, 8)[:, :4]), CorruptCheckpointError, "is not the (4, 4)"),
    "compressed record (zip bomb)": (_zip_bomb, CorruptCheckpointError, "is compressed"),
    "legacy constructor torch.Tensor(4, 2**30)": (lambda: _rezip(_archive(torch.ones(4, 4)), replace={"data.pkl": HUGE_CONSTRUCTOR}), UnsafeCheckpointError, "torch.Tensor"),
    "legacy constructor, its name escaped": (lambda: _rezip(_archive(torch.ones(4, 4)), replace={"data.pkl": ESCAPED_CONSTRUCTOR}), CorruptCheckpointError, "UnpicklingError"),
    "4x4x1 for a 4x4 slot (DCP's AssertionError)": (lambda: _archive(torch.ones(4, 4, 1)), CorruptCheckpointError, "cannot be read: AssertionError"),
    "record cut short": (lambda: _rezip(_archive(torch.ones(4, 4)), replace={"data/0": b"\0" * 16}), CorruptCheckpointError, "cannot be read"),
    "not an archive": (lambda: b"PK\x03\x04" + b"\0" * 200, CorruptCheckpointError, "not a readable torch.save archive"),
}


@pytest.mark.parametrize("case", list(ITEM_CASES))
def test_a_crafted_tensor_item_is_refused_on_every_entry_point(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    make, error, fragment = ITEM_CASES[case]
    data = make()
    hp, lightning = _sharded(tmp_path), _lightning(tmp_path)
    for root in (hp, lightning):
        _replace_item(root, "weight", data)
        with pytest.raises(error, match=re.escape(fragment)) as info:
            _load_into_model(root)
        assert "weight" in str(info.value) and str(root) in str(info.value)
        with pytest.raises(error, match=re.escape(fragment)):
            read_sharded(root)
        with pytest.raises(error, match=re.escape(fragment)):
            read_dcp(root)  # plain DCP, read whole
    model = nn.Linear(4, 4)
    with pytest.raises(error, match=re.escape(fragment)):
        load_weights(model, hp)
    assert fragment in _cli_consolidate(hp, tmp_path / "out.ckpt", capsys)


def test_an_honest_checkpoint_of_every_layout_still_loads_exactly(tmp_path: Path) -> None:
    for root in (_sharded(tmp_path), _lightning(tmp_path)):
        model = _load_into_model(root)
        assert torch.equal(model.weight.detach(), WEIGHTS["weight"]) and torch.equal(model.bias.detach(), WEIGHTS["bias"])
        assert torch.equal(read_dcp(root)["state_dict"]["weight"], WEIGHTS["weight"])



class _Python311EarlyPickler(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.4 do, ``getattr(EnumClass, "NAME")``; ``_GETATTR_PATH``
    as the same call on a class that is not an enum (what a crafted index could ask for)."""

    def reducer_override(self, obj: Any) -> Any:
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if obj is _GETATTR_PATH:
            return getattr, (Path, "home")
        return NotImplemented


_GETATTR_PATH = object()


def _repickle_index(root: Path, edit: Callable[[Any], None] = lambda metadata: None) -> None:
    with open(root / DCP_METADATA_FILE, "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - our own test file
    edit(metadata)
    with open(root / DCP_METADATA_FILE, "wb") as f:
        _Python311EarlyPickler(f).dump(metadata)
    _resign(root)


def test_an_index_written_by_python_3_11_early_loads_and_getattr_reaches_only_dcps_enums(tmp_path: Path) -> None:
    # DCP's index holds an enum (the tensors' memory format); Python 3.11.0-3.11.4 pickle it through builtins.getattr.
    for root in (_sharded(tmp_path), _lightning(tmp_path)):
        _repickle_index(root)
        assert b"getattr" in (root / DCP_METADATA_FILE).read_bytes()
        model = _load_into_model(root)
        assert torch.equal(model.weight.detach(), WEIGHTS["weight"]) and torch.equal(model.bias.detach(), WEIGHTS["bias"])
        assert torch.equal(read_dcp(root)["state_dict"]["weight"], WEIGHTS["weight"])
    # getattr on anything but a member of DCP's own enums is refused as unsafe, before it is called.
    crafted = _sharded(tmp_path, "crafted")
    _repickle_index(crafted, lambda metadata: setattr(metadata, "planner_data", _GETATTR_PATH))
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.getattr\(pathlib\.Path, 'home'\)"):
        _load_into_model(crafted)

# ---------------------------------------------------------------- DCP's index: no instruction may touch a class

_META = b"torch.distributed.checkpoint.metadata"
#: Crafted ``.metadata`` pickles: (bytes, what the refusal names). The first is the 54-byte attack that rewrote
#: pathlib for the whole process: ``GLOBAL pathlib.PurePath; BUILD (None, {"_str": "/attacker/path"})``.
CLASS_INDEX_CASES = {
    "BUILD on a class (pathlib)": (b"\x80\x02cpathlib\nPurePath\nN}X\x04\x00\x00\x00_strX\x0e\x00\x00\x00/attacker/paths\x86b.", "BUILD on pathlib.PurePath"),
    "BUILD on one of DCP's classes": (
        b"\x80\x02c" + _META + b"\nMetadata\nN}X\x0f\x00\x00\x00hp_test_plantedK\x01s\x86b.", "BUILD on torch.distributed.checkpoint.metadata.Metadata"),
    "STACK_GLOBAL of strings from the memo, then BUILD": (
        b"\x80\x04\x8c\x07pathlib\x94\x8c\x08PurePath\x94" b"00" b"h\x00h\x01\x93N}\x8c\x04_str\x8c\x0e/attacker/paths\x86b.", "BUILD on pathlib.PurePath"),
    "slot state set on a DCP object": (
        b"\x80\x02c" + _META + b"\nMetadataIndex\n)\x81N}X\x09\x00\x00\x00__class__cpathlib\nPurePath\ns\x86b.", "only a dict of its fields"),
    "NEWOBJ of a callable only REDUCE may call": (b"\x80\x02cpathlib\nPosixPath\n)\x81.", "NEWOBJ of pathlib.PosixPath"),
    "REDUCE of a class only NEWOBJ may make": (b"\x80\x02c" + _META + b"\nMetadata\n)R.", "REDUCE of torch.distributed.checkpoint.metadata.Metadata"),
    "APPEND onto a class": (b"\x80\x02cpathlib\nPurePath\nX\x01\x00\x00\x00aa.", "APPEND on pathlib.PurePath"),
    "INST of an allowed class": (b"(ipathlib\nPurePath\n.", "the INST instruction"),
}


@pytest.fixture
def pathlib_guard() -> Any:
    """The classes a crafted index aims at, restored after the test if it changed them (only the old reader did)."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    kept = dict(vars(PurePath))
    yield
    for name in set(vars(PurePath)) - set(kept):
        delattr(PurePath, name)
    for name, value in kept.items():
        if vars(PurePath).get(name) is not value:
            setattr(PurePath, name, value)
    if "hp_test_planted" in vars(dcp_metadata.Metadata):
        delattr(dcp_metadata.Metadata, "hp_test_planted")


@pytest.mark.parametrize("case", list(CLASS_INDEX_CASES))
def test_an_index_may_call_and_fill_only_dcps_own_objects(tmp_path: Path, case: str, pathlib_guard: Any) -> None:
    from torch.distributed.checkpoint import metadata as dcp_metadata

    from hp_lightning.checkpoint.read import read_dcp_metadata

    data, fragment = CLASS_INDEX_CASES[case]
    hp, lightning = _sharded(tmp_path), _lightning(tmp_path)
    for root in (hp, lightning):
        (root / DCP_METADATA_FILE).write_bytes(data)
        _resign(root)
        for read in (read_dcp_metadata, _load_into_model, read_dcp):
            with pytest.raises(UnsafeCheckpointError, match=re.escape(fragment)) as info:
                read(root)
            assert str(root / DCP_METADATA_FILE) in str(info.value)
    # Refused before any instruction ran: paths and DCP's classes are what they were, in this process.
    assert str(Path("/tmp/x")) == "/tmp/x" and os.fspath(PurePosixPath("a/b")) == "a/b"
    assert str(Path("/tmp/x") / "y") == "/tmp/x/y"
    assert "hp_test_planted" not in vars(dcp_metadata.Metadata)


def test_the_index_allowlist_resolves_every_name_or_says_which_is_missing() -> None:
    from hp_lightning.checkpoint.unpickle import INDEX_CALLS, INDEX_CLASSES, resolve_index_names

    resolved = resolve_index_names([*INDEX_CLASSES, *INDEX_CALLS])
    assert "torch.distributed.checkpoint.filesystem._StorageInfo" in resolved and "torch.serialization._get_layout" in resolved
    renamed = [("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING_RENAMED"), ("torch", "Size")]
    with pytest.raises(ImportError, match=re.escape("_MEM_FORMAT_ENCODING_RENAMED") + f".*torch {re.escape(torch.__version__)} lacks"):
        resolve_index_names(renamed)


# ---------------------------------------------------------------- DCP's index: bounded, covering, inside the files


def _no_chunks(metadata: Any) -> None:
    _entry(metadata, "weight").chunks = []


def _half_chunk(metadata: Any) -> None:
    chunk = _entry(metadata, "weight").chunks[0]
    _entry(metadata, "weight").chunks = [dataclasses.replace(chunk, sizes=torch.Size([2, 4]))]


def _huge(metadata: Any) -> None:
    entry = _entry(metadata, "weight")
    entry.size = torch.Size([1 << 16, 1 << 16])  # 16 GiB of float32
    entry.chunks = [dataclasses.replace(entry.chunks[0], sizes=torch.Size([1 << 16, 1 << 16]))]


def _past_the_end(metadata: Any) -> None:
    key = next(k for k in metadata.storage_data if k.fqn.endswith("weight"))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=10_000_000)


INDEX_CASES = {
    "entry with no chunks": (_no_chunks, "cover 0 of its 16 elements"),
    "entry with half its chunks": (_half_chunk, "cover 8 of its 16 elements"),
    "16 GiB declared": (_huge, "declares 17,179,869,184 bytes"),
    "item past the end of its file": (_past_the_end, "outside the file"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_a_crafted_index_is_refused_before_anything_is_allocated(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    edit, fragment = INDEX_CASES[case]
    hp, lightning = _sharded(tmp_path), _lightning(tmp_path)
    for root in (hp, lightning):
        _edit_index(root, edit)
        for read in (_load_into_model, read_sharded, read_dcp):
            with pytest.raises(CorruptCheckpointError, match=re.escape(fragment)) as info:
                read(root)
            assert "weight" in str(info.value)
    assert fragment in _cli_consolidate(hp, tmp_path / "out.ckpt", capsys)


def test_deep_structures_are_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hp = _sharded(tmp_path)
    manifest = (hp / MANIFEST_FILE).read_text()
    (hp / MANIFEST_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptCheckpointError, match="hp_lightning.json"):
        _load_into_model(hp)
    assert "hp_lightning.json" in _cli_consolidate(hp, tmp_path / "out.ckpt", capsys)
    (hp / MANIFEST_FILE).write_text(manifest)
    nested = b"]" * 200_000 + b"a" * (200_000 - 1)  # a list inside a list ... 200k deep
    deep_pickle = b"\x80\x02}(X\n\x00\x00\x00state_dict}X\x10\x00\x00\x00hyper_parameters" + nested + b"u."
    deep = tmp_path / "deep.ckpt"
    deep.write_bytes(_rezip(_archive({"state_dict": {}}), replace={"data.pkl": deep_pickle}))
    with pytest.raises(CorruptCheckpointError, match="deep.ckpt.*nest"):
        read_full_file(deep)
    (hp / "meta.pt").write_bytes(deep.read_bytes())
    _resign(hp)
    with pytest.raises(CorruptCheckpointError, match="meta.pt.*nest"):
        read_sharded(hp)


# ---------------------------------------------------------------- only regular files


def _with_timeout(fn: Callable[[], Any], seconds: float = 20) -> BaseException | None:
    """Run ``fn`` in a thread; the test fails (instead of hanging) if it has not finished in ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


def test_a_fifo_is_refused_without_blocking_on_every_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hp, lightning = _sharded(tmp_path), _lightning(tmp_path)
    for root in (hp, lightning):
        shard = next(p for p in root.iterdir() if p.suffix == ".distcp")
        shard.unlink()
        os.mkfifo(shard)
        for read in (_load_into_model, read_sharded, read_dcp, lambda r: read_sharded(r, verify_files=False)):
            error = _with_timeout(lambda read=read, root=root: read(root))
            assert isinstance(error, CorruptCheckpointError) and shard.name in str(error), error
        (root / "meta.pt").unlink()
        os.mkfifo(root / "meta.pt")
        error = _with_timeout(lambda root=root: read_sharded(root, verify_files=False))
        assert isinstance(error, (CorruptCheckpointError, ValueError)) and "meta.pt" in str(error), error
    assert _with_timeout(lambda: _cli_consolidate(lightning, tmp_path / "out.ckpt", capsys)) is None
    # DCP's index or the manifest as a FIFO, a shard as a directory (DCP's IsADirectoryError): refused at once, named.
    for name, make in ((DCP_METADATA_FILE, os.mkfifo), (MANIFEST_FILE, os.mkfifo), ("__0_0.distcp", os.mkdir)):
        root = _sharded(tmp_path, f"with-{name.strip('.')}")
        (root / name).unlink()
        make(root / name)
        error = _with_timeout(lambda root=root: _load_into_model(root))
        assert isinstance(error, CorruptCheckpointError) and name in str(error), error
    full = tmp_path / "model.ckpt"
    os.mkfifo(full)
    from lightning.pytorch import LightningModule

    from hp_lightning.checkpoint import load_from_checkpoint

    for read in (read_full_file, lambda p: load_weights(nn.Linear(4, 4), p), lambda p: load_from_checkpoint(LightningModule, p)):
        error = _with_timeout(lambda read=read: read(full))
        assert isinstance(error, ValueError) and "model.ckpt" in str(error), error


# ---------------------------------------------------------------- full files


def _full(tmp_path: Path, archive: bytes) -> Path:
    path = tmp_path / "full.ckpt"
    path.write_bytes(archive)
    return path


def test_full_files_are_read_by_torch_load_without_mmap(tmp_path: Path) -> None:
    honest = _archive({"state_dict": dict(WEIGHTS), "global_step": 3})
    # A record shorter than its tensor: refused (mmap would have read the bytes after it as weights).
    short = _full(tmp_path, _rezip(honest, replace={"data/0": b"\1" * 8}))
    with pytest.raises(CorruptCheckpointError, match="full.ckpt"):
        read_full_file(short)
    with pytest.raises(CorruptCheckpointError, match="full.ckpt"):
        load_weights(nn.Linear(4, 4), short)
    # A deflate-compressed record: decoded to the right values.
    compressed = _full(tmp_path, _rezip(honest, deflate="data/0"))
    model = nn.Linear(4, 4)
    load_weights(model, compressed)
    assert torch.equal(model.weight.detach(), WEIGHTS["weight"]) and torch.equal(model.bias.detach(), WEIGHTS["bias"])
    # A zip bomb and the legacy constructor: refused before torch allocates what they declare.
    with pytest.raises(CorruptCheckpointError, match="is compressed"):
        read_full_file(_full(tmp_path, _zip_bomb()))
    with pytest.raises(UnsafeCheckpointError, match="torch.Tensor"):
        read_full_file(_full(tmp_path, _rezip(honest, replace={"data.pkl": HUGE_CONSTRUCTOR})))
    legacy = tmp_path / "legacy.pt"
    torch.save(dict(WEIGHTS), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptCheckpointError, match="legacy"):
        read_full_file(legacy)
    assert torch.equal(read_full_file(legacy, weights_only=False)["state_dict"]["weight"], WEIGHTS["weight"])


def test_a_pickle_that_does_not_parse_is_damage_and_one_naming_a_callable_is_a_refusal(tmp_path: Path) -> None:
    # torch raises the same UnpicklingError for both; its public get_unsafe_globals_in_checkpoint tells them apart.
    honest = _archive({"state_dict": dict(WEIGHTS)})
    damaged = _full(tmp_path, _rezip(honest, replace={"data.pkl": b"\x80\x02\x82\x01."}))  # EXT1: safe loading cannot parse it, names no global
    with pytest.raises(CorruptCheckpointError, match="does not parse under torch's safe loader") as info:
        read_full_file(damaged, verify=False)
    assert "weights_only=False" not in str(info.value) and "full.ckpt" in str(info.value)
    planted = _full(tmp_path, _rezip(honest, replace={"data.pkl": b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R."}))
    with pytest.raises(UnsafeCheckpointError, match=r"needs os\.system.*weights_only=False"):
        read_full_file(planted, verify=False)


def test_load_from_checkpoint_refuses_a_crafted_directory(tmp_path: Path) -> None:
    from lightning.pytorch import LightningModule

    from hp_lightning.checkpoint import load_from_checkpoint

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 4))
            self.bias = nn.Parameter(torch.zeros(4))

    hp = _sharded(tmp_path)
    assert torch.equal(load_from_checkpoint(Module, hp).weight.detach(), WEIGHTS["weight"])
    _replace_item(hp, "weight", _archive(torch.ones(8, 8)))
    with pytest.raises(CorruptCheckpointError, match="is not the"):
        load_from_checkpoint(Module, hp)


# ---------------------------------------------------------------- we delete only what we wrote


def test_cleanup_never_touches_a_users_lookalike_entries(tmp_path: Path) -> None:
    out = tmp_path / "model.ckpt"
    notes = tmp_path / "model.ckpt.hp-partial-notes"
    mine = tmp_path / "model.hp-prev-mine.ckpt"
    old = tmp_path / "model.ckpt.hp-trash-old"
    unmarked = tmp_path / "model.ckpt.hp-partial-0123456789ab"  # our name shape, but no mark of ours inside
    notes.write_text("my notes")
    mine.write_bytes(_archive(dict(WEIGHTS)))
    old.mkdir()
    (old / "keep.txt").write_text("keep")
    unmarked.mkdir()
    (unmarked / "keep.txt").write_text("keep")
    src = _sharded(tmp_path, "src")
    for _ in range(2):
        assert cli(["consolidate", str(src), str(out), "--overwrite"]) == 0
        for save in (True, False):
            save_checkpoint({"state_dict": dict(WEIGHTS)}, out, sharded=save)
        layout.recover(out)
        layout.clean_stale(out)
    assert notes.read_text() == "my notes" and mine.exists() and (old / "keep.txt").exists() and (unmarked / "keep.txt").exists()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["model.ckpt", notes.name, mine.name, old.name, unmarked.name, "src"]), names


def test_what_a_killed_save_left_is_ours_and_cleaned(tmp_path: Path) -> None:
    out = tmp_path / "model.ckpt"
    staged = layout.new_staging(out)  # what a save killed mid-write leaves
    (staged / "model.ckpt").write_bytes(b"half")
    save_checkpoint({"state_dict": dict(WEIGHTS)}, out, sharded=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


# ---------------------------------------------------------------- memory: one child under RLIMIT_AS

_GIB = b"J\x00\x00\x00@"  # BININT 2**30
#: Pickles calling each constructor torch's safe loader allows that reserves a declared size (1-16 GiB from a few
#: bytes), each refused before it runs. The quantized one reads storage "0" (16 bytes, the record of ``torch.ones(4)``).
SIZED_PICKLES = {
    "torch.Tensor(4, 2**30)": HUGE_CONSTRUCTOR,
    "bytearray(2**30)": b"\x80\x02cbuiltins\nbytearray\n" + _GIB + b"\x85R.",
    "bytearray via __builtin__": b"\x80\x02c__builtin__\nbytearray\n" + _GIB + b"\x85R.",
    "torch.FloatTensor(4, 2**30)": b"\x80\x02ctorch\nFloatTensor\nK\x04" + _GIB + b"\x86R.",
    "torch.Tensor.__new__ (NEWOBJ)": b"\x80\x02ctorch\nTensor\nK\x04" + _GIB + b"\x86\x81.",
    "torch.storage.UntypedStorage(2**30)": b"\x80\x02ctorch.storage\nUntypedStorage\n" + _GIB + b"\x85R.",
    "torch.storage.TypedStorage(2**30)": b"\x80\x02ctorch.storage\nTypedStorage\n" + _GIB + b"\x85R.",
    "_rebuild_from_type_v2 calling torch.FloatTensor": (
        b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(ctorch\nFloatTensor\nctorch\nTensor\nK\x04" + _GIB + b"\x86}tR."
    ),
    "_rebuild_from_type_v2 calling torch.FloatTensor with a list": (
        b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(ctorch\nFloatTensor\nctorch\nTensor\n](K\x04" + _GIB + b"e}tR."
    ),
    "_rebuild_qtensor of shape (2**30, 4) over 16 bytes": (
        b"\x80\x02ctorch._utils\n_rebuild_qtensor\n((X\x07\x00\x00\x00storagectorch\nQUInt8Storage\nX\x01\x00\x00\x000"
        b"X\x03\x00\x00\x00cpuK\x10tQK\x00" + _GIB + b"K\x04\x86K\x04K\x01\x86(ctorch\nper_tensor_affine\n"
        b"G?\xf0\x00\x00\x00\x00\x00\x00K\x00t\x89ccollections\nOrderedDict\n)RtR."
    ),
}

MEMORY_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    import torch
    from torch import nn
    from hp_lightning.checkpoint import load_checkpoint, load_weights, read_full_file
    from hp_lightning.checkpoint.integrity import ReadCheck
    from hp_lightning.checkpoint.read import read_dcp, read_sharded

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    def verify_meta_item(path, name, offset, length):
        records = json.loads((path / "hp_lightning.json").read_text())["files"]
        ReadCheck(path, records).verify_item(name, int(offset), int(length), torch.empty(4, 4, device="meta"))

    readers = {
        "read_dcp": read_dcp,
        "read_sharded": read_sharded,
        "load_checkpoint": lambda path: load_checkpoint(path, nn.Linear(4, 4), []),
        "load_weights": lambda path: load_weights(nn.Linear(4, 4), path),
        "read_full_file": read_full_file,
        "verify_meta_item": verify_meta_item,
    }
    limit = vm_bytes() + (768 << 20)  # what is mapped now, plus 768 MiB: below every allocation tried here (1-16 GiB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    outcomes = {}
    for name, (reader, path, *extra) in json.loads(sys.argv[1]).items():
        try:
            readers[reader](Path(path), *extra)
            outcomes[name] = "loaded"
        except BaseException as exc:
            outcomes[name] = type(exc).__name__ + ": " + str(exc)[:1000]
    print(json.dumps(outcomes))
    """
)


def _meta_item_with_a_crc_range(tmp_path: Path) -> tuple[Path, Any]:
    """A sharded checkpoint whose ``weight`` item is a valid ``torch.save`` of a *meta* tensor (a size, no memory), its
    bytes' CRC-32 recorded as a data range the size of the tensor: what once made the in-place CRC read ``nbytes``
    from address 0 (a SIGSEGV under ISA-L). Returns the directory and the item's index record."""
    import zlib

    hp = _sharded(tmp_path, "meta")
    _replace_item(hp, "weight", _archive(torch.empty(4, 4, device="meta")))
    with open(hp / DCP_METADATA_FILE, "rb") as f:
        info = next(v for k, v in pickle.load(f).storage_data.items() if k.fqn.endswith("weight"))  # noqa: S301 - our own file
    data = (hp / info.relative_path).read_bytes()
    start, size = info.offset, 64  # inside the item, as many bytes as the meta tensor declares: the in-place path
    manifest = json.loads((hp / MANIFEST_FILE).read_text())
    manifest["files"][info.relative_path] = {
        "size": len(data),
        "crc32": f"{zlib.crc32(data[start + size:], zlib.crc32(data[:start])):08x}",
        "crc32_ranges": [[start, size, f"{zlib.crc32(data[start:start + size]):08x}"]],
    }
    (hp / MANIFEST_FILE).write_text(json.dumps(manifest))
    return hp, info


def test_declared_sizes_never_allocate_under_a_memory_limit(tmp_path: Path) -> None:
    """Every declared size, bounded before it is allocated; and a declared size with no memory behind it (the meta
    tensor item) refused before anything reads it. One child process: a crash there fails the test, not the worker."""
    huge = _sharded(tmp_path, "huge")
    _edit_index(huge, _huge)
    bomb = _sharded(tmp_path, "bomb")
    _replace_item(bomb, "weight", _zip_bomb())
    full_bomb = tmp_path / "bomb.ckpt"
    full_bomb.write_bytes(_zip_bomb())
    escaped = _lightning(tmp_path, "escaped")
    _replace_item(escaped, "weight", _rezip(_archive(torch.ones(4, 4)), replace={"data.pkl": ESCAPED_CONSTRUCTOR}))
    meta, info = _meta_item_with_a_crc_range(tmp_path)
    cases: dict[str, tuple[str, ...]] = {
        "index 16 GiB, read_dcp": ("read_dcp", str(huge)),
        "index 16 GiB, read_sharded": ("read_sharded", str(huge)),
        "index 16 GiB, load_checkpoint": ("load_checkpoint", str(huge)),
        "item zip bomb": ("load_checkpoint", str(bomb)),
        "full zip bomb": ("read_full_file", str(full_bomb)),
        "item escaped constructor": ("read_dcp", str(escaped)),
        "meta item, load_weights": ("load_weights", str(meta)),
        "meta item, load_checkpoint": ("load_checkpoint", str(meta)),
        "meta item, ReadCheck": ("verify_meta_item", str(meta), info.relative_path, str(info.offset), str(info.length)),
    }
    expected: dict[str, tuple[str, Any]] = dict.fromkeys(cases, ("CorruptCheckpointError", None))
    for case in ("meta item, load_weights", "meta item, load_checkpoint"):
        expected[case] = ("CorruptCheckpointError", f"Entry 'state_dict.weight' of {str(meta)!r}")
    expected["meta item, ReadCheck"] = ("CorruptCheckpointError", str(meta / info.relative_path))
    for number, (name, pickled) in enumerate(SIZED_PICKLES.items()):
        item = _lightning(tmp_path, f"sized{number}")  # a DCP item: read by DCP's torch.load(weights_only=True)
        _replace_item(item, "weight", _rezip(_archive(torch.ones(4)), replace={"data.pkl": pickled}))
        full = tmp_path / f"sized{number}.ckpt"  # a full file: read by torch.load(weights_only=True)
        full.write_bytes(_rezip(_archive(torch.ones(4)), replace={"data.pkl": pickled}))
        cases[f"item {name}"], cases[f"full {name}"] = ("read_dcp", str(item)), ("read_full_file", str(full))
        expected[f"item {name}"] = ("UnsafeCheckpointError", f"Entry 'state_dict.weight' of {str(item)!r}")
        expected[f"full {name}"] = ("UnsafeCheckpointError", repr(str(full)))
    run = subprocess.run([sys.executable, "-c", MEMORY_CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])  # -11: the meta item crashed the reader
    outcomes = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(outcomes) == set(cases)
    for name, outcome in outcomes.items():
        kind, where = expected[name]
        assert outcome.startswith(kind + ":"), (name, outcome)
        assert "can't allocate" not in outcome and "MemoryError" not in outcome, (name, outcome)
        assert where is None or where in outcome, (name, outcome)
        if kind == "UnsafeCheckpointError":
            assert "its pickle 'archive/data.pkl' calls" in outcome and "weights_only=False" in outcome, (name, outcome)
