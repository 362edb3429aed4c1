"""Every function and runtime control of the seed API rejects bad arguments with a clear error.

Runs in one spawned single-rank gloo process (the controls need a sharded module, which needs a
process group); no test here can hang on a collective.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import TinyNet, run_distributed


def validation_worker() -> list[tuple[str, str, str]]:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from hp_lightning import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, init_device_mesh
    from hp_lightning.fully_shard.policies import build_mp_policy

    dist.init_process_group("gloo")
    mesh1 = init_device_mesh("cpu", (1,))
    mesh2 = init_device_mesh("cpu", (1, 1))
    model = TinyNet()
    other = nn.Linear(2, 2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh1)
    fully_shard(model, mesh=mesh1)
    hsdp = fully_shard(TinyNet(), mesh=mesh2)
    replicated = nn.Linear(2, 2)
    fully_shard(replicated, mesh=mesh1, replicate_params={replicated.bias})
    from hp_lightning.parallel.pipeline import PipelineRunner

    half_reduce = fully_shard(nn.Linear(2, 2), mesh=mesh1, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16))

    cases = {
        "fully_shard(non-module)": lambda: fully_shard("model"),
        "fully_shard([])": lambda: fully_shard([]),
        "fully_shard(twice)": lambda: fully_shard(model.blocks[0], mesh=mesh1),
        "fully_shard(mesh=str)": lambda: fully_shard(nn.Linear(2, 2), mesh="cpu"),
        "fully_shard(3-D mesh)": lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))),
        "fully_shard(reshard=str)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, reshard_after_forward="no"),
        "fully_shard(comm_fusion=int)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, comm_fusion=1),
        "fully_shard(placement_fn=int)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, shard_placement_fn=3),
        "fully_shard(placement_fn returns int)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, shard_placement_fn=lambda p: 1),
        "fully_shard(placement_fn dim out of range)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, shard_placement_fn=lambda p: Shard(5)),
        "fully_shard(mp_policy=dict)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, mp_policy={"param_dtype": "bf16"}),
        "fully_shard(offload_policy=True)": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, offload_policy=True),
        "fully_shard(ignored_params=tensor)": lambda: fully_shard(other, mesh=mesh1, ignored_params=other.weight),
        "fully_shard(replicate_params=[tensor])": lambda: fully_shard(nn.Linear(2, 2), mesh=mesh1, replicate_params=[torch.zeros(2)]),
        "fully_shard(both sets)": lambda: fully_shard(other, mesh=mesh1, ignored_params={other.weight}, replicate_params={other.weight}),
        "set_requires_gradient_sync(int)": lambda: model.set_requires_gradient_sync(1),
        "set_requires_gradient_sync(recurse=str)": lambda: model.set_requires_gradient_sync(True, recurse="yes"),
        "set_requires_all_reduce(str)": lambda: hsdp.set_requires_all_reduce("no"),
        "set_reshard_after_forward(None)": lambda: model.set_reshard_after_forward(None),
        "set_reshard_after_backward(str)": lambda: model.set_reshard_after_backward("true"),
        "set_modules_to_forward_prefetch(module)": lambda: model.blocks[0].set_modules_to_forward_prefetch(model.blocks[1]),
        "set_modules_to_forward_prefetch([unsharded])": lambda: model.blocks[0].set_modules_to_forward_prefetch([other]),
        "set_modules_to_backward_prefetch(int)": lambda: model.blocks[1].set_modules_to_backward_prefetch(3),
        "set_gradient_scaling_factor(str)": lambda: model.set_gradient_scaling_factor("0.5"),
        "set_gradient_scaling_factor(bool)": lambda: model.set_gradient_scaling_factor(True),
        "set_gradient_scaling_factor(0)": lambda: model.set_gradient_scaling_factor(0),
        "set_gradient_scaling_factor(nan)": lambda: model.set_gradient_scaling_factor(float("nan")),
        # torch's FSDP2 divides twice on a one-rank shard group when reducing in float16: refused.
        "set_gradient_scaling_factor(one-rank unit, float16 reduce)": lambda: half_reduce.set_gradient_scaling_factor(0.5),
        "PipelineRunner(stage with replicate_params)": lambda: PipelineRunner(
            replicated, stage_index=0, num_stages=2, device=torch.device("cpu"), group=dist.group.WORLD, schedule="gpipe",
            microbatches=2, loss_fn=lambda out, target: out.sum(),
        ),
        "set_reduce_op_type(mean)": lambda: model.set_reduce_op_type("mean"),
        "set_reduce_op_type(ReduceOp)": lambda: model.set_reduce_op_type(dist.ReduceOp.SUM),
        "unshard(async_op=str)": lambda: model.unshard(async_op="yes"),
        "init_device_mesh(-1)": lambda: init_device_mesh("cpu", (-1,)),
        "build_mp_policy(int8)": lambda: build_mp_policy(param_dtype="int8"),
    }
    out = []
    for name, call in cases.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            out.append((name, "TypeError" if isinstance(exc, TypeError) else "ValueError", str(exc)))
        else:
            out.append((name, "no error", ""))
    # Valid calls still work after all that.
    model.set_gradient_scaling_factor(0.25)
    model.set_reduce_op_type("SUM")
    handle = model.unshard(async_op=True)
    handle.wait()
    model.reshard()
    _ = CPUOffloadPolicy(), MixedPrecisionPolicy()
    dist.barrier()
    return out


def test_every_invalid_argument_raises_a_clear_error():
    (results,) = run_distributed(validation_worker, 1)
    missing = [name for name, kind, _ in results if kind == "no error"]
    assert not missing, f"accepted bad input: {missing}"
    for name, kind, message in results:
        assert kind in ("TypeError", "ValueError"), (name, kind)
        # Each message says what was expected and what came.
        assert "expect" in message or "must" in message or "needs" in message, (name, message)
        assert "got" in message, (name, message)
    assert len(results) >= 30
