"""What every rank of the simulated cluster does: enter its node, check the routing, time, measure.

1. Enter the node's network namespace (before any socket exists) and join the process group:
   gloo binds to the node's end of the inter-node link (see :mod:`benchmarks.cluster_net`).
2. **Routing check**, at every link speed: an all-reduce inside each node, then one across
   nodes, with the link's byte counter read before and after each. Intra-node traffic must leave
   the link's counter (almost) unchanged; the cross-node all-reduce must show up on it. The
   cross-node all-reduce is also timed: gloo's effective bandwidth over the shaped link.
3. **Timed rounds**: in every round, every link speed (node-local rank 0 reshapes its end of the
   link, then all ranks meet at a barrier), and at each speed every configuration, built afresh,
   with the link's and the loopback's byte counters read at every step mark. No new round starts
   past the time budget (rank 0 decides, everyone follows).
4. **Measurement pass** at the fastest speed: memory and collectives per configuration (untimed),
   collectives split by process group.
5. **Activations** of the unsharded model (rank 0 alone, no collectives): the bytes its forward
   pass adds on one micro-batch, the activation term of the memory bound.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from benchmarks.cluster_net import ClusterNetwork, enter_node, interface_bytes, shape_link
from benchmarks.cluster_settings import ClusterSettings
from benchmarks.measure import MemoryProbe, StepMarks, release_freed_memory
from benchmarks.settings import ModelShape
from benchmarks.trainers import gpt_config, next_token_loss, rank_loader, run_configuration
from benchmarks.worker import Progress, measure_configuration, quiet, setup_rank
from examples.gpt import GPT, CharWindows, encode, stdlib_corpus

LOOPBACK = "lo"


class LinkCounters:
    """The link's and the loopback's byte counters at every step mark (node-local rank 0 only)."""

    def __init__(self, link: str, active: bool) -> None:
        self.link = link
        self.active = active
        self.samples: list[tuple[int, int]] = []

    def sample(self, _mark: int = 0) -> None:
        if self.active:
            counters = interface_bytes()
            self.samples.append((counters.get(self.link, 0), counters.get(LOOPBACK, 0)))

    def per_step(self, skip: int) -> tuple[float, float]:
        """(link, loopback) bytes per step over the marks after the first ``skip`` steps."""
        if not self.active or len(self.samples) <= skip + 1:
            return (float("nan"), float("nan"))
        first, last = self.samples[skip], self.samples[-1]
        steps = len(self.samples) - 1 - skip
        return ((last[0] - first[0]) / steps, (last[1] - first[1]) / steps)


def _groups(settings: ClusterSettings) -> tuple[Any, Any]:
    """This rank's intra-node group and its cross-node group (same local rank on every node).

    ``new_group`` is collective: every rank creates every group, in the same order.
    """
    rank, per_node = dist.get_rank(), settings.ranks_per_node
    intra = cross = None
    for node in range(settings.nodes):
        group = dist.new_group(list(range(node * per_node, (node + 1) * per_node)))
        if rank // per_node == node:
            intra = group
    for local in range(per_node):
        group = dist.new_group([node * per_node + local for node in range(settings.nodes)])
        if rank % per_node == local:
            cross = group
    return intra, cross


def link_check(net: ClusterNetwork, settings: ClusterSettings, node: int, intra: Any, cross: Any) -> dict[str, Any]:
    """All-reduce inside each node, then across nodes; the link's bytes for each, and the cross-node time.

    Both nodes (and both cross-node pairs) run at once, so the link sees everything of one kind.
    Payload per group: ``link_check_mib`` MiB.
    """
    local0 = dist.get_rank() % settings.ranks_per_node == 0
    tensor = torch.ones(settings.link_check_mib * 2**20 // 4)
    dist.all_reduce(tensor, group=cross)  # connections of the groups exist before counting
    dist.all_reduce(tensor, group=intra)
    out: dict[str, Any] = {"payload_bytes": tensor.numel() * 4, "groups_per_kind": settings.ranks_per_node}
    for kind, group in (("intra", intra), ("cross", cross)):
        dist.barrier()
        before = interface_bytes() if local0 else {}
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        seconds = time.perf_counter() - start
        dist.barrier()
        after = interface_bytes() if local0 else {}
        if local0:
            out[f"{kind}_link_bytes"] = after[net.interface(node)] - before[net.interface(node)]
            out[f"{kind}_loopback_bytes"] = after[LOOPBACK] - before[LOOPBACK]
        out[f"{kind}_seconds"] = seconds
    # The barriers alone: what the check's own synchronization puts on the link.
    before = interface_bytes() if local0 else {}
    dist.barrier()
    dist.barrier()
    after = interface_bytes() if local0 else {}
    if local0:
        out["barrier_link_bytes"] = (after[net.interface(node)] - before[net.interface(node)]) / 2
    return out


def set_speed(net: ClusterNetwork, settings: ClusterSettings, node: int, speed_index: int) -> str:
    """Node-local rank 0 shapes its end of the link; everyone waits until both ends are done."""
    applied = ""
    if dist.get_rank() % settings.ranks_per_node == 0:
        applied = shape_link(net, node, settings.speeds[speed_index])
    dist.barrier()
    return applied


def unsharded_activations(shape: ModelShape, dataset: Dataset, micro_batch: int) -> dict[str, int]:
    """Bytes the forward pass of the unsharded model adds on one micro-batch, and the step's peak above that.

    The model is built, warmed up (one forward and backward, so lazily allocated buffers exist)
    and its gradients dropped; then heap is sampled through one more forward and backward.
    ``forward`` is the peak during forward minus the heap before it: saved activations, logits,
    the loss's intermediates. ``backward_extra`` is the peak during backward minus the heap
    before forward minus the full gradients: what backward's transients add on top.
    """
    torch.manual_seed(0)
    model = GPT(gpt_config(shape))
    model.train()
    inputs = torch.stack([dataset[i][0] for i in range(micro_batch)])
    targets = torch.stack([dataset[i][1] for i in range(micro_batch)])
    next_token_loss(model(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    probe = MemoryProbe(torch.device("cpu"))
    with probe:
        probe.sample()
        t0 = time.time_ns()
        loss = next_token_loss(model(inputs), targets)
        probe.sample()
        t1 = time.time_ns()
        loss.backward()
        probe.sample()
        t2 = time.time_ns()
    base = probe.heap_at(t0)
    out = {
        "micro_batch": micro_batch,
        "forward": probe.heap_peak(t0, t1) - base,
        "backward_extra": max(probe.heap_peak(t1, t2) - base - grads, 0),
        "grads": grads,
    }
    del model, loss
    release_freed_memory()
    return out


def rank_main(settings: ClusterSettings, net: ClusterNetwork) -> dict[str, Any]:
    """Entry point of every rank (started by :func:`tests.helpers.run_distributed` with NODE_RANK set)."""
    node = int(os.environ["NODE_RANK"])
    enter_node(net, node)
    quiet()
    device = setup_rank("cpu")
    rank = dist.get_rank()
    local0 = rank % settings.ranks_per_node == 0
    started = time.monotonic()
    progress = Progress(rank, settings.world_size)
    shape = settings.model
    dataset = CharWindows(encode(stdlib_corpus(settings.corpus_chars)), block_size=shape.block_size, stride=shape.block_size)
    intra, cross = _groups(settings)

    shaping: dict[str, str] = {}
    checks: dict[str, Any] = {}
    for i, speed in enumerate(settings.speeds):
        shaping[speed.name] = set_speed(net, settings, node, i)
        checks[speed.name] = link_check(net, settings, node, intra, cross)
    progress.say("routing check")

    configs = settings.configurations()
    times: dict[str, dict[str, list[list[float]]]] = {s.name: {c.name: [] for c in configs} for s in settings.speeds}
    link: dict[str, dict[str, list[tuple[float, float]]]] = {s.name: {c.name: [] for c in configs} for s in settings.speeds}
    steps = settings.warmup_steps + settings.timed_steps
    rounds_done = 0
    round_seconds: list[float] = []
    for round_index in range(settings.rounds):
        go = torch.tensor([1])
        if rank == 0 and round_seconds:
            elapsed = time.monotonic() - started
            go[0] = int(elapsed + max(round_seconds) <= settings.time_budget_s)
        dist.broadcast(go, src=0)
        if not int(go[0]):
            break
        t_round = time.monotonic()
        for i, speed in enumerate(settings.speeds):
            set_speed(net, settings, node, i)
            for config in configs:
                gc.collect()  # every configuration starts without the previous one's garbage
                counters = LinkCounters(net.interface(node), active=local0)
                marks = StepMarks(device, on_mark=counters.sample)
                loader = rank_loader(dataset, settings.micro_batch(config.accumulate), settings.world_size, rank)
                run_configuration(config, shape, loader, steps, device, marks, num_nodes=settings.nodes)
                times[speed.name][config.name].append(marks.step_times(skip=settings.warmup_steps))
                link[speed.name][config.name].append(counters.per_step(settings.warmup_steps))
        round_seconds.append(time.monotonic() - t_round)
        rounds_done += 1
        progress.say(f"timing round {round_index + 1}/{settings.rounds}")

    measured: dict[str, Any] = {}
    activations: list[dict[str, int]] = []
    if settings.memory_pass:
        set_speed(net, settings, node, max(range(len(settings.speeds)), key=lambda i: settings.speeds[i].rate_mbit))
        for config in settings.measured_configurations():
            gc.collect()
            measured[config.name] = measure_configuration(
                config, shape, dataset, settings.micro_batch(config.accumulate), settings.measure_steps, device,
                num_nodes=settings.nodes,
            )
        progress.say("memory and collectives pass")
        if rank == 0:
            for k in sorted({c.accumulate for c in settings.measured_configurations()}):
                activations.append(unsharded_activations(shape, dataset, settings.micro_batch(k)))
        dist.barrier()
        progress.say("unsharded activations")

    return {
        "rank": rank,
        "node": node,
        "local0": local0,
        "shaping": shaping,
        "link_check": checks,
        "configs": [c.name for c in configs],
        "times": times,
        "link": link,
        "rounds_done": rounds_done,
        "round_seconds": round_seconds,
        "measured": measured,
        "activations": activations,
    }
