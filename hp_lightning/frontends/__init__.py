"""What the Trainer and Fabric strategies share, written once.

* :mod:`.base`: :class:`~hp_lightning.frontends.base.StrategyBase`, the base both strategies
  extend (through :mod:`.constructors`, whose ``__init__`` takes every option).
* :mod:`.precision`: :class:`~hp_lightning.frontends.precision.PrecisionCore`, both precision plugins' behaviour.
"""
