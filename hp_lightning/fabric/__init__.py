"""Lightning Fabric front end: ``Fabric(strategy="hsdp")`` with the Trainer strategy's options, plan and checkpoints.

* :class:`HSDPFabricStrategy` (also importable as ``HSDPStrategy``, its old name): Fabric's hooks
  over :class:`~hp_lightning.frontends.base.StrategyBase` (sharding at ``fabric.setup``,
  ``no_backward_sync`` with the accumulation modes, DTensor-aware clipping) and
  :mod:`hp_lightning.checkpoint` (``fabric.save`` / ``fabric.load`` in the Trainer's layout).
* :class:`HSDPPrecision`: the precision flags of :mod:`hp_lightning.core.precision_flags` for Fabric.
* :mod:`.state`: how a Fabric ``state`` dict maps onto the Trainer's checkpoint layout.
* :mod:`.optimizers`: optimizers created before sharding, rebound or refused.
* :mod:`.refusals`: what Fabric cannot honour (Trainer-only options, ``CheckpointIO``, FSDP1), with the fix.
* :mod:`.fault_tolerance`: the ``fault_tolerance`` option's torchft engine, started at ``fabric.setup``.

``import hp_lightning`` registers ``"hsdp"``, ``"hp_fsdp"`` and ``"hsdp_cpu_offload"`` in
Fabric's strategy registry, as it does in the Trainer's.
"""

from hp_lightning.fabric.precision import HSDPPrecision
from hp_lightning.fabric.strategy import HSDPFabricStrategy

#: The old name (before the two front ends got distinct class names): the same class.
HSDPStrategy = HSDPFabricStrategy

__all__ = ["HSDPFabricStrategy", "HSDPPrecision", "HSDPStrategy"]
