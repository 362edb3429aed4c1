"""What reads: every way a checkpoint comes into this process, and DCP's reader and planner that load it.

:mod:`.load`, :mod:`.convert` and the callbacks read through here. Each step calls :mod:`.integrity`
to check what it is about to trust and :mod:`.unpickle` to rebuild a pickle (safely unless asked).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Optional, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.integrity import (
    CorruptCheckpointError,
    FileWindow,
    ReadCheck,
    TensorCheck,
    UnsafeCheckpointError,
    check_archive,
    check_contained,
    check_index,
    corruption_message,
    describe_entry,
    open_regular,
    regular_file_size,
    verify_records,
    verify_zip,
)
from hp_lightning.checkpoint.layout import DCP_METADATA_FILE, FSDP_MODEL_KEY, FULL_INFO_KEY, META_FILE, MODEL_KEY, OPTIMIZER_KEY, CheckpointKind
from hp_lightning.checkpoint.unpickle import index_allowlist, load_entry, resolve_weights_only, torch_load, unpickle_index
from hp_lightning.core import devices
from hp_lightning.core.state_dict import Shape

#: Tensor archives up to this size are read whole before ``torch.load`` parses them (larger ones
#: stream from the file: no second copy of a large shard in memory).
WHOLE_READ_MAX = 1 << 20



# ------------------------------------------------ single files


def read_full_file(
    path: Path, *, weights_only: Optional[bool] = None, verify: bool = True, keys: Optional[layout.StateKeys] = None
) -> dict[str, Any]:
    """Read a single-file checkpoint into a dict on this process (plain ``torch.load``: not memory-mapped).

    Bare state dicts and ``.safetensors`` files come back as ``{"state_dict": ...}``; a Lightning Fabric
    checkpoint (``keys``: its ``state`` keys; ours say so themselves) in the Trainer's layout.
    ``weights_only``: None or True: safe loading; False: unpickle anything, only for files you trust.
    ``verify``: check the zip CRC-32s first.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(directory_message(path, "read_full_file"))
    regular_file_size(path.parent, path.name)  # a FIFO or device is refused before anything opens it
    if path.suffix == ".safetensors":
        return {MODEL_KEY: _read_safetensors(path)}
    if verify and (problem := verify_zip(path)):
        raise CorruptCheckpointError(corruption_message([problem], path))
    checkpoint = torch_load(path, weights_only=weights_only)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint dict or a state dict.")
    if isinstance(checkpoint.get(FULL_INFO_KEY), Mapping):
        layout.check_version(checkpoint[FULL_INFO_KEY], path)
    # A Fabric-layout file: the keys it recorded (ours) or the load's (Lightning's own Fabric).
    fabric = layout.in_trainer_layout(checkpoint, keys if MODEL_KEY not in checkpoint else None)
    if fabric is not None:
        return fabric
    if MODEL_KEY in checkpoint and isinstance(checkpoint[MODEL_KEY], Mapping):
        return checkpoint
    if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return {MODEL_KEY: checkpoint}  # a bare model.state_dict()
    raise ValueError(
        f"{str(path)!r} is neither a Lightning checkpoint (no {MODEL_KEY!r} entry), a Lightning Fabric checkpoint"
        f"{f' (no model under {keys.model!r})' if keys else ''} nor a state dict of tensors; its top-level keys are "
        f"{sorted(map(str, checkpoint))[:8]}."
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file  # safetensors is optional (hp-lightning[safetensors])
    except ImportError:
        raise ValueError(f"Reading {str(path)!r} needs the safetensors package: pip install 'hp-lightning[safetensors]'.") from None
    try:
        return load_file(str(path), device=devices.CPU)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise CorruptCheckpointError(f"{str(path)!r} is not a readable safetensors file ({exc}); it is truncated or damaged.") from None


def directory_message(path: Path, caller: str) -> str:
    """What to do with a sharded checkpoint directory where a single file was expected."""
    return (
        f"{caller} got {str(path)!r}, a sharded checkpoint directory (one shard file per rank), not a single "
        f"file. In one process, load it with the one-line helper "
        f"`hp_lightning.checkpoint.load.load_from_checkpoint(MyModule, {str(path)!r})`, or convert it once: "
        f"`python -m hp_lightning.checkpoint consolidate {str(path)!r} model.ckpt --weights-only`, then "
        f"`MyModule.load_from_checkpoint('model.ckpt')`. (Lightning's own `MyModule.load_from_checkpoint` opens "
        f"the path as a file and fails with IsADirectoryError on a directory.)"
    )


# ------------------------------------------------ DCP directories: the index, and DCP's reader and planner


def read_dcp_metadata(path: Path, *, weights_only: Optional[bool] = None, rank: Optional[int] = None) -> dcp_metadata.Metadata:
    """DCP's index of the checkpoint directory ``path``: unpickled safely by default (:func:`unpickle_index`), checked
    to stay inside ``path`` and every size it declares backed by bytes present (:func:`check_index`)."""
    path = Path(path)
    name = DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}"
    where = path / name
    check_contained(path, [name], what="its DCP index")
    allow = index_allowlist(weights_only)
    try:
        with open_regular(where) as f:
            metadata = unpickle_index(f, where, allow)
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named (a missing file, RecursionError too)
        raise CorruptCheckpointError(f"{str(where)!r} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged.") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{str(where)!r} does not hold DCP metadata (got {type(metadata).__name__}); the checkpoint is damaged.")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    check_contained(path, {getattr(info, "relative_path", None) for info in storage.values()}, what=f"its DCP index {str(where)!r}")
    try:
        check_index(path, metadata, str(path / DCP_METADATA_FILE))
    except (AttributeError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:  # fields of the wrong types
        raise CorruptCheckpointError(f"{str(where)!r} is not valid DCP metadata ({type(exc).__name__}: {exc}); the checkpoint is damaged.") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` reading the index with :func:`read_dcp_metadata`; every file it opens must be regular
    (and, given ``recorded``, in the manifest), and each tensor archive passes :func:`check_archive` as DCP opens it."""

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        weights_only: Optional[bool] = None,
        metadata: Optional[dcp_metadata.Metadata] = None,
        recorded: Optional[frozenset[str]] = None,
    ) -> None:
        super().__init__(path)
        self.weights_only = weights_only
        self.recorded = recorded  # the files a manifest vouches for (hp_lightning's layout); any other is refused
        self.reading = ""  # the tensor item DCP is reading, named in an error torch raises about it
        self._metadata = metadata  # the index already read (safely) by the caller: not unpickled twice
        self.transforms = cast(Any, self)  # DCP calls transform_load_stream (below) on each item it opens

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        root = Path(self.path)
        for name in {self.storage_data[item.storage_index].relative_path for item in plan.items}:  # check_index vouched for the keys
            if self.recorded is not None and name not in self.recorded:
                problem = f"{str(root / name)!r} is read by DCP's index but not recorded in the manifest (added after the save)"
                raise CorruptCheckpointError(corruption_message([problem], root))
            regular_file_size(root, name)  # still a regular file (check_index checked every item's bytes lie inside it)
        return super().read_data(plan, planner)

    def transform_load_stream(self, read_item: ReadItem, transform_descriptors: Sequence[str], raw_stream: IO[bytes]) -> IO[bytes]:
        info = self.storage_data[read_item.storage_index]
        self.reading = describe_entry(self.path, read_item.storage_index.fqn, info.relative_path)
        if transform_descriptors:
            raise CorruptCheckpointError(
                f"{self.reading}: stored through DCP's stream transforms {list(transform_descriptors)}, which decompress "
                f"with no bound on the size they produce; hp_lightning and DCP's defaults write none, so it is refused."
            )
        if read_item.type == LoadItemType.BYTE_IO:
            return raw_stream  # read whole by DCP (its item length bounds it), checked by SafeLoadPlanner.load_bytes
        window = cast(IO[bytes], FileWindow(raw_stream, 0, info.length))  # DCP's view of the item, seeking from its end right
        if info.length <= WHOLE_READ_MAX:
            # A small archive is read in one call and parsed from memory: torch's zip reader and
            # zipfile then seek and read a few dozen times per archive in C, not through Python streams.
            data = window.read(info.length)
            if len(data) != info.length:
                raise CorruptCheckpointError(f"{self.reading}: {len(data):,} of its {info.length:,} bytes are there; it is truncated.")
            window = io.BytesIO(data)
            check_archive(window, info.length, self.reading, whole=data)  # DCP loads it with weights_only=True
        else:
            check_archive(window, info.length, self.reading)
        return window

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is not None and kwargs.get("rank") is None:
            metadata = self._metadata
        else:
            metadata = read_dcp_metadata(Path(self.path), weights_only=self.weights_only, rank=kwargs.get("rank"))
        assert metadata.storage_meta is not None  # read_dcp_metadata always fills it in
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` that unpickles non-tensor entries safely (:func:`load_entry`) and checks
    each tensor before it is copied (:class:`TensorCheck`)."""

    def __init__(self, source: Path, *, weights_only: Optional[bool] = None, allow_partial_load: bool = False, check: Optional[ReadCheck] = None) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.source = Path(source)
        self.safe = resolve_weights_only(weights_only)
        self.check = check
        self.tensors = TensorCheck(self.source, check)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if self.check is not None:
            info = self.metadata.storage_data[read_item.storage_index]  # type: ignore[union-attr]
            self.check.verify_item(info.relative_path, info.offset, info.length, None)
        loaded = load_entry(value, self.source, fqn, safe=self.safe)
        if self.flatten_state_dict:
            put_route(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        plain = super().resolve_tensor(read_item).detach()
        return self.tensors.target(plain, self.metadata, read_item)


def put_route(root: Any, route: Sequence[Any], value: Any) -> None:
    """Set ``value`` at ``route`` (keys and list positions: DCP's routes spell dict keys as strings, so an
    integer is a list position) inside ``root``, making the containers it lacks."""
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

    A refusal inside DCP comes back out as the error it was, on every rank; any other damage DCP or
    torch meets as a :class:`CorruptCheckpointError`. ``check``: verify each tensor against the
    manifest's CRC-32s and read only files it records; ``metadata``: the index, if already read.
    """
    reader = SafeReader(str(path), weights_only=weights_only, metadata=metadata, recorded=check.recorded if check is not None else None)
    planner = SafeLoadPlanner(path, weights_only=weights_only, allow_partial_load=allow_partial_load, check=check)
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader, planner=planner, no_dist=no_dist)
    except (dcp.CheckpointException, RuntimeError, ValueError, IndexError, KeyError, AssertionError, EOFError, OSError, RecursionError, pickle.UnpicklingError) as exc:
        causes = [failure[0] if isinstance(failure, tuple) else failure for _, failure in sorted(getattr(exc, "failures", {}).items())] or [exc]
        ours = [cause for cause in causes if isinstance(cause, (UnsafeCheckpointError, CorruptCheckpointError))]
        if ours:  # a reader's own refusal, on whichever rank: raised as it was, on every rank
            raise type(ours[0])(str(ours[0])) from None
        where = reader.reading or f"Checkpoint {str(path)!r}"
        raise CorruptCheckpointError(f"{where} cannot be read: {type(causes[0]).__name__}: {str(causes[0])[:300]}; it is damaged or was altered.") from None


