"""Fabric precision plugin for the Fabric ``HSDPStrategy``: the same flags as the Trainer's.

The flag table (what ``"32-true"``, ``"bf16-mixed"`` and ``"bf16-true"`` mean for sharded
weights, compute and gradient reduction) lives in :mod:`hp_lightning.core.precision_flags`, shared
with the Trainer's plugin. This module adds only what Fabric calls: module conversion, the init
contexts, autocast around ``forward`` and input/output casting.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from typing_extensions import override

from hp_lightning.core import devices
from hp_lightning.core.precision_flags import SUPPORTED_PRECISION, default_dtype, normalize_precision, true_dtype

__all__ = ["HSDPPrecision", "precision_from_fabric"]


class HSDPPrecision(Precision):
    """Precision for FSDP2 under Fabric: dtype policy for sharding, autocast for bf16-mixed.

    The strategy turns the flag into FSDP2's ``MixedPrecisionPolicy`` when it shards (see
    :meth:`derived_param_dtype`); this plugin handles what happens around the model's ``forward``.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` (or ``"32"``, ``32``, ``"bf16"``).
        device_type: where autocast runs; the strategy sets it from its root device.

    Raises:
        ValueError: for any other flag (fp16 and fp64 included), naming the supported ones.
    """

    def __init__(self, precision: Any = "32-true", device_type: str = devices.CPU) -> None:
        self.precision = normalize_precision(precision, front_end="Fabric")  # type: ignore[assignment]
        self.device_type = device_type

    @property
    def derived_param_dtype(self) -> Optional[torch.dtype]:
        """The compute dtype of gathered parameters this flag implies (None: the parameters' own)."""
        return SUPPORTED_PRECISION[self.precision][0]

    @property
    def derived_reduce_dtype(self) -> Optional[torch.dtype]:
        """The gradient reduction dtype this flag implies (None: the gradients' own)."""
        return SUPPORTED_PRECISION[self.precision][1]

    @property
    def true_dtype(self) -> Optional[torch.dtype]:
        """The dtype the whole module (sharded weights included) is converted to, if any."""
        return true_dtype(self.precision)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.true_dtype is not None:
            return module.to(dtype=self.true_dtype)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        if self.true_dtype is None:
            return nullcontext()
        return default_dtype(self.true_dtype)

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

    @override
    def convert_output(self, data: Any) -> Any:
        # As Fabric's own plugins: outputs come back in the default dtype, so the loss is fp32.
        if self.precision == "32-true":
            return data
        return _cast_floating(data, torch.get_default_dtype())


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def precision_from_fabric(plugin: Precision) -> HSDPPrecision:
    """Turn the plugin Fabric's connector chose from ``Fabric(precision=...)`` into ours.

    Raises:
        ValueError: for precision settings FSDP2 sharding cannot honour here (fp16, fp64,
            transformer-engine, bitsandbytes, or any other custom plugin).
    """
    if isinstance(plugin, HSDPPrecision):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
        raise ValueError(
            f"HSDPStrategy supports precision {sorted(SUPPORTED_PRECISION)}; got {flag!r} (plugin "
            f"{type(plugin).__name__}). Set Fabric(precision='bf16-mixed') or '32-true'."
        )
    device = getattr(plugin, "device", devices.CPU)
    return HSDPPrecision(flag, device_type=str(device))
