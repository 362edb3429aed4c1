"""Optimizers created before ``fabric.setup`` sharded the model: pointed at the sharded parameters, or refused.

Sharding replaces every parameter (FSDP2 registers new DTensor parameters), so an optimizer
created before setup would update tensors the model no longer uses.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

from torch import Tensor
from torch.optim import Optimizer


class ReplacedParameters:
    """The parameters sharding replaced, by id and weakly held (an optimizer still holding one is stale)."""

    def __init__(self) -> None:
        self._replaced: dict[int, weakref.ref] = {}

    def record(self, before: Iterable[Tensor], after: Iterable[Tensor]) -> None:
        current = {id(p) for p in after}
        for param in before:
            if id(param) not in current:
                self._replaced[id(param)] = weakref.ref(param)

    def stale(self, optimizer: Optimizer) -> list[Tensor]:
        """The parameters ``optimizer`` holds that sharding replaced."""
        params: list[Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
        return [p for p in params if (ref := self._replaced.get(id(p))) is not None and ref() is p]

    def refuse_stale(self, optimizer: Optimizer, *, models_set_up: bool) -> None:
        """Refuse ``optimizer`` (ValueError) unless a model is set up and it holds none of the replaced parameters."""
        stale = self.stale(optimizer)
        if models_set_up and not stale:
            return
        reason = (
            "no model was set up yet" if not models_set_up
            else f"it holds {len(stale)} of the model's parameters from before sharding, which the model no longer uses"
        )
        raise ValueError(
            f"fabric.setup_optimizers(optimizer): {reason}. HSDPStrategy replaces the parameters when it shards "
            f"the model, so create the optimizer afterwards: model = fabric.setup_module(model); "
            f"optimizer = torch.optim.AdamW(model.parameters()); optimizer = fabric.setup_optimizers(optimizer). "
            f"Or pass both to fabric.setup(model, optimizer), which points the optimizer at the sharded parameters."
        )


def rebind_optimizer(optimizer: Optimizer, before: Mapping[int, tuple[str, Tensor]], after: Mapping[str, Tensor], index: int) -> None:
    """Swap each of ``optimizer``'s pre-sharding parameters (``before``: id -> (name, param)) for ``after[name]``.

    Raises:
        ValueError: for a parameter that is not the model's, or an optimizer that already holds
            state (it stepped before setup).
    """
    current = {id(p) for p in after.values()}
    groups: list[list[Tensor]] = []
    moved = 0
    for group_index, group in enumerate(optimizer.param_groups):
        params = []
        for param in group["params"]:
            if id(param) in current:
                params.append(param)
            elif id(param) in before:
                params.append(after[before[id(param)][0]])
                moved += 1
            else:
                raise ValueError(
                    f"fabric.setup(model, optimizer): optimizer {index} (param group {group_index}) holds a parameter of "
                    f"shape {tuple(param.shape)} that is not one of the model's, so it cannot be pointed at a sharded one. "
                    f"Build the optimizer from model.parameters(), or create it after fabric.setup_module(model) and pass "
                    f"it to fabric.setup_optimizers(optimizer)."
                )
        groups.append(params)
    if moved and any(optimizer.state.values()):
        raise ValueError(
            f"fabric.setup(model, optimizer): optimizer {index} already holds state (it stepped before setup) for "
            f"parameters that sharding replaced; that state cannot follow them. Create the optimizer after "
            f"fabric.setup_module(model), then call fabric.setup_optimizers(optimizer)."
        )
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params
