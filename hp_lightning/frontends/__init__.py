"""What the Trainer and Fabric strategies share, written once.

* :mod:`.base`: :class:`~hp_lightning.frontends.base.StrategyBase`, the base both strategies
  extend (through :mod:`.constructors`, whose ``__init__`` takes every field of
  :class:`~hp_lightning.core.options.HSDPOptions`): launch,
  process group, watchdog, mesh, collectives, accumulation, timeouts, checkpoint writes, teardown,
  registration. :mod:`hp_lightning.strategies` (Trainer) and :mod:`hp_lightning.fabric` keep only
  the hooks that differ between the two.
* :mod:`.precision`: :class:`~hp_lightning.frontends.precision.PrecisionCore`, both precision
  plugins' behaviour (:mod:`hp_lightning.core.precision_flags` says what each flag means).
"""
