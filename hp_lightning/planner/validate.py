"""``--validate``: train a planned candidate for a few steps on CPU ranks and compare with the plan.

Each rank runs the real ``HSDPStrategy`` under the ``Trainer`` (gloo, the plan's groups). Over the
last step only (the probes cost time) a :class:`~hp_lightning.core.diagnostics.CollectiveCounter`
counts calls, compared byte for byte, and a :class:`~hp_lightning.core.diagnostics.HeapSampler`
samples glibc's malloc heap. The heap also holds what is not a tensor (code, caches, objects,
gloo's buffers), measured in the same run and taken off: ``tensor peak = heap peak - non-tensor
heap``, compared with ``RankRun.gloo_peak_bytes`` (see ``docs/planning.md``).
"""

from __future__ import annotations

import gc
import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from hp_lightning.core import devices
from hp_lightning.core._torch_private import local_tensor
from hp_lightning.core.diagnostics import CollectiveCall, CollectiveCounter, HeapSampler
from hp_lightning.planner.candidates import Cluster, Workload
from hp_lightning.planner.comms import step_calls
from hp_lightning.planner.model import ModelSpec, _import
from hp_lightning.strategies.hsdp import HSDPStrategy


def live_tensor_bytes() -> int:
    """Bytes of CPU tensor storage alive that Python can reach and the collector tracks, each storage once.

    Storages are keyed by address, so views and FSDP2's flat buffers count once; objects frozen by
    :func:`_frozen_gc` are skipped. Tensors only C++ holds (autograd's saved tensors) are not seen:
    call it between steps, when no graph lives.
    """
    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookups on lazy modules
            continue
        tensor = local_tensor(obj) if isinstance(obj, DTensor) else obj
        if tensor.device.type != devices.CPU or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


@contextmanager
def _frozen_gc() -> Iterator[None]:
    """Freeze every object alive now (:func:`gc.freeze`) for the block; collect the block's garbage after it.

    What exists before the measured run is not its memory: frozen, it is left out of
    :func:`live_tensor_bytes` and out of the collector's passes (about a second each in a process
    importing torch, Lightning and transformers). The objects stay frozen after the block: call it
    in a process that exists to measure.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()  # the run's own cycles (Trainer, strategy, module), before they are frozen by the next run


@dataclass(frozen=True)
class Measurement:
    """What one rank measured in its last step (bytes; memory relative to before the model was built)."""

    rank: int
    calls: list[tuple[str, tuple[int, ...], int, str]]  # (kind, ranks, bytes, dtype) of the last step
    heap_peak: int  # the malloc heap's peak over the step
    non_tensor_heap: int  # heap growth minus live tensor storage growth, at the step's end
    sampling_gap_ms: float = 0.0  # the longest time between two heap samples in the step (a peak may hide in it)

    @property
    def tensor_peak(self) -> int:
        """The heap peak less what no tensor accounts for: the figure the plan's peak predicts."""
        return self.heap_peak - self.non_tensor_heap


