"""Lightning Fabric front end: ``Fabric(strategy="hsdp")`` with the Trainer strategy's options, plan and checkpoints.

* :class:`HSDPFabricStrategy` (also ``HSDPStrategy``, its old name): Fabric's hooks over
  :class:`~hp_lightning.frontends.base.StrategyBase`; ``fabric.save`` / ``fabric.load`` in the Trainer's layout.
* :class:`HSDPPrecision`: the precision flags of :mod:`hp_lightning.core.precision_flags` for Fabric.
* :mod:`.state`: how a Fabric ``state`` dict maps onto the Trainer's checkpoint layout.
* :mod:`.optimizers`: optimizers created before sharding, rebound or refused.
* :mod:`.refusals`: what Fabric cannot honour (Trainer-only options, ``CheckpointIO``), with the fix.
* :mod:`.fault_tolerance`: the ``fault_tolerance`` option's torchft engine, started at ``fabric.setup``.
"""

from hp_lightning.fabric.precision import HSDPPrecision
from hp_lightning.fabric.strategy import HSDPFabricStrategy, HSDPStrategy

__all__ = ["HSDPFabricStrategy", "HSDPPrecision", "HSDPStrategy"]
