"""PNG plots of a benchmark summary (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import STATE_BYTES_PER_PARAM, MiB, formula_bytes
from benchmarks.settings import DDP, FAMILY_LABELS, HP, MAX_STEP_RATIO_TO_RAW, RAW


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_step_ratios(summary: dict[str, Any], path: Path) -> None:
    """Step time relative to the raw FSDP2 loop, per configuration, world size and accumulation."""
    plt = _pyplot()
    worlds = sorted(summary["worlds"], key=int)
    ks = sorted({row["accumulate"] for w in worlds for row in summary["worlds"][w]["rows"].values()})
    fig, axes = plt.subplots(len(ks), len(worlds), figsize=(5.5 * len(worlds), 3.6 * len(ks)), squeeze=False)
    for i, k in enumerate(ks):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            rows = [r for r in summary["worlds"][world]["rows"].values() if r["accumulate"] == k]
            labels = [f"{r['family'].replace('lightning_', 'L-')}\n{r['sharding']}" for r in rows]
            values = [r["ratios"]["step"] for r in rows]
            colors = ["#888888" if r["family"] == RAW else "#d62728" if r["family"] == HP else "#1f77b4" for r in rows]
            ax.bar(range(len(rows)), values, color=colors)
            for x, row in enumerate(rows):  # each round's own ratio: how noisy the machine was
                rounds = row.get("round_step_ratios", [])
                ax.plot([x] * len(rounds), rounds, "o", color="black", markersize=2.5, alpha=0.6,
                        label="single rounds" if x == 0 else None)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.axhline(MAX_STEP_RATIO_TO_RAW, color="#d62728", linestyle="--", linewidth=0.8, label=f"target {MAX_STEP_RATIO_TO_RAW}")
            for x, v in enumerate(values):
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(rows)), labels, fontsize=7)
            ax.set_ylabel("step time / raw FSDP2 loop")
            ax.set_title(f"world {world}, accumulate_grad_batches={k}")
            top = max([*values, *(v for row in rows for v in row.get("round_step_ratios", []))])
            ax.set_ylim(0, top * 1.18)
            ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory_vs_world(summary: dict[str, Any], path: Path) -> None:
    """Model-state memory per rank against world size for the sweep's largest model."""
    plt = _pyplot()
    sweep = summary["sweep"]
    largest_shape = max(sweep, key=lambda r: r["params"])["shape"]
    rows = [r for r in sweep if r["shape"] == largest_shape and r["family"] != RAW]
    params = rows[0]["params"]
    unit = rows[0]["largest_unit_bytes"]
    s = summary["settings"]["hsdp_shard_size"]
    worlds = summary["settings"]["formula_world_sizes"]
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    curves = {
        "DDP": (DDP, "#1f77b4", [STATE_BYTES_PER_PARAM * params for _ in worlds], worlds),
        "FSDP": ("FSDP", "#d62728", [formula_bytes(params, unit, w) for w in worlds], worlds),
        f"HSDP (S={s})": ("HSDP", "#2ca02c", [formula_bytes(params, unit, s) for w in worlds if w >= 2 * s],
                          [w for w in worlds if w >= 2 * s]),
    }
    for label, (kind, color, values, xs) in curves.items():
        ax.plot(xs, [v / MiB for v in values], linestyle="--", color=color, linewidth=1, label=f"{label}: formula")
        mine = [r for r in rows if (r["family"] == DDP if kind == DDP else (r["family"] == HP and r["sharding"].startswith(kind)))]
        if mine:
            ax.plot([r["world_size"] for r in mine], [r["resident_bytes"] / MiB for r in mine], "o", color=color,
                    label=f"{label}: measured resident")
            ax.plot([r["world_size"] for r in mine], [r["step_peak_bytes"] / MiB for r in mine], "^", color=color,
                    markerfacecolor="none", label=f"{label}: measured step peak")
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Model-state memory per rank, {largest_shape} ({params / 1e6:.1f} M params, fp32 + AdamW)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series_color(family: str, sharding: str) -> str:
    """One colour per (family, kind of sharding), the same in every panel."""
    if family == DDP:
        return "#1f77b4"
    hsdp = sharding.startswith("HSDP")
    if family == HP:
        return "#2ca02c" if hsdp else "#d62728"
    return "#bcbd22" if hsdp else "#7f7f7f"


def plot_memory_vs_model(summary: dict[str, Any], path: Path) -> None:
    """Per-rank memory against model size at each world size, per configuration."""
    plt = _pyplot()
    sweep = summary["sweep"]
    worlds = sorted({r["world_size"] for r in sweep})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4.2), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        rows = [r for r in sweep if r["world_size"] == world]
        for key in sorted({(r["family"], r["sharding"]) for r in rows}):
            mine = sorted((r for r in rows if (r["family"], r["sharding"]) == key), key=lambda r: r["params"])
            xs = [r["params"] / 1e6 for r in mine]
            label = f"{FAMILY_LABELS[key[0]].split(' + ')[0]} ({key[1]})"
            color = _series_color(*key)
            ax.plot(xs, [r["step_peak_bytes"] / MiB for r in mine], "-^", color=color, label=f"{label} step peak")
            ax.plot(xs, [r["resident_bytes"] / MiB for r in mine], ":o", color=color, label=f"{label} resident")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"world {world}")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {
    "step_time_ratio.png": ("Step time relative to the raw FSDP2 loop", plot_step_ratios),
    "memory_vs_world_size.png": ("Model-state memory per rank against world size", plot_memory_vs_world),
    "memory_vs_model_size.png": ("Per-rank memory against model size", plot_memory_vs_model),
}


def write_plots(summary: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Write every plot into ``out_dir``; returns file name -> caption."""
    written = {}
    for name, (caption, draw) in PLOTS.items():
        draw(summary, out_dir / name)
        written[name] = caption
    return written
