"""What the non-final micro-batches of an accumulation window communicate.

Per unit and optimizer step on an HSDP ``(R, S)`` mesh with ``k`` micro-batches (reduce-scatters
over the shard group / all-reduces over the replicate group / gradient memory held between
micro-batches):

* ``"skip"``: 1 / 1 / the full-size gradient of every unit;
* ``"every"``: k / k / 1/S-size gradient shards;
* ``"defer_all_reduce"``: k / 1 / 1/S-size partial sums (on a 1-D mesh: as ``"every"``).

Pick ``"skip"`` when memory allows (least traffic), ``"every"`` when full-size gradients do not
fit, and ``"defer_all_reduce"`` on HSDP across nodes: the reduce-scatter stays on the fast
intra-node links every micro-batch while the slow inter-node all-reduce runs once per window.

Both front ends enter :func:`no_gradient_sync` for non-final micro-batches (the Trainer from
``block_backward_sync``, Fabric from ``no_backward_sync``).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

ACCUMULATION_MODES = ("skip", "every", "defer_all_reduce")


def check_mode(mode: Any, owner: str = "accumulation_mode") -> str:
    """Validate an accumulation mode string (case-insensitive, one of :data:`ACCUMULATION_MODES`) and return it lower-cased."""
    if not isinstance(mode, str):
        raise TypeError(f"{owner} expects one of {list(ACCUMULATION_MODES)} as a string; got {type(mode).__name__} {mode!r}.")
    if mode.lower() not in ACCUMULATION_MODES:
        raise ValueError(
            f"{owner} expects one of {list(ACCUMULATION_MODES)}; got {mode!r}. 'skip' syncs once per "
            f"window, 'every' every micro-batch, 'defer_all_reduce' reduce-scatters every micro-batch "
            f"and all-reduces once (HSDP)."
        )
    return mode.lower()


@contextmanager
def no_gradient_sync(root: nn.Module, mode: str) -> Generator[None, None, None]:
    """Run one non-final micro-batch's backward under ``mode`` (see the module docstring).

    ``root`` is the sharded root (an :class:`~hp_lightning.HSDPModule`); anything else is left
    alone. The previous state is restored on exit, also when the body raises.
    """
    mode = check_mode(mode)
    # An HSDPModule carries its data-parallel mesh; a unit hp_lightning did not shard is left alone.
    mesh = getattr(root, "device_mesh", None)
    # "defer_all_reduce" on FSDP (a 1-D mesh): no all-reduce to defer.
    if not isinstance(root, FSDPModule) or not isinstance(mesh, DeviceMesh) or mode == "every" or (mode == "defer_all_reduce" and mesh.ndim < 2):
        yield
        return
    set_sync = root.set_requires_all_reduce if mode == "defer_all_reduce" else root.set_requires_gradient_sync
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)
