"""Lightning Fabric front end: ``Fabric(strategy="hsdp")`` with the Trainer strategy's options, plan and checkpoints.

* :class:`HSDPStrategy`: Fabric's hooks over :mod:`hp_lightning.core` (sharding at
  ``fabric.setup``, ``no_backward_sync`` with the accumulation modes, DTensor-aware clipping) and
  :mod:`hp_lightning.checkpoint` (``fabric.save`` / ``fabric.load`` in the Trainer's layout).
* :class:`HSDPPrecision`: the precision flags of :mod:`hp_lightning.core.precision_flags` for Fabric.
* :mod:`.state`: how a Fabric ``state`` dict maps onto the Trainer's checkpoint layout.

``import hp_lightning`` registers ``"hsdp"``, ``"hp_fsdp"`` and ``"hsdp_cpu_offload"`` in
Fabric's strategy registry, as it does in the Trainer's.
"""

from hp_lightning.fabric.precision import HSDPPrecision
from hp_lightning.fabric.strategy import HSDPStrategy

__all__ = ["HSDPPrecision", "HSDPStrategy"]
