"""Measuring one rank: step times, memory, model-state bytes and collectives.

Timing and memory are taken in separate passes: the probes (a sampling thread, counting
collectives, a garbage collection at every step) cost time themselves, so the timed rounds run
without them and an extra, untimed pass per configuration runs with them.

* Step times: :class:`StepMarks` records ``perf_counter`` (after a device synchronize) at the end
  of every optimizer step; step ``i`` lasts from mark ``i - 1`` to mark ``i``.
* Memory: :class:`MemoryProbe` samples the bytes malloc has handed out (CPU tensors live there),
  the RSS, or the device allocator's peak, every half millisecond and at every step mark and
  phase note.
* Model state: parameters + gradients + optimizer state actually held by this rank (local shards
  of DTensors), read from the tensors after the last step.
* Collectives: :class:`hp_lightning.core.diagnostics.CollectiveCounter` around the steps."""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_lightning.core import devices
from hp_lightning.core.diagnostics import CollectiveCounter



@dataclass
class StepMarks:
    """End-of-step marks (perf_counter, wall-clock ns, collectives issued so far) and phase notes.

    ``mark()`` is called once before the first step and once after every optimizer step, so step
    ``i`` lasts from mark ``i - 1`` to mark ``i``. ``note(phase)`` records when a phase of a step
    begins (``"forward"``, ``"backward"``, ``"optimizer"``), for splitting the memory samples by phase.
    """

    device: torch.device
    counter: CollectiveCounter | None = None
    probe: MemoryProbe | None = None
    on_mark: Callable[[int], None] | None = None
    perf: list[float] = field(default_factory=list)
    wall_ns: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    notes: list[tuple[int, str, int]] = field(default_factory=list)

    def mark(self) -> None:
        """Call once before the first step and once after every optimizer step."""
        if self.counter is not None:
            # Measurement pass: collect cyclic garbage (Lightning leaves some every step) so the
            # memory figures do not depend on when Python's collector happens to run.
            gc.collect()
        devices.synchronize(self.device)
        self.perf.append(time.perf_counter())
        self.wall_ns.append(time.time_ns())
        self.calls.append(len(self.counter.calls) if self.counter is not None else 0)
        if self.probe is not None:
            self.probe.sample()
        if self.on_mark is not None:
            self.on_mark(len(self.perf) - 1)

    def note(self, phase: str) -> None:
        """Record that ``phase`` of the current step (number ``len(perf)``) begins now."""
        if self.counter is not None:  # only the measurement pass needs phases
            devices.synchronize(self.device)
            if self.probe is not None:
                self.probe.sample()
            self.notes.append((len(self.perf), phase, time.time_ns()))

    def phase_start(self, step: int, phase: str) -> int | None:
        """Wall-clock ns at which ``phase`` first began in step ``step`` (1-based), if noted."""
        return next((when for s, name, when in self.notes if s == step and name == phase), None)

    def step_times(self, skip: int) -> list[float]:
        """Seconds of every optimizer step after the first ``skip`` (warm-up) steps."""
        return [b - a for a, b in zip(self.perf[skip:], self.perf[skip + 1 :])]


# ---------------------------------------------------------------------------- memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


