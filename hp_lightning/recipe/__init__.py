"""The recipe: what turns a user's model into a sharded one (TP, EP, activation checkpointing, units, root, prefetch).

Above :mod:`hp_lightning.core`, :mod:`hp_lightning.parallel` and :mod:`hp_lightning.fully_shard`,
below the front ends (which call :func:`~hp_lightning.recipe.prepare.prepare_model`); no Lightning import.
"""
