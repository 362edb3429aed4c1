"""The engine both front ends share: everything that shards, initializes and inspects a model.

Nothing here imports Lightning (``tests/unit/test_layout.py`` holds that), so the Trainer strategy
(:mod:`hp_lightning.strategies`), the Fabric strategy (:mod:`hp_lightning.fabric`), the callbacks
and the checkpoint IO all call the same code. One module per concern:

=====================  =========================================================================
``mesh``               named device meshes: shapes, validation, the data-parallel sub-mesh
``units``              which submodules become sharding units, which parameters are special
``parallelize``        the recipe: activation checkpointing -> units -> root -> prefetch -> reduction
``materialize``        records meta-device construction and replays it on the local shards, or refuses
``prepare``            the one call both front ends make: parallelize -> agree -> materialize -> place
``accumulation``       what non-final micro-batches communicate (skip / every / defer_all_reduce)
``introspection``      facts about units: gathered state, prefetch, bytes, placements
``gradients``          clipping over sharded (DTensor) and whole gradients
``precision_flags``    the precision flags both front ends accept and the dtypes each implies
``state_dict``         model/optimizer state, sharded or whole, keyed by parameter name
``options``            the strategy options, validated once for both front ends
``watchdog``           every rank stops within seconds when one fails; the first cause named once
``agreement``          settings every rank must share, compared before they take effect
``preemption``         SIGTERM recorded in a handler, acted on by every rank at the same batch
``devices``            the only place device names (cuda, npu) appear
``diagnostics``        counting collectives at the torch.distributed call
``_torch_private``     every private torch name, behind one function each
=====================  =========================================================================

The package imports nothing eagerly: import the module you need.
"""