def _heap_reader() -> Callable[[], int] | None:
    """glibc's ``mallinfo2``: bytes in use by malloc over all arenas and threads (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return read


def _rss_reader() -> Callable[[], int]:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def read() -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            return 0

    return read


class MemoryProbe:
    """Bytes in use over time on one rank: heap (CPU tensors), RSS, and the device's peak counter.

    On the CPU, tensors come from malloc, so the bytes malloc has handed out (glibc's
    ``mallinfo2``, summed over every thread's arena) minus the same figure before the
    configuration was built is what the configuration holds: its tensors plus a small,
    near-constant share of Python objects. Frees in communication threads count too, which
    ``torch.profiler``'s per-thread allocator trace misses. A background thread samples heap and
    RSS every ``interval_s``; :meth:`sample` adds a sample at every step mark and phase note.
    On CUDA / NPU the caching allocator's peak counter is read instead of the heap.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.0005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.read_heap = _heap_reader()
        self.read_rss = _rss_reader()
        self.samples: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heap_before = 0
        self.rss_before = 0

    @property
    def on_device(self) -> bool:
        return devices.is_accelerator(self.device.type)

    def sample(self) -> None:
        heap = self.read_heap() if self.read_heap is not None else 0
        self.samples.append((time.time_ns(), heap, self.read_rss()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemoryProbe:
        release_freed_memory()
        self.heap_before = self.read_heap() if self.read_heap is not None else 0
        self.rss_before = self.read_rss()
        self._thread = threading.Thread(target=self._run, name="memory-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _window(self, start_ns: int, end_ns: int) -> list[tuple[int, int, int]]:
        return [s for s in self.samples if start_ns <= s[0] <= end_ns]

    def heap_peak(self, start_ns: int, end_ns: int) -> int:
        """Most heap bytes in use in [start_ns, end_ns], relative to before the configuration."""
        return max((heap for _, heap, _ in self._window(start_ns, end_ns)), default=self.heap_before) - self.heap_before

    def heap_peak_time(self, start_ns: int, end_ns: int) -> int | None:
        """When (wall-clock ns) the heap peaked in [start_ns, end_ns]; None without samples."""
        window = self._window(start_ns, end_ns)
        return max(window, key=lambda s: s[1])[0] if window else None

    def heap_at(self, when_ns: int) -> int:
        """Heap bytes in use at the last sample before ``when_ns``, relative to before the configuration."""
        earlier = [heap for t, heap, _ in self.samples if t <= when_ns]
        return (earlier[-1] if earlier else self.heap_before) - self.heap_before

    def rss_peak(self, start_ns: int, end_ns: int) -> int:
        return max((rss for _, _, rss in self._window(start_ns, end_ns)), default=self.rss_before)

    def reset_device_peak(self) -> None:
        """Start a new peak window on an accelerator (no-op on the CPU)."""
        module = devices.device_module(self.device.type)
        if module is not None:
            module.reset_peak_memory_stats(self.device)

    def device_peak(self) -> int | None:
        return devices.max_memory_allocated(self.device)


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS reflects what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------- model state


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for ``tensor``: its local shard for a DTensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Parameters, gradients and optimizer state held by this rank, in bytes (local shards)."""
    params = list(module.parameters())
    state = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for opt in optimizers for s in opt.state.values() for t in _tensors(s) if t.dim() > 0),
    }
    state["total"] = state["params"] + state["grads"] + state["optimizer"]
    return state


# ---------------------------------------------------------------------------- collectives


def collectives_per_step(counter: CollectiveCounter, marks: StepMarks, skip: int) -> dict[str, float]:
    """Calls and bytes per optimizer step, by kind, over the steps after ``skip``."""
    first, last = marks.calls[skip], marks.calls[-1]
    steps = max(len(marks.calls) - 1 - skip, 1)
    calls = counter.calls[first:last]
    out: dict[str, float] = {"calls": len(calls) / steps, "bytes": sum(c.bytes for c in calls) / steps}
    for kind in sorted({c.kind for c in calls}):
        out[f"{kind}_calls"] = sum(1 for c in calls if c.kind == kind) / steps
        out[f"{kind}_bytes"] = sum(c.bytes for c in calls if c.kind == kind) / steps
    return out


def collectives_by_group(counter: CollectiveCounter, marks: StepMarks, skip: int) -> dict[str, dict[str, float]]:
    """Calls and payload bytes per optimizer step by process group (``"0,1"``: ranks 0 and 1), over the steps after ``skip``.

    Which links a collective can use follows from its group: one whose ranks share a node stays
    inside the node; the simulated cluster (``benchmarks.cluster``) compares these payloads
    with the inter-node link's byte counters.
    """
    first, last = marks.calls[skip], marks.calls[-1]
    steps = max(len(marks.calls) - 1 - skip, 1)
    out: dict[str, dict[str, float]] = {}
    for call in counter.calls[first:last]:
        entry = out.setdefault(",".join(map(str, call.ranks)), {"calls": 0.0, "bytes": 0.0})
        entry["calls"] += 1 / steps
        entry["bytes"] += call.bytes / steps
    return out
