"""Parallelisms that compose with ``fully_shard``: tensor parallelism and expert parallelism.

Both are applied before ``fully_shard``, on their own dim of a named device mesh; FSDP then shards
the resulting DTensors over the data-parallel dims (see ``README.md``, "Composing parallelisms").
"""

from hp_lightning.parallel.expert import ExpertParallel, expert_parallel_size, find_expert_modules
from hp_lightning.parallel.tensor import TP_STYLES, hf_tp_plan, parallelize_module, resolve_tp_plan, validate_tp_plan

__all__ = [
    "ExpertParallel",
    "TP_STYLES",
    "expert_parallel_size",
    "find_expert_modules",
    "hf_tp_plan",
    "parallelize_module",
    "resolve_tp_plan",
    "validate_tp_plan",
]
