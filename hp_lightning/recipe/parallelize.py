"""Apply FSDP/HSDP to a model: one function per technique, applied in a fixed order.

:func:`parallelize` is the whole recipe; the strategy calls it once per setup:

1. tensor parallelism on the ``tp`` dim, before sharding, so FSDP shards TP's DTensors further
   over the data-parallel dims (FSDP2's 2-D composition);
2. expert parallelism on the ``ep`` dim: experts split over EP ranks, tokens moved by all-to-all;
3. activation checkpointing of the chosen blocks (whole, or selectively keeping matmul and
   attention outputs), before sharding, so FSDP's hooks sit outside the recomputed region;
4. ``torch.compile`` of each block's ``forward``, around its checkpointing, FSDP's hooks outside;
5. ``fully_shard`` on each unit, bottom-up, each with only the replicate/ignored parameters it
   owns; expert modules are units of their own on the data-parallel dims without ``ep``;
6. ``fully_shard`` on the root, which takes every parameter no unit owns (embeddings, heads);
7. forward-method registration on the root, so its parameters are gathered whichever method the
   user's code enters through (``training_step``, ``generate``, ...);
8. explicit prefetch between consecutive units;
9. reduce op and gradient scaling.

Materialization of meta-device parameters runs after sharding, so that no rank ever allocates the
whole model. :func:`shard_module` is the one call site of ``fully_shard``.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hp_lightning.core import devices
from hp_lightning.core._torch_private import prefetch_targets, wrap_as_forward
from hp_lightning.core.mesh import MODEL_PARALLEL_DIM_NAMES, ParallelMesh
from hp_lightning.core.options import HSDPOptions
from hp_lightning.core.units import UnitSpec, auto_units, bottom_up, select_modules, select_params, side_units
from hp_lightning.fully_shard import CPUOffloadPolicy, HSDPModule, MixedPrecisionPolicy, OffloadPolicy, adopt_sharded, build_mp_policy, fully_shard
from hp_lightning.parallel.expert import ExpertParallel, check_expert_split, find_expert_modules
from hp_lightning.parallel.pipeline.cut import whole_model_modules, whole_model_params
from hp_lightning.parallel.tensor import hf_tp_plan, resolve_tp_plan, tp_applied

#: Methods of a LightningModule that run a forward pass and so must gather the root's parameters.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
#: Methods registered automatically when the module has them.
AUTO_FORWARD_METHODS = ("generate",)


@dataclass(frozen=True)
class ShardingPlan:
    """What :func:`parallelize` applies: the options as the user set them, and the FSDP policies they resolve to.

    Only the two policies are resolved here, because they depend on the run (the front end's
    ``precision=``, the device) as well as the options: build them with :meth:`of`.
    """

    options: HSDPOptions = field(default_factory=HSDPOptions)
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)

    def __post_init__(self) -> None:
        """Refuse policies that contradict the options (a plan built by hand must not drop ``param_dtype`` silently).

        Raises:
            ValueError: ``param_dtype`` / ``reduce_dtype`` / ``cpu_offload`` set in the options but not in the policies.
        """
        wrong = [
            f"{name}={want} but mp_policy.{name}={got}"
            for name, want, got in (
                ("param_dtype", self.options.param_dtype, self.mp_policy.param_dtype),
                ("reduce_dtype", self.options.reduce_dtype, self.mp_policy.reduce_dtype),
            )
            if want is not None and want != got
        ]
        if self.options.cpu_offload != isinstance(self.offload_policy, CPUOffloadPolicy):
            wrong.append(f"cpu_offload={self.options.cpu_offload} but offload_policy={type(self.offload_policy).__name__}")
        if wrong:
            raise ValueError(f"ShardingPlan: the policies contradict the options ({'; '.join(wrong)}). Build the plan with ShardingPlan.of(options, ...).")

    @classmethod
    def of(
        cls,
        options: HSDPOptions,
        *,
        derived_param_dtype: torch.dtype | None = None,
        derived_reduce_dtype: torch.dtype | None = None,
        device_type: str = devices.CPU,
    ) -> ShardingPlan:
        """The plan for ``options`` in this run.

        Args:
            options: the strategy's options.
            derived_param_dtype / derived_reduce_dtype: what the front end's precision setting
                implies; the ``param_dtype`` / ``reduce_dtype`` options override them.
            device_type: the device the model trains on (pinned host memory needs an accelerator).
        """
        return cls(
            options=options,
            mp_policy=build_mp_policy(
                param_dtype=options.param_dtype or derived_param_dtype,
                reduce_dtype=options.reduce_dtype or derived_reduce_dtype,
            ),
            offload_policy=CPUOffloadPolicy(pin_memory=devices.is_accelerator(device_type)) if options.cpu_offload else OffloadPolicy(),
        )


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

    The plan is ``plan.options.tp_plan`` or, without one, the Hugging Face models' own
    ``base_model_tp_plan``. Nothing is applied when the user did TP in ``configure_model``.

    Raises:
        ValueError: TP requested without any plan, a pattern that matches nothing, a wrong style.
    """
    if mesh.tp is None or tp_applied(model):
        return []
    tp_plan = plan.options.tp_plan or hf_tp_plan(model)
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
    patterns = tuple(plan.options.expert_modules or DEFAULT_EXPERT_MODULES)
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


