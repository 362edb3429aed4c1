"""``python -m benchmarks.overhead`` (``make bench-overhead``): the step's own overhead at one core per rank.

The main benchmark runs more ranks than cores, where a few milliseconds of per-step Python hide
in the noise of oversubscription. Here 2 ranks run on 2 cores, each rank pinned to its own core
(``os.sched_setaffinity`` before the process group exists, so gloo's and our threads share it)
with one intra-op thread, so every fixed cost a configuration adds shows in its step time.

Model (issue 43): 6 residual MLP blocks of width 512 (hidden 4x) and a linear head in the root;
FSDP over both ranks, one unit per block plus the root, one unit of explicit prefetch; AdamW;
a fixed micro-batch (so k = 4 does four times the compute of k = 1). Configurations, timed in
interleaved rounds (every configuration once per round, every second round in reverse order):

* ``raw_fsdp2``: a hand-written loop over pre-built batches, ``set_requires_gradient_sync`` for
  accumulation: the engine's limit.
* ``hp_lightning``: ``HSDPStrategy(mesh_shape=[2])``, automatic units (the same plan).
* ``lightning_mps``: ``ModelParallelStrategy`` with ``fully_shard`` written in ``configure_model``.
* ``lightning_floor``: the raw loop's step inside a LightningModule with manual optimization under
  ``ModelParallelStrategy`` (plain ``loss.backward()`` and the torch optimizer): what Lightning's
  fit loop and the DataLoader cost on their own, which no strategy can remove.

After the timed rounds, one profiling pass per configuration runs cProfile (wall clock) over
the steps after warm-up on both ranks, and reads every thread's CPU time from
``/proc/self/task``; the report splits each configuration's time into ours (hp_lightning),
Lightning's, the DataLoader's, torch's Python (FSDP2's hooks, autograd glue), torch's kernels
and the model's own code, per optimizer step and per micro-batch (from k = 1 and k = 4 together:
per micro-batch = (t4 - t1) / 3, fixed per step = t1 - that). cProfile inflates Python-heavy code
several-fold, so its milliseconds rank the shares; the timed rounds give the true totals.

Writes ``benchmarks/results/overhead.md`` and ``overhead.json``.

Examples::

    python -m benchmarks.overhead                # the full run (about 6 minutes on 2 idle cores)
    python -m benchmarks.overhead --quick        # a smaller model, 1 round: a check of the harness
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from benchmarks.load import LoadMonitor, busy_banner, describe_load
from benchmarks.measure import StepMarks
from benchmarks.settings import HP, MPS, RAW, Configuration
from benchmarks.trainers import data_parallel_mesh, rank_loader, shard_by_hand
from benchmarks.worker import quiet, setup_rank
from hp_lightning import HSDPStrategy

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: The manual-optimization floor: Lightning's loop around the raw step (MPS, no automatic optimization).
FLOOR = "lightning_floor"
FAMILIES = (RAW, HP, MPS, FLOOR)
LABELS = {
    RAW: "raw FSDP2 loop (pre-built batches)",
    HP: "hp_lightning HSDPStrategy(mesh_shape=[2])",
    MPS: "Lightning ModelParallelStrategy + fully_shard",
    FLOOR: "floor: raw step in a LightningModule, manual optimization, MPS",
}
TARGET_RATIO = 1.03
LEARNING_RATE = 1e-3
WORLD = 2


@dataclass(frozen=True)
class OverheadSettings:
    """Sizes and counts of one run.

    Attributes:
        blocks / width / hidden: the MLP (``hidden`` is the blocks' inner width).
        micro_batch: samples per rank and micro-batch (the same at every k).
        accumulations: micro-batches per optimizer step.
        families: the configurations timed (the raw loop, the reference, always among them).
        rounds: interleaved timing rounds (every configuration once per round; every second round in
            reverse order, so a drift of the machine's speed within a round cancels out of the ratios).
        warmup_steps / timed_steps: optimizer steps per round not timed / timed.
        profile_steps: optimizer steps under cProfile in the profiling pass (after warm-up); 0 skips it.
    """

    blocks: int = 6
    width: int = 512
    hidden: int = 2048
    micro_batch: int = 64
    accumulations: tuple[int, ...] = (1, 4)
    families: tuple[str, ...] = FAMILIES
    rounds: int = 3
    warmup_steps: int = 3
    timed_steps: int = 14
    profile_steps: int = 6

    def configurations(self) -> list[Configuration]:
        """Round order: k = 1 families, then k = 4 families."""
        return [Configuration(family, (WORLD,), k) for k in self.accumulations for family in self.families]

    @property
    def samples(self) -> int:
        """Samples in the dataset: enough micro-batches for the longest run on every rank."""
        steps = self.warmup_steps + max(self.timed_steps, self.profile_steps)
        return WORLD * self.micro_batch * max(self.accumulations) * (steps + 1)


FULL = OverheadSettings()
QUICK = replace(FULL, width=128, hidden=512, micro_batch=16, rounds=1, warmup_steps=1, timed_steps=3, profile_steps=2)


# ---------------------------------------------------------------------------- model and data


class Block(nn.Module):
    """A residual MLP block: x + W2 gelu(W1 x)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    """``blocks`` MLP blocks (the sharding units) and a head the root keeps."""

    def __init__(self, settings: OverheadSettings) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(settings.width, settings.hidden) for _ in range(settings.blocks))
        self.head = nn.Linear(settings.width, settings.width)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset(settings: OverheadSettings) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(settings.samples, settings.width, generator=generator)
    return TensorDataset(x, torch.randn(settings.samples, settings.width, generator=generator))


def build_model(settings: OverheadSettings) -> MLP:
    seed_everything(0, verbose=False)
    return MLP(settings)


# ---------------------------------------------------------------------------- the four configurations


def run_raw(settings: OverheadSettings, k: int, loader: DataLoader, steps: int, marks: StepMarks) -> None:
    """The raw FSDP2 loop over batches built before the clock starts."""
    model = build_model(settings)
    shard_by_hand(model, data_parallel_mesh("cpu", (WORLD,)))  # type: ignore[arg-type]  # needs only .blocks
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    batches: Iterator[list[Tensor]] = iter(list(loader))
    marks.mark()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(k):
            x, y = next(batches)
            if k > 1:
                model.set_requires_gradient_sync(micro == k - 1)  # type: ignore[operator]
            loss = F.mse_loss(model(x), y) / k
            loss.backward()
        optimizer.step()
        marks.mark()


class AutoModule(LightningModule):
    """Automatic optimization: hp_lightning shards it itself; under MPS ``configure_model`` shards by hand."""

    def __init__(self, settings: OverheadSettings, shard_by_hand: bool) -> None:
        super().__init__()
        self.settings = settings
        self.shard = shard_by_hand
        self.model: Optional[MLP] = None

    @override
    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.settings)
        if self.shard and not isinstance(self.model, FSDPModule):
            shard_by_hand(self.model, self.device_mesh["data_parallel"])  # type: ignore[arg-type]

    @override
    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        assert self.model is not None
        return F.mse_loss(self.model(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)


class FloorModule(AutoModule):
    """The raw loop's step under Lightning's loop: manual optimization, torch's optimizer, plain backward."""

    def __init__(self, settings: OverheadSettings, k: int) -> None:
        super().__init__(settings, shard_by_hand=True)
        self.automatic_optimization = False
        self.k = k

    @override
    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:  # type: ignore[override]
        optimizer = self.optimizers().optimizer  # type: ignore[union-attr]
        micro = batch_idx % self.k
        assert self.model is not None
        if micro == 0:
            optimizer.zero_grad(set_to_none=True)
        if self.k > 1:
            self.model.set_requires_gradient_sync(micro == self.k - 1)  # type: ignore[operator]
        x, y = batch
        (F.mse_loss(self.model(x), y) / self.k).backward()
        if micro == self.k - 1:
            optimizer.step()


class Marks(Callback):
    """Marks the start of training and the end of every optimizer step (every k batches)."""

    def __init__(self, marks: StepMarks, k: int) -> None:
        self.marks = marks
        self.k = k

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.marks.mark()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.k == 0:
            self.marks.mark()


def run_lightning(family: str, settings: OverheadSettings, k: int, loader: DataLoader, steps: int, marks: StepMarks) -> None:
    seed_everything(0, verbose=False)
    module: LightningModule
    if family == HP:
        strategy: Any = HSDPStrategy(mesh_shape=[WORLD])
        module = AutoModule(settings, shard_by_hand=False)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
        module = FloorModule(settings, k) if family == FLOOR else AutoModule(settings, shard_by_hand=True)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true",
        max_epochs=1, limit_train_batches=steps * k,
        accumulate_grad_batches=1 if family == FLOOR else k,
        callbacks=[Marks(marks, k)], use_distributed_sampler=False, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)


