"""The simulated cluster's measurements turned into figures, targets, tables and plots.

Conventions (as :mod:`benchmarks.report`): a step's time is the slowest rank's; a configuration's
time at a speed is the median over every timed step of every round; ratios divide medians over
the same interleaved rounds, and each round's own ratio is kept to show how far one round
strays. Link bytes are node 0's interface counters (received + transmitted, so both directions;
payload plus TCP/IP headers, ACKs and the small store and barrier traffic), per optimizer step,
median over rounds. Collective payloads are rank 0's, from the untimed measurement pass,
split by whether the process group stays inside one node.

Memory at the bound (issue 18, item 4), per rank:

    bound = 16 B x params / S              (fp32 parameters, gradients, AdamW's two moments, sharded S ways)
          + gathered units                 (the root's own parameters when it stays gathered, plus the
                                            largest pair of consecutive units: current + prefetched)
          + activations                    (what the forward pass adds in an unsharded run on the same
                                            micro-batch: saved activations, logits, the loss's intermediates)

measured against the step's peak heap (glibc ``mallinfo2``: every byte malloc handed out, in
every thread, sampled every 0.5 ms; see :class:`benchmarks.measure.MemoryProbe`). The CPU build
of torch keeps no allocator statistics (``torch.cpu`` has no ``max_memory_allocated``), and RSS
counts pages, not bytes, and never shrinks within a step: the heap is the closest CPU
equivalent of CUDA's ``max_memory_allocated``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from benchmarks.cluster_settings import (
    MAX_PEAK_RATIO_TO_BOUND,
    MAX_STEP_RATIO_TO_RAW,
    MIN_HSDP_SPEEDUP_OVER_FSDP,
    TARGET_SPEED,
    ClusterSettings,
)
from benchmarks.load import busy_banner
from benchmarks.report import STATE_BYTES_PER_PARAM, MiB, _quantile, slowest_rank_steps
from benchmarks.settings import BLOCKS_PLAN, DDP, FAMILY_LABELS, HP, LLM_PLAN, RAW, Configuration
from benchmarks.trainers import largest_unit_bytes, plan_units


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def label(config: Configuration) -> str:
    """A table label: family, sharding, accumulation mode, plan."""
    text = f"{FAMILY_LABELS[config.family].split(' + ')[0]} ({config.sharding}"
    if config.accumulate > 1:
        text += f", k={config.accumulate}"
    if config.accumulation_mode != "skip":
        text += f", {config.accumulation_mode}"
    if config.plan == LLM_PLAN:
        text += ", LLM-aware units"
    if config.plan == BLOCKS_PLAN:
        text += ", blocks-only units"
    if config.divergence_check != "per_step":
        text += f", divergence_check={config.divergence_check}"
    return text + ")"


def _config(settings: ClusterSettings, name: str) -> Configuration:
    return next(c for c in settings.measured_configurations() if c.name == name)


def _shard_size(config: Configuration) -> int:
    if config.family == DDP:
        return 1
    return config.mesh_shape[-1]


def _group_kind(ranks: str, per_node: int) -> str:
    members = [int(r) for r in ranks.split(",")]
    return "intra" if len({r // per_node for r in members}) == 1 else "cross"


def summarize_speed(ranks: Sequence[dict[str, Any]], settings: ClusterSettings, speed: str) -> dict[str, Any]:
    """Step times, ratios, link and loopback bytes of every configuration at one link speed."""
    view = [{"times": r["times"][speed]} for r in ranks]
    node0 = next(r for r in ranks if r["rank"] == 0)
    node1 = next((r for r in ranks if r["local0"] and r["node"] == 1), None)
    tokens = settings.global_batch * settings.model.block_size
    rows: dict[str, dict[str, Any]] = {}
    for name in ranks[0]["configs"]:
        config = _config(settings, name)
        rounds = slowest_rank_steps(view, name)
        pooled = [t for r in rounds for t in r]
        link = node0["link"][speed][name]
        step = _median(pooled)
        rows[name] = {
            "name": name,
            "label": label(config),
            "config": asdict(config),
            "reference": config.reference().name,
            "step_s": step,
            "step_p25_s": _quantile(pooled, 0.25),
            "step_p75_s": _quantile(pooled, 0.75),
            "round_medians": [_median(r) for r in rounds],
            "samples": len(pooled),
            "tokens_per_s": tokens / step,
            "link_bytes": _median([b for b, _ in link]),
            "link_bytes_rounds": [b for b, _ in link],
            "loopback_bytes_node0": _median([lo for _, lo in link]),
            "loopback_bytes_node1": _median([lo for _, lo in node1["link"][speed][name]]) if node1 else None,
        }
    for row in rows.values():
        ref = rows.get(row["reference"])
        row["step_ratio"] = row["step_s"] / ref["step_s"] if ref else None
        row["round_step_ratios"] = (
            [a / b for a, b in zip(row["round_medians"], ref["round_medians"])] if ref else []
        )
    return {"speed": speed, "rows": rows}


def collectives(ranks: Sequence[dict[str, Any]], settings: ClusterSettings) -> dict[str, dict[str, float]]:
    """Rank 0's collective payload per step by kind of group (inside a node / across nodes)."""
    node0 = next(r for r in ranks if r["rank"] == 0)
    out = {}
    for name, measured in node0["measured"].items():
        split = {"intra_bytes": 0.0, "cross_bytes": 0.0, "intra_calls": 0.0, "cross_calls": 0.0}
        for group, entry in measured["collectives_by_group"].items():
            kind = _group_kind(group, settings.ranks_per_node)
            split[f"{kind}_bytes"] += entry["bytes"]
            split[f"{kind}_calls"] += entry["calls"]
        split["by_kind"] = {k[: -len("_calls")]: v for k, v in measured["collectives"].items() if k.endswith("_calls")}
        out[name] = split
    return out


