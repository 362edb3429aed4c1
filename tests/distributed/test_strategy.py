"""HSDPStrategy end to end on real gloo ranks: accumulation, clipping, eval entry points, multi-node
meshes, meta-device init, metrics. Each test is one multi-process launch running several checks."""

from __future__ import annotations

import weakref

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hp_lightning.core.diagnostics import CollectiveCounter
from tests.helpers import (
    Block,
    LossRecorder,
    RegressionModule,
    TinyNet,
    full_params,
    loader,
    make_dataset,
    max_rel_diff,
    rank_loader,
    run_distributed,
    trainer_kwargs,
)

GLOBAL_BATCH = 16
SHARD_GROUPS = {(0, 1), (2, 3)}
REPLICATE_GROUPS = {(0, 2), (1, 3)}


class NormRecorder(Callback):
    """The global gradient norm before clipping, at every optimizer step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from hp_lightning.core.gradients import total_grad_norm

        self.norms.append(float(total_grad_norm(pl_module.parameters())))


class EvalModule(RegressionModule):
    """Every entry point calls ``self.net`` directly; ``generate`` is a custom method."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.head(self.net.inp(x))


def reference_fit(steps: int, accumulate: int = 1, clip: float | None = None) -> dict:
    seed_everything(0)
    model = RegressionModule()
    norms = NormRecorder()
    trainer = Trainer(
        devices=1, max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        callbacks=[norms], **trainer_kwargs(),
    )
    trainer.fit(model, loader(make_dataset(), GLOBAL_BATCH // accumulate))
    return {"params": full_params(model), "norms": norms.norms, "model": model}


def hsdp_worker() -> dict:
    from hp_lightning import HSDPStrategy

    out: dict = {"accumulation": {}}
    # 1. Gradient accumulation: collectives per optimizer step, k = 1, 2, 4.
    for k in (1, 2, 4):
        seed_everything(0)
        model = RegressionModule()
        trainer = Trainer(
            devices=4, strategy=HSDPStrategy(mesh_shape=[2, 2]), max_steps=2, accumulate_grad_batches=k, **trainer_kwargs()
        )
        with CollectiveCounter() as comms:
            trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH // k, 4))
        out["accumulation"][k] = {
            "reduce_scatter": comms.count("reduce_scatter"),
            "reduce_scatter_groups": comms.groups("reduce_scatter"),
            "grad_all_reduce": sum(comms.count("all_reduce", g) for g in REPLICATE_GROUPS),
            "all_reduce_groups": comms.groups("all_reduce"),
            "params": full_params(model),
        }
    # 2. Clipping by norm: the norm is the global one and the clipped update matches.
    seed_everything(0)
    model = RegressionModule()
    norms = NormRecorder()
    trainer = Trainer(
        devices=4, strategy=HSDPStrategy(mesh_shape=[2, 2]), max_steps=3, gradient_clip_val=0.05, callbacks=[norms],
        **trainer_kwargs(),
    )
    trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH, 4))
    out["clip"] = {"norms": norms.norms, "params": full_params(model)}
    # 3. Evaluation entry points and a custom method on the same sharded model.
    seed_everything(0)
    model = EvalModule()
    trainer = Trainer(devices=4, strategy=HSDPStrategy(mesh_shape=[2, 2]), **trainer_kwargs())
    data = rank_loader(make_dataset(), GLOBAL_BATCH, 4)
    out["validate"] = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    out["test"] = trainer.test(model, data, verbose=False)[0]["test_loss"]
    out["predict"] = torch.cat(trainer.predict(model, data))
    out["generate"] = model.generate(make_dataset()[:4][0]).detach()
    return out


def test_hsdp_accumulation_clipping_and_eval_entry_points():
    results = run_distributed(hsdp_worker, 4)
    # Gradient accumulation: one reduce-scatter (shard group) and one all-reduce (replicate
    # group) per unit and optimizer step, whatever k is: 3 units (2 blocks + root) x 2 steps.
    for k in (1, 2, 4):
        ref = reference_fit(steps=2, accumulate=k)
        for rank, res in enumerate(results):
            acc = res["accumulation"][k]
            assert acc["reduce_scatter"] == 6, (k, rank, acc["reduce_scatter"])
            assert acc["grad_all_reduce"] == 6, (k, rank, acc["grad_all_reduce"])
            assert acc["reduce_scatter_groups"] <= SHARD_GROUPS
            assert max_rel_diff(acc["params"], ref["params"]) <= 1e-5, k
    # Clipping: same global pre-clip norms as one process, same clipped parameters.
    ref = reference_fit(steps=3, clip=0.05)
    assert all(n > 0.05 for n in ref["norms"]), "the clip value must actually clip"
    for res in results:
        assert res["clip"]["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert max_rel_diff(res["clip"]["params"], ref["params"]) <= 1e-5
    # Eval entry points on the untrained model equal a plain single-process computation.
    seed_everything(0)
    plain = EvalModule()
    x, y = make_dataset()[:]
    with torch.no_grad():
        expected_loss = float(torch.nn.functional.mse_loss(plain.net(x), y))
        expected_generate = plain.generate(x[:4])
    for rank, res in enumerate(results):
        assert res["validate"] == pytest.approx(expected_loss, rel=1e-5)
        assert res["test"] == pytest.approx(expected_loss, rel=1e-5)
        # DistributedSampler(shuffle=False): rank r predicts samples r, r+4, ...
        with torch.no_grad():
            expected_pred = plain.net(x[rank::4])
        torch.testing.assert_close(res["predict"], expected_pred, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["generate"], expected_generate, rtol=1e-5, atol=1e-6)


def multinode_worker() -> dict:
    import hp_lightning  # noqa: F401

    seed_everything(0)
    model = RegressionModule()
    trainer = Trainer(devices=2, num_nodes=2, strategy="hsdp", max_steps=1, **trainer_kwargs())
    with CollectiveCounter() as comms:
        trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH, 4))
    return {
        "mesh": tuple(model.device_mesh.shape),
        "names": model.device_mesh.mesh_dim_names,
        "node_rank": trainer.node_rank,
        "all_gather_groups": comms.groups("all_gather"),
        "reduce_scatter_groups": comms.groups("reduce_scatter"),
        "all_reduce_groups": comms.groups("all_reduce"),
    }