def run_one(config: Configuration, settings: OverheadSettings, data: TensorDataset, steps: int, marks: StepMarks) -> None:
    loader = rank_loader(data, settings.micro_batch, WORLD, dist.get_rank())
    if config.family == RAW:
        run_raw(settings, config.accumulate, loader, steps, marks)
    else:
        run_lightning(config.family, settings, config.accumulate, loader, steps, marks)


# ---------------------------------------------------------------------------- profiling


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by Python thread name (else the OS name)."""
    hz = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/stat") as f:
                text = f.read()
            with open(f"/proc/self/task/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        tid = int(entry)
        name = "main" if tid == main else names.get(tid, f"native:{comm}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / hz
    return out


#: Categories of the profile, in report order.
CATEGORIES = ("hp_lightning", "lightning", "dataloader", "torch_python", "torch_kernels", "model", "other")


def category(filename: str, function: str) -> Optional[str]:
    """The category of a profiled function; None for a C builtin that is not torch's (charged to its callers)."""
    if filename == "~":
        torch_c = ("torch._C", "of 'torch.", "_VariableFunctionsClass", "run_backward", "torch._ops", "_dist_", "c10d")
        return "torch_kernels" if any(s in function for s in torch_c) else None
    if "/hp_lightning/" in filename:
        return "hp_lightning"
    if "/lightning/" in filename or "/lightning_utilities/" in filename:
        return "lightning"
    if "/torch/utils/data/" in filename:
        return "dataloader"
    if "/torch/" in filename:
        return "torch_python"
    if filename.endswith("benchmarks/overhead.py"):
        return "model"
    return "other"


