"""A latency-bandwidth (alpha-beta) model of one optimizer step.

Per rank: ``compute + optimizer + communication - overlap x min(compute, communication)``, plus the
pipeline bubble.

* compute: ``6 x parameters x tokens`` FLOPs (forward 2, backward 4) of this rank's stage, divided
  by TP; activation checkpointing adds one more forward of the blocks (``2 x block parameters x
  tokens``); at ``Cluster.device_flops``;
* optimizer: the step reads and writes parameters, gradients and moments once each, at
  ``Cluster.memory_bandwidth`` (on the host under CPU offload, at ``host_bandwidth``, which also
  carries the shards' copies to and from the device);
* each collective over ``n`` ranks of one link class: ``alpha x steps + factor x bytes / beta`` with
  ring factors ``(n-1)/n`` (all-gather output, reduce-scatter input), ``2(n-1)/n`` (all-reduce),
  1 (broadcast, send); a receive is its peer's send and costs nothing more;
* the bubble of PP: ``(stages - 1) / microbatches`` of the compute.

It ranks candidates; its absolute times are as good as the cluster constants given.
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