# ------------------------------------------------ sharded directories whole, in one process


def dcp_index(path: Path, *, weights_only: Optional[bool] = None, metadata: Optional[Metadata] = None) -> dict[tuple[Any, ...], Shape]:
    """Every entry DCP stored, as its nested path (``('state_dict', 'net.w')``) -> global shape (``metadata``: the index, if read)."""
    if metadata is None:
        metadata = read_dcp_metadata(path, weights_only=weights_only)
    planner_data = metadata.planner_data or {}
    index: dict[tuple[Any, ...], Shape] = {}
    for flat_key, entry in metadata.state_dict_metadata.items():
        nested = tuple(planner_data.get(flat_key, tuple(flat_key.split(".", 1))))
        index[nested] = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
    return index


def read_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """A sharded directory's trainer state (``meta.pt``: everything but the tensors), read before any tensor."""
    check_contained(path, [META_FILE], what="its trainer state")
    meta = torch_load(path / META_FILE, weights_only=weights_only)
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{str(path / META_FILE)!r} does not hold a dict (got {type(meta).__name__}); the checkpoint is damaged.")
    return meta


def verify(path: Path) -> str:
    """Check a checkpoint against its integrity records; return a one-line summary (only DCP's index is unpickled)."""
    path = Path(path)
    kind = layout.classify(path)
    if kind is CheckpointKind.FULL_FILE:
        if problem := verify_zip(path):
            raise CorruptCheckpointError(corruption_message([problem], path))
        if path.suffix == ".safetensors":
            check = "a safetensors header that describes every byte"
        elif zipfile.is_zipfile(path):
            check = "every zip entry matches its CRC-32"
        else:
            check = "legacy torch.save format, which records no checksums"
        return f"OK: {path} (single file, {path.stat().st_size} bytes, {check})"
    if kind is CheckpointKind.LIGHTNING_SHARDED:
        dcp_index(path)  # its index, safely unpickled, names only files inside
        return f"OK: {path} is readable, but Lightning's sharded layout records no checksums to verify"
    manifest = layout.read_manifest(path)
    records = manifest["files"]
    problems = verify_records(path, records, sorted(records))
    if problems:
        raise CorruptCheckpointError(corruption_message(problems, path))
    dcp_index(path)  # the index must name only files inside too (the manifest cannot vouch for that)
    total = sum(r["size"] for r in records.values())
    if all("sha256" in r for r in records.values()):
        return f"OK: {path} (sharded, {len(records)} files, {total} bytes match their recorded sizes, CRC-32s and SHA-256)"
    if all("crc32" in r or "sha256" in r for r in records.values()):
        return f"OK: {path} (sharded, {len(records)} files, every one of {total} bytes matches the CRC-32s recorded at save)"
    return (
        f"OK: {path} (sharded, {len(records)} files, {total} bytes match their recorded sizes; written by an hp_lightning "
        f"that recorded no checksums, so a same-size alteration cannot be told: save it again to record them)"
    )


