"""What every hp_lightning callback shares: the strategy check, the units, the window position.

Also the one place that reads FSDP2's private per-unit state (parameter groups, prefetch lists,
held gradients): the report and the gradient-memory monitor need facts FSDP2 does not expose
publicly. Keeping those reads here means a torch upgrade that renames them breaks one file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from hp_lightning.fully_shard import HSDPModule, hsdp_modules
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl


def require_hsdp_strategy(trainer: pl.Trainer, callback: object) -> HSDPStrategy:
    """The trainer's :class:`HSDPStrategy`, or a ``TypeError`` naming the callback and the fix.

    Called from each callback's ``setup()``, which Lightning runs on every rank before any
    per-step hook, so a wrong strategy is refused before the first collective.
    """
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
    root = root_module(strategy)
    sharded = strategy.sharded_model
    inner = list(sharded.units) if sharded is not None else [m for m in hsdp_modules(root) if m is not root]
    return [root, *[u for u in inner if u is not root]]


def unit_names(root: nn.Module) -> dict[int, str]:
    """``id(module) -> qualified name`` below the root (``"<root>"`` for the root itself)."""
    return {id(m): (name or "<root>") for name, m in root.named_modules()}


def in_accumulation_window(trainer: pl.Trainer) -> bool:
    """True while the current training batch is a non-final micro-batch of its window.

    This is the very decision Lightning takes before running the batch (and the reason it enters
    ``strategy.block_backward_sync()``): it follows ``accumulate_grad_batches``, a
    ``GradientAccumulationScheduler`` changing it per epoch, and the short window at an epoch's
    end. Valid from ``on_train_batch_start`` to ``on_train_batch_end``.
    """
    if not trainer.lightning_module.automatic_optimization:
        return False
    return bool(trainer.fit_loop._should_accumulate())


# ---------------------------------------------------------------- FSDP2 internals (read only)


def param_groups(unit: HSDPModule) -> list[Any]:
    """FSDP2's parameter groups of one unit (usually one; several for a list-of-modules unit)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.13 kept a single group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def prefetch_targets(unit: HSDPModule, direction: str) -> list[nn.Module]:
    """Units this one all-gathers ahead of time (explicit prefetch) in ``"forward"`` or ``"backward"``."""
    state = unit._get_fsdp_state()
    modules: list[nn.Module] = []
    for target in getattr(state, f"_states_to_{direction}_prefetch", []):
        modules.extend(getattr(target, "_modules", ()))
    return modules


def reshards_after_forward(unit: HSDPModule) -> bool:
    """Whether the unit frees its gathered parameters after forward (its current setting)."""
    return any(group.post_forward_mesh_info is not None for group in param_groups(unit))
