"""The strategy the fault matrix runs: HSDPStrategy, whose fault watchdog is on by default.

Kept as a module so the fault scripts import one name; the watchdog, the rank-agreement checks
and ``on_exception`` reporting are all HSDPStrategy's own (``hp_lightning.core.watchdog``, ``hp_lightning.core.agreement``).
"""

from __future__ import annotations

from hp_lightning.strategies.hsdp import HSDPStrategy

GuardedHSDPStrategy = HSDPStrategy
