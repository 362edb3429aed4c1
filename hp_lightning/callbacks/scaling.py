"""Scale reduced gradients per step: ``final gradient = factor x reduce_op(local gradients)``.

The factor is applied where FSDP reduces, after the collective, in place on the gradient
shard: no extra pass over full-size gradients, and nothing to undo in the loss. Typical use:
``reduce_op="sum"`` and ``factor = 1 / tokens in the global batch`` normalizes by the global
token count instead of averaging per-rank means (which over-weights ranks with short sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from hp_lightning.callbacks._common import require_hsdp_strategy, root_module
from hp_lightning.fully_shard import REDUCE_OPS, validate_scaling_factor

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: ``factor(trainer, pl_module, batch) -> float | None``, called before each training batch.
FactorFn = Callable[..., Optional[float]]


class GradientScaling(Callback):
    """Set the gradient scaling factor before each training batch's backward.

    Args:
        factor: a number (fixed for the run), a callable ``factor(trainer, pl_module, batch)``
            returning a number or None (called at the start of every training batch; in YAML an
            import path), or None (no scaling, overriding the strategy's
            ``gradient_scaling_factor``). It must be the same on every rank. Under ``"skip"`` and
            ``"defer_all_reduce"`` the factor in force at a window's last micro-batch scales the
            whole window; ``"every"`` scales each micro-batch by its own.
        reduce_op: ``"avg"`` (mean over data-parallel ranks) or ``"sum"``; None keeps the
            strategy's ``reduce_op``. With ``"sum"`` the factor alone sets the normalization.

    Raises:
        TypeError / ValueError: for a factor that is not a positive number, callable or None, or
            an unknown ``reduce_op`` (at construction; a callable's result when it is returned);
            TypeError in ``setup()`` when the trainer's strategy is not :class:`HSDPStrategy`.
    """

    def __init__(
        self,
        factor: Union[float, FactorFn, None] = None,
        reduce_op: Optional[Literal["avg", "sum"]] = None,
    ) -> None:
        if callable(factor):
            self.factor: Union[float, FactorFn, None] = factor
        else:
            self.factor = validate_scaling_factor(factor, "GradientScaling(factor=...)")
        if reduce_op is not None and (not isinstance(reduce_op, str) or reduce_op.lower() not in REDUCE_OPS):
            raise ValueError(f"GradientScaling(reduce_op=...) expects one of {list(REDUCE_OPS)} or None; got {reduce_op!r}.")
        self.reduce_op = reduce_op.lower() if reduce_op is not None else None
        #: The factor in force for the current (or last) training batch.
        self.current_factor: Optional[float] = None
        self._applied = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_hsdp_strategy(trainer, self)
        self._applied = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        root = root_module(require_hsdp_strategy(trainer, self))
        if self.reduce_op is not None:
            root.set_reduce_op_type(self.reduce_op)
        if not callable(self.factor):
            self._set(root, self.factor)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not callable(self.factor):
            return
        name = getattr(self.factor, "__qualname__", repr(self.factor))
        value = validate_scaling_factor(self.factor(trainer, pl_module, batch), f"GradientScaling(factor={name}) result at batch {batch_idx}")
        self._set(root_module(require_hsdp_strategy(trainer, self)), value)

    def _set(self, root: Any, value: Optional[float]) -> None:
        if self._applied and value == self.current_factor:
            return  # unchanged: skip the walk over every unit
        root.set_gradient_scaling_factor(value)
        self.current_factor = value
        self._applied = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(factor={self.factor!r}, reduce_op={self.reduce_op!r})"
