"""The pipeline bubble, measured: idle fraction per stage for every schedule (``make bench-pipeline``).

Two gloo ranks (``pipeline_parallel_size=2``, no data parallelism), cut from one residual MLP
with :func:`hp_lightning.parallel.split_stage`: one stage per rank for GPipe and 1F1B, two per
rank (V = 2, four stages; :func:`~hp_lightning.parallel.pipeline_schedules.stage_view` gives each
its module) for the interleaved, looped and zero-bubble schedules, all run through
:class:`hp_lightning.parallel.PipelineRunner` (what ``HSDPStrategy`` runs per training step).
The batch (256 samples) is the same for every row; it is split into M = 4 or 8 micro-batches.
Busy time counts forward, backward and (zero-bubble) weight-gradient chunks. The ideal shown is
``(P - 1) / (V M + P - 1)``, the interleaved 1F1B bubble (V = 1: GPipe's and 1F1B's); zero-bubble
schedules aim below it.

Per stage and step: *busy* is the time inside the stage's forward and backward of each
micro-batch (its compute), *idle* is ``1 - busy / step time`` (waiting for the other stage, and
the send/receive itself). The ideal bubble of both schedules is ``(P - 1) / (M + P - 1)``: 20 % at
M = 4, 11 % at M = 8 for P = 2. 1F1B has the same bubble as GPipe; what it saves is activation
memory (at most P micro-batches alive instead of M), reported here as the peak number of
micro-batches whose forward has run and whose backward has not.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

STEPS, WARMUP = 6, 2
SAMPLES, WIDTH, DEPTH = 256, 512, 8


def _worker() -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    from hp_lightning.parallel import PipelineRunner, split_stage

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(DEPTH))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x

    from hp_lightning.parallel.pipeline import stage_units, units_by_stage
    from hp_lightning.parallel.pipeline_schedules import stage_view, stages_of_rank

    results: dict[str, Any] = {}
    schedules = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}
    for schedule, per_rank in schedules.items():
        for microbatches in (4, 8):
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
            busy = [0.0]
            alive, peak = [0], [0]

            def timed(method: Any, counts: int, busy: list[float] = busy, alive: list[int] = alive, peak: list[int] = peak) -> Any:
                def run(*args: Any, **kwargs: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return method(*args, **kwargs)
                    finally:
                        busy[0] += time.perf_counter() - start
                        alive[0] += counts
                        peak[0] = max(peak[0], alive[0])

                return run

            for stage in runner.stages:
                stage.forward_one_chunk = timed(stage.forward_one_chunk, +1)
                stage.backward_one_chunk = timed(stage.backward_one_chunk, -1)
                stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, 0)
            x, y = torch.randn(SAMPLES, WIDTH), torch.randn(SAMPLES, WIDTH)
            steps, busies, peaks = [], [], []
            for step in range(WARMUP + STEPS):
                busy[0], alive[0], peak[0] = 0.0, 0, 0
                dist.barrier()
                start = time.perf_counter()
                runner.step(x, y)
                elapsed = time.perf_counter() - start
                if step >= WARMUP:
                    steps.append(elapsed)
                    busies.append(busy[0])
                    peaks.append(peak[0])
            idle = [1 - b / s for b, s in zip(busies, steps)]
            results[f"{schedule} M={microbatches}"] = {
                "step_s": statistics.median(steps),
                "busy_s": statistics.median(busies),
                "idle": statistics.median(idle),
                "ideal_bubble": 1 / (per_rank * microbatches + 1),
                "stages_per_rank": per_rank,
                "peak_microbatches_alive": max(peaks),
            }
    dist.destroy_process_group()
    return results


def main() -> int:
    from tests.helpers import run_distributed

    results = run_distributed(_worker, 2, timeout=900)
    lines = [
        f"# Pipeline bubble: 2 gloo ranks (P = 2), {SAMPLES} samples per step, median of {STEPS} steps",
        "",
        "| schedule | step s | rank 0 idle | rank 1 idle | ideal (P-1)/(VM+P-1) | peak micro-batch chunks alive (rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    for name in results[0]:
        s0, s1 = results[0][name], results[1][name]
        lines.append(
            f"| {name} V={s0['stages_per_rank']} | {max(s0['step_s'], s1['step_s']):.3f} | {s0['idle']:.1%} | {s1['idle']:.1%} | "
            f"{s0['ideal_bubble']:.1%} | {s0['peak_microbatches_alive']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_bubble.md").write_text(text)
    (out / "pipeline_bubble.json").write_text(json.dumps({"stage0": results[0], "stage1": results[1]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
