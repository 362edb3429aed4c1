"""Every private torch name hp_lightning touches, behind one small function each, resolved honestly.

torch's public API does not cover these needs (each function says which one); when a torch upgrade
renames one, this file is the only place to change. Two guards hold it to the releases it was
verified on (:data:`VERIFIED_TORCH`): :func:`missing_private_names` resolves every name for real
(``tests/unit/test_private_apis.py`` runs it on each of them), and on another torch ``import
hp_lightning`` still works while the first use of a feature that needs a missing name raises
:class:`MissingPrivateNameError` naming it (nothing falls back silently to doing less).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from hp_lightning.core import devices

#: The torch releases hp_lightning is tested on, oldest first: CI runs the whole suite on the first
#: (Makefile: ``TORCH_PIN``) and the compat slice (``tests/compat_slice.txt``) on each other one
#: (Makefile: ``COMPAT_PINS_<major.minor>``); every name below was resolved on each of them.
VERIFIED_TORCH: tuple[str, ...] = ("2.13.0", "2.14.1", "2.15.0")


def tested_range(verified: Sequence[str]) -> str:
    """The pip range that releases ``verified`` (oldest first) span: from the oldest to the next minor after the newest.

    ``("2.13.0", "2.14.1", "2.15.0")`` gives ``">=2.13,<2.16"``; ``("2.5.2", "2.6.6")`` gives ``">=2.5.2,<2.7"``.
    """
    oldest, newest = verified[0], verified[-1]
    floor = oldest.removesuffix(".0") if oldest.count(".") == 2 else oldest
    major, minor = (int(part) for part in newest.split(".")[:2])
    return f">={floor},<{major}.{minor + 1}"


#: The torch releases hp_lightning supports: exactly the range its verified releases span
#: (``pyproject.toml`` pins the same; ``tests/unit/test_private_apis.py`` compares them).
TESTED_TORCH = tested_range(VERIFIED_TORCH)


class MissingPrivateNameError(ImportError):
    """A private torch or Lightning name a feature needs is absent: raised at the feature's first use, never at import."""


@dataclass(frozen=True)
class PrivateName:
    """One private name: ``module`` then ``path`` (dotted attributes), and what needs it.

    Attributes:
        feature: what in hp_lightning needs it, in a user's words (the error says it).
        per_instance: the attributes after the first (a class) are set on each instance, so they
            are checked on a real instance of that class (see :func:`missing_private_names`).
        verified: the releases of its library it was resolved on (a subset where a release lacks
            it and the code takes another route there).
    """

    module: str
    path: str
    feature: str
    per_instance: bool = False
    verified: tuple[str, ...] = VERIFIED_TORCH

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"

    @property
    def library(self) -> str:
        return self.module.split(".")[0]


