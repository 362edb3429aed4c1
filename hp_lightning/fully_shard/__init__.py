"""The seed's ``fully_shard`` API (HyperParallel) on PyTorch FSDP2."""

from hp_lightning.fully_shard.api import REDUCE_OPS, ArgumentTypeError, HSDPModule, adopt_sharded, fully_shard, hsdp_modules, to_model_placements, validate_scaling_factor
from hp_lightning.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, build_mp_policy, parse_dtype
from hp_lightning.fully_shard.state_dict import get_model_state_dict, set_model_state_dict

__all__ = [
    "ArgumentTypeError",
    "CPUOffloadPolicy",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "REDUCE_OPS",
    "adopt_sharded",
    "build_mp_policy",
    "fully_shard",
    "get_model_state_dict",
    "hsdp_modules",
    "parse_dtype",
    "set_model_state_dict",
    "to_model_placements",
    "validate_scaling_factor",
]
