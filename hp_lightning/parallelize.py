"""Apply FSDP/HSDP to a model: one function per technique, applied in a fixed order.

:func:`parallelize` is the whole recipe; the strategy calls it once per setup:

1. activation checkpointing on the chosen blocks (before sharding, so FSDP's gather/free hooks
   sit outside the recomputed region and recomputation sees gathered parameters);
2. ``fully_shard`` on each unit, bottom-up, each with only the replicate/ignored parameters it owns;
3. ``fully_shard`` on the root, which takes every parameter no unit owns (embeddings, heads,
   final norms) and drives lazy initialization;
4. forward-method registration on the root, so the root's parameters are gathered whichever
   method the user's code enters through (``training_step``, ``generate``, ...);
5. explicit prefetch between consecutive units;
6. reduce op and gradient scaling.

Materialization of meta-device parameters is a separate step (:func:`materialize`), run after
the model is sharded, so that no rank ever allocates the whole model.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from hp_lightning.fully_shard import HSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from hp_lightning.wrapping import UnitSpec, auto_units, select_modules, select_params

#: Methods of a LightningModule that run a forward pass and so must gather the root's parameters.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
#: Methods registered automatically when the module has them.
AUTO_FORWARD_METHODS = ("generate",)


@dataclass(frozen=True)
class ShardingPlan:
    """Everything :func:`parallelize` needs besides the model and the mesh (all validated)."""

    shard_modules: Sequence[UnitSpec] | None = None
    reshard_after_forward: bool = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    activation_checkpointing: Sequence[UnitSpec] | None = None
    ignored_params: Sequence[str] | None = None
    replicate_params: Sequence[str] | None = None
    shard_placement: Mapping[str, int] | None = None
    comm_fusion: bool = False
    prefetch: int = 1
    reduce_op: str = "avg"
    gradient_scaling_factor: float | None = None
    forward_methods: Sequence[str] | None = None


@dataclass
class ShardedModel:
    """What :func:`parallelize` produced: the root and its units in forward order."""

    root: HSDPModule
    units: list[HSDPModule]
    ignored: list[str]
    replicated: list[str]


def apply_activation_checkpointing(model: nn.Module, specs: Sequence[UnitSpec] | None) -> list[nn.Module]:
    """Recompute the chosen blocks' activations in backward instead of storing them.

    Wraps each block's ``forward`` (not the module), so parameter names and state-dict keys
    stay the same. Costs one extra forward per block in backward; saves its activations.
    """
    if not specs:
        return []
    blocks = select_modules(model, specs, option="activation_checkpointing")
    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def checkpointed(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed  # type: ignore[method-assign]
    return blocks


def _placement_fn(model: nn.Module, shard_placement: Mapping[str, int] | None):
    """Map parameter-name globs to ``Shard(dim)``; first matching pattern wins."""
    if not shard_placement:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    for pattern in shard_placement:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names.values()):
            raise ValueError(
                f"shard_placement pattern {pattern!r} matches no parameter; names look like "
                f"{list(names.values())[:6]}."
            )

    def placement(param: nn.Parameter) -> Shard | None:
        name = names.get(id(param), "")
        for pattern, dim in shard_placement.items():
            if fnmatch.fnmatchcase(name, pattern):
                return Shard(dim)
        return None

    return placement


def shard_units(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan) -> tuple[list[HSDPModule], list[str], list[str]]:
    """``fully_shard`` each unit bottom-up, then the root. Returns (units, ignored names, replicated names)."""
    units = select_modules(model, plan.shard_modules) if plan.shard_modules else auto_units(model)
    ignored = select_params(model, plan.ignored_params, "ignored_params")
    replicated = select_params(model, plan.replicate_params, "replicate_params")
    both = {n for n, _ in ignored} & {n for n, _ in replicated}
    if both:
        raise ValueError(f"Parameters {sorted(both)} match both ignored_params and replicate_params; pick one.")
    placement = _placement_fn(model, plan.shard_placement)
    assigned: set[int] = set()

    def owned(module: nn.Module, selected: list[tuple[str, nn.Parameter]]) -> set[nn.Parameter]:
        mine = {id(p) for p in module.parameters()} - assigned
        return {p for _, p in selected if id(p) in mine}

    for unit in [*units, model]:
        is_root = unit is model
        unit_ignored, unit_replicated = owned(unit, ignored), owned(unit, replicated)
        assigned.update(id(p) for p in unit.parameters())
        fully_shard(
            unit,
            mesh=mesh,
            # The root's parameters are needed again as soon as backward starts: keep them.
            reshard_after_forward=False if is_root else plan.reshard_after_forward,
            shard_placement_fn=placement,
            mp_policy=plan.mp_policy,
            offload_policy=plan.offload_policy,
            ignored_params=unit_ignored or None,
            replicate_params=unit_replicated or None,
            comm_fusion=plan.comm_fusion,
        )
    return units, [n for n, _ in ignored], [n for n, _ in replicated]  # type: ignore[return-value]


def register_forward_methods(root: nn.Module, extra: Sequence[str] | None) -> list[str]:
    """Make step methods and ``generate``-like methods gather the root's parameters like ``forward``."""
    names = [m for m in STEP_METHODS if callable(getattr(root, m, None))]
    names += [m for m in AUTO_FORWARD_METHODS if callable(getattr(root, m, None)) and m not in names]
    for method in extra or ():
        if not callable(getattr(root, method, None)):
            raise ValueError(
                f"forward_methods names {method!r}, but {type(root).__name__} has no such method. "
                f"List methods that run the model outside forward(), e.g. ['generate']."
            )
        if method not in names:
            names.append(method)
    for method in names:
        _register_forward_method(root, method)
    return names