_FSDP = "torch.distributed.fsdp._fully_shard"
_PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "sharding introspection and prefetch wiring"),
    PrivateName(f"{_FSDP}._fsdp_state", "FSDPState._pre_forward", "step methods run inside the root's forward (forward_methods)"),
    PrivateName(f"{_FSDP}._fsdp_state", "FSDPState._post_forward", "step methods run inside the root's forward (forward_methods)"),
    PrivateName(f"{_FSDP}._fsdp_state", "FSDPState._fsdp_param_groups", "sharding introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_state", "FSDPState._modules", "prefetch introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_state", "FSDPState._states_to_forward_prefetch", "prefetch introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_state", "FSDPState._states_to_backward_prefetch", "prefetch introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_common", "TrainingState.FORWARD", "step methods run inside the root's forward (forward_methods)"),
    PrivateName(f"{_FSDP}._fsdp_common", "TrainingState.IDLE", "step methods run inside the root's forward (forward_methods)"),
    PrivateName(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.post_forward_mesh_info", "sharding introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup._training_state", "forward_methods", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.is_unsharded", "forward_methods"),
    PrivateName(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.fsdp_params", "sharding introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.offload_policy", "sharding introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup._partial_reduce_output", "gradient accumulation checks", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param", "FSDPParam.sharded_param", "sharding introspection", per_instance=True),
    # Each parameter's own mixed-precision policy: torch 2.15 resolves one per parameter (MixedPrecisionPolicy's
    # param_dtype_override_fn) and dropped FSDPParamGroup.mp_policy (2.13 and 2.14 have both, the same object).
    PrivateName(f"{_FSDP}._fsdp_param", "FSDPParam.mp_policy", "sharding introspection", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param", "FSDPParam.unsharded_accumulated_grad", "gradient accumulation checks", per_instance=True),
    PrivateName(f"{_FSDP}._fsdp_param", "FSDPParam._unsharded_param", "gradient accumulation checks", per_instance=True),
    PrivateName("torch.distributed.distributed_c10d", "_get_default_store", "the fault watchdog"),
    PrivateName("torch.distributed.distributed_c10d", "_set_pg_timeout", "train_timeout"),
    PrivateName("torch.distributed.distributed_c10d", "_resolve_process_group", "collective counting (diagnostics)"),
    PrivateName("torch.distributed.device_mesh", "DeviceMesh._flatten", "expert parallelism's flattened mesh dims"),
    PrivateName("torch.distributed.tensor", "DTensor._local_tensor", "the planner's memory tracking", per_instance=True),
    PrivateName("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator", "the planner"),
    PrivateName("torch.utils._python_dispatch", "TorchDispatchMode", "the planner"),
    PrivateName("torch.autograd.variable", "Variable._execution_engine.queue_callback", "replicate_params (gradient all-reduce after backward)"),
    # The planner (hp_lightning/planner): a fake process group and fake tensors, one simulated rank.
    PrivateName("torch.testing._internal.distributed.fake_pg", "FakeStore", "the planner (fake process group)"),
    PrivateName("torch._subclasses.fake_tensor", "FakeTensorMode", "the planner (fake tensors)"),
    PrivateName("torch._subclasses.fake_tensor", "DataDependentOutputException", "the planner (fake tensors)"),
    PrivateName("torch._subclasses.fake_tensor", "UnsupportedOperatorException", "the planner (fake tensors)"),
    # Their caches (the same functools.lru_cache API on every verified release) hold meshes of an earlier fake world.
    PrivateName("torch.distributed.tensor._sharding_prop", "ShardingPropagator.propagate_op_sharding.cache_clear", "the planner", per_instance=True),
    PrivateName("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached.cache_clear", "the planner"),
    PrivateName("torch.utils._pytree", "tree_flatten", "the planner"),
)


def _versions(versions: Sequence[str]) -> str:
    return versions[0] if len(versions) == 1 else f"{', '.join(versions[:-1])} and {versions[-1]}"


def missing_error(entry: PrivateName, *, tested: str = TESTED_TORCH, version: Optional[str] = None) -> MissingPrivateNameError:
    """The one error for a private name this installation lacks: the name, the feature, where it was verified, the tested range."""
    library = entry.library
    version = version or torch.__version__
    adapter = "hp_lightning/core/_torch_private.py" if library == "torch" else "hp_lightning/_lightning_private.py"
    return MissingPrivateNameError(
        f"hp_lightning's {entry.feature} needs {library}'s private {entry.name}, which {library} {version} lacks. "
        f"It was verified on {library} {_versions(entry.verified)}; hp_lightning is tested with {library}{tested}: "
        f"install one of those (pip install '{library}{tested}'), or update hp_lightning's adapter ({adapter})."
    )


def resolve(module_path: str, attribute_path: str) -> Any:
    """The object at ``module_path`` + ``attribute_path``, each attribute looked up for real (else ImportError / AttributeError)."""
    return functools.reduce(getattr, attribute_path.split("."), importlib.import_module(module_path))


def _resolve(module_path: str, attribute_path: str) -> bool:
    try:
        resolve(module_path, attribute_path)
    except (ImportError, AttributeError):
        return False
    return True


def entry_for(name: str, entries: Sequence[PrivateName], verified: tuple[str, ...] = VERIFIED_TORCH) -> PrivateName:
    """The entry of ``entries`` for the private ``name`` (or for a longer name it starts).

    A name no entry lists (none should be) gets one that says "this feature" and the library's ``verified`` releases.
    """
    for entry in entries:
        if entry.name == name or entry.name.startswith(f"{name}."):
            return entry
    module, _, path = name.partition(".")
    return PrivateName(module, path, "this feature", verified=verified)