def attribute(stats: pstats.Stats) -> dict[str, float]:
    """Own (exclusive) wall seconds by category; a non-torch builtin's time goes to its callers' categories."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, _, tottime, _, callers) in table.items():
        cat = category(filename, function)
        if cat is not None:
            out[cat] += tottime
            continue
        total_calls = sum(c[1] for c in callers.values()) or 1
        for (caller_file, _, caller_fn), (_, ncalls, _, _) in callers.items():
            out[category(caller_file, caller_fn) or "other"] += tottime * ncalls / total_calls
        if not callers:
            out["other"] += tottime
    return out


def top_functions(stats: pstats.Stats, prefix: str, n: int = 12) -> list[tuple[str, int, float]]:
    """The ``n`` functions under a path fragment with the most own time: (name, calls, seconds)."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = [
        (f"{Path(f).name}:{line}:{fn}", nc, tt) for (f, line, fn), (_, nc, tt, _, _) in table.items() if prefix in f
    ]
    return sorted(rows, key=lambda r: -r[2])[:n]


def profile_configuration(config: Configuration, settings: OverheadSettings, data: TensorDataset) -> dict[str, Any]:
    """Run warm-up + ``profile_steps`` with cProfile and thread CPU clocks on over the profiled steps only."""
    profiler = cProfile.Profile()
    threads: dict[str, dict[str, float]] = {}
    first, last = settings.warmup_steps, settings.warmup_steps + settings.profile_steps

    def on_mark(index: int) -> None:
        if index == first:
            threads["start"] = thread_cpu_s()
            profiler.enable()
        elif index == last:
            profiler.disable()
            threads["end"] = thread_cpu_s()

    marks = StepMarks(torch.device("cpu"), on_mark=on_mark)
    gc.collect()
    run_one(config, settings, data, last, marks)
    profiler.disable()
    stats = pstats.Stats(profiler)
    steps = settings.profile_steps
    cpu = {name: (threads["end"].get(name, 0.0) - threads["start"].get(name, 0.0)) / steps for name in threads["end"]}
    return {
        "wall_s_per_step": (marks.perf[last] - marks.perf[first]) / steps,
        "own_s_per_step": {cat: s / steps for cat, s in attribute(stats).items()},
        "thread_cpu_s_per_step": {k: v for k, v in cpu.items() if v > 0},
        "top_hp_lightning": [(n, c / steps, s / steps) for n, c, s in top_functions(stats, "/hp_lightning/")],
        "top_lightning": [(n, c / steps, s / steps) for n, c, s in top_functions(stats, "/lightning/")],
    }


