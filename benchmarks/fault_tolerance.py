"""``python -m benchmarks.fault_tolerance`` (``make bench-ft``): what fault tolerance costs, and how fast it recovers.

Two simulated nodes (network namespaces joined by a shaped veth pair, :mod:`benchmarks.cluster_net`),
2 ranks each, the same GPT and data in every configuration:

* **plain HSDP 2x2**: one 4-rank job, a ``(replicate, shard) = (2, 2)`` mesh, shard inside a node,
  replicate across the link (FSDP2 does the replicate all-reduce);
* **fault-tolerant HSDP**: replica group g = node g, each its own 2-rank job sharding over its own
  1-D mesh, torchft's ``Manager`` across the groups (:class:`hp_lightning.ft.FaultTolerantHSDP`:
  quorum before every step, replicate all-reduce through the Manager, commit vote after backward),
  the lighthouse in node 0's namespace on node 0's end of the link, so both nodes reach it.

Part 1 times both in alternating launches at every link speed and reads the link's byte counters
(step time ratio FT / plain, target <= 1.05 at 1 Gbit/s). Part 2 SIGKILLs one rank of group 1
mid-run, times the survivor's stall until it commits alone, restarts group 1 and times it until
its first committed step after healing from group 0; then both groups finish together and their
shards are compared bit for bit. Writes ``fault_tolerance.{json,md}`` to ``--out``; prints the
target line (PASS/FAIL), never failing on a missed target. Without namespaces (not root, no
iproute2), or with ``--loopback``, both nodes share the host's loopback, unshaped, and the output
says so.

Examples::

    sudo python -m benchmarks.fault_tolerance            # the full run (make bench-ft), ~6 minutes on 2 cores
    sudo python -m benchmarks.fault_tolerance --quick    # tiny model, 1 Gbit/s only, one repetition (~1 minute)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pickle
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import cluster_net
from benchmarks.cluster_net import ClusterNetwork, LinkSpeed
from benchmarks.cluster_settings import CLUSTER, CLUSTER_SMOKE
from benchmarks.load import LoadMonitor
from benchmarks.run import describe_machine
from benchmarks.settings import AUTO_PLAN, LLM_PLAN, ModelShape

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
NODES = 2
RANKS_PER_NODE = 2
#: The issue's target: fault-tolerant step time / plain HSDP step time at this speed.
MAX_FT_STEP_RATIO = 1.05
TARGET_SPEED = "1G"
CLONE_NEWUTS = 0x04000000
LOOPBACK_ADDRESS = "127.0.0.1"
LOOPBACK = "lo"


@dataclass(frozen=True)
class FTBenchSettings:
    """Sizes, counts and limits of one ``bench-ft`` run.

    Attributes:
        model: the GPT of both configurations (default: ``bench-cluster``'s, 21.5 M parameters,
            78 % in embeddings and head, so the replicate all-reduce is a large share of a step
            at 1 Gbit/s).
        global_batch: sequences per optimizer step over all ranks (each rank reads a quarter).
        speeds: settings of the inter-node link; part 2 runs at the first.
        rounds: alternating rounds of part 1; each runs plain then FT (FT then plain in odd
            rounds) at every speed, each a fresh launch.
        warmup_steps / timed_steps: optimizer steps per launch (untimed: the first quorum, the
            cross-group process group and allocator warm-up fall there / timed).
        recoveries: kill-and-heal cycles of part 2, one after the other in one session.
        steps_before_kill: committed steps both groups make together before the kill.
        solo_steps: committed steps the survivor makes alone before group 1 restarts.
        heartbeat_timeout_ms: the lighthouse's silence before a group counts as dead: it bounds
            the survivor's stall (torchft's default is 5000).
        join_timeout_ms: how long a quorum waits for a group that heartbeats but has not joined
            (torchft's default is 60000).
        quorum_tick_ms: how often the lighthouse re-checks a pending quorum (torchft's default 100).
        ft_timeout_s: ``FaultTolerance.timeout``: cross-group collectives, commit vote, state transfer.
        quorum_timeout_s: ``FaultTolerance.quorum_timeout``.
        corpus_chars: characters of standard-library text the windows are cut from.
        launch_timeout_s: hard limit of any one launch or wait.
        time_budget_s: no new round of part 1 starts once the time so far plus the longest round
            so far would pass this (one always runs); part 2 then runs its ``recoveries`` cycles.
    """

    model: ModelShape = CLUSTER.model
    global_batch: int = 16
    speeds: tuple[LinkSpeed, ...] = (LinkSpeed("1G", 1000), LinkSpeed("10G", 10000))
    rounds: int = 4
    warmup_steps: int = 3
    timed_steps: int = 4
    recoveries: int = 3
    steps_before_kill: int = 3
    solo_steps: int = 2
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 2000
    quorum_tick_ms: int = 10
    ft_timeout_s: float = 10.0
    quorum_timeout_s: float = 30.0
    corpus_chars: int = 200_000
    launch_timeout_s: float = 180.0
    time_budget_s: float = 290.0

    def __post_init__(self) -> None:
        for participants in (1, 2):
            if self.global_batch % (participants * RANKS_PER_NODE):
                raise ValueError(
                    f"FTBenchSettings(global_batch={self.global_batch}) must split over {participants} group(s) x "
                    f"{RANKS_PER_NODE} ranks (the survivor reads the dead group's share too); choose a multiple of "
                    f"{NODES * RANKS_PER_NODE}."
                )
        if self.timed_steps < 1 or self.warmup_steps < 1 or self.recoveries < 1:
            raise ValueError(f"FTBenchSettings needs warmup_steps, timed_steps and recoveries >= 1; got "
                             f"{self.warmup_steps}, {self.timed_steps} and {self.recoveries}.")


FULL = FTBenchSettings()
QUICK = replace(
    FULL, model=CLUSTER_SMOKE.model, speeds=(FULL.speeds[0],), rounds=1, warmup_steps=2, timed_steps=3, recoveries=1,
    steps_before_kill=2, solo_steps=1, corpus_chars=20_000, launch_timeout_s=90.0, time_budget_s=60.0,
)


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one node run: the simulated cluster, or (``net`` None) the host's loopback."""

    net: Optional[ClusterNetwork]

    def address(self, node: int) -> str:
        return self.net.address(node) if self.net is not None else LOOPBACK_ADDRESS

    def link(self, node: int) -> Optional[str]:
        """The interface whose counters count inter-node bytes (None on loopback: nothing to count)."""
        return self.net.interface(node) if self.net is not None else None


# ---------------------------------------------------------------------------- inside every process


def _become_node(place: Placement, node: int) -> None:
    """Enter node ``node``: its network namespace (gloo binds its end of the link) and its own hostname.

    torchft's manager and checkpoint server advertise ``socket.gethostname()`` to the other
    groups, and on this machine that name resolves to 127.0.0.1, which inside a namespace is the
    namespace's own loopback. So, as on a real cluster where every node's hostname resolves to an
    address the others reach, each simulated node gets its own UTS namespace whose hostname is its
    link address. Must run before torchft is imported (the Manager reads the name at import).
    """
    if place.net is None:
        return
    cluster_net.enter_node(place.net, node)
    libc = ctypes.CDLL(None, use_errno=True)
    name = place.address(node).encode()
    if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"giving node {node} its own hostname failed: {os.strerror(err)}")


def _quiet() -> None:
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "torch.distributed", "torchft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


class _Data:
    """The windows of text and each step's share, the same in both configurations.

    Plain HSDP's replicate index is FT's participant rank, so with both groups present every rank
    reads the same samples in both (:class:`hp_lightning.ft.ParticipantBatches`).
    """

    def __init__(self, settings: FTBenchSettings) -> None:
        from examples.gpt import CharWindows, encode, stdlib_corpus
        from hp_lightning.ft import ParticipantBatches

        block = settings.model.block_size
        self.windows = CharWindows(encode(stdlib_corpus(settings.corpus_chars)), block_size=block, stride=block)
        self.batches = ParticipantBatches(len(self.windows), settings.global_batch)

    def batch(self, step: int, participant: int, participants: int, group_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.batches.indices(step, participant_rank=participant, participants=participants, group_rank=group_rank,
                                   group_world_size=RANKS_PER_NODE)
        pairs = [self.windows[i] for i in idx]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _build_gpt(settings: FTBenchSettings, mesh: Any, total_steps: int) -> tuple[torch.nn.Module, Any, Any]:
    """The GPT sharded with the plan hp_lightning picks for it (``benchmarks.trainers``), AdamW + schedule."""
    from lightning.pytorch import seed_everything

    from benchmarks.trainers import gpt_config, hand_written_optimizer, resolve_plan, shard_by_hand, shard_llm_aware
    from examples.gpt import GPT

    seed_everything(0, verbose=False)
    with torch.device("meta"):
        model = GPT(gpt_config(settings.model))
    shard = shard_llm_aware if resolve_plan(settings.model, AUTO_PLAN) == LLM_PLAN else shard_by_hand
    shard(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    model.train()
    optimizer, scheduler = hand_written_optimizer(model, total_steps)
    return model, optimizer, scheduler


def _local_shards(model: torch.nn.Module) -> torch.Tensor:
    """This rank's parameter shards, flattened: the same layout under a (2, 2) mesh's shard dim and a group's 1-D mesh."""
    return torch.cat([p.to_local().detach().reshape(-1).float() for p in model.parameters()])


def _counters(interface: Optional[str]) -> tuple[int, int]:
    """(link, loopback) bytes so far in this namespace, received + transmitted (0 for the link on loopback)."""
    counts = cluster_net.interface_bytes()
    return (counts.get(interface, 0) if interface else 0, counts.get(LOOPBACK, 0))


def _cpu_s() -> float:
    """CPU seconds of this process so far (all its threads): what the load accounting cannot see.

    Ranks are children of the forkserver, not of the benchmark's process, so ``os.times()`` there
    never counts them; each rank reports its own and the harness adds them up.
    """
    t = os.times()
    return t.user + t.system


def _shape(place: Placement, node: int, speed: LinkSpeed) -> str:
    return cluster_net.shape_link(place.net, node, speed) if place.net is not None else "none (loopback, unshaped)"


def plain_rank(settings: FTBenchSettings, place: Placement, speed: LinkSpeed) -> dict[str, Any]:
    """One rank of plain HSDP 2x2 (started by ``run_distributed`` with NODE_RANK set): shape, train, time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.trainers import next_token_loss

    node, local = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    _become_node(place, node)
    _quiet()
    dist.init_process_group("gloo")
    applied = _shape(place, node, speed) if local == 0 else ""
    dist.barrier()
    data = _Data(settings)
    steps = settings.warmup_steps + settings.timed_steps
    mesh = init_device_mesh("cpu", (NODES, RANKS_PER_NODE), mesh_dim_names=("replicate", "shard"))
    model, optimizer, scheduler = _build_gpt(settings, mesh, steps)
    initial = _local_shards(model)
    gc.collect()
    marks, counts, cpu = [time.perf_counter()], [_counters(place.link(node))], [_cpu_s()]
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = data.batch(step, participant=node, participants=NODES, group_rank=local)
        next_token_loss(model(inputs), targets).backward()
        optimizer.step()
        scheduler.step()
        marks.append(time.perf_counter())
        counts.append(_counters(place.link(node)))
        cpu.append(_cpu_s())
    return {"node": node, "local": local, "applied": applied, "marks": marks, "counters": counts, "cpu": cpu,
            "shards": _local_shards(model), "initial_shards": initial, "cpu_s": _cpu_s()}


def _ft_config(settings: FTBenchSettings, group: int, lighthouse: str, min_replicas: int) -> Any:
    from hp_lightning.ft import FaultTolerance

    return FaultTolerance(replica_group=group, num_replica_groups=NODES, min_replicas=min_replicas, lighthouse=lighthouse,
                          quorum_timeout=settings.quorum_timeout_s, timeout=settings.ft_timeout_s, connect_timeout=10.0,
                          init_sync=True)


def ft_rank(settings: FTBenchSettings, place: Placement, speed: LinkSpeed, group: int, group_rank: int, master_port: int,
            lighthouse: str, out_dir: str, max_steps: Optional[int], min_replicas: int) -> None:
    """One rank of replica group ``group`` (= node ``group``): its own job, FSDP2 over its 1-D mesh, torchft across.

    Writes one progress line per step (``progress_g<g>_r<r>.jsonl``: step, participants, committed,
    wall time, step seconds, quorum seconds, link counters) after a ``ready`` line (Manager built,
    before the first quorum); trains until ``max_steps`` or the step in the harness's ``stop_at``
    file; then writes ``result_g<g>_r<r>.pkl``: ``("ok", {...})`` or ``("error", traceback)``.
    """
    out = Path(out_dir)
    progress_path = out / f"progress_g{group}_r{group_rank}.jsonl"
    result_path = out / f"result_g{group}_r{group_rank}.pkl"
    os.environ.update(MASTER_ADDR=place.address(group), MASTER_PORT=str(master_port), RANK=str(group_rank),
                      WORLD_SIZE=str(RANKS_PER_NODE), LOCAL_RANK=str(group_rank), LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
                      NODE_RANK="0", OMP_NUM_THREADS="1", RUST_LOG="warn", TORCH_CPP_LOG_LEVEL="ERROR")
    torch.set_num_threads(1)

    def say(line: dict[str, Any]) -> None:
        with open(progress_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    try:
        _become_node(place, group)
        _quiet()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from benchmarks.trainers import next_token_loss
        from hp_lightning.ft import FaultTolerantHSDP

        dist.init_process_group("gloo")
        applied = _shape(place, group, speed) if group_rank == 0 else ""
        data = _Data(settings)
        mesh = init_device_mesh("cpu", (RANKS_PER_NODE,), mesh_dim_names=("shard",))
        model, optimizer, scheduler = _build_gpt(settings, mesh, max_steps or 10_000)
        ft = FaultTolerantHSDP(_ft_config(settings, group, lighthouse, min_replicas), model, optimizer,
                               extra={"scheduler": scheduler})
        gc.collect()
        link = place.link(group)
        say({"ready": True, "t": time.time(), "counters": _counters(link)})
        stop_file = out / "stop_at"
        while True:
            stop_at = max_steps if max_steps is not None else (int(stop_file.read_text()) if stop_file.exists() else None)
            if stop_at is not None and ft.step >= stop_at:
                break
            start = time.perf_counter()
            p = ft.begin_step()
            quorum_s = time.perf_counter() - start
            inputs, targets = data.batch(p.step, participant=p.rank, participants=p.count, group_rank=group_rank)
            next_token_loss(model(inputs), targets).backward()
            committed = ft.commit()
            if committed:
                scheduler.step()
            end = time.perf_counter()
            say({"step": ft.step, "participants": p.count, "committed": committed, "t": time.time(), "end": end,
                 "seconds": end - start, "quorum_s": quorum_s, "cpu": _cpu_s(), "counters": _counters(link)})
        result = {"applied": applied, "step": ft.step, "shards": _local_shards(model), "cpu_s": _cpu_s()}
        ft.shutdown()
        dist.barrier()
        status: tuple[str, Any] = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - forwarded to the harness
        status = ("error", f"group {group} rank {group_rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result_path, "wb") as f:
        pickle.dump(status, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status[0] == "ok" else 1)


def lighthouse_main(settings: FTBenchSettings, place: Placement, min_replicas: int, port_file: str) -> None:
    """torchft's lighthouse inside node 0, bound to node 0's end of the link; serves until killed."""
    import threading

    _become_node(place, 0)
    from hp_lightning.ft import start_lighthouse

    server = start_lighthouse(f"{place.address(0)}:0", min_replicas=min_replicas, join_timeout_ms=settings.join_timeout_ms,
                              quorum_tick_ms=settings.quorum_tick_ms, heartbeat_timeout_ms=settings.heartbeat_timeout_ms)
    port = server.address().rsplit(":", 1)[1].strip("/")
    tmp = Path(port_file + ".tmp")
    tmp.write_text(port)
    tmp.rename(port_file)
    threading.Event().wait()


# ---------------------------------------------------------------------------- the harness (host side)



class _FTSession:
    """One lighthouse and two replica groups of warm processes; every wait bounded, everything killed at the end."""

    def __init__(self, settings: FTBenchSettings, place: Placement, speed: LinkSpeed, min_replicas: int,
                 max_steps: Optional[int]) -> None:
        from tests.helpers import rank_context

        self.settings, self.place, self.speed = settings, place, speed
        self.min_replicas, self.max_steps = min_replicas, max_steps
        self.ctx = rank_context()
        self._tmp = tempfile.TemporaryDirectory(prefix="hp_bench_ft_")
        self.out = Path(self._tmp.name)
        self.procs: dict[tuple[int, int], Any] = {}
        self.expected_dead: set[tuple[int, int]] = set()
        self.lighthouse: Any = None
        self.address = ""

    def start_lighthouse(self) -> None:
        """Start the lighthouse process and wait for its port."""
        port_file = self.out / "lighthouse_port"
        self.lighthouse = self.ctx.Process(target=lighthouse_main, args=(self.settings, self.place, self.min_replicas,
                                                                         str(port_file)))
        self.lighthouse.start()
        self._wait("the lighthouse", port_file.exists, 30)
        self.address = f"http://{self.place.address(0)}:{port_file.read_text()}"

    def start_group(self, group: int) -> float:
        """Start group ``group``'s ranks (fresh progress files); returns the wall time just before."""
        from tests.helpers import free_port

        for r in range(RANKS_PER_NODE):
            (self.out / f"result_g{group}_r{r}.pkl").unlink(missing_ok=True)
            (self.out / f"progress_g{group}_r{r}.jsonl").unlink(missing_ok=True)
        port, started = free_port(), time.time()
        for r in range(RANKS_PER_NODE):
            proc = self.ctx.Process(target=ft_rank, args=(self.settings, self.place, self.speed, group, r, port, self.address,
                                                          str(self.out), self.max_steps, self.min_replicas))
            proc.start()
            self.procs[(group, r)] = proc
        return started

    def progress(self, group: int, rank: int = 0) -> list[dict[str, Any]]:
        path = self.out / f"progress_g{group}_r{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def steps(self, group: int, rank: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.progress(group, rank) if "step" in e]

    def result(self, group: int, rank: int) -> Any:
        path = self.out / f"result_g{group}_r{rank}.pkl"
        if not path.exists():
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def _wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for key, proc in self.procs.items():
                if proc.exitcode not in (None, 0) and key not in self.expected_dead:
                    raise RuntimeError(f"bench-ft: waiting for {what}, group {key[0]} rank {key[1]} failed "
                                       f"(exit {proc.exitcode}):\n{self.result(*key)}")
            if self.lighthouse is not None and self.lighthouse.exitcode is not None:
                raise RuntimeError(f"bench-ft: the lighthouse exited ({self.lighthouse.exitcode}) while waiting for {what}.")
            if time.monotonic() > deadline:
                tails = {g: self.progress(g)[-2:] for g in range(NODES)}
                raise RuntimeError(f"bench-ft: timed out after {timeout:.0f}s waiting for {what}; last progress {tails}.")
            time.sleep(0.02)

    def wait_for(self, what: str, predicate: Callable[[], bool]) -> None:
        self._wait(what, predicate, self.settings.launch_timeout_s)

    def join(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Wait for every live rank to finish; their results (RuntimeError on any error or hang)."""
        live = [k for k in self.procs if k not in self.expected_dead]
        self.wait_for("every rank to finish", lambda: all(self.procs[k].exitcode is not None for k in live))
        results = {k: self.result(*k) for k in live}
        errors = [v[1] for v in results.values() if v is None or v[0] != "ok"]
        if errors:
            raise RuntimeError("bench-ft: a rank failed:\n" + "\n".join(map(str, errors)))
        return {k: v[1] for k, v in results.items()}

    def close(self) -> None:
        """Kill what still runs (by pid: only this session's processes) and remove the session's files."""
        for proc in [*self.procs.values(), *([self.lighthouse] if self.lighthouse is not None else [])]:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        self._tmp.cleanup()


@contextmanager
def _session(*args: Any) -> Iterator[_FTSession]:
    session = _FTSession(*args)
    try:
        session.start_lighthouse()
        yield session
    finally:
        session.close()


def _pace(ends: list[float], skip: int) -> list[float]:
    """Seconds between consecutive ends of step on one rank, after ``skip`` warm-up steps.

    ``ends[0]`` is the start of the first step. The pace of the job, everything between two
    optimizer steps included (FT: the quorum, the commit vote); the ranks are coupled by their
    collectives, so every rank has the same pace up to jitter, and node 0's rank 0 stands for all.
    """
    return [b - a for a, b in zip(ends[skip:], ends[skip + 1:])]


def _per_step_bytes(counters: list[tuple[int, int]], skip: int) -> tuple[float, float]:
    """(link, loopback) bytes per step over the timed steps, from node 0's counters at each mark."""
    first, last = counters[skip], counters[-1]
    steps = len(counters) - 1 - skip
    return ((last[0] - first[0]) / steps, (last[1] - first[1]) / steps)


def time_plain(settings: FTBenchSettings, place: Placement, speed: LinkSpeed) -> dict[str, Any]:
    """One launch of plain HSDP 2x2: per-step seconds, node 0's bytes per step, every rank's final shards."""
    from tests.helpers import free_port, run_distributed

    env = {"MASTER_ADDR": place.address(0), "MASTER_PORT": str(free_port())}
    ranks = run_distributed(plain_rank, NODES * RANKS_PER_NODE, settings, place, speed, timeout=settings.launch_timeout_s,
                            local_world_size=RANKS_PER_NODE, env=env)
    node0 = next(r for r in ranks if r["node"] == 0 and r["local"] == 0)
    link, loop = _per_step_bytes(node0["counters"], settings.warmup_steps)
    w = settings.warmup_steps
    cpu = sum((r["cpu"][-1] - r["cpu"][w]) / settings.timed_steps for r in ranks)
    return {"step_s": _pace(node0["marks"], settings.warmup_steps), "link_bytes": link, "rank_cpu_s_per_step": cpu,
            "loopback_bytes": loop, "applied": [r["applied"] for r in ranks if r["local"] == 0],
            "shards": {(r["node"], r["local"]): r["shards"] for r in ranks},
            "initial_shards": {(r["node"], r["local"]): r["initial_shards"] for r in ranks}}


def time_ft(settings: FTBenchSettings, place: Placement, speed: LinkSpeed) -> dict[str, Any]:
    """One run of both replica groups (min_replicas=2: every step has both), timed like :func:`time_plain`."""
    steps = settings.warmup_steps + settings.timed_steps
    with _session(settings, place, speed, NODES, steps) as session:
        session.start_group(0)
        session.start_group(1)
        results = session.join()
        lines = {(g, r): session.steps(g, r) for g in range(NODES) for r in range(RANKS_PER_NODE)}
    for key, steps_seen in lines.items():
        if len(steps_seen) != steps or not all(e["committed"] and e["participants"] == NODES for e in steps_seen):
            raise RuntimeError(f"bench-ft: group {key[0]} rank {key[1]} did not commit every step with both groups: {steps_seen}")
    rank0 = lines[(0, 0)]
    seconds = _pace([e["end"] for e in rank0], settings.warmup_steps - 1)
    link, loop = _per_step_bytes([tuple(e["counters"]) for e in rank0], settings.warmup_steps - 1)
    w = settings.warmup_steps - 1
    cpu = sum((lines[k][-1]["cpu"] - lines[k][w]["cpu"]) / settings.timed_steps for k in lines)
    return {"step_s": seconds, "link_bytes": link, "loopback_bytes": loop, "rank_cpu_s_per_step": cpu,
            "quorum_s": [lines[k][i]["quorum_s"] for k in lines for i in range(settings.warmup_steps, steps)],
            "applied": [results[(g, 0)]["applied"] for g in range(NODES)],
            "shards": {k: v["shards"] for k, v in results.items()}}


def _max_rel_diff(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


def _kill_and_heal(settings: FTBenchSettings, session: _FTSession) -> dict[str, Any]:
    """One cycle: SIGKILL group 1's rank 1 half a step into a step, the survivor goes on alone, group 1 restarts and heals.

    Returns the seconds from the kill to group 1's other rank gone, to the survivor's first step
    committed alone, from the restart to the restarted group's Manager being up (``ready``) and to
    its first committed step (the healing quorum's state transfer included), and the survivor's
    uncommitted steps.
    """
    latest = session.steps(1)[-1]["step"]
    session.wait_for("a fresh step of group 1", lambda: session.steps(1)[-1]["step"] > latest)
    time.sleep(0.5 * statistics.median(e["seconds"] for e in session.steps(1)))
    session.expected_dead = {(1, 0), (1, 1)}
    print("  SIGKILL group 1 rank 1 (the survivor's torchft logs its failed all-reduce: expected)", flush=True)
    killed_at = time.time()
    os.kill(session.procs[(1, 1)].pid, signal.SIGKILL)
    session.wait_for("group 1's other rank to end", lambda: session.procs[(1, 0)].exitcode is not None)
    group_gone = time.time() - killed_at

    def alone() -> list[dict[str, Any]]:
        return [e for e in session.steps(0) if e["committed"] and e["participants"] == 1 and e["t"] > killed_at]

    session.wait_for("the survivor to commit alone", lambda: bool(alone()))
    survivor = alone()[0]
    session.wait_for("the survivor's solo steps", lambda: len(alone()) >= 1 + settings.solo_steps)
    failed = [e for e in session.steps(0) if not e["committed"] and e["t"] > killed_at]

    session.expected_dead = set()
    restarted_at = session.start_group(1)
    session.wait_for("group 1 healed and committing", lambda: any(e["committed"] for e in session.steps(1)))
    ready = next(e for e in session.progress(1) if e.get("ready"))
    first = next(e for e in session.steps(1) if e["committed"])
    return {
        "kill_to_group_gone_s": group_gone,
        "kill_to_survivor_commit_s": survivor["t"] - killed_at,
        "survivor_uncommitted_steps": len(failed),
        # The stall's parts: the step in flight ends (failed), the next quorum waits for the dead
        # group's heartbeat to expire, then the first step alone (twice the per-rank batch).
        "kill_to_failed_step_end_s": failed[0]["t"] - killed_at if failed else 0.0,
        "survivor_requorum_s": survivor["quorum_s"],
        "survivor_solo_step_s": survivor["seconds"],
        "restart_to_ready_s": ready["t"] - restarted_at,
        # Node 1's link counters from the Manager being up to the first committed step: the state
        # transfer (both ranks' shards: weights, AdamW moments) plus one step's all-reduces.
        "healing_link_mib": (first["counters"][0] - ready["counters"][0]) / 2**20,
        "restart_to_first_commit_s": first["t"] - restarted_at,
        "healing_quorum_s": first["quorum_s"],
        "healing_step_s": first["seconds"],
        "healed_at_step": first["step"],
        "healed_with_participants": first["participants"],
    }


def recover(settings: FTBenchSettings, place: Placement, speed: LinkSpeed) -> dict[str, Any]:
    """Part 2 in one session (min_replicas=1): kill-and-heal cycles, then both groups finish together.

    The first cycle starts after ``steps_before_kill`` steps committed together; each later one
    right after the previous heal.
    At the end both groups stop at the same step and every rank's shards are compared with its
    peer's in the other group: a heal that copied anything wrong shows up there.
    """
    with _session(settings, place, speed, 1, None) as session:
        session.start_group(0)
        session.start_group(1)
        session.wait_for("both groups training together", lambda: any(
            e["participants"] == NODES and e["committed"] and e["step"] >= settings.steps_before_kill for e in session.steps(1)))
        cycles: list[dict[str, Any]] = []
        cycle_s: list[float] = []
        for index in range(settings.recoveries):
            t0 = time.monotonic()
            cycles.append(_kill_and_heal(settings, session))
            cycle_s.append(time.monotonic() - t0)
            c = cycles[-1]
            print(f"  recovery {index + 1}: kill -> survivor commits alone {c['kill_to_survivor_commit_s']:.2f} s, "
                  f"restart -> first commit {c['restart_to_first_commit_s']:.2f} s", flush=True)
        stop_at = max(session.steps(0)[-1]["step"], session.steps(1)[-1]["step"]) + 1
        tmp = session.out / "stop_at.tmp"
        tmp.write_text(str(stop_at))
        tmp.rename(session.out / "stop_at")
        results = session.join()
    identical = all(torch.equal(results[(0, r)]["shards"], results[(1, r)]["shards"]) for r in range(RANKS_PER_NODE))
    return {"cycles": cycles, "cycle_s": cycle_s, "stop_at": stop_at, "bit_identical_after_heal": identical}


# ---------------------------------------------------------------------------- the run


def _median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure(settings: FTBenchSettings, place: Placement, started: float) -> dict[str, Any]:
    """Part 1 (alternating timed launches at every speed) and part 2 (kill-and-heal repetitions)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {"plain": [], "ft": []} for s in settings.speeds}
    parity: dict[str, float] = {}
    moved: dict[str, float] = {}
    round_s: list[float] = []
    for index in range(settings.rounds):
        if round_s and time.monotonic() - started + max(round_s) > settings.time_budget_s:
            break
        t0 = time.monotonic()
        for speed in settings.speeds:
            order = ("plain", "ft") if index % 2 == 0 else ("ft", "plain")
            for kind in order:
                gc.collect()
                run = (time_plain if kind == "plain" else time_ft)(settings, place, speed)
                runs[speed.name][kind].append(run)
                print(f"  round {index + 1} {speed.name} {kind}: median step {1000 * statistics.median(run['step_s']):.0f} ms, "
                      f"link {run['link_bytes'] / 2**20:.1f} MiB/step", flush=True)
            if speed.name not in parity:
                plain = runs[speed.name]["plain"][0]
                parity[speed.name] = _max_rel_diff(runs[speed.name]["ft"][0]["shards"], plain["shards"])
                # How far training moved the weights: the comparison above is not one of untouched initial values.
                moved[speed.name] = _max_rel_diff(plain["initial_shards"], plain["shards"])
            for kind in ("plain", "ft"):
                runs[speed.name][kind][-1].pop("shards")
                runs[speed.name][kind][-1].pop("initial_shards", None)
        round_s.append(time.monotonic() - t0)
    recovery = recover(settings, place, settings.speeds[0])
    return {"runs": runs, "parity_max_rel_diff": parity, "training_moved_max_rel": moved, "round_s": round_s,
            "recovery": recovery}


def summarize(settings: FTBenchSettings, measured: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios and the target from the raw measurements."""
    from benchmarks.trainers import gpt_config
    from examples.gpt import GPT

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(gpt_config(settings.model)).parameters())
    speeds = {}
    for name, kinds in measured["runs"].items():
        row: dict[str, Any] = {}
        for kind, runs in kinds.items():
            steps = [s for r in runs for s in r["step_s"]]
            row[kind] = {
                "step_ms_median": 1000 * statistics.median(steps),
                "step_ms_p25_p75": [1000 * q for q in statistics.quantiles(steps, n=4)[::2]] if len(steps) > 1 else [],
                "round_medians_ms": [1000 * statistics.median(r["step_s"]) for r in runs],
                "link_mib_per_step": statistics.median(r["link_bytes"] for r in runs) / 2**20,
                "loopback_mib_per_step_node0": statistics.median(r["loopback_bytes"] for r in runs) / 2**20,
                "rank_cpu_s_per_step": statistics.median(r["rank_cpu_s_per_step"] for r in runs),
                "shaping": runs[0]["applied"],
            }
            if kind == "ft":
                row[kind]["quorum_ms_median"] = 1000 * statistics.median(q for r in runs for q in r["quorum_s"])
        # Paired: each round's two launches ran back to back, so their ratio cancels most of a shared
        # machine's drift; the median over rounds is the figure, the ratio of pooled medians is beside it.
        row["round_ratios"] = [f / p for f, p in zip(row["ft"]["round_medians_ms"], row["plain"]["round_medians_ms"])]
        row["ratio_ft_over_plain"] = statistics.median(row["round_ratios"])
        row["ratio_of_pooled_medians"] = row["ft"]["step_ms_median"] / row["plain"]["step_ms_median"]
        row["link_ratio_ft_over_plain"] = row["ft"]["link_mib_per_step"] / row["plain"]["link_mib_per_step"] \
            if row["plain"]["link_mib_per_step"] else float("nan")
        row["parity_max_rel_diff"] = measured["parity_max_rel_diff"][name]
        row["training_moved_max_rel"] = measured["training_moved_max_rel"][name]
        speeds[name] = row
    keys = ["kill_to_group_gone_s", "kill_to_survivor_commit_s", "survivor_uncommitted_steps", "kill_to_failed_step_end_s",
            "survivor_requorum_s", "survivor_solo_step_s", "restart_to_ready_s", "restart_to_first_commit_s",
            "healing_quorum_s", "healing_step_s", "healing_link_mib"]
    recs = measured["recovery"]["cycles"]
    recovery: dict[str, Any] = {k: _median_range([float(r[k]) for r in recs]) for k in keys}
    recovery["bit_identical_after_heal"] = measured["recovery"]["bit_identical_after_heal"]
    recovery["healed_with_both"] = all(r["healed_with_participants"] == NODES for r in recs)
    target_speed = TARGET_SPEED if TARGET_SPEED in speeds else next(iter(speeds))
    ratio = speeds[target_speed]["ratio_ft_over_plain"]
    target = {"speed": target_speed, "limit": MAX_FT_STEP_RATIO, "measured": ratio, "pass": ratio <= MAX_FT_STEP_RATIO}
    return {"parameters": params, "speeds": speeds, "recovery": recovery, "target": target}


def target_line(target: dict[str, Any], place_note: str) -> str:
    verdict = "PASS" if target["pass"] else "FAIL"
    return (f"{verdict}: {target['speed']}{place_note}: fault-tolerant HSDP step / plain HSDP 2x2 step <= "
            f"{target['limit']}: measured {target['measured']:.3f}")


def _fmt_range(r: dict[str, float], digits: int = 2) -> str:
    return f"{r['median']:.{digits}f} ({r['min']:.{digits}f}–{r['max']:.{digits}f})"


def render_markdown(report: dict[str, Any]) -> str:
    """The results page: settings, machine, the two tables, how it was measured."""
    s, summary, machine, network = report["settings"], report["summary"], report["machine"], report["network"]
    model = s["model"]
    lines = ["# Fault-tolerant HSDP (torchft) against plain HSDP 2x2, on a simulated 2-node cluster", ""]
    if machine.get("_busy"):
        lines += [f"> **BUSY MACHINE**: {machine['load']}. Absolute times are noisy; read the ratios of the "
                  "alternating launches and their per-round ranges.", ""]
    lines += ["Generated by `python -m benchmarks.fault_tolerance` (`make bench-ft`). Every number below was measured "
              "in this run.", "", "## Machine", ""]
    lines += [f"- **{k}**: {v}" for k, v in machine.items() if not k.startswith("_")]
    lines += ["", "## Setup", ""]
    if network["namespaces"]:
        lines.append(f"- 2 nodes = network namespaces `{network['namespaces'][0]}`, `{network['namespaces'][1]}`, 2 ranks "
                     f"each; the nodes talk over one veth pair `{network['interfaces'][0]}` ({network['addresses'][0]}) <-> "
                     f"`{network['interfaces'][1]}` ({network['addresses'][1]}), its egress shaped with tbf on both ends "
                     f"(`benchmarks.cluster_net`); netem {'on' if network['netem'] else 'absent in this kernel: latency not added'}. "
                     "Each node also has its own hostname (its link address, in its own UTS namespace), which torchft "
                     "advertises to the other groups. Namespaces left after the run: "
                     f"{', '.join(network['leftover_namespaces']) or 'none'}.")
    else:
        lines.append(f"- **No simulated cluster** ({network['fallback_reason']}): both \"nodes\" share the host's loopback, "
                     "unshaped; the link columns are not measured and the ratio is not the 1 Gbit/s one.")
    lines += [
        f"- Model: `examples.gpt.GPT`, {model['n_layer']} layers, width {model['n_embd']}, {model['n_head']} heads, vocabulary "
        f"{model['vocab_size']}, {model['block_size']}-token sequences: {summary['parameters'] / 1e6:.1f} M parameters "
        f"({summary['parameters'] * 4 / 2**20:.0f} MiB fp32), AdamW with warm-up + cosine schedule, sharded with the "
        "plan hp_lightning picks for it (`benchmarks.trainers`).",
        f"- Data: the same {s['global_batch']} sequences per optimizer step in both configurations "
        "(`hp_lightning.ft.ParticipantBatches`: plain HSDP's replicate index = FT's participant rank).",
        "- **plain**: one 4-rank job, mesh (replicate 2, shard 2): shard inside a node, FSDP2's all-reduce across the link.",
        "- **FT**: replica group g = node g, each its own 2-rank job (own rendezvous, FSDP2 over its 1-D mesh), "
        "`hp_lightning.ft.FaultTolerantHSDP` (torchft `Manager`: quorum per step, replicate all-reduce through the "
        "Manager, commit vote) with its group watchdog.",
        "- Lighthouse: torchft's `LighthouseServer` in its own process "
        + (f"inside node 0's namespace, bound to {network['lighthouse_bind']} (node 0's end of the link, so node 1 "
           "reaches it across the link and node 0 locally)" if network["namespaces"] else
           f"bound to {network['lighthouse_bind']}") + f"; heartbeat_timeout_ms={s['heartbeat_timeout_ms']} (bounds the survivor's stall), join_timeout_ms="
        f"{s['join_timeout_ms']}, quorum_tick_ms={s['quorum_tick_ms']}; FaultTolerance(timeout={s['ft_timeout_s']:g}, "
        f"quorum_timeout={s['quorum_timeout_s']:g}).",
        "",
        "## No-fault step time",
        "",
        f"{s['warmup_steps']} warm-up + {s['timed_steps']} timed steps per launch, "
        f"{len(next(iter(summary['speeds'].values()))['plain']['round_medians_ms'])} alternating round(s) (plain, FT; then "
        "FT, plain), every launch fresh. Step = time between two consecutive ends of an optimizer step on node 0's "
        "rank 0 (the job's pace: FT's quorum and commit vote included; the ranks are coupled by their collectives, so "
        "every rank has the same pace up to jitter). Quorum = `begin_step` alone, median over every rank and timed "
        "step: it includes waiting for the other group, so it is mostly skew between the groups. CPU = the CPU time of "
        "the 4 rank processes (every thread: compute, gloo, torchft's manager and checkpoint servers, the group "
        "watchdog) per timed step, summed; on 2 shared cores, CPU time an FT process spends beside the training is "
        "step time once the cores are saturated. Link bytes: node 0's veth counters (received + transmitted) over the "
        "timed steps, so everything that crossed between the nodes, lighthouse traffic included.",
        "",
        "| link | configuration | step ms, median [p25–p75] | round medians ms | FT / plain | inter-node MiB/step | "
        "loopback MiB/step (node 0) | CPU s/step, 4 ranks | quorum ms/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["speeds"].items():
        for kind in ("plain", "ft"):
            r = row[kind]
            iqr = f" [{r['step_ms_p25_p75'][0]:.0f}–{r['step_ms_p25_p75'][1]:.0f}]" if r["step_ms_p25_p75"] else ""
            ratio = (f"**{row['ratio_ft_over_plain']:.3f}** (rounds {', '.join(f'{x:.3f}' for x in row['round_ratios'])}; "
                     f"pooled {row['ratio_of_pooled_medians']:.3f})" if kind == "ft" else "1.000")
            link = f"{r['link_mib_per_step']:.1f}" if network["namespaces"] else "n/a"
            quorum = f"{r['quorum_ms_median']:.1f}" if kind == "ft" else "—"
            lines.append(f"| {name} | {'fault-tolerant HSDP' if kind == 'ft' else 'plain HSDP 2x2'} | {r['step_ms_median']:.0f}{iqr} | "
                         f"{', '.join(f'{x:.0f}' for x in r['round_medians_ms'])} | {ratio} | {link} | "
                         f"{r['loopback_mib_per_step_node0']:.1f} | {r['rank_cpu_s_per_step']:.2f} | {quorum} |")
    lines += ["", "Same training: after the first launch at each speed, every rank's final parameter shards, FT against "
              "plain, max relative difference: " + ", ".join(
                  f"{k} {v['parity_max_rel_diff']:.2g} (training moved them from their initial values by up to "
                  f"{v['training_moved_max_rel']:.2g})" for k, v in summary["speeds"].items()) + ".", "", "```", report["target_line"], "```", ""]
    rec = summary["recovery"]
    n = rec["kill_to_survivor_commit_s"]["n"]
    lines += [
        f"## Recovery ({report['recovery_speed']}, {n} repetition{'s' if n != 1 else ''}: median (min–max))",
        "",
        f"One session (min_replicas=1): both groups train until {s['steps_before_kill']} steps are committed together; "
        "then each repetition SIGKILLs group 1's rank 1 half a step into a step; the survivor (group 0) trains alone "
        f"for {s['solo_steps']} more committed step(s), then group 1 is started again (fresh processes from the warm "
        "forkserver: torch, Lightning and hp_lightning already imported) and heals from group 0 over torchft's HTTP "
        "checkpoint transport (weights, AdamW moments, LR schedule, step); the next repetition follows its first "
        "committed step. At the end both groups stop at the same step and every rank's shards are compared with its "
        "peer's in the other group.",
        "",
        "| what | seconds |",
        "|---|---|",
        f"| kill -> group 1's other rank gone (its collectives fail, group watchdog) | {_fmt_range(rec['kill_to_group_gone_s'])} |",
        f"| **kill -> survivor's next committed step** (alone) | **{_fmt_range(rec['kill_to_survivor_commit_s'])}** |",
        f"| = kill -> the survivor's step in flight ends, not committed | {_fmt_range(rec['kill_to_failed_step_end_s'])} |",
        f"| + the survivor's first step alone (each rank reads twice its usual share) | {_fmt_range(rec['survivor_solo_step_s'])} |",
        f"| &nbsp;&nbsp; of which its quorum, waiting for group 1's heartbeat to expire | {_fmt_range(rec['survivor_requorum_s'])} |",
        f"| survivor's uncommitted steps (count) | {_fmt_range(rec['survivor_uncommitted_steps'], 0)} |",
        f"| restart -> restarted group's Manager up (processes, process group, model, lighthouse connection) | "
        f"{_fmt_range(rec['restart_to_ready_s'])} |",
        f"| **restart -> healed group's first committed step** | **{_fmt_range(rec['restart_to_first_commit_s'])}** |",
        f"| of which: the healing step's quorum (`begin_step`: waiting for the survivor's next step + state transfer) | "
        f"{_fmt_range(rec['healing_quorum_s'])} |",
        f"| of which: the whole healing step | {_fmt_range(rec['healing_step_s'])} |",
        f"| MiB over the link from Manager up to first commit (state transfer + one step) | "
        f"{_fmt_range(rec['healing_link_mib'], 1) if network['namespaces'] else 'n/a (loopback)'} |",
        "",
        f"Survivor and healed group ended with bit-identical shards (every rank, after the last heal and "
        f"{report['raw']['recovery']['stop_at']} steps): **{'yes' if rec['bit_identical_after_heal'] else 'NO'}**; "
        f"every healed group's first committed step had both groups: {'yes' if rec['healed_with_both'] else 'NO'}.",
        "",
        "## How measured",
        "",
        "One process builds the namespaces, then alternates launches of the two configurations at each link speed "
        "(ranks forked from one warm forkserver, 1 thread each, 4 ranks on "
        f"{machine['_cores']} cores), so slow drifts of a shared machine hit both alike. FT / plain is the median over rounds of each round's "
        "ratio (FT's median step / plain's, two launches back to back); beside it each round's ratio and the ratio "
        "of the medians pooled over all rounds, which a drift of the machine's load between rounds can skew. Node 0's rank 0 reads its namespace's interface "
        "counters at the end of every step. The load line counts the ranks' own CPU time (they report it; the "
        "forkserver, not this process, is their parent). For recovery, every rank appends a line per step "
        "(wall clock, committed or not, participants) and the harness, on the same clock, kills, restarts and reads "
        "them: the survivor's stall is the kill to its first step committed with one participant (the step in flight "
        "fails and is not applied; the next quorum waits for the dead group's heartbeat to expire); the restart time "
        "is from starting the processes to their first committed step, the state transfer included. "
        f"The run took {machine['benchmark wall time']}.",
        "",
    ]
    return "\n".join(lines)


def run(settings: FTBenchSettings, out_dir: Path, note: str = "", loopback: bool = False) -> dict[str, Any]:
    """Build the cluster (or fall back to loopback), measure, remove the cluster, write the results."""
    started = time.monotonic()
    # Read by the ranks when torch and torchft load, so set before the forkserver starts; restored afterwards.
    saved = {k: os.environ.get(k) for k in ("TORCH_CPP_LOG_LEVEL", "RUST_LOG")}
    os.environ["TORCH_CPP_LOG_LEVEL"] = saved["TORCH_CPP_LOG_LEVEL"] or "ERROR"
    os.environ["RUST_LOG"] = saved["RUST_LOG"] or "warn"
    missing = ["--loopback given"] if loopback else cluster_net.missing_requirements()
    try:
        with LoadMonitor() as load:
            if missing:
                print(f"bench-ft: no simulated cluster ({'; '.join(missing)}): both nodes on the host's loopback, unshaped",
                      flush=True)
                place = Placement(None)
                settings = replace(settings, speeds=(LinkSpeed("loopback", 0, 0),))
                measured = measure(settings, place, started)
                network: dict[str, Any] = {"namespaces": [], "fallback_reason": "; ".join(missing), "netem": False}
            else:
                with cluster_net.simulated_cluster(NODES) as net:
                    print(f"bench-ft: namespaces {net.namespace(0)}, {net.namespace(1)}; link {net.address(0)} <-> "
                          f"{net.address(1)}", flush=True)
                    place = Placement(net)
                    measured = measure(settings, place, started)
                network = {"namespaces": [net.namespace(n) for n in range(NODES)],
                           "interfaces": [net.interface(n) for n in range(NODES)],
                           "addresses": [net.address(n) for n in range(NODES)], "netem": net.netem,
                           "leftover_namespaces": cluster_net.leftover_namespaces(net.owner_pid)}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    network["lighthouse_bind"] = f"{place.address(0)}:<free port>"
    elapsed = time.monotonic() - started
    machine = describe_machine("cpu", load.summary(), note)  # the load monitor counts the ranks (the benchmark's process tree)
    machine["benchmark wall time"] = f"{elapsed / 60:.1f} min"
    summary = summarize(settings, measured)
    report = {"settings": asdict(settings), "machine": machine, "network": network, "summary": summary,
              "recovery_speed": settings.speeds[0].name, "elapsed_s": elapsed,
              "raw": {"runs": measured["runs"], "recovery": measured["recovery"], "round_s": measured["round_s"]}}
    report["target_line"] = target_line(summary["target"], "" if place.net is not None else " (loopback, unshaped)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fault_tolerance.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "fault_tolerance.md").write_text(render_markdown(report))
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_tolerance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 Gbit/s only, one round, one recovery (~1 minute)")
    parser.add_argument("--rounds", type=int, help="alternating rounds of the step-time part")
    parser.add_argument("--recoveries", type=int, help="kill-and-heal repetitions")
    parser.add_argument("--budget", type=float, help="seconds after which no new round or repetition starts")
    parser.add_argument("--speeds", help="comma-separated link speeds of the preset to run (e.g. 1G); default all")
    parser.add_argument("--loopback", action="store_true", help="skip the namespaces: both nodes on the host's loopback, unshaped")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--note", default="", help="a line about the conditions, written under Machine")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    overrides = {"rounds": args.rounds, "recoveries": args.recoveries, "time_budget_s": args.budget}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.speeds:
        known = {s.name: s for s in settings.speeds}
        wanted = [name.strip() for name in args.speeds.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in known]
        if unknown or not wanted:
            parser.error(f"--speeds expects names among {sorted(known)}; got {args.speeds!r}.")
        settings = replace(settings, speeds=tuple(known[name] for name in wanted))
    report = run(settings, args.out, note=args.note, loopback=args.loopback)
    print()
    print(report["target_line"])
    rec = report["summary"]["recovery"]
    print(f"kill -> survivor's next committed step: {_fmt_range(rec['kill_to_survivor_commit_s'])} s; restart -> healed "
          f"group's first committed step: {_fmt_range(rec['restart_to_first_commit_s'])} s; bit-identical after heal: "
          f"{rec['bit_identical_after_heal']}")
    print(f"\nwrote {args.out / 'fault_tolerance.md'} (+ .json) in {report['elapsed_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    # Run through the package module, so the rank functions pickle as benchmarks.fault_tolerance.* (not __main__).
    from benchmarks.fault_tolerance import main as _main

    sys.exit(_main())