def _error(name: str) -> MissingPrivateNameError:
    return missing_error(entry_for(name, _PRIVATE_NAMES))


def _private(module_path: str, attribute_path: str) -> Any:
    """A class-level private name at its use, or the one clear error (:func:`missing_error`)."""
    try:
        return resolve(module_path, attribute_path)
    except (ImportError, AttributeError):
        raise _error(f"{module_path}.{attribute_path}") from None


def _field(obj: Any, owner: str, attribute: str) -> Any:
    """A private attribute torch sets on each instance (``owner``: the entry's ``module.Class``), or the clear error."""
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise _error(f"{owner}.{attribute}") from None


@functools.lru_cache(maxsize=None)
def _declared(owner: str, attribute: str) -> None:
    """Check once that torch's class ``owner`` (``module.Class``) still declares the per-instance ``attribute``.

    For an attribute torch sets only after some event (``FSDPParam._unsharded_param``, at the unit's
    first all-gather): its absence from an instance then means "not yet", never "renamed" (that is
    a :class:`MissingPrivateNameError` here).
    """
    module, _, cls_name = owner.rpartition(".")
    cls = _private(module, cls_name)
    if not any(attribute in inspect.get_annotations(klass) for klass in cls.__mro__):
        raise _error(f"{owner}.{attribute}")


def placeholder_class(name: str, error: Callable[[], MissingPrivateNameError]) -> type:
    """A stand-in for a missing private class, so that modules defining subclasses of it still import.

    Creating an instance (of it or of a subclass) or an ``isinstance`` / ``issubclass`` check against
    it raises ``error()``: a feature that needs the class fails at its first use, never silently.
    """

    class _Refusing(type):
        def __instancecheck__(cls, instance: Any) -> bool:
            raise error()

        def __subclasscheck__(cls, subclass: Any) -> bool:
            raise error()

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise error()

    return _Refusing(name, (), {"__new__": __new__, "__doc__": f"torch's {name} is missing from this installation (see hp_lightning's adapter)."})


if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode  # intercepting ops at dispatch (no public base class)
else:
    try:
        TorchDispatchMode = resolve("torch.utils._python_dispatch", "TorchDispatchMode")
    except (ImportError, AttributeError):
        TorchDispatchMode = placeholder_class("TorchDispatchMode", lambda: _error("torch.utils._python_dispatch.TorchDispatchMode"))

__all__ = ["MissingPrivateNameError", "TorchDispatchMode"]


def _instances() -> list[Any]:
    """Real instances of the FSDP2 and DTensor classes whose private attributes are set per instance.

    A two-unit model sharded on a one-rank fake process group, run forward and backward with
    gradient sync off (so that the accumulation state exists too).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with fake_process_group(0, 1):
        mesh = init_device_mesh(devices.CPU, (1,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        model(torch.ones(2, 4)).sum().backward()
        state = model[0]._get_fsdp_state()  # type: ignore[operator]
        group = state._fsdp_param_groups[0]
        weight = model[0].weight
        assert isinstance(weight, DTensor)
        return [state, group, group.fsdp_params[0], weight, DTensor._op_dispatcher.sharding_propagator]


def _has_path(obj: Any, attribute_path: str) -> bool:
    for part in attribute_path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing_private_names(names: Sequence[PrivateName] = _PRIVATE_NAMES) -> list[str]:
    """The private torch names (of ``names``) this installation lacks, each resolved for real; empty when all are there.

    Class-level names are looked up attribute by attribute from their module; a ``per_instance``
    name's class (the first attribute of its path) from its module, the rest on a real instance of
    that class (:func:`_instances`, built on a fake process group: a RuntimeError in a process
    that has a process group).
    """
    missing: list[str] = []
    instances: Optional[list[Any]] = None
    for entry in names:
        if not entry.per_instance:
            if not _resolve(entry.module, entry.path):
                missing.append(entry.name)
            continue
        owner_path, _, attribute_path = entry.path.partition(".")
        if not attribute_path or not _resolve(entry.module, owner_path):
            missing.append(entry.name)
            continue
        owner = resolve(entry.module, owner_path)
        instances = _instances() if instances is None else instances
        samples = [obj for obj in instances if isinstance(obj, owner)]
        if not samples:
            missing.append(f"{entry.name} (no instance of {owner_path} to check it on)")
        elif not all(_has_path(obj, attribute_path) for obj in samples):
            missing.append(entry.name)
    return missing


# ---------------------------------------------------------------- FSDP2 per-unit state

_STATE = f"{_FSDP}._fsdp_state.FSDPState"
_GROUP = f"{_FSDP}._fsdp_param_group.FSDPParamGroup"
_PARAM = f"{_FSDP}._fsdp_param.FSDPParam"


def fsdp_state(unit: nn.Module) -> Any:
    """FSDP2's state object of a sharded unit (no public accessor)."""
    return _field(unit, "torch.distributed.fsdp.FSDPModule", "_get_fsdp_state")()


