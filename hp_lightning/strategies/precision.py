"""Lightning precision plugin for HSDPStrategy: precision flags mapped onto FSDP2's policy.

=================  ===============================  ========================  =================
``precision=``     sharded (master) weights         compute                   gradient reduce
=================  ===============================  ========================  =================
``"32-true"``      fp32                             fp32                      fp32
``"bf16-mixed"``   fp32                             bf16 (FSDP param_dtype    fp32
                                                    + autocast)
``"bf16-true"``    bf16                             bf16                      bf16
=================  ===============================  ========================  =================

``param_dtype`` / ``reduce_dtype`` given to the strategy override the derived values. fp16
("16-mixed") needs a gradient scaler that understands sharded gradients and is refused with a
clear message; so are fp64, transformer-engine and bitsandbytes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from typing_extensions import override

from hp_lightning.core import devices
from hp_lightning.core.gradients import clip_grad_norm_, clip_grad_value_
from hp_lightning.core.precision_flags import SUPPORTED_PRECISION, normalize_precision
from hp_lightning.core.precision_flags import default_dtype as _default_dtype

__all__ = ["SUPPORTED_PRECISION", "HSDPPrecision", "normalize_precision", "precision_from_lightning"]


class HSDPPrecision(Precision):
    """Precision for FSDP2: dtype policy for sharding, autocast for bf16-mixed, DTensor-aware clipping.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``.
        device_type: where autocast runs; the strategy sets it from its root device.
    """

    def __init__(self, precision: str = "32-true", device_type: str = devices.CPU) -> None:
        self.precision = normalize_precision(precision)  # type: ignore[assignment]
        self.device_type = device_type

    @property
    def derived_param_dtype(self) -> torch.dtype | None:
        return SUPPORTED_PRECISION[self.precision][0]

    @property
    def derived_reduce_dtype(self) -> torch.dtype | None:
        return SUPPORTED_PRECISION[self.precision][1]

    @property
    def true_dtype(self) -> torch.dtype | None:
        """The dtype the whole module (sharded weights included) is converted to, if any."""
        return torch.bfloat16 if self.precision == "bf16-true" else None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.true_dtype is not None:
            return module.to(dtype=self.true_dtype)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        if self.true_dtype is None:
            return nullcontext()
        return _default_dtype(self.true_dtype)

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.true_dtype is None:
            return data
        return _cast_floating(data, self.true_dtype)

    #: Under pipeline parallelism, the group of this rank's stages: the norm is over all of them.
    pipeline_group: Any = None
    #: The ranks holding the same parameters: ignored parameters' norms are averaged over them.
    data_parallel_group: Any = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizable, clip_val: int | float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val, across=self.pipeline_group, same_params=self.data_parallel_group)

    @override
    def clip_grad_by_value(self, optimizer: Optimizable, clip_val: int | float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def precision_from_lightning(plugin: Precision) -> HSDPPrecision:
    """Turn the plugin Lightning's connector chose from ``Trainer(precision=...)`` into ours.

    Raises:
        ValueError: for precision settings FSDP2 sharding cannot honour here.
    """
    if isinstance(plugin, HSDPPrecision):
        return plugin
    flag = getattr(plugin, "precision", None)
    supported_types = {"Precision", "MixedPrecision", "HalfPrecision"}
    if type(plugin).__name__ not in supported_types:
        raise ValueError(
            f"HSDPStrategy supports precision {sorted(SUPPORTED_PRECISION)}; got {flag!r} (plugin "
            f"{type(plugin).__name__}). Set Trainer(precision='bf16-mixed') or '32-true'."
        )
    device = getattr(plugin, "device", devices.CPU)
    return HSDPPrecision(normalize_precision(flag), device_type=str(device))
