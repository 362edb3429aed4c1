"""The ranked table, the reasons, and the winning candidate as a LightningCLI ``strategy:`` block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from hp_lightning.planner.comms import traffic

if TYPE_CHECKING:
    from hp_lightning.planner.api import PlanResult


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f}"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}"


def table(result: PlanResult, limit: int = 20) -> str:
    """The candidates, best first: memory per rank (GiB, or MiB for small models), bytes per step by link class (MiB), step time."""
    peaks = [e.memory.peak for e in result.ranked if e.memory is not None]
    unit, mem = ("GiB", _gib) if max(peaks, default=0) >= 2**30 else ("MiB", _mib)
    head = f"memory per rank in {unit}; communication per optimizer step in MiB; modelled step time in seconds, global tokens/s\n" + (
        f"{'#':>3}  {'candidate':<44} {'params':>7} {'grads':>7} {'optim':>7} {'gather':>7} {'activ':>7} {'peak':>7}  "
        f"{'intra MiB':>10} {'inter MiB':>10} {'step s':>8} {'tokens/s':>10}  verdict"
    )
    lines = [head, "-" * len(head.splitlines()[-1])]
    for i, entry in enumerate(result.ranked[:limit], start=1):
        if entry.error is not None:
            lines.append(f"{i:>3}  {entry.candidate.name:<44} {'':>55}  cannot run: {entry.error}")
            continue
        m, t = entry.memory, entry.time
        assert m is not None and t is not None, "an evaluated candidate without an error has its memory and time"
        lines.append(
            f"{i:>3}  {entry.candidate.name:<44} {mem(m.params):>7} {mem(m.grads):>7} {mem(m.optimizer):>7} "
            f"{mem(m.largest_gather):>7} {mem(m.activations):>7} {mem(m.peak):>7}  {_mib(entry.link_bytes('intra')):>10} "
            f"{_mib(entry.link_bytes('inter')):>10} {t.total:>8.3f} {entry.tokens_per_second:>10,.0f}  {m.reason}"
        )
    if len(result.ranked) > limit:
        lines.append(f"... {len(result.ranked) - limit} more candidate(s)")
    return "\n".join(lines)


def details(entry: Any, cluster: Any) -> str:
    """One candidate in full: per-rank memory, and calls/bytes per collective and link class."""
    if entry.error is not None:
        return f"{entry.candidate.name}: cannot run: {entry.error}"
    m, t = entry.memory, entry.time
    out = [
        f"{entry.candidate.name}  (worst simulated rank {entry.worst.rank}, pipeline stage {entry.worst.stage})",
        f"  memory per rank: parameters {_gib(m.params)} GiB, gradients {_gib(m.grads)} GiB, optimizer {_gib(m.optimizer)} GiB, "
        f"largest gathered unit {_gib(m.largest_gather)} GiB, activations and transients {_gib(m.activations)} GiB, "
        f"peak {_gib(m.peak)} GiB" + (f", host {_gib(m.host)} GiB (offloaded)" if m.host else ""),
        (
            f"  step: compute {t.compute:.3f} s, optimizer {t.optimizer:.3f} s, intra-node comm {t.intra:.3f} s, "
            f"inter-node comm {t.inter:.3f} s, bubble {t.bubble:.3f} s -> {t.total:.3f} s"
        ),
        "  collectives per step (this rank):",
    ]
    for row in traffic(entry.calls, cluster):
        out.append(f"    {row.kind:<15} {row.link:<6} {row.calls:>5} calls {row.bytes:>16,} bytes")
    return "\n".join(out)


def strategy_yaml(strategy_args: dict[str, Any], *, devices: int, nodes: int) -> str:
    """The LightningCLI ``trainer:`` block (devices, nodes, ``strategy:``) for ``strategy_args``."""
    block = {
        "trainer": {
            "devices": devices,
            "num_nodes": nodes,
            "strategy": {"class_path": "hp_lightning.HSDPStrategy", "init_args": strategy_args},
        }
    }
    return yaml.safe_dump(block, sort_keys=False)
