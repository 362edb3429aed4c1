"""Mixed-precision and offload policies (FSDP2's own, re-exported as HyperParallel spells them), and YAML's dtype strings."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from hp_lightning.core.checks import DTYPE_NAMES, parse_dtype

__all__ = [
    "CPUOffloadPolicy",
    "DTYPE_NAMES",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "build_mp_policy",
    "parse_dtype",
]

def build_mp_policy(
    param_dtype: str | torch.dtype | None = None,
    reduce_dtype: str | torch.dtype | None = None,
    output_dtype: str | torch.dtype | None = None,
) -> MixedPrecisionPolicy:
    """Build FSDP2's :class:`MixedPrecisionPolicy` from strings or dtypes.

    ``param_dtype`` is what the all-gathered parameters (and so the forward/backward compute)
    use; the sharded master weights keep their own dtype. ``reduce_dtype`` is what gradients are
    reduce-scattered / all-reduced in: keeping it at fp32 while computing in bf16 costs twice the
    gradient bandwidth and buys exact accumulation across ranks.
    """
    return MixedPrecisionPolicy(
        param_dtype=parse_dtype(param_dtype, name="param_dtype"),
        reduce_dtype=parse_dtype(reduce_dtype, name="reduce_dtype"),
        output_dtype=parse_dtype(output_dtype, name="output_dtype"),
    )
