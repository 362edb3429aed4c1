"""HyperParallel's ``fully_shard`` signature and runtime controls, running on PyTorch FSDP2.

``hp_lightning.fully_shard`` accepts exactly the seed's arguments and returns the same module,
now an :class:`HSDPModule` (which is also a torch ``FSDPModule``). Everything that shards,
gathers or reduces is FSDP2's; this layer adds what the seed has and FSDP2 spells differently
or lacks:

=========================  ======================================================================
seed                       here
=========================  ======================================================================
``replicate_params``       FSDP2 ``ignored_params`` + :class:`~.replicate.ReplicatedParamSync`
``comm_fusion``            bucketed replicate-param all-reduce (FSDP2 already fuses each unit's
                           all-gather and reduce-scatter into one collective)
``set_reduce_op_type``     FSDP2 gradient divide factor + sum-only collectives
``set_gradient_scaling_``  same mechanism: final gradient = factor x reduced gradient
``factor``
=========================  ======================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, UnshardHandle
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hp_lightning.core._torch_private import managed_params
from hp_lightning.core.checks import REDUCE_OPS, ArgumentTypeError, validate_scaling_factor
from hp_lightning.core.devices import is_accelerator
from hp_lightning.core.materialize import link_construction
from hp_lightning.core.mesh import build_device_mesh, default_device_type
from hp_lightning.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_lightning.fully_shard.replicate import ReplicatedParamSync
from hp_lightning.parallel.expert import expert_parallel_size, find_expert_modules

__all__ = [
    "ArgumentTypeError",
    "HSDPModule",
    "REDUCE_OPS",
    "adopt_sharded",
    "fully_shard",
    "hsdp_modules",
    "to_model_placements",
    "validate_scaling_factor",
]

def _require_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{what} expects a bool (True or False); got {type(value).__name__} {value!r}.")
    return value


def _require_fsdp_modules(modules: Any, what: str) -> list[FSDPModule]:
    if isinstance(modules, nn.Module) or not isinstance(modules, Iterable):
        raise ArgumentTypeError(
            f"{what} expects a list of modules returned by fully_shard; got {type(modules).__name__}. "
            f"Wrap a single module in a list: {what}([module])."
        )
    modules = list(modules)
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ArgumentTypeError(
                f"{what} expects modules that fully_shard has sharded; got an unsharded "
                f"{type(module).__name__}. Call hp_lightning.fully_shard on it first."
            )
    return modules


if TYPE_CHECKING:
    # Every HSDPModule is an nn.Module: the class fully_shard builds is HP<FSDP<Orig>>, and Orig is
    # the user's module class. Only the type checker sees this base; at runtime it is FSDPModule.
    class _ShardedModule(FSDPModule, nn.Module): ...

else:
    _ShardedModule = FSDPModule


class HSDPModule(_ShardedModule):
    """The runtime controls of a module sharded by :func:`fully_shard`.

    Each control validates its argument and, where the seed does, recurses over the sharding
    units below this one. Methods not overridden here are FSDP2's own.
    """

    # MRO: [HP<FSDP<Orig>>, HSDPModule, FSDP<Orig>, FSDPModule, Orig, ...]; FSDPModule.__new__
    # uses this index to construct the original class when a container is indexed.
    _orig_cls_mro_index: int = 4

    # Set by fully_shard on every unit.
    _hp_mesh: DeviceMesh
    _hp_replicated: ReplicatedParamSync | None
    _hp_reduce_op: str
    _hp_scaling_factor: float | None
    _hp_extra_divisor: int

    def _hp_units(self, recurse: bool) -> list[HSDPModule]:
        return hsdp_modules(self) if recurse else [self]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``to_empty()`` / ``.to()`` may put new objects in the places of replicate params, which
        # FSDP2 does not manage: their gradient all-reduce hooks must follow them.
        out = super()._apply(fn, recurse)
        for unit in self._hp_units(recurse):
            replicated = getattr(unit, "_hp_replicated", None)
            if replicated is not None:
                replicated.follow_replaced()
        return out

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh this unit shards over (a LightningModule keeps its own ``device_mesh``: see :attr:`sharding_mesh`)."""
        return self._hp_mesh

    @property
    def sharding_mesh(self) -> DeviceMesh:
        """The data-parallel mesh this unit shards over, whatever the module's class calls ``device_mesh``."""
        return self._hp_mesh

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction on or off (off = accumulate locally, e.g. on non-final micro-batches).

        Off holds full-size, unsharded gradients between backward passes: the least
        communication, the most memory.
        """
        _require_bool(requires_gradient_sync, "set_requires_gradient_sync")
        _require_bool(recurse, "set_requires_gradient_sync(recurse=...)")
        super().set_requires_gradient_sync(requires_gradient_sync, recurse=recurse)
        for unit in self._hp_units(recurse):
            if unit._hp_replicated is not None:
                unit._hp_replicated.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: run (True) or defer (False) the all-reduce across replicate groups.

        With False, gradients are still reduce-scattered inside each shard group every backward,
        and the cross-group all-reduce waits for a backward with True. On a 1-D (FSDP) mesh both
        values are no-ops, as in HyperParallel and torch; use ``set_requires_gradient_sync(False)``.
        """
        _require_bool(requires_all_reduce, "set_requires_all_reduce")
        _require_bool(recurse, "set_requires_all_reduce(recurse=...)")
        if self._hp_mesh.ndim != 2:
            return
        super().set_requires_all_reduce(requires_all_reduce, recurse=recurse)
        for unit in self._hp_units(recurse):
            if unit._hp_replicated is not None:
                unit._hp_replicated.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free gathered parameters after forward (True: less memory) or keep them for backward."""
        _require_bool(reshard_after_forward, "set_reshard_after_forward")
        _require_bool(recurse, "set_reshard_after_forward(recurse=...)")
        super().set_reshard_after_forward(reshard_after_forward, recurse=recurse)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free gathered parameters after backward (True) or keep them for the next micro-batch."""
        _require_bool(reshard_after_backward, "set_reshard_after_backward")
        _require_bool(recurse, "set_reshard_after_backward(recurse=...)")
        super().set_reshard_after_backward(reshard_after_backward, recurse=recurse)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` as soon as this unit's forward starts (overlaps communication)."""
        super().set_modules_to_forward_prefetch(_require_fsdp_modules(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` as soon as this unit's backward starts."""
        super().set_modules_to_backward_prefetch(_require_fsdp_modules(modules, "set_modules_to_backward_prefetch"))

    def set_gradient_scaling_factor(self, factor: float | None) -> None:
        """Multiply every reduced gradient below this unit by ``factor`` (None: no scaling).

        The final gradient is ``factor * reduce_op(local gradients)``, replicate parameters
        included; e.g. ``1 / tokens_in_global_batch`` with ``reduce_op="sum"`` normalizes by
        the global token count.
        """
        factor = validate_scaling_factor(factor, "set_gradient_scaling_factor")
        for unit in self._hp_units(recurse=True):
            unit._hp_scaling_factor = factor
            unit._hp_apply_reduction()

    def set_reduce_op_type(self, reduce_op: str) -> None:
        """Reduce gradients by ``"avg"`` (default: mean over data-parallel ranks) or ``"sum"``."""
        if not isinstance(reduce_op, str):
            raise ArgumentTypeError(f"set_reduce_op_type expects 'avg' or 'sum'; got {type(reduce_op).__name__} {reduce_op!r}.")
        op = reduce_op.lower()
        if op not in REDUCE_OPS:
            raise ValueError(f"set_reduce_op_type expects one of {REDUCE_OPS}; got {reduce_op!r}.")
        for unit in self._hp_units(recurse=True):
            unit._hp_reduce_op = op
            unit._hp_apply_reduction()

    def _hp_apply_reduction(self) -> None:
        """Express (reduce op, scaling factor) as FSDP2's gradient divide factor.

        FSDP2 computes ``sum(local grads) / divide_factor``; "avg" with scaling ``f`` is
        ``divide_factor = N / f`` and "sum" is ``1 / f``, N being the data-parallel size
        (both axes in HSDP; for expert-parallel experts also the ``ep`` size, whose ranks' tokens
        all reach the experts). Sum-only collectives keep this exact on every backend, gloo
        included, at the cost of one in-place division after the collective.
        """
        extra = getattr(self, "_hp_extra_divisor", 1)
        default = self._hp_reduce_op == "avg" and self._hp_scaling_factor is None and extra == 1
        if default:
            super().set_gradient_divide_factor(None)  # type: ignore[arg-type]
            super().set_force_sum_reduction_for_comms(False)
        else:
            divisor = float(self._hp_mesh.size() * extra) if self._hp_reduce_op == "avg" else 1.0
            if self._hp_scaling_factor is not None:
                divisor /= self._hp_scaling_factor
            alone = self._hp_shard_group_is_one_rank(divisor)
            super().set_gradient_divide_factor(divisor)
            super().set_force_sum_reduction_for_comms(not alone)
        if self._hp_replicated is not None:
            self._hp_replicated.reduce_op = self._hp_reduce_op
            self._hp_replicated.scaling_factor = self._hp_scaling_factor

    def _hp_shard_group_is_one_rank(self, divisor: float) -> bool:
        """Whether this unit shards over one rank (single device, HSDP ``(R, 1)``, experts with ``ep`` = shard size).

        There FSDP2 (torch 2.13) runs no reduce-scatter but copies the gradient divided by the
        factor, and divides again when sum-only reduction is forced, so it is not forced. For reduce
        dtypes other than float32/bfloat16 torch divides twice either way: refused, not trained
        with a squared divisor.

        Raises:
            ValueError: for a one-rank unit reducing in another dtype with a divisor other than 1.
        """
        if self._hp_mesh.size(self._hp_mesh.ndim - 1) != 1:
            return False

        dtypes = {policy.reduce_dtype or policy.param_dtype or param.dtype for param, policy, _ in managed_params(self)}
        risky = sorted(str(d) for d in dtypes if d not in (torch.float32, torch.bfloat16))
        if risky and divisor != 1.0:
            raise ValueError(
                f"Gradient reduction with reduce op {self._hp_reduce_op!r}, scaling factor {self._hp_scaling_factor} "
                f"and expert divisor {getattr(self, '_hp_extra_divisor', 1)} on a unit sharded over one rank (mesh "
                f"{tuple(self._hp_mesh.shape)}) needs a float32 or bfloat16 reduce dtype; got {risky}, for which "
                f"torch's FSDP2 divides these gradients twice (by {divisor:g} squared). Reduce in float32 "
                f"(MixedPrecisionPolicy(reduce_dtype=torch.float32)), shard over more than one rank, or keep the "
                f"default reduction (avg, no scaling)."
            )
        return True

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict whose sharded entries may be DTensors, full tensors or this rank's shards.

        HyperParallel's ``load_state_dict`` takes all three; FSDP2 only DTensors (conversion:
        :func:`to_model_placements`). ``assign=True`` makes the loaded values the parameters (what a
        meta-device module needs) but never aliases the caller's storage, as HyperParallel's copy
        into its shards does: an entry torch would alias is copied first.

        Raises:
            ValueError: an entry whose shape is neither the parameter's global nor its local shape.
        """
        converted = to_model_placements(self, state_dict)
        if assign:
            converted = {key: _unaliased(value, state_dict[key]) for key, value in converted.items()}
        return super().load_state_dict(converted, strict=strict, assign=assign)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now; with ``async_op=True`` return a handle to wait on."""
        _require_bool(async_op, "unshard(async_op=...)")
        return super().unshard(async_op=async_op)


