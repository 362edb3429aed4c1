"""Parallelisms that compose with ``fully_shard``: tensor, expert and pipeline parallelism.

TP and EP are applied before ``fully_shard``, on their own dim of a named device mesh; FSDP then
shards the resulting DTensors over the data-parallel dims. PP cuts the model into stages first;
each stage is sharded over its own data-parallel sub-mesh (see ``README.md``, "Composing
parallelisms").
"""

from hp_lightning.parallel.expert import ExpertParallel, expert_parallel_size, find_expert_modules
from hp_lightning.parallel.pipeline import PipelineRunner, PipelineStage, split_stage, stage_units
from hp_lightning.parallel.tensor import TP_STYLES, hf_tp_plan, parallelize_module, resolve_tp_plan, validate_tp_plan

__all__ = [
    "ExpertParallel",
    "PipelineRunner",
    "PipelineStage",
    "TP_STYLES",
    "expert_parallel_size",
    "find_expert_modules",
    "hf_tp_plan",
    "parallelize_module",
    "resolve_tp_plan",
    "split_stage",
    "stage_units",
    "validate_tp_plan",
]
