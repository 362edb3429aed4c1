"""Parameters tied across stages (an LM head tied to its embedding): found at the cut, kept equal while training."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hp_lightning.core import gradients

#: Where :func:`split_stage` records, on the cut model, its parameters tied across stages.
TIES_ATTR = "_hp_pipeline_ties"
#: Set on a stage's copy of a tied parameter that is not the first holder's: gradient norms
#: count the tied parameter once (on its first holder), as one process holding it once does.
TIED_REPLICA_ATTR = gradients.TIED_REPLICA_ATTR


@dataclass(frozen=True)
class TiedParameter:
    """One parameter that the model reaches under several names, held by more than one stage.

    Attributes:
        names: every name of the parameter in the whole model, in ``named_parameters`` order.
        stages: the stage holding each of ``names``.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]

    @property
    def holders(self) -> tuple[int, ...]:
        """The stages holding a copy, in order; the first one's copy is the reference."""
        return tuple(sorted(set(self.stages)))

    def name_on(self, stage: int) -> Optional[str]:
        """The first of the names ``stage`` holds (None when it holds no copy)."""
        return next((n for n, s in zip(self.names, self.stages) if s == stage), None)


def tied_parameters(model: nn.Module) -> tuple[TiedParameter, ...]:
    """The parameters :func:`split_stage` found tied across stages (empty before a cut, or without ties)."""
    return model.__dict__.get(TIES_ATTR, ())


def find_ties(model: nn.Module, units: Sequence[str], bounds: Sequence[int]) -> tuple[TiedParameter, ...]:
    """Parameters reached under several names whose names lie on different stages (same on every rank)."""
    stage_of_unit = {unit: next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1]) for i, unit in enumerate(units)}
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    ties = []
    for names in names_of.values():
        if len(names) < 2:
            continue
        stages = tuple(next(stage_of_unit[u] for u in units if name.startswith(u + ".")) for name in names)
        if len(set(stages)) > 1:
            ties.append(TiedParameter(tuple(names), stages))
    return tuple(ties)


class TiedCopies:
    """This stage's copies of parameters tied across stages, kept equal by Megatron-LM's rule.

    The copies start equal (the first holder's shards are broadcast once, shard ``i`` to shard
    ``i``: their layouts are checked to line up first), and every batch each copy's new gradient
    (this batch's only, so accumulation never counts one twice) is summed over the holders before
    the optimizer, so equal copies take equal steps. Gradient norms count the parameter once
    (later holders' copies are marked ``TIED_REPLICA_ATTR``). Cost: one all-reduce of the tied
    shard per batch between the holders.

    Raises:
        ValueError: copies whose shapes, dtypes or sharding differ between the stages (on every rank alike).
    """

    def __init__(self, stage_module: nn.Module, *, stage_index: int, num_stages: int, group: dist.ProcessGroup) -> None:
        self.copies: list[tuple[TiedParameter, nn.Parameter, dist.ProcessGroup, int]] = []
        ties = tied_parameters(stage_module)
        if not ties:
            return
        groups = self._groups(ties, num_stages, group)
        stage_ranks = dist.get_process_group_ranks(group)
        mine = []
        for tie, tie_group in zip(ties, groups):
            name = tie.name_on(stage_index)
            param = stage_module.get_parameter(name) if name is not None else None
            mine.append(None if param is None else _layout(param))
            if param is not None:
                assert tie_group is not None
                self.copies.append((tie, param, tie_group, stage_ranks[tie.holders[0]]))
        layouts: list[Any] = [None] * num_stages
        dist.all_gather_object(layouts, mine, group=group)
        for index, tie in enumerate(ties):
            seen = {stage: layouts[stage][index] for stage in tie.holders}
            if len(set(seen.values())) > 1:
                described = "; ".join(f"stage {s} ({tie.name_on(s)}): {layout}" for s, layout in seen.items())
                raise ValueError(
                    f"Pipeline: {list(tie.names)} are one tied parameter held by stages {list(tie.holders)}, whose "
                    f"copies must have the same shape, dtype and sharding to be kept equal shard by shard; got {described}. "
                    f"Shard them alike (the same shard_placement_fn result for both names), or untie them in the model."
                )
        with torch.no_grad():
            for tie, param, tie_group, first in self.copies:
                dist.broadcast(_local_of(param), src=first, group=tie_group)
                if stage_index != tie.holders[0]:
                    setattr(param, TIED_REPLICA_ATTR, True)

    @staticmethod
    def _groups(ties: Sequence[TiedParameter], num_stages: int, group: dist.ProcessGroup) -> list[Optional[dist.ProcessGroup]]:
        """Each tie's group of holders (this rank's): the pipeline group, or a subgroup built on every rank."""
        everyone = tuple(range(num_stages))
        if all(tie.holders == everyone for tie in ties):
            return [group] * len(ties)
        # new_group is a collective of the whole world: every rank builds every pipeline group's subgroups,
        # in the same order (the ties are found identically on every rank).
        pipelines: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, tuple(dist.get_process_group_ranks(group)))
        me = dist.get_rank()
        out: list[Optional[dist.ProcessGroup]] = []
        for tie in ties:
            if tie.holders == everyone:
                out.append(group)
                continue
            chosen = None
            for ranks in sorted(set(pipelines)):
                holders = [ranks[s] for s in tie.holders]
                subgroup = dist.new_group(holders)
                if me in holders:
                    chosen = subgroup
            out.append(chosen)
        return out

    def set_aside_grads(self) -> list[Optional[torch.Tensor]]:
        """Take the copies' gradients aside (an accumulation window's earlier batches), leaving None."""
        earlier = [param.grad for _, param, _, _ in self.copies]
        for _, param, _, _ in self.copies:
            param.grad = None
        return earlier

    @torch.no_grad()
    def sum_grads(self, earlier: list[Optional[torch.Tensor]]) -> None:
        """Sum this batch's gradient of each copy over its holders, then add the earlier batches' back."""
        for (_, param, tie_group, _), before in zip(self.copies, earlier):
            new = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(_local_of(new), group=tie_group)
            if before is not None:
                before.add_(new)
                new = before
            param.grad = new


def _local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes land in it), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _layout(param: torch.Tensor) -> str:
    """What must agree between two copies of a tied parameter for their shards to line up."""
    if isinstance(param, DTensor):
        return (
            f"shape {tuple(param.shape)}, {param.dtype}, placements {tuple(map(str, param.placements))} over a mesh of "
            f"{tuple(param.device_mesh.shape)}, local shard {tuple(param.to_local().shape)}"
        )
    return f"shape {tuple(param.shape)}, {param.dtype}, whole on every rank"
