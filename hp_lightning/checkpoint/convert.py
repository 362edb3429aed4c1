"""Offline conversion between the formats, in one process with no process group.

* :func:`consolidate`: a sharded directory (hp_lightning's, or Lightning's ``ModelParallelStrategy``
  / ``FSDPStrategy`` layout) -> one Lightning ``.ckpt`` file, or model weights only, or
  ``.safetensors``. The whole state passes through this process's memory, so the machine needs
  host RAM for the model (plus optimizer state, unless ``weights_only``).
* :func:`shard`: a single-file checkpoint -> an hp_lightning sharded directory (one shard file,
  which DCP splits across however many ranks later load it).

Outputs are written like training saves: staged under a temporary name, renamed into place.
Inputs are read like training loads: every pickle safely (torch's ``weights_only=True``) unless
``trust_pickle=True`` / ``--trust-pickle`` says the source is trusted, and no entry may name a file
outside the source directory.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
from hp_lightning.checkpoint.load import dcp_index, read_full_file
from hp_lightning.checkpoint.save import producer_record, save_checkpoint, write_file_atomically
from hp_lightning.checkpoint.unpickle import dcp_load, read_dcp_metadata, torch_load

#: What a weights-only export keeps: enough for ``LightningModule.load_from_checkpoint``.
WEIGHTS_ONLY_KEYS = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    MODEL_KEY,
    "hyper_parameters",
    "hparams_name",
    "hparams_type",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hparams_type",
    FULL_INFO_KEY,
)
FORMATS = ("torch", "safetensors")
WHAT = "Will not write the output"


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
    layout.check_contained(path, [META_FILE], what="its trainer state")
    checkpoint = torch_load(path / META_FILE, weights_only=pickles)  # before any tensor is read
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(f"{str(path / META_FILE)!r} does not hold a dict (got {type(checkpoint).__name__}); the checkpoint is damaged.")
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
        *parents, leaf = tuple(routes.get(key, (key,)))
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _lists_back(nested)


def _lists_back(node: Any) -> Any:
    """Dicts keyed 0..n-1 (how a list's items are routed, e.g. optimizer param_groups) back to lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists_back(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def _weights_only(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in checkpoint.items() if k in WEIGHTS_ONLY_KEYS}


def _safetensors_ready(weights: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Contiguous tensors, none sharing memory (safetensors refuses both); non-tensor entries left out."""
    tensors, skipped, seen = {}, [], set()
    for key, value in weights.items():
        if not isinstance(value, torch.Tensor):
            skipped.append(key)
            continue
        tensor = value.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if pointer is not None and pointer in seen:
            tensor = tensor.clone()  # tied weights: stored twice, as safetensors requires
        elif pointer is not None:
            seen.add(pointer)
        tensors[key] = tensor
    return tensors, skipped


def consolidate(
    src: Path, out: Path, *, weights_only: bool = False, fmt: str = "torch", overwrite: bool = False, trust_pickle: bool = False
) -> str:
    """Write sharded checkpoint ``src`` as one file ``out``; return a one-line summary.

    Args:
        weights_only: keep the model weights and what ``load_from_checkpoint`` needs; drop
            optimizer, scheduler, loop-internal and callback state (smaller; cannot resume training).
        fmt: ``"torch"`` (a Lightning ``.ckpt``) or ``"safetensors"`` (model tensors only).
        overwrite: replace ``out`` if it holds a checkpoint already (anything else is never replaced).
        trust_pickle: unpickle the source without safe loading (only for a trusted source).

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False.
        UnsafeCheckpointError: a pickle safe loading refuses, or an entry naming a file outside ``src``.
        ValueError: a bad format name, ``out`` equal to ``src``, ``out`` holding something that is
            not a checkpoint, or ``src`` not a sharded checkpoint.
    """
    src, out = Path(src), Path(out)
    if fmt not in FORMATS:
        raise ValueError(f"--format expects one of {list(FORMATS)}; got {fmt!r}.")
    if out.resolve() == src.resolve():
        raise ValueError(f"The output {str(out)!r} is the source checkpoint itself; choose another output path.")
    layout.refuse_foreign(out, overwrite=overwrite, what=WHAT)
    checkpoint = read_sharded(src, weights_only=weights_only or fmt == "safetensors", trust_pickle=trust_pickle)
    checkpoint[FULL_INFO_KEY] = {**producer_record(), "format": "full", "consolidated_from": str(src)}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        tensors, skipped = _safetensors_ready(checkpoint[MODEL_KEY])
        metadata = {"format": "pt", "source": str(src), "hp_lightning_version": str(checkpoint[FULL_INFO_KEY]["hp_lightning_version"])}
        write_file_atomically(out, lambda staging: save_file(tensors, str(staging), metadata=metadata), overwrite=overwrite, what=WHAT)
        note = f"; left out non-tensor entries {skipped}" if skipped else ""
        return f"wrote {out} (safetensors, {len(tensors)} tensors{note}) from {src}"
    if weights_only:
        checkpoint = _weights_only(checkpoint)
    write_file_atomically(out, lambda staging: torch.save(checkpoint, staging), overwrite=overwrite, what=WHAT)
    optimizers = len(checkpoint.get(OPTIMIZER_KEY, []))
    return f"wrote {out} ({'weights only' if weights_only else 'full'}, {len(checkpoint[MODEL_KEY])} model entries, {optimizers} optimizer state(s)) from {src}"


def shard(src: Path, out: Path, *, weights_only: Optional[bool] = None, overwrite: bool = False) -> str:
    """Write single-file checkpoint ``src`` as an hp_lightning sharded directory ``out``; return a summary.

    Args:
        weights_only: torch's flag for reading ``src``: None (default) or True: safely; False:
            unpickle anything, which runs code the file carries (only for a trusted source).
        overwrite: replace ``out`` if it holds a checkpoint already (anything else is never replaced).

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False.
        UnsafeCheckpointError: a pickle safe loading refuses (the file, the type and the opt-in named).
        ValueError: ``src`` is not a single-file checkpoint, ``out`` is ``src``, or ``out`` holds
            something that is not a checkpoint.
        CorruptCheckpointError: ``src`` fails its CRC-32 check.
    """
    src, out = Path(src), Path(out)
    if layout.classify(src) is not CheckpointKind.FULL_FILE:
        raise ValueError(f"{str(src)!r} is a directory; shard reads single-file checkpoints (consolidate goes the other way).")
    if out.resolve() == src.resolve():
        raise ValueError(f"The output {str(out)!r} is the source checkpoint itself; choose another output path.")
    layout.refuse_foreign(out, overwrite=overwrite, what=WHAT)
    checkpoint = read_full_file(src, weights_only=weights_only)
    checkpoint.pop(FULL_INFO_KEY, None)
    save_checkpoint(checkpoint, out, sharded=True)
    optimizers = len(checkpoint.get(OPTIMIZER_KEY) or [])
    return f"wrote {out} (sharded, {len(checkpoint[MODEL_KEY])} model entries, {optimizers} optimizer state(s)) from {src}"
