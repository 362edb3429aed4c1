"""``Trainer(accelerator="auto")`` on Ascend machines: the one step a registered accelerator cannot take.

Lightning 2.6 resolves ``"auto"`` in ``_AcceleratorConnector._choose_auto_accelerator``, a fixed
chain (TPU, MPS, CUDA, else CPU) that never consults the ``AcceleratorRegistry``.
:func:`install_auto_selection` wraps that static method: where Lightning would fall back to the CPU
and NPUs are present, the answer is ``"npu"`` (asked only then; without ``torch_npu`` a path lookup).
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from hp_lightning._lightning_private import accelerator_connector_class
from hp_lightning.core import devices

_ATTRIBUTE = "_choose_auto_accelerator"
_MARK = "_hp_lightning_wrapped"


def choose_auto_accelerator(lightning_choice: str) -> str:
    """Lightning's choice for ``accelerator="auto"``, with ``"npu"`` in place of a CPU fallback on NPU machines."""
    if lightning_choice == devices.CPU and devices.npu_available():
        return devices.NPU
    return lightning_choice


def auto_selection_installed() -> bool:
    """True when :func:`install_auto_selection` is in effect."""
    current = accelerator_connector_class().__dict__.get(_ATTRIBUTE)
    return isinstance(current, staticmethod) and getattr(current.__func__, _MARK, None) is not None


def install_auto_selection() -> bool:
    """Make ``Trainer(accelerator="auto")`` pick NPUs where Lightning would pick the CPU (idempotent).

    True when this call installed the wrapper; False when it was in place or the hook is missing (said in a warning).
    """
    if auto_selection_installed():
        return False
    original = accelerator_connector_class().__dict__.get(_ATTRIBUTE)
    if not isinstance(original, staticmethod):
        rank_zero_warn(
            f"hp_lightning could not extend Lightning's accelerator='auto' to NPUs: "
            f"_AcceleratorConnector.{_ATTRIBUTE} is missing in this Lightning version. "
            f"Select NPUs with Trainer(accelerator={devices.NPU!r})."
        )
        return False
    lightning_choose: Callable[[], str] = original.__func__

    def _choose_auto_accelerator() -> str:
        return choose_auto_accelerator(lightning_choose())

    setattr(_choose_auto_accelerator, _MARK, lightning_choose)
    setattr(accelerator_connector_class(), _ATTRIBUTE, staticmethod(_choose_auto_accelerator))
    return True


def uninstall_auto_selection() -> bool:
    """Restore Lightning's own ``accelerator="auto"``; True when a wrapper was removed."""
    if not auto_selection_installed():
        return False
    current = accelerator_connector_class().__dict__[_ATTRIBUTE]
    setattr(accelerator_connector_class(), _ATTRIBUTE, staticmethod(getattr(current.__func__, _MARK)))
    return True
