"""Meta-device tensors allocated as local shards and initialized, then unsharded state placed.

Run after :func:`hp_lightning.core.parallelize.parallelize`, so that no rank ever allocates the
whole model: ``to_empty`` allocates each sharded parameter's local shard only.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _metric_defaults(model: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Copies of every torchmetrics Metric's default states: ``to_empty`` leaves them uninitialized."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return []
    return [(m, copy.deepcopy(m._defaults)) for m in model.modules() if isinstance(m, Metric)]


def _restore_metrics(saved: list[tuple[nn.Module, dict]]) -> None:
    """Put the defaults back and reset each metric's states from them (on the metric's new device)."""
    for metric, defaults in saved:
        metric._defaults = defaults
        metric.reset()


@torch.no_grad()
def materialize(model: nn.Module, mesh: DeviceMesh, init_device: torch.device) -> bool:
    """Allocate meta-device tensors (local shards only) and initialize them.

    Runs ``reset_parameters()`` on every submodule that owns parameters or buffers, then the
    model's own ``init_weights()`` when it defines one (the hook for custom schemes such as
    GPT-2's scaled residual init). Sharded parameters draw from a generator seeded with a seed
    agreed across ranks plus the shard coordinate, so different shards get independent values
    while HSDP replicas of a shard get identical ones; whole (replicate/ignored) parameters and
    buffers are then broadcast from rank 0, so every rank starts from the same model.

    Returns:
        True when something was materialized.
    """
    if not has_meta_tensors(model):
        return False
    metric_defaults = _metric_defaults(model)
    model.to_empty(device=init_device)
    _restore_metrics(metric_defaults)
    # On the mesh's device (the current one of its type): NCCL and HCCL take no host tensors.
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64, device=mesh.device_type)
    dist.broadcast(seed, src=0)
    shard_coordinate = mesh.get_local_rank(mesh.ndim - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed.item()) + 7919 * shard_coordinate)
        for module in model.modules():
            owns_state = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
            if owns_state and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        init_weights = getattr(model, "init_weights", None)
        if callable(init_weights):
            init_weights()
    for tensor in [*model.parameters(), *model.buffers()]:
        if not isinstance(tensor, DTensor):
            dist.broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, src=0)
    return True


@torch.no_grad()
def move_unsharded_states(model: nn.Module, device: torch.device) -> None:
    """Move what FSDP does not manage (whole parameters, buffers, metric states) to ``device``.

    Sharded parameters are left where FSDP put them (the device, or the host under CPU offload).
    """
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for module in model.modules():
        if isinstance(module, Metric):
            module.to(device)
