"""Strategy options on real gloo ranks (world 2 FSDP): precision policies, CPU offload, activation
checkpointing, reshard_after_forward, and the seed-API options set from the strategy's arguments."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.tensor import DTensor, Shard

from hp_lightning.core.diagnostics import CollectiveCounter
from tests.helpers import Block, RegressionModule, full_params, loader, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs

GLOBAL_BATCH = 16
STEPS = 2


class ForwardCalling(RegressionModule):
    """training_step goes through ``self(x)``: a forward nested in the registered step method."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class DtypeProbe(RegressionModule):
    """Records the dtype the blocks compute in and the dtype of the sharded weights."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net.inp(x)
        self.compute_dtype = self.net.blocks[0](h).dtype
        return super().training_step(batch, batch_idx)


def fit(strategy, module=None, precision="32-true", **trainer_args):
    """Fit 2 steps; ``module`` must have been built right after ``seed_everything(0)``."""
    if module is None:
        seed_everything(0)
        module = RegressionModule()
    model = module
    trainer = Trainer(devices=2, strategy=strategy, max_steps=STEPS, precision=precision, **trainer_kwargs(**trainer_args))
    with CollectiveCounter() as comms:
        trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH, 2))
    return model, comms, trainer


def options_worker() -> dict:
    from hp_lightning import HSDPStrategy

    out: dict = {}
    # bf16-mixed: fp32 shards, bf16 compute, fp32 gradient reduction.
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2]), DtypeProbe(), precision="bf16-mixed")
    out["bf16_mixed"] = {
        "shard_dtype": model.net.blocks[0].fc1.weight.dtype,
        "compute_dtype": model.compute_dtype,
        "reduce_dtypes": {c.dtype for c in comms.calls if c.kind == "reduce_scatter"},
        "gather_dtypes": {c.dtype for c in comms.calls if c.kind == "all_gather"},
    }
    # bf16-true: everything bf16.
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2]), DtypeProbe(), precision="bf16-true")
    out["bf16_true"] = {
        "shard_dtype": model.net.blocks[0].fc1.weight.dtype,
        "compute_dtype": model.compute_dtype,
        "reduce_dtypes": {c.dtype for c in comms.calls if c.kind == "reduce_scatter"},
    }
    # Explicit dtype strings override the precision flag.
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2], param_dtype="bf16", reduce_dtype="fp32"), DtypeProbe())
    out["explicit"] = {"compute_dtype": model.compute_dtype, "reduce_dtypes": {c.dtype for c in comms.calls if c.kind == "reduce_scatter"}}

    # fp32 options that must not change the numbers.
    numerics = {}
    model, comms, trainer = fit(HSDPStrategy(mesh_shape=[2], cpu_offload=True))
    numerics["cpu_offload"] = full_params(model)
    out["offload_policy"] = type(trainer.strategy.sharding_plan().offload_policy).__name__
    calls = {"n": 0}

    class Counting(Block):
        pass

    seed_everything(0)
    model = RegressionModule()
    for block in model.net.blocks:
        block.__class__ = Counting
        block.fc1.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2], activation_checkpointing=["Counting"]), model)
    numerics["activation_checkpointing"] = full_params(model)
    out["ac_fc1_forwards"] = calls["n"]
    for reshard in (True, False):
        model, comms, _ = fit(HSDPStrategy(mesh_shape=[2], reshard_after_forward=reshard, prefetch=0))
        numerics[f"reshard_{reshard}"] = full_params(model)
        out[f"reshard_{reshard}_gathers"] = comms.count("all_gather")
    # Seed options from the strategy's arguments: sum x 0.5 over 2 ranks == avg.
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2], reduce_op="sum", gradient_scaling_factor=0.5))
    numerics["sum_half"] = full_params(model)
    model, comms, _ = fit(
        HSDPStrategy(mesh_shape=[2], replicate_params=["net.head.*"], comm_fusion=True, shard_placement={"*.fc1.weight": 1}, prefetch=2)
    )
    numerics["replicate_placement"] = full_params(model)
    out["head_is_whole"] = not isinstance(model.net.head.weight, DTensor)
    fc1 = model.net.blocks[0].fc1.weight
    out["fc1_placement"] = tuple(fc1.placements)
    out["head_all_reduces"] = comms.count("all_reduce", (0, 1))
    out["numerics"] = numerics
    # A step that calls self(x): the root is still gathered once per step (forward only), the
    # two blocks twice (forward + backward, reshard_after_forward=True).
    seed_everything(0)
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2]), ForwardCalling())
    numerics["forward_calling"] = full_params(model)
    out["forward_calling_gathers"] = comms.count("all_gather")
    # Clipping by value works elementwise on the local shards and whole tensors alike.
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2], replicate_params=["net.head.*"]), gradient_clip_val=0.01, gradient_clip_algorithm="value")
    out["clip_value"] = full_params(model)
    # sharding_report=True logs the table (rank 0) at setup.
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    fit(HSDPStrategy(mesh_shape=[2], sharding_report=True))
    out["report_lines"] = [r for r in records if "net.blocks.0" in r]
    # ignored_params from the strategy: whole on every rank, never synchronized. HSDP 2 x 1 with
    # clipping: the ignored gradients differ per rank, yet the two replicas of every shard agree.
    model, comms, _ = fit(HSDPStrategy(mesh_shape=[2, 1], ignored_params=["net.inp.bias"]), gradient_clip_val=0.01)
    out["ignored_whole"] = not isinstance(model.net.inp.bias, DTensor)
    out["ignored_value"] = model.net.inp.bias.detach().clone()
    out["replica_shards"] = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return out


def reference(steps: int = STEPS, **trainer_args) -> dict:
    seed_everything(0)
    model = RegressionModule()
    trainer = Trainer(devices=1, max_steps=steps, **trainer_kwargs(**trainer_args))
    trainer.fit(model, loader(make_dataset(), GLOBAL_BATCH))
    return full_params(model)


def test_strategy_options():
    results = run_distributed(options_worker, 2)
    ref = reference()
    for res in results:
        mixed = res["bf16_mixed"]
        assert mixed["shard_dtype"] == torch.float32 and mixed["compute_dtype"] == torch.bfloat16
        assert mixed["reduce_dtypes"] == {torch.float32} and mixed["gather_dtypes"] == {torch.bfloat16}
        true = res["bf16_true"]
        assert true["shard_dtype"] == torch.bfloat16 and true["compute_dtype"] == torch.bfloat16
        assert true["reduce_dtypes"] == {torch.bfloat16}
        assert res["explicit"]["compute_dtype"] == torch.bfloat16 and res["explicit"]["reduce_dtypes"] == {torch.float32}
        assert res["offload_policy"] == "CPUOffloadPolicy"
        # Activation checkpointing runs each block's forward twice per step (forward + recompute).
        assert res["ac_fc1_forwards"] == 2 * 2 * STEPS
        # reshard_after_forward=False saves the backward re-gather of both blocks every step.
        assert res["reshard_True_gathers"] - res["reshard_False_gathers"] == 2 * STEPS
        assert res["head_is_whole"] and res["fc1_placement"] == (Shard(1),)
        # head.weight + head.bias fused into one all-reduce per step.
        assert res["head_all_reduces"] >= STEPS
        for name, params in res["numerics"].items():
            assert max_rel_diff(params, ref) <= 1e-5, name
        assert res["ignored_whole"]
        assert res["forward_calling_gathers"] == (1 + 2 * 2) * STEPS
    assert results[0]["report_lines"], "rank 0 logs the sharding report"
    clipped = reference(gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert max_rel_diff(clipped, ref) > 1e-3, "the clip value must change the result"
    for res in results:
        assert max_rel_diff(res["clip_value"], clipped) <= 1e-5
    # Each rank trained its own copy of the ignored bias on its own data.
    assert not torch.allclose(results[0]["ignored_value"], results[1]["ignored_value"])
    # One clipping coefficient on every rank: replicas of each shard stay equal.
    shards = [res["replica_shards"] for res in results]
    assert shards[0] and all(torch.equal(shards[0][n], shards[1][n]) for n in shards[0]), "HSDP replicas diverged"