def test_two_nodes_give_automatic_hsdp_mesh_with_shard_groups_inside_nodes():
    results = run_distributed(multinode_worker, 4, local_world_size=2)
    for rank, res in enumerate(results):
        assert res["mesh"] == (2, 2) and res["names"] == ("replicate", "shard")
        assert res["node_rank"] == rank // 2
        # All-gathers and reduce-scatters stay inside a node; gradient all-reduces cross nodes.
        node_group = (2 * (rank // 2), 2 * (rank // 2) + 1)
        assert res["all_gather_groups"] == {node_group}
        assert res["reduce_scatter_groups"] == {node_group}
        assert (rank % 2, rank % 2 + 2) in res["all_reduce_groups"]


class MetaModule(LightningModule):
    """Builds its layers in configure_model, so they are created on the meta device."""

    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        import torchmetrics

        self.val_mse = torchmetrics.MeanSquaredError()

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        self.net = TinyNet(width=self.width, depth=self.depth)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mse(self.net(x), y)
        self.log("val_mse", self.val_mse)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class AllocationTracker(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once among those created while active, and the largest one.

    Initialization runs on full-size temporaries one tensor at a time (each rank then keeps its
    shard), so the peak of live storage, not the sum of all allocations, is the memory bound.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.largest = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and storage.nbytes() > 0:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    self.largest = max(self.largest, storage.nbytes())
                    weakref.finalize(storage, self._freed, key)
        return out


def meta_worker() -> dict:
    from hp_lightning import HSDPStrategy

    class Measured(HSDPStrategy):
        def setup(self, trainer):
            # A sentinel default: materialization (to_empty) must keep the metric's defaults and
            # reset its state from them, not leave uninitialized memory behind.
            metric = trainer.lightning_module.val_mse
            metric._defaults["sum_squared_error"].fill_(7.0)
            with AllocationTracker() as tracker:
                super().setup(trainer)
            self.setup_bytes, self.setup_largest = tracker.peak, tracker.largest
            self.metric_state_after_setup = float(metric.sum_squared_error)
            metric._defaults["sum_squared_error"].zero_()
            metric.reset()

    seed_everything(0)
    model = MetaModule()
    recorder = LossRecorder()
    strategy = Measured(mesh_shape=[2])
    trainer = Trainer(devices=2, strategy=strategy, max_epochs=4, callbacks=[recorder], **trainer_kwargs())
    data = make_dataset(n=64)
    trainer.fit(model, rank_loader(data, GLOBAL_BATCH, 2), rank_loader(data, GLOBAL_BATCH, 2))
    weight = model.net.blocks[0].fc1.weight
    return {
        "setup_bytes": strategy.setup_bytes,
        "setup_largest": strategy.setup_largest,
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
        "local_weight": weight.to_local().detach().clone(),
        "all_dtensor": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)] == [],
        "non_dtensor": [(n, type(p).__name__, str(p.device)) for n, p in model.named_parameters() if not isinstance(p, DTensor)],
        "losses": recorder.losses,
        "val_mse": float(trainer.callback_metrics["val_mse"]),
        "metric_device": str(model.val_mse.device),
        "metric_state_after_setup": strategy.metric_state_after_setup,
    }


def test_meta_init_allocates_only_local_shards_and_trains():
    results = run_distributed(meta_worker, 2)
    for res in results:
        assert res["all_dtensor"], res["non_dtensor"]
        # At its peak, setup holds this rank's shards (1/2 of the model) and a few full-size
        # temporaries of one tensor each: never the whole model.
        assert res["setup_bytes"] <= 0.5 * res["model_bytes"] + 3 * res["largest_param_bytes"] + 64 * 1024, (res["setup_bytes"], res["model_bytes"])
        assert res["setup_largest"] <= res["largest_param_bytes"] + 64
        assert res["losses"][-1] < 0.7 * res["losses"][0], res["losses"]
        assert res["metric_device"] == "cpu"
        assert res["metric_state_after_setup"] == 7.0
    # Shards of one weight differ (independent init per shard, not one shard copied).
    a, b = results[0]["local_weight"], results[1]["local_weight"]
    assert a.shape == b.shape and not torch.allclose(a, b)
    # The synced metric is the same number on both ranks.
    assert results[0]["val_mse"] == pytest.approx(results[1]["val_mse"], rel=1e-6)
