"""This rank's part of a pipeline, decided once from the options: what the strategy runs and the planner costs.

:func:`plan_cut` resolves the split points (``"auto"`` included, from the meta-device model, the
same on every rank), every stage's plan and the stages this rank holds under the schedule's
placement, without changing the model; :meth:`StageCut.apply` then cuts the model to them.
:func:`hold_gathered` is ``pipeline_keep_gathered`` applied to the sharded stage roots. The
Trainer strategy's pipeline steps and the planner's simulated ranks both call these, so the plan
the planner costs is the plan the strategy runs.
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
        plan: every stage's units and parameter bytes, as cut (the same on every rank).
        stages: this rank's stages, increasing (one, or ``pipeline_stages_per_rank`` of them).
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
    """The cut ``options`` ask for, for pipeline rank ``pp_rank`` (the model is not changed).

    Args:
        model: the whole model (on the meta device or not: only parameter sizes are read).
        options: the strategy's options (``pipeline_*`` and ``pipeline_parallel_size``).
        pp_rank: this rank's index along the ``pp`` mesh dim.

    Raises:
        ValueError: split points that are not modules of ``model``, or ``"auto"`` on a model
            without a list of blocks to cut (naming the fix).
    """
    pp = options.pipeline_parallel_size
    per_rank = options.pipeline_stages_per_rank
    schedule = options.pipeline_schedule
    points = options.pipeline_split_points
    assert points is not None, "the options resolve pipeline_split_points=None to 'auto' under a pipeline"
    num_stages = pp * per_rank
    split_points = resolve_split_points(model, points, num_stages)
    return StageCut(split_points, stage_plan(model, split_points), stages_of_rank(schedule, pp_rank, pp, per_rank), num_stages)


def hold_gathered(stage_roots: Sequence[nn.Module], options: PipelineOptions) -> None:
    """``pipeline_keep_gathered``: each sharded stage root keeps its parameters gathered from forward to the step's reduction."""
    if options.pipeline_keep_gathered:
        for root in stage_roots:
            if isinstance(root, FSDPModule):
                root.set_reshard_after_forward(False)