#: Ops whose outputs selective checkpointing keeps (the expensive ones); everything else is recomputed.
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm", "addmm", "bmm", "baddbmm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_expensive_ops)


def apply_activation_checkpointing(model: nn.Module, specs: Sequence[UnitSpec] | None, mode: str = "full", every: int = 1) -> list[nn.Module]:
    """Recompute the chosen blocks' activations in backward instead of storing them.

    Wraps each block's ``forward`` (not the module), so parameter names and state-dict keys
    stay the same. ``"full"`` keeps only each block's input and costs one extra forward per block
    in backward; ``"selective_op"`` keeps the outputs of :data:`SAVED_OPS` too and recomputes only
    the cheap ops. ``every``: only every N-th chosen block (the first, the N+1-th, ...).
    """
    if not specs:
        return []
    blocks = select_modules(model, specs, option="activation_checkpointing", whole_model=whole_model_modules(model))[::every]
    _turn_off_kv_caches(model)
    extra: dict[str, Any] = {"context_fn": _selective_contexts} if mode == "selective_op" else {}
    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def checkpointed(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = checkpointed
    return blocks


def _turn_off_kv_caches(model: nn.Module) -> None:
    """Hugging Face models with ``config.use_cache``: off, with a warning (as their own gradient checkpointing does).

    A key/value cache filled in forward is filled again when a checkpointed block is recomputed
    in backward, so the recomputation would attend over twice the keys (or, selectively, fail).
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False  # type: ignore[union-attr]
            warnings.warn(
                f"activation_checkpointing: {type(module).__name__}.config.use_cache was True, which a recomputed "
                f"block would fill twice; set to False for training (as Hugging Face's gradient checkpointing does).",
                UserWarning,
                stacklevel=3,
            )


def apply_compile(model: nn.Module, plan: ShardingPlan) -> list[nn.Module]:
    """``torch.compile`` the forward of each block the plan makes a unit (not the root, not the user's units).

    The bound ``forward`` is replaced, not the module: names and state-dict keys stay, and FSDP's
    hooks (registered afterwards) run outside the compiled region. Compilation happens at the first call.
    """
    setting = plan.options.compile
    if setting is False:
        return []
    arguments: dict[str, Any] = {} if setting is True else dict(setting)
    blocks = [m for m in planned_units(model, plan) if m is not model and not isinstance(m, FSDPModule)]
    for block in blocks:
        block.forward = torch.compile(block.forward, **arguments)
    return blocks


def _placement_fn(model: nn.Module, shard_placement: Mapping[str, int] | None):
    """Map parameter-name globs to ``Shard(dim)``; first matching pattern wins.

    Each pattern must match a parameter of the whole model (under a pipeline, one another stage
    holds counts: :func:`~hp_lightning.parallel.pipeline.cut.whole_model_params`).
    """
    if not shard_placement:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    whole = whole_model_params(model) or frozenset(names.values())
    for pattern in shard_placement:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in whole):
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


def _drop_already_sharded(selected: list[tuple[str, nn.Parameter]], option: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters a user unit already sharded cannot be ignored or replicated any more: warn and drop them.

    Raises:
        ValueError: a parameter tensor or expert parallelism split: it cannot be kept whole.
    """
    split = [n for n, p in selected if isinstance(p, DTensor) and MODEL_PARALLEL_DIM_NAMES & set(p.device_mesh.mesh_dim_names or ())]
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


def shard_units(model: nn.Module, mesh: ParallelMesh, plan: ShardingPlan, experts: Sequence[nn.Module] = ()) -> tuple[list[nn.Module], list[str], list[str]]:
    """``fully_shard`` each unit bottom-up, then the root. Returns (units, ignored names, replicated names).

    Modules the user sharded already (in ``configure_model`` or Fabric code) keep their own
    settings and are not sharded again: the plan only shards what is left, and the returned
    units include the user's, in bottom-up order. Expert modules are units on ``mesh.expert_dp``.
    """
    user_units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the user's own, outermost first
    planned = planned_units(model, plan)
    expert_ids = {id(m) for m in experts}
    # Automatic plans only: large embeddings / head (+ final norm) as units, each group led by its first module.
    groups = {} if plan.options.shard_modules or user_units else {id(g[0]): g for g in side_units(model, planned)}
    last_group = max(groups, key=lambda key: order_of(model, groups[key][0]), default=None)
    leaders = [g[0] for g in groups.values()]
    units = bottom_up(model, {id(m): m for m in [*planned, *experts, *user_units, *leaders] if m is not model}.values())
    ignored, replicated, placement = _parameter_rules(model, plan)
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
        shard_module(
            members if len(members) > 1 else unit,
            mesh.expert_dp if id(unit) in expert_ids and mesh.expert_dp is not None else mesh.dp,
            plan,
            placement=placement,
            ignored=unit_ignored,
            replicated=unit_replicated,
            keep_gathered=keep,
        )
    return units, [n for n, _ in ignored], [n for n, _ in replicated]


def planned_units(model: nn.Module, plan: ShardingPlan) -> list[nn.Module]:
    """The modules ``shard_modules`` names, or the automatic blocks without it (not yet sharded or ordered)."""
    if not plan.options.shard_modules:
        return auto_units(model)
    return select_modules(model, plan.options.shard_modules, whole_model=whole_model_modules(model))


def _parameter_rules(model: nn.Module, plan: ShardingPlan) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]], Any]:
    """The plan's per-parameter options resolved on ``model``: (ignored, replicated, placement function).

    Under a pipeline ``model`` is this rank's stage: a glob that matches only another stage's
    parameters selects nothing here, and only one that matches nothing in the whole model is refused.

    Raises:
        ValueError: a glob that matches nothing, or a parameter both ignored and replicated.
    """
    options = plan.options
    ignored = _drop_already_sharded(select_params(model, _globs_here(model, options.ignored_params), "ignored_params"), "ignored_params")
    replicated = _drop_already_sharded(select_params(model, _globs_here(model, options.replicate_params), "replicate_params"), "replicate_params")
    both = {n for n, _ in ignored} & {n for n, _ in replicated}
    if both:
        raise ValueError(f"Parameters {sorted(both)} match both ignored_params and replicate_params; pick one.")
    return ignored, replicated, _placement_fn(model, plan.options.shard_placement)


