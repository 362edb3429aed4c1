"""Reading the pickled parts of a checkpoint without running code from them, unless asked.

A pickle can name any importable callable and have the reader call it (``os.system``, through an
object's ``__reduce__``), so unpickling a file runs whatever its writer chose. torch's answer is
``torch.load(weights_only=True)``, its default since 2.6: only tensors, primitive containers and
the types registered with ``torch.serialization.add_safe_globals`` are rebuilt; anything else is
refused. Lightning passes ``weights_only=None`` through to it, so a plain Lightning resume is safe.

A checkpoint has four kinds of pickles, and this module reads each of them safely by default:

* ``torch.save`` files (a full checkpoint, ``meta.pt``): :func:`torch_load`, torch's safe loader.
* DCP's index ``.metadata``, which torch's ``FileSystemReader`` reads with a bare ``pickle.load``:
  :class:`SafeReader` rebuilds only DCP's own metadata classes (an allowlist of the types a
  torch DCP save writes), and refuses a storage entry that names a file outside the directory.
* DCP's non-tensor entries (optimizer ``param_groups`` values, other plain values), which torch's
  ``DefaultLoadPlanner`` reads with ``torch.load(weights_only=False)``: :class:`SafeLoadPlanner`
  reads them with torch's safe loader.
* DCP's tensor items (one ``torch.save`` archive per tensor, inside the shard files), which torch
  reads with ``torch.load(weights_only=True)``: :func:`read_plain_tensor` decodes the plain ones
  itself (a stricter allowlist: torch's tensor rebuild, the storage classes, ``OrderedDict``; every
  size, stride and offset checked against the storage), about 7x faster; anything else goes to
  ``torch.load(weights_only=True)`` as in torch.

``weights_only=None`` means torch's default: safe, unless the environment sets torch's documented
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` (and ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces safe loading
even where ``False`` was passed). ``weights_only=False`` unpickles anything: only for files you trust.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Optional, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from hp_lightning.checkpoint import integrity, layout
from hp_lightning.checkpoint.integrity import FileWindow, ReadCheck
from hp_lightning.checkpoint.layout import DCP_METADATA_FILE, CorruptCheckpointError, UnsafeCheckpointError
from hp_lightning.core import devices

#: How to opt out of safe loading, for a file you trust (named in every refusal).
OPT_IN = (
    "weights_only=False (trainer.fit(..., weights_only=False), fabric.load(..., weights_only=False), "
    "hp_lightning.checkpoint.load_weights / load_checkpoint / read_full_file(..., weights_only=False), "
    "`python -m hp_lightning.checkpoint consolidate|shard --trust-pickle`)"
)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: Optional[bool]) -> bool:
    """Whether to unpickle safely: ``None`` is torch's default (True), with torch's two environment overrides.

    Raises:
        TypeError: for anything but None, True or False (a typo such as ``"False"`` must not decide this).
    """
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"weights_only expects None (safe, torch's default), True or False; got {weights_only!r}.")
    if _env_flag("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if weights_only is None:
        return not _env_flag("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    return weights_only


def refusal(where: str, refused: list[str], *, entry: Optional[str] = None) -> UnsafeCheckpointError:
    """The error for a pickle that safe loading will not rebuild: the file, the types, the opt-in."""
    what = f"entry {entry!r} of {where}" if entry else where
    types = ", ".join(refused[:6]) + (f" and {len(refused) - 6} more" if len(refused) > 6 else "") if refused else "a type it does not allow"
    return UnsafeCheckpointError(
        f"Refused to unpickle {what}: it needs {types}, which safe loading does not rebuild, because "
        f"unpickling it could run code stored in the file. If you trust this file (you or a colleague "
        f"wrote it), load it with {OPT_IN}. If the type is your own plain-data class, allow it once with "
        f"torch.serialization.add_safe_globals([...]) instead. To share weights with others, prefer "
        f".safetensors, which holds no code."
    )


def _refused_globals(source: Union[Path, IO[bytes]], message: str) -> list[str]:
    """The globals torch's safe loader would refuse in ``source`` (read without running them)."""
    try:
        if not isinstance(source, Path):
            source.seek(0)
        found = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # noqa: BLE001 - only for the message; fall back to torch's own words
        found = []
    return found or re.findall(r"GLOBAL ([\w.]+)", message)


