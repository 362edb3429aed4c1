"""Apply FSDP/HSDP to a model: one function per technique, applied in a fixed order.

:func:`parallelize` is the whole recipe; the strategy calls it once per setup:

1. tensor parallelism on the ``tp`` dim (torch's ``parallelize_module``): before sharding, so
   FSDP shards TP's DTensors further over the data-parallel dims (FSDP2's 2-D composition);
2. expert parallelism on the ``ep`` dim: experts split over EP ranks, tokens moved by all-to-all;
3. activation checkpointing on the chosen blocks (before sharding, so FSDP's gather/free hooks
   sit outside the recomputed region and recomputation sees gathered parameters);
4. ``fully_shard`` on each unit, bottom-up, each with only the replicate/ignored parameters it
   owns; expert modules are units of their own on the data-parallel dims without ``ep``;
5. ``fully_shard`` on the root, which takes every parameter no unit owns (embeddings, heads,
   final norms) and drives lazy initialization;
6. forward-method registration on the root, so the root's parameters are gathered whichever
   method the user's code enters through (``training_step``, ``generate``, ...);
7. explicit prefetch between consecutive units;
8. reduce op and gradient scaling.

Materialization of meta-device parameters is a separate step (:func:`materialize`), run after
the model is sharded, so that no rank ever allocates the whole model.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.utils.checkpoint import checkpoint

from hp_lightning.core._torch_private import prefetch_targets, wrap_as_forward
from hp_lightning.core.mesh import ParallelMesh
from hp_lightning.core.units import UnitSpec, auto_units, bottom_up, select_modules, select_params, side_units
from hp_lightning.fully_shard import HSDPModule, MixedPrecisionPolicy, OffloadPolicy, adopt_sharded, fully_shard
from hp_lightning.parallel.expert import ExpertParallel, check_expert_split, find_expert_modules
from hp_lightning.parallel.tensor import hf_tp_plan, resolve_tp_plan, tp_applied

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
    tp_plan: Mapping[str, Any] | None = None
    expert_modules: Sequence[str] | None = None

#: Module-name glob that finds experts when ``expert_modules`` is not given (torchtitan's and HF's naming).
DEFAULT_EXPERT_MODULES = ("*experts",)


@dataclass
class ShardedModel:
    """What :func:`parallelize` produced: the root and its units in forward order."""

    root: HSDPModule
    units: list[HSDPModule]
    ignored: list[str]
    replicated: list[str]


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh, plan: ShardingPlan) -> list[str]:
    """Split the planned layers over the ``tp`` dim; returns the module names it parallelized.

    The plan is ``plan.tp_plan`` or, without one, the Hugging Face models' own
    ``base_model_tp_plan``. Nothing is applied when the user did TP in ``configure_model``.

    Raises:
        ValueError: TP requested without any plan, a pattern that matches nothing, a wrong style.
    """
    if mesh.tp is None or tp_applied(model, mesh.tp):
        return []
    tp_plan = plan.tp_plan or hf_tp_plan(model)
    if not tp_plan:
        raise ValueError(
            f"tensor_parallel_size={mesh.layout.tp}, but there is no TP plan: {type(model).__name__} contains no "
            f"Hugging Face model with a base_model_tp_plan and tp_plan was not given. Pass tp_plan="
            f"{{'model.blocks.*.attn.qkv_heads': 'colwise', 'model.blocks.*.attn.proj': 'rowwise', ...}}, or call "
            f"hp_lightning.parallelize_module(module, self.device_mesh['tp'], plan) in configure_model."
        )
    resolved = resolve_tp_plan(model, tp_plan, "HSDPStrategy(tp_plan=...)")
    torch_parallelize_module(model, mesh.tp, resolved)  # construction was linked by prepare_model
    return list(resolved)


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, plan: ShardingPlan) -> list[nn.Module]:
    """Split the expert modules over the ``ep`` dim; returns every expert-parallel module.

    Raises:
        ValueError: EP requested and no module matches ``expert_modules``.
    """
    if mesh.ep is None:
        return []
    patterns = tuple(plan.expert_modules or DEFAULT_EXPERT_MODULES)
    named = [(n, m) for n, m in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    already = find_expert_modules(model)
    if not named and not already:
        raise ValueError(
            f"expert_parallel_size={mesh.layout.ep}, but no module of {type(model).__name__} matches expert_modules="
            f"{list(patterns)}. Name the grouped-experts modules, e.g. expert_modules=['model.blocks.*.mlp.experts']."
        )
    for _, module in named:  # every module checked before any is split: an error leaves the model whole
        if module not in already:
            check_expert_split(module, mesh.layout.ep)
    for _, module in named:
        if module not in already:
            ExpertParallel().apply(module, mesh.ep)
    return find_expert_modules(model)


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

        block.forward = checkpointed
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


def _user_units(model: nn.Module) -> list[nn.Module]:
    """Modules the user already sharded (``hp_lightning.fully_shard`` or torch's), outermost first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _drop_already_sharded(
    selected: list[tuple[str, nn.Parameter]], option: str
) -> list[tuple[str, nn.Parameter]]:
    """Parameters a user unit already sharded cannot be ignored or replicated any more: warn and drop them.

    Raises:
        ValueError: a parameter tensor or expert parallelism split: it cannot be kept whole.
    """
    split = [n for n, p in selected if isinstance(p, DTensor) and {"tp", "ep"} & set(p.device_mesh.mesh_dim_names or ())]
    if split:
        raise ValueError(
            f"{option} matches {split[:6]}, which tensor or expert parallelism splits across ranks: they cannot be "
            f"kept whole (replicate_params) or left rank-local (ignored_params). Narrow the pattern to parameters "
            f"outside tp_plan / expert_modules."
        )
    sharded = [n for n, p in selected if isinstance(p, DTensor)]
    if sharded:
        warnings.warn(
            f"{option} matches {sharded[:6]}, which your own fully_shard call in configure_model already "
            f"sharded; they stay sharded. Pass ignored_params/replicate_params to that fully_shard call "
            f"instead, or leave their module for the strategy to shard.",
            UserWarning,
            stacklevel=3,
        )
    return [(n, p) for n, p in selected if not isinstance(p, DTensor)]


