"""The seed's fully_shard API on real gloo ranks: reduce op, scaling, replicate / ignored params,
HSDP topology, comm fusion, prefetch order, accumulation. World 2 FSDP and world 4 HSDP 2x2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_lightning.core.diagnostics import CollectiveCounter
from tests.helpers import TinyNet, make_dataset, run_distributed

N_SAMPLES = 16


def _data(rank: int, world: int):
    x, y = make_dataset(n=N_SAMPLES)[:]
    return x[rank::world], y[rank::world]


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def build(mesh, *, replicate: bool = True, ignore_inp_bias: bool = False, comm_fusion: bool = False, prefetch: bool = False):
    from hp_lightning import fully_shard

    torch.manual_seed(0)
    model = TinyNet(width=16, depth=3)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    replicate_params = {model.inp.weight, model.head.weight, model.head.bias} if replicate else None
    ignored = {model.inp.bias} if ignore_inp_bias else None
    fully_shard(model, mesh=mesh, replicate_params=replicate_params, ignored_params=ignored, comm_fusion=comm_fusion)
    if prefetch:
        blocks = list(model.blocks)
        for i, block in enumerate(blocks[:-1]):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
    return model


def step(model, x, y) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()


def api_worker(mesh_shape: list[int]) -> dict:
    from hp_lightning import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", mesh_shape)
    x, y = _data(rank, world)
    out: dict = {}

    # Reduce op and scaling factor, replicate params included.
    model = build(mesh)
    step(model, x, y)
    out["avg"] = _full_grads(model)
    model.zero_grad()
    model.set_reduce_op_type("sum")
    step(model, x, y)
    out["sum"] = _full_grads(model)
    model.zero_grad()
    model.set_reduce_op_type("avg")
    model.set_gradient_scaling_factor(0.5)
    step(model, x, y)
    out["avg_half"] = _full_grads(model)
    model.zero_grad()
    model.set_gradient_scaling_factor(None)
    step(model, x, y)
    out["avg_restored"] = _full_grads(model)
    out["replicate_is_whole"] = not isinstance(model.head.weight, DTensor) and tuple(model.head.weight.shape) == (4, 16)

    # Accumulation: sync off on the first half of the local batch, on for the second.
    model.zero_grad()
    half = x.shape[0] // 2
    model.set_requires_gradient_sync(False)
    with CollectiveCounter() as silent:
        step(model, x[:half], y[:half])
    model.set_requires_gradient_sync(True)
    step(model, x[half:], y[half:])
    out["accumulated"] = _full_grads(model)
    out["silent_gradient_collectives"] = silent.count("reduce_scatter") + silent.count("all_reduce")

    # Synced at every micro-batch with "sum" and a factor: each half is reduced once, the first
    # half's reduced gradient (already in .grad) never again.
    model.zero_grad()
    model.set_reduce_op_type("sum")
    model.set_gradient_scaling_factor(0.25)
    step(model, x[:half], y[:half])
    step(model, x[half:], y[half:])
    out["every_sum_quarter"] = _full_grads(model)
    model.set_reduce_op_type("avg")
    model.set_gradient_scaling_factor(None)

    # A replicate param replaced by hand after sharding (a new nn.Parameter, not through .to()):
    # its gradient is still averaged over every rank, not left local.
    model = build(mesh)
    model.head.bias = torch.nn.Parameter(model.head.bias.detach().clone())
    step(model, x, y)
    out["hand_replaced"] = _full_grads(model)

    # Training: replicate params identical across ranks and equal to the reference; ignored
    # params drift apart (each rank keeps its own gradient).
    model = build(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CollectiveCounter() as comms:
        for _ in range(3):
            step(model, x, y)
            opt.step()
            opt.zero_grad()
    out["trained"] = _full_params(model)
    out["groups"] = {k: comms.groups(k) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    out["world_all_reduces"] = comms.count("all_reduce", tuple(range(world)))
    model = build(mesh, ignore_inp_bias=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, x, y)
    opt.step()
    out["ignored_after_step"] = model.inp.bias.detach().clone()

    # Comm fusion: the root's replicate grads in one bucket instead of one per parameter.
    counts = {}
    for fused in (False, True):
        model = build(mesh, comm_fusion=fused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with CollectiveCounter() as comms:
            for _ in range(2):
                step(model, x, y)
                opt.step()
                opt.zero_grad()
        counts[fused] = comms.count("all_reduce", tuple(range(world)))
        out[f"fusion_{fused}_params"] = _full_params(model)
    out["fusion_counts"] = counts

    # Prefetch: with forward prefetch, block i+1 is gathered before block i computes.
    events: list[str] = []
    for prefetch in (False, True):
        model = build(mesh, replicate=False, prefetch=prefetch)
        sizes = {}
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: events.append(f"compute{i}"))
        with CollectiveCounter() as comms:
            comms.listeners.append(lambda call: events.append(f"gather:{call.bytes}") if call.kind == "all_gather" else None)
            model(x)
        block_gather_bytes = {c.bytes for c in comms.calls if c.kind == "all_gather"}
        sizes[prefetch] = block_gather_bytes
        out[f"events_{prefetch}"] = list(events)
        events.clear()
    dist.barrier()
    return out


def reference_grads() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet(width=16, depth=3)
    x, y = make_dataset(n=N_SAMPLES)[:]
    step(model, x, y)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_trained() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet(width=16, depth=3)
    x, y = make_dataset(n=N_SAMPLES)[:]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        step(model, x, y)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(a: dict, b: dict, scale: float = 1.0, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], scale * b[k], rtol=rtol, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mesh_shape", [[2], [2, 2], [2, 1]], ids=["fsdp2", "hsdp2x2", "hsdp2x1"])
def test_fully_shard_api(mesh_shape):
    world = 1
    for s in mesh_shape:
        world *= s
    results = run_distributed(api_worker, world, mesh_shape)
    ref = reference_grads()
    trained = reference_trained()
    for rank, res in enumerate(results):
        # avg equals the single-process full-batch gradient; sum is avg x DP size.
        _close(res["avg"], ref)
        _close(res["hand_replaced"], ref)
        _close(res["sum"], res["avg"], scale=world, rtol=1e-6)
        _close(res["avg_half"], res["avg"], scale=0.5, rtol=1e-6)
        _close(res["avg_restored"], res["avg"], rtol=1e-6)
        assert res["replicate_is_whole"]
        # Two half-batches accumulated without sync in between = twice the full-batch gradient.
        _close(res["accumulated"], ref, scale=2.0)
        # Halves (each the mean of half the batch: twice the full batch's share) summed, x 0.25.
        _close(res["every_sum_quarter"], res["sum"], scale=0.5, rtol=1e-6)
        assert res["silent_gradient_collectives"] == 0
        # Replicate params match the reference and every rank; ignored params are local.
        for name, value in res["trained"].items():
            torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-6, msg=name)
        # Topology: gathers and reduce-scatters inside shard groups; all-reduces across
        # replicate groups (FSDP gradients) or the whole DP domain (replicate params).
        shard = mesh_shape[-1]
        shard_groups = {tuple(range(g * shard, (g + 1) * shard)) for g in range(world // shard)}
        assert res["groups"]["all_gather"] <= shard_groups
        assert res["groups"]["reduce_scatter"] <= shard_groups
        if len(mesh_shape) == 2:
            replicate_groups = {tuple(range(s, world, shard)) for s in range(shard)}
            assert res["groups"]["all_reduce"] <= replicate_groups | {tuple(range(world))}
        if shard > 1:  # (with a one-rank shard group the FSDP gradients' all-reduce spans the world too)
            # 3 whole params reduced separately, 3 steps.
            assert res["world_all_reduces"] == 9
            # Comm fusion: 1 bucket instead of 3 per backward, same numbers.
            assert res["fusion_counts"] == {False: 6, True: 2}
        _close(res["fusion_True_params"], res["fusion_False_params"], rtol=1e-6)
        if shard == 1:
            continue  # no all-gather on a one-rank shard group: nothing to prefetch
        # Prefetch: without it, each block is gathered right before it computes; with it, the
        # next block's gather is issued before the current block computes.
        plain = [e for e in res["events_False"]]
        fetched = [e for e in res["events_True"]]
        assert plain.index("compute0") < [i for i, e in enumerate(plain) if e.startswith("gather")][2]
        gathers_before_compute0 = sum(1 for e in fetched[: fetched.index("compute0")] if e.startswith("gather"))
        assert gathers_before_compute0 == sum(1 for e in plain[: plain.index("compute0")] if e.startswith("gather")) + 1
    ignored = [res["ignored_after_step"] for res in results]
    assert not torch.allclose(ignored[0], ignored[1]), "ignored params must not be synchronized"
