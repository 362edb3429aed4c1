"""What a training step costs out of sight: collectives, host reads, CPU memory.

:class:`CollectiveCounter` is torch's public :class:`~torch.distributed.tensor.debug.CommDebugMode`,
a dispatch mode that sees each ``torch.distributed`` collective as its ``c10d`` op and each of
DTensor's functional collectives as its ``_c10d_functional`` op; it records each call's kind,
group ranks, bytes and dtype, and counts the ``send``/``recv`` that ``CommDebugMode`` leaves out
(pipeline stages). What is counted is what is issued at the call: the tensor collectives an object
collective (``all_gather_object``, ...) pickles through, and those DTensor issues inside one of its
ops (a redistribution, clipping's norm), are not counted, nor ``barrier``. :class:`HostReads`
counts each read of a tensor's value into Python (on an accelerator, a host-device sync);
:class:`HeapSampler` measures the CPU's malloc heap and RSS. Each mode sees its own thread only.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.overrides import TorchFunctionMode

from hp_lightning.core import devices
from hp_lightning.core._torch_private import resolve_process_group

#: Communication op (an op overload's ``name()``) -> the kind it is counted as. ``c10d`` ops are
#: the ``torch.distributed`` calls; ``_c10d_functional`` ops are DTensor's.
KINDS: dict[str, str] = {
    "c10d::allgather_": "all_gather", "c10d::_allgather_base_": "all_gather", "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::reduce_scatter_": "reduce_scatter", "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::alltoall_": "all_to_all", "c10d::alltoall_base_": "all_to_all",
    "c10d::send": "send", "c10d::recv_": "recv",
    "_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_reduce_": "all_reduce", "_c10d_functional::all_reduce_coalesced": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather", "_c10d_functional::all_gather_into_tensor_coalesced": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter", "_c10d_functional::reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "_c10d_functional::broadcast": "broadcast", "_c10d_functional::broadcast_": "broadcast",
}

#: The object collectives: the tensor collectives they pickle through are theirs, not calls of the user's.
_OBJECT_COLLECTIVES = frozenset(
    inspect.unwrap(f).__code__
    for f in (dist.all_gather_object, dist.broadcast_object_list, dist.gather_object, dist.scatter_object_list,
              dist.send_object_list, dist.recv_object_list)
)


@dataclass(frozen=True)
class CollectiveCall:
    kind: str
    ranks: tuple[int, ...]
    bytes: int
    dtype: torch.dtype | None = None
    #: The label of the :meth:`CollectiveCounter.mark` in effect when it was issued (None: before any).
    bucket: Any = None

    @property
    def floating(self) -> bool:
        """Whether it carries floating-point data (parameters, gradients) rather than flags or counts."""
        return self.dtype is not None and self.dtype.is_floating_point


class CollectiveCounter(CommDebugMode):
    """``CommDebugMode`` recording every collective this thread issues: kind, group ranks, bytes, dtype.

    ``get_comm_counts()`` counts the recorded ops (each as the op seen). torch's per-module
    tracing (global module hooks and a record of every op, to inspect one forward) is left off,
    so a counter can stay around a whole ``fit``.

    Example::

        with CollectiveCounter() as comms:
            trainer.fit(model)
        comms.count("reduce_scatter")
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []
        #: Called with each recorded call, in issue order (e.g. to interleave with compute events).
        self.listeners: list[Callable[[CollectiveCall], None]] = []
        #: The label calls are recorded under (set by :meth:`mark`).
        self.bucket: Any = None

    def __enter__(self) -> CollectiveCounter:
        super(CommDebugMode, self).__enter__()  # the dispatch mode itself, without CommDebugMode's module tracker
        return self

    def __exit__(self, *exc: Any) -> None:
        super(CommDebugMode, self).__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        # DTensor's ops run as they are (CommDebugMode hands them back to look inside): the
        # collectives DTensor issues inside an op are not counted, those it issues at a call are.
        kind = KINDS.get(func.name()) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind is not None and not _inside(_OBJECT_COLLECTIVES):
            self.comm_counts[func.overloadpacket] += 1
            tensor = _largest_tensor(args)
            size = 0 if tensor is None else tensor.numel() * tensor.element_size()
            call = CollectiveCall(kind, _ranks(kind, args), size, None if tensor is None else tensor.dtype, self.bucket)
            self.calls.append(call)
            for listener in self.listeners:
                listener(call)
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.calls.clear()

    def mark(self, label: Any) -> None:
        """Record the calls from now on under ``label`` (until the next mark), e.g. one bucket per micro-batch."""
        self.bucket = label

    def buckets(self) -> dict[Any, list[CollectiveCall]]:
        """The recorded calls per :meth:`mark` label, in the order the labels were first used."""
        out: dict[Any, list[CollectiveCall]] = {}
        for call in self.calls:
            out.setdefault(call.bucket, []).append(call)
        return out

    def count(self, kind: str | None = None, ranks: tuple[int, ...] | None = None) -> int:
        return sum(1 for c in self.calls if (kind is None or c.kind == kind) and (ranks is None or c.ranks == ranks))

    def by_kind(self) -> Counter[str]:
        return Counter(c.kind for c in self.calls)

    def groups(self, kind: str) -> set[tuple[int, ...]]:
        return {c.ranks for c in self.calls if c.kind == kind}

    def bytes(self, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.calls if kind is None or c.kind == kind)