def _globs_here(model: nn.Module, patterns: Sequence[str] | None) -> Sequence[str] | None:
    """``patterns`` without those that match only parameters of the stages cut away from ``model``.

    A pattern that matches a parameter here, or none in the whole model (or anything but a list
    of strings), is kept: :func:`~hp_lightning.core.units.select_params` selects or refuses it.
    """
    whole = whole_model_params(model)
    if whole is None or patterns is None or isinstance(patterns, str) or not isinstance(patterns, Sequence):
        return patterns
    here = [name for name, _ in model.named_parameters()]

    def elsewhere_only(pattern: object) -> bool:
        return isinstance(pattern, str) and not any(fnmatch.fnmatchcase(n, pattern) for n in here) and any(fnmatch.fnmatchcase(n, pattern) for n in whole)

    return [pattern for pattern in patterns if not elsewhere_only(pattern)]


def shard_module(
    target: nn.Module | list[nn.Module],
    mesh: DeviceMesh,
    plan: ShardingPlan,
    *,
    placement: Any = None,
    ignored: set[nn.Parameter] | frozenset[nn.Parameter] = frozenset(),
    replicated: set[nn.Parameter] | frozenset[nn.Parameter] = frozenset(),
    keep_gathered: bool = False,
) -> None:
    """``fully_shard`` ``target`` with every plan-wide option: the one call site of ``fully_shard`` in the engine.

    What differs per module is an argument: ``placement`` (the shard-dim function; None: dim 0),
    the ``ignored`` / ``replicated`` parameters this unit owns, and ``keep_gathered`` (keep the
    parameters gathered after forward whatever ``reshard_after_forward`` says: a root, the head).
    """
    fully_shard(
        target,
        mesh=mesh,
        reshard_after_forward=False if keep_gathered else plan.options.reshard_after_forward,
        shard_placement_fn=placement,
        mp_policy=plan.mp_policy,
        offload_policy=plan.offload_policy,
        ignored_params=set(ignored) or None,
        replicate_params=set(replicated) or None,
        comm_fusion=plan.options.comm_fusion,
    )


