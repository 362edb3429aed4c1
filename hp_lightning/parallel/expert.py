"""Expert parallelism: experts split over the ``ep`` mesh dim, tokens moved to them with all-to-all.

The seed's ``ExpertParallel().apply(moe.experts, mesh["ep"])``, on a *grouped* experts module (as
in torchtitan): every parameter has the experts as dim 0 and the forward is
``experts(tokens_sorted_by_expert, num_tokens_per_expert)``. ``apply`` shards the parameters with
``Shard(0)`` and wraps forward: dispatch (each token to its expert's rank, by differentiable
all-to-all), the module's own forward on its local experts, combine (the reverse all-to-all).
Hugging Face's ``experts(hidden_states, top_k_index, top_k_weights)`` is recognized by its argument
names: each (token, choice) pair is dispatched, the ``k`` outputs weighted and summed after.

An expert's gradient sums every ``ep`` rank's tokens, so data-parallel averaging divides by the
``ep`` size too: :func:`expert_parallel_size` tells ``fully_shard`` to.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hp_lightning.core.materialize import link_construction

__all__ = ["ExpertParallel", "check_expert_split", "expert_parallel_size", "find_expert_modules"]

_EP_ATTR = "_hp_expert_parallel_mesh"


def expert_parallel_size(module: nn.Module) -> int:
    """The ``ep`` size ``module``'s experts are split over (1 when it is not expert-parallel)."""
    mesh = module.__dict__.get(_EP_ATTR)
    return 1 if mesh is None else mesh.size()


def find_expert_modules(model: nn.Module) -> list[nn.Module]:
    """Every expert-parallel module below ``model``, outermost first."""
    return [m for m in model.modules() if _EP_ATTR in m.__dict__]


def check_expert_split(module: nn.Module, ep: int) -> int:
    """The number of experts of a grouped-experts ``module``, checked to split evenly over ``ep`` ranks.

    Raises:
        ValueError: parameters without a common experts dim, or ``ep`` not dividing the experts.
    """
    leading = {p.shape[0] if p.dim() else 0 for p in module.parameters()}
    if len(leading) != 1 or 0 in leading:
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        raise ValueError(
            f"ExpertParallel expects a grouped-experts module whose every parameter has the experts as dim 0 "
            f"([num_experts, ...]); {type(module).__name__} has {shapes}. Stack the experts' weights (see "
            f"examples/moe.py, GroupedExperts)."
        )
    experts = leading.pop()
    if experts % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide the {experts} experts of {type(module).__name__}: each "
            f"EP rank holds the same number of experts. Choose an EP size that divides {experts}."
        )
    return experts


