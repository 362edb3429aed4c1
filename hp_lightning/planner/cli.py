"""``python -m hp_lightning plan``: the planner's command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hp_lightning.planner.api import plan, smallest_cluster
from hp_lightning.planner.candidates import GBIT, Cluster, Search, Workload
from hp_lightning.planner.model import ModelBuildError
from hp_lightning.planner.report import details, table
from hp_lightning.planner.validate import run_validation


def _size(text: str) -> float:
    """``80GB``, ``80GiB``, ``8e10`` -> bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "tb": 1e12, "gb": 1e9, "mb": 1e6}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return float(lowered[: -len(suffix)]) * scale
    return float(lowered)


def _rate(text: str) -> float:
    """``100Gbit``, ``25GB/s``, ``1e9`` (bytes/s) -> bytes/s."""
    lowered = text.strip().lower().removesuffix("/s")
    if lowered.endswith("gbit"):
        return float(lowered[:-4]) * GBIT
    if lowered.endswith("mbit"):
        return float(lowered[:-4]) * GBIT / 1000
    return _size(lowered)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hp_lightning plan",
        description="Rank the FSDP/HSDP x TP x PP plans for a model on a cluster, before renting it (see docs/planning.md).",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("model", nargs="?", help="a class path (examples.gpt.GPTLightningModule), a LightningCLI YAML, or a Hugging Face config.json")
    src.add_argument("--init-args", default="{}", help="JSON init args of a class path, e.g. '{\"n_layer\": 12}'")
    src.add_argument("--model-class", help="the model class of a YAML whose model: section has no class_path")
    src.add_argument("--tp-plan", help="JSON TP plan (module glob -> style) for models that ship none")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--devices", type=int, default=8, help="devices per node")
    c.add_argument("--device-memory", type=_size, default=80e9, help="per device, e.g. 80GB (default 80GB)")
    c.add_argument("--intra-node-bandwidth", type=_rate, default=300e9, help="per rank, e.g. 300GB/s (default)")
    c.add_argument("--inter-node-bandwidth", type=_rate, default=25e9, help="per rank, e.g. 200Gbit (default 25GB/s)")
    c.add_argument("--latency", type=float, default=20e-6, help="seconds per message (default 20e-6)")
    c.add_argument("--device-flops", type=float, default=400e12, help="achieved FLOP/s per device (default 4e14)")
    c.add_argument("--memory-bandwidth", type=_rate, default=2e12, help="device memory bytes/s (default 2e12)")
    c.add_argument("--host-bandwidth", type=_rate, default=25e9, help="host<->device bytes/s (default 25GB/s)")
    c.add_argument("--overlap", type=float, default=0.7, help="share of compute/comm overlap, 0..1 (default 0.7)")
    w = p.add_argument_group("batch")
    w.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch and data-parallel rank")
    w.add_argument("--seq-len", type=int, default=2048)
    w.add_argument("--accumulation", type=int, default=1)
    w.add_argument("--precision", default="bf16-mixed", choices=["32", "bf16-mixed", "bf16-true"])
    w.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    w.add_argument("--pipeline-microbatches", type=int)
    s = p.add_argument_group("search")
    s.add_argument("--tp", type=int, nargs="*", help="TP sizes to try (default: all allowed)")
    s.add_argument("--pp", type=int, nargs="*", help="PP sizes to try (default: all allowed)")
    s.add_argument("--no-hsdp", action="store_true", help="FSDP shapes only")
    s.add_argument("--no-offload", action="store_true")
    s.add_argument("--no-ac", action="store_true", help="never checkpoint activations")
    s.add_argument("--keep-gathered", choices=["both", "never", "always"], default="both", help="reshard_after_forward=False: try both, never, always")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=20, help="rows in the table")
    o.add_argument("--yaml", type=Path, help="write the best candidate's trainer/strategy block here")
    o.add_argument("--show", help="print one candidate in full (its table name, e.g. 'HSDP 2x2')")
    o.add_argument("--validate", nargs="?", const="best", help="train the best (or the named) candidate a few steps on CPU ranks and compare")
    o.add_argument("--steps", type=int, default=2, help="--validate: optimizer steps, at least 2 (the last is measured)")
    o.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.model is None:
        parser().error("name the model: a class path, a LightningCLI YAML, or a Hugging Face config.json")
    try:
        cluster = Cluster(
            nodes=args.nodes, devices=args.devices, device_memory=args.device_memory, intra_node_bandwidth=args.intra_node_bandwidth,
            inter_node_bandwidth=args.inter_node_bandwidth, latency_s=args.latency, device_flops=args.device_flops,
            memory_bandwidth=args.memory_bandwidth, host_bandwidth=args.host_bandwidth, overlap=args.overlap,
        )
        workload = Workload(
            micro_batch=args.micro_batch, seq_len=args.seq_len, accumulation=args.accumulation, precision=args.precision,
            optimizer=args.optimizer, pipeline_microbatches=args.pipeline_microbatches,
        )
        keep = {"both": (True, False), "never": (True,), "always": (False,)}[args.keep_gathered]
        search = Search(
            reshard_after_forward=keep, cpu_offload=(False,) if args.no_offload else (False, True),
            activation_checkpointing=(False,) if args.no_ac else (False, True),
            tp_sizes=tuple(args.tp) if args.tp else None, pp_sizes=tuple(args.pp) if args.pp else None, hsdp=not args.no_hsdp,
        )
        init_args: dict[str, Any] = json.loads(args.init_args)
        tp_plan = json.loads(args.tp_plan) if args.tp_plan else None
        result = plan(
            args.model, init_args, cluster=cluster, workload=workload, search=search, tp_plan=tp_plan,
            model_class=args.model_class, progress=not args.no_progress, require_fit=False,
        )
    except (ModelBuildError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{result.spec.label}: {cluster.nodes} node(s) x {cluster.devices} device(s), {cluster.device_memory / 2**30:.0f} GiB each; "
          f"micro-batch {workload.micro_batch} x {workload.seq_len} tokens, accumulation {workload.accumulation}, {workload.precision}")
    print(table(result, args.top))
    for line in result.pruned[:12]:
        print(f"  not searched: {line}")
    if args.show:
        print(details(result.find(args.show), cluster))
    best = result.best
    if best is None:
        print(f"error: {smallest_cluster(result)[0]}", file=sys.stderr)
        return 3
    print()
    print(details(best, cluster))
    block = result.strategy_yaml()
    print("\nLightningCLI block for the best candidate:\n" + block)
    if args.yaml:
        args.yaml.write_text(block)
        print(f"written to {args.yaml}")
    if args.validate:
        entry = best if args.validate == "best" else result.find(args.validate)
        print(run_validation(result, entry, steps=args.steps))
    return 0