def read_sharded(path: Path, *, weights_only: bool = False, verify_files: bool = True, trust_pickle: bool = False) -> dict[str, Any]:
    """A sharded directory as one Lightning checkpoint dict of whole CPU tensors (no process group).

    ``weights_only``: the model state only (not torch's flag of that name). ``verify_files``: check the
    manifest first. ``trust_pickle``: unpickle without safe loading (runs code: only for trusted files).
    """
    path = Path(path)
    kind = layout.classify(path)
    if kind is CheckpointKind.FULL_FILE:
        raise ValueError(f"{str(path)!r} is already a single-file checkpoint; consolidate reads sharded directories.")
    if kind is CheckpointKind.HP_SHARDED and verify_files:
        verify(path)
    pickles = False if trust_pickle else None
    checkpoint = read_meta(path, pickles)  # before any tensor is read
    roots = {k[0] for k in dcp_index(path, weights_only=pickles)}
    model_key = MODEL_KEY if MODEL_KEY in roots else FSDP_MODEL_KEY
    if model_key not in roots:
        raise ValueError(f"{str(path)!r} holds no model state (no {MODEL_KEY!r} or {FSDP_MODEL_KEY!r} entries; found {sorted(map(str, roots))}).")
    state = read_dcp(path, {model_key} if weights_only else None, trust_pickle=trust_pickle)
    checkpoint[MODEL_KEY] = state.pop(model_key)
    optimizers = sorted((k for k in state if str(k).startswith("optimizer_")), key=lambda k: int(str(k).split("_")[1]))
    if optimizers:
        checkpoint[OPTIMIZER_KEY] = [_positions_back(state[k]) for k in optimizers]
    return checkpoint


