"""The pipeline bubble, measured: idle fraction per stage for GPipe and 1F1B (``make bench-pipeline``).

Two gloo ranks, one stage each (``pipeline_parallel_size=2``, no data parallelism), cut from one
residual MLP at its middle block with :func:`hp_lightning.parallel.split_stage` and run with
torch's ``ScheduleGPipe`` / ``Schedule1F1B`` through :class:`hp_lightning.parallel.PipelineRunner`
(what ``HSDPStrategy`` runs per training step). The batch (256 samples) is the same for every
row; it is split into M = 4 or 8 micro-batches.

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

    results: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for microbatches in (4, 8):
            torch.manual_seed(0)
            model = Net()
            split_stage(model, [f"blocks.{DEPTH // 2}"], rank)
            runner = PipelineRunner(
                model, stage_index=rank, num_stages=2, device=torch.device("cpu"), group=dist.group.WORLD,
                schedule=schedule, microbatches=microbatches, loss_fn=lambda out, target: (out - target).pow(2).mean(),
            )
            stage = runner.stage
            busy = [0.0]
            alive, peak = [0], [0]

            def timed(method: Any, counts: int) -> Any:
                def run(*args: Any, **kwargs: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return method(*args, **kwargs)
                    finally:
                        busy[0] += time.perf_counter() - start
                        alive[0] += counts
                        peak[0] = max(peak[0], alive[0])

                return run

            stage.forward_one_chunk = timed(stage.forward_one_chunk, +1)
            stage.backward_one_chunk = timed(stage.backward_one_chunk, -1)
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
                "ideal_bubble": 1 / (microbatches + 1),
                "peak_microbatches_alive": max(peaks),
            }
    dist.destroy_process_group()
    return results


def main() -> int:
    from tests.helpers import run_distributed

    results = run_distributed(_worker, 2, timeout=900)
    lines = [
        f"# Pipeline bubble: 2 stages on 2 gloo ranks, {SAMPLES} samples per step, median of {STEPS} steps",
        "",
        "| schedule | step s | stage 0 idle | stage 1 idle | ideal (P-1)/(M+P-1) | peak micro-batches alive (stage 0) |",
        "|---|---|---|---|---|---|",
    ]
    for name in results[0]:
        s0, s1 = results[0][name], results[1][name]
        lines.append(
            f"| {name} | {max(s0['step_s'], s1['step_s']):.3f} | {s0['idle']:.1%} | {s1['idle']:.1%} | "
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
