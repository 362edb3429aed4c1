"""Gradient bytes a rank holds between backward passes, measured on the live tensors.

Device allocator statistics mix gradients with activations and parameters, and do not exist on
CPU. This counts the gradient storage itself, wherever FSDP keeps it after a backward:

* sharded gradients (``param.grad``, a DTensor: its local shard),
* unsharded gradients a unit accumulates while gradient sync is off (``"skip"`` mode: the
  full-size gradient of every parameter),
* HSDP partial reductions waiting for their all-reduce (``"defer_all_reduce"``),
* plain gradients of replicate / ignored parameters.

Each storage is counted once, by its full size (views into one flat buffer share it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from hp_lightning.callbacks._common import param_groups, require_hsdp_strategy
from hp_lightning.fully_shard import hsdp_modules

if TYPE_CHECKING:
    import lightning.pytorch as pl


def live_gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient storage ``model`` holds right now on this rank (see the module docstring)."""
    seen: dict[tuple[str, int], int] = {}

    def add(tensor: Optional[torch.Tensor]) -> None:
        if tensor is None:
            return
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()

    for param in model.parameters():
        add(param.grad)
    for unit in hsdp_modules(model):
        for group in param_groups(unit):
            add(getattr(group, "_partial_reduce_output", None))
            for fsdp_param in group.fsdp_params:
                add(getattr(fsdp_param, "unsharded_accumulated_grad", None))
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    add(unsharded.grad)
    return sum(seen.values())


class GradientMemoryMonitor(Callback):
    """Record the gradient bytes each rank holds at the end of every backward.

    The figure that differs between accumulation modes: what stays resident from one
    micro-batch to the next. (Inside a backward every mode also briefly holds one unit's
    full-size gradient before reducing it.)

    Attributes:
        per_backward: bytes after each backward of the current ``fit``, in order.
        peak_bytes: the largest of them.
    """

    def __init__(self) -> None:
        self.per_backward: list[int] = []

    @property
    def peak_bytes(self) -> int:
        return max(self.per_backward, default=0)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_hsdp_strategy(trainer, self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.per_backward = []

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.per_backward.append(live_gradient_bytes(pl_module))
