"""The recipe: what turns a user's model into a sharded one (TP, EP, activation checkpointing, units, root, prefetch).

It sits on top of the engine's pieces (:mod:`hp_lightning.core` below everything,
:mod:`hp_lightning.parallel` and :mod:`hp_lightning.fully_shard` above it) and below the front
ends, which call :func:`~hp_lightning.recipe.prepare.prepare_model` once per setup. No Lightning
import here either.
"""
