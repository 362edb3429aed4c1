"""``python -m benchmarks.llm`` (``make bench-llm``): compile and activation checkpointing on a Llama, side by side.

A Hugging Face ``LlamaForCausalLM`` (8 blocks, width 512, sequence 512, vocabulary 8192) under
Fabric with ``HSDPFabricStrategy(mesh_shape=[2])`` on 2 gloo ranks, one micro-batch of one
sequence per rank. Configurations, timed in interleaved rounds (each once per round, rebuilt from
scratch, then again), steps after the warm-up only:

* ``eager``: no levers;
* ``compiled``: ``compile=True`` (inductor, each block's forward); its compilation time (the
  warm-up steps' excess over eager's) is reported apart;
* ``ac_full`` / ``ac_selective_op`` / ``ac_every_2``: ``activation_checkpointing`` on every block
  (whole blocks, or matmul/attention outputs kept), or whole blocks on every second one.

Per configuration: the median step time, its ratio to eager, and the peak heap bytes per rank
during the timed steps above the state before them (activations and what the step allocates:
where checkpointing saves). Writes ``benchmarks/results/llm.md`` and ``llm.json``.

    python -m benchmarks.llm            # 2 rounds (about 10 minutes on 2 idle cores, compilation included)
    python -m benchmarks.llm --quick    # a 2-block model, 1 round: a check of the harness
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

WORLD = 2
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "eager": {},
    "compiled": {"compile": True},
    "ac_full": {"activation_checkpointing": ["model.layers.*"]},
    "ac_selective_op": {"activation_checkpointing": ["model.layers.*"], "activation_checkpointing_mode": "selective_op"},
    "ac_every_2": {"activation_checkpointing": ["model.layers.*"], "activation_checkpointing_every": 2},
}


def _config(quick: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=2 if quick else 8,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )


def _worker(quick: bool, rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from transformers import LlamaForCausalLM

    from hp_lightning.core.diagnostics import HeapSampler, release_freed_memory
    from hp_lightning.fabric import HSDPStrategy

    torch.set_num_threads(1)
    sequence = 128 if quick else 512
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (1, sequence), generator=generator)
    out: dict[str, Any] = {name: {"step_s": [], "warmup_s": [], "peak_bytes": []} for name in CONFIGURATIONS}
    fabric_of: dict[str, Any] = {}
    for _ in range(rounds):
        for name, options in CONFIGURATIONS.items():
            fabric = fabric_of.get(name)
            if fabric is None:
                fabric = fabric_of[name] = Fabric(accelerator="cpu", devices=WORLD, strategy=HSDPStrategy(mesh_shape=[WORLD], **options))
                fabric.launch()
            torch.manual_seed(0)
            with fabric.init_module(empty_init=True):
                model = LlamaForCausalLM(_config(quick))
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))

            def step(model: Any = model, optimizer: Any = optimizer, fabric: Any = fabric) -> None:
                logits = model(ids).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:])
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

            dist.barrier()
            start = time.perf_counter()
            for _ in range(warmup):
                step()
            dist.barrier()
            out[name]["warmup_s"].append(time.perf_counter() - start)
            release_freed_memory()
            with HeapSampler(rss=False) as heap:
                begin = time.time_ns()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    heap.sample()
                    out[name]["step_s"].append(time.perf_counter() - t0)
                out[name]["peak_bytes"].append(heap.heap_peak(begin, time.time_ns()))
            del model, optimizer
    return out


def main() -> int:
    from benchmarks.load import LoadMonitor, busy_banner, describe_load
    from tests.helpers import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    warmup, steps = (2, 2) if args.quick else (2, 4)
    with LoadMonitor() as monitor:
        results = run_distributed(_worker, WORLD, args.quick, rounds, warmup, steps, timeout=3600, env={"OMP_NUM_THREADS": "1"})
    eager_step = statistics.median(t for r in results for t in r["eager"]["step_s"])
    eager_warmup = statistics.median(t for r in results for t in r["eager"]["warmup_s"])
    lines = [
        f"# Llama ({'2' if args.quick else '8'} blocks, width 512, vocabulary 8192, sequence {128 if args.quick else 512}), "
        f"FSDP {WORLD} on CPU, one sequence per rank; {rounds} interleaved round(s) of {steps} timed steps after {warmup} warm-up",
        "",
        "| configuration | step, s (median) | vs eager | warm-up beyond eager's, s | peak heap during steps, MiB (max over ranks) |",
        "|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {"world": WORLD, "rounds": rounds, "quick": args.quick, "configurations": {}}
    for name in CONFIGURATIONS:
        step = statistics.median(t for r in results for t in r[name]["step_s"])
        warm = statistics.median(t for r in results for t in r[name]["warmup_s"]) - eager_warmup
        peak = max(p for r in results for p in r[name]["peak_bytes"])
        summary["configurations"][name] = {
            "step_s": step, "ratio_to_eager": step / eager_step, "extra_warmup_s": warm, "peak_heap_bytes": peak,
            "rounds": [r[name] for r in results],
        }
        lines.append(f"| {name} | {step:.3f} | {step / eager_step:.2f}x | {warm:+.1f} | {peak / 2**20:.0f} |")
    report = monitor.summary()
    summary["load"] = report
    lines += ["", f"Machine: {os.cpu_count()} cores. {describe_load(report)}", *busy_banner(report)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm.md").write_text(text)
    (args.out / "llm.json").write_text(json.dumps(summary, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
