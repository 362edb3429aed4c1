"""Bytes per optimizer step, per collective and link class, from the simulated rank's real calls.

:func:`control_calls` adds the strategy's own small control collectives, which no fake step runs.
A group is *intra-node* when all its ranks share a node, else *inter-node*.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from hp_lightning.core.diagnostics import CollectiveCall
from hp_lightning.planner.candidates import Candidate, Cluster
from hp_lightning.planner.simulate import RankRun


def control_calls(run: RankRun, candidate: Candidate, cluster: Cluster) -> list[CollectiveCall]:
    """The strategy's own per-step collectives on this rank.

    Without PP the step agreement all-reduce (int32: the preemption signal and two flags per
    parameter the divergence check compares); with PP the loss broadcast over the pipeline group,
    the logged loss all-reduce over the stage's ranks and the step agreement (preemption only).
    """
    world = tuple(range(cluster.world_size))
    if candidate.pp == 1:
        flags = 1 + (2 * run.divergence_slots if run.divergence_check else 0)
        return [CollectiveCall("all_reduce", world, 4 * flags, torch.int32)]
    stride = cluster.world_size // candidate.pp
    pipeline_group = tuple(run.rank % stride + i * stride for i in range(candidate.pp))
    stage_group = tuple(range(run.stage * stride, (run.stage + 1) * stride))
    return [
        CollectiveCall("broadcast", pipeline_group, 4, torch.float32),
        CollectiveCall("all_reduce", stage_group, 4, torch.float32),
        CollectiveCall("all_reduce", world, 4, torch.int32),
    ]


def step_calls(run: RankRun, candidate: Candidate, cluster: Cluster) -> list[CollectiveCall]:
    """Every collective this rank issues in one steady-state optimizer step."""
    return [*run.calls, *control_calls(run, candidate, cluster)]


def link_of(ranks: tuple[int, ...], cluster: Cluster) -> str:
    """``"intra"`` when every rank of the group is on one node, else ``"inter"``."""
    return "intra" if len({cluster.node_of(r) for r in ranks}) <= 1 else "inter"


@dataclass(frozen=True)
class Traffic:
    """Calls and bytes of one collective kind on one link class, per optimizer step."""

    kind: str
    link: str
    calls: int
    bytes: int


def traffic(calls: list[CollectiveCall], cluster: Cluster) -> list[Traffic]:
    """``calls`` summed per (kind, link class), largest first."""
    sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for call in calls:
        entry = sums[(call.kind, link_of(call.ranks, cluster))]
        entry[0] += 1
        entry[1] += call.bytes
    rows = [Traffic(kind, link, n, b) for (kind, link), (n, b) in sums.items()]
    return sorted(rows, key=lambda t: -t.bytes)
