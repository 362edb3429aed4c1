"""Offline conversion between the formats, in one process with no process group.

* :func:`consolidate`: a sharded directory -> one ``.ckpt`` file (or weights only, or ``.safetensors``);
  the whole state passes through this process's memory.
* :func:`shard`: a single-file checkpoint -> an hp_lightning sharded directory (one shard file,
  which DCP splits across however many ranks later load it).

Outputs are written and inputs read like training saves and loads (pickles safely unless ``trust_pickle``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.layout import FULL_INFO_KEY, MODEL_KEY, OPTIMIZER_KEY, CheckpointKind
from hp_lightning.checkpoint.read import read_dcp, read_full_file, read_sharded, verify
from hp_lightning.checkpoint.save import producer_record, save_checkpoint, write_file_atomically

__all__ = ["FORMATS", "WEIGHTS_ONLY_KEYS", "consolidate", "read_dcp", "read_sharded", "shard", "verify"]  # the readers live in .read

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
        weights_only: keep the model weights and what ``load_from_checkpoint`` needs (cannot resume training).
        fmt: ``"torch"`` (a Lightning ``.ckpt``) or ``"safetensors"`` (model tensors only).
        overwrite: replace ``out`` if it holds a checkpoint already (anything else is never replaced).
        trust_pickle: unpickle the source without safe loading (only for a trusted source).
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
        from safetensors.torch import save_file  # safetensors is optional (hp-lightning[safetensors])

        tensors, skipped = _safetensors_ready(checkpoint[MODEL_KEY])
        metadata = {"format": "pt", "source": str(src), "hp_lightning_version": str(checkpoint[FULL_INFO_KEY]["hp_lightning_version"])}
        write_file_atomically(out, lambda staging: save_file(tensors, str(staging), metadata=metadata), overwrite=overwrite, what=WHAT)
        note = f"; left out non-tensor entries {skipped}" if skipped else ""
        return f"wrote {out} (safetensors, {len(tensors)} tensors{note}) from {src}"
    if weights_only:
        checkpoint = {k: v for k, v in checkpoint.items() if k in WEIGHTS_ONLY_KEYS}
    write_file_atomically(out, lambda staging: torch.save(checkpoint, staging), overwrite=overwrite, what=WHAT)
    optimizers = len(checkpoint.get(OPTIMIZER_KEY, []))
    return f"wrote {out} ({'weights only' if weights_only else 'full'}, {len(checkpoint[MODEL_KEY])} model entries, {optimizers} optimizer state(s)) from {src}"


def shard(src: Path, out: Path, *, weights_only: Optional[bool] = None, overwrite: bool = False) -> str:
    """Write single-file checkpoint ``src`` as an hp_lightning sharded directory ``out``; return a summary.

    ``weights_only``: torch's flag for reading ``src`` (False only for a trusted source). ``overwrite``:
    replace ``out`` if it holds a checkpoint already (anything else is never replaced).
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
