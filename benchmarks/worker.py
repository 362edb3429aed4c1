"""What every rank of one launch does: interleaved timing rounds, a measurement pass, the memory sweep.

One launch per world size; all configurations share its process group. Rounds run every
configuration in turn (A B C D A B C D ...), so slow drift of the machine (other processes,
thermal state) touches every configuration alike; each round rebuilds the configuration from
scratch and times only the steps after its warm-up.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from benchmarks.measure import (
    MemoryProbe,
    StepMarks,
    collectives_by_group,
    collectives_per_step,
    model_state_bytes,
    release_freed_memory,
)
from benchmarks.settings import DDP, HP, RAW, Configuration, ModelShape, Settings
from benchmarks.trainers import largest_unit_bytes, rank_loader, run_configuration
from examples.gpt import CharWindows, encode, stdlib_corpus
from hp_lightning.core import devices
from hp_lightning.core.diagnostics import CollectiveCounter

#: Steps of a measurement pass not measured (the first creates the optimizer state).
MEASURE_SKIP = 1
#: Collectives smaller than this are control traffic (flags, agreement checks), not parameters or gradients.
DATA_COLLECTIVE_BYTES = 4096


class Progress:
    """Rank 0 prints each finished phase and how long it took (a long run shows it is alive)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.last = time.monotonic()

    def say(self, phase: str) -> None:
        now = time.monotonic()
        if self.rank == 0:
            print(f"  world {self.world_size}: {phase} done ({now - self.last:.0f} s)", flush=True)
        self.last = now


def quiet() -> None:
    """Keep Lightning's per-Trainer banners and known warnings out of the benchmark output."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def setup_rank(device_type: str) -> torch.device:
    """This rank's device and the launch's process group (once; every configuration reuses it)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if devices.is_accelerator(device_type) else torch.device(device_type)
    devices.set_current_device(device)
    if not dist.is_initialized():
        dist.init_process_group(devices.default_backend(device_type))
    return device


def windows(settings: Settings, block_size: int) -> Dataset:
    return CharWindows(encode(stdlib_corpus(settings.corpus_chars)), block_size=block_size, stride=block_size)


def measure_configuration(
    config: Configuration, shape: ModelShape, dataset: Dataset, micro_batch: int, steps: int, device: torch.device,
    num_nodes: int = 1,
) -> dict[str, Any]:
    """One untimed run with every probe on: memory, model state, collectives.

    Memory figures are bytes above what the process held before the configuration was built,
    over the steps after the first (which creates the optimizer state): the peak, the bytes held
    when a step starts, and the peaks up to the end of forward and of backward of the first
    measured step.
    """
    counter = CollectiveCounter()
    issued: list[tuple[int, str, int, tuple[int, ...]]] = []
    counter.listeners.append(lambda call: issued.append((time.time_ns(), call.kind, call.bytes, call.ranks)))
    probe = MemoryProbe(device)
    marks = StepMarks(
        device, counter=counter, probe=probe, on_mark=lambda i: probe.reset_device_peak() if i == MEASURE_SKIP else None
    )
    loader = rank_loader(dataset, micro_batch, config.world_size, dist.get_rank())
    with probe, counter:
        record = run_configuration(config, shape, loader, steps, device, marks, num_nodes=num_nodes)
        state = model_state_bytes(record.module, record.optimizers)
    start, end = marks.wall_ns[MEASURE_SKIP], marks.wall_ns[-1]
    step = MEASURE_SKIP + 1
    backward = marks.phase_start(step, "backward")
    optimizer = marks.phase_start(step, "optimizer")
    out: dict[str, Any] = {
        "state": state,
        "collectives": collectives_per_step(counter, marks, MEASURE_SKIP),
        "collectives_by_group": collectives_by_group(counter, marks, MEASURE_SKIP),
        "rss_peak": probe.rss_peak(start, end),
        "rss_before": probe.rss_before,
        "held_at_step_start": probe.heap_at(start),
        "peak_bytes": probe.heap_peak(start, end),
        "forward_peak": probe.heap_peak(start, backward) if backward else None,
        "forward_backward_peak": probe.heap_peak(start, optimizer) if optimizer else None,
        "per_step": [(probe.heap_at(a), probe.heap_peak(a, b)) for a, b in zip(marks.wall_ns[MEASURE_SKIP:], marks.wall_ns[MEASURE_SKIP + 1 :])],
        "memory_source": "heap",
        "peak_context": peak_context(probe.heap_peak_time(start, end), marks, issued),
    }
    device_peak = probe.device_peak()
    if device_peak is not None:
        out.update(peak_bytes=device_peak, held_at_step_start=None, forward_peak=None, forward_backward_peak=None,
                   per_step=None, memory_source=f"{device.type} allocator")
    del record
    release_freed_memory()
    return out


