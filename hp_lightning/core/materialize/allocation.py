"""Allocation (NaN-filled, local shards only), metrics kept off the meta device, and the RNG state
every rank starts from.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torchmetrics import Metric
from hp_lightning.core.materialize.full_tensors import _Slot
from hp_lightning.core.materialize.ops import _local, _poison


def refuse_metrics_on_meta(model: nn.Module) -> None:
    """A torchmetrics metric created on the meta device has no default values to reset to: refuse it.

    Raises:
        ValueError: naming the metric, its meta states and the fix (before any collective).
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for name, metric in model.named_modules():
        if not isinstance(metric, Metric):
            continue
        on_meta = [key for key, value in metric._defaults.items() if isinstance(value, torch.Tensor) and value.is_meta]
        if on_meta:
            raise ValueError(
                f"The torchmetrics metric {name or type(metric).__name__!r} ({type(metric).__name__}) was created on "
                f"the meta device (in configure_model or under init_module), so its default states {on_meta} have no "
                f"values to reset to. Create metrics in your LightningModule's __init__ (they are small and are "
                f"not sharded), or build on the host with HSDPStrategy(meta_init=False)."
            )


def _metric_defaults(model: nn.Module) -> list[tuple[Metric, dict]]:
    """Copies of every torchmetrics Metric's default states: ``to_empty`` leaves them uninitialized."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return []
    refuse_metrics_on_meta(model)
    return [(m, copy.deepcopy(m._defaults)) for m in model.modules() if isinstance(m, Metric)]


def _restore_metrics(saved: list[tuple[Metric, dict]]) -> None:
    """Put the defaults back and reset each metric's states from them (on the metric's new device)."""
    for metric, defaults in saved:
        metric._defaults = defaults
        metric.reset()


@torch.no_grad()
def _allocate(model: nn.Module, slots: Sequence[_Slot], init_device: torch.device) -> None:
    """``to_empty`` (local shards only), keeping the values of tensors that were not on meta.

    FSDP2 re-derives its sharded storage in ``to_empty``, which reallocates every tensor; values
    built for real (a backbone created in ``__init__``, a metric) are copied aside and put back.
    Memory that was meta is then filled with NaN, never left as it was.
    """
    keep: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for module in model.modules():
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if tensor is not None and not tensor.is_meta:
                    keep.append((module, kind, name, _local(tensor).detach().clone()))
    metric_defaults = _metric_defaults(model)
    model.to_empty(device=init_device)
    _restore_metrics(metric_defaults)
    for module, kind, name, value in keep:
        table = module._parameters if kind == "parameter" else module._buffers
        _local(cast(torch.Tensor, table[name])).copy_(value)  # kept above: it is there
    for slot in slots:
        _poison(_local(slot.get()))


def _agreed_rng_state(state: torch.Tensor, device_type: str) -> torch.Tensor:
    """Rank 0's generator state, on every rank: every rank computes the same full tensors."""
    if not (dist.is_available() and dist.is_initialized()):
        return state
    # On the mesh's device type (the current device of that type): NCCL and HCCL take no host tensors.
    buffer = state.to(device_type)
    dist.broadcast(buffer, src=0)
    return buffer.cpu()