def _storage_of(value: Any) -> torch.UntypedStorage | None:
    if isinstance(value, DTensor):
        value = value.to_local()
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return None
    return value.untyped_storage()


def _unaliased(loaded: Any, given: Any) -> Any:
    """``loaded`` (converted from the caller's ``given``), copied when it shares ``given``'s storage."""
    loaded_storage, given_storage = _storage_of(loaded), _storage_of(given)
    if loaded_storage is None or given_storage is None or loaded_storage.data_ptr() != given_storage.data_ptr():
        return loaded
    return loaded.detach().clone()


_HP_CLASSES: dict[type, type] = {}


def _kept_attributes(cls: type) -> dict[str, Any]:
    """What the module's own class defines that :class:`HSDPModule` must not shadow (a LightningModule's ``device_mesh``)."""
    for base in cls.__mro__:
        if base is not HSDPModule and "device_mesh" in base.__dict__:
            return {"device_mesh": base.__dict__["device_mesh"]}
    return {}


def _extend_with_controls(module: nn.Module) -> HSDPModule:
    """Swap ``module``'s class for one that adds :class:`HSDPModule`'s controls (as FSDP2 does)."""
    cls = type(module)
    if isinstance(module, HSDPModule):
        return module
    if cls not in _HP_CLASSES:
        _HP_CLASSES[cls] = type(f"HP{cls.__name__}", (HSDPModule, cls), _kept_attributes(cls))
    module.__class__ = _HP_CLASSES[cls]
    return cast(HSDPModule, module)


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str) and device.strip():
        return torch.device(device.strip()).type
    raise ArgumentTypeError(f"fully_shard(device=...) expects a torch.device, a string like 'cpu' or None; got {device!r}.")