def _positions_back(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """Integer state keys back for state keyed by position: DCP returns ``"0"``, which ``Optimizer.load_state_dict``
    would not match to the groups' ``0`` (training on with fresh state, silently)."""
    listed = [p for group in optimizer_state.get("param_groups", []) for p in group.get("params", [])]
    state = optimizer_state.get("state", {})
    if listed and all(isinstance(p, int) for p in listed) and all(str(k).isdigit() for k in state):
        optimizer_state["state"] = {int(k): v for k, v in state.items()}
    return optimizer_state


def read_dcp(path: Path, roots: Optional[set[str]] = None, *, trust_pickle: bool = False) -> dict[str, Any]:
    """A DCP directory (or the entries under ``roots``) as nested whole CPU tensors, in this process.

    The target is built from the index (each tensor at its global shape), filled by ``dcp.load`` without
    a process group, and nested back along the recorded paths; pickles are safe unless ``trust_pickle``.
    """
    pickles = False if trust_pickle else None
    metadata = read_dcp_metadata(path, weights_only=pickles)
    routes = metadata.planner_data or {}
    flat: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        route = tuple(routes.get(key, (key,)))
        if roots is not None and route[0] not in roots:
            continue
        flat[key] = torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp_load(flat, path, weights_only=pickles, no_dist=True)
    nested: dict[Any, Any] = {}
    for key, value in flat.items():
        put_route(nested, tuple(routes.get(key, (key,))), value)  # lists (e.g. param_groups) come back as lists
    return nested
