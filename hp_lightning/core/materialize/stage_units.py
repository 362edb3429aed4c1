"""Units a pipeline stage removed: put back (still on meta) while the stage is materialized, so
random draws land where a full build puts them; their operations run on discarded full-size
temporaries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hp_lightning.core.materialize.ops import _METADATA, _func_name, _leaves, _map_leaves, _written

#: Methods that return views of their tensor (on a removed tensor: still meta, on the same storage).
_VIEW_METHODS = frozenset(
    {"view", "view_as", "reshape", "t", "transpose", "flatten", "unflatten", "detach", "__getitem__", "narrow", "select",
     "chunk", "split", "unbind", "expand", "permute"}
)

#: Where :func:`record_detached_units` keeps, on a cut model, the meta-device units it lost.
_DETACHED_ATTR = "_hp_detached_units"


@dataclass(eq=False)
class DetachedUnit:
    """A unit a pipeline cut removed from a model still on the meta device (kept until materialized).

    Attributes:
        parent: the module it was removed from.
        key: its key in ``parent._modules``.
        module: the unit itself (meta tensors only, so it costs no memory).
        keys: ``parent``'s module keys, in order, just before the removal.
        shared: ``{name in module: name in the cut model}`` of parameters it shares with the
            stage (a tied head); while put back, those slots hold the stage's current parameter.
    """

    parent: nn.Module
    key: str
    module: nn.Module
    keys: tuple[str, ...]
    shared: dict[str, str]


def record_detached_units(model: nn.Module, units: Sequence[DetachedUnit]) -> None:
    """Remember (until :func:`materialize`) the meta units a pipeline cut removed from ``model``."""
    if units:
        model.__dict__[_DETACHED_ATTR] = [*model.__dict__.get(_DETACHED_ATTR, ()), *units]
    else:
        model.__dict__.pop(_DETACHED_ATTR, None)


@contextmanager
def _units_put_back(model: nn.Module) -> Iterator[set[int]]:
    """The removed units back in their places (their parents' order kept); yields their meta storages."""
    units: list[DetachedUnit] = model.__dict__.get(_DETACHED_ATTR, [])
    if not units:
        yield set()
        return
    cut_modules = {id(u.parent): (u.parent, dict(u.parent._modules)) for u in units}
    kept_params = [(m, dict(m._parameters)) for m in model.modules()]
    swapped: list[tuple[nn.Module, str, Any]] = []
    for unit in reversed(units):  # undo the removals in reverse: each parent's order comes back whole
        modules = unit.parent._modules
        restored = {k: (unit.module if k == unit.key else modules[k]) for k in unit.keys}
        modules.clear()
        modules.update(restored)
        for local, kept_name in unit.shared.items():
            owner_name, _, attr = local.rpartition(".")
            owner = unit.module.get_submodule(owner_name)
            swapped.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = model.get_parameter(kept_name)
    meta = [t for u in units for t in [*u.module.parameters(), *u.module.buffers()] if t.is_meta]
    removed = {id(t) for t in meta}
    try:
        yield {id(t.untyped_storage()) for t in meta}
    finally:
        for owner, attr, original in reversed(swapped):
            owner._parameters[attr] = original
        for parent, modules in cut_modules.values():
            parent._modules.clear()
            parent._modules.update(modules)
        for module, params in kept_params:
            for name, param in list(module._parameters.items()):
                if param is not params.get(name) and id(param) in removed:
                    module._parameters[name] = params[name]  # a rule tied a stage's slot to a removed unit's tensor


#: Reading a value out of a tensor: what a removed unit's temporaries must never hand to this stage.
_VALUE_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__array__"})


class _Discarded(TorchFunctionMode):
    """Operations on removed units' meta tensors run on full-size temporaries that are dropped at once.

    What a whole build does to those tensors consumes the random-number generator; doing it on a
    temporary of the same shape, strides and dtype consumes it the same way, so the stage's own
    tensors, initialized later, get the draws they get in the whole model. Results that are new
    tensors come back as meta tensors tracked the same way (``w.new_empty(...).normal_()``), so
    no temporary value survives the operation. An operation that writes this stage's tensors (or
    reads a Python number) from a removed unit's values cannot be made exact: refused.
    """

    def __init__(self, storages: set[int], device: torch.device) -> None:
        super().__init__()
        self.storages = set(storages)
        self.device = device
        self._alive: list[Any] = []  # placeholders' storages, so their ids stay unique

    def _is_removed(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.is_meta and id(value.untyped_storage()) in self.storages

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        kwargs = kwargs or {}
        flat = _leaves((args, kwargs))
        if not any(self._is_removed(t) for t in flat):
            return func(*args, **kwargs)
        name = _func_name(func)
        if name in _METADATA or name.startswith("__get__:") or name in _VIEW_METHODS:
            return func(*args, **kwargs)  # metadata, or a view of a removed tensor: still on meta, on the same storage
        targets = _written(func, args, kwargs)
        kept_writes = [t for t in targets if not self._is_removed(t)]
        if kept_writes or name in _VALUE_READS:
            raise ValueError(
                f"Meta-device initialization of a pipeline stage: an init rule ({name}) reads the values of a tensor "
                f"that belongs to a unit on another stage{' into a tensor of this stage' if kept_writes else ''}. "
                f"This stage cannot compute it exactly without building that unit. Build the model in the "
                f"LightningModule's __init__ (HSDPStrategy(meta_init=False)), or make the rule read this stage's tensors only."
            )
        temporaries: dict[int, torch.Tensor] = {}

        def real(value: Any) -> Any:
            if not self._is_removed(value):
                return value
            if id(value) not in temporaries:
                temporaries[id(value)] = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=self.device)
            return temporaries[id(value)]

        out = func(*_map_leaves(real, tuple(args)), **_map_leaves(real, kwargs))
        back = {id(t): v for v in _leaves((args, kwargs)) if id(v) in temporaries for t in [temporaries[id(v)]]}

        def placeholder(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in back:
                return back[id(value)]
            meta = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
            self.storages.add(id(meta.untyped_storage()))
            self._alive.append(meta.untyped_storage())
            return meta

        return _map_leaves(placeholder, out)