def shard_units(
    model: nn.Module, mesh: ParallelMesh, plan: ShardingPlan, experts: Sequence[nn.Module] = ()
) -> tuple[list[nn.Module], list[str], list[str]]:
    """``fully_shard`` each unit bottom-up, then the root. Returns (units, ignored names, replicated names).

    Modules the user sharded already (in ``configure_model`` or Fabric code) keep their own
    settings and are not sharded again: the plan only shards what is left, and the returned
    units include the user's, in bottom-up order. Expert modules are units on ``mesh.expert_dp``.
    """
    user_units = _user_units(model)
    planned = select_modules(model, plan.shard_modules) if plan.shard_modules else auto_units(model)
    expert_ids = {id(m) for m in experts}
    # Automatic plans only: large embeddings / head (+ final norm) as units, each group led by its first module.
    groups = {} if plan.shard_modules or user_units else {id(g[0]): g for g in side_units(model, planned)}
    last_group = max(groups, key=lambda key: order_of(model, groups[key][0]), default=None)
    leaders = [g[0] for g in groups.values()]
    units = bottom_up(model, {id(m): m for m in [*planned, *experts, *user_units, *leaders] if m is not model}.values())
    ignored = _drop_already_sharded(select_params(model, plan.ignored_params, "ignored_params"), "ignored_params")
    replicated = _drop_already_sharded(select_params(model, plan.replicate_params, "replicate_params"), "replicate_params")
    both = {n for n, _ in ignored} & {n for n, _ in replicated}
    if both:
        raise ValueError(f"Parameters {sorted(both)} match both ignored_params and replicate_params; pick one.")
    placement = _placement_fn(model, plan.shard_placement)
    # Parameters of the user's units belong to those units already.
    assigned: set[int] = {id(p) for unit in user_units for p in unit.parameters()}

    def owned(modules: list[nn.Module], selected: list[tuple[str, nn.Parameter]]) -> set[nn.Parameter]:
        mine = {id(p) for module in modules for p in module.parameters()} - assigned
        return {p for _, p in selected if id(p) in mine}

    for unit in [*units, model]:
        if isinstance(unit, FSDPModule):
            adopt_sharded(unit)  # the user's unit: give it the runtime controls, keep its settings
            continue
        members = groups.get(id(unit), [unit])
        unit_ignored, unit_replicated = owned(members, ignored), owned(members, replicated)
        assigned.update(id(p) for m in members for p in m.parameters())
        # The root's parameters, and the last unit's (the head), are needed again as soon as
        # backward starts: keep them gathered.
        keep = unit is model or (id(unit) == last_group and _is_head(members))
        fully_shard(
            members if len(members) > 1 else unit,
            mesh=mesh.expert_dp if id(unit) in expert_ids and mesh.expert_dp is not None else mesh.dp,
            reshard_after_forward=False if keep else plan.reshard_after_forward,
            shard_placement_fn=placement,
            mp_policy=plan.mp_policy,
            offload_policy=plan.offload_policy,
            ignored_params=unit_ignored or None,
            replicate_params=unit_replicated or None,
            comm_fusion=plan.comm_fusion,
        )
    return units, [n for n, _ in ignored], [n for n, _ in replicated]


