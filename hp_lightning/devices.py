"""The one place that names device types.

Everything else in hp_lightning receives a ``torch.device`` (or its ``.type``) from the
accelerator and asks this module what follows from it: the process-group backend, the
device module (``torch.cuda`` / ``torch.npu``), whether the type is an accelerator at all.
A test scans the package for device-name literals outside this file.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

CPU = "cpu"
CUDA = "cuda"
NPU = "npu"

#: Device type -> the collective backend that serves it best.
DEFAULT_BACKENDS: dict[str, str] = {CPU: "gloo", CUDA: "nccl", NPU: "hccl"}

#: Device types whose module lives in an optional package, and the install hint for it.
OPTIONAL_DEVICE_PACKAGES: dict[str, tuple[str, str]] = {
    NPU: ("torch_npu", "pip install 'hp-lightning[npu]' (brings torch_npu; needs the Ascend CANN toolkit)"),
}


def default_backend(device_type: str) -> str:
    """Return the process-group backend for ``device_type`` (gloo, nccl or hccl).

    Raises:
        ValueError: for a device type with no known backend.
    """
    try:
        return DEFAULT_BACKENDS[device_type]
    except KeyError:
        raise ValueError(
            f"No default process-group backend for device type {device_type!r}; expected one of "
            f"{sorted(DEFAULT_BACKENDS)}. Pass process_group_backend=... explicitly."
        ) from None


def is_accelerator(device_type: str) -> bool:
    """True for device types that have their own device module and memory (not the CPU)."""
    return device_type != CPU


def cpu_device() -> torch.device:
    """The host device, where offloaded shards and consolidated checkpoints live."""
    return torch.device(CPU)


def device_module(device_type: str) -> ModuleType | None:
    """Return ``torch.<device_type>`` (``torch.cuda``, ``torch.npu``), or None for the CPU.

    ``torch.npu`` only exists once ``torch_npu`` is imported, so it is imported here on demand.
    """
    if not is_accelerator(device_type):
        return None
    if device_type in OPTIONAL_DEVICE_PACKAGES:
        package, _ = OPTIONAL_DEVICE_PACKAGES[device_type]
        importlib.import_module(package)
    return getattr(torch, device_type, None)


def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU."""
    try:
        module = device_module(NPU)
    except ImportError:
        return False
    return module is not None and bool(module.is_available())


def cuda_available() -> bool:
    return torch.cuda.is_available()


def set_current_device(device: torch.device) -> None:
    """Make ``device`` the current device of its type (no-op on the CPU)."""
    module = device_module(device.type)
    if module is not None and device.index is not None:
        module.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on the CPU)."""
    module = device_module(device.type)
    if module is not None:
        module.synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Release cached allocator blocks on ``device`` (no-op on the CPU)."""
    module = device_module(device.type)
    if module is not None:
        module.empty_cache()


def max_memory_allocated(device: torch.device) -> int | None:
    """Peak bytes the allocator handed out on ``device``; None where no allocator tracks it."""
    module = device_module(device.type)
    if module is None:
        return None
    return int(module.max_memory_allocated(device))
