"""hp_lightning: HyperParallel-style FSDP/HSDP (``fully_shard``) for the Lightning Trainer.

Importing this package registers the strategy names ``"hsdp"``, ``"hp_fsdp"`` and
``"hsdp_cpu_offload"`` in Lightning's ``StrategyRegistry`` and in Fabric's ``STRATEGY_REGISTRY``
(:class:`FabricHSDPStrategy`, also :class:`hp_lightning.fabric.HSDPStrategy`), and the
accelerator ``"npu"`` (Ascend, through ``torch_npu``, which is not imported here) in its
``AcceleratorRegistry``. It patches nothing: :func:`enable_npu_auto_selection` (an explicit call)
makes ``accelerator="auto"`` choose NPUs where Lightning would fall back to the CPU.

Layout: :mod:`hp_lightning.core` (no Lightning) and :mod:`hp_lightning.fully_shard` (the seed's API)
are the engine; :mod:`hp_lightning.strategies` (Trainer) and :mod:`hp_lightning.fabric` (Fabric)
are hooks over it; :mod:`hp_lightning.callbacks` and :mod:`hp_lightning.checkpoint` build on those.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from hp_lightning.accelerators import NPUAccelerator, register_accelerators
from hp_lightning.accelerators import install_auto_selection as enable_npu_auto_selection
from hp_lightning.checkpoint import ResumableLoader, load_weights
from hp_lightning.fully_shard import (
    CPUOffloadPolicy,
    HSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    get_model_state_dict,
    set_model_state_dict,
)
from hp_lightning.core.mesh import init_device_mesh
from hp_lightning.parallel import ExpertParallel, PipelineStage, parallelize_module
from hp_lightning.fabric import HSDPStrategy as FabricHSDPStrategy
from hp_lightning.strategies import HSDPPrecision, HSDPStrategy

__version__ = "0.1.0"


def _register() -> None:
    if "hsdp" not in StrategyRegistry:
        HSDPStrategy.register_strategies(StrategyRegistry)
    if "hsdp" not in FABRIC_STRATEGY_REGISTRY:
        FabricHSDPStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    register_accelerators()


_register()

__all__ = [
    "CPUOffloadPolicy",
    "ExpertParallel",
    "FabricHSDPStrategy",
    "HSDPModule",
    "HSDPPrecision",
    "HSDPStrategy",
    "MixedPrecisionPolicy",
    "NPUAccelerator",
    "OffloadPolicy",
    "PipelineStage",
    "ResumableLoader",
    "__version__",
    "enable_npu_auto_selection",
    "fully_shard",
    "get_model_state_dict",
    "init_device_mesh",
    "load_weights",
    "parallelize_module",
    "set_model_state_dict",
]