def param_groups(unit: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one unit (one per ``fully_shard`` call on it)."""
    return list(_field(fsdp_state(unit), _STATE, "_fsdp_param_groups"))


def prefetch_targets(unit: nn.Module, direction: str) -> list[nn.Module]:
    """Modules this unit all-gathers ahead of time in ``"forward"`` or ``"backward"``.

    FSDP2 has setters (``set_modules_to_*_prefetch``) but no getters.
    """
    modules: list[nn.Module] = []
    for target in _field(fsdp_state(unit), _STATE, f"_states_to_{direction}_prefetch"):
        modules.extend(_field(target, _STATE, "_modules"))
    return modules


def reshards_after_forward(unit: nn.Module) -> bool:
    """Whether the unit frees its gathered parameters after forward (no public getter)."""
    return any(_field(group, _GROUP, "post_forward_mesh_info") is not None for group in param_groups(unit))


def wrap_as_forward(root: nn.Module, method_name: str) -> None:
    """Run ``root.<method_name>`` inside the root's FSDP forward hooks, surviving a nested ``self(...)``.

    torch's public ``register_fsdp_forward_method`` does not suffice for a LightningModule's step
    methods: they call ``self(x)``, whose own hooks end the forward pass early; the inner
    post-forward leaves the root's group idle and the outer one then reshards it, although the
    root keeps its parameters after forward, so backward would all-gather the root (embeddings,
    head) a second time every micro-batch. Re-entering the forward state before the outer
    post-forward keeps one all-gather per micro-batch. A missing private name is said here, at
    wrapping, not mid-step.
    """
    idle, forward = _private(f"{_FSDP}._fsdp_common", "TrainingState.IDLE"), _private(f"{_FSDP}._fsdp_common", "TrainingState.FORWARD")
    state = fsdp_state(root)
    pre_forward, post_forward = _field(state, _STATE, "_pre_forward"), _field(state, _STATE, "_post_forward")
    for group in _field(state, _STATE, "_fsdp_param_groups"):  # what the wrapper reads per call, checked once here
        _field(group, _GROUP, "_training_state")
    _private(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.is_unsharded")
    original = getattr(root, method_name)

    @functools.wraps(original)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(self, args, kwargs)
        output = original(*args, **kwargs)
        for group in state._fsdp_param_groups:
            if group._training_state == idle and group.is_unsharded:
                group._training_state = forward
        return post_forward(self, args, output)

    # Lightning reads a step's signature one ``__wrapped__`` level down: a user's own decorator
    # (``functools.wraps``) must stay what it sees, as without us.
    wrapped.__wrapped__ = getattr(original, "__wrapped__", original)
    setattr(root, method_name, types.MethodType(wrapped, root))


# ---------------------------------------------------------------- autograd, store, dispatch, DCP


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once at the end of the current backward pass (no public equivalent)."""
    _private("torch.autograd.variable", "Variable._execution_engine.queue_callback")(callback)


def default_store() -> dist.Store:
    """The default process group's store (no public accessor)."""
    return _private("torch.distributed.distributed_c10d", "_get_default_store")()


def resolve_process_group(group_name: str) -> Any:
    """The process group a functional collective names by string (no public lookup)."""
    from torch.distributed.distributed_c10d import GroupName

    return _private("torch.distributed.distributed_c10d", "_resolve_process_group")(GroupName(group_name))


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A 1-D mesh over all ranks of ``mesh`` (a slice of a root mesh), registered on the root as ``name``.

    torchtitan's way to give several mesh dims one process group (e.g. expert-parallel ranks that
    are also data-parallel ranks); DeviceMesh has no public flatten.
    """
    return _field(mesh, "torch.distributed.device_mesh.DeviceMesh", "_flatten")(name)


def set_collective_timeout(group: Any, timeout: Any) -> None:
    """Change an existing process group's collective timeout (torch has no public setter)."""
    _private("torch.distributed.distributed_c10d", "_set_pg_timeout")(timeout, group)


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard as a plain tensor, without autograd (``to_local()`` is differentiable)."""
    return _field(tensor, "torch.distributed.tensor.DTensor", "_local_tensor")


def managed_params(unit: nn.Module) -> list[tuple[Any, Any, Any]]:
    """``(sharded parameter, mp_policy, offload_policy)`` for every parameter ``unit`` itself manages.

    FSDP2 keeps these on its (private) parameter groups and parameters; there is no public listing.
    The mixed-precision policy is the parameter's own, the offload policy the group's.
    """
    out = []
    for group in param_groups(unit):
        offload = _field(group, _GROUP, "offload_policy")
        out += [(_field(fsdp_param, _PARAM, "sharded_param"), _field(fsdp_param, _PARAM, "mp_policy"), offload)
                for fsdp_param in _field(group, _GROUP, "fsdp_params")]
    return out


def held_gradients(unit: nn.Module) -> list[torch.Tensor]:
    """Gradient storage FSDP2 holds for ``unit`` outside ``param.grad``.

    The unsharded gradients accumulated while gradient sync is off, and HSDP partial reductions
    waiting for their all-reduce (``set_requires_all_reduce(False)``).
    """
    held: list[Optional[torch.Tensor]] = []
    for group in param_groups(unit):
        held.append(_field(group, _GROUP, "_partial_reduce_output"))
        for fsdp_param in _field(group, _GROUP, "fsdp_params"):
            held.append(_field(fsdp_param, _PARAM, "unsharded_accumulated_grad"))
            # Set at the unit's first all-gather (see _declared): before it, no unsharded gradient either.
            _declared(_PARAM, "_unsharded_param")
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                held.append(unsharded.grad)
    return [t for t in held if t is not None]


# ---------------------------------------------------------------- the planner's fake world


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` in which tensors have shapes and dtypes but no storage; real tensors entering it
    (torchmetrics' scalar states, constants a model keeps) are converted on first use instead of refused."""
    return _private("torch._subclasses.fake_tensor", "FakeTensorMode")(allow_non_fake_inputs=True)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a fake-tensor run raises for code that reads tensor values or has no fake kernel."""
    module = "torch._subclasses.fake_tensor"
    return (_private(module, "DataDependentOutputException"), _private(module, "UnsupportedOperatorException"))


def reset_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions, which hold the meshes (and group names) of an earlier fake world.

    Each simulated rank joins a new fake world; a cached decision for an equal-looking mesh would
    name a process group of a world that no longer exists. Both caches are ``functools.lru_cache``
    on every verified torch; one that no longer has ``cache_clear`` is the clear error, not skipped.
    """
    propagator = _private("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator")
    owner = "torch.distributed.tensor._sharding_prop.ShardingPropagator"
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        _field(_field(propagator, owner, name), f"{owner}.{name}", "cache_clear")()


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
    store = _private("torch.testing._internal.distributed.fake_pg", "FakeStore")()  # registers the "fake" backend on import
    reset_dtensor_caches()
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """torch's pytree flattening (``torch.utils._pytree``; no public pytree module in torch 2.13)."""
    return _private("torch.utils._pytree", "tree_flatten")(tree)
