"""Turning the ranks' raw measurements into figures, ratios, targets, tables and plots.

Conventions:

* A step's time is the slowest rank's (ranks wait for each other in collectives anyway); a
  configuration's step time is the median over every timed step of every round.
* Ratios to the raw FSDP2 loop divide medians over the same interleaved rounds, so slow drift of
  the machine weighs on both alike. Each round's own ratio is kept too (``round_step_ratios``),
  showing how far a single round strays.
* Memory per rank is the worst rank's; collectives are rank 0's, per optimizer step. "Bytes
  moved" is each call's payload: the gathered output of an all-gather, the input of a
  reduce-scatter, the tensor of an all-reduce or broadcast.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional

from benchmarks.load import busy_banner
from benchmarks.settings import (
    DDP,
    FAMILY_LABELS,
    HP,
    MAX_STATE_RATIO_TO_FORMULA,
    MAX_STEP_RATIO_TO_RAW,
    MIN_ACCUMULATION_SPEEDUP_OVER_MPS,
    MPS,
    RAW,
    Configuration,
    Settings,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
#: Bytes per parameter of fp32 training with AdamW: parameter, gradient, two moments.
STATE_BYTES_PER_PARAM = 16
PARAM_BYTES = 4


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(int(round(q * (len(ordered) - 1))), len(ordered) - 1)
    return ordered[index]


def _config_from_name(configs: Sequence[Configuration], name: str) -> Configuration:
    return next(c for c in configs if c.name == name)


def slowest_rank_steps(ranks: Sequence[dict[str, Any]], name: str) -> list[list[float]]:
    """Per round, each timed step's time on the slowest rank."""
    rounds = len(ranks[0]["times"][name])
    return [[max(step) for step in zip(*(r["times"][name][i] for r in ranks))] for i in range(rounds)]


