"""A ``full`` checkpoint of a pipeline: every stage's state gathered, whole, on global rank 0."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _whole_on_stage_leader(value: Any, leader: bool) -> Any:
    """One tensor made whole within its stage (a collective over the stage's ranks); kept on the CPU by the leader."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    elif not isinstance(value, torch.Tensor):
        return value if leader else None
    return value.detach().cpu().clone() if leader else None


def gather_stages_on_rank0(state: dict[str, Any], *, stage_leader: bool, pipeline_group: dist.ProcessGroup) -> list[dict[str, Any]]:
    """Every stage's ``state`` with whole CPU tensors, on global rank 0 (an empty list elsewhere).

    torch's full state dict keeps whole tensors on global rank 0 only, which holds one stage; so
    each tensor is gathered within its stage (one at a time), kept by the stage's first
    data-parallel rank, and those ranks send their stage to rank 0 over the pipeline group.

    Args:
        state: a model state dict, or an optimizer one (``{"state": {name: {entry: tensor}}, ...}``).
        stage_leader: this rank is its stage's first data-parallel rank (in rank 0's pipeline group).
    """
    if "state" in state and "param_groups" in state:
        mine: Any = {
            "state": {name: {k: _whole_on_stage_leader(v, stage_leader) for k, v in entries.items()} for name, entries in state["state"].items()},
            "param_groups": state["param_groups"],
        }
    else:
        mine = {key: _whole_on_stage_leader(value, stage_leader) for key, value in state.items()}
    if not stage_leader:
        return []
    stages: Optional[list[Any]] = [None] * dist.get_world_size(pipeline_group) if dist.get_rank() == 0 else None
    dist.gather_object(mine, stages, group=pipeline_group, group_dst=0)
    return stages or []
