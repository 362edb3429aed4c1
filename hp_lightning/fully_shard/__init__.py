"""The seed's ``fully_shard`` API (HyperParallel) on PyTorch FSDP2."""

from hp_lightning.fully_shard.api import (
    REDUCE_OPS,
    HSDPModule,
    adopt_sharded,
    fully_shard,
    hsdp_modules,
    validate_scaling_factor,
)
from hp_lightning.fully_shard.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    build_mp_policy,
    parse_dtype,
)

__all__ = [
    "CPUOffloadPolicy",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "REDUCE_OPS",
    "adopt_sharded",
    "build_mp_policy",
    "fully_shard",
    "hsdp_modules",
    "parse_dtype",
    "validate_scaling_factor",
]
