"""``python -m benchmarks.run``: hp_lightning side by side with raw FSDP2 and Lightning's strategies.

One multi-process launch per world size (real ranks on gloo, or nccl/hccl on accelerators);
inside it every configuration is timed in interleaved rounds, then measured once for memory and
collectives, then the memory sweep runs. Writes ``results.md``, ``results.json`` (the summary),
PNG plots and ``raw/ranks.json`` (every rank's measurements) to ``--out`` and prints the target
lines (PASS/FAIL), never failing on a missed target.

Examples::

    python -m benchmarks.run                 # the full run (make bench), CPU unless a GPU/NPU is present
    python -m benchmarks.run --quick         # about a minute: a tiny model, world 2, one round
    python -m benchmarks.run --device cpu --worlds 2 --rounds 2
    python -m benchmarks.run --rerender benchmarks/results/raw/ranks.json   # tables and plots only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

import lightning
import torch

from benchmarks.load import LoadMonitor, describe_load
from benchmarks.plots import write_plots
from benchmarks.report import (
    budget_table,
    evaluate_targets,
    markdown,
    summarize_sweep,
    summarize_world,
    target_lines,
)
from benchmarks.settings import FULL, SMOKE, Settings, settings_from_dict
from benchmarks.trainers import largest_unit_bytes
from benchmarks.worker import rank_main
from hp_lightning.core import devices

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: Seconds one world size's launch may take before it is killed (a hang fails the run, not the machine).
LAUNCH_TIMEOUT_S = 1500
#: Every rank's measurements, under ``<out>/raw/`` (not committed): input of ``--rerender``.
RAW_FILE = "ranks.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return None


def describe_machine(device_type: str, load: Optional[dict[str, Any]], note: str) -> dict[str, Any]:
    """What the results page says about where they were measured.

    ``load`` is :meth:`benchmarks.load.LoadMonitor.summary` of the run: it becomes the ``load``
    line, and a busy run is marked (``_busy``; the report opens with a banner).
    """
    cores = os.cpu_count() or 1
    memory = _memory_gib()
    info: dict[str, Any] = {
        "CPU": f"{_cpu_model()}, {cores} cores visible" + (f", {memory:.0f} GiB RAM" if memory else ""),
        "OS": platform.platform(),
        "Python / torch / lightning": f"{platform.python_version()} / {torch.__version__} / {lightning.__version__}",
        "device": device_type if device_type == devices.CPU else f"{device_type} x {devices.device_count(device_type)}",
        "threads per rank": "1 (torch.set_num_threads(1), OMP_NUM_THREADS=1)",
        "_cores": cores,
    }
    if load is not None:
        info["load"] = describe_load(load) + (" — **busy**: " + "; ".join(load["busy_reasons"]) if load["busy"] else " — quiet")
        info["_load"] = load
        info["_busy"] = load["busy"]
    if note:
        info["note"] = note
    return info


def pick_device(requested: str, world_sizes: tuple[int, ...]) -> str:
    """``auto``: the accelerator when it has a device per rank of the largest world, else the CPU.

    Raises:
        SystemExit: when an explicitly requested device type is absent or too few.
    """
    needed = max(world_sizes)
    if requested == "auto":
        accelerator = devices.current_accelerator_type()
        if devices.is_accelerator(accelerator) and devices.device_count(accelerator) < needed:
            print(f"{devices.device_count(accelerator)} {accelerator} device(s) < {needed} ranks: running on the CPU", flush=True)
            return devices.CPU
        return accelerator
    if devices.is_accelerator(requested) and devices.device_count(requested) < needed:
        raise SystemExit(
            f"--device {requested}: {devices.device_count(requested)} device(s) here, {needed} ranks needed; "
            f"use --device cpu or --worlds with at most that many ranks."
        )
    return requested


def run(settings: Settings, device_type: str, out_dir: Path, note: str = "") -> dict[str, Any]:
    """Run every launch, write the results and return the summary."""
    from tests.helpers import run_distributed

    started = time.monotonic()
    launches = []
    with LoadMonitor() as load:
        for world in settings.world_sizes:
            t0 = time.monotonic()
            print(f"world {world}: {len(settings.configurations(world))} configurations x {settings.rounds} rounds ...", flush=True)
            launches.append(run_distributed(rank_main, world, settings, world, device_type, timeout=LAUNCH_TIMEOUT_S))
            print(f"world {world}: done in {time.monotonic() - t0:.0f} s", flush=True)
    elapsed = time.monotonic() - started
    machine = describe_machine(device_type, load.summary(), note)
    machine["benchmark wall time"] = f"{elapsed / 60:.1f} min"
    return render(launches, settings, machine, elapsed, out_dir)


def render(
    launches: list[list[dict[str, Any]]], settings: Settings, machine: dict[str, Any], elapsed: float, out_dir: Path
) -> dict[str, Any]:
    """Summarize the ranks' measurements; write results.md, results.json and the plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    worlds = {str(ranks[0]["world_size"]): summarize_world(ranks, settings) for ranks in launches}
    sweep = summarize_sweep(launches)
    summary: dict[str, Any] = {
        "settings": asdict(settings),
        "machine": machine,
        "model_params": largest_unit_bytes(settings.model)["params"],
        "elapsed_s": elapsed,
        "busy": bool(machine.get("_busy", False)),
        "worlds": worlds,
        "sweep": sweep,
        "budget": budget_table(sweep, settings),
        "targets": evaluate_targets({int(w): v for w, v in worlds.items()}, sweep),
    }
    summary["plots"] = write_plots(summary, out_dir)
    (out_dir / "results.md").write_text(markdown(summary))
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(exist_ok=True)
    raw = {"settings": summary["settings"], "machine": machine, "elapsed_s": elapsed, "ranks": launches}
    (raw_dir / RAW_FILE).write_text(json.dumps(raw, default=str))
    return summary


