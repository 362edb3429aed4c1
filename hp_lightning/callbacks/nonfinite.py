"""Stop training at the first NaN/inf gradient, naming the step, the sharding unit and the parameter.

A NaN in one rank's gradient shard reaches every rank's weights within a step or two, and the
loss turns NaN far from the cause. The reduced gradients are checked before the optimizer step
(and clipping); every rank stops at that step with the weights untouched. Cost per step: one
local max-norm and an all-reduce of one number; names are gathered only when something was found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from hp_lightning.fully_shard import HSDPModule

if TYPE_CHECKING:
    import lightning.pytorch as pl

ACTIONS = ("raise", "stop")


class NonFiniteGradientError(FloatingPointError):
    """Gradients held NaN or inf at an optimizer step; the message names the step, unit and parameters."""


class NonFiniteGradients(Callback):
    """Check the reduced gradients before every optimizer step; stop at the first NaN/inf.

    Args:
        action: ``"raise"`` (default) raises :class:`NonFiniteGradientError` on every rank
            before the optimizer step (a non-zero exit). ``"stop"`` drops the gradients, warns
            with the same message and stops the Trainer after this batch (exit code 0; a final
            checkpoint holds weights without the NaN).
        max_names: how many offending parameters the message lists.

    Raises:
        ValueError / TypeError: for an unknown ``action`` or a ``max_names`` below 1.
    """

    def __init__(self, action: Literal["raise", "stop"] = "raise", max_names: int = 5) -> None:
        if not isinstance(action, str) or action not in ACTIONS:
            raise ValueError(f"NonFiniteGradients(action=...) expects one of {list(ACTIONS)}; got {action!r}.")
        if isinstance(max_names, bool) or not isinstance(max_names, int) or max_names < 1:
            raise TypeError(f"NonFiniteGradients(max_names=...) expects an int >= 1; got {max_names!r}.")
        self.action = action
        self.max_names = max_names
        self._batch_idx = 0
        self._units: Optional[list[str]] = None
        #: The message of the last detection (None while gradients were finite).
        self.last_report: Optional[str] = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        named = [(name, p.grad) for name, p in pl_module.named_parameters() if p.grad is not None]
        local = [(name, g.to_local() if isinstance(g, DTensor) else g) for name, g in named]
        local = [(name, g) for name, g in local if g.numel() > 0]
        found = _any_non_finite([g for _, g in local])
        device = trainer.strategy.root_device
        flag = torch.tensor([1.0 if found else 0.0], device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        mine = [(name, kind) for name, g in local if (kind := _kind(g)) is not None]
        message = self._message(trainer, pl_module, _gather(mine))
        self.last_report = message
        if self.action == "raise":
            raise NonFiniteGradientError(message)
        for param in pl_module.parameters():
            param.grad = None  # the optimizer skips parameters without gradients: the weights stay as they are
        trainer.should_stop = True
        rank_zero_warn(message + " Training stops after this batch (NonFiniteGradients(action='stop')).")

    # ------------------------------------------------------------------ the message

    def _message(self, trainer: pl.Trainer, pl_module: pl.LightningModule, found: list[tuple[str, str, int]]) -> str:
        order = {name: i for i, (name, _) in enumerate(pl_module.named_parameters())}
        by_name: dict[str, tuple[str, list[int]]] = {}
        for name, kind, rank in found:
            _, ranks = by_name.setdefault(name, (kind, []))
            ranks.append(rank)
            if kind == "NaN":
                by_name[name] = ("NaN", ranks)
        names = sorted(by_name, key=lambda n: order.get(n, len(order)))
        first = names[0]
        kind, ranks = by_name[first]
        unit = self._unit_of(pl_module, first)
        where = f" in sharding unit '{unit}'" if unit is not None else ""
        listed = ", ".join(f"{n} ({by_name[n][0]})" for n in names[: self.max_names])
        more = f" and {len(names) - self.max_names} more" if len(names) > self.max_names else ""
        return (
            f"Non-finite gradients at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch "
            f"{self._batch_idx}), found before the optimizer step, so the weights were not updated. First: parameter "
            f"'{first}'{where}, {kind} on {_ranks(ranks)}. {len(names)} parameter(s) affected: {listed}{more}. "
            f"Usual causes: a learning rate too high, a loss that produced NaN/inf (log of 0, division by 0), "
            f"overflow in low precision, or bad input data in this batch."
        )

    def _unit_of(self, pl_module: pl.LightningModule, param_name: str) -> Optional[str]:
        """The innermost sharding unit whose subtree holds ``param_name`` (None without sharding)."""
        if self._units is None:
            units = [name for name, m in pl_module.named_modules() if isinstance(m, HSDPModule)]
            self._units = sorted(units, key=len, reverse=True)  # innermost (longest name) first
        for unit in self._units:
            if unit == "" or param_name.startswith(unit + "."):
                return unit or "<root>"
        return None


def _any_non_finite(tensors: Sequence[torch.Tensor]) -> bool:
    if not tensors:
        return False
    # The max-norm is NaN or inf exactly when some element is, and never overflows.
    total = torch.nn.utils.get_total_norm(list(tensors), norm_type=math.inf)
    return not bool(torch.isfinite(total))


def _kind(tensor: torch.Tensor) -> Optional[str]:
    if bool(torch.isfinite(tensor).all()):
        return None
    return "NaN" if bool(torch.isnan(tensor).any()) else "inf"


def _gather(mine: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Every rank's offending (name, kind), tagged with the rank that holds the shard."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [(name, kind, 0) for name, kind in mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [(name, kind, rank) for rank, part in enumerate(everyone) for name, kind in part]


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(set(ranks))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
