"""Recording construction on the meta device: every tensor operation a module's constructor performs,
in order, with the RNG state at the start (:func:`meta_init_context`), and the links from recorded
tensors to the model's parameters and buffers (:func:`link_construction`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_buffer_registration_hook, register_module_module_registration_hook, register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

from hp_lightning.core.materialize.full_tensors import _Slot
from hp_lightning.core.materialize.ops import _DTYPE_FACTORIES, _LINKS_ATTR, _NOT_DATA_WRITES, _RECORD_ATTR, _SEQUENCE, _func_name, _leaves, _map_leaves, _written
from hp_lightning.core.materialize.stage_units import _DETACHED_ATTR


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
        if isinstance(value, torch.device) and value.type == "meta" or isinstance(value, str) and value == "meta":
            return None  # replayed on the init device
        return value

    def record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.broken:
            return
        inputs = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        if not any(t.is_meta for t in [*inputs, *outputs]):
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
        if name in _DTYPE_FACTORIES and not inputs and kwargs.get("dtype") is None and len(outputs) == 1:
            # The default dtype at construction (Lightning's precision context sets it), not at replay.
            kwargs["dtype"] = outputs[0].dtype
        self.nodes.append(_Node(func, _map_leaves(self.ref, tuple(args)), _map_leaves(self.ref, kwargs), [id(t) for t in outputs]))
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
    lives on the modules built inside until :func:`materialize` consumes it. Yields the record
    being written (mostly useful to tests).
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

    def group_of_slot(self, slot: _Slot) -> int | None:
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
    in_model = {id(m) for m in model.modules()}
    for module in model.modules():
        earlier: _Links | None = module.__dict__.get(_LINKS_ATTR)
        if earlier is not None and earlier.record is record:
            for group, slot in earlier.slots.items():
                if id(slot[0]) in in_model:  # not a unit a pipeline cut removed since: its tensors are temporaries
                    slots.setdefault(group, slot)
            slot_groups.update({key: group for key, group in earlier.slot_groups.items() if key[0] in in_model})
    for module in model.modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or not tensor.is_meta or id(tensor.untyped_storage()) not in record.storages:
                continue  # real, or built on meta outside the recording: initialized by rules
            tensor_group = groups.get(_memory_key(tensor))
            if tensor_group is not None:
                slots.setdefault(tensor_group, (module, name))
                slot_groups[(id(module), name)] = tensor_group
    model.__dict__[_LINKS_ATTR] = _Links(record, group_of, slots, slot_groups)


def _forget_construction(model: nn.Module) -> None:
    model.__dict__.pop(_LINKS_ATTR, None)
    model.__dict__.pop(_DETACHED_ATTR, None)  # the units another stage holds: freed here
    for module in model.modules():
        module.__dict__.pop(_RECORD_ATTR, None)
