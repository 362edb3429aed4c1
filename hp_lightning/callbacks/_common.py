"""What every hp_lightning callback shares: the strategy check, the root, the window position."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hp_lightning._lightning_private import should_accumulate
from hp_lightning.core.introspection import units_in_order
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl


def require_hsdp_strategy(trainer: pl.Trainer, callback: object) -> HSDPStrategy:
    """The trainer's :class:`HSDPStrategy`, or a ``TypeError`` naming the callback and the fix (from ``setup()``, before any collective)."""
    strategy = trainer.strategy
    if not isinstance(strategy, HSDPStrategy):
        name = type(callback).__name__
        raise TypeError(
            f"{name} switches HSDPStrategy's per-step controls, but the trainer's strategy is "
            f"{type(strategy).__name__}. Use Trainer(strategy='hsdp') (or 'hp_fsdp', or "
            f"hp_lightning.HSDPStrategy(...)), or remove {name} from the callbacks."
        )
    return strategy


def root_module(strategy: HSDPStrategy) -> HSDPModule:
    """The sharded root (the LightningModule itself once the strategy has set up)."""
    root = strategy.model
    if not isinstance(root, HSDPModule):
        raise RuntimeError(
            "The model is not sharded yet: hp_lightning callbacks act from on_fit_start / "
            "on_*_start on, after HSDPStrategy.setup() has applied fully_shard."
        )
    return root


def all_units(strategy: HSDPStrategy) -> list[HSDPModule]:
    """Every sharding unit, root first, then the others in forward order."""
    sharded = strategy.sharded_model
    return units_in_order(root_module(strategy), sharded.units if sharded is not None else None)


def in_accumulation_window(trainer: pl.Trainer) -> bool:
    """True while the current training batch is a non-final micro-batch of its window.

    Lightning's own decision (schedulers and short epoch-end windows included), valid from
    ``on_train_batch_start`` to ``on_train_batch_end``.
    """
    if not trainer.lightning_module.automatic_optimization:
        return False
    return should_accumulate(trainer)