def order_of(model: nn.Module, module: nn.Module) -> int:
    """``module``'s position in ``model.modules()`` (registration order, usually forward order)."""
    return next(i for i, m in enumerate(model.modules()) if m is module)


def _is_head(group: list[nn.Module]) -> bool:
    return any(isinstance(m, nn.Linear) for m in group)


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
        wrap_as_forward(root, method)
    return names


def wire_prefetch(units: list[HSDPModule], depth: int) -> None:
    """Each unit all-gathers the next ``depth`` units in forward and the previous ``depth`` in backward.

    Overlaps each all-gather with the compute of the unit before it, at the cost of holding
    ``depth`` extra units gathered. ``units`` must be in forward execution order. A unit whose
    prefetch the user already set (on their own ``fully_shard`` unit) keeps it.
    """
    if depth <= 0:
        return
    for i, unit in enumerate(units):
        ahead: list[FSDPModule] = list(units[i + 1 : i + 1 + depth])
        behind: list[FSDPModule] = list(reversed(units[max(0, i - depth) : i]))
        if ahead and not prefetch_targets(unit, "forward"):
            unit.set_modules_to_forward_prefetch(ahead)
        if behind and not prefetch_targets(unit, "backward"):
            unit.set_modules_to_backward_prefetch(behind)


def apply_reduction(root: HSDPModule, plan: ShardingPlan) -> None:
    """Reduce op and scaling factor, applied recursively to every unit."""
    if plan.reduce_op != "avg":
        root.set_reduce_op_type(plan.reduce_op)
    if plan.gradient_scaling_factor is not None:
        root.set_gradient_scaling_factor(plan.gradient_scaling_factor)


def parallelize(model: nn.Module, mesh: ParallelMesh | DeviceMesh, plan: ShardingPlan) -> ShardedModel:
    """Parallelize ``model`` in place following the fixed order in this module's docstring."""
    mesh = ParallelMesh.of(mesh)
    # 1. Tensor parallelism, then 2. expert parallelism: both before FSDP shards their DTensors.
    apply_tensor_parallel(model, mesh, plan)
    experts = apply_expert_parallel(model, mesh, plan) or find_expert_modules(model)
    # 3. Activation checkpointing before sharding.
    apply_activation_checkpointing(model, plan.activation_checkpointing)
    # 4 + 5. Units bottom-up, then the root.
    units, ignored, replicated = shard_units(model, mesh, plan, experts)
    root = model
    if not isinstance(root, HSDPModule):  # pragma: no cover - shard_units always shards or adopts the root
        raise RuntimeError(f"parallelize left the root {type(root).__name__} unsharded.")
    # 6. Step and generate methods gather the root's parameters.
    register_forward_methods(root, plan.forward_methods)
    # 7. Prefetch in forward order (units came bottom-up; reverse pre-order reversed is pre-order).
    forward_order = list(reversed(units))
    wire_prefetch([u for u in forward_order if u is not root], plan.prefetch)  # type: ignore[misc]
    # 8. Reduction semantics.
    apply_reduction(root, plan)
    return ShardedModel(root=root, units=forward_order, ignored=ignored, replicated=replicated)  # type: ignore[arg-type]


