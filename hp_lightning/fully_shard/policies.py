"""Mixed-precision and offload policies, and the dtype spellings users write in YAML.

The policy classes are PyTorch FSDP2's own frozen dataclasses, re-exported so that a
HyperParallel user's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
keeps working. This module adds what YAML needs: dtypes as strings (``"bf16"``), and a builder
that validates them at the boundary.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from hp_lightning.fully_shard.errors import ArgumentTypeError

__all__ = [
    "CPUOffloadPolicy",
    "DTYPE_NAMES",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "build_mp_policy",
    "parse_dtype",
]

#: Accepted spellings of the floating dtypes FSDP computes or reduces in.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(value: str | torch.dtype | None, *, name: str) -> torch.dtype | None:
    """Turn ``"bf16"`` / ``torch.bfloat16`` / ``None`` into a ``torch.dtype`` (or None).

    Args:
        value: a dtype, one of :data:`DTYPE_NAMES`, or None (inherit).
        name: the option's name, for the error message.

    Raises:
        TypeError: for anything that is not a string, a dtype or None.
        ValueError: for an unknown string or a non-floating dtype.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in DTYPE_NAMES:
            raise ValueError(
                f"{name} must be one of {sorted(DTYPE_NAMES)} or None; got {value!r}. "
                f"Use for example {name}='bf16'."
            )
        dtype = DTYPE_NAMES[key]
    else:
        raise ArgumentTypeError(f"{name} must be a string like 'bf16', a torch.dtype or None; got {type(value).__name__} {value!r}.")
    if not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype; got {dtype}. Use 'bf16', 'fp16' or 'fp32'.")
    return dtype


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
