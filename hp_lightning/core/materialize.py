"""Meta-device models made real: every tensor initialized by its module's own rule, or a clear error.

Building a model on the meta device costs no memory, which is what lets a model larger than one
device be sharded before it exists; but ``to_empty`` then hands back *uninitialized* memory, and
whatever is not written afterwards trains as garbage (HF ``RMSNorm`` weights of 1e16, GPT-2
``Conv1D`` weights, ``MultiheadAttention.in_proj_weight``, rotary ``inv_freq`` buffers). This
module guarantees that never happens:

1. **Record construction** (:func:`meta_init_context`, the strategy's init context): while the
   module is built on the meta device, every tensor operation it performs (``torch.ones``,
   ``nn.init.kaiming_uniform_``, ``arange(...) ** -x``, the ``clone`` of ``copy.deepcopy``, ...)
   is recorded in order, with the random-number-generator state at the start.
2. **Replay it on real memory** (:func:`materialize`, after sharding): the recorded operations
   run again, in the same order and from the same RNG state, on full-size tensors, one tensor at
   a time; each sharded parameter keeps only its local shard. Random draws thus consume the
   generator exactly as an unsharded build would: the result equals the same model built on the
   init device with the same seed, parameter for parameter, on any mesh.
3. **Run the rules construction skipped on meta**: Hugging Face ``PreTrainedModel.init_weights``
   (its ``post_init`` skips initialization on the meta device; it also rebuilds rotary
   ``inv_freq``) at the point its constructor would have run it, then the LightningModule's
   ``init_weights()`` hook. Modules built on the meta device outside the recording context are
   initialized by their rules alone: ``reset_parameters()``, ``_reset_parameters()``
   (``nn.MultiheadAttention``, ``nn.Transformer``), HF ``init_weights`` and ``init_weights()``.
4. **Refuse what nothing covers**: before anything is allocated, a parameter or buffer that no
   recording and no rule can write is a ``ValueError`` naming the tensor, its module class and
   the fix, on every rank (the decision is made from module structure, identical everywhere).
   Memory is filled with NaN rather than left uninitialized, and a last check after
   initialization (one small all-reduce) names any tensor that is still NaN, infinite or absurdly
   large, on every rank.

Memory: besides the local shards, one full-size tensor at a time (two while one is copied into
another) lives on the init device during initialization; tensors shared by several operations
may be all-gathered again from their shards when an operation reads them after another tensor
was touched in between (HF's post-construction pass does, once per tensor).

Inside init rules, sharded parameters behave like ordinary full tensors (:class:`_FullTensorWrites`);
DTensor random operators are never used, so their CPU warnings cannot appear.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode

__all__ = [
    "ABSURD_MAGNITUDE",
    "has_meta_tensors",
    "link_construction",
    "materialize",
    "meta_init_context",
    "move_unsharded_states",
]

#: A finite parameter value above this (in magnitude) after initialization is reported as garbage.
ABSURD_MAGNITUDE = 1e12
#: Where a module built under :func:`meta_init_context` keeps its construction record.
_RECORD_ATTR = "_hp_construction"
#: Where :func:`link_construction` keeps, on the root, which recorded tensor each slot is.
_LINKS_ATTR = "_hp_construction_links"
#: The DTensor CPU warning users cannot act on; filtered around our own init calls only.
_DTENSOR_RANDOM_WARNING = r"DTensor random operators may not have complete support"
_SEQUENCE = itertools.count()

#: In-place methods that change tensor metadata or autograd flags, not values.
_NOT_DATA_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream", "pin_memory"})
#: Augmented assignment and item assignment write their first argument.
_AUGMENTED = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)
#: Metadata queries: answered by a DTensor with global values, no need for the full tensor.
_METADATA = frozenset(
    {"dim", "ndimension", "size", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
     "__len__", "is_contiguous", "get_device", "data_ptr", "storage_offset", "is_signed", "is_leaf"}
)
#: Properties that return tensors aliasing their owner (everything else a property returns is metadata).
_ALIASING_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH"})
#: Factories whose dtype defaults to ``torch.get_default_dtype()``: recorded with the dtype they used.
_DTYPE_FACTORIES = frozenset(
    {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "linspace", "logspace", "eye", "tensor", "empty_strided"}
)
#: Factories that allocate without defining values: replayed as NaN (never as leftover memory).
_EMPTY_FACTORIES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


# ====================================================================== small helpers


def _leaves(value: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts (what torch operations take as arguments)."""
    leaves: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        else:
            leaves.append(item)
    return leaves


def _map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts, the structure kept."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_leaves(fn, v) for v in value)
    if isinstance(value, list):
        return [_map_leaves(fn, v) for v in value]
    if isinstance(value, dict):
        return {k: _map_leaves(fn, v) for k, v in value.items()}
    return fn(value)


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is still on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _func_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return f"{name}:{getattr(owner, '__name__', '')}"
    return name


#: Operations that overwrite every element of their target (``torch.nn.init`` functions, or wrappers
#: with their names such as ``transformers.initialization``), so its old values need not be read.
_OVERWRITING = frozenset(
    {"uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
     "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_", "copy_", "fill_", "zero_",
     "__set__:data"}
)


