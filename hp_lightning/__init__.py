"""hp_lightning: HyperParallel-style FSDP/HSDP (``fully_shard``) for the Lightning Trainer.

Importing this package registers the strategy names (``"hsdp"``, ``"hp_fsdp"``, ...) in Lightning's
and Fabric's registries and the accelerator ``"npu"`` (``torch_npu`` is not imported here). It
patches nothing: :func:`enable_npu_auto_selection` (an explicit call) makes ``accelerator="auto"``
choose NPUs where Lightning would fall back to the CPU. Layout: ``docs/architecture.md``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from hp_lightning._version import __version__
from hp_lightning.accelerators import NPUAccelerator, register_accelerators
from hp_lightning.accelerators import install_auto_selection as enable_npu_auto_selection
from hp_lightning.checkpoint import ResumableLoader, load_weights
from hp_lightning.core.mesh import init_device_mesh
from hp_lightning.fabric import HSDPFabricStrategy
from hp_lightning.fully_shard import (
    CPUOffloadPolicy,
    HSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    get_model_state_dict,
    set_model_state_dict,
)
from hp_lightning.parallel import ExpertParallel, PipelineStage, parallelize_module
from hp_lightning.strategies import HSDPPrecision, HSDPStrategy

#: The Fabric strategy's earlier name here (kept working).
FabricHSDPStrategy = HSDPFabricStrategy


def _register() -> None:
    if "hsdp" not in StrategyRegistry:
        HSDPStrategy.register_strategies(StrategyRegistry)
    if "hsdp" not in FABRIC_STRATEGY_REGISTRY:
        HSDPFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    register_accelerators()


_register()

__all__ = [
    "CPUOffloadPolicy",
    "ExpertParallel",
    "FabricHSDPStrategy",
    "HSDPFabricStrategy",
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
    "plan",
    "set_model_state_dict",
]


def __getattr__(name: str) -> object:
    # ``hp_lightning.plan`` (the planner) is imported on first use: training processes never pay for it.
    if name == "plan":
        from hp_lightning.planner import plan

        return plan
    raise AttributeError(f"module 'hp_lightning' has no attribute {name!r}")