def _token_loader(vocab: int, seq_len: int, batch: int, batches: int, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    n = batch * batches
    x = torch.randint(0, vocab, (n, seq_len), generator=g)
    y = torch.randint(0, vocab, (n, seq_len), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False, drop_last=True)


def measure_rank(spec: ModelSpec, strategy_args: dict[str, Any], cluster: Cluster, workload: Workload, steps: int = 2) -> Measurement:
    """Train ``steps`` optimizer steps on this rank (inside a launched world) and measure the last one.

    The first step builds the optimizer's and FSDP2's lazy state, so two steps suffice. Must run in
    every rank of a launched world of ``cluster.world_size`` processes, each with one CPU thread.

    Raises:
        ValueError: fewer than 2 steps (the first is not the steady state).
        RuntimeError: no glibc ``mallinfo2`` here (the CPU memory method needs it).
    """
    if steps < 2:
        raise ValueError(f"--validate needs at least 2 optimizer steps (the first builds the optimizer state and is not measured); got steps={steps}.")
    sampler = HeapSampler(rss=False)
    if sampler.read_heap is None:
        raise RuntimeError("--validate measures CPU memory with glibc's mallinfo2, which this system lacks (not glibc).")
    last_batch = steps * workload.accumulation - 1

    class _LastStep(pl.Callback):
        """Counts collectives and samples the heap from the last step's first batch on (probes slow a step down)."""

        def __init__(self) -> None:
            self.window = [0, 0]
            self.non_tensor_heap = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == last_batch - workload.accumulation + 1:
                sampler.sample()
                self.window[0] = time.time_ns()
                sampler.resume()
                counter.__enter__()  # left after fit: the step's calls up to the end, as a bucket would hold

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == last_batch:  # after the optimizer step: no autograd graph lives
                sampler.sample()
                self.window[1] = time.time_ns()
                sampler.pause()
                self.non_tensor_heap = sampler.heap_at(self.window[1]) - live_tensor_bytes()

    rank = int(os.environ.get("RANK", "0"))
    pp = strategy_args.get("pipeline_parallel_size", 1)
    batch = workload.micro_batch * (strategy_args.get("pipeline_microbatches") or pp if pp > 1 else 1)
    counter = CollectiveCounter()
    probes = _LastStep()
    with sampler, _frozen_gc():  # the heap's baseline after a collection; from then on the collector sees only this run
        sampler.pause()  # until the measured step
        module = _import(spec.class_path)(**dict(spec.init_args))
        precision = {"32": "32-true", "bf16-mixed": "32-true", "bf16-true": "bf16-true"}[workload.precision]
        trainer = pl.Trainer(
            accelerator=devices.CPU, devices=cluster.devices, num_nodes=cluster.nodes, strategy=HSDPStrategy(**strategy_args),
            max_steps=steps, accumulate_grad_batches=workload.accumulation, precision=cast(Literal["32-true", "bf16-true"], precision),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0, callbacks=[probes],
        )
        dp = cluster.world_size // (strategy_args.get("tensor_parallel_size", 1) * pp)
        vocab = spec.vocab_size(module)
        loader = _token_loader(vocab, workload.seq_len, batch, steps * workload.accumulation * dp)
        try:
            trainer.fit(module, loader)
        finally:
            counter.__exit__(None, None, None)
        del trainer, module, loader  # garbage for the collection at the block's end
    calls = [(c.kind, c.ranks, c.bytes, str(c.dtype)) for c in counter.calls]
    return Measurement(rank, calls, sampler.heap_peak(*probes.window), probes.non_tensor_heap, sampler.largest_gap_ms(*probes.window))


def compare(predicted: list[CollectiveCall], measured: list[tuple[str, tuple[int, ...], int, str]]) -> dict[str, tuple[int, int]]:
    """Bytes per collective kind: (predicted, measured)."""
    kinds = sorted({c.kind for c in predicted} | {m[0] for m in measured})
    return {k: (sum(c.bytes for c in predicted if c.kind == k), sum(m[2] for m in measured if m[0] == k)) for k in kinds}


def _launched_rank(rank: int, world: int, port: int, local_world: int, args: tuple, out: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
        NODE_RANK=str(rank // local_world), LOCAL_WORLD_SIZE=str(local_world), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        out.put((rank, "ok", measure_rank(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported by the launcher
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_validation(result: Any, entry: Any, steps: int = 2, timeout: float = 600.0) -> str:
    """Launch the plan's world on this machine's CPU, train ``entry`` and report estimate vs measurement.

    Raises:
        ValueError: a world too large for CPU ranks here (more than 16 processes), or fewer than 2 steps.
        RuntimeError: a rank failed.
    """
    if steps < 2:
        raise ValueError(f"--validate needs at least 2 optimizer steps (the first builds the optimizer state and is not measured); got --steps {steps}.")
    cluster = result.cluster
    if cluster.world_size > 16:
        raise ValueError(
            f"--validate runs every planned rank as a CPU process here; {cluster.world_size} ranks is too many. Validate on a "
            f"small cluster shape (e.g. --nodes 2 --devices 2) with the same model family, or on the real machines."
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (result.spec, result.strategy_args(entry), cluster, result.workload, steps)
    procs = [ctx.Process(target=_launched_rank, args=(r, cluster.world_size, port, cluster.devices, args, queue)) for r in range(cluster.world_size)]
    for p in procs:
        p.start()
    got: dict[int, Measurement] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(got) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty; check the processes
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        (got.__setitem__(rank, value) if status == "ok" else errors.append(f"rank {rank}: {value}"))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors or len(got) < len(procs):
        raise RuntimeError("--validate failed:\n" + "\n".join(errors or ["a rank exited without a result (see its output above)"]))
    return validation_report(entry, cluster, [got[r] for r in sorted(got)])


def predicted_for_rank(entry: Any, cluster: Cluster, rank: int) -> tuple[list[CollectiveCall], int]:
    """The plan's calls and CPU (gloo) peak for ``rank``: its stage's simulated rank, re-addressed to ``rank``'s groups."""
    stride = cluster.world_size // entry.candidate.pp
    run = entry.runs[rank // stride] if entry.candidate.pp > 1 else entry.runs[0]
    calls = step_calls(run, entry.candidate, cluster)
    return calls, run.gloo_peak_bytes  # the ranks run on gloo: its staging buffers are part of their peak


def validation_report(entry: Any, cluster: Cluster, measured: list[Measurement]) -> str:
    """Per rank: bytes per collective kind predicted vs counted, and peak memory predicted vs measured."""
    lines = [
        f"--validate {entry.candidate.name}: last of the measured steps, per rank; memory in MiB: tensor peak = heap peak "
        f"(mallinfo2) - non-tensor heap (heap growth - live tensor growth at the step's end)"
    ]
    for m in measured:
        calls, peak = predicted_for_rank(entry, cluster, m.rank)
        rows = compare(calls, m.calls)
        exact = all(p == q for p, q in rows.values())
        parts = ", ".join(f"{k} {p:,}/{q:,}" for k, (p, q) in rows.items())
        ratio = peak / m.tensor_peak if m.tensor_peak > 0 else float("nan")
        lines.append(
            f"  rank {m.rank}: bytes predicted/counted {parts} -> {'EXACT' if exact else 'DIFFERENT'}; peak predicted "
            f"{peak / 2**20:.1f}, measured {m.tensor_peak / 2**20:.1f} (heap {m.heap_peak / 2**20:.1f} - non-tensor heap "
            f"{m.non_tensor_heap / 2**20:.1f}): predicted / measured = {ratio:.2f}"
        )
    return "\n".join(lines)
