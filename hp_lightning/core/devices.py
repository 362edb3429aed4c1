"""The one place that names device types.

Everything else in hp_lightning receives a ``torch.device`` (or its ``.type``) from the
accelerator and asks this module what follows from it: the process-group backend, the
device module (``torch.cuda`` / ``torch.npu``), whether the type is an accelerator at all,
how to set the current device, synchronize, free cached memory and read memory statistics.
``tests/unit/test_no_device_literals.py`` scans the package for device-name literals outside
this file and ``hp_lightning/accelerators/``.

``torch.npu`` only exists once ``torch_npu`` (Huawei's Ascend extension for PyTorch) is imported.
With PyTorch >= 2.5 and a recent ``torch_npu``, ``import torch`` already imports it (out-of-tree
backend autoload, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); otherwise this module imports it on
first use, never at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch

CPU = "cpu"
CUDA = "cuda"
NPU = "npu"

#: Every device type hp_lightning runs on, in the order automatic selection prefers them.
DEVICE_TYPES: tuple[str, ...] = (CUDA, NPU, CPU)

#: Device type -> the collective backend that serves it best.
DEFAULT_BACKENDS: dict[str, str] = {CPU: "gloo", CUDA: "nccl", NPU: "hccl"}

#: Device types whose module lives in an optional package, and the install hint for it.
OPTIONAL_DEVICE_PACKAGES: dict[str, tuple[str, str]] = {
    NPU: ("torch_npu", "pip install 'hp-lightning[npu]' (brings torch_npu; needs the Ascend CANN toolkit)"),
}

#: Environment variable that restricts which devices of a type a process sees.
VISIBLE_DEVICES_ENV: dict[str, str] = {CUDA: "CUDA_VISIBLE_DEVICES", NPU: "ASCEND_RT_VISIBLE_DEVICES"}


def default_backend(device_type: str) -> str:
    """The process-group backend for ``device_type`` (gloo, nccl or hccl); a ValueError for an unknown type."""
    try:
        return DEFAULT_BACKENDS[device_type]
    except KeyError:
        raise ValueError(
            f"No default process-group backend for device type {device_type!r}; expected one of "
            f"{sorted(DEFAULT_BACKENDS)}. Pass process_group_backend=... explicitly."
        ) from None


def process_group_backend(device_type: str, *, host_collectives: bool = False) -> str:
    """The ``backend`` argument of ``init_process_group`` for ranks on ``device_type``.

    ``host_collectives``: also serve collectives on host tensors (gloo) next to the device's backend,
    as in ``"cpu:gloo,cuda:nccl"``; needed when state lives on the host (CPU offload): NCCL / HCCL
    refuse CPU tensors.
    """
    backend = default_backend(device_type)
    if not host_collectives or not is_accelerator(device_type):
        return backend
    return f"{CPU}:{DEFAULT_BACKENDS[CPU]},{device_type}:{backend}"


def is_accelerator(device_type: str) -> bool:
    """True for device types that have their own device module and memory (not the CPU)."""
    return device_type != CPU


def cpu_device() -> torch.device:
    """The host device, where offloaded shards and consolidated checkpoints live."""
    return torch.device(CPU)


def install_hint(device_type: str) -> str:
    """How to install the package that provides ``device_type`` ('' when torch itself does)."""
    return OPTIONAL_DEVICE_PACKAGES.get(device_type, ("", ""))[1]


def import_device_package(device_type: str) -> None:
    """Import the optional package behind ``device_type`` (``torch_npu`` for NPUs); no-op for others.

    Raises:
        ModuleNotFoundError: when the package is not installed; the message says how to install it.
        ImportError: when it is installed but fails to import (for ``torch_npu`` usually a CANN
            toolkit that is missing or not sourced); the original error is chained.
    """
    entry = OPTIONAL_DEVICE_PACKAGES.get(device_type)
    if entry is None or sys.modules.get(entry[0]) is not None:
        return
    package, hint = entry
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"Device type {device_type!r} needs the {package!r} package, which is not installed. "
            f"Install it with: {hint}.",
            name=package,
        )
    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - any failure of a vendor import is reported the same way
        raise ImportError(
            f"Device type {device_type!r} needs {package!r}, which is installed but failed to import "
            f"({type(exc).__name__}: {exc}). Check that its toolkit is installed and its environment set "
            f"(for Ascend: source <CANN install dir>/set_env.sh), or reinstall with: {hint}.",
            name=package,
        ) from exc


def device_module(device_type: str) -> ModuleType | None:
    """Return ``torch.<device_type>`` (``torch.cuda``, ``torch.npu``), or None for the CPU; imports ``torch_npu`` on demand."""
    if not is_accelerator(device_type):
        return None
    import_device_package(device_type)
    return getattr(torch, device_type, None)


def package_installed(device_type: str) -> bool:
    """True when ``device_type`` needs no optional package, or its package can be found (not imported)."""
    entry = OPTIONAL_DEVICE_PACKAGES.get(device_type)
    if entry is None or sys.modules.get(entry[0]) is not None:
        return True
    return importlib.util.find_spec(entry[0]) is not None


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` this process sees (1 for the CPU, 0 when unusable)."""
    if not is_accelerator(device_type):
        return 1
    if not package_installed(device_type):
        return 0
    try:
        module = device_module(device_type)
    except ImportError:
        return 0
    return int(module.device_count()) if module is not None and module.is_available() else 0


def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU (never raises)."""
    return device_count(NPU) > 0


def cuda_available() -> bool:
    """True when this PyTorch build sees at least one CUDA device."""
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
    return None if module is None else int(module.max_memory_allocated(device))


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`max_memory_allocated` on ``device`` (no-op on the CPU)."""
    module = device_module(device.type)
    if module is not None:
        module.reset_peak_memory_stats(device)


def memory_stats(device: torch.device) -> dict[str, Any]:
    """The caching allocator's statistics for ``device`` (what loggers record); {} on the CPU.

    Keys follow ``torch.cuda.memory_stats`` (``"allocated_bytes.all.current"``, ...); torch_npu
    mirrors them for NPUs.
    """
    module = device_module(device.type)
    return {} if module is None else dict(module.memory_stats(device))


def barrier_device_ids(device: torch.device) -> list[int] | None:
    """``device_ids`` for ``torch.distributed.barrier``: the device's index on accelerators, else None.

    With an index the barrier runs on that device instead of whatever device is current
    (which may be device 0 on every rank); on the CPU, None lets gloo use the host.
    """
    return None if not is_accelerator(device.type) or device.index is None else [device.index]


def current_accelerator_type() -> str:
    """The first device type of :data:`DEVICE_TYPES` with a device present (the CPU when none is)."""
    return next((device_type for device_type in DEVICE_TYPES if device_count(device_type) > 0), CPU)
