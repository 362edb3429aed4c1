"""Sharding a user applied in ``configure_model`` is respected: the strategy shards only the rest.

Three ways a user shards by hand, in one launch of 2 gloo ranks, each compared with the same
model trained in one process: every block with ``hp_lightning.fully_shard``, half the blocks
(the strategy does the other half and the root), every block with torch's own ``fully_shard``.
A fourth module builds and shards its model on the meta device: nothing may stay on it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from tests.helpers import (
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
STEPS = 4
WORLD = 2


class ShardsItsBlocks(RegressionModule):
    """Builds its net in ``__init__`` (so its init equals the reference's) and shards blocks in ``configure_model``."""

    def __init__(self, which: str) -> None:
        super().__init__(depth=2)
        self.which = which

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        import hp_lightning

        blocks = list(self.net.blocks) if self.which != "half" else [self.net.blocks[0]]
        for block in blocks:
            if self.which == "torch":
                torch_fully_shard(block, mesh=self.device_mesh)
            else:
                hp_lightning.fully_shard(block, mesh=self.device_mesh)


class BuildsAndShardsOnMeta(RegressionModule):
    """The ModelParallelStrategy habit: build in configure_model (on the meta device), shard there."""

    def __init__(self) -> None:
        super().__init__(depth=2)
        del self.net

    def configure_model(self) -> None:
        import hp_lightning

        self.net = TinyNet(depth=2)
        for block in self.net.blocks:
            hp_lightning.fully_shard(block, mesh=self.device_mesh)


class MetricOnMeta(RegressionModule):
    """A torchmetrics metric created in configure_model: its defaults would have no values."""

    def configure_model(self) -> None:
        import torchmetrics

        self.val_mse = torchmetrics.MeanSquaredError()


def reference() -> dict:
    seed_everything(0)
    model = RegressionModule(depth=2)
    recorder = LossRecorder()
    trainer = Trainer(devices=1, max_steps=STEPS, callbacks=[recorder], **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(), GLOBAL_BATCH))
    return {"params": full_params(model), "losses": recorder.losses}


def _fit(model, **strategy_options) -> dict:
    import hp_lightning

    recorder = LossRecorder()
    strategy = hp_lightning.HSDPStrategy(mesh_shape=[WORLD], **strategy_options)
    trainer = Trainer(devices=WORLD, strategy=strategy, max_steps=STEPS, callbacks=[recorder], **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH, WORLD))
    names = {id(m): n for n, m in model.named_modules()}
    return {
        "params": full_params(model),
        "losses": recorder.losses,
        "units": [names[id(u)] for u in strategy.sharded_model.units],
        "controls": all(isinstance(u, hp_lightning.HSDPModule) for u in strategy.sharded_model.units),
        "meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "finite": all(bool(torch.isfinite(t).all()) for t in full_params(model).values()),
        "warnings": [str(w.message) for w in caught if "already sharded" in str(w.message)],
    }


def worker() -> dict:
    out = {}
    for which in ("all", "half", "torch"):
        seed_everything(0)
        # "half": a replicate pattern inside the user's unit cannot be honoured; a warning says so.
        options = {"replicate_params": ["net.blocks.0.norm.*"]} if which == "half" else {}
        out[which] = _fit(ShardsItsBlocks(which), **options)
    seed_everything(0)
    out["meta"] = _fit(BuildsAndShardsOnMeta())
    try:
        _fit(MetricOnMeta(), fault_watchdog=False)
        out["metric"] = "trained"
    except ValueError as exc:
        out["metric"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    return reference(), run_distributed(worker, WORLD, timeout=300)


@pytest.mark.parametrize("which", ["all", "half", "torch"])
def test_user_units_train_like_one_process(runs, which):
    ref, results = runs
    for rank, res in enumerate(r[which] for r in results):
        diff = max_rel_diff(res["params"], ref["params"])
        assert diff <= 1e-5, f"{which}, rank {rank}: max relative parameter difference {diff:.3e}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-7)
        # The user's units and the strategy's are one list, in forward order; all have the controls.
        assert res["units"] == ["net.blocks.0", "net.blocks.1"]
        assert res["controls"]
        assert res["meta"] == []


def test_unhonourable_option_warns(runs):
    _, results = runs
    for res in results:
        assert any("net.blocks.0.norm.weight" in w for w in res["half"]["warnings"]), res["half"]["warnings"]
        assert res["all"]["warnings"] == []


def test_metric_built_on_meta_is_refused_with_the_fix(runs):
    _, results = runs
    for res in results:
        assert "'val_mse' (MeanSquaredError) was created on the meta device" in res["metric"], res["metric"]
        assert "Create metrics in your LightningModule's __init__" in res["metric"]


def test_meta_built_user_units_are_materialized(runs):
    _, results = runs
    for res in results:
        assert res["meta"]["meta"] == [], res["meta"]["meta"]
        assert res["meta"]["finite"]
        assert res["meta"]["units"] == ["net.blocks.0", "net.blocks.1"]
        assert len(res["meta"]["losses"]) == STEPS and all(l == l for l in res["meta"]["losses"])
