"""Sharded and full checkpoints for FSDP2 models, written so that a resume never reads half a save.

Formats:

* **sharded** — a directory written by ``torch.distributed.checkpoint`` (DCP): model and optimizer
  state as they live (one shard per rank), plus ``meta.pt`` with everything else Lightning saves
  (epoch, global step, loops, callbacks, LR schedulers, hyper-parameters). DCP reshards on load,
  so the directory loads into any world size and mesh.
* **full** — one ``.ckpt`` file that rank 0 writes: a plain Lightning checkpoint whose
  ``state_dict`` holds whole CPU tensors, readable with ``torch.load`` /
  ``LightningModule.load_from_checkpoint`` on one process. Parameters are gathered one at a time
  and moved to the CPU, so no rank holds the whole model on its device.

Atomicity: a save is written under a temporary sibling name and renamed into place by rank 0
only after every rank has finished writing; the previous checkpoint at that path is replaced in
one rename. A killed save leaves a ``.tmp-*`` entry that no loader picks up.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

#: Version of hp_lightning's sharded-checkpoint layout; newer versions are refused on load.
FORMAT_VERSION = 1
META_FILE = "meta.pt"
MODEL_KEY = "state_dict"
TMP_MARKER = ".tmp-"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str) -> str:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def model_state_dict(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """The model's state: local shards (``full=False``) or whole CPU tensors on rank 0 (``full=True``)."""
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return get_model_state_dict(model, options=options)


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names, sharded or whole (rank 0) like the model."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return get_optimizer_state_dict(model, optimizer, options=options)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def _tmp_sibling(path: Path) -> Path:
    token = _broadcast_str(uuid.uuid4().hex[:12])
    return path.with_name(f"{path.name}{TMP_MARKER}{token}")


def _replace(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path`` replacing what was there; the old entry disappears only after."""
    if path.exists():
        old = path.with_name(f"{path.name}{TMP_MARKER}old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, path)


def save_checkpoint(checkpoint: dict[str, Any], path: Path, *, sharded: bool) -> None:
    """Write Lightning's ``checkpoint`` dict (state already gathered per format) atomically to ``path``.

    Every rank calls this. For sharded checkpoints each rank writes its shards; for full ones only
    rank 0 writes.
    """
    path = Path(path)
    tmp = _tmp_sibling(path)
    if sharded:
        state = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optim_state
        if _rank() == 0:
            tmp.mkdir(parents=True, exist_ok=False)
        _barrier()
        dcp.save(state, checkpoint_id=str(tmp))
        if _rank() == 0:
            meta = dict(checkpoint)
            meta["hp_lightning_format_version"] = FORMAT_VERSION
            meta["num_optimizers"] = sum(1 for k in state if k.startswith("optimizer_"))
            torch.save(meta, tmp / META_FILE)
    elif _rank() == 0:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, tmp)
    _barrier()
    if _rank() == 0:
        _replace(tmp, path)
    _barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool = True) -> dict[str, Any]:
    """Load a sharded directory or a full file into the sharded ``model`` and ``optimizers``.

    Returns the rest of the checkpoint (epoch, loops, callbacks, ...) for Lightning to restore.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a directory that is not an hp_lightning checkpoint, or a newer format.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    if path.is_dir():
        return _load_sharded(path, model, optimizers, strict=strict)
    return _load_full(path, model, optimizers, strict=strict)


def _load_sharded(path: Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool) -> dict[str, Any]:
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{str(path)!r} is a directory but not an hp_lightning sharded checkpoint (no {META_FILE}).")
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    version = meta.get("hp_lightning_format_version", 0)
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r} was written by a newer hp_lightning (format {version}; this one reads up to "
            f"{FORMAT_VERSION}). Upgrade hp_lightning to load it."
        )
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    stored_optimizers = int(meta.get("num_optimizers", 0))
    for i, optimizer in enumerate(optimizers[:stored_optimizers]):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers[:stored_optimizers]):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"])
    return meta


def _load_full(path: Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool) -> dict[str, Any]:
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{str(path)!r} does not hold a checkpoint dict; got {type(checkpoint).__name__}.")
    weights_only = MODEL_KEY not in checkpoint
    model_sd = checkpoint if weights_only else checkpoint.pop(MODEL_KEY)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, model_sd if _rank() == 0 else {}, options=options)
    if weights_only:
        return {}
    optimizer_states = checkpoint.pop("optimizer_states", [])
    for optimizer, optim_sd in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(model, optimizer, optim_sd if _rank() == 0 else {}, options=options)
    return checkpoint


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint of either format (a sharded one is a whole directory)."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
