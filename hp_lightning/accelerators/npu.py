"""Ascend NPUs for the Lightning Trainer: ``Trainer(accelerator="npu", devices=8, strategy="hsdp")``.

Lightning 2.6 ships no NPU accelerator. ``torch_npu``'s ``torch.npu`` mirrors ``torch.cuda``, so
every device call goes through :mod:`hp_lightning.core.devices`; only the name and the device
parsing are NPU-specific. ``torch_npu`` is imported when an ``NPUAccelerator`` is created (where a
missing install is reported with its fix), never at registration.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableSequence
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from typing_extensions import override

from hp_lightning._lightning_private import AcceleratorRegistryType
from hp_lightning.core import devices

if TYPE_CHECKING:
    import lightning.pytorch as pl

_log = logging.getLogger(__name__)

NAME = devices.NPU


class NPUAccelerator(Accelerator):
    """Accelerator for Huawei Ascend NPUs, through ``torch_npu`` (collectives on HCCL).

    Raises:
        ModuleNotFoundError: when ``torch_npu`` is not installed (the message gives the install command).
        ImportError: when ``torch_npu`` is installed but fails to import (CANN not set up).
    """

    def __init__(self) -> None:
        self._device: torch.device | None = None
        try:
            devices.import_device_package(NAME)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"Trainer(accelerator={NAME!r}) needs torch_npu, the Ascend extension for PyTorch, which is "
                f"not installed. Install it with: {devices.install_hint(NAME)}; or choose "
                f"accelerator='auto' to train on the devices this machine has.",
                name=exc.name,
            ) from None

    @override
    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current NPU (ValueError for another device type)."""
        if device.type != NAME:
            raise ValueError(
                f"NPUAccelerator.setup_device expects an NPU device such as torch.device({NAME!r}, 0); got "
                f"{device}. Use accelerator={device.type!r} for {device.type} devices."
            )
        devices.set_current_device(device)
        self._device = device

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        visible = devices.VISIBLE_DEVICES_ENV[NAME]
        _log.info(f"LOCAL_RANK: {trainer.local_rank} - {visible}: {os.environ.get(visible, 'all')}")
        devices.empty_cache(trainer.strategy.root_device)

    @override
    def get_device_stats(self, device: Union[torch.device, str, int]) -> dict[str, Any]:
        """The NPU caching allocator's statistics for ``device`` (keys as ``torch.cuda.memory_stats``)."""
        return devices.memory_stats(_as_npu_device(device))

    @override
    def teardown(self) -> None:
        """Return the cached blocks of this process's NPU to the driver."""
        if self._device is not None:
            devices.empty_cache(self._device)

    @staticmethod
    @override
    def parse_devices(devices_flag: Union[int, str, list[int], tuple[int, ...]]) -> list[int]:
        """``Trainer(devices=...)`` → NPU indices: ints (count), -1 (all), lists, strings ``"2"``, ``"0,3"``."""
        elastic = dist.is_available() and dist.is_torchelastic_launched()  # torchrun may give each process one device
        return parse_npu_devices(devices_flag, available=devices.device_count(NAME), elastic=elastic)

    @staticmethod
    @override
    def get_parallel_devices(device_indices: list[int]) -> list[torch.device]:
        return [torch.device(NAME, i) for i in device_indices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return devices.device_count(NAME)

    @staticmethod
    @override
    def is_available() -> bool:
        return devices.npu_available()

    @staticmethod
    @override
    def name() -> str:
        return NAME

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: AcceleratorRegistryType) -> None:
        accelerator_registry.register(cls.name(), cls, description="Huawei Ascend NPU (torch_npu)")


