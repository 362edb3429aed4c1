"""hp_lightning: HyperParallel-style FSDP/HSDP (``fully_shard``) for the Lightning Trainer.

Importing this package registers the strategy names ``"hsdp"``, ``"hp_fsdp"`` and
``"hsdp_cpu_offload"`` in Lightning's ``StrategyRegistry``, the accelerator ``"npu"`` (Ascend,
through ``torch_npu``, which is not imported here) in its ``AcceleratorRegistry``, and lets
``accelerator="auto"`` choose NPUs where Lightning would fall back to the CPU.
"""

from lightning.pytorch.strategies import StrategyRegistry

from hp_lightning.accelerators import NPUAccelerator, install_auto_selection, register_accelerators
from hp_lightning.checkpoint import ResumableLoader, load_weights
from hp_lightning.fully_shard import (
    CPUOffloadPolicy,
    HSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from hp_lightning.mesh import init_device_mesh
from hp_lightning.strategies import HSDPPrecision, HSDPStrategy

__version__ = "0.1.0"


def _register() -> None:
    if "hsdp" not in StrategyRegistry:
        HSDPStrategy.register_strategies(StrategyRegistry)
    register_accelerators()
    install_auto_selection()


_register()

__all__ = [
    "CPUOffloadPolicy",
    "HSDPModule",
    "HSDPPrecision",
    "HSDPStrategy",
    "MixedPrecisionPolicy",
    "NPUAccelerator",
    "OffloadPolicy",
    "ResumableLoader",
    "__version__",
    "fully_shard",
    "init_device_mesh",
    "load_weights",
]
