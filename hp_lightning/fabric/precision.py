"""Fabric's precision plugin: :class:`~hp_lightning.frontends.precision.PrecisionCore` under Fabric's hooks."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from hp_lightning.frontends.precision import PrecisionCore, cast_floating

__all__ = ["HSDPPrecision", "precision_from_fabric"]


class HSDPPrecision(PrecisionCore, Precision):  # type: ignore[misc]  # Lightning types `precision` as its Literal of flags; ours is the str normalize_precision returns
    """Precision for FSDP2 under Fabric (flags: :mod:`hp_lightning.core.precision_flags`)."""

    front_end = "Fabric"
    replaces = (Precision, MixedPrecision, HalfPrecision)

    @override
    def convert_output(self, data: Any) -> Any:
        # As Fabric's own plugins: outputs come back in the default dtype, so the loss is fp32.
        return data if self.precision == "32-true" else cast_floating(data, torch.get_default_dtype())


#: Fabric's plugin for ``Fabric(precision=...)`` as ours (ValueError for what FSDP2 cannot honour).
precision_from_fabric = HSDPPrecision.from_lightning
