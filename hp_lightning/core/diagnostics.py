"""Counting collectives where they are issued: at the ``torch.distributed`` call.

:class:`CollectiveCounter` wraps (never replaces the behaviour of) the ``torch.distributed``
functions FSDP2 and hp_lightning call, and records each call's kind, process group ranks and
bytes. Tests assert on it; benchmarks report it; users can put it around a step to see what
their configuration communicates.

FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``; those, the other
``torch.distributed`` collectives and the point-to-point calls are wrapped, and a call made from
inside another wrapped call is not counted twice. DTensor (tensor parallelism, gradient-norm
reductions) communicates through torch's *functional* collectives instead, which never pass
through those functions: a dispatch mode counts them at the op (``_c10d_functional.*``).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
from hp_lightning.core._torch_private import TorchDispatchMode, resolve_process_group

#: Wrapped function name -> the kind it is counted as.
WRAPPED: dict[str, str] = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
}

#: Functional collective op name (``torch.ops._c10d_functional.<name>``) -> the kind it is counted as.
FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


@dataclass(frozen=True)
class CollectiveCall:
    kind: str
    ranks: tuple[int, ...]
    bytes: int
    dtype: torch.dtype | None = None


@dataclass
class CollectiveCounter:
    """Context manager recording every wrapped collective issued by this process.

    Example::

        with CollectiveCounter() as comms:
            trainer.fit(model)
        comms.count("reduce_scatter")
    """

    calls: list[CollectiveCall] = field(default_factory=list)
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)
    paused: bool = False
    #: Called with each recorded call, in issue order (e.g. to interleave with compute events).
    listeners: list[Callable[[CollectiveCall], None]] = field(default_factory=list)

    def __enter__(self) -> CollectiveCounter:
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            wrapped = self._wrap(name, original)
            setattr(dist, name, wrapped)
            if name in ("isend", "irecv") and getattr(_c10d, name, None) is original:
                setattr(_c10d, name, wrapped)  # P2POp accepts only c10d's own isend/irecv
        self._functional = _FunctionalCollectives(self)
        self._functional.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        functional = getattr(self, "_functional", None)
        if functional is not None:
            functional.__exit__(*exc)
            self._functional = None
        for name, original in self._originals.items():
            if getattr(_c10d, name, None) is getattr(dist, name, None):
                setattr(_c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def _record(self, call: CollectiveCall) -> None:
        if self.paused or getattr(self._local, "depth", 0):
            return
        self.calls.append(call)
        for listener in self.listeners:
            listener(call)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind = WRAPPED[name]

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            tensor = _largest_tensor(args, kwargs)
            self._record(
                CollectiveCall(
                    kind,
                    _peer_pair(args, kwargs) if kind in ("send", "recv") else _group_ranks(kwargs.get("group")),
                    0 if tensor is None else tensor.numel() * tensor.element_size(),
                    None if tensor is None else tensor.dtype,
                )
            )
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return counted

    def reset(self) -> None:
        self.calls.clear()

    def count(self, kind: str | None = None, ranks: tuple[int, ...] | None = None) -> int:
        return sum(1 for c in self.calls if (kind is None or c.kind == kind) and (ranks is None or c.ranks == ranks))

    def by_kind(self) -> Counter[str]:
        return Counter(c.kind for c in self.calls)

    def groups(self, kind: str) -> set[tuple[int, ...]]:
        return {c.ranks for c in self.calls if c.kind == kind}

    def bytes(self, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.calls if kind is None or c.kind == kind)


class _FunctionalCollectives(TorchDispatchMode):
    """Counts ``torch.ops._c10d_functional`` collectives (DTensor's) for a :class:`CollectiveCounter`."""

    def __init__(self, counter: CollectiveCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        kwargs = kwargs or {}
        kind = FUNCTIONAL.get(func._opname) if func.namespace == "_c10d_functional" else None
        if kind is not None:
            group_name = next((a for a in reversed(args) if isinstance(a, str)), kwargs.get("group_name"))
            tensor = _largest_tensor(args, kwargs)
            self.counter._record(
                CollectiveCall(
                    kind,
                    tuple(dist.get_process_group_ranks(resolve_process_group(group_name))) if group_name else (),
                    0 if tensor is None else tensor.numel() * tensor.element_size(),
                    None if tensor is None else tensor.dtype,
                )
            )
        return func(*args, **kwargs)


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _peer_pair(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """A point-to-point call as the sorted pair (this rank, its peer) in global ranks."""
    group = kwargs.get("group")
    peer = next((kwargs[k] for k in ("dst", "src") if kwargs.get(k) is not None), None)
    if peer is None:
        local = next((kwargs[k] for k in ("group_dst", "group_src") if kwargs.get(k) is not None), None)
        if local is not None:
            peer = local if group is None else dist.get_global_rank(group, local)
        elif len(args) > 1 and isinstance(args[1], int):
            peer = args[1]
    if peer is None:
        return _group_ranks(group)
    return tuple(sorted({dist.get_rank(), int(peer)}))


def _largest_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The largest tensor argument: the gathered output, the scattered input, the reduced tensor."""
    flat = [*args, *kwargs.values()]
    flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    return max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)