def _is_weights_only_failure(exc: BaseException) -> bool:
    return isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc)


def _weights_only_failure(source: Union[Path, IO[bytes]], exc: BaseException, where: str, entry: Optional[str] = None) -> ValueError:
    """A refusal when safe loading met a global it does not allow; else the bytes do not parse (damaged).

    torch reports both as the same ``UnpicklingError``; only the first is a question of trust, so
    only the first names the opt-in (suggesting ``weights_only=False`` for junk would be wrong).
    """
    message = str(exc)
    refused = _refused_globals(source, message)
    if refused or "GLOBAL" in message:
        return refusal(where, refused, entry=entry)
    reason = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", message, re.S)
    what = f"entry {entry!r} of {where}" if entry else where
    return (CorruptCheckpointError if entry else ValueError)(
        f"Could not read checkpoint {what}: its pickle does not parse ({reason.group(1) if reason else message}); "
        f"it is damaged or not a torch checkpoint."
    )


def torch_load(path: Path, *, weights_only: Optional[bool]) -> Any:
    """``torch.load`` a checkpoint file onto the CPU (memory-mapped where the format allows), safely by default.

    Raises:
        UnsafeCheckpointError: safe loading refused a type (naming the file, the type and the opt-in).
        ValueError: the file cannot be unpickled at all (damaged, not a checkpoint).
    """
    safe = resolve_weights_only(weights_only)
    try:
        try:
            return torch.load(path, map_location=devices.cpu_device(), mmap=True, weights_only=safe)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
        return torch.load(path, map_location=devices.cpu_device(), weights_only=safe)  # legacy (non-zip) format
    except Exception as exc:  # noqa: BLE001 - unpickling damaged bytes can raise almost anything
        if _is_weights_only_failure(exc):
            raise _weights_only_failure(Path(path), exc, repr(str(path))) from None
        raise ValueError(f"Could not read checkpoint {str(path)!r}: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------- DCP's index


def _dcp_metadata_globals() -> frozenset[tuple[str, str]]:
    """The globals a torch DCP ``.metadata`` pickle names: DCP's metadata dataclasses and their field types."""
    module = dcp_metadata.__name__
    names = {
        (module, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(dcp_metadata, name)
    }
    names |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")}
    names |= {("collections", "OrderedDict")}
    names |= {("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")}
    names |= {("torch", name) for name, value in vars(torch).items() if isinstance(value, (torch.dtype, torch.memory_format, torch.layout))}
    return frozenset(names)


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds only DCP's metadata types: every other global is refused before it can be called."""

    allowed = _dcp_metadata_globals()

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return super().find_class(module, name)
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a DCP index")


def read_dcp_metadata(path: Path, *, weights_only: Optional[bool] = None, rank: Optional[int] = None) -> dcp_metadata.Metadata:
    """DCP's index of the checkpoint directory ``path``, unpickled safely by default and checked to stay inside it.

    Raises:
        UnsafeCheckpointError: the index names a type outside DCP's own, or a storage file outside ``path``.
        CorruptCheckpointError: it cannot be read or is not DCP metadata.
    """
    path = Path(path)
    name = DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}"
    where = path / name
    layout.check_contained(path, [name], what="its DCP index")
    try:
        with open(where, "rb") as f:
            if resolve_weights_only(weights_only):
                unpickler = _MetadataUnpickler(f)
                try:
                    metadata = unpickler.load()
                except pickle.UnpicklingError:
                    if unpickler.refused:
                        raise refusal(repr(str(where)), unpickler.refused) from None
                    raise
            else:
                metadata = pickle.load(f)  # noqa: S301 - trusted by the caller's explicit weights_only=False
    except (UnsafeCheckpointError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise CorruptCheckpointError(f"{str(where)!r} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged.") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{str(where)!r} does not hold DCP metadata (got {type(metadata).__name__}); the checkpoint is damaged.")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    files = sorted({str(getattr(info, "relative_path", "")) for info in storage.values()})
    layout.check_contained(path, files, what=f"its DCP index {str(where)!r}")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


# ---------------------------------------------------------------- DCP's tensor items, fast

#: The typed-storage classes a ``torch.save`` pickle of a plain tensor names, and the dtype each stands for.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "BoolStorage": torch.bool,
    "ByteStorage": torch.uint8,
    "CharStorage": torch.int8,
    "ShortStorage": torch.int16,
    "IntStorage": torch.int32,
    "LongStorage": torch.int64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _NotPlain(Exception):
    """The archive is not the plain one-tensor ``torch.save`` this reader decodes: ``torch.load`` reads it."""


class _StorageClass:
    """What ``find_class`` hands the pickle for ``torch.<X>Storage``: only its dtype (it cannot be called)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _LoadedStorage:
    """A storage this reader filled from the archive's record (a pickle cannot make one: no global names it)."""

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.storage, self.dtype = storage, dtype


def _rebuild_plain_tensor(
    loaded: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any, metadata: Any = None
) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v2`` for a plain CPU tensor, with every argument checked (bounds included:
    ``Tensor.set_`` does not check that the view fits its storage; it grows a resizable one)."""
    if not isinstance(loaded, _LoadedStorage) or backward_hooks or metadata or not isinstance(requires_grad, bool):
        raise _NotPlain("not a plain tensor")
    ints = (storage_offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else None
    if ints is None or len(size) != len(stride) or not all(type(v) is int and v >= 0 for v in ints):
        raise _NotPlain("sizes, strides and offset must be non-negative integers")
    if not _fits(storage_offset, size, stride, loaded.dtype, loaded.storage.nbytes()):
        raise _NotPlain("the view reaches past its storage")
    return torch.empty(0, dtype=loaded.dtype).set_(loaded.storage, storage_offset, size, stride)


class _TensorItemUnpickler(pickle.Unpickler):
    """``data.pkl`` of a one-tensor ``torch.save`` archive, read by Python's C unpickler.

    Allowed globals: torch's tensor rebuild (replaced by :func:`_rebuild_plain_tensor`), the
    plain-dtype storage classes (as their dtype) and ``OrderedDict``; storages come only from the
    archive's own records. Anything else raises :class:`_NotPlain`, and ``torch.load`` with its
    safe loader reads the archive instead (and refuses what it refuses).
    """

    def __init__(self, file: IO[bytes], read_storage: Any) -> None:
        super().__init__(file)
        self._read_storage = read_storage

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_plain_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageClass(_STORAGE_DTYPES[name])
        raise _NotPlain(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageClass)):
            raise _NotPlain("not a storage reference")
        _, kind, key, _, numel = pid
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise _NotPlain("bad storage reference")
        return _LoadedStorage(self._read_storage(key, kind.dtype, numel), kind.dtype)


def _wanted_record(name: str) -> bool:
    return name.endswith(("/data.pkl", "/byteorder")) or "/data/" in name


def read_plain_tensor(fd: int, offset: int, length: int) -> Optional[torch.Tensor]:
    """The tensor of the one-tensor ``torch.save`` archive at ``[offset, offset + length)`` of ``fd`` (a DCP
    item), or None when it is anything else (``torch.load`` then reads it, as DCP does).

    About 7x faster than ``torch.load`` per archive (~30 us against ~220 us), which is most of a
    resume's time for DCP's many small archives: the zip's directory is read with a few small
    reads, ``data.pkl`` with Python's C unpickler restricted to what a plain tensor needs, and the
    data record straight into a new storage (one read, no intermediate copy). Little-endian,
    stored (uncompressed) records only. What the pickle leaves must be a plain tensor viewing, inside
    its bounds, one of the storages read from the archive (checked after unpickling too: the
    pickle's BUILD opcode can change a tensor after it is rebuilt).
    """
    try:
        records = integrity.archive_records(fd, offset, length, wanted=_wanted_record)
        if records is None:
            return None
        pickles = [name for name in records if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            return None
        prefix = pickles[0][: -len("data.pkl")]
        order = records.get(prefix + "byteorder")
        if order is None or sys.byteorder != "little" or os.pread(fd, order[1], order[0]) != b"little":
            return None
        read: dict[str, tuple[torch.UntypedStorage, torch.dtype, int]] = {}

        def read_storage(key: str, dtype: torch.dtype, numel: int) -> torch.UntypedStorage:
            if key in read:
                storage, first_dtype, first_numel = read[key]
                if (first_dtype, first_numel) != (dtype, numel):
                    raise _NotPlain("one storage named with two dtypes or sizes")
                return storage
            record = records.get(f"{prefix}data/{key}")
            nbytes = numel * _itemsize(dtype)
            if record is None or record[1] != nbytes:
                raise _NotPlain("storage record missing or of the wrong size")
            # A storage over a bytearray cannot be resized: a pickle's BUILD (Tensor.__setstate__) cannot grow it.
            buffer = bytearray(nbytes)
            if nbytes and os.preadv(fd, [buffer], record[0]) != nbytes:
                raise _NotPlain("short read")
            storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage() if nbytes else torch.UntypedStorage(0)
            read[key] = (storage, dtype, numel)
            return storage

        start, size, _ = records[pickles[0]]
        tensor = _TensorItemUnpickler(io.BytesIO(os.pread(fd, size, start)), read_storage).load()
    except (_NotPlain, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, OverflowError, RuntimeError, OSError):
        return None
    # What the pickle made of it afterwards (its BUILD opcode runs Tensor.__setstate__, which can re-point,
    # resize or mark the tensor) must still be a plain view inside one of the storages read here.
    if type(tensor) is not torch.Tensor or tensor.requires_grad or tensor._backward_hooks is not None:
        return None
    mine = [entry for entry in read.values() if entry[0].data_ptr() == tensor.untyped_storage().data_ptr()]
    if len(mine) != 1 or tensor.dtype != mine[0][1] or tensor.untyped_storage().nbytes() != mine[0][0].nbytes():
        return None
    if not _fits(int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, mine[0][0].nbytes()):
        return None
    return tensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fits(storage_offset: int, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> bool:
    """Whether a view (offset, sizes, strides, in elements) lies inside a storage of ``nbytes``."""
    if storage_offset < 0 or any(n < 0 for n in size) or any(st < 0 for st in stride):
        return False
    if not all(size):
        return True  # an empty view reads nothing
    end = storage_offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1
    return end * _itemsize(dtype) <= nbytes


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose index is read by :func:`read_dcp_metadata` (safe, contained).

    Given a :class:`~hp_lightning.checkpoint.integrity.ReadCheck` (a resume of an hp_lightning
    sharded checkpoint), each tensor is checked against the manifest's CRC-32s between DCP's
    ``torch.load`` of its item and the copy into the model: the bytes are verified as they are
    read, in the same pass. Otherwise torch's reading, unchanged.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        weights_only: Optional[bool] = None,
        check: Optional[ReadCheck] = None,
        metadata: Optional[dcp_metadata.Metadata] = None,
    ) -> None:
        super().__init__(path)
        self.weights_only = weights_only
        self.check = check
        self._metadata = metadata  # the index already read (safely) by the caller: not unpickled twice

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        check = self.check
        if check is None:
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        root = Path(self.path)
        for name, items in per_file.items():
            if name not in check.recorded:  # the manifest vouches for every file a save wrote
                self._refuse(f"{str(root / name)!r} is read by DCP's index but not recorded in the manifest (added after the save)")
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)  # one forward sweep through the file
            with open(root / name, "rb") as stream:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    view = self.transforms.transform_load_stream(item, info.transform_descriptors or (), cast(IO[bytes], FileWindow(stream, info.offset, info.length)))
                    if item.type == LoadItemType.BYTE_IO:
                        data = io.BytesIO(view.read(-1))
                        self._refuse(check.problem(name, info.offset, info.length, None))
                        planner.load_bytes(item, data)
                        continue
                    entry = f"Entry {item.dest_index.fqn!r} of {str(root)!r} (in {name!r})"
                    loaded = None if info.transform_descriptors else read_plain_tensor(stream.fileno(), info.offset, info.length)
                    if loaded is None:  # anything but a plain tensor archive: torch's own (safe) reading
                        source = view if view.seekable() else io.BytesIO(view.read(-1))
                        try:
                            loaded = torch.load(source, map_location=devices.CPU, weights_only=True)
                        except Exception as exc:  # noqa: BLE001 - named: a refusal, or damaged bytes
                            self._refuse(check.problem(name, info.offset, info.length, None))  # a CRC mismatch names the bytes
                            if _is_weights_only_failure(exc):
                                raise _weights_only_failure(source, exc, repr(str(root)), entry=item.dest_index.fqn) from None
                            raise CorruptCheckpointError(f"{entry} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged.") from None
                    self._refuse(check.problem(name, info.offset, info.length, loaded))
                    try:
                        for dim, (start, size) in enumerate(zip(item.storage_offsets, item.lengths)):
                            if start != 0 or size != loaded.size(dim):
                                loaded = loaded.narrow(dim, start, size)
                    except (RuntimeError, IndexError) as exc:
                        raise CorruptCheckpointError(
                            f"{entry}: DCP's index places a chunk outside the stored tensor of shape {tuple(loaded.size())} ({exc}); "
                            f"the checkpoint is damaged."
                        ) from None
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != loaded.size():
                        raise CorruptCheckpointError(
                            f"{entry}: the checkpoint holds shape {tuple(loaded.size())} where this model's state has "
                            f"{tuple(target.size())}; the checkpoint is damaged."
                        )
                    target.copy_(loaded)
                    planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _refuse(self, problem: Optional[str]) -> None:
        if problem is not None:
            raise CorruptCheckpointError(layout.corruption_message([problem], Path(self.path)))

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is not None and kwargs.get("rank") is None:
            metadata = self._metadata
        else:
            metadata = read_dcp_metadata(Path(self.path), weights_only=self.weights_only, rank=kwargs.get("rank"))
        assert metadata.storage_meta is not None  # read_dcp_metadata always fills it in
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` reading DCP's non-tensor entries with torch's safe loader by default."""

    def __init__(self, source: Path, *, weights_only: Optional[bool] = None, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.source = Path(source)
        self.safe = resolve_weights_only(weights_only)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=self.safe)
        except Exception as exc:  # noqa: BLE001 - named: entry and directory
            if _is_weights_only_failure(exc):
                raise _weights_only_failure(value, exc, repr(str(self.source)), entry=fqn) from None
            raise CorruptCheckpointError(
                f"Entry {fqn!r} of {str(self.source)!r} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged."
            ) from None
        if self.flatten_state_dict:
            _put(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _put(root: Any, route: Sequence[Any], value: Any) -> None:
    """Set ``value`` at ``route`` (keys and list positions) inside ``root``, making the containers it lacks."""
    node = root
    for key, following in zip(route[:-1], route[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
        else:
            node.setdefault(key, empty)
        node = node[key]
    last = route[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def dcp_load(
    state: dict[str, Any],
    path: Path,
    *,
    weights_only: Optional[bool],
    no_dist: bool,
    allow_partial_load: bool = False,
    check: Optional[ReadCheck] = None,
    metadata: Optional[dcp_metadata.Metadata] = None,
) -> None:
    """``dcp.load(state, ...)`` from directory ``path`` with :class:`SafeReader` and :class:`SafeLoadPlanner`.

    DCP gathers every rank's failure and raises the same ``CheckpointException`` everywhere; a
    refusal inside it comes back out as the :class:`UnsafeCheckpointError` it was, on every rank.

    Args:
        check: verify each tensor against the manifest's CRC-32s as it is read (:class:`SafeReader`).
        metadata: DCP's index, when the caller already read it with :func:`read_dcp_metadata`.

    Raises:
        UnsafeCheckpointError: a non-tensor entry or the index needs more than safe loading allows.
        CorruptCheckpointError: with ``check``, a tensor's bytes differ from those recorded at save.
    """
    reader = SafeReader(str(path), weights_only=weights_only, check=check, metadata=metadata)
    planner = SafeLoadPlanner(path, weights_only=weights_only, allow_partial_load=allow_partial_load)
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader, planner=planner, no_dist=no_dist)
    except dcp.CheckpointException as exc:
        for _, failure in sorted(exc.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, (UnsafeCheckpointError, CorruptCheckpointError)):
                raise type(cause)(str(cause)) from None
        raise