def _default_mesh(device_type: str | None = None) -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard(mesh=None) builds a 1-D mesh over the default process group, but "
            "torch.distributed is not initialized. Call torch.distributed.init_process_group "
            "first, or pass mesh=hp_lightning.init_device_mesh(...)."
        )
    return build_device_mesh(device_type or default_device_type(), (dist.get_world_size(),))


def _host_offload_for(mesh: DeviceMesh, offload_policy: OffloadPolicy) -> OffloadPolicy:
    """``offload_policy`` with pinning dropped on a CPU mesh (same numbers).

    Pinning needs an accelerator runtime (torch would raise "Cannot access accelerator device when
    none is available") and only speeds up host<->accelerator copies.
    """
    if isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory and not is_accelerator(mesh.device_type):
        return dataclasses.replace(offload_policy, pin_memory=False)
    return offload_policy


def _param_set(params: Iterable[nn.Parameter] | None, what: str) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, (torch.Tensor, nn.Module)) or not isinstance(params, Iterable):
        raise ArgumentTypeError(
            f"fully_shard({what}=...) expects a set or list of nn.Parameter; got {type(params).__name__}. "
            f"Pass for example {what}={{model.head.weight}}."
        )
    out: list[nn.Parameter] = []
    for p in params:
        if not isinstance(p, nn.Parameter):
            raise ArgumentTypeError(f"fully_shard({what}=...) expects nn.Parameter items; got {type(p).__name__}.")
        if not any(p is q for q in out):
            out.append(p)
    return out


