"""``python -m benchmarks.cluster`` (``make bench-cluster``): HSDP against FSDP across a simulated 2-node link.

Builds two network namespaces joined by a shaped veth pair (:mod:`benchmarks.cluster_net`),
launches 2 ranks in each, and inside that one launch times every configuration at every link
speed in interleaved rounds, with the link's byte counters read at every step
(:mod:`benchmarks.cluster_worker`). Then writes ``cluster.md``, ``cluster.json``, plots and
``raw/cluster_ranks.json`` to ``--out`` and prints the target lines (PASS/FAIL), never failing on
a missed target. Needs root and iproute2; without them it says what is missing and exits 2.

Examples::

    sudo python -m benchmarks.cluster                 # the full run (make bench-cluster), < 15 minutes
    sudo python -m benchmarks.cluster --quick         # a tiny model, one speed, two configurations
    python -m benchmarks.cluster --rerender benchmarks/results/raw/cluster_ranks.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from benchmarks import cluster_net
from benchmarks.cluster_report import render, target_lines
from benchmarks.cluster_settings import CLUSTER, CLUSTER_SMOKE, ClusterSettings, settings_from_dict, settings_to_dict
from benchmarks.cluster_worker import rank_main
from benchmarks.load import LoadMonitor
from benchmarks.run import describe_machine

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
RAW_FILE = "cluster_ranks.json"


def run(settings: ClusterSettings, out_dir: Path, note: str = "") -> dict[str, Any]:
    """Build the cluster, run the launch, remove the cluster, write the results; returns the summary.

    Raises:
        SystemExit: (2) when root or iproute2 is missing (nothing runs).
        RuntimeError: when a rank fails or the launch passes ``settings.launch_timeout_s``
            (the namespaces are removed all the same).
    """
    started = time.monotonic()
    # Ranks read it when torch loads (so it must be in the environment they are spawned with):
    # c10d's "hostname of the client socket cannot be retrieved" (no reverse DNS for 127.18.0.x
    # inside the namespaces) is noise. Restored afterwards.
    log_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = log_level or "ERROR"
    try:
        return _run(settings, out_dir, note, started)
    finally:
        if log_level is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _run(settings: ClusterSettings, out_dir: Path, note: str, started: float) -> dict[str, Any]:
    from tests.helpers import run_distributed

    with LoadMonitor() as load:
        with cluster_net.simulated_cluster(settings.nodes) as net:
            print(f"cluster: {settings.nodes} namespaces ({', '.join(net.namespace(n) for n in range(net.nodes))}), "
                  f"{settings.ranks_per_node} ranks each, link {net.interface(0)} <-> {net.interface(1)} "
                  f"({net.address(0)} <-> {net.address(1)}); netem {'available' if net.netem else 'absent: latency not modelled'}",
                  flush=True)
            print(f"{len(settings.configurations())} configurations x {len(settings.speeds)} speeds x up to "
                  f"{settings.rounds} rounds ...", flush=True)
            before = {child.pid for child in multiprocessing.active_children()}
            try:
                ranks = run_distributed(
                    rank_main, settings.world_size, settings, net, timeout=settings.launch_timeout_s,
                    local_world_size=settings.ranks_per_node, env={"MASTER_ADDR": net.master_addr},
                )
            except BaseException:
                # Interrupted (a signal, Ctrl-C): end the ranks this launch started, by pid, at once;
                # ranks not yet inside a namespace would otherwise finish importing first.
                for child in multiprocessing.active_children():
                    if child.pid not in before:
                        child.kill()
                raise
            owner = net.owner_pid
    leftovers = cluster_net.leftover_namespaces(owner)
    elapsed = time.monotonic() - started
    machine = describe_machine("cpu", load.summary(), note)
    machine["benchmark wall time"] = f"{elapsed / 60:.1f} min"
    network = {"netem": net.netem, "namespaces": [net.namespace(n) for n in range(net.nodes)],
               "interfaces": [net.interface(n) for n in range(net.nodes)],
               "addresses": [net.address(n) for n in range(net.nodes)], "leftover_namespaces": leftovers}
    return write(ranks, settings, machine, network, elapsed, out_dir)


def write(ranks: list[dict[str, Any]], settings: ClusterSettings, machine: dict[str, Any], network: dict[str, Any],
          elapsed: float, out_dir: Path) -> dict[str, Any]:
    """Summarize and write cluster.md, cluster.json, the plots and the raw per-rank data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = render(ranks, settings, machine, network, elapsed, out_dir)
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(exist_ok=True)
    raw = {"settings": settings_to_dict(settings), "machine": machine, "network": network, "elapsed_s": elapsed, "ranks": ranks}
    (raw_dir / RAW_FILE).write_text(json.dumps(raw, default=str))
    return summary


def rerender(raw_json: Path, out_dir: Path) -> dict[str, Any]:
    """Rebuild tables, JSON summary and plots from saved per-rank measurements, measuring nothing."""
    saved = json.loads(raw_json.read_text())
    return write(saved["ranks"], settings_from_dict(saved["settings"]), saved["machine"], saved["network"],
                 saved["elapsed_s"], out_dir)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one speed, two configurations, one round")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (upper bound: the time budget may stop earlier)")
    parser.add_argument("--budget", type=float, help="seconds after which no new round starts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--note", default="", help="a line about the conditions, written under Machine")
    parser.add_argument("--rerender", type=Path, metavar="RAW_JSON",
                        help=f"only rebuild cluster.md, cluster.json and plots from a saved <out>/raw/{RAW_FILE}")
    args = parser.parse_args(argv)
    if args.rerender:
        summary = rerender(args.rerender, args.out)
        print("\n".join(target_lines(summary["targets"])))
        return 0
    missing = cluster_net.missing_requirements()
    if missing:
        print("bench-cluster: cannot build the simulated cluster; missing: " + "; ".join(missing) + ".\n"
              "Run it as root on Linux with iproute2 (`sudo make bench-cluster`). Nothing was run.", file=sys.stderr)
        return 2
    settings = CLUSTER_SMOKE if args.quick else CLUSTER
    overrides = {"rounds": args.rounds, "time_budget_s": args.budget}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    summary = run(settings, args.out, note=args.note)
    print()
    for line in summary["lines"]:
        print(line)
    print()
    for line in target_lines(summary["targets"]):
        print(line)
    if summary["busy"]:
        print(f"\nBUSY MACHINE: {summary['machine']['load']}")
    print(f"\nwrote {args.out / 'cluster.md'} (+ cluster.json, plots, raw/{RAW_FILE}) in {summary['elapsed_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
