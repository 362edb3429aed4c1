"""This rank's part of a pipeline, decided once from the options: what the strategy runs and the planner costs.

The Trainer strategy's pipeline steps and the planner's simulated ranks both call :func:`plan_cut`
and :func:`hold_gathered`, so the plan the planner costs is the plan the strategy runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule

from hp_lightning.core.options import HSDPOptions, PipelineOptions
from hp_lightning.parallel.pipeline.auto import resolve_split_points
from hp_lightning.parallel.pipeline.cut import split_stage
from hp_lightning.parallel.pipeline.plan import StagePlan, stage_plan
from hp_lightning.parallel.pipeline_schedules import stages_of_rank


@dataclass(frozen=True)
class StageCut:
    """Where the model is cut and which stages this rank holds.

    Attributes:
        split_points: the resolved split points (``"auto"`` turned into module names).
        plan: every stage's units and parameter bytes (the same on every rank).
        stages: this rank's stages, increasing.
        num_stages: stages in the whole pipeline.
    """

    split_points: list[str]
    plan: list[StagePlan]
    stages: list[int]
    num_stages: int

    def apply(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """Cut ``model`` to this rank's stages in place; returns (units kept, units removed)."""
        return split_stage(model, self.split_points, self.stages)


def plan_cut(model: nn.Module, options: HSDPOptions, pp_rank: int) -> StageCut:
    """The cut ``options`` ask for, for pipeline rank ``pp_rank``; reads only sizes of the whole ``model`` (meta is fine).

    Raises:
        ValueError: split points that are not modules of ``model``, or ``"auto"`` on a model
            without a list of blocks to cut (naming the fix).
    """
    pp, per_rank = options.pipeline_parallel_size, options.pipeline_stages_per_rank
    assert options.pipeline_split_points is not None, "the options resolve pipeline_split_points=None to 'auto' under a pipeline"
    split_points = resolve_split_points(model, options.pipeline_split_points, pp * per_rank)
    return StageCut(split_points, stage_plan(model, split_points), stages_of_rank(options.pipeline_schedule, pp_rank, pp, per_rank), pp * per_rank)


def hold_gathered(stage_roots: Sequence[nn.Module], options: PipelineOptions) -> None:
    """``pipeline_keep_gathered``: each sharded stage root keeps its parameters gathered from forward to the step's reduction."""
    if options.pipeline_keep_gathered:
        for root in stage_roots:
            if isinstance(root, FSDPModule):
                root.set_reshard_after_forward(False)
