"""The precision flags both front ends accept, and what each means for FSDP2's dtype policy.

=================  ===============================  ========================  =================
``precision=``     sharded (master) weights         compute                   gradient reduce
=================  ===============================  ========================  =================
``"32-true"``      fp32                             fp32                      fp32
``"bf16-mixed"``   fp32                             bf16 (FSDP param_dtype    fp32
                                                    + autocast)
``"bf16-true"``    bf16                             bf16                      bf16
=================  ===============================  ========================  =================

``param_dtype`` / ``reduce_dtype`` given to the strategy override the derived values. fp16
(``"16-mixed"``, ``"16-true"``) needs a gradient scaler that understands sharded gradients and is
refused with a clear message; so are fp64, transformer-engine and bitsandbytes.

Both front ends' plugins (:class:`hp_lightning.frontends.precision.PrecisionCore`) read this table, so a flag means the same in either.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch

#: Precision flags HSDPStrategy accepts, and what each means for (param_dtype, reduce_dtype).
SUPPORTED_PRECISION: dict[str, tuple[Optional[torch.dtype], Optional[torch.dtype]]] = {
    "32-true": (None, None),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "bf16-true": (None, None),
}
#: Short spellings Lightning also accepts, mapped to the canonical flag.
PRECISION_ALIASES: dict[Any, str] = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}


def normalize_precision(value: Any, front_end: str = "Trainer") -> str:
    """Return the canonical flag for ``value`` (``"bf16-mixed"``, ``"32"``, ``32``, ...) or raise a ValueError that lists the choices.

    ``front_end``: ``"Trainer"`` or ``"Fabric"``, the call the error message tells the user to fix.
    """
    flag = PRECISION_ALIASES.get(value, value)
    if flag not in SUPPORTED_PRECISION:
        fp16 = flag in ("16-mixed", "16", 16)
        hint = " fp16 mixed precision needs a sharded gradient scaler; use 'bf16-mixed' (same memory, no scaler)." if fp16 else ""
        raise ValueError(
            f"HSDPStrategy supports precision {sorted(SUPPORTED_PRECISION)}; got {value!r}.{hint} "
            f"Set {front_end}(precision='bf16-mixed') or '32-true'."
        )
    return flag


def true_dtype(flag: str) -> Optional[torch.dtype]:
    """The dtype the whole module (sharded weights included) is converted to under ``flag``, if any."""
    return torch.bfloat16 if normalize_precision(flag) == "bf16-true" else None


@contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Create floating-point tensors in ``dtype`` inside the block (restored on exit, also on error)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
