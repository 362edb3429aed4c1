"""The Trainer's precision plugin: :class:`~hp_lightning.frontends.precision.PrecisionCore` under Lightning's hooks."""

from __future__ import annotations

from typing import Union

from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from hp_lightning.core.precision_flags import SUPPORTED_PRECISION, normalize_precision
from hp_lightning.frontends.precision import PrecisionCore

__all__ = ["SUPPORTED_PRECISION", "HSDPPrecision", "normalize_precision", "precision_from_lightning"]


class HSDPPrecision(PrecisionCore, Precision):  # type: ignore[misc]  # Lightning types `precision` as its Literal of flags; ours is the str normalize_precision returns
    """Precision for FSDP2 under the Trainer (flags: :mod:`hp_lightning.core.precision_flags`)."""

    replaces = (Precision, MixedPrecision, HalfPrecision)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizable, clip_val: Union[int, float]) -> None:
        self.clip_norm(optimizer, clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizable, clip_val: Union[int, float]) -> None:
        self.clip_value(optimizer, clip_val)


#: Lightning's plugin for ``Trainer(precision=...)`` as ours (ValueError for what FSDP2 cannot honour).
precision_from_lightning = HSDPPrecision.from_lightning
