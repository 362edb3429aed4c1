"""CollectiveCounter counts both kinds of collective at the call, with their process groups.

``torch.distributed`` functions (what FSDP2 calls) are wrapped; DTensor's functional collectives
(tensor parallelism, norms of sharded gradients) are counted at the op. Two real gloo ranks.
"""

from __future__ import annotations

from tests.helpers import run_distributed


def _count() -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hp_lightning.core.diagnostics import CollectiveCounter

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with CollectiveCounter() as comms:
        whole = sharded.full_tensor()  # functional all-gather (DTensor)
        total = torch.ones(3)
        dist.all_reduce(total)  # torch.distributed call
        norm = torch.linalg.vector_norm(sharded).full_tensor()  # functional all-reduce of partial norms
    out = {
        "kinds": sorted(comms.by_kind().items()),
        "groups": sorted(comms.groups("all_gather") | comms.groups("all_reduce")),
        "whole": whole.tolist(),
        "total": total.tolist(),
        "norm": float(norm),
    }
    dist.destroy_process_group()
    return out


def test_functional_and_plain_collectives_are_both_counted():
    results = run_distributed(_count, 2)
    for res in results:
        assert res["kinds"] == [("all_gather", 1), ("all_reduce", 2)], res["kinds"]
        assert res["groups"] == [(0, 1)]
        assert res["whole"] == list(range(8)) and res["total"] == [2.0, 2.0, 2.0]
        assert abs(res["norm"] - sum(i * i for i in range(8)) ** 0.5) < 1e-5