def summarize_world(ranks: Sequence[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """Figures and ratios of every configuration timed at one world size."""
    world = ranks[0]["world_size"]
    configs = settings.configurations(world)
    tokens_per_step = settings.global_batch * settings.model.block_size
    rows: dict[str, dict[str, Any]] = {}
    round_medians: dict[str, list[float]] = {}
    for config in configs:
        rounds = slowest_rank_steps(ranks, config.name)
        pooled = [t for r in rounds for t in r]
        round_medians[config.name] = [_median(r) for r in rounds]
        measured = [r["measured"][config.name] for r in ranks]
        collectives = measured[0]["collectives"]
        step = _median(pooled)
        rows[config.name] = {
            "config": asdict(config),
            "name": config.name,
            "family": config.family,
            "sharding": config.sharding,
            "accumulate": config.accumulate,
            "reference": config.reference().name,
            "step_s": step,
            "step_p25_s": _quantile(pooled, 0.25),
            "step_p75_s": _quantile(pooled, 0.75),
            "samples": len(pooled),
            "tokens_per_s": tokens_per_step / step,
            "peak_bytes": max(m["peak_bytes"] for m in measured),
            "rss_peak_bytes": max(m["rss_peak"] for m in measured),
            "rss_delta_bytes": max(m["rss_peak"] - m["rss_before"] for m in measured),
            "state_bytes": max(m["state"]["total"] for m in measured),
            "collective_calls": collectives["calls"],
            "collective_bytes": collectives["bytes"],
            "collectives_by_kind": {k[: -len("_calls")]: v for k, v in collectives.items() if k.endswith("_calls")},
        }
    for row in rows.values():
        ref = rows[row["reference"]]
        step_ratio = row["step_s"] / ref["step_s"]
        row["ratios"] = {
            "step": step_ratio,
            "tokens_per_s": 1.0 / step_ratio,
            "peak": row["peak_bytes"] / ref["peak_bytes"],
            "rss_delta": row["rss_delta_bytes"] / max(ref["rss_delta_bytes"], 1),
            "state": row["state_bytes"] / ref["state_bytes"],
            "collective_calls": row["collective_calls"] / max(ref["collective_calls"], 1e-9),
            "collective_bytes": row["collective_bytes"] / max(ref["collective_bytes"], 1e-9),
        }
        # Per-round ratios (each round's median over its reference's): how much the ratio moved.
        row["round_step_ratios"] = [a / b for a, b in zip(round_medians[row["name"]], round_medians[row["reference"]])]
    return {"world_size": world, "rows": rows, "round_medians": round_medians}


# ---------------------------------------------------------------------------- memory sweep


def formula_bytes(params: int, largest_unit_bytes: int, shard_size: int) -> int:
    """(params + grads + AdamW state) / S + the largest unit's unsharded parameters (fp32)."""
    return STATE_BYTES_PER_PARAM * params // shard_size + largest_unit_bytes


def summarize_sweep(launches: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (world size, model, configuration) of the memory sweep, worst rank."""
    rows = []
    for ranks in launches:
        world = ranks[0]["world_size"]
        for i, entry in enumerate(ranks[0]["sweep"]):
            per_rank = [r["sweep"][i] for r in ranks]
            mesh = tuple(entry["mesh_shape"])
            shard = 1 if entry["family"] == DDP else mesh[-1]
            row = {
                "world_size": world,
                "shape": entry["shape"],
                "config": entry["config"],
                "family": entry["family"],
                "sharding": entry["sharding"],
                "shard_size": shard,
                "params": entry["params"],
                "largest_unit_bytes": entry["largest_unit_bytes"],
                "resident_bytes": max(p["state"]["total"] for p in per_rank),
                "step_peak_bytes": max(p["peak_bytes"] for p in per_rank),
                "forward_peak_bytes": max((p["forward_peak"] or 0) for p in per_rank),
            }
            unit = 0 if entry["family"] == DDP else entry["largest_unit_bytes"]
            row["formula_bytes"] = formula_bytes(entry["params"], unit, shard)
            row["resident_to_formula"] = row["resident_bytes"] / row["formula_bytes"]
            row["peak_to_formula"] = row["step_peak_bytes"] / row["formula_bytes"]
            rows.append(row)
    by_key = {(r["world_size"], r["shape"], r["sharding"], r["family"]): r for r in rows}
    for row in rows:
        raw = by_key.get((row["world_size"], row["shape"], row["sharding"], RAW))
        row["peak_to_raw"] = row["step_peak_bytes"] / raw["step_peak_bytes"] if raw else None
    return rows


def _linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept)."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else mean_y / mean_x
    return slope, mean_y - slope * mean_x


def budget_table(sweep: Sequence[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """The largest model that fits ``settings.budget_gib`` per rank, measured and by formula.

    Measured: per (world, configuration), per-rank bytes of the sweep's models fitted as
    ``a * params + b``; the budget then gives the largest ``params`` (same architecture family,
    model state only: no activations). Formula: ``16 N / S + unit share * 4 N`` with the unit
    share (largest unit / whole model) of the sweep's largest model.
    """
    budget = settings.budget_gib * GiB
    measured = []
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for row in sweep:
        if row["family"] == RAW:
            continue
        groups.setdefault((row["world_size"], row["sharding"], row["family"]), []).append(row)
    for (world, sharding, family), rows in sorted(groups.items()):
        params = [r["params"] for r in rows]
        entry = {"world_size": world, "sharding": sharding, "family": family}
        for key in ("resident_bytes", "step_peak_bytes"):
            slope, intercept = _linear_fit(params, [r[key] for r in rows])
            entry[f"{key}_per_param"] = slope
            entry[f"max_params_{key}"] = (budget - intercept) / slope if slope > 0 else None
        measured.append(entry)
    largest = max(sweep, key=lambda r: r["params"]) if sweep else None
    unit_share = largest["largest_unit_bytes"] / (PARAM_BYTES * largest["params"]) if largest else 0.0
    formula = []
    for world in settings.formula_world_sizes:
        row = {"world_size": world, "DDP": budget / STATE_BYTES_PER_PARAM,
               "FSDP": budget / (STATE_BYTES_PER_PARAM / world + PARAM_BYTES * unit_share)}
        s = settings.hsdp_shard_size
        row[f"HSDP (S={s})"] = budget / (STATE_BYTES_PER_PARAM / s + PARAM_BYTES * unit_share) if world >= 2 * s and world % s == 0 else None
        formula.append(row)
    return {"budget_gib": settings.budget_gib, "unit_share": unit_share, "measured": measured, "formula": formula}


# ---------------------------------------------------------------------------- targets


def _verdict(value: Optional[float], limit: float) -> str:
    if value is None:
        return "N/A"
    return "PASS" if value <= limit else "FAIL"


def evaluate_targets(worlds: dict[int, dict[str, Any]], sweep: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets as (name, value, limit, verdict, how far) records."""
    targets: list[dict[str, Any]] = []

    def add(name: str, value: Optional[float], limit: float, unit: str = "x") -> None:
        verdict = _verdict(value, limit)
        margin = None if value is None else (value / limit - 1.0) * 100.0
        targets.append({"name": name, "value": value, "limit": limit, "verdict": verdict, "margin_pct": margin, "unit": unit})

    def row(world: int, family: str, mesh: tuple[int, ...], k: int) -> Optional[dict[str, Any]]:
        if world not in worlds:
            return None
        return worlds[world]["rows"].get(Configuration(family, mesh, k).name)

    for mesh in ((4,), (2, 2)):
        for k in (1, 4):
            hp = row(4, HP, mesh, k)
            label = "FSDP 4" if len(mesh) == 1 else "HSDP 2x2"
            add(f"world 4, {label}, k={k}: hp_lightning step / raw FSDP2 loop step <= {MAX_STEP_RATIO_TO_RAW}",
                hp["ratios"]["step"] if hp else None, MAX_STEP_RATIO_TO_RAW)
    for world in sorted(worlds):
        hp1, mps1 = row(world, HP, (world,), 1), row(world, MPS, (world,), 1)
        add(f"world {world}, k=1: hp_lightning step / ModelParallelStrategy step <= 1.00",
            _step_ratio(hp1, mps1), 1.0)
        hp4, mps4 = row(world, HP, (world,), 4), row(world, MPS, (world,), 4)
        limit = 1.0 / MIN_ACCUMULATION_SPEEDUP_OVER_MPS
        add(f"world {world}, k=4: hp_lightning step / ModelParallelStrategy step <= {limit:.3f} (>= {MIN_ACCUMULATION_SPEEDUP_OVER_MPS:.2f}x faster)",
            _step_ratio(hp4, mps4), limit)
    sharded = [r for r in sweep if r["family"] == HP]
    if sharded:
        worst_resident = max(sharded, key=lambda r: r["resident_to_formula"])
        add(f"memory sweep, resident params+grads+optimizer state per rank <= {MAX_STATE_RATIO_TO_FORMULA} x formula "
            f"(worst: {worst_resident['shape']}, {worst_resident['sharding']}, world {worst_resident['world_size']})",
            worst_resident["resident_to_formula"], MAX_STATE_RATIO_TO_FORMULA)
        worst_peak = max(sharded, key=lambda r: r["peak_to_formula"])
        add(f"memory sweep, peak memory of a step (activations ~0) per rank <= {MAX_STATE_RATIO_TO_FORMULA} x formula "
            f"(worst: {worst_peak['shape']}, {worst_peak['sharding']}, world {worst_peak['world_size']})",
            worst_peak["peak_to_formula"], MAX_STATE_RATIO_TO_FORMULA)
    return targets


def _step_ratio(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]]) -> Optional[float]:
    if a is None or b is None:
        return None
    return a["step_s"] / b["step_s"]


def target_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for t in targets:
        if t["value"] is None:
            lines.append(f"{t['verdict']}: {t['name']} (not measured in this run)")
        else:
            lines.append(f"{t['verdict']}: {t['name']}: measured {t['value']:.3f} ({t['margin_pct']:+.1f}% vs limit)")
    return lines


# ---------------------------------------------------------------------------- markdown


def _mib(value: float) -> str:
    return f"{value / MiB:.2f}"


def _x(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.3f}"


def markdown(summary: dict[str, Any]) -> str:
    """The results page: machine, settings, per-world tables, targets, sweep, budget, plots."""
    settings = summary["settings"]
    machine = summary["machine"]
    out = ["# hp_lightning benchmarks", ""]
    out += busy_banner(machine.get("_load", {}))
    out += ["Generated by `python -m benchmarks.run` (`make bench`). Every number below was measured in this run.", ""]
    out += ["## Machine", ""]
    for key, value in machine.items():
        if not key.startswith("_"):
            out.append(f"- **{key}**: {value}")
    out += ["", "## What runs", ""]
    model = settings["model"]
    out += [
        f"- Model: `examples.gpt.GPT`, {model['n_layer']} layers, width {model['n_embd']}, {model['n_head']} heads, "
        f"{model['block_size']}-token sequences, {summary['model_params'] / 1e6:.2f} M parameters, fp32, AdamW.",
        f"- Global batch: {settings['global_batch']} sequences ({settings['global_batch'] * model['block_size']} tokens) "
        f"per optimizer step under every configuration and world size; with `accumulate_grad_batches=k` each rank runs "
        f"k micro-batches of global_batch / (world x k).",
        f"- Rounds: {settings['rounds']} interleaved rounds (every configuration once per round, in the same order), "
        f"each building the configuration afresh and timing {settings['timed_steps']} optimizer steps after "
        f"{settings['warmup_steps']} warm-up steps.",
        "- Configurations: " + "; ".join(f"**{k}** = {v}" for k, v in FAMILY_LABELS.items()) + ". "
        "The sharded ones share one plan (each block a unit, root kept gathered after forward, one unit of prefetch).",
        "- Memory and collectives come from a separate, untimed pass per configuration "
        f"({settings['measure_steps']} steps, the first not counted). **Peak MiB/rank**: on the CPU, the bytes malloc "
        "has handed out (glibc `mallinfo2`, every thread; CPU tensors live there) above what the process held before "
        "the configuration was built, sampled every 0.5 ms and at every phase of a step: model, optimizer state, "
        "activations and communication buffers (plus a near-constant share of Python objects); on CUDA/NPU the "
        "allocator's peak. **RSS Δ**: peak RSS minus the RSS before the configuration was built. Collectives counted "
        "at the `torch.distributed` call (`hp_lightning.core.diagnostics.CollectiveCounter`; DDP's C++ all-reduces "
        "routed through the default Python comm hook for this pass).",
        "- Ratios are to the raw FSDP2 loop on the same mesh and k (HSDP rows: the raw loop on the same 2-D mesh): "
        "median over median, both over the same interleaved rounds. **range over rounds** is the lowest and highest "
        "of the per-round ratios (each round's median over its reference's), a measure of how noisy the machine was.",
        "",
    ]
    out += ["## Targets", "", "```"] + target_lines(summary["targets"]) + ["```", ""]
    for world in sorted(summary["worlds"], key=int):
        data = summary["worlds"][world]
        out += [f"## World size {world}", ""]
        if int(world) > machine.get("_cores", 1 << 30):
            out += [f"_{world} ranks on {machine['_cores']} cores: oversubscribed, ranks time-share cores; "
                    "absolute times are slower and noisier than on a machine with a core per rank._", ""]
        header = ("| configuration | k | step ms, median [p25–p75] | × raw | range over rounds | tokens/s | × raw "
                  "| peak MiB/rank | × raw | RSS Δ MiB/rank | × raw | collectives/step | × raw | MiB moved/step | × raw |")
        out += [header, "|" + "---|" * 15]
        for row in data["rows"].values():
            r = row["ratios"]
            out.append(
                f"| {FAMILY_LABELS[row['family']]} ({row['sharding']}) | {row['accumulate']} | "
                f"{row['step_s'] * 1e3:.1f} [{row['step_p25_s'] * 1e3:.1f}–{row['step_p75_s'] * 1e3:.1f}] | {_x(r['step'])} | "
                f"{min(row['round_step_ratios']):.2f}–{max(row['round_step_ratios']):.2f} | "
                f"{row['tokens_per_s']:.0f} | {_x(r['tokens_per_s'])} | {_mib(row['peak_bytes'])} | {_x(r['peak'])} | "
                f"{_mib(row['rss_delta_bytes'])} | {_x(r['rss_delta'])} | {row['collective_calls']:.1f} | {_x(r['collective_calls'])} | "
                f"{_mib(row['collective_bytes'])} | {_x(r['collective_bytes'])} |"
            )
        out += ["", "Collectives per optimizer step by kind (rank 0):", ""]
        out += ["| configuration | k | " + " | ".join(("all_gather", "reduce_scatter", "all_reduce", "broadcast")) + " |", "|---|---|---|---|---|---|"]
        for row in data["rows"].values():
            kinds = row["collectives_by_kind"]
            out.append(f"| {FAMILY_LABELS[row['family']]} ({row['sharding']}) | {row['accumulate']} | " + " | ".join(
                f"{kinds.get(k, 0):.1f}" for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")) + " |")
        out += [""]
    out += ["## Model-state memory per rank (sweep)", ""]
    out += [
        "Each model trained 2 steps on one 8-token sequence per rank (activations negligible). "
        "**resident** = parameters + gradients + AdamW state this rank holds after the step, read from the tensors "
        "(local shards). **step peak** = the most bytes in use at once during the second step (heap above the "
        "process's before the model was built, as in the tables above): "
        "resident state plus gathered units, unsharded gradients, communication and optimizer scratch buffers. "
        "**formula** = 16 B x params / S + the largest unit's unsharded parameters (4 B each); DDP: 16 B x params.",
        "",
        "| world | model | params | configuration | resident MiB | step peak MiB | formula MiB | resident / formula | peak / formula | peak × raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["sweep"]:
        out.append(
            f"| {row['world_size']} | {row['shape']} | {row['params'] / 1e6:.2f} M | {FAMILY_LABELS[row['family']]} ({row['sharding']}) | "
            f"{_mib(row['resident_bytes'])} | {_mib(row['step_peak_bytes'])} | {_mib(row['formula_bytes'])} | "
            f"{row['resident_to_formula']:.3f} | {row['peak_to_formula']:.3f} | {_x(row['peak_to_raw'])} |"
        )
    budget = summary["budget"]
    out += ["", f"## Largest model that fits {budget['budget_gib']:g} GiB per rank (model state only, no activations)", ""]
    out += ["**Measured** (linear fit of the sweep's per-rank bytes against parameter count, same architecture family):", ""]
    out += ["| world | configuration | resident B/param/rank | → max params | step-peak B/param/rank | → max params |", "|---|---|---|---|---|---|"]
    for m in budget["measured"]:
        out.append(
            f"| {m['world_size']} | {FAMILY_LABELS[m['family']]} ({m['sharding']}) | {m['resident_bytes_per_param']:.2f} | "
            f"{_billions(m['max_params_resident_bytes'])} | {m['step_peak_bytes_per_param']:.2f} | {_billions(m['max_params_step_peak_bytes'])} |"
        )
    out += ["", f"**Formula** (16 B/param of state divided by S, plus the largest unit at {budget['unit_share']:.3f} of the "
            "model's parameters, as in the sweep's largest model; not measured):", ""]
    keys = [k for k in budget["formula"][0] if k != "world_size"]
    out += ["| world | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for row in budget["formula"]:
        out.append(f"| {row['world_size']} | " + " | ".join(_billions(row[k]) for k in keys) + " |")
    out += ["", "## Plots", ""]
    for name, caption in summary["plots"].items():
        out += [f"![{caption}]({name})", ""]
    return "\n".join(out) + "\n"


def _billions(params: Optional[float]) -> str:
    if params is None:
        return "–"
    return f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.0f} M"
