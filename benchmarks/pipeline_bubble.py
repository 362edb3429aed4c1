"""The pipeline bubble, measured: idle fraction per stage for every schedule (``make bench-pipeline``).

Two gloo ranks (``pipeline_parallel_size=2``, no data parallelism), cut from one residual MLP
with :func:`hp_lightning.parallel.split_stage`: one stage per rank for GPipe and 1F1B, two per
rank (V = 2, four stages; :func:`~hp_lightning.parallel.pipeline_schedules.stage_view` gives each
its module) for the interleaved, looped and zero-bubble schedules, all run through
:class:`hp_lightning.parallel.PipelineRunner` (what ``HSDPStrategy`` runs per training step).
The batch is the same for every row; it is split into M = 4 or 8 micro-batches.

Per stage and step: *compute* is the time inside the stage's forward, backward and (zero-bubble)
weight-gradient chunks; *idle* is ``1 - compute / step time``, split into *wait* (inside the
schedule's waits on its sends and receives and in the step's closing loss broadcast: the bubble,
plus the transfer itself), *post* (posting them) and *rest* (the schedule's own Python between actions: loss, chunking, bookkeeping). The ideal shown is
``(P - 1) / (V M + P - 1)``, the interleaved 1F1B bubble (V = 1: GPipe's and 1F1B's); zero-bubble
schedules aim below it. 1F1B has the same bubble as GPipe; what it saves is activation memory,
reported as the peak number of micro-batch chunks whose forward has run and whose backward has not.

What makes the measurement reflect the schedule rather than the transport: each rank runs one
thread (``torch.set_num_threads(1)``; on a machine with fewer cores than ranks the ranks steal
time from each other, and idle is meaningless), and a micro-batch chunk's compute must dwarf one
gloo send / receive and the schedule's per-action Python (a few hundred microseconds on
localhost): interleaving halves the chunk and doubles the messages, so with small chunks it
*adds* idle time. The widths here (1024, 4 x 1024 hidden, 512 samples) put a chunk at M = 8,
V = 2 at tens of milliseconds on one core; *post* and *rest* say how much the overheads still
weigh (the bubble itself is in *wait*).

Second part, on 4 ranks (PP 2 x FSDP 2, ``HSDPStrategy`` under the Trainer on the tests' small
model, ``pipeline_keep_gathered`` at its default): all-gathers and reduce-scatters per unit in one
training step, counted at the ``torch.distributed`` call
(:class:`hp_lightning.core.diagnostics.CollectiveCounter`), for the same schedules and M; 1.0 / 1.0
means once per step whatever M is. Only counts are taken there (4 ranks may share fewer cores).

``--quick`` (or ``HP_BENCH_QUICK=1``): a smoke run (small widths, one step, M = 4 only) that checks
the script works; it prints its table and writes nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

QUICK = "--quick" in sys.argv or os.environ.get("HP_BENCH_QUICK") == "1"
STEPS, WARMUP = (1, 1) if QUICK else (6, 2)
SAMPLES, WIDTH, DEPTH = (64, 64, 8) if QUICK else (512, 1024, 8)
MICROBATCHES = (4,) if QUICK else (4, 8)
#: name -> stages per rank (V).
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}


def _adding_time_to(total: list[float], fn: Any) -> Any:
    """``fn``, with the seconds each call takes added to ``total[0]``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    return timed


def _timed_p2p(waiting: list[float], posting: list[float]) -> None:
    """Time the schedules' posting of sends / receives and their waits on them (both torch module-level helpers)."""
    from torch.distributed.pipelining import schedules

    schedules._batch_p2p = _adding_time_to(posting, schedules._batch_p2p)  # type: ignore[assignment]
    schedules._wait_batch_p2p = _adding_time_to(waiting, schedules._wait_batch_p2p)  # type: ignore[assignment]


