"""Reading checkpoints into this process, with no process group: the one place every reader shares.

:mod:`.load` (into a sharded model, from every rank) and :mod:`.convert` (offline, between formats)
both read through here, so neither imports the other: a single file (:func:`read_full_file`), a
sharded directory's index (:func:`dcp_index`), trainer state (:func:`read_meta`) and whole tensors
(:func:`read_dcp`, :func:`read_sharded`), and the integrity check (:func:`verify`).

Every pickle is read with torch's safe loading unless the caller opts out (see :mod:`.unpickle`),
and no entry of a checkpoint directory may name a file outside it.
"""

from __future__ import annotations

import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.layout import (
    FSDP_MODEL_KEY,
    FULL_INFO_KEY,
    META_FILE,
    MODEL_KEY,
    OPTIMIZER_KEY,
    CheckpointKind,
    CorruptCheckpointError,
)
from hp_lightning.checkpoint.unpickle import dcp_load, put_route, read_dcp_metadata, torch_load
from hp_lightning.core import devices
from hp_lightning.core.state_dict import Shape

# ------------------------------------------------ single files


def read_full_file(
    path: Path, *, weights_only: Optional[bool] = None, verify: bool = True, keys: Optional[layout.StateKeys] = None
) -> dict[str, Any]:
    """Read a single-file checkpoint into a dict on this process (with plain ``torch.load``: not memory-mapped).

    Bare state dicts and ``.safetensors`` files come back as ``{"state_dict": ...}``.

    Args:
        weights_only: None (default) or True: torch's safe loading, which refuses any type but
            tensors, primitive containers and registered safe globals; False: unpickle anything,
            which runs code the file carries: only for files you trust.
        verify: check the zip CRC-32s first.
        keys: where a Lightning Fabric checkpoint (its own layout: the ``state`` keys) keeps the
            model, optimizers and schedulers; it comes back in the Trainer's layout
            (:func:`~hp_lightning.checkpoint.layout.in_trainer_layout`). A Fabric-layout save of ours
            says so itself.

    Raises:
        UnsafeCheckpointError: safe loading refused a type (the file, the type and the opt-in named).
        CorruptCheckpointError: a truncated or altered file (zip CRC-32 check).
        ValueError: not a checkpoint, or written by a newer format version.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(directory_message(path, "read_full_file"))
    layout.regular_file_size(path.parent, path.name)  # a FIFO or device is refused before anything opens it
    if path.suffix == ".safetensors":
        return {MODEL_KEY: _read_safetensors(path)}
    if verify and (problem := layout.verify_zip(path)):
        raise CorruptCheckpointError(layout.corruption_message([problem], path))
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


# ------------------------------------------------ sharded directories


def dcp_index(path: Path, *, weights_only: Optional[bool] = None, metadata: Optional[Metadata] = None) -> dict[tuple[Any, ...], Shape]:
    """Every entry DCP stored, as its nested path (``('state_dict', 'net.w')``) -> global shape.

    DCP's index is a pickle: it is read safely unless ``weights_only=False`` (see :mod:`.unpickle`);
    pass ``metadata`` already read by :func:`read_dcp_metadata` to read it once.

    Raises:
        UnsafeCheckpointError: the index needs a type outside DCP's own, or names a file outside ``path``.
        CorruptCheckpointError: the index is missing or damaged.
    """
    if metadata is None:
        metadata = read_dcp_metadata(path, weights_only=weights_only)
    planner_data = metadata.planner_data or {}
    index: dict[tuple[Any, ...], Shape] = {}
    for flat_key, entry in metadata.state_dict_metadata.items():
        nested = tuple(planner_data.get(flat_key, tuple(flat_key.split(".", 1))))
        index[nested] = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
    return index


def read_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """A sharded directory's trainer state (``meta.pt``: everything but the tensors), read before any tensor.

    Raises:
        UnsafeCheckpointError: a type safe loading refuses, or the entry names a file outside ``path``.
        CorruptCheckpointError: the file does not hold a dict.
    """
    layout.check_contained(path, [META_FILE], what="its trainer state")
    meta = torch_load(path / META_FILE, weights_only=weights_only)
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{str(path / META_FILE)!r} does not hold a dict (got {type(meta).__name__}); the checkpoint is damaged.")
    return meta


def verify(path: Path) -> str:
    """Check a checkpoint against its integrity records; return a one-line summary.

    Only DCP's index is unpickled (DCP's own types, nothing else); a manifest or index that names a
    file outside the directory is refused.

    Raises:
        CorruptCheckpointError: a missing, truncated or altered file.
        UnsafeCheckpointError: an entry naming a file outside the checkpoint directory.
        ValueError: not a checkpoint, or one written by a newer format version.
    """
    path = Path(path)
    kind = layout.classify(path)
    if kind is CheckpointKind.FULL_FILE:
        if problem := layout.verify_zip(path):
            raise CorruptCheckpointError(layout.corruption_message([problem], path))
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
    problems = layout.verify_records(path, records, sorted(records))
    if problems:
        raise CorruptCheckpointError(layout.corruption_message(problems, path))
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

    Args:
        weights_only: read the model state only (no optimizer state). Not torch's flag of that name.
        verify_files: check the manifest's sizes and checksums first.
        trust_pickle: unpickle ``meta.pt``, DCP's index and its non-tensor entries without safe
            loading (torch's ``weights_only=False``), which runs code they carry: only for trusted files.

    Raises:
        ValueError: ``path`` is a single file, or not a checkpoint.
        CorruptCheckpointError: a file does not match its integrity record.
        UnsafeCheckpointError: a pickle safe loading refuses, or an entry naming a file outside ``path``.
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
    # Every entry is rebuilt whole from the index: no model needed, no process group.
    state = read_dcp(path, {model_key} if weights_only else None, trust_pickle=trust_pickle)
    checkpoint[MODEL_KEY] = state.pop(model_key)
    optimizers = sorted((k for k in state if str(k).startswith("optimizer_")), key=lambda k: int(str(k).split("_")[1]))
    if optimizers:
        checkpoint[OPTIMIZER_KEY] = [_positions_back(state[k]) for k in optimizers]
    return checkpoint


def _positions_back(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """Integer state keys back, for state keyed by position (plain PyTorch / single-device Lightning).

    DCP stores dict keys as strings, so position ``0`` comes back as ``"0"`` while the param groups
    still list ``0``; ``Optimizer.load_state_dict`` would then file the state under ``"0"`` and
    train on with fresh state, silently.
    """
    listed = [p for group in optimizer_state.get("param_groups", []) for p in group.get("params", [])]
    state = optimizer_state.get("state", {})
    if listed and all(isinstance(p, int) for p in listed) and all(str(k).isdigit() for k in state):
        optimizer_state["state"] = {int(k): v for k, v in state.items()}
    return optimizer_state


def read_dcp(path: Path, roots: Optional[set[str]] = None, *, trust_pickle: bool = False) -> dict[str, Any]:
    """A DCP directory (or the entries under ``roots``) as nested whole CPU tensors, in this process.

    torch's public API only: the target is built from the directory's own metadata (each tensor
    allocated at its global shape and dtype, other values as placeholders), ``dcp.load`` fills it
    without a process group, and the flat keys are nested back along the metadata's recorded paths.
    The index and the non-tensor entries are unpickled safely unless ``trust_pickle``.
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