def parse_npu_devices(devices_flag: Any, available: int, *, elastic: bool = False) -> list[int]:
    """Turn a ``Trainer(devices=...)`` value into NPU indices, checked against ``available`` NPUs.

    Accepted, as for CUDA in Lightning: an int N > 0, -1 (all), a list or tuple of indices, a string
    holding either (``"4"``, ``"0,3"``, ``"1,"``), and ``"auto"``. ``elastic``: torchrun with one
    visible NPU per process (the indices are other processes' and are not checked).

    Raises:
        TypeError: for values of any other type (bools and floats included).
        ValueError: for 0, ints below -1, unparsable strings, empty or duplicate lists, negative
            indices, or more NPUs than are visible.
    """
    indices = _requested_indices(devices_flag, available)
    if not indices:
        raise ValueError(f"Trainer(devices={devices_flag!r}) selects no NPU. Use devices=-1 for all NPUs or a count like devices=8.")
    if any(i < 0 for i in indices):
        raise ValueError(f"Trainer(devices={devices_flag!r}): NPU indices must be >= 0; got {indices}. Example: devices=[0, 1].")
    if len(set(indices)) != len(indices):
        raise ValueError(f"Trainer(devices={devices_flag!r}) lists an NPU twice: {indices}. List each index once.")
    if elastic and available == 1:
        return indices
    missing = [i for i in indices if i >= available]
    if missing:
        visible = devices.VISIBLE_DEVICES_ENV[NAME]
        if not available:
            raise ValueError(
                f"Trainer(devices={devices_flag!r}) asks for NPUs, but torch_npu reports none. Check the driver "
                f"with `npu-smi info` and the {visible} variable, or use accelerator='cpu'."
            )
        raise ValueError(
            f"Trainer(devices={devices_flag!r}) selects NPU indices {indices}, but this process sees {available} "
            f"NPU(s) (indices 0..{available - 1}), so {missing} do not exist. Ask for at most {available} NPUs, "
            f"or check {visible} and `npu-smi info`."
        )
    return indices


def _requested_indices(value: Any, available: int) -> list[int]:
    if isinstance(value, bool) or not isinstance(value, (int, str, MutableSequence, tuple)):
        raise TypeError(
            f"Trainer(devices=...) for NPUs expects an int, a list of ints or a string; got "
            f"{type(value).__name__} {value!r}. Examples: devices=8, devices=-1, devices=[0, 2], devices='0,2'."
        )
    if isinstance(value, str):
        return _indices_from_string(value, available)
    if isinstance(value, int):
        if value == -1:
            return list(range(available))
        if value < 1:
            raise ValueError(f"Trainer(devices={value!r}) for NPUs expects a count >= 1 or -1 (all NPUs); got {value}.")
        return list(range(value))
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(
                f"Trainer(devices=[...]) for NPUs expects indices as ints; got {type(item).__name__} {item!r} in "
                f"{list(value)}. Example: devices=[0, 1]."
            )
    return list(value)


def _indices_from_string(text: str, available: int) -> list[int]:
    stripped = text.strip()
    if stripped == "auto":
        return list(range(available))
    try:
        parsed: Union[int, list[int]] = (
            [int(part) for part in stripped.split(",") if part.strip()] if "," in stripped else int(stripped)
        )
    except ValueError:
        raise ValueError(
            f"Trainer(devices={text!r}) is not a count or a list of NPU indices. Examples: '8', '-1', '0,3', '1,'."
        ) from None
    return _requested_indices(parsed, available)





def _as_npu_device(device: Union[torch.device, str, int]) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device(NAME, device)
    resolved = torch.device(device)
    if resolved.type != NAME:
        raise ValueError(f"NPUAccelerator.get_device_stats expects an NPU device; got {resolved}.")
    return resolved


def register_npu_accelerator(registry: AcceleratorRegistryType = AcceleratorRegistry) -> bool:
    """Register :class:`NPUAccelerator` as ``"npu"`` in Lightning's registry; True if this call added it.

    Registers without ``torch_npu`` too, so ``Trainer(accelerator="npu")`` then fails with the install
    command instead of Lightning's generic "invalid accelerator name".
    """
    if NAME in registry:
        return False
    NPUAccelerator.register_accelerators(registry)
    return True
