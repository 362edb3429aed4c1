"""Pipeline parallelism (PP): each rank builds one stage of the model and runs it with ``torch.distributed.pipelining``.

The model is cut at *split points*, module names in its own hierarchy (``"net.blocks.2"`` starts
stage 1 at block 2), given or ``"auto"`` (:func:`auto_split_points`). The cut follows torchtitan's
convention, so parameter names never change and a pipelined checkpoint is keyed like the whole
model's: a stage keeps its *units* (the children of every module on the way to a split point);
another stage's entry of a container is deleted (the others keep their keys), any other unit is
set to ``None``, which the model's ``forward`` must skip (a pass-through placeholder would instead
silently add positions to a later stage's hidden state). Units with nothing in their
``state_dict`` stay on every stage unless they are container entries; parameters held by a module
on the way are refused; a parameter tied across stages is one copy per holder (:class:`TiedCopies`).

Schedules are torch's own; the loss is computed on the last stage per micro-batch. Trade-off: more
stages hold less of the model each, but every stage idles while the pipeline fills and drains
(the *bubble*, ``(stages - 1) / (micro-batches + stages - 1)`` of a step for GPipe and 1F1B; 1F1B
holds at most ``stages`` micro-batches of activations instead of all).
"""

from hp_lightning.core.checks import AUTO, validate_split_points
from hp_lightning.parallel.pipeline.auto import auto_split_points, find_block_list, resolve_split_points
from hp_lightning.parallel.pipeline.cut import CONTAINERS, split_stage, stage_units, stays_on_every_stage, units_by_stage, whole_model_params
from hp_lightning.parallel.pipeline.gather import gather_stages_on_rank0
from hp_lightning.parallel.pipeline.plan import StagePlan, plan_table, stage_plan, stage_reports
from hp_lightning.parallel.pipeline.runner import PipelineRunner, PipelineStage
from hp_lightning.parallel.pipeline.stages import StageCut, hold_gathered, plan_cut
from hp_lightning.parallel.pipeline.ties import TIED_REPLICA_ATTR, TIES_ATTR, TiedCopies, TiedParameter, tied_parameters
from hp_lightning.parallel.pipeline_schedules import SCHEDULES

__all__ = [
    "AUTO",
    "CONTAINERS",
    "PipelineRunner",
    "PipelineStage",
    "SCHEDULES",
    "StageCut",
    "StagePlan",
    "TIED_REPLICA_ATTR",
    "TIES_ATTR",
    "TiedCopies",
    "TiedParameter",
    "auto_split_points",
    "find_block_list",
    "gather_stages_on_rank0",
    "hold_gathered",
    "plan_cut",
    "plan_table",
    "resolve_split_points",
    "split_stage",
    "stage_plan",
    "stage_reports",
    "stage_units",
    "stays_on_every_stage",
    "tied_parameters",
    "units_by_stage",
    "validate_split_points",
    "whole_model_params",
]