def _worker() -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    from hp_lightning.parallel import PipelineRunner, split_stage
    from hp_lightning.parallel.pipeline import stage_units, units_by_stage
    from hp_lightning.parallel.pipeline_schedules import stage_view, stages_of_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    waiting, posting = [0.0], [0.0]
    _timed_p2p(waiting, posting)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(DEPTH))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x

    results: dict[str, Any] = {}
    for schedule, per_rank in SCHEDULES.items():
        for microbatches in MICROBATCHES:
            torch.manual_seed(0)
            model = Net()
            num_stages = 2 * per_rank
            points = [f"blocks.{DEPTH * s // num_stages}" for s in range(1, num_stages)]
            mine = stages_of_rank(schedule, rank, 2, per_rank)
            per_stage = units_by_stage(stage_units(model, points), points)
            split_stage(model, points, mine)
            held = [u for s in mine for u in per_stage[s]]
            modules = [model] if per_rank == 1 else [stage_view(model, [u for u in held if u not in per_stage[s]]) for s in mine]
            runner = PipelineRunner(
                modules if per_rank > 1 else model, stage_index=mine if per_rank > 1 else rank, num_stages=num_stages,
                device=torch.device("cpu"), group=dist.group.WORLD,
                schedule=schedule, microbatches=microbatches, loss_fn=lambda out, target: (out - target).pow(2).mean(),
            )
            busy, chunks = [0.0], [0]
            alive, peak = [0], [0]

            def timed(method: Any, counts: int, busy: list[float] = busy, chunks: list[int] = chunks, alive: list[int] = alive, peak: list[int] = peak) -> Any:
                clocked = _adding_time_to(busy, method)

                def run(*args: Any, **kwargs: Any) -> Any:
                    try:
                        return clocked(*args, **kwargs)
                    finally:
                        chunks[0] += 1
                        alive[0] += counts
                        peak[0] = max(peak[0], alive[0])

                return run

            # The step ends with the last stage's loss broadcast to every stage: a wait for the pipeline's tail, as in training.
            runner._share_loss = _adding_time_to(waiting, runner._share_loss)  # type: ignore[method-assign]
            for stage in runner.stages:
                stage.forward_one_chunk = timed(stage.forward_one_chunk, +1)
                stage.backward_one_chunk = timed(stage.backward_one_chunk, -1)
                stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, 0)
            x, y = torch.randn(SAMPLES, WIDTH), torch.randn(SAMPLES, WIDTH)
            rows: list[dict[str, float]] = []
            for step in range(WARMUP + STEPS):
                busy[0], chunks[0], alive[0], peak[0], waiting[0], posting[0] = 0.0, 0, 0, 0, 0.0, 0.0
                dist.barrier()
                start = time.perf_counter()
                runner.step(x, y)
                elapsed = time.perf_counter() - start
                if step >= WARMUP:
                    rows.append({"step": elapsed, "busy": busy[0], "wait": waiting[0], "post": posting[0], "chunks": chunks[0], "peak": peak[0]})
            results[f"{schedule} M={microbatches}"] = {
                "step_s": statistics.median(r["step"] for r in rows),
                "busy_s": statistics.median(r["busy"] for r in rows),
                "idle": statistics.median(1 - r["busy"] / r["step"] for r in rows),
                "waiting": statistics.median(r["wait"] / r["step"] for r in rows),
                "posting": statistics.median(r["post"] / r["step"] for r in rows),
                "rest": statistics.median((r["step"] - r["busy"] - r["wait"] - r["post"]) / r["step"] for r in rows),
                "ms_per_chunk": 1e3 * statistics.median(r["busy"] / max(r["chunks"], 1) for r in rows),
                "ideal_bubble": 1 / (per_rank * microbatches + 1),
                "stages_per_rank": per_rank,
                "peak_microbatches_alive": max(int(r["peak"]) for r in rows),
            }
    dist.destroy_process_group()
    return results


def _count_worker() -> dict[str, Any]:
    """Per rank, per schedule and M: one training step's all-gathers / reduce-scatters and the rank's unit count."""
    from tests.distributed.test_pipeline_schedules import counted

    return {f"{schedule} M={m}": counted([2], schedule, per_rank, m) for schedule, per_rank in SCHEDULES.items() for m in MICROBATCHES}


def _idle(stage: dict[str, Any]) -> str:
    return f"{stage['idle']:.1%} ({stage['waiting']:.1%} + {stage['posting']:.1%} + {stage['rest']:.1%})"


def _per_unit(count: dict[str, Any]) -> str:
    units = count["units"] or 1
    return f"{count['all_gather'] / units:.1f} / {count['reduce_scatter'] / units:.1f}"


def main() -> int:
    from tests.helpers import run_distributed

    results = run_distributed(_worker, 2, timeout=1800)
    counts = run_distributed(_count_worker, 4, timeout=900)
    for rank_counts in counts:
        for count in rank_counts.values():
            del count["report"], count["stages"]  # the sharding report is the tests' subject, not the bench's
    lines = [
        f"# Pipeline bubble: 2 gloo ranks (P = 2), {SAMPLES} samples per step, width {WIDTH}, median of {STEPS} steps"
        + (" (--quick smoke run: not a measurement)" if QUICK else ""),
        "",
        "Idle = 1 - compute / step = wait + post + rest: *wait* inside the waits on sends / receives (the bubble, and the transfer),"
        " *post* posting them, *rest* the schedule's own Python (loss, chunking, bookkeeping). AG / RS per unit: one step's"
        " all-gathers / reduce-scatters per FSDP unit under PP 2 x FSDP 2 (4 ranks), stage 0 | stage 1.",
        "",
        "| schedule | step s | ms per chunk | rank 0 idle (wait + post + rest) | rank 1 idle (wait + post + rest) | ideal (P-1)/(VM+P-1) |"
        " AG / RS per unit per step | peak chunks alive (rank 0) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in results[0]:
        s0, s1 = results[0][name], results[1][name]
        c0, c2 = counts[0][name], counts[2][name]  # ranks 0 and 2: pipeline ranks 0 and 1 of data-parallel rank 0
        lines.append(
            f"| {name} V={s0['stages_per_rank']} | {max(s0['step_s'], s1['step_s']):.3f} | {s0['ms_per_chunk']:.1f} | "
            f"{_idle(s0)} | {_idle(s1)} | "
            f"{s0['ideal_bubble']:.1%} | {_per_unit(c0)} \\| {_per_unit(c2)} | {s0['peak_microbatches_alive']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if QUICK:
        return 0
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_bubble.md").write_text(text)
    (out / "pipeline_bubble.json").write_text(json.dumps({"stage0": results[0], "stage1": results[1], "collectives_per_rank": counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
