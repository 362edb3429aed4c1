"""Devices Lightning lacks: Ascend NPUs through ``torch_npu``.

``register_accelerators()`` (called by ``import hp_lightning``) adds ``"npu"`` to Lightning's
``AcceleratorRegistry`` without importing ``torch_npu``; ``install_auto_selection()`` lets
``accelerator="auto"`` choose NPUs where Lightning would fall back to the CPU.
"""

from hp_lightning.accelerators.auto import (
    auto_selection_installed,
    choose_auto_accelerator,
    install_auto_selection,
    uninstall_auto_selection,
)
from hp_lightning.accelerators.npu import NPUAccelerator, parse_npu_devices, register_npu_accelerator


def register_accelerators() -> None:
    """Register hp_lightning's accelerators in Lightning's ``AcceleratorRegistry`` (idempotent)."""
    register_npu_accelerator()


__all__ = [
    "NPUAccelerator",
    "auto_selection_installed",
    "choose_auto_accelerator",
    "install_auto_selection",
    "parse_npu_devices",
    "register_accelerators",
    "register_npu_accelerator",
    "uninstall_auto_selection",
]
