"""A latency-bandwidth (alpha-beta) model of one optimizer step: it ranks candidates; absolute times are as good as the constants.

Per rank: ``compute + optimizer + communication - overlap x min(compute, communication)`` plus the
pipeline bubble. Compute is ``6 x parameters x tokens`` FLOPs over TP (checkpointing adds a forward
of the blocks); a collective over ``n`` ranks costs ``alpha x steps + factor x bytes / beta`` with
ring factors ``(n-1)/n`` (all-gather, reduce-scatter), ``2(n-1)/n`` (all-reduce), 1 (broadcast, send).
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_lightning.core.diagnostics import CollectiveCall
from hp_lightning.planner.candidates import Candidate, Cluster, Workload
from hp_lightning.planner.comms import link_of
from hp_lightning.planner.simulate import RankRun


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part."""

    compute: float
    optimizer: float
    intra: float
    inter: float
    bubble: float
    total: float


def collective_seconds(call: CollectiveCall, cluster: Cluster) -> float:
    """One call's alpha-beta time on its link class."""
    n = max(len(call.ranks), 1)
    link = link_of(call.ranks, cluster)
    beta = cluster.intra_node_bandwidth if link == "intra" else cluster.inter_node_bandwidth
    if call.kind in ("all_gather", "reduce_scatter"):
        return cluster.latency_s * (n - 1) + (n - 1) / n * call.bytes / beta
    if call.kind == "all_reduce":
        return cluster.latency_s * 2 * (n - 1) + 2 * (n - 1) / n * call.bytes / beta
    if call.kind in ("broadcast", "send", "all_to_all"):
        return cluster.latency_s + call.bytes / beta
    return 0.0  # recv: the peer's send


def step_time(run: RankRun, calls: list[CollectiveCall], candidate: Candidate, cluster: Cluster, workload: Workload) -> StepTime:
    """The modelled step time of one simulated rank."""
    flops = 6.0 * run.stage_numel / candidate.tp * run.tokens
    if candidate.activation_checkpointing:
        flops += 2.0 * run.block_numel / candidate.tp * run.tokens
    compute = flops / cluster.device_flops
    state = 2 * run.params_bytes + run.grads_bytes + 2 * run.optimizer_bytes
    optimizer = state / (cluster.host_bandwidth if candidate.cpu_offload else cluster.memory_bandwidth)
    if candidate.cpu_offload:
        optimizer += (run.params_bytes + run.grads_bytes) / cluster.host_bandwidth
    intra = sum(collective_seconds(c, cluster) for c in calls if link_of(c.ranks, cluster) == "intra")
    inter = sum(collective_seconds(c, cluster) for c in calls if link_of(c.ranks, cluster) == "inter")
    bubble = compute * (candidate.pp - 1) / workload.pp_microbatches(candidate.pp) if candidate.pp > 1 else 0.0
    comm = intra + inter
    total = compute + bubble + optimizer + comm - cluster.overlap * min(compute, comm)
    return StepTime(compute, optimizer, intra, inter, bubble, total)
