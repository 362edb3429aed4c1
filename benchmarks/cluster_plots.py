"""PNG plots of the simulated cluster's summary (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.cluster_settings import ClusterSettings
from benchmarks.plots import _pyplot
from benchmarks.report import MiB

_SPEED_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


def _short(label: str) -> str:
    return (label.replace("Lightning ", "L-").replace("ModelParallelStrategy", "ModelParallel").replace("raw FSDP2 loop", "raw").replace(", LLM-aware units", ", LLM units")
            .replace("defer_all_reduce", "defer").replace(" (", "\n(").replace(", k=", ",\nk="))


def plot_step_and_link(summary: dict[str, Any], path: Path) -> None:
    """Step time (top) and inter-node bytes per step (bottom) per configuration, one bar per link speed."""
    plt = _pyplot()
    speeds = list(summary["speeds"])
    names = list(summary["speeds"][speeds[0]]["rows"])
    labels = [_short(summary["speeds"][speeds[0]]["rows"][n]["label"]) for n in names]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(9.0, 1.25 * len(names)), 8.0), sharex=True)
    width = 0.8 / len(speeds)
    for j, speed in enumerate(speeds):
        rows = summary["speeds"][speed]["rows"]
        xs = [i + (j - (len(speeds) - 1) / 2) * width for i in range(len(names))]
        steps = [rows[n]["step_s"] for n in names]
        top.bar(xs, steps, width, color=_SPEED_COLORS[j % 4], label=f"link {speed}")
        for x, n in zip(xs, names):  # each round's own median: how noisy the machine was
            rounds = rows[n]["round_medians"]
            top.plot([x] * len(rounds), rounds, "o", color="black", markersize=2.5, alpha=0.6)
        for x, v in zip(xs, steps):
            top.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        link = [rows[n]["link_bytes"] / MiB for n in names]
        bottom.bar(xs, link, width, color=_SPEED_COLORS[j % 4], label=f"link {speed}")
        for x, v in zip(xs, link):
            bottom.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    top.set_ylabel("step time, s (median; dots: rounds)")
    top.set_title("Step time per configuration and link speed (2 nodes x 2 ranks)")
    top.legend(fontsize=8)
    bottom.set_ylabel("MiB per step on the inter-node link")
    bottom.set_xticks(range(len(names)), labels, fontsize=7)
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(summary: dict[str, Any], path: Path) -> None:
    """The bound's three terms stacked, next to the measured peak, per configuration."""
    plt = _pyplot()
    rows = summary["memory"]
    fig, ax = plt.subplots(figsize=(max(9.0, 1.1 * len(rows)), 4.8))
    xs = range(len(rows))
    bottoms = [0.0] * len(rows)
    for key, color, text in (("state_bound", "#1f77b4", "params+grads+AdamW / S"),
                             ("gathered_bound", "#ff7f0e", "gathered units"),
                             ("activations", "#2ca02c", "activations (unsharded forward)")):
        values = [r[key] / MiB for r in rows]
        ax.bar([x - 0.2 for x in xs], values, 0.4, bottom=bottoms, color=color, label=f"bound: {text}")
        bottoms = [b + v for b, v in zip(bottoms, values)]
    peaks = [r["peak"] / MiB for r in rows]
    ax.bar([x + 0.2 for x in xs], peaks, 0.4, color="#7f7f7f", label="measured peak")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["peak"] / MiB, f"{r['peak_to_bound']:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [_short(r["label"]) for r in rows], fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.set_title("Peak memory per rank against the bound")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_cluster_plots(summary: dict[str, Any], settings: ClusterSettings, out_dir: Path) -> dict[str, str]:
    """Write the cluster's plots into ``out_dir``; returns file name -> caption."""
    written = {}
    plot_step_and_link(summary, out_dir / "cluster_step_time_and_link.png")
    written["cluster_step_time_and_link.png"] = "Step time and inter-node bytes per configuration and link speed"
    if summary["memory"]:
        plot_memory(summary, out_dir / "cluster_memory.png")
        written["cluster_memory.png"] = "Peak memory per rank against the bound"
    return written
