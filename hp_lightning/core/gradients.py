"""Gradient clipping over a mix of sharded (DTensor) and whole (plain tensor) gradients.

``torch.nn.utils.clip_grad_norm_`` fails on such a mix ("got mixed torch.Tensor and DTensor"):
replicate and ignored parameters keep plain gradients next to the DTensor shards. Here the norm
is computed per kind and combined:

* DTensor gradients: the norm of each mesh's group is a reduction across its shards, so every
  rank gets the global value (what one process holding the whole model would compute);
* plain gradients: replicate-parameter gradients are identical on every rank after their
  all-reduce, so their local norm is already the global one; ignored parameters' gradients
  differ per rank, so with ``same_params`` (the data-parallel group) the plain part is averaged
  over those ranks (its ``norm_type``-th power; the max for inf): a no-op for replicate
  gradients, and every rank, hence every replica of a shard, is scaled by the same coefficient;
* copies of a parameter tied across pipeline stages (an LM head tied to the embedding) hold the
  same summed gradient on every holder: the copies after the first holder's are marked
  (``_hp_tied_replica``) and left out of the norm, so the tied parameter counts once, as in one
  process; they are still scaled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ParamsLike = Union[torch.Tensor, Iterable[torch.Tensor]]
_T = TypeVar("_T", bound=torch.Tensor)


#: Marks a pipeline stage's copy of a tied parameter that another stage's copy already counts
#: for (set by :class:`hp_lightning.parallel.pipeline.TiedCopies`).
TIED_REPLICA_ATTR = "_hp_tied_replica"


def _grads(parameters: ParamsLike, *, counted_once: bool = False) -> list[torch.Tensor]:
    """The gradients to scale; with ``counted_once``, those the norm counts (tied replicas left out)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    return [p.grad for p in params if p.grad is not None and not (counted_once and getattr(p, TIED_REPLICA_ATTR, False))]


def _grouped(tensors: list[_T], key: Callable[[_T], Any]) -> dict[Any, list[_T]]:
    groups: dict[Any, list[_T]] = {}
    for t in tensors:
        groups.setdefault(key(t), []).append(t)
    return groups


def total_grad_norm(
    parameters: ParamsLike,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    across: Optional[dist.ProcessGroup] = None,
    same_params: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The global ``norm_type``-norm of all gradients, the same on every rank (see the module docstring).

    ``across``: ranks holding the rest of the model (a pipeline's other stages): their norms are
    combined too, as torchtitan does for PP. ``same_params``: the data-parallel group the plain
    part is averaged over (one scalar all-reduce). ``error_if_nonfinite``: a RuntimeError when the
    norm is NaN or infinite.
    """
    norm_type = float(norm_type)
    grads = _grads(parameters, counted_once=True)
    if not grads and across is None and same_params is None:
        return torch.tensor(0.0)
    partial_norms = []
    plain = [g for g in grads if not isinstance(g, DTensor)]
    for group in _grouped([g for g in grads if isinstance(g, DTensor)], lambda g: g.device_mesh).values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=None)
        partial_norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    if plain or same_params is not None:
        norm = torch.nn.utils.get_total_norm(plain, norm_type=norm_type, foreach=None).float() if plain else torch.zeros(())
        if same_params is not None and dist.get_world_size(same_params) > 1:  # after the shards' collectives, on every rank
            norm = _combined(norm, norm_type, same_params, mean=True)
        partial_norms.append(norm)
    partial_norms = partial_norms or [torch.zeros(())]  # a stage without gradients still joins `across`
    device = partial_norms[0].device
    stacked = torch.stack([n.to(device) for n in partial_norms])
    total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
    if across is not None:
        total = _combined(total, norm_type, across)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so they "
            f"cannot be clipped. Lower the learning rate, check the loss for NaN/inf, or pass "
            f"error_if_nonfinite=False to skip this check."
        )
    return total


def _combined(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup, mean: bool = False) -> torch.Tensor:
    """The sum (``mean``: the mean) over ``group`` of ``norm``'s ``norm_type``-th power, as a norm again (the max for inf)."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, group=group)  # a sum: gloo has no average
    return (powered / dist.get_world_size(group) if mean else powered) ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: ParamsLike,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    across: Optional[dist.ProcessGroup] = None,
    same_params: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = total_grad_norm(parameters, norm_type, error_if_nonfinite, across, same_params)
    grads = _grads(parameters)
    if not grads:
        return total
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    # Scale the local storage: a DTensor's shard is a plain tensor, so one foreach call per
    # device/dtype serves both kinds without mixing DTensor and Tensor arguments.
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for device, group in _grouped(local, lambda t: t.device).items():
        torch._foreach_mul_(group, coefficient.to(device))
    return total


def clip_grad_value_(parameters: ParamsLike, clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (elementwise: no collective)."""
    for g in _grads(parameters):
        (g.to_local() if isinstance(g, DTensor) else g).clamp_(-float(clip_value), float(clip_value))
