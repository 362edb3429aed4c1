"""``--validate``: train a planned candidate for a few steps on CPU ranks and compare with the plan.

Each rank runs the real ``HSDPStrategy`` under the Lightning ``Trainer`` (gloo, one process per
planned rank, ``LOCAL_WORLD_SIZE`` = the plan's devices per node, so intra/inter-node groups are
the plan's), with

* :class:`~hp_lightning.core.diagnostics.CollectiveCounter` around ``fit``, one bucket per batch
  (``mark`` in ``on_train_batch_start``): the last step's calls are compared with the plan's,
  per collective kind, byte for byte;
* the benchmarks' CPU memory method (``benchmarks/measure.py``): glibc ``mallinfo2`` (bytes malloc
  has handed out, all threads; CPU tensors live there) sampled every 0.5 ms by a thread and at
  every batch start and end, relative to the heap before the Trainer was built (after a garbage
  collection and ``malloc_trim``); the peak over the last step is compared with the plan's peak.
  It also holds what no tensor accounts for (Python objects Lightning creates per step, gloo's
  buffers), which is the residual reported. On a GPU, ``torch.cuda.max_memory_allocated`` is
  the measure (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from hp_lightning.core import devices
from hp_lightning.core.diagnostics import CollectiveCall, CollectiveCounter
from hp_lightning.planner.candidates import Cluster, Workload
from hp_lightning.planner.model import ModelSpec


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


def heap_reader() -> Callable[[], int] | None:
    """Bytes malloc has handed out, over all arenas and threads (glibc ``mallinfo2``); None elsewhere."""
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


def release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HeapSampler:
    """Samples the heap every ``interval_s`` on a thread; :meth:`sample` adds one now."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.read = heap_reader()
        if self.read is None:
            raise RuntimeError("--validate measures CPU memory with glibc's mallinfo2, which this system lacks (not glibc).")
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planner-heap", daemon=True)
        self.before = 0

    def sample(self) -> None:
        assert self.read is not None
        self.samples.append((time.perf_counter(), self.read()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(0.0005)

    def start(self) -> None:
        release_freed_memory()
        assert self.read is not None
        self.before = self.read()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float, end: float) -> int:
        window = [h for t, h in self.samples if start <= t <= end]
        return max(window, default=self.before) - self.before


@dataclass(frozen=True)
class Measurement:
    """What one rank measured in its last step."""

    rank: int
    calls: list[tuple[str, tuple[int, ...], int, str]]  # (kind, ranks, bytes, dtype) of the last step
    heap_peak: int


def _token_loader(vocab: int, seq_len: int, batch: int, batches: int, seed: int = 0) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    n = batch * batches
    x = torch.randint(0, vocab, (n, seq_len), generator=g)
    y = torch.randint(0, vocab, (n, seq_len), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False, drop_last=True)


def measure_rank(spec: ModelSpec, strategy_args: dict[str, Any], cluster: Cluster, workload: Workload, steps: int = 3) -> Measurement:
    """Train ``steps`` optimizer steps on this rank (inside a launched world) and measure the last one.

    Must run in every rank of a world of ``cluster.world_size`` processes (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT`` set), each with one CPU thread.
    """
    import lightning.pytorch as pl

    import hp_lightning
    from hp_lightning.planner.model import _import

    class _Marks(pl.Callback):
        def __init__(self, counter: CollectiveCounter, sampler: HeapSampler) -> None:
            self.counter, self.sampler = counter, sampler
            self.windows: dict[int, list[float]] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.sampler.sample()
            self.counter.mark(batch_idx // workload.accumulation)
            self.windows.setdefault(batch_idx // workload.accumulation, [time.perf_counter(), 0.0])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.sampler.sample()
            self.windows[batch_idx // workload.accumulation][1] = time.perf_counter()

    rank = int(os.environ.get("RANK", "0"))
    pp = strategy_args.get("pipeline_parallel_size", 1)
    batch = workload.micro_batch * (strategy_args.get("pipeline_microbatches") or pp if pp > 1 else 1)
    sampler = HeapSampler()
    counter = CollectiveCounter()
    marks = _Marks(counter, sampler)
    sampler.start()
    module = _import(spec.class_path)(**dict(spec.init_args))
    precision = {"32": "32-true", "bf16-mixed": "32-true", "bf16-true": "bf16-true"}[workload.precision]
    trainer = pl.Trainer(
        accelerator=devices.CPU, devices=cluster.devices, num_nodes=cluster.nodes, strategy=hp_lightning.HSDPStrategy(**strategy_args),
        max_steps=steps, accumulate_grad_batches=workload.accumulation, precision=cast(Literal["32-true", "bf16-true"], precision), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[marks],
    )
    dp = cluster.world_size // (strategy_args.get("tensor_parallel_size", 1) * pp)
    vocab = spec.vocab_size(module)
    loader = _token_loader(vocab, workload.seq_len, batch, steps * workload.accumulation * dp)
    with counter:
        trainer.fit(module, loader)
    sampler.stop()
    last = steps - 1
    start, end = marks.windows[last]
    calls = [(c.kind, c.ranks, c.bytes, str(c.dtype)) for c in counter.buckets().get(last, [])]
    return Measurement(rank, calls, sampler.peak(start, end))


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
        import traceback

        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_validation(result: Any, entry: Any, steps: int = 3, timeout: float = 600.0) -> str:
    """Launch the plan's world on this machine's CPU, train ``entry`` and report estimate vs measurement.

    Raises:
        ValueError: a world too large for CPU ranks here (more than 16 processes).
        RuntimeError: a rank failed.
    """
    import socket

    import torch.multiprocessing as mp

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
    """The plan's calls and peak for ``rank``: its stage's simulated rank, re-addressed to ``rank``'s groups."""
    from hp_lightning.planner.comms import step_calls

    stride = cluster.world_size // entry.candidate.pp
    run = entry.runs[rank // stride] if entry.candidate.pp > 1 else entry.runs[0]
    calls = step_calls(run, entry.candidate, cluster)
    return calls, run.peak_bytes


def validation_report(entry: Any, cluster: Cluster, measured: list[Measurement]) -> str:
    """Per rank: bytes per collective kind predicted vs counted, and peak memory predicted vs measured."""
    lines = [f"--validate {entry.candidate.name}: last of the measured steps, per rank"]
    for m in measured:
        calls, peak = predicted_for_rank(entry, cluster, m.rank)
        rows = compare(calls, m.calls)
        exact = all(p == q for p, q in rows.values())
        parts = ", ".join(f"{k} {p:,}/{q:,}" for k, (p, q) in rows.items())
        ratio = m.heap_peak / peak if peak else float("nan")
        lines.append(
            f"  rank {m.rank}: bytes predicted/counted {parts} -> {'EXACT' if exact else 'DIFFERENT'}; peak predicted "
            f"{peak / 2**20:.1f} MiB, measured {m.heap_peak / 2**20:.1f} MiB (heap, mallinfo2) = {ratio:.2f} x"
        )
    return "\n".join(lines)
