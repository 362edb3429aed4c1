"""Gradient bytes a rank holds between backward passes, measured on the live tensors
(:func:`hp_lightning.core.introspection.live_gradient_bytes`).

Allocator statistics mix gradients with activations and parameters (and do not exist on CPU);
this counts the gradient storage wherever FSDP keeps it: sharded, unsharded under ``"skip"``,
partial reductions under ``"defer_all_reduce"``, and plain gradients, each storage once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from hp_lightning.callbacks._common import require_hsdp_strategy
from hp_lightning.core.introspection import live_gradient_bytes

if TYPE_CHECKING:
    import lightning.pytorch as pl


class GradientMemoryMonitor(Callback):
    """Record the gradient bytes each rank holds at the end of every backward (what differs between accumulation modes).

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