def peak_context(peak_ns: int | None, marks: StepMarks, issued: list[tuple[int, str, int, tuple[int, ...]]]) -> dict[str, Any]:
    """Where in the step the heap peaked: the phase, and the last collective issued before the peak.

    FSDP2 issues each unit's all-gather / reduce-scatter as it reaches the unit, so the last
    collective names the unit being worked on at the peak (its size tells which unit).
    """
    if peak_ns is None:
        return {}
    step = sum(1 for t in marks.wall_ns if t <= peak_ns)
    phases = [(when, name) for s, name, when in marks.notes if s == step and when <= peak_ns]
    # Control collectives (a few bytes: flags, loss checks) say nothing about which unit is at work.
    before = [e for e in issued if e[0] <= peak_ns and e[2] >= DATA_COLLECTIVE_BYTES]
    out: dict[str, Any] = {"step": step, "phase": phases[-1][1] if phases else "optimizer"}
    if before:
        when, kind, nbytes, ranks = before[-1]
        out.update(last_collective=kind, last_collective_bytes=nbytes, last_collective_ranks=list(ranks),
                   ms_after_last_collective=(peak_ns - when) / 1e6)
    return out


def sweep_configurations(settings: Settings, world_size: int) -> list[Configuration]:
    """DDP, FSDP over the world and HSDP (R x S) where the world allows; the sharded ones both
    through hp_lightning and as the raw FSDP2 loop (which tells the engine's share of the memory)."""
    meshes: list[tuple[int, ...]] = [(world_size,)]
    s = settings.hsdp_shard_size
    if world_size % s == 0 and world_size // s >= 2:
        meshes.append((world_size // s, s))
    return [Configuration(DDP, (world_size,))] + [Configuration(f, m) for m in meshes for f in (HP, RAW)]


def rank_main(settings: Settings, world_size: int, device_type: str) -> dict[str, Any]:
    """Entry point of every rank (started by :func:`tests.helpers.run_distributed`)."""
    quiet()
    device = setup_rank(device_type)
    rank = dist.get_rank()
    shape = settings.model
    dataset = windows(settings, shape.block_size)
    configs = settings.configurations(world_size)
    steps = settings.warmup_steps + settings.timed_steps

    progress = Progress(rank, world_size)
    times: dict[str, list[list[float]]] = {c.name: [] for c in configs}
    for round_index in range(settings.rounds):
        for config in configs:
            micro = settings.micro_batch(world_size, config.accumulate)
            gc.collect()  # every configuration starts without the previous one's garbage
            marks = StepMarks(device)
            run_configuration(config, shape, rank_loader(dataset, micro, world_size, rank), steps, device, marks)
            times[config.name].append(marks.step_times(skip=settings.warmup_steps))
        progress.say(f"timing round {round_index + 1}/{settings.rounds}")

    measured = {
        config.name: measure_configuration(
            config, shape, dataset, settings.micro_batch(world_size, config.accumulate), settings.measure_steps, device
        )
        for config in configs
    }

    progress.say("memory and collectives pass")
    sweep: list[dict[str, Any]] = []
    datasets: dict[int, Dataset] = {}
    for sweep_shape in settings.sweep_shapes:
        if sweep_shape.block_size not in datasets:
            datasets[sweep_shape.block_size] = windows(settings, sweep_shape.block_size)
        for config in sweep_configurations(settings, world_size):
            # One sequence per rank: activations are negligible, model state is what remains.
            result = measure_configuration(
                config, sweep_shape, datasets[sweep_shape.block_size], 1, MEASURE_SKIP + 1, device
            )
            sweep.append({"shape": sweep_shape.label, "config": config.name, "sharding": config.sharding,
                          "family": config.family, "mesh_shape": config.mesh_shape, **largest_unit_bytes(sweep_shape),
                          **result})

    progress.say("memory sweep")
    return {
        "rank": rank,
        "world_size": world_size,
        "configs": [c.name for c in configs],
        "times": times,
        "measured": measured,
        "sweep": sweep,
    }
