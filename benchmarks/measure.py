"""Measuring one rank: step times, memory, model-state bytes and collectives.

Timing and memory are taken in separate passes: the probes (a sampling thread, counting
collectives, a garbage collection at every step) cost time themselves, so the timed rounds run
without them and an extra, untimed pass per configuration runs with them.

* Step times: :class:`StepMarks` records ``perf_counter`` (after a device synchronize) at the end
  of every optimizer step; step ``i`` lasts from mark ``i - 1`` to mark ``i``.
* Memory: :class:`MemoryProbe` samples the bytes malloc has handed out (CPU tensors live there)
  and the RSS every half millisecond and at every step mark and phase note
  (:class:`hp_lightning.core.diagnostics.HeapSampler`), or reads the device allocator's peak.
* Model state: parameters + gradients + optimizer state actually held by this rank (local shards
  of DTensors), read from the tensors after the last step.
* Collectives: :class:`hp_lightning.core.diagnostics.CollectiveCounter` around the steps."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_lightning.core import devices
from hp_lightning.core.diagnostics import CollectiveCounter, HeapSampler
from hp_lightning.core.diagnostics import release_freed_memory as release_freed_memory  # the workers import it from here


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
    cpu: list[float] = field(default_factory=list)
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
        self.cpu.append(time.process_time())
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

    def cpu_step_times(self, skip: int) -> list[float]:
        """This process's CPU seconds (every thread) in every optimizer step after the first ``skip``.

        Unlike wall time it leaves out waiting (on a peer, on the device) and time the hypervisor
        stole: on a shared machine the steadier measure of the work a configuration adds.
        """
        return [b - a for a, b in zip(self.cpu[skip:], self.cpu[skip + 1 :])]


# ---------------------------------------------------------------------------- memory


class MemoryProbe(HeapSampler):
    """Bytes in use over time on one rank: heap (CPU tensors), RSS, and the device's peak counter.

    On the CPU, tensors come from malloc, so the bytes malloc has handed out (glibc's
    ``mallinfo2``, summed over every thread's arena) minus the same figure before the
    configuration was built is what the configuration holds: its tensors plus a small,
    near-constant share of Python objects (:class:`hp_lightning.core.diagnostics.HeapSampler`,
    shared with the planner's ``--validate``). :meth:`sample` adds a sample at every step mark and
    phase note. On CUDA / NPU the caching allocator's peak counter is read instead of the heap.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.0005) -> None:
        super().__init__(interval_s)
        self.device = device

    @property
    def on_device(self) -> bool:
        return devices.is_accelerator(self.device.type)

    def reset_device_peak(self) -> None:
        """Start a new peak window on an accelerator (no-op on the CPU)."""
        module = devices.device_module(self.device.type)
        if module is not None:
            module.reset_peak_memory_stats(self.device)

    def device_peak(self) -> int | None:
        return devices.max_memory_allocated(self.device)


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