# ---------------------------------------------------------------------------- ranks


def rank_main(settings: OverheadSettings) -> dict[str, Any]:
    """Every rank: pin to one core and one thread, then timed rounds, then a profiling pass."""
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})  # before gloo's threads exist: they inherit it
    torch.set_num_threads(1)
    quiet()
    setup_rank("cpu")
    data = dataset(settings)
    configs = settings.configurations()
    steps = settings.warmup_steps + settings.timed_steps
    times: dict[str, list[float]] = {c.name: [] for c in configs}
    cpu_times: dict[str, list[float]] = {c.name: [] for c in configs}
    # Untimed: the first run in a fresh process pays one-time costs (allocator growth, lazy imports and
    # inits) that would otherwise land on round 1's first configuration, the raw loop (the reference).
    run_one(configs[0], settings, data, settings.warmup_steps + 1, StepMarks(torch.device("cpu")))
    for round_index in range(settings.rounds):
        for config in configs if round_index % 2 == 0 else configs[::-1]:
            gc.collect()
            marks = StepMarks(torch.device("cpu"))
            run_one(config, settings, data, steps, marks)
            times[config.name].append(statistics.median(marks.step_times(skip=settings.warmup_steps)))
            cpu_times[config.name].append(statistics.median(marks.cpu_step_times(skip=settings.warmup_steps)))
        if rank == 0:
            print(f"  round {round_index + 1}/{settings.rounds} done", flush=True)
    profiles = {}
    if settings.profile_steps:
        profiles = {config.name: profile_configuration(config, settings, data) for config in configs}
    return {"rank": rank, "core": cores[rank % len(cores)], "times": times, "cpu_times": cpu_times, "profiles": profiles}


# ---------------------------------------------------------------------------- report


def summarize(ranks: list[dict[str, Any]], settings: OverheadSettings) -> dict[str, Any]:
    """Per configuration: step time per round (slowest rank), ratio to raw per round, overhead per micro-batch."""
    rows: dict[str, Any] = {}
    for config in settings.configurations():
        per_round = [max(r["times"][config.name][i] for r in ranks) for i in range(settings.rounds)]
        raw_name = Configuration(RAW, (WORLD,), config.accumulate).name
        raw = [max(r["times"][raw_name][i] for r in ranks) for i in range(settings.rounds)]
        ratios = [a / b for a, b in zip(per_round, raw)]
        micro_ms = [(a - b) * 1e3 / config.accumulate for a, b in zip(per_round, raw)]
        # CPU: both ranks' process CPU per step (median step of each), summed: the job's work.
        cpu = [sum(r["cpu_times"][config.name][i] for r in ranks) for i in range(settings.rounds)]
        cpu_raw = [sum(r["cpu_times"][raw_name][i] for r in ranks) for i in range(settings.rounds)]
        cpu_ratios = [a / b for a, b in zip(cpu, cpu_raw)]
        rows[config.name] = {
            "family": config.family, "k": config.accumulate, "label": LABELS[config.family],
            "step_s": statistics.median(per_round), "step_s_rounds": per_round,
            "ratio": statistics.median(ratios), "ratio_rounds": ratios,
            "overhead_ms_per_micro_batch": statistics.median(micro_ms), "overhead_ms_per_micro_batch_rounds": micro_ms,
            "cpu_s": statistics.median(cpu), "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratio_rounds": cpu_ratios,
            "profile": [r["profiles"][config.name] for r in ranks if config.name in r["profiles"]],
        }
    return rows