def _is_inplace(name: str) -> bool:
    return name in _AUGMENTED or name == "__set__:data" or (
        name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA_WRITES
    )


def _target(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The first argument, positional or (``torch.nn.init`` style) the ``tensor=`` keyword."""
    return args[0] if args else kwargs.get("tensor")


def _written(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an operation writes: in-place target, ``out=``, item assignment, ``.data =``."""
    targets: list[Any] = []
    if "out" in kwargs:
        targets.extend(_leaves(kwargs["out"]))
    if _is_inplace(_func_name(func)):
        targets.append(_target(args, kwargs))
    return [t for t in targets if isinstance(t, torch.Tensor)]


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _poison(t: torch.Tensor) -> None:
    """NaN for floating tensors: memory nothing wrote can never pass for a value."""
    if _is_float(t) and t.numel():
        t.fill_(float("nan"))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ====================================================================== 1. recording construction


@dataclass(eq=False)
class _Node:
    """One recorded operation: ``func(*args, **kwargs)`` with tensors replaced by :class:`_Ref`."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[int]  # ids of the recorded output tensors (in flatten order)


@dataclass(frozen=True)
class _Ref:
    key: int  # id of a recorded tensor


@dataclass(eq=False)
class ConstructionRecord:
    """What building a module on the meta device did to tensors, in order.

    Attributes:
        sequence: creation order among records (the earliest one's RNG state starts replay).
        rng_state: the CPU generator state when construction began.
        nodes: the recorded operations.
        tensors: every recorded tensor by id (kept alive so that ids stay unique).
        storages: the storage objects of recorded meta tensors (kept alive for the same reason).
        markers: ``(position, module)``: the module's constructor had returned once ``position``
            operations were recorded (it was then assigned to its parent).
        broken: a reason when the recording cannot be replayed (then the rules are used).
    """

    sequence: int
    rng_state: torch.Tensor
    nodes: list[_Node] = field(default_factory=list)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    storages: dict[int, Any] = field(default_factory=dict)
    markers: list[tuple[int, nn.Module]] = field(default_factory=list)
    broken: str | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> ConstructionRecord:
        # copy.deepcopy of a module built under the record (nn.TransformerEncoder clones its layer)
        # shares the record: the copies are part of the same construction.
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled module keeps no recording (it holds functions and meta tensors); rules apply.
        return (_unreplayable, ("the module was pickled after construction",))

    def ref(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            self.tensors.setdefault(id(value), value)
            if value.is_meta:
                storage = value.untyped_storage()
                self.storages.setdefault(id(storage), storage)
            return _Ref(id(value))
        if isinstance(value, torch.device) and value.type == "meta":
            return None  # replayed on the init device
        if isinstance(value, str) and value == "meta":
            return None
        return value

    def record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.broken:
            return
        inputs = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        touches_meta = any(t.is_meta for t in inputs) or any(t.is_meta for t in outputs)
        if not touches_meta:
            return
        name = _func_name(func)
        writes = _written(func, args, kwargs)
        if not outputs and not writes:
            return  # a query (sizes, flags, item assignment without tensors aside)
        if name in _NOT_DATA_WRITES or name.split(":")[0] == "__set__" and name != "__set__:data":
            return
        if name in ("set_", "resize_", "as_strided_", "untyped_storage"):
            if name != "untyped_storage":
                self.broken = f"construction calls Tensor.{name}, which cannot be replayed"
            return
        kwargs = dict(kwargs)
        if "device" in kwargs:
            kwargs["device"] = self.ref(kwargs["device"])
        if name in _DTYPE_FACTORIES and not inputs and kwargs.get("dtype") is None and len(outputs) == 1:
            # The default dtype at construction (Lightning's precision context sets it), not at replay.
            kwargs["dtype"] = outputs[0].dtype
        self.nodes.append(
            _Node(func, _map_leaves(self.ref, tuple(args)), _map_leaves(self.ref, kwargs), [id(t) for t in outputs])
        )
        for t in outputs:
            self.ref(t)


def _unreplayable(reason: str) -> ConstructionRecord:
    return ConstructionRecord(sequence=next(_SEQUENCE), rng_state=torch.get_rng_state(), broken=reason)


class _Recorder(TorchFunctionMode):
    """Records every tensor operation that involves the meta device (see :class:`ConstructionRecord`)."""

    def __init__(self, record: ConstructionRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self.record.record(func, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - never break the user's constructor; replay falls back to rules
            self.record.broken = f"{_func_name(func)} could not be recorded ({type(exc).__name__}: {exc})"
        return out


@contextmanager
def meta_init_context() -> Iterator[ConstructionRecord]:
    """Build modules on the meta device while recording how their tensors get their values.

    What :meth:`HSDPStrategy.tensor_init_context` enters around ``configure_model`` and
    ``trainer.init_module()``. Costs no tensor memory; the record (operations and meta tensors)
    lives on the modules built inside until :func:`materialize` consumes it.

    Yields:
        The record being written (mostly useful to tests).
    """
    record = ConstructionRecord(sequence=next(_SEQUENCE), rng_state=torch.get_rng_state())

    def tag(module: nn.Module, name: str, value: Any) -> None:
        if value is not None:
            module.__dict__.setdefault(_RECORD_ATTR, record)

    marked: set[int] = set()  # ids of the modules in record.markers (which keeps them alive)

    def constructed(parent: nn.Module, name: str, child: Any) -> None:
        if isinstance(child, nn.Module) and id(child) not in marked:
            marked.add(id(child))
            record.markers.append((len(record.nodes), child))

    with ExitStack() as stack:
        for register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook):
            stack.callback(register(tag).remove)
        stack.callback(register_module_module_registration_hook(constructed).remove)
        stack.enter_context(torch.device("meta"))
        stack.enter_context(_Recorder(record))
        yield record


@dataclass
class _Links:
    """Which recorded tensors are which parameter/buffer slots of a model (found before sharding).

    Recorded tensors that view the same memory the same way (``nn.Parameter(t)`` and ``t``, a
    parameter and its ``.data``) form one *group*: the unit replay computes values for.
    """

    record: ConstructionRecord
    group_of: dict[int, int]  # recorded tensor id -> group
    slots: dict[int, tuple[nn.Module, str]]  # group -> (module, attribute)
    slot_groups: dict[tuple[int, str], int]  # (id(module), attribute) -> group

    def group_of_slot(self, slot: "_Slot") -> int | None:
        return self.slot_groups.get((id(slot.module), slot.name))


def _memory_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of the memory a (meta) tensor views: storage object, offset, shape, strides, dtype.

    ``untyped_storage()`` returns the same Python object for every tensor on one storage, meta
    tensors included (``is_set_to`` has no meta kernel).
    """
    return id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def link_construction(model: nn.Module) -> None:
    """Match the model's meta tensors to the construction record, before sharding replaces them.

    Call between construction and ``fully_shard``: ``prepare_model`` does for the whole model,
    and ``hp_lightning.fully_shard`` does for each module a user shards inside ``configure_model``
    (those links are kept and merged here). Slots are matched by the memory they view, so
    ``nn.Parameter(torch.ones(d))``, the ``.data`` of a parameter and a ``copy.deepcopy`` all find
    their recorded origin.
    """
    records = {id(r): r for m in model.modules() if (r := m.__dict__.get(_RECORD_ATTR)) is not None}
    if not records:
        return
    record = min(records.values(), key=lambda r: r.sequence)
    groups: dict[tuple[Any, ...], int] = {}
    group_of: dict[int, int] = {}
    for key, tensor in record.tensors.items():
        memory = _memory_key(tensor) if tensor.is_meta else ("real", key)
        group_of[key] = groups.setdefault(memory, len(groups))
    slots: dict[int, tuple[nn.Module, str]] = {}
    slot_groups: dict[tuple[int, str], int] = {}
    # Links made earlier (before a submodule was sharded by hand, or before tensor/expert
    # parallelism replaced the model's parameters with DTensors): those slots cannot be matched
    # by memory any more, so they are kept.
    for module in model.modules():
        earlier: _Links | None = module.__dict__.get(_LINKS_ATTR)
        if earlier is not None and earlier.record is record:
            for group, slot in earlier.slots.items():
                slots.setdefault(group, slot)
            slot_groups.update(earlier.slot_groups)
    for module in model.modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or not tensor.is_meta or id(tensor.untyped_storage()) not in record.storages:
                continue  # real, or built on meta outside the recording: initialized by rules
            group = groups.get(_memory_key(tensor))
            if group is not None:
                slots.setdefault(group, (module, name))
                slot_groups[(id(module), name)] = group
    model.__dict__[_LINKS_ATTR] = _Links(record, group_of, slots, slot_groups)


def _forget_construction(model: nn.Module) -> None:
    model.__dict__.pop(_LINKS_ATTR, None)
    for module in model.modules():
        module.__dict__.pop(_RECORD_ATTR, None)


# ====================================================================== 2. full tensors for init code


@dataclass
class _Slot:
    """A parameter or buffer that started on the meta device."""

    module: nn.Module
    name: str
    qualified: str
    kind: str  # "parameter" or "buffer"
    persistent: bool

    def get(self) -> torch.Tensor:
        table = self.module._parameters if self.kind == "parameter" else self.module._buffers
        return table[self.name]

    def describe(self) -> str:
        note = "" if self.persistent else ", non-persistent: no checkpoint holds it"
        return f"{self.qualified} ({type(self.module).__name__} {self.kind}{note})"


@dataclass
class _Cached:
    full: torch.Tensor
    views_out: bool = False


class _FullTensorWrites(TorchFunctionMode):
    """Inside init code, sharded parameters act as full tensors; writes land in the local shards.

    Any operation that involves a sharded parameter runs on a full-size temporary instead: built
    from the shards with one all-gather when the operation reads values the parameter already
    has, or left as NaN when nothing was written yet (or the operation overwrites everything).
    After an operation that writes it, the local shard is copied back (every rank computes the
    same full tensor, so shards of one tensor are slices of one value). Temporaries are cached
    for the next operation on the same parameter (``trunc_normal_`` is five of them); at most
    ``capacity`` are alive. Writes to the other tracked tensors (buffers, whole parameters) are
    counted, so that coverage can be checked.

    Args:
        sharded: the sharded parameters by ``id``.
        tracked: every slot tensor by storage pointer (for write tracking).
        capacity: how many full-size temporaries may be alive at once.
    """

    def __init__(self, sharded: dict[int, DTensor], tracked: dict[int, torch.Tensor], capacity: int = 2) -> None:
        super().__init__()
        self.sharded = sharded
        self.by_storage = {_local(p).untyped_storage().data_ptr(): p for p in sharded.values() if _local(p).numel()}
        self.tracked = tracked
        self.capacity = capacity
        self.cache: dict[int, _Cached] = {}
        self.written: set[int] = set()  # ids of sharded params and storage pointers of tracked tensors

    # -------------------------------------------------------------- sharded parameters

    def _canonical(self, t: Any) -> DTensor | None:
        if not isinstance(t, DTensor):
            return None
        if id(t) in self.sharded:
            return self.sharded[id(t)]
        local = _local(t)
        return self.by_storage.get(local.untyped_storage().data_ptr()) if local.numel() else None

    def _full(self, param: DTensor, *, read: bool) -> torch.Tensor:
        entry = self.cache.pop(id(param), None)
        if entry is None:
            while len(self.cache) >= self.capacity:
                self._evict(next(iter(self.cache)))
            local = _local(param)
            if read and id(param) in self.written:
                full = param.full_tensor()
            else:
                full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
                _poison(full)
            entry = _Cached(full)
        self.cache[id(param)] = entry  # most recently used last
        return entry.full

    def _write_back(self, param: DTensor, full: torch.Tensor) -> None:
        local = _local(param)
        if local.numel():
            shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None).to_local()
            if shard.shape != local.shape:
                raise RuntimeError(
                    f"Cannot write an initialized shard of shape {tuple(shard.shape)} into the local shard of "
                    f"shape {tuple(local.shape)} (placements {param.placements}); please report this layout."
                )
            local.copy_(shard)
        self.written.add(id(param))

    def _evict(self, key: int) -> None:
        entry = self.cache.pop(key)
        if entry.views_out:
            self._write_back(self.sharded[key], entry.full)

    def flush(self) -> None:
        """Write back every temporary that handed out views, and drop all temporaries."""
        for key in list(self.cache):
            self._evict(key)

    # -------------------------------------------------------------- the protocol

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        kwargs = kwargs or {}
        name = _func_name(func)
        flat = _leaves((args, kwargs))
        involved = {id(p): p for t in flat if (p := self._canonical(t)) is not None}
        if not involved or name in _METADATA or name.startswith("__get__:") and name[8:] not in _ALIASING_PROPERTIES:
            out = func(*args, **kwargs)
            self._track_plain(func, args, kwargs)
            return out
        if name.startswith("__get__:"):  # .data / .T of a sharded parameter: a view of its full value
            param = next(iter(involved.values()))
            if name == "__get__:data":
                return param
            full = self._full(param, read=True)
            self.cache[id(param)].views_out = True
            return func.__self__.__get__(full)
        if name in ("set_", "resize_", "as_strided_"):
            raise ValueError(
                f"An init rule calls Tensor.{name} on a sharded parameter of shape {tuple(next(iter(involved.values())).shape)}; "
                f"write its values in place instead (nn.init.*, copy_, fill_)."
            )
        writes = {id(p) for t in _written(func, args, kwargs) if (p := self._canonical(t)) is not None}
        overwrites = name in _OVERWRITING
        fulls = {}
        for key, param in involved.items():
            fulls[key] = self._full(param, read=not (key in writes and overwrites and len(writes) == 1))

        def swap(value: Any) -> Any:
            p = self._canonical(value)
            return fulls[id(p)] if p is not None else value

        if name == "__set__:data" and (target := self._canonical(args[0])) is not None:
            fulls[id(target)].copy_(swap(args[1]))
            self._write_back(target, fulls[id(target)])
            return None
        out = func(*_map_leaves(swap, tuple(args)), **_map_leaves(swap, kwargs))
        for key in writes:
            self._write_back(self.sharded[key], fulls[key])
        # Results aliasing a temporary: hand back the parameter itself, or remember the view.
        for key, full in fulls.items():
            if out is full:
                return self.sharded[key]
            for t in _leaves(out):
                if isinstance(t, torch.Tensor) and t._base is full:
                    self.cache[key].views_out = True
        self._track_plain(func, args, kwargs)
        return out

    # -------------------------------------------------------------- other tracked tensors

    def _track_plain(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        for t in _written(func, args, kwargs):
            if not isinstance(t, DTensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.tracked:
                    self.written.add(ptr)

    def was_written(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DTensor):
            p = self._canonical(tensor)
            return p is not None and id(p) in self.written
        return tensor.untyped_storage().data_ptr() in self.written


# ====================================================================== 3. the init program


def _is_hf_pretrained(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (duck-typed: transformers is optional)."""
    return all(callable(getattr(module, a, None)) for a in ("post_init", "_init_weights", "init_weights")) and hasattr(
        module, "config"
    )


def _untie(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Give each tied HF target (``lm_head.weight``) a plain full-size stand-in; return what to restore.

    A Hugging Face model built for real initializes ``lm_head.weight`` as its own tensor (its
    ``nn.Linear`` constructor, then ``_init_weights``) and only then ties it to the input
    embedding, discarding those values. Built on the meta device, the tie exists before our
    initialization, which would then overwrite the embedding. The stand-ins take those writes
    (one full tensor each, for the duration); ``tie_weights`` at the end of ``init_weights``
    re-ties, and :func:`_retie` restores whatever is still untied.
    """
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for target, source in dict(tied).items():
        try:
            target_module_name, _, target_attr = str(target).rpartition(".")
            target_module = model.get_submodule(target_module_name)
            original = target_module._parameters.get(target_attr)
            if original is None or original is not model.get_parameter(str(source)):
                continue
        except (AttributeError, KeyError):
            continue
        local = _local(original)
        stand_in = nn.Parameter(torch.empty(original.shape, dtype=local.dtype, device=local.device), original.requires_grad)
        target_module._parameters[target_attr] = stand_in
        swapped.append((target_module, target_attr, original))
    return swapped


def _retie(swapped: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for module, attr, original in swapped:
        if module._parameters.get(attr) is not original:
            module._parameters[attr] = original


def _hf_init_weights(module: nn.Module) -> None:
    """``PreTrainedModel.init_weights()`` as its ``post_init`` runs it on a real build (untied first)."""
    swapped = _untie(module)
    try:
        module.init_weights()
    finally:
        _retie(swapped)


def _owns_state(module: nn.Module) -> bool:
    return any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])


def _constructor_rule(module: nn.Module) -> Callable[[], Any] | None:
    """What the module's constructor runs to initialize itself, by torch convention."""
    if callable(getattr(module, "_reset_parameters", None)):
        return module._reset_parameters  # nn.MultiheadAttention, nn.Transformer
    if _owns_state(module) and callable(getattr(module, "reset_parameters", None)):
        return module.reset_parameters
    return None


#: Containers whose constructor deep-copies one given layer into ``layers`` (equal initial values).
_CLONING_CONTAINERS: tuple[type[nn.Module], ...] = (nn.TransformerEncoder, nn.TransformerDecoder)


@dataclass
class _Step:
    """One init rule: ``run()`` on ``module`` (described in errors)."""

    module: nn.Module
    what: str
    run: Callable[[], Any]


def _clone_layers(container: nn.Module) -> Callable[[], None]:
    def run() -> None:
        layers = list(container.layers)
        first = dict(layers[0].named_parameters()) | dict(layers[0].named_buffers())
        for layer in layers[1:]:
            for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
                tensor.copy_(first[name])

    return run


def _rule_program(model: nn.Module, root_hook: bool) -> list[_Step]:
    """Rules in constructor order (post-order: children, then the parent's own rule).

    A module's ``init_weights()`` counts as its constructor's last step (HF ``post_init``,
    GPT-2-style models), unless the root defines its own hook (``root_hook``), which then runs
    last and replaces them.
    """
    steps: list[_Step] = []

    def visit(module: nn.Module) -> None:
        hf = _is_hf_pretrained(module) and callable(getattr(module, "init_weights", None))
        if hf:
            # Its constructor runs before post_init ties weights: rules see untied targets.
            swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
            steps.append(_Step(module, "untie", lambda m=module, out=swapped: out.extend(_untie(m))))
        if isinstance(module, _CLONING_CONTAINERS) and len(getattr(module, "layers", ())) > 1:
            visit(module.layers[0])
            steps.append(_Step(module, "copies of layers.0 (its constructor deep-copies one layer)", _clone_layers(module)))
            for name, child in module.named_children():
                if name != "layers":
                    visit(child)
        else:
            for child in module.children():
                visit(child)
        rule = _constructor_rule(module)
        if rule is not None:
            steps.append(_Step(module, f"{type(module).__name__}.{rule.__name__}()", rule))
        hook = getattr(module, "init_weights", None)
        if hf:

            def post_init(m: nn.Module = module, out: list = swapped) -> None:
                try:
                    m.init_weights()
                finally:
                    _retie(out)

            steps.append(_Step(module, f"{type(module).__name__}.init_weights()", post_init))
        elif callable(hook) and module is not model and not root_hook:
            steps.append(_Step(module, f"{type(module).__name__}.init_weights()", hook))

    visit(model)
    return steps


def _root_hook(model: nn.Module) -> _Step | None:
    hook = getattr(model, "init_weights", None)
    if callable(hook):
        return _Step(model, f"{type(model).__name__}.init_weights()", hook)
    return None


def _covering_rules(model: nn.Module, slot: _Slot, parents: dict[int, nn.Module], root_hook: bool) -> list[str]:
    """Rules that may write ``slot``: its module's constructor rule, or a rule of an ancestor."""
    rules = []
    own = _constructor_rule(slot.module)
    if own is not None:
        rules.append(f"{type(slot.module).__name__}.{own.__name__}()")
    current = slot.module
    while id(current) in parents:
        current = parents[id(current)]
        if callable(getattr(current, "_reset_parameters", None)):
            rules.append(f"{type(current).__name__}._reset_parameters()")
        if callable(getattr(current, "init_weights", None)) and (
            current is model or _is_hf_pretrained(current) or not root_hook
        ):
            rules.append(f"{type(current).__name__}.init_weights()")
        if isinstance(current, _CLONING_CONTAINERS):
            rules.append(f"{type(current).__name__} layer copies")
    return rules


def _parents(model: nn.Module) -> dict[int, nn.Module]:
    """Each submodule's parent inside ``model`` (by id; the first parent when shared)."""
    parents: dict[int, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    return parents


# ====================================================================== replaying a record


class _Replay:
    """Runs a :class:`ConstructionRecord` again on real memory (see the module docstring).

    Recorded tensors that are parameters or buffers of the model resolve to those (through
    :class:`_FullTensorWrites`, which turns sharded ones into full tensors); the others (the
    intermediates of construction, layers that were deep-copied and dropped) are recomputed as
    plain tensors and freed after their last use.
    """

    def __init__(self, links: _Links, modes: _FullTensorWrites, on_marker: Callable[[nn.Module], None]) -> None:
        self.links = links
        self.modes = modes
        self.on_marker = on_marker
        self.values: dict[int, torch.Tensor] = {}  # group -> value
        self.last_use = self._last_uses()

    def _groups(self, node: _Node) -> set[int]:
        refs = [v.key for v in _leaves((node.args, node.kwargs)) if isinstance(v, _Ref)]
        return {self.links.group_of[k] for k in [*refs, *node.outputs]}

    def _last_uses(self) -> dict[int, list[int]]:
        last: dict[int, int] = {}
        for i, node in enumerate(self.links.record.nodes):
            for group in self._groups(node):
                last[group] = i
        by_node: dict[int, list[int]] = {}
        for group, i in last.items():
            by_node.setdefault(i, []).append(group)
        return by_node

    def _slot_tensor(self, group: int) -> torch.Tensor | None:
        slot = self.links.slots.get(group)
        if slot is None:
            return None
        module, name = slot
        return module._parameters[name] if name in module._parameters else module._buffers[name]

    def _resolve(self, value: Any) -> Any:
        if not isinstance(value, _Ref):
            return value
        group = self.links.group_of[value.key]
        slot = self._slot_tensor(group)
        if slot is not None:
            return slot
        if group in self.values:
            return self.values[group]
        original = self.links.record.tensors[value.key]
        if not original.is_meta:
            return original  # a real tensor construction used (kept by reference)
        raise _ReplayError(f"a recorded tensor of shape {tuple(original.shape)} is used before it was produced")

    def run(self) -> None:
        record = self.links.record
        markers = iter(sorted(record.markers, key=lambda marker: marker[0]))
        pending = next(markers, None)
        for index, node in enumerate(record.nodes):
            while pending is not None and pending[0] <= index:
                self.on_marker(pending[1])
                pending = next(markers, None)
            self._run_node(index, node)
        while pending is not None:
            self.on_marker(pending[1])
            pending = next(markers, None)

    def _run_node(self, index: int, node: _Node) -> None:
        args = _map_leaves(self._resolve, node.args)
        kwargs = _map_leaves(self._resolve, node.kwargs)
        name = _func_name(node.func)
        try:
            out = node.func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported with the operation named
            raise _ReplayError(f"{name} failed on real memory ({type(exc).__name__}: {exc})") from exc
        outputs = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        if name in _EMPTY_FACTORIES:
            for t in outputs:
                _poison(t)
        for key, value in zip(node.outputs, outputs):
            group = self.links.group_of[key]
            target = self._slot_tensor(group)
            if target is None:
                self.values[group] = value
            elif name not in _EMPTY_FACTORIES and value is not target:
                # e.g. nn.Parameter(torch.ones(d)), or a deep copy: the recorded value of the slot.
                target.copy_(value)
        for group in self.last_use.get(index, ()):
            self.values.pop(group, None)


class _ReplayError(RuntimeError):
    """The record cannot be replayed; the rules are used instead."""


# ====================================================================== 4. checks


def _meta_slots(model: nn.Module) -> list[_Slot]:
    slots: list[_Slot] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_meta or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                qualified = f"{module_name}.{name}" if module_name else name
                slots.append(_Slot(module, name, qualified, kind, kind == "parameter" or name not in non_persistent))
    return slots


def _uncovered_message(model: nn.Module, slots: Sequence[_Slot], *, after_rules: bool) -> str:
    owner = type(model).__name__
    listed = "; ".join(s.describe() for s in slots[:8]) + (f"; and {len(slots) - 8} more" if len(slots) > 8 else "")
    classes = sorted({type(s.module).__name__ for s in slots})
    why = (
        "was still uninitialized after every init rule ran (its constructor's recording and the rules did not write it)"
        if after_rules
        else "has no init rule: its module defines no reset_parameters(), no ancestor defines init_weights(), and its "
        "value is not one construction recorded"
    )
    return (
        f"{owner} was built on the meta device, and {len(slots)} tensor(s) {why}: {listed}. Training would use "
        f"uninitialized memory, so setup stops here (on every rank). Fix one of: define reset_parameters() on "
        f"{', '.join(classes)} that writes every parameter and buffer it owns; define init_weights() on your "
        f"LightningModule that writes them (it runs after the rules, with sharded parameters acting as full "
        f"tensors); or build the model outside the meta device with HSDPStrategy(meta_init=False) "
        f"(or trainer.init_module(empty_init=False)), at the cost of the whole model in host memory on every rank."
    )


def check_coverage(model: nn.Module, slots: Sequence[_Slot], links: _Links | None, root_hook: bool) -> None:
    """Refuse, before allocating anything, tensors that no recording and no rule can initialize.

    Decided from module structure and the construction record only, which are identical on every
    rank, so every rank raises the same error and none waits in a collective.

    Raises:
        ValueError: naming each uncovered tensor, its module class and the fixes.
    """
    parents = _parents(model)
    defined = _defined_groups(links) if links is not None else set()
    uncovered = []
    for slot in slots:
        group = links.group_of_slot(slot) if links is not None else None
        if group not in defined and not _covering_rules(model, slot, parents, root_hook):
            uncovered.append(slot)
    if uncovered:
        raise ValueError(_uncovered_message(model, uncovered, after_rules=False))


def _defined_groups(links: _Links) -> set[int]:
    """Recorded tensors construction gave a value: written in place, or produced by more than ``empty``."""
    defined: set[int] = set()
    for node in links.record.nodes:
        name = _func_name(node.func)
        defined.update(links.group_of[r.key] for r in _leaves(_written_refs(node)) if isinstance(r, _Ref))
        if name not in _EMPTY_FACTORIES and not name.startswith("__get__:"):
            defined.update(links.group_of[k] for k in node.outputs)
    return defined


def _written_refs(node: _Node) -> list[Any]:
    """The recorded tensors a node writes (the recorded twin of :func:`_written`)."""
    refs = [node.kwargs["out"]] if "out" in node.kwargs else []
    if _is_inplace(_func_name(node.func)):
        refs.append(_target(node.args, node.kwargs))
    return refs


def check_values(slots: Sequence[_Slot], group: dist.ProcessGroup | None, device_type: str) -> None:
    """Last line of defence: name every initialized tensor that is NaN, infinite or absurdly large.

    One all-reduce of two numbers per tensor, so every rank sees every rank's shards and raises
    the same error. Buffers may legitimately hold infinities or huge finite values (attention
    masks filled with ``-inf`` or ``finfo.min``); only NaN counts for them.

    Raises:
        ValueError: naming the tensors and what was wrong with them.
    """
    floats = [s for s in slots if _is_float(_local(s.get()))]
    if not floats:
        return
    stats = torch.zeros(len(floats), 2, dtype=torch.float64)
    for i, slot in enumerate(floats):
        local = _local(slot.get()).detach()
        if not local.numel():
            continue
        values = local.abs() if not local.is_complex() else local.abs()
        if slot.kind == "buffer":
            stats[i, 0] = float(torch.isnan(values).any())
        else:
            stats[i, 0] = float((~torch.isfinite(values)).any())
            finite = values[torch.isfinite(values)]
            stats[i, 1] = float(finite.max()) if finite.numel() else 0.0
    if dist.is_available() and dist.is_initialized():
        stats = stats.to(device_type)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        stats = stats.cpu()
    bad = [
        f"{slot.describe()}: {'NaN or infinite values' if stats[i, 0] else f'|x| up to {stats[i, 1]:.3g}'}"
        for i, slot in enumerate(floats)
        if stats[i, 0] or stats[i, 1] > ABSURD_MAGNITUDE
    ]
    if bad:
        raise ValueError(
            f"After meta-device initialization, {len(bad)} tensor(s) hold values no init rule would produce "
            f"(uninitialized memory or a rule that did not write them): {'; '.join(bad[:8])}. Give their module a "
            f"reset_parameters() (or your LightningModule an init_weights()) that writes them completely, or build "
            f"the model outside the meta device with HSDPStrategy(meta_init=False)."
        )


# ====================================================================== 5. allocation and RNG


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


def _metric_defaults(model: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Copies of every torchmetrics Metric's default states: ``to_empty`` leaves them uninitialized."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return []
    refuse_metrics_on_meta(model)
    return [(m, copy.deepcopy(m._defaults)) for m in model.modules() if isinstance(m, Metric)]


def _restore_metrics(saved: list[tuple[nn.Module, dict]]) -> None:
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
        _local(table[name]).copy_(value)
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


# ====================================================================== the entry point


@torch.no_grad()
def materialize(model: nn.Module, mesh: DeviceMesh, init_device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Allocate meta-device tensors (local shards only) and initialize every one of them.

    See the module docstring for the guarantee and its cost. In order: coverage check (may
    raise, on every rank alike), allocation (NaN-filled), the construction replay and HF rules
    at their constructor positions (or the rules alone, for modules built on meta without a
    recording), rules for tensors the replay did not write, the LightningModule's
    ``init_weights()``, the value check (one all-reduce), and a broadcast of whole tensors from
    rank 0. When the generator was not used since construction began, it is left where building
    the model for real would have left it.

    Args:
        model: the sharded model (``prepare_model`` called :func:`link_construction` before sharding).
        mesh: the data-parallel mesh.
        init_device: where tensors are allocated and initialized (the host under CPU offload).
        group: the ranks holding this same model (None: the world; a pipeline stage's ranks
            under PP, whose tensors differ from the other stages').

    Returns:
        True when something was materialized.

    Raises:
        ValueError: a tensor no rule covers (before allocating), or a tensor still uninitialized
            or absurd afterwards; raised on every rank.
    """
    slots = _meta_slots(model)
    if not slots:
        _forget_construction(model)
        return False
    links: _Links | None = model.__dict__.get(_LINKS_ATTR)
    if links is not None and links.record.broken:
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(
                f"The construction of {type(model).__name__} could not be recorded for replay ({links.record.broken}); "
                f"it is initialized by its modules' rules instead (deterministic, but not equal to a model built "
                f"without the meta device).",
                UserWarning,
                stacklevel=2,
            )
        links = None
    root = _root_hook(model) if not _is_hf_pretrained(model) else None
    check_coverage(model, slots, links, root is not None)

    _allocate(model, slots, init_device)
    start = links.record.rng_state if links is not None else torch.get_rng_state()
    agreed = _agreed_rng_state(start, mesh.device_type)
    untouched = torch.equal(torch.get_rng_state(), agreed)

    originals = [s.get() for s in slots]
    sharded = {id(t): t for t in originals if isinstance(t, DTensor)}
    tracked = {t.untyped_storage().data_ptr(): t for t in originals if not isinstance(t, DTensor)}
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=_DTENSOR_RANDOM_WARNING)
        stack.enter_context(torch.device(init_device))
        writes = stack.enter_context(_FullTensorWrites(sharded, tracked))
        torch.set_rng_state(agreed)
        _run_program(model, slots, links, writes, root, agreed)
        writes.flush()
        final_state = torch.get_rng_state()

    _adopt_replaced(slots, init_device)
    # A rule may also replace a buffer (``self.inv_freq = ...``): that writes it too.
    unwritten = [s for s, t in zip(slots, originals) if s.get() is t and not writes.was_written(t)]
    if unwritten:
        raise ValueError(_uncovered_message(model, unwritten, after_rules=True))
    check_values(slots, group, mesh.device_type)
    if dist.is_available() and dist.is_initialized():
        for slot in slots:
            tensor = slot.get()
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, group=group, group_src=0)
    if untouched:
        torch.set_rng_state(final_state)
    _forget_construction(model)
    return True


def _run_program(
    model: nn.Module,
    slots: Sequence[_Slot],
    links: _Links | None,
    writes: _FullTensorWrites,
    root: _Step | None,
    rng_state: torch.Tensor,
) -> None:
    """Replay (or rules), then rules for what the replay left unwritten, then the root's hook."""
    if links is not None:
        hf_done: set[int] = set()
        in_model = {id(m) for m in model.modules()}

        def on_marker(module: nn.Module) -> None:
            # HF's post_init skipped initialization on the meta device; run it where it would have run.
            if _is_hf_pretrained(module) and id(module) not in hf_done and id(module) in in_model:
                hf_done.add(id(module))
                _hf_init_weights(module)

        try:
            _Replay(links, writes, on_marker).run()
            if _is_hf_pretrained(model) and id(model) not in hf_done:
                _hf_init_weights(model)
            leftover = {id(s.module) for s in slots if not writes.was_written(s.get())}
            steps = [s for s in _rule_program(model, root is not None) if id(s.module) in leftover and s.module is not model]
        except _ReplayError as exc:
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(
                    f"Replaying the construction of {type(model).__name__} failed ({exc}); it is initialized by its "
                    f"modules' rules instead (deterministic, but not equal to a model built without the meta device).",
                    UserWarning,
                    stacklevel=3,
                )
            # Start over from nothing: NaN everywhere, the generator where replay started, no HF marks.
            writes.flush()
            for slot in slots:
                _poison(_local(slot.get()))
            writes.written.clear()
            for module in model.modules():
                module.__dict__.pop("_is_hf_initialized", None)
            torch.set_rng_state(rng_state)
            steps = _rule_program(model, root is not None)
    else:
        steps = _rule_program(model, root is not None)
    for step in [*steps, *([root] if root is not None else [])]:
        try:
            step.run()
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"(while initializing {type(model).__name__} after meta-device construction: {step.what})")
            raise


def _adopt_replaced(slots: Sequence[_Slot], init_device: torch.device) -> None:
    """Accept buffers a rule replaced (``self.inv_freq = ...``); refuse replaced sharded parameters."""
    for slot in slots:
        tensor = slot.get()
        if slot.kind == "parameter" and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            raise ValueError(f"{slot.describe()} is still on the meta device after initialization; an init rule replaced it.")
        if slot.kind == "buffer" and tensor.device != init_device and not tensor.is_meta:
            slot.module._buffers[slot.name] = tensor.to(init_device)


# ====================================================================== after setup


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