class ExpertParallel:
    """Split a grouped-experts module over a 1-D ``ep`` mesh; dispatch and combine tokens with all-to-all."""

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Shard ``module``'s experts over ``device_mesh`` and wrap its forward; returns ``module``.

        Raises:
            TypeError: not a module, or not a 1-D mesh.
            ValueError: see :func:`check_expert_split`; or already expert-parallel.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"ExpertParallel().apply expects the experts nn.Module; got {type(module).__name__}.")
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise TypeError(
                f"ExpertParallel().apply expects the 1-D expert-parallel sub-mesh (mesh['ep']); got "
                f"{type(device_mesh).__name__} {getattr(device_mesh, 'shape', '')}."
            )
        if _EP_ATTR in module.__dict__:
            raise ValueError(f"ExpertParallel().apply: {type(module).__name__} is expert-parallel already.")
        check_expert_split(module, device_mesh.size())
        for child_name, child in module.named_children():
            if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                raise ValueError(
                    f"ExpertParallel expects the experts' parameters directly on {type(module).__name__}; it has a "
                    f"submodule {child_name!r} ({type(child).__name__}) with parameters or buffers of its own. Stack "
                    f"them into [num_experts, ...] parameters of {type(module).__name__} (parameter-free submodules "
                    f"such as an activation are fine)."
                )
        routed = _takes_router_choice(module)
        link_construction(module)  # inside a recorded meta build: keep each parameter's construction
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None if param.is_meta else 0)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__dict__[_EP_ATTR] = device_mesh
        inner = module.forward

        def forward(tokens: Tensor, num_tokens_per_expert: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return _expert_parallel_forward(module, inner, device_mesh, tokens, num_tokens_per_expert, args, kwargs)

        if routed:

            def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:  # type: ignore[misc]
                return _routed_forward(module, inner, device_mesh, hidden_states, top_k_index, top_k_weights)

        module.forward = forward
        return module


def _takes_router_choice(module: nn.Module) -> bool:
    """Whether ``module.forward`` has Hugging Face's experts interface ``(hidden_states, top_k_index, top_k_weights)``."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == ["hidden_states", "top_k_index", "top_k_weights"]


def _routed_forward(module: nn.Module, inner: Any, mesh: DeviceMesh, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Hugging Face's interface on the grouped dispatch: one token per (token, choice), weighted after the combine."""
    experts = next(module.parameters()).shape[0]  # global: the parameters are DTensors over ep
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)

    def local_experts(tokens: Tensor, local_counts: Tensor) -> Tensor:
        local = local_counts.numel()
        index = torch.repeat_interleave(torch.arange(local, device=tokens.device), local_counts.to(tokens.device))[:, None]
        weights = torch.ones(index.shape, dtype=top_k_weights.dtype, device=tokens.device)
        saved = module.__dict__.get("num_experts")
        module.__dict__["num_experts"] = local
        try:
            return inner(tokens, index, weights)
        finally:
            if saved is None:
                module.__dict__.pop("num_experts", None)
            else:
                module.__dict__["num_experts"] = saved

    out = _expert_parallel_forward(module, local_experts, mesh, hidden_states[order // k], counts, (), {})
    per_choice = torch.empty_like(out).index_copy(0, order, out).view(n, k, -1)
    return (per_choice * top_k_weights.to(per_choice.dtype)[..., None]).sum(1).to(hidden_states.dtype)


def _run_on_local_params(module: nn.Module, inner: Any, *args: Any, **kwargs: Any) -> Tensor:
    """Call the module's own forward with each DTensor parameter replaced by its local experts.

    ``to_local`` is differentiable, so gradients reach the (sharded or gathered) parameter; the
    originals are put back before forward returns, so FSDP's post-forward sees its own parameters.
    """
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = param.to_local()
        return inner(*args, **kwargs)
    finally:
        module._parameters.update(saved)


def _expert_parallel_forward(module: nn.Module, inner: Any, mesh: DeviceMesh, tokens: Tensor, counts: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    group = mesh.get_group()
    ep = mesh.size()
    experts = counts.numel()
    local = experts // ep
    counts = counts.to(torch.int64)
    # 1. Dispatch: who receives how many tokens for which of its experts, then the tokens themselves.
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    by_source = received_counts.view(ep, local)  # [source rank, local expert]
    receive_splits = by_source.sum(1).tolist()
    received = dist_autograd.all_to_all_single(
        tokens.new_empty((sum(receive_splits), *tokens.shape[1:])), tokens.contiguous(), receive_splits, send_splits, group=group
    )
    # Received tokens are ordered (source, expert); the experts want them grouped by expert: a
    # stable sort by (expert, source) of each token's segment, on the device, without a sync.
    source, expert = torch.meshgrid(torch.arange(ep, device=counts.device), torch.arange(local, device=counts.device), indexing="ij")
    segment_key = torch.repeat_interleave((expert * ep + source).flatten(), by_source.flatten())
    order = torch.argsort(segment_key, stable=True).to(tokens.device)
    # 2. The experts' own forward, on this rank's experts and parameters.
    out = _run_on_local_params(module, inner, received[order], by_source.sum(0), *args, **kwargs)
    restored = torch.empty_like(out).index_copy(0, order, out) if order.numel() else out
    # 3. Combine: outputs back to the tokens' ranks, in the order they were sent.
    return dist_autograd.all_to_all_single(
        out.new_empty((tokens.shape[0], *out.shape[1:])), restored.contiguous(), send_splits, receive_splits, group=group
    )