def split_per_micro_batch(rows: dict[str, Any], family: str, settings: OverheadSettings) -> Optional[dict[str, dict[str, float]]]:
    """Own ms by category, rank mean: per step at k = 1 and 4, and split into per micro-batch and fixed per step."""
    ks = settings.accumulations
    if ks != (1, 4) or not settings.profile_steps:
        return None
    by_k = {}
    for k in ks:
        row = rows[Configuration(family, (WORLD,), k).name]
        by_k[k] = {cat: statistics.mean(p["own_s_per_step"][cat] for p in row["profile"]) * 1e3 for cat in CATEGORIES}
    out = {}
    for cat in CATEGORIES:
        micro = (by_k[4][cat] - by_k[1][cat]) / 3
        out[cat] = {"k1": by_k[1][cat], "k4": by_k[4][cat], "per_micro_batch": micro, "fixed_per_step": by_k[1][cat] - micro}
    return out


def _spread(ratios: list[float]) -> str:
    """``median over N rounds (quartiles a–b, range c–d)``."""
    median = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [median, median, median]
    return (f"{median:.3f} over {len(ratios)} rounds (quartiles {quartiles[0]:.3f}–{quartiles[2]:.3f}, "
            f"range {min(ratios):.3f}–{max(ratios):.3f})")


