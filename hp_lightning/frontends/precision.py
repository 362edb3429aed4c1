"""Precision for FSDP2, once for both front ends: the flags mapped onto FSDP2's policy, autocast, clipping.

What each flag means is the table in :mod:`hp_lightning.core.precision_flags`; the Trainer's and
Fabric's plugins combine :class:`PrecisionCore` with their Lightning base class.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Optional, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import Self

from hp_lightning.core import devices
from hp_lightning.core.gradients import clip_grad_norm_, clip_grad_value_
from hp_lightning.core.precision_flags import SUPPORTED_PRECISION, default_dtype, normalize_precision, true_dtype


class PrecisionCore:
    """Dtype policy for sharding, autocast for bf16-mixed, casting, and clipping over every shard.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` (or ``"32"``, ``32``, ``"bf16"``).
        device_type: where autocast runs; the strategy sets it from its root device.

    Raises:
        ValueError: for any other flag (fp16 and fp64 included), naming the supported ones.
    """

    #: ``"Trainer"`` or ``"Fabric"``: the call an error message tells the user to fix.
    front_end: ClassVar[str] = "Trainer"
    #: Lightning's plugins for the supported flags, which :meth:`from_lightning` replaces.
    replaces: ClassVar[tuple[type, ...]] = ()
    #: Under pipeline parallelism, the group of this rank's stages: the norm is over all of them.
    pipeline_group: Any = None
    #: The ranks holding the same parameters: ignored parameters' norms are averaged over them.
    data_parallel_group: Any = None

    def __init__(self, precision: Any = "32-true", device_type: str = devices.CPU) -> None:
        self.precision = normalize_precision(precision, front_end=self.front_end)
        self.device_type = device_type

    @classmethod
    def from_lightning(cls, plugin: Any) -> Self:
        """Turn the plugin the front end's connector chose from ``precision=...`` into this one.

        Raises:
            ValueError: for what FSDP2 sharding cannot honour (fp16, fp64, any custom plugin).
        """
        if isinstance(plugin, cls):
            return plugin
        flag = getattr(plugin, "precision", None)
        if type(plugin) not in cls.replaces:
            raise ValueError(
                f"HSDPStrategy supports precision {sorted(SUPPORTED_PRECISION)}; got {flag!r} (plugin "
                f"{type(plugin).__name__}). Set {cls.front_end}(precision='bf16-mixed') or '32-true'."
            )
        return cls(flag, device_type=str(getattr(plugin, "device", devices.CPU)))

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

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module if self.true_dtype is None else module.to(dtype=self.true_dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return nullcontext() if self.true_dtype is None else default_dtype(self.true_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        return data if self.true_dtype is None else cast_floating(data, self.true_dtype)

    def clip_norm(
        self, optimizer: Any, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Scale the optimizer's gradients so their global norm (every shard, every stage) is at most ``max_norm``.

        Returns the norm before clipping, the same on every rank.
        """
        params = self.main_params(optimizer)  # type: ignore[attr-defined]
        return clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, across=self.pipeline_group, same_params=self.data_parallel_group
        )

    def clip_value(self, optimizer: Any, clip_val: Union[float, int]) -> None:
        """Clamp every gradient element (local: no collective)."""
        clip_grad_value_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating-point tensor in it cast to ``dtype``."""
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)