def _validate_placement_fn(fn: Callable[[nn.Parameter], Shard | None]) -> Callable[[nn.Parameter], Shard | None]:
    def checked(param: nn.Parameter) -> Shard | None:
        placement = fn(param)
        if placement is not None and not isinstance(placement, Shard):
            raise ArgumentTypeError(
                f"shard_placement_fn must return torch.distributed.tensor.Shard(dim) or None; got "
                f"{type(placement).__name__} {placement!r} for a parameter of shape {tuple(param.shape)}."
            )
        if placement is not None and not -param.ndim <= placement.dim < param.ndim:
            raise ValueError(
                f"shard_placement_fn must return a dim in [{-param.ndim}, {param.ndim - 1}] for a parameter of "
                f"shape {tuple(param.shape)}; got Shard({placement.dim}). Return Shard(0) or None for dim 0."
            )
        return placement

    return checked


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    replicate_params: set[nn.Parameter] | None = None,
    comm_fusion: bool = False,
    device: str | torch.device | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module`` in place with FSDP (1-D mesh) or HSDP (2-D ``(replicate, shard)`` mesh).

    Call it bottom-up: on each sharding unit (a transformer block, say), then on the root. Each
    call groups the parameters not yet owned by an inner unit (of ``module``, or of a list of
    modules forming one unit) into one all-gather and one reduce-scatter.

    Args:
        mesh: 1-D → FSDP; 2-D ``(replicate, shard)`` → HSDP; None → 1-D over the world.
        reshard_after_forward: free gathered parameters after forward (True) or keep them for
            backward (False: one all-gather fewer per unit, the unit's full size held longer).
        shard_placement_fn: ``param -> Shard(dim) | None``; None → dim 0.
        mp_policy: compute (``param_dtype``) and gradient-reduction (``reduce_dtype``) dtypes.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards, gradients and optimizer state on
            the host (not pinned on a CPU mesh); ``OffloadPolicy()`` or None on the device.
        ignored_params: left alone: not sharded, gradients not synchronized (each rank keeps its own).
        replicate_params: kept whole on every rank, gradients all-reduced over the whole
            data-parallel domain, honouring every control below.
        comm_fusion: reduce the unit's replicate-parameter gradients in one bucketed all-reduce
            instead of one per parameter.
        device: the device (type) to shard onto, as in HyperParallel: builds the default mesh, or
            must match the given mesh's. None: the mesh's device (the accelerator when there is one).

    Returns:
        The same module (or list), extended with :class:`HSDPModule`'s runtime controls.

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value, before any collective.
    """
    modules = module if isinstance(module, list) else [module]
    if isinstance(module, list) and not module:
        raise ValueError("fully_shard expects a module or a non-empty list of modules; got [].")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ArgumentTypeError(f"fully_shard expects nn.Module or list[nn.Module]; got {type(m).__name__}.")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard expects a module it has not sharded yet; got {type(m).__name__}, already sharded. "
                f"Apply it once per unit, bottom-up: the blocks first, then the root."
            )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ArgumentTypeError(f"fully_shard(mesh=...) expects a DeviceMesh or None; got {type(mesh).__name__}.")
    _require_bool(reshard_after_forward, "fully_shard(reshard_after_forward=...)")
    _require_bool(comm_fusion, "fully_shard(comm_fusion=...)")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise ArgumentTypeError(f"fully_shard(shard_placement_fn=...) expects a callable or None; got {type(shard_placement_fn).__name__}.")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ArgumentTypeError(
            f"fully_shard(mp_policy=...) expects hp_lightning.MixedPrecisionPolicy; got {type(mp_policy).__name__}."
        )
    offload_policy = OffloadPolicy() if offload_policy is None else offload_policy
    if not isinstance(offload_policy, OffloadPolicy):
        raise ArgumentTypeError(
            f"fully_shard(offload_policy=...) expects OffloadPolicy() or CPUOffloadPolicy(); got "
            f"{type(offload_policy).__name__}."
        )
    ignored = _param_set(ignored_params, "ignored_params")
    replicated = _param_set(replicate_params, "replicate_params")
    both = [p for p in replicated if any(p is q for q in ignored)]
    if both:
        raise ValueError(
            f"fully_shard expects disjoint ignored_params and replicate_params; got {len(both)} parameter(s) in "
            f"both. A parameter is either left alone (ignored) or kept whole with synchronized gradients "
            f"(replicate): remove it from one of the sets."
        )

    device_type = _device_type(device)
    if mesh is not None and device_type is not None and mesh.device_type != device_type:
        raise ValueError(
            f"fully_shard(device={device!r}) does not match the mesh, which is on {mesh.device_type!r}. Pass a mesh "
            f"built on {device_type!r} (hp_lightning.init_device_mesh({device_type!r}, ...)), or drop device=."
        )
    mesh = mesh if mesh is not None else _default_mesh(device_type)
    offload_policy = _host_offload_for(mesh, offload_policy)
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP); got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. For FSDP+TP pass the data-parallel "
            f"sub-mesh, e.g. mesh['dp']."
        )

    # Sharding by hand inside a recorded meta-device build (configure_model): remember which
    # recorded tensors these parameters are, before FSDP replaces them, so setup can initialize them.
    for m in modules:
        link_construction(m)

    # Expert-parallel experts below this unit average their gradients over more ranks than the
    # rest (every EP rank's tokens reach them): they become a unit of their own first.
    for m in modules:
        for experts in find_expert_modules(m):
            if experts is not m and not isinstance(experts, FSDPModule):
                fully_shard(
                    experts,
                    mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=shard_placement_fn,
                    mp_policy=mp_policy,
                    offload_policy=offload_policy,
                )

    _torch_fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=_validate_placement_fn(shard_placement_fn) if shard_placement_fn else None,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=set(ignored) | set(replicated) or None,
    )
    sync = ReplicatedParamSync(replicated, mesh, bucketed=comm_fusion, module=modules) if replicated else None
    for m in modules:
        _attach_controls(m, mesh, sync)
        sync = None  # the unit's sync lives on its first module; the others share the FSDP state
    return module


def _attach_controls(module: nn.Module, mesh: DeviceMesh, replicated: ReplicatedParamSync | None) -> HSDPModule:
    """Make a sharded ``module`` an :class:`HSDPModule` with the controls at their defaults ("avg", no scaling)."""
    unit = _extend_with_controls(module)
    unit._hp_mesh = mesh
    unit._hp_replicated = replicated
    unit._hp_reduce_op = "avg"
    unit._hp_scaling_factor = None
    unit._hp_extra_divisor = expert_parallel_size(unit)  # an expert unit's gradients also average over EP
    if unit._hp_extra_divisor != 1:
        unit._hp_apply_reduction()
    return unit


def adopt_sharded(module: nn.Module) -> HSDPModule:
    """Give a module sharded by torch's own ``fully_shard`` the runtime controls of :class:`HSDPModule`.

    Its sharding is left as the user chose; reduce op and scaling start at their defaults ("avg",
    none). Modules sharded by :func:`fully_shard` are returned as they are.

    Raises:
        TypeError: when ``module`` is not sharded at all.
    """
    if isinstance(module, HSDPModule):
        return module
    if not isinstance(module, FSDPModule):
        raise ArgumentTypeError(f"adopt_sharded expects a module sharded by fully_shard; got an unsharded {type(module).__name__}.")
    mesh = next((p.device_mesh for p in module.parameters() if isinstance(p, DTensor)), None)
    if mesh is None:
        raise ValueError(f"adopt_sharded: {type(module).__name__} is sharded but holds no sharded parameter to read its mesh from.")
    return _attach_controls(module, mesh, None)


def hsdp_modules(module: nn.Module) -> list[HSDPModule]:
    """All sharding units in ``module``'s tree (root included), outermost first."""
    return [m for m in module.modules() if isinstance(m, HSDPModule)]


def to_model_placements(model: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each plain tensor for a sharded parameter turned into a DTensor like it.

    Full tensors (the global shape) keep this rank's slice, without communication (every rank is
    expected to pass the same full tensor, as with a full state dict); tensors of the local shard's
    shape are taken as this rank's shard. DTensors and entries for unsharded tensors pass through.

    Raises:
        ValueError: a plain tensor whose shape is neither the global nor the local shape.
    """
    if not isinstance(state_dict, Mapping):
        raise ArgumentTypeError(f"load_state_dict expects a mapping of names to tensors; got {type(state_dict).__name__}.")
    current = dict(model.named_parameters(remove_duplicate=False))
    out = dict(state_dict)
    for key, value in state_dict.items():
        param = current.get(key)
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        local = param.to_local()
        value = value.detach().to(device=local.device, dtype=local.dtype)
        if tuple(value.shape) == tuple(param.shape):
            out[key] = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        elif tuple(value.shape) == tuple(local.shape):
            out[key] = DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            raise ValueError(
                f"load_state_dict: {key!r} has shape {tuple(value.shape)}; expected the full shape "
                f"{tuple(param.shape)} or this rank's shard {tuple(local.shape)} (placements {param.placements})."
            )
    return out