def _inside(codes: frozenset[Any]) -> bool:
    """Whether a function with one of these code objects is on this thread's stack."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _ranks(kind: str, args: tuple[Any, ...]) -> tuple[int, ...]:
    """The group's global ranks; for send and recv, the sorted pair (this rank, its peer).

    A ``c10d`` op carries its process group boxed (and the peer's rank in it); a functional one names it.
    """
    at = next((i for i, a in enumerate(args) if isinstance(a, torch.ScriptObject)), None)
    if at is not None:
        group = dist.ProcessGroup.unbox(args[at])
    else:
        name = next((a for a in reversed(args) if isinstance(a, str)), None)
        if name is None:
            return ()
        at, group = len(args), resolve_process_group(name)
    if kind in ("send", "recv"):
        peer = next(a for a in args[at + 1 :] if isinstance(a, int))
        return tuple(sorted({dist.get_rank(), dist.get_global_rank(group, peer)}))
    return tuple(dist.get_process_group_ranks(group))


def _largest_tensor(args: Any) -> torch.Tensor | None:
    """The largest tensor argument: the gathered output, the scattered input, the reduced tensor."""
    if isinstance(args, torch.Tensor):
        return args
    if not isinstance(args, (list, tuple)):
        return None
    tensors = [t for t in map(_largest_tensor, args) if t is not None]
    return max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)


#: ``torch.Tensor`` methods that read a tensor's value into Python (on an accelerator: a sync).
HOST_READS: dict[Any, str] = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.cpu: devices.CPU,
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
}

_PACKAGE = str(Path(__file__).resolve().parents[1])
#: torch's folder as imported and as resolved (a virtual environment reached through a symlink
#: names its files by the link).
_TORCH = tuple({str(Path(torch.__file__).parent), str(Path(torch.__file__).resolve().parent)})


@dataclass
class HostReads(TorchFunctionMode):
    """Context manager counting reads of tensor values into Python made from one package's code.

    Each read (:data:`HOST_READS`, and ``.to("cpu")``) is attributed to the first frame outside
    torch that led to it (a read inside a torch function called from hp_lightning counts for
    hp_lightning's line); reads whose caller is elsewhere (Lightning, the user, an optimizer
    Lightning steps) are not recorded. On CPU these reads cost nothing, but the same lines on an
    accelerator each wait for the device: this is the way to find them without one.
    """

    #: The folder whose code is counted (default: hp_lightning's).
    package: str = _PACKAGE
    #: (kind, "path/relative/to/package/parent:line") per read, in order.
    reads: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        kwargs = kwargs or {}
        kind = HOST_READS.get(func)
        if kind is None and func is torch.Tensor.to and _to_host(args, kwargs):
            kind = "to(cpu)"
        if kind is not None and (site := self._site()) is not None:
            self.reads.append((kind, site))
        return func(*args, **kwargs)

    def _site(self) -> str | None:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.package):
            return None
        return f"{Path(frame.f_code.co_filename).relative_to(Path(self.package).parent)}:{frame.f_lineno}"

    def count(self) -> int:
        return len(self.reads)


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.to(...)`` call targets the CPU."""
    targets = [*args[1:], kwargs.get("device")]
    return any((isinstance(t, str) and t.startswith(devices.CPU)) or (isinstance(t, torch.device) and t.type == devices.CPU) for t in targets)


# ---------------------------------------------------------------------------- CPU memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


def heap_reader() -> Callable[[], int] | None:
    """A function reading the bytes malloc has handed out, over all arenas and threads; None without glibc.

    glibc's ``mallinfo2``: chunks in use (``uordblks``) plus mmapped ones (``hblkhd``). CPU
    tensors live there, so do C++ objects (gloo's buffers, autograd nodes) and Python's objects
    larger than 512 bytes; Python's small objects come from its own mmapped arenas and are not
    counted. Free memory malloc keeps for reuse is not counted either, so fragmentation does not
    blur the figure.
    """
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return read


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so a baseline or RSS reflects what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HeapSampler:
    """Bytes in use on the CPU over time: the malloc heap (:func:`heap_reader`) and the RSS.

    A thread samples both every ``interval_s``; :meth:`sample` adds one now (call it at step
    boundaries and phase changes, so no boundary falls between two samples). Figures are relative
    to the heap when the sampler was entered (after a garbage collection and ``malloc_trim``).
    Sampling from a thread, rather than tracing allocations, also sees frees made in
    communication threads, which ``torch.profiler``'s per-thread trace misses; the price is that
    a peak shorter than the interval can be missed. Samples are ``(time.time_ns(), heap, rss)``;
    ``rss=False`` skips reading ``/proc/self/statm`` (a file read per sample) and records 0.
    """

    def __init__(self, interval_s: float = 0.0005, *, rss: bool = True) -> None:
        self.interval_s = interval_s
        self.read_heap = heap_reader()
        self.read_rss = _rss if rss else (lambda: 0)
        self.samples: list[tuple[int, int, int]] = []
        self.heap_before = 0
        self.rss_before = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        heap = self.read_heap() if self.read_heap is not None else 0
        self.samples.append((time.time_ns(), heap, self.read_rss()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HeapSampler:
        release_freed_memory()
        self.heap_before = self.read_heap() if self.read_heap is not None else 0
        self.rss_before = self.read_rss()
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    def pause(self) -> None:
        """Stop the sampling thread (:meth:`sample` still records): outside the windows one reads, it only costs time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def resume(self) -> None:
        """Start the sampling thread (again); a no-op while it runs."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="heap-sampler", daemon=True)
            self._thread.start()

    def _window(self, start_ns: int, end_ns: int) -> list[tuple[int, int, int]]:
        return [s for s in self.samples if start_ns <= s[0] <= end_ns]

    def heap_peak(self, start_ns: int, end_ns: int) -> int:
        """Most heap bytes in use in [start_ns, end_ns], relative to the heap on entering."""
        return max((heap for _, heap, _ in self._window(start_ns, end_ns)), default=self.heap_before) - self.heap_before

    def largest_gap_ms(self, start_ns: int, end_ns: int) -> float:
        """The longest time between two samples in [start_ns, end_ns]: how long a peak could hide.

        On a loaded machine the sampling thread is not scheduled every ``interval_s``; a peak
        measured with a large gap may be an underestimate, and a reader can tell.
        """
        times = [t for t, _, _ in self._window(start_ns, end_ns)]
        return max((b - a for a, b in zip(times, times[1:])), default=end_ns - start_ns) / 1e6

    def heap_peak_time(self, start_ns: int, end_ns: int) -> int | None:
        """When (``time.time_ns()``) the heap peaked in [start_ns, end_ns]; None without samples."""
        window = self._window(start_ns, end_ns)
        return max(window, key=lambda s: s[1])[0] if window else None

    def heap_at(self, when_ns: int) -> int:
        """Heap bytes in use at the last sample at or before ``when_ns``, relative to the heap on entering."""
        earlier = [heap for t, heap, _ in self.samples if t <= when_ns]
        return (earlier[-1] if earlier else self.heap_before) - self.heap_before

    def rss_peak(self, start_ns: int, end_ns: int) -> int:
        """Largest RSS in [start_ns, end_ns] (absolute, not relative)."""
        return max((rss for _, _, rss in self._window(start_ns, end_ns)), default=self.rss_before)