def shard_stage_root(model: nn.Module, target: nn.Module | list[nn.Module], mesh: DeviceMesh, plan: ShardingPlan) -> None:
    """Shard a pipeline stage's root (its pieces no unit owns, or a view of its units) with the whole plan.

    ``model`` is the module the parameter globs are written against (the LightningModule, cut to
    this rank's stages); ``target`` gets the ``ignored_params`` it holds and the placement rules.
    A stage root stays gathered after forward (its parameters are needed again as backward starts).
    """
    ignored, replicated, placement = _parameter_rules(model, plan)
    members = target if isinstance(target, list) else [target]
    mine = {id(p) for m in members for p in m.parameters()}
    shard_module(
        target,
        mesh,
        plan,
        placement=placement,
        ignored={p for _, p in ignored if id(p) in mine},
        replicated={p for _, p in replicated if id(p) in mine},
        keep_gathered=True,
    )


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
    if plan.options.reduce_op != "avg":
        root.set_reduce_op_type(plan.options.reduce_op)
    if plan.options.gradient_scaling_factor is not None:
        root.set_gradient_scaling_factor(plan.options.gradient_scaling_factor)


def parallelize(model: nn.Module, mesh: ParallelMesh | DeviceMesh, plan: ShardingPlan | HSDPOptions) -> ShardedModel:
    """Parallelize ``model`` in place following the fixed order in this module's docstring."""
    mesh = ParallelMesh.of(mesh)
    plan = plan if isinstance(plan, ShardingPlan) else ShardingPlan.of(plan)
    apply_tensor_parallel(model, mesh, plan)
    experts = apply_expert_parallel(model, mesh, plan) or find_expert_modules(model)
    options = plan.options
    apply_activation_checkpointing(model, options.activation_checkpointing, options.activation_checkpointing_mode, options.activation_checkpointing_every)
    apply_compile(model, plan)
    units, ignored, replicated = shard_units(model, mesh, plan, experts)
    root = model
    if not isinstance(root, HSDPModule):  # pragma: no cover - shard_units always shards or adopts the root
        raise RuntimeError(f"parallelize left the root {type(root).__name__} unsharded.")
    register_forward_methods(root, plan.options.forward_methods)
    # Prefetch in forward order (units came bottom-up; reverse pre-order reversed is pre-order).
    forward_order = list(reversed(units))
    wire_prefetch([u for u in forward_order if u is not root], plan.options.prefetch)  # type: ignore[misc]
    apply_reduction(root, plan)
    return ShardedModel(root=root, units=forward_order, ignored=ignored, replicated=replicated)  # type: ignore[arg-type]


