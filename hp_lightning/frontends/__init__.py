"""What the Trainer and Fabric strategies share, written once.

* :mod:`.core`: :class:`~hp_lightning.frontends.core.StrategyCore`, the base both strategies
  extend (its constructor is generated from :class:`~hp_lightning.core.options.HSDPOptions` into
  :mod:`.constructors` by ``scripts/gen_signatures.py``): launch,
  process group, watchdog, mesh, collectives, accumulation, timeouts, checkpoint writes, teardown,
  registration. :mod:`hp_lightning.strategies` (Trainer) and :mod:`hp_lightning.fabric` keep only
  the hooks that differ between the two.
* :mod:`.precision`: :class:`~hp_lightning.frontends.precision.PrecisionCore`, both precision
  plugins' behaviour (:mod:`hp_lightning.core.precision_flags` says what each flag means).
"""
