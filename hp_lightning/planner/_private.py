"""The private torch names the planner touches: they live in :mod:`hp_lightning.core._torch_private`.

The planner runs hp_lightning's real sharding recipe in a single process, for one simulated rank
of a world it does not have: the process group is torch's *fake* backend (every collective returns
at once, moving nothing), and tensors are *fake* (shapes, dtypes and devices, no storage). Neither
has a public home in torch yet, so both sit in the one torch adapter, version-checked with the rest.
"""

from __future__ import annotations

from hp_lightning.core._torch_private import (
    data_dependent_errors,
    fake_process_group,
    fake_tensor_mode,
    missing_private_names,
    reset_dtensor_caches,
)

__all__ = ["data_dependent_errors", "fake_process_group", "fake_tensor_mode", "missing_private_names", "reset_dtensor_caches"]