def _register_forward_method(root: nn.Module, method_name: str) -> None:
    """``register_fsdp_forward_method`` that also survives a nested ``self(...)`` call.

    A step method usually calls ``self(x)``, whose own FSDP hooks end the forward pass early:
    the inner post-forward leaves the root's group idle, and the outer one then reshards it
    although the root keeps its parameters after forward, so backward would all-gather the
    root (embeddings, head) a second time every micro-batch. Re-entering the forward state
    before the outer post-forward keeps one all-gather per micro-batch.
    """
    original = getattr(root, method_name)

    @functools.wraps(original)
    def wrapped(self: nn.Module, *args, **kwargs):
        state = self._get_fsdp_state()
        args, kwargs = state._pre_forward(self, args, kwargs)
        output = original(*args, **kwargs)
        _resume_forward_state(state)
        return state._post_forward(self, args, output)

    setattr(root, method_name, wrapped.__get__(root, type(root)))


def _resume_forward_state(state) -> None:
    """Mark gathered, idle groups as in forward again (FSDP2 internals; torch 2.13)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for group in getattr(state, "_fsdp_param_groups", ()):
        if getattr(group, "_training_state", None) == TrainingState.IDLE and getattr(group, "is_unsharded", False):
            group._training_state = TrainingState.FORWARD


def wire_prefetch(units: list[HSDPModule], depth: int) -> None:
    """Each unit all-gathers the next ``depth`` units in forward and the previous ``depth`` in backward.

    Overlaps each all-gather with the compute of the unit before it, at the cost of holding
    ``depth`` extra units gathered. ``units`` must be in forward execution order.
    """
    if depth <= 0:
        return
    for i, unit in enumerate(units):
        ahead = units[i + 1 : i + 1 + depth]
        behind = list(reversed(units[max(0, i - depth) : i]))
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


def apply_reduction(root: HSDPModule, plan: ShardingPlan) -> None:
    """Reduce op and scaling factor, applied recursively to every unit."""
    if plan.reduce_op != "avg":
        root.set_reduce_op_type(plan.reduce_op)
    if plan.gradient_scaling_factor is not None:
        root.set_gradient_scaling_factor(plan.gradient_scaling_factor)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan) -> ShardedModel:
    """Shard ``model`` in place following the fixed order in this module's docstring."""
    # 1. Activation checkpointing before sharding.
    apply_activation_checkpointing(model, plan.activation_checkpointing)
    # 2 + 3. Units bottom-up, then the root.
    units, ignored, replicated = shard_units(model, mesh, plan)
    root = model
    assert isinstance(root, HSDPModule)
    # 4. Step and generate methods gather the root's parameters.
    register_forward_methods(root, plan.forward_methods)
    # 5. Prefetch in forward order (units came bottom-up; reverse pre-order reversed is pre-order).
    forward_order = list(reversed(units))
    wire_prefetch([u for u in forward_order if u is not root], plan.prefetch)  # type: ignore[misc]
    # 6. Reduction semantics.
    apply_reduction(root, plan)
    return ShardedModel(root=root, units=forward_order, ignored=ignored, replicated=replicated)  # type: ignore[arg-type]


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