def markdown(summary: dict[str, Any]) -> str:
    settings = OverheadSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in summary["settings"].items()})
    rows = summary["rows"]
    lines = [
        "# Step overhead at one core per rank (`make bench-overhead`)",
        "",
        *busy_banner(summary["load"]),
        f"World 2 on gloo, each rank pinned to its own core, `torch.set_num_threads(1)`. Model: {settings.blocks} "
        f"residual MLP blocks, width {settings.width} (hidden {settings.hidden}), head in the root; FSDP 2, a unit "
        f"per block + root; AdamW; micro-batch {settings.micro_batch} samples per rank. {settings.rounds} interleaved "
        f"rounds of {settings.warmup_steps} warm-up + {settings.timed_steps} timed steps; a round's time is the "
        "slower rank's median step; ratios are the median over rounds of the per-round ratio to the raw loop.",
        "",
        f"Load: {describe_load(summary['load'])}.",
        f"Wall time: {summary['elapsed_s'] / 60:.1f} min. torch {summary['torch']}.",
        "",
        "| configuration | k | step (ms, median) | ÷ raw (median) | ÷ raw per round | overhead per micro-batch (ms, median [min, max]) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        spread = row["overhead_ms_per_micro_batch_rounds"]
        lines.append(
            f"| {row['label']} | {row['k']} | {row['step_s'] * 1e3:.1f} | **{row['ratio']:.3f}** | "
            + ", ".join(f"{r:.3f}" for r in row["ratio_rounds"])
            + f" | {row['overhead_ms_per_micro_batch']:+.1f} [{min(spread):+.1f}, {max(spread):+.1f}] |"
        )
    lines += [
        "",
        "CPU time per step (both ranks' processes, every thread, summed; the median step of each round): it leaves "
        "out waiting and time stolen by the hypervisor, so it varies less between rounds than wall time.",
        "",
        "| configuration | k | CPU (ms, median) | CPU ÷ raw (median) | CPU ÷ raw per round |",
        "|---|---|---|---|---|",
    ]
    for row in rows.values():
        lines.append(f"| {row['label']} | {row['k']} | {row['cpu_s'] * 1e3:.1f} | **{row['cpu_ratio']:.3f}** | "
                     + ", ".join(f"{r:.3f}" for r in row["cpu_ratio_rounds"]) + " |")
    lines += ["", "## Targets (issue 43)", ""]
    for k in settings.accumulations if HP in settings.families else ():
        row = rows[Configuration(HP, (WORLD,), k).name]
        ratio = statistics.median(row["ratio_rounds"])
        verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
        lines.append(f"- hp_lightning ÷ raw at k = {k}: {_spread(row['ratio_rounds'])}; target ≤ {TARGET_RATIO}: "
                     f"**{verdict}**. CPU time ÷ raw: {_spread(row['cpu_ratio_rounds'])}")
    if not settings.profile_steps:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## Where the time goes (cProfile, wall clock, own time by category, ms per optimizer step, mean of ranks)",
        "",
        "cProfile inflates Python-heavy code several-fold: read these as shares, and the timed table above for totals. "
        "Builtins that are not torch's are charged to their callers' category.",
        "",
        "| configuration | k | profiled step (ms) | " + " | ".join(CATEGORIES) + " |",
        "|---|---|---|" + "---|" * len(CATEGORIES),
    ]
    for row in rows.values():
        own = {cat: statistics.mean(p["own_s_per_step"][cat] for p in row["profile"]) * 1e3 for cat in CATEGORIES}
        wall = statistics.mean(p["wall_s_per_step"] for p in row["profile"]) * 1e3
        lines.append(f"| {row['label']} | {row['k']} | {wall:.1f} | " + " | ".join(f"{own[c]:.1f}" for c in CATEGORIES) + " |")
    for family in settings.families:
        split = split_per_micro_batch(rows, family, settings)
        if split is None:
            continue
        lines += ["", f"### {LABELS[family]}: per micro-batch and fixed per step (ms, profiled)", "",
                  "| category | k = 1 step | k = 4 step | per micro-batch | fixed per step |", "|---|---|---|---|---|"]
        for cat, v in split.items():
            lines.append(f"| {cat} | {v['k1']:.2f} | {v['k4']:.2f} | {v['per_micro_batch']:.2f} | {v['fixed_per_step']:.2f} |")
    lines += ["", "## CPU time of threads other than the main one (ms per step, rank 0)", "",
              "| configuration | k | threads |", "|---|---|---|"]
    for row in rows.values():
        cpu = row["profile"][0]["thread_cpu_s_per_step"]
        others = ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in sorted(cpu.items(), key=lambda kv: -kv[1]) if n != "main") or "none"
        lines.append(f"| {row['label']} | {row['k']} | main: {cpu.get('main', 0) * 1e3:.1f}; {others} |")
    lines += ["", "## hp_lightning's own functions (profiled, rank 0, per step: calls, ms)", ""]
    for k in settings.accumulations if HP in settings.families else ():
        top = rows[Configuration(HP, (WORLD,), k).name]["profile"][0]["top_hp_lightning"]
        lines.append(f"- k = {k}: " + ("; ".join(f"`{n}` {c:.0f}x {s * 1e3:.2f}" for n, c, s in top[:8]) or "none"))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    from tests.helpers import run_distributed

    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and one round: checks the harness")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3)")
    parser.add_argument("--families", help=f"comma-separated configurations to time, the raw loop always among them "
                        f"(default all: {','.join(FAMILIES)})")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile pass (the timed rounds only)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = replace(settings, rounds=args.rounds)
    if args.families:
        chosen = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = sorted(set(chosen) - set(FAMILIES))
        if unknown:
            parser.error(f"--families: unknown {unknown}; expected names among {list(FAMILIES)}")
        settings = replace(settings, families=tuple(f for f in FAMILIES if f == RAW or f in chosen))
    if args.no_profile:
        settings = replace(settings, profile_steps=0)
    if (os.cpu_count() or 1) < WORLD:
        print(f"note: {os.cpu_count()} core(s) for {WORLD} ranks: they share, the overhead is not isolated", flush=True)
    started = time.monotonic()
    with LoadMonitor() as load:
        ranks = run_distributed(rank_main, WORLD, settings, timeout=1800)
    elapsed = time.monotonic() - started
    summary = {
        "settings": asdict(settings), "load": load.summary(), "elapsed_s": elapsed, "torch": torch.__version__,
        "cores": [r["core"] for r in ranks], "rows": summarize(ranks, settings),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.md").write_text(markdown(summary))
    (args.out / "overhead.json").write_text(json.dumps(summary, indent=1, default=str))
    for row in summary["rows"].values():
        print(f"  {row['label']:<62} k={row['k']} step {row['step_s'] * 1e3:7.1f} ms  ÷ raw {row['ratio']:.3f}  "
              f"+{row['overhead_ms_per_micro_batch']:.1f} ms/micro-batch  CPU ÷ raw {row['cpu_ratio']:.3f}")
    print(f"wrote {args.out / 'overhead.md'} in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
