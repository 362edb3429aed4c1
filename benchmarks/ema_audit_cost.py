"""``python -m benchmarks.ema_audit_cost``: what ShardedEMA's update and one replica-audit check cost.

On the overhead benchmark's model (:mod:`benchmarks.overhead`: 6 residual MLP blocks of width 512,
hidden 2048, a head; 12.9 M fp32 parameters), 2 gloo ranks, one intra-op thread each, every
block a ``fully_shard`` unit plus the root:

* **EMA update** on FSDP over both ranks (each rank averages its half of the model):
  ``AveragedWeights.update`` as ``ShardedEMA`` calls it after an optimizer step, fp32 average over
  fp32 weights (one ``torch._foreach_lerp_``), and with ``dtype`` differing from the weights (an fp64
  average: the ``_foreach_mul_`` + ``_foreach_add_`` path); plus one swap in and out (evaluation).
* **One audit check** on HSDP with 2 replicas of 1 shard (each rank holds, and checksums, the
  whole model: the most a rank can hold): ``ReplicaAudit.check`` with its checksums, its two
  collectives and its host read; and the checksums alone.
* For scale, the training step itself in the same processes (forward, backward, AdamW; 64
  samples per rank), FSDP over both ranks.

Each number is the median of repeated calls, the slower rank's. Prints a table (milliseconds, the
share of the training step measured in the same run, and the EMA update and the check in bytes
per second of local shards).

    python -m benchmarks.ema_audit_cost [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.overhead import FULL, build_model
from hp_lightning.core.ema import AveragedWeights
from hp_lightning.core.replica_audit import ReplicaAudit, unit_checksums, units_of

WORLD = 2


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _sharded(mesh_shape: tuple[int, ...]) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard") if len(mesh_shape) == 2 else ("shard",))
    model = build_model(FULL)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_bytes(model: torch.nn.Module) -> int:
    return sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())


def _rank(rank: int, port: int, repeats: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result: dict[str, float] = {}

    model = _sharded((WORLD,))
    result["fsdp_local_mb"] = _local_bytes(model) / 1e6
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(FULL.micro_batch, FULL.width)

    def step() -> None:
        F.mse_loss(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result["train_step_ms"] = _median_ms(step, max(5, repeats // 3))
    same = AveragedWeights(model)
    result["ema_update_ms"] = _median_ms(lambda: same.update(0.999), repeats)
    cast = AveragedWeights(model, dtype=torch.float64)
    result["ema_update_cast_ms"] = _median_ms(lambda: cast.update(0.999), repeats)

    def swap() -> None:
        with same.swapped():
            pass

    result["ema_swap_ms"] = _median_ms(swap, repeats)

    model = _sharded((WORLD, 1))
    result["hsdp_local_mb"] = _local_bytes(model) / 1e6
    audit = ReplicaAudit(1, "raise", init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))["replicate"].get_group())
    units = units_of([model])
    result["audit_units"] = len(units)
    result["audit_check_ms"] = _median_ms(lambda: audit.check(units, 1), repeats)
    result["audit_sums_ms"] = _median_ms(lambda: unit_checksums(units), repeats)
    assert not audit.reports
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, result)
    if rank == 0:
        out.put(everyone)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.repeats, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    ranks = out.get()
    for p in procs:
        p.join()
    slow = {key: max(r[key] for r in ranks) for key in ranks[0]}
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} cores)")
    step = slow["train_step_ms"]
    print(f"| measured (median, slower of {WORLD} ranks) | ms | of the step | local shards | throughput |")
    print("|---|---|---|---|---|")
    print(f"| training step (fwd + bwd + AdamW, FSDP 2) | {step:.1f} | 100 % | {slow['fsdp_local_mb']:.1f} MB | |")
    for key, label in (("ema_update_ms", "EMA update, fp32 average (one _foreach_lerp_)"),
                       ("ema_update_cast_ms", "EMA update, fp64 average (_foreach_mul_ + _foreach_add_)"),
                       ("ema_swap_ms", "EMA swap in and back (evaluation)")):
        print(f"| {label} | {slow[key]:.2f} | {100 * slow[key] / step:.2f} % | {slow['fsdp_local_mb']:.1f} MB | "
              f"{slow['fsdp_local_mb'] / slow[key]:.2f} GB/s |")
    print(f"| replica audit, one check ({int(slow['audit_units'])} units, HSDP 2x1) | {slow['audit_check_ms']:.2f} | "
          f"{100 * slow['audit_check_ms'] / step:.2f} % | {slow['hsdp_local_mb']:.1f} MB | {slow['hsdp_local_mb'] / slow['audit_check_ms']:.2f} GB/s |")
    print(f"| of which the checksums alone (no collective) | {slow['audit_sums_ms']:.2f} | {100 * slow['audit_sums_ms'] / step:.2f} % | "
          f"{slow['hsdp_local_mb']:.1f} MB | {slow['hsdp_local_mb'] / slow['audit_sums_ms']:.2f} GB/s |")


if __name__ == "__main__":
    main()
