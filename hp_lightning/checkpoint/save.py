"""Saving a sharded model's checkpoint from every rank: staged, checksummed, then published in one step.

* **sharded**: every rank writes its own shards in parallel with ``torch.distributed.checkpoint``
  (DCP) into a staging directory; rank 0 adds ``meta.pt`` (the rest of Lightning's checkpoint);
  then the file sizes (and, with ``checksums=True``, each file's SHA-256, read back by the ranks
  in parallel) go into the manifest rank 0 writes before it publishes.
  Fast and light on memory; loads into any world size or mesh; needs a filesystem every rank sees.
* **full**: the state arrives already gathered on rank 0 (tensor by tensor, see
  :mod:`hp_lightning.core.state_dict`), which writes one ``torch.save`` file. Portable, but rank 0
  holds the whole state in host memory and writes it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.collective import on_every_rank, on_rank0, rank, world_size
from hp_lightning.checkpoint.layout import (
    DCP_METADATA_FILE,
    FORMAT_VERSION,
    FULL_INFO_KEY,
    MANIFEST_FILE,
    META_FILE,
    MODEL_KEY,
    OPTIMIZER_KEY,
)


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (hp_lightning's or Lightning's layout)."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST_FILE).is_file() or (path / DCP_METADATA_FILE).is_file())


def mesh_record(state: Mapping[str, Any]) -> dict[str, Any]:
    for value in state.values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ()), "device_type": mesh.device_type}
    return {}


def producer_record() -> dict[str, Any]:
    import lightning

    from hp_lightning import __version__

    return {
        "format_version": FORMAT_VERSION,
        "hp_lightning_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "lightning_version": lightning.__version__,
        "world_size": world_size(),
    }


def prepare_target(path: Path) -> Path:
    """Rank 0: finish a swap a kill interrupted, drop what killed saves left, pick a staging name."""
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ValueError(f"Cannot save a checkpoint to {str(path)!r}: something other than a file or directory is there.")
    # A training save replaces an older checkpoint of the same name, and nothing else.
    layout.refuse_foreign(path, overwrite=True, what="Cannot save a checkpoint")
    layout.recover(path)
    layout.clean_stale(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return layout.staging_path(path, layout.new_token())


def save_checkpoint(checkpoint: dict[str, Any], path: Path, *, sharded: bool, checksums: bool = False) -> None:
    """Write Lightning's ``checkpoint`` dict to ``path`` from every rank; the save appears whole or not at all.

    The state in ``checkpoint`` must come from :func:`model_state_dict` / :func:`optimizer_state_dict`
    with the same ``full`` setting (``full = not sharded``). Every rank calls this.

    Args:
        checksums: sharded only: also record every file's SHA-256 (one read-back of the new files,
            usually from the page cache, spread over the ranks), so every later load checks every
            byte. Without it the manifest records sizes, which every load checks.

    Raises:
        ValueError: the target is something other than a file or directory.
    """
    path = Path(path)
    if sharded:
        _save_sharded(dict(checkpoint), path, checksums=checksums)
    else:
        _save_full(dict(checkpoint), path)


def _save_sharded(checkpoint: dict[str, Any], path: Path, *, checksums: bool) -> None:
    tensors: dict[str, Any] = {MODEL_KEY: checkpoint.pop(MODEL_KEY, {})}
    for index, optim_state in enumerate(checkpoint.pop(OPTIMIZER_KEY, None) or []):
        tensors[f"optimizer_{index}"] = optim_state

    def start() -> Path:
        staging = prepare_target(path)
        staging.mkdir()
        # The producer record marks hp_lightning's layout even if the manifest is later lost.
        torch.save({**checkpoint, FULL_INFO_KEY: {**producer_record(), "format": "sharded"}}, staging / META_FILE)
        layout.fsync_file(staging / META_FILE)
        return staging

    staging = on_rank0(start)
    # Every rank writes its shards; DCP gathers their outcome, so a failure raises on all ranks.
    dcp.save(tensors, checkpoint_id=str(staging), no_dist=not dist.is_initialized())
    # Sizes (a stat); checksums only when asked for: each rank reads back a slice of the files, in parallel.
    records = on_every_rank(
        lambda: {n: layout.file_record(staging / n, checksum=checksums) for n in layout.data_files(staging)[rank() :: world_size()]}
    )
    gathered: list[Any] = [records]
    if dist.is_initialized():
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, records)

    def finish() -> None:
        files = {name: record for part in gathered for name, record in part.items()}
        manifest = {
            **producer_record(),
            "format": "sharded",
            "model_key": MODEL_KEY,
            "num_optimizers": len(tensors) - 1,
            "mesh": mesh_record(tensors[MODEL_KEY]),
            "checksum": "sha256" if checksums else None,
            "files": files,
        }
        layout.write_manifest(staging, manifest)
        layout.publish(staging, path)

    on_rank0(finish)


def _save_full(checkpoint: dict[str, Any], path: Path) -> None:
    def write() -> None:
        staging = prepare_target(path)
        checkpoint[FULL_INFO_KEY] = {**producer_record(), "format": "full"}
        try:
            torch.save(checkpoint, staging)
            layout.fsync_file(staging)
        except (OSError, RuntimeError) as exc:
            layout.remove(staging)
            raise layout.write_error(exc, path) from None
        layout.publish(staging, path)

    on_rank0(write)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint of either format (a sharded one is a whole directory), in one rename first."""
    layout.remove(Path(path))
