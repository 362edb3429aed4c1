"""Pipeline parallelism (PP): each rank builds one stage of the model and runs it with ``torch.distributed.pipelining``.

The model is cut at *split points*, module names in its own hierarchy (``"net.blocks.2"`` starts
stage 1 at block 2), given or chosen (``"auto"``, :func:`auto_split_points`: the model's list of
blocks cut so that the largest stage holds the fewest parameter bytes, embeddings on the first
stage, final norm and head on the last). The cut follows torchtitan's convention, so parameter
names never change and a checkpoint of a pipelined run is keyed like one of the whole model:

* the modules the split points cut between (*units*) are the children of every module on the way
  to a split point, in registration order; the split points must be units, in that order;
* a stage keeps its units; every other unit that holds parameters or buffers is removed from it:
  an entry of an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` is deleted while the
  others keep their keys (``blocks.2`` stays ``blocks.2``; the list iterates and indexes over the
  entries it still holds, so ``for block in self.blocks``, ``self.layers[0]`` and torch's own
  ``nn.TransformerEncoder`` work unchanged); any other module is set to ``None``: the model's
  ``forward`` must skip a ``None`` module (``h = self.emb(x) if self.emb is not None else x``),
  as torchtitan's models do. A model that does not fails loudly (``'NoneType' object is not
  callable``). A pass-through placeholder would not: ``self.emb(x) + self.pos(pos)`` on a later
  stage would add positions to the hidden state silently;
* a unit with nothing in its ``state_dict`` (a loss module, an activation, a rotary-embedding
  table kept in non-persistent buffers) stays on every stage, unless it is an entry of a
  container: entries run in sequence, so an activation between two blocks of an
  ``nn.Sequential`` runs on its own stage only (kept everywhere, it would run once per stage);
* parameters held directly by a module on the way (not by a unit) belong to no single stage and
  are refused;
* a parameter the model uses under several names on different stages (an LM head tied to the
  embedding: ``head.weight = tok.weight``) becomes one copy per stage that holds one of its names,
  kept equal by Megatron-LM's rule (:class:`TiedParameter`): the copies start equal (the first
  holder's values are broadcast once), and every step their gradients are summed over the
  stages that hold them before the optimizer, so each copy takes the step one process takes.

The stage runs the LightningModule's ``forward`` on its units. Schedules are torch's own
(``ScheduleGPipe``, ``Schedule1F1B``); the loss is computed on the last stage per micro-batch.
Trade-off: more stages hold less of the model each, but every stage idles while the pipeline
fills and drains — the *bubble*, ``(stages - 1) / (micro-batches + stages - 1)`` of a step for
GPipe and 1F1B alike; 1F1B holds at most ``stages`` micro-batches of activations instead of all.

The modules, one job each: :mod:`.cut` (where a model may be cut, and the cut), :mod:`.auto`
(balanced split points), :mod:`.plan` (each stage's units and bytes, the table), :mod:`.runner`
(torch's stage and schedule, one batch at a time), :mod:`.stages` (this rank's cut, decided
once from the options: the strategy's and the planner's), :mod:`.ties` (parameters tied across stages)
and :mod:`.gather` (a full checkpoint gathered from every stage). Their public names are
importable from here.
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