def rerender(raw_json: Path, out_dir: Path) -> dict[str, Any]:
    """Rebuild tables, JSON summary and plots from saved per-rank measurements, measuring nothing."""
    saved = json.loads(raw_json.read_text())
    return render(saved["ranks"], settings_from_dict(saved["settings"]), saved["machine"], saved["elapsed_s"], out_dir)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, world 2, one round (about a minute)")
    parser.add_argument("--device", default="auto", choices=["auto", devices.CPU, devices.CUDA, devices.NPU])
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default: 2 4)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--timed-steps", type=int, help="timed optimizer steps per round")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--note", default="", help="a line about the conditions, written under Machine")
    parser.add_argument("--rerender", type=Path, metavar="RAW_JSON",
                        help=f"only rebuild results.md, results.json and plots from a saved <out>/raw/{RAW_FILE} (no measuring)")
    args = parser.parse_args(argv)
    if args.rerender:
        summary = rerender(args.rerender, args.out)
        print("\n".join(target_lines(summary["targets"])))
        print(f"\nwrote {args.out / 'results.md'} from {args.rerender}")
        return 0

    settings = SMOKE if args.quick else FULL
    overrides = {"world_sizes": tuple(args.worlds) if args.worlds else None, "rounds": args.rounds, "timed_steps": args.timed_steps}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    device_type = pick_device(args.device, settings.world_sizes)
    summary = run(settings, device_type, args.out, note=args.note)

    print()
    for world, data in sorted(summary["worlds"].items(), key=lambda kv: int(kv[0])):
        print(f"world {world}:")
        for row in data["rows"].values():
            print(f"  {row['name']:<42} step {row['step_s'] * 1e3:8.1f} ms  x raw {row['ratios']['step']:.3f}  "
                  f"peak {row['peak_bytes'] / 2**20:7.2f} MiB  collectives/step {row['collective_calls']:5.1f}")
    print()
    for line in target_lines(summary["targets"]):
        print(line)
    if summary["busy"]:
        print(f"\nBUSY MACHINE: {summary['machine']['load']}")
    print(f"\nwrote {args.out / 'results.md'} (+ results.json, plots, raw/{RAW_FILE}) in {summary['elapsed_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
