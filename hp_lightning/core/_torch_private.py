"""Every private torch name hp_lightning touches, behind one small function each.

torch's public API does not cover these needs (each function says which one); when a torch upgrade
renames one, this file is the only place to change, and ``tests/unit/test_private_apis.py`` fails
with :func:`missing_private_names`' message instead of a training run failing somewhere deep.

Checked against torch 2.13.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # intercepting ops at dispatch (no public base class)

__all__ = ["TorchDispatchMode"]

#: The torch releases every name below was checked against.
CHECKED_TORCH_VERSIONS = ("2.13",)

# (module path, attribute path) of each private name, for the version test.
_PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._pre_forward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._post_forward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._fsdp_param_groups"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._states_to_forward_prefetch"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._states_to_backward_prefetch"),
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState.FORWARD"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.post_forward_mesh_info"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup._training_state"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.is_unsharded"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.fsdp_params"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.mp_policy"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.offload_policy"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup._partial_reduce_output"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.sharded_param"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.unsharded_accumulated_grad"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam._unsharded_param"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.autograd.variable", "Variable._execution_engine.queue_callback"),
    # The planner (hp_lightning/planner): a fake process group and fake tensors, one simulated rank.
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),  # registers the "fake" backend on import
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    ("torch._subclasses.fake_tensor", "UnsupportedOperatorException"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator.propagate_op_sharding"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached"),
    ("torch.utils._pytree", "tree_flatten"),
)


def _resolve(module_path: str, attribute_path: str) -> bool:
    try:
        obj: Any = importlib.import_module(module_path)
    except ImportError:
        return False
    for part in attribute_path.split("."):
        if part in getattr(obj, "__annotations__", {}) and not hasattr(obj, part):
            # A dataclass-style attribute declared on the class and set per instance.
            return True
        if not hasattr(obj, part):
            # Instance attributes set in __init__ are visible in its code object's names.
            init = getattr(obj, "__init__", None)
            code = getattr(init, "__code__", None)
            return code is not None and part in code.co_names
        obj = getattr(obj, part)
    return True


def missing_private_names() -> list[str]:
    """The private torch names this installation lacks (empty when all are there)."""
    return [f"{m}.{a}" for m, a in _PRIVATE_NAMES if not _resolve(m, a)]


# ---------------------------------------------------------------- FSDP2 per-unit state


def fsdp_state(unit: nn.Module) -> Any:
    """FSDP2's state object of a sharded unit (no public accessor)."""
    return unit._get_fsdp_state()  # type: ignore[operator]


def param_groups(unit: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one unit (one per ``fully_shard`` call on it)."""
    return list(getattr(fsdp_state(unit), "_fsdp_param_groups", ()))


def prefetch_targets(unit: nn.Module, direction: str) -> list[nn.Module]:
    """Modules this unit all-gathers ahead of time in ``"forward"`` or ``"backward"``.

    FSDP2 has setters (``set_modules_to_*_prefetch``) but no getters.
    """
    modules: list[nn.Module] = []
    for target in getattr(fsdp_state(unit), f"_states_to_{direction}_prefetch", ()):
        modules.extend(getattr(target, "_modules", ()))
    return modules


def reshards_after_forward(unit: nn.Module) -> bool:
    """Whether the unit frees its gathered parameters after forward (no public getter)."""
    return any(group.post_forward_mesh_info is not None for group in param_groups(unit))


def wrap_as_forward(root: nn.Module, method_name: str) -> None:
    """Run ``root.<method_name>`` inside the root's FSDP forward hooks, surviving a nested ``self(...)``.

    torch's public ``register_fsdp_forward_method`` does not suffice for a LightningModule's step
    methods: they call ``self(x)``, whose own hooks end the forward pass early; the inner
    post-forward leaves the root's group idle and the outer one then reshards it, although the
    root keeps its parameters after forward, so backward would all-gather the root (embeddings,
    head) a second time every micro-batch. Re-entering the forward state before the outer
    post-forward keeps one all-gather per micro-batch.
    """
    import functools

    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    original = getattr(root, method_name)

    @functools.wraps(original)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = fsdp_state(self)
        args, kwargs = state._pre_forward(self, args, kwargs)
        output = original(*args, **kwargs)
        for group in getattr(state, "_fsdp_param_groups", ()):
            if getattr(group, "_training_state", None) == TrainingState.IDLE and getattr(group, "is_unsharded", False):
                group._training_state = TrainingState.FORWARD
        return state._post_forward(self, args, output)

    setattr(root, method_name, types.MethodType(wrapped, root))


# ---------------------------------------------------------------- autograd, store, DCP


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once at the end of the current backward pass (no public equivalent)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> dist.Store:
    """The default process group's store (no public accessor)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def resolve_process_group(group_name: str) -> Any:
    """The process group a functional collective names by string (no public lookup)."""
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(group_name))


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A 1-D mesh over all ranks of ``mesh`` (a slice of a root mesh), registered on the root as ``name``.

    torchtitan's way to give several mesh dims one process group (e.g. expert-parallel ranks that
    are also data-parallel ranks); DeviceMesh has no public flatten.
    """
    return mesh._flatten(name)


def set_collective_timeout(group: Any, timeout: Any) -> None:
    """Change an existing process group's collective timeout (torch has no public setter)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def managed_params(unit: nn.Module) -> list[tuple[Any, Any, Any]]:
    """``(sharded parameter, mp_policy, offload_policy)`` for every parameter ``unit`` itself manages.

    FSDP2 keeps these on its (private) parameter groups; there is no public listing.
    """
    return [
        (fsdp_param.sharded_param, group.mp_policy, group.offload_policy)
        for group in param_groups(unit)
        for fsdp_param in group.fsdp_params
    ]


def held_gradients(unit: nn.Module) -> list[torch.Tensor]:
    """Gradient storage FSDP2 holds for ``unit`` outside ``param.grad``.

    The unsharded gradients accumulated while gradient sync is off, and HSDP partial reductions
    waiting for their all-reduce (``set_requires_all_reduce(False)``).
    """
    held: list[Optional[torch.Tensor]] = []
    for group in param_groups(unit):
        held.append(getattr(group, "_partial_reduce_output", None))
        for fsdp_param in group.fsdp_params:
            held.append(getattr(fsdp_param, "unsharded_accumulated_grad", None))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                held.append(unsharded.grad)
    return [t for t in held if t is not None]


# ---------------------------------------------------------------- the planner's fake world


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` in which tensors have shapes and dtypes but no storage.

    Real tensors (torchmetrics' scalar states, constants a model keeps) may enter it: they are
    converted on first use instead of refused.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a fake-tensor run raises for code that reads tensor values or has no fake kernel."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        UnsupportedOperatorException,
    )

    return (DataDependentOutputException, UnsupportedOperatorException)


def reset_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions, which hold the meshes (and group names) of an earlier fake world.

    Each simulated rank joins a new fake world; a cached decision for an equal-looking mesh would
    name a process group of a world that no longer exists.
    """
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if clear is not None:
            clear()


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Make this process rank ``rank`` of a fake world of ``world_size`` for the ``with`` block.

    Raises:
        RuntimeError: a process group exists already (the planner runs before training, not inside it).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "hp_lightning.planner simulates ranks on a fake process group of its own, but this process already "
            "has a process group. Run the planner in its own process (`python -m hp_lightning plan ...`), not inside "
            "a training job."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    reset_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """torch's pytree flattening (``torch.utils._pytree``; no public pytree module in torch 2.13)."""
    from torch.utils._pytree import tree_flatten as flatten

    return flatten(tree)
