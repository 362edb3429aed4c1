"""What a tensor operation does to its tensors: the small rules recording, replay and the checks
share (which calls write, which only read metadata, which factories leave memory uninitialized).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