def memory_at_bound(ranks: Sequence[dict[str, Any]], settings: ClusterSettings) -> list[dict[str, Any]]:
    """Peak heap per rank against the bound, with the step's phases (see the module docstring)."""
    node0 = next(r for r in ranks if r["rank"] == 0)
    if not node0["measured"] or not node0["activations"]:
        return []
    activations = {a["micro_batch"]: a for a in node0["activations"]}
    params = largest_unit_bytes(settings.model)["params"]
    rows = []
    for name in node0["measured"]:
        config = _config(settings, name)
        per_rank = [r["measured"][name] for r in ranks]
        s = _shard_size(config)
        units = plan_units(settings.model, config.plan)
        act = activations[settings.micro_batch(config.accumulate)]
        state = STATE_BYTES_PER_PARAM * params // s
        gathered = 0 if config.family == DDP else units["gathered_bytes"]
        bound = state + gathered + act["forward"]
        peak = max(m["peak_bytes"] for m in per_rank)
        start = max(m["held_at_step_start"] or 0 for m in per_rank)
        forward = max(m["forward_peak"] or 0 for m in per_rank)
        backward = max(m["forward_backward_peak"] or 0 for m in per_rank)
        resident = max(m["state"]["total"] for m in per_rank)
        row = {
            "name": name, "label": label(config), "family": config.family, "plan": config.plan, "shard_size": s,
            "state_bound": state, "gathered_bound": gathered, "activations": act["forward"],
            "backward_transients": act["backward_extra"], "bound": bound, "peak": peak, "peak_to_bound": peak / bound,
            "held_at_step_start": start, "forward_peak": forward, "backward_peak": backward, "resident_state": resident,
            "root_bytes": 0 if config.family == DDP else units["root_bytes"],
            "largest_unit": max([units["root_bytes"], *(b for _, b in units["units"])]),
            "peak_context": max(per_rank, key=lambda m: m["peak_bytes"]).get("peak_context", {}),
            # What backward holds on top for one unit: its unsharded gradients in the flat reduce-scatter
            # input and the 1/S output (DDP: its gradient buckets, a flat copy of every gradient).
            "backward_staging": 4 * params if config.family == DDP else (
                max([units["root_bytes"], *(b for _, b in units["units"])]) * (s + 1) // s),
            # Within 1 MiB of a phase's peak counts as that phase (the peak is over two steps, the phases over one).
            "peak_phase": "forward" if peak <= forward + MiB else ("backward" if peak <= backward + MiB else "optimizer step"),

        }
        row["extended_bound"] = bound + row["backward_staging"]
        row["peak_to_extended_bound"] = peak / row["extended_bound"]
        rows.append(row)
    return rows


def _unit_name(nbytes: int, settings: ClusterSettings, plan: str) -> str:
    units = plan_units(settings.model, plan)
    if units["root_bytes"] and nbytes == units["root_bytes"]:
        return "the root unit: embeddings + final norm + head"
    names = [name for name, b in units["units"] if b == nbytes]
    if not names:
        return "a unit"
    return "a block" if names[0].startswith("blocks.") else f"the {names[0]} unit"


def rest_items(row: dict[str, Any], settings: ClusterSettings) -> list[tuple[str, int]]:
    """The buffers the bound does not count that are alive at the measured peak, sized for this model.

    Where the peak falls is measured (phase, and the last collective issued before it, whose
    size names the unit); what each buffer holds follows from how FSDP2 / DDP work. Items are
    estimates of size, not separate measurements.
    """
    params = largest_unit_bytes(settings.model)["params"]
    s = row["shard_size"]
    ctx = row["peak_context"]
    items: list[tuple[str, int]] = []
    if row["family"] == DDP:
        items.append(("DDP's gradient buckets: a flat copy of every gradient for the all-reduce (4 B/param)", 4 * params))
        return items
    kind, nbytes = ctx.get("last_collective"), int(ctx.get("last_collective_bytes") or 0)
    unit = _unit_name(nbytes, settings, row["plan"])
    if kind == "reduce_scatter" and nbytes:
        items.append((f"gradients of the unit being reduce-scattered ({unit}), unsharded, in the flat reduce-scatter input",
                      nbytes))
        items.append(("the reduce-scatter's output (1/S of them)", nbytes // s))
    elif kind == "all_gather" and nbytes:
        items.append((f"flat all-gather output of the unit being gathered ({unit}), before the copy into its parameters",
                      nbytes))
    elif kind == "all_reduce" and nbytes:
        items.append(("the all-reduce buffer across replicas (a unit's reduce-scattered gradient shard)", nbytes))
    root = row["root_bytes"]
    head = plan_units(settings.model, "llm_units")["units"][-1][1]
    if root and ctx.get("phase") == "backward" and not (kind == "reduce_scatter" and nbytes == root):
        items.append(("the head's unsharded gradient: in the root unit, reduce-scattered only at the end of backward",
                      head))
    return items


def evaluate_targets(speeds: dict[str, dict[str, Any]], memory: Sequence[dict[str, Any]],
                     settings: ClusterSettings) -> list[dict[str, Any]]:
    """The issue's targets as (name, value, limit, verdict, how far) records; ``sense`` says which side passes."""
    targets: list[dict[str, Any]] = []
    w, hsdp = (settings.world_size,), settings.hsdp_mesh

    def add(name: str, value: Optional[float], limit: float, at_least: bool = False,
            rounds: Sequence[float] = ()) -> None:
        if value is None or value != value:
            verdict, margin = "N/A", None
        else:
            ok = value >= limit if at_least else value <= limit
            verdict = "PASS" if ok else "FAIL"
            margin = (value / limit - 1.0) * 100.0
        targets.append({"name": name, "value": value, "limit": limit, "verdict": verdict, "margin_pct": margin,
                        "at_least": at_least, "rounds": list(rounds)})

    def row(speed: str, config: Configuration) -> Optional[dict[str, Any]]:
        return speeds.get(speed, {}).get("rows", {}).get(config.name)

    for speed in speeds:
        for family in (HP, RAW):
            fsdp, h = row(speed, Configuration(family, w)), row(speed, Configuration(family, hsdp))
            if fsdp and h:
                judged = speed == TARGET_SPEED and family == HP
                add(f"{speed}: {FAMILY_LABELS[family]} HSDP {hsdp[0]}x{hsdp[1]} speed-up over FSDP {w[0]} "
                    f"(FSDP step / HSDP step) >= {MIN_HSDP_SPEEDUP_OVER_FSDP}" + ("" if judged else " (information)"),
                    fsdp["step_s"] / h["step_s"], MIN_HSDP_SPEEDUP_OVER_FSDP, at_least=True,
                    rounds=[a / b for a, b in zip(fsdp["round_medians"], h["round_medians"])])
    for speed in speeds:
        fsdp, h = row(speed, Configuration(HP, w)), row(speed, Configuration(HP, hsdp))
        if fsdp and h:
            add(f"{speed}: inter-node bytes per step, hp_lightning HSDP / FSDP <= 1/S = {1 / hsdp[1]:.3f}",
                h["link_bytes"] / fsdp["link_bytes"], 1 / hsdp[1])
    for speed in speeds:
        off = Configuration(HP, hsdp, 4, "defer_all_reduce", divergence_check="off")
        for config in (Configuration(HP, w), Configuration(HP, hsdp), Configuration(HP, hsdp, 4, "defer_all_reduce"), off):
            r = row(speed, config)
            if r:
                note = " (information: the divergence check's cost is the ratio of the two k=4 rows)" if config == off else ""
                add(f"{speed}: {r['label']} step / raw FSDP2 loop step <= {MAX_STEP_RATIO_TO_RAW}{note}", r["step_ratio"],
                    MAX_STEP_RATIO_TO_RAW, rounds=r["round_step_ratios"])
    for m in memory:
        if m["family"] in (HP, RAW) and m["plan"] != BLOCKS_PLAN:
            add(f"memory: {m['label']} peak per rank / bound <= {MAX_PEAK_RATIO_TO_BOUND}"
                + ("" if m["family"] == HP else " (information: the raw loop, same plan)"), m["peak_to_bound"],
                MAX_PEAK_RATIO_TO_BOUND)
    return targets


def target_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for t in targets:
        if t["value"] is None:
            lines.append(f"{t['verdict']}: {t['name']} (not measured in this run)")
        else:
            spread = f"; single rounds {min(t['rounds']):.2f}-{max(t['rounds']):.2f}" if t.get("rounds") else ""
            lines.append(f"{t['verdict']}: {t['name']}: measured {t['value']:.3f} ({t['margin_pct']:+.1f}% vs limit{spread})")
    return lines


def _mib(value: Optional[float]) -> str:
    return "–" if value is None or value != value else f"{value / MiB:.1f}"


def _x(value: Optional[float], digits: int = 3) -> str:
    return "–" if value is None or value != value else f"{value:.{digits}f}"


def render(ranks: list[dict[str, Any]], settings: ClusterSettings, machine: dict[str, Any], network: dict[str, Any],
           elapsed: float, out_dir: Path) -> dict[str, Any]:
    """Summarize; write cluster.md, cluster.json and the plots; return the summary."""
    from benchmarks.cluster_plots import write_cluster_plots

    speeds = {s.name: summarize_speed(ranks, settings, s.name) for s in settings.speeds}
    comms = collectives(ranks, settings)
    memory = memory_at_bound(ranks, settings)
    node0 = next(r for r in ranks if r["rank"] == 0)
    node1 = next((r for r in ranks if r["local0"] and r["node"] == 1), None)
    summary: dict[str, Any] = {
        "settings": json.loads(json.dumps(asdict(settings))),
        "machine": machine,
        "network": network,
        "busy": bool(machine.get("_busy", False)),
        "elapsed_s": elapsed,
        "params": largest_unit_bytes(settings.model)["params"],
        "rounds_done": node0["rounds_done"],
        "round_seconds": node0["round_seconds"],
        "shaping": {"node 0": node0["shaping"], "node 1": node1["shaping"] if node1 else None},
        "link_check": {"node 0": node0["link_check"], "node 1": node1["link_check"] if node1 else None},
        "speeds": speeds,
        "collectives": comms,
        "memory": memory,
        "memory_rest": {m["name"]: rest_items(m, settings) for m in memory},
        "targets": evaluate_targets(speeds, memory, settings),
    }
    summary["plots"] = write_cluster_plots(summary, settings, out_dir)
    summary["lines"] = console_lines(summary)
    (out_dir / "cluster.md").write_text(markdown(summary, settings))
    (out_dir / "cluster.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def console_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for speed, data in summary["speeds"].items():
        lines.append(f"link {speed}:")
        for row in data["rows"].values():
            lines.append(f"  {row['label']:<58} step {row['step_s'] * 1e3:8.0f} ms  x raw {_x(row['step_ratio'])}  "
                         f"link {_mib(row['link_bytes']):>7} MiB/step")
    return lines


def markdown(summary: dict[str, Any], settings: ClusterSettings) -> str:
    """The results page of the simulated cluster."""
    machine, network = summary["machine"], summary["network"]
    model = settings.model
    w, (r, s) = settings.world_size, settings.hsdp_mesh
    out = ["# hp_lightning on a simulated 2-node cluster", ""]
    out += busy_banner(machine.get("_load", {}))
    out += ["Generated by `python -m benchmarks.cluster` (`make bench-cluster`). Every number below was measured in this run.", ""]
    out += ["## Machine", ""]
    out += [f"- **{k}**: {v}" for k, v in machine.items() if not k.startswith("_")]
    out += ["", "## The simulated cluster", ""]
    speeds = ", ".join(f"**{sp.name}** = {sp.label}" for sp in settings.speeds)
    out += [
        f"- {settings.nodes} nodes = network namespaces {', '.join(f'`{n}`' for n in network['namespaces'])}, "
        f"{settings.ranks_per_node} ranks each ({w} ranks). Ranks of a node talk over the node's loopback; the nodes over "
        f"one veth pair `{network['interfaces'][0]}` ({network['addresses'][0]}) <-> `{network['interfaces'][1]}` "
        f"({network['addresses'][1]}), loopback-range addresses enabled with `route_localnet`. Every rank of node n binds "
        f"gloo to node n's end of the pair (`GLOO_SOCKET_IFNAME`): inside the node that address is local, so intra-node "
        f"traffic stays on the loopback.",
        f"- Link speeds: {speeds}. Shaping on each end's egress: "
        + "; ".join(f"{k}: `{v}`" for k, v in summary["shaping"]["node 0"].items()) + ".",
        "- Latency: " + ("added with netem (one way = half the RTT above)." if network["netem"] else
                         "**not modelled**: this kernel has no `sch_netem` (CONFIG_NET_SCH_NETEM unset); the link's "
                         "latency is the veth's own (microseconds). With the few large collectives per step here "
                         "(tens), 0.2 ms per message would add well under 1 % to steps of seconds."),
        f"- Namespaces left after the run: {network['leftover_namespaces'] or 'none'}.",
        "",
        "**Routing check** (each rank-pair all-reduces "
        f"{settings.link_check_mib} MiB; link bytes = node 0's veth counters, received + transmitted):",
        "",
        "| speed | all-reduce inside each node: link bytes | loopback bytes | all-reduce across nodes: link bytes | seconds | effective Gbit/s per direction |",
        "|---|---|---|---|---|---|",
    ]
    for speed, check in summary["link_check"]["node 0"].items():
        payload = check["payload_bytes"] * check["groups_per_kind"]
        gbit = 8 * check["cross_link_bytes"] / 2 / check["cross_seconds"] / 1e9
        out.append(f"| {speed} | {check['intra_link_bytes']:,} | {check['intra_loopback_bytes']:,} | "
                   f"{check['cross_link_bytes']:,} ({check['cross_link_bytes'] / payload:.2f} x payload) | "
                   f"{check['cross_seconds']:.3f} | {gbit:.2f} |")
    out += ["", f"(barriers alone put {summary['link_check']['node 0'][settings.speeds[0].name]['barrier_link_bytes']:,.0f} "
            "bytes on the link; the payload of one kind is summed over both groups running at once.)", ""]
    out += ["## What runs", ""]
    out += [
        f"- Model: `examples.gpt.GPT`, {model.n_layer} layers, width {model.n_embd}, {model.n_head} heads, vocabulary "
        f"{model.vocab_size}, {model.block_size}-token sequences: {summary['params'] / 1e6:.1f} M parameters "
        f"({plan_units(model, 'blocks')['root_bytes'] / 4 / summary['params'] * 100:.0f} % in the embeddings and head), fp32, AdamW.",
        f"- Global batch {settings.global_batch} sequences ({settings.global_batch * model.block_size} tokens) per "
        f"optimizer step in every configuration (k=4: 4 micro-batches of {settings.micro_batch(4)} per rank).",
        f"- {summary['rounds_done']} interleaved rounds (of up to {settings.rounds}; rounds took "
        f"{', '.join(f'{t:.0f}' for t in summary['round_seconds'])} s); each round runs every speed, and at each speed "
        f"every configuration, built afresh, timing {settings.timed_steps} optimizer steps after {settings.warmup_steps} warm-up.",
        f"- Configurations: DDP (`DDPStrategy`), FSDP over all {w} ranks, HSDP {r}x{s} (shard inside a node, replicate "
        "across nodes), HSDP with `GradientAccumulationSync(\"defer_all_reduce\")` at k=4, Lightning "
        "`ModelParallelStrategy` (FSDP by hand in `configure_model`: each block a unit, the root keeps the rest), each "
        "hp_lightning one also as the raw FSDP2 loop with the plan hp_lightning chooses automatically for this model "
        "(LLM-aware units: embeddings, each block, final norm + head as units, the root holds nothing, the head kept "
        "gathered from forward into backward, one unit of prefetch). **raw FSDP2 (..., blocks-only units)**: the raw "
        "loop with the plan hp_lightning used before (each block a unit, the root keeps embeddings, final norm and head "
        "gathered from forward through backward), for comparison.",
        "",
    ]
    out += ["## Targets", "", "```"] + target_lines(summary["targets"]) + ["```", ""]
    fsdp_name = Configuration(HP, (w,)).name
    for speed, data in summary["speeds"].items():
        sp = next(x for x in settings.speeds if x.name == speed)
        out += [f"## Link {speed} ({sp.label})", ""]
        if w > machine.get("_cores", 1 << 30):
            out += [f"_{w} ranks on {machine['_cores']} cores: oversubscribed; absolute times are slower and noisier than "
                    "on a machine with a core per rank._", ""]
        fsdp_row = data["rows"].get(fsdp_name)
        out += ["| configuration | step ms, median [p25–p75] | × raw loop | range over rounds | tokens/s | "
                "× hp FSDP time | inter-node MiB/step (link counters) | × hp FSDP | loopback MiB/step, node 0 / node 1 | "
                "collective payload MiB/step: inside nodes / across nodes |",
                "|" + "---|" * 10]
        for row in data["rows"].values():
            c = summary["collectives"].get(row["name"], {})
            rr = row["round_step_ratios"]
            out.append(
                f"| {row['label']} | {row['step_s'] * 1e3:.0f} [{row['step_p25_s'] * 1e3:.0f}–{row['step_p75_s'] * 1e3:.0f}] | "
                f"{_x(row['step_ratio'])} | {f'{min(rr):.2f}–{max(rr):.2f}' if rr else '–'} | {row['tokens_per_s']:.0f} | "
                f"{_x(row['step_s'] / fsdp_row['step_s'] if fsdp_row else None)} | {_mib(row['link_bytes'])} | "
                f"{_x(row['link_bytes'] / fsdp_row['link_bytes'] if fsdp_row else None)} | "
                f"{_mib(row['loopback_bytes_node0'])} / {_mib(row['loopback_bytes_node1'])} | "
                f"{_mib(c.get('intra_bytes'))} / {_mib(c.get('cross_bytes'))} |"
            )
        out += [""]
    if summary["collectives"]:
        out += ["## Collectives per optimizer step (rank 0, measurement pass)", ""]
        out += ["| configuration | all-gather | reduce-scatter | all-reduce | broadcast | calls inside a node / across nodes |",
                "|---|---|---|---|---|---|"]
        for name, c in summary["collectives"].items():
            k = c["by_kind"]
            out.append(f"| {label(_config(settings, name))} | " + " | ".join(
                f"{k.get(x, 0):.1f}" for x in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"))
                + f" | {c['intra_calls']:.1f} / {c['cross_calls']:.1f} |")
        out += [""]
    if summary["memory"]:
        out += memory_markdown(summary, settings)
    out += ["## Plots", ""]
    for name, caption in summary["plots"].items():
        out += [f"![{caption}]({name})", ""]
    return "\n".join(out) + "\n"


def memory_markdown(summary: dict[str, Any], settings: ClusterSettings) -> list[str]:
    params = summary["params"]
    out = ["## Memory at the bound (per rank, worst rank)", ""]
    out += [
        f"bound = 16 B x {params / 1e6:.1f} M params / S + gathered units (root's own parameters if it stays gathered + "
        "the largest pair of consecutive units) + activations (forward of the unsharded model on the same micro-batch). "
        "Peak: heap in use (glibc `mallinfo2`, all threads, sampled every 0.5 ms) above the process's before the "
        f"configuration was built, over {'step 2' if settings.measure_steps == 2 else f'steps 2..{settings.measure_steps}'} "
        "(the first creates the optimizer state); phases are the peaks up to the end of forward "
        "and of backward of step 2. **backward staging**: what the bound leaves out and FSDP2 must hold in backward, "
        "the largest unit's unsharded gradients in the flat reduce-scatter input plus the 1/S output (DDP: its "
        "gradient buckets, 4 B/param); the last two columns add it to the bound.",
        "",
        "| configuration | S | state/S MiB | gathered MiB | activations MiB | **bound** MiB | **peak** MiB | peak / bound | "
        "held at step start | forward peak | backward peak | peak in | bound + backward staging MiB | peak / that |",
        "|" + "---|" * 14,
    ]
    for m in summary["memory"]:
        out.append(
            f"| {m['label']} | {m['shard_size']} | {_mib(m['state_bound'])} | {_mib(m['gathered_bound'])} | "
            f"{_mib(m['activations'])} | {_mib(m['bound'])} | {_mib(m['peak'])} | {m['peak_to_bound']:.2f} | "
            f"{_mib(m['held_at_step_start'])} | {_mib(m['forward_peak'])} | {_mib(m['backward_peak'])} | {m['peak_phase']} | "
            f"{_mib(m['extended_bound'])} | {m['peak_to_extended_bound']:.2f} |"
        )
    out += ["", "**Where the rest goes.** For every configuration above its bound: when the peak happened (measured: "
            "the phase, and the last collective issued before it; its size names the unit FSDP2 was working on) and "
            "the buffers alive then that the bound does not count, sized for this model. The remainder is the "
            "excess those buffers do not explain; it is negative where terms of the bound were already freed at that "
            "moment (at the end of backward the activations are gone).", ""]
    out += ["| configuration | peak − bound MiB | peak happened | buffers beyond the bound at that moment | MiB | remainder MiB |",
            "|---|---|---|---|---|---|"]
    for m in summary["memory"]:
        if m["peak"] <= m["bound"]:
            continue
        ctx = m["peak_context"]
        when = ctx.get("phase", "?")
        if ctx.get("last_collective"):
            when += (f", {ctx['ms_after_last_collective']:.0f} ms after the {ctx['last_collective'].replace('_', '-')} of "
                     f"{ctx['last_collective_bytes'] / MiB:.1f} MiB")
        items = summary["memory_rest"][m["name"]]
        excess = m["peak"] - m["bound"]
        text = "<br>".join(t for t, _ in items) or "–"
        sizes = "<br>".join(_mib(b) for _, b in items) or "–"
        out.append(f"| {m['label']} | {_mib(excess)} | {when} | {text} | {sizes} | {_mib(excess - sum(b for _, b in items))} |")
    out += [""]
    return out
