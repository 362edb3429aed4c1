"""The engine's bottom layer: options, meshes, units, materialization, state dicts, and the checks around them.

Nothing here imports Lightning (``tests/unit/test_layout.py`` holds that), so the Trainer strategy
(:mod:`hp_lightning.strategies`), the Fabric strategy (:mod:`hp_lightning.fabric`), the callbacks,
the checkpoint IO and the planner all call the same code. One module per concern; the map of every
module, with one line each, is ``docs/architecture.md``. Every private torch name lives in
:mod:`hp_lightning.core._torch_private`, version-checked.

The package imports nothing eagerly: import the module you need.
"""
