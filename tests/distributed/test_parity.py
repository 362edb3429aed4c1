"""Parity: FSDP / HSDP training equals single-process training, step for step.

One model, one data order, one global batch of 16, 6 AdamW steps, fp32. World 1 is a plain
Lightning run in this process; worlds 2 and 4 are real gloo ranks under HSDPStrategy.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.helpers import (
    LossRecorder,
    RegressionModule,
    full_params,
    loader,
    rank_loader,
    make_dataset,
    max_rel_diff,
    run_distributed,
    trainer_kwargs,
)

GLOBAL_BATCH = 16
STEPS = 6


def reference(steps: int = STEPS, accumulate: int = 1) -> dict:
    seed_everything(0)
    model = RegressionModule()
    recorder = LossRecorder()
    trainer = Trainer(devices=1, max_steps=steps, callbacks=[recorder], accumulate_grad_batches=accumulate, **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(), GLOBAL_BATCH // accumulate))
    return {"params": full_params(model), "losses": recorder.losses}


def fit_worker(mesh_shape, world: int, steps: int = STEPS) -> dict:
    import hp_lightning  # noqa: F401 - registers the strategy

    seed_everything(0)
    model = RegressionModule()
    recorder = LossRecorder()
    strategy = hp_lightning.HSDPStrategy(mesh_shape=mesh_shape)
    trainer = Trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[recorder], **trainer_kwargs())
    trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH, world))
    layout = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        layout[name] = (tuple(p.placements), p.to_local().numel(), p.numel())
    return {
        "params": full_params(model),
        "losses": recorder.losses,
        "layout": layout,
        "mesh": (tuple(model.device_mesh.shape), tuple(model.device_mesh.mesh_dim_names)),
        "units": [type(u).__name__ for u in trainer.strategy.sharded_model.units],
    }


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.mark.parametrize(
    ("mesh_shape", "world", "placements"),
    [
        ([2], 2, (Shard(0),)),
        ([4], 4, (Shard(0),)),
        ([2, 2], 4, (Replicate(), Shard(0))),
    ],
    ids=["fsdp2", "fsdp4", "hsdp2x2"],
)
def test_matches_single_process(ref, mesh_shape, world, placements):
    results = run_distributed(fit_worker, world, mesh_shape, world)
    shard = mesh_shape[-1]
    for rank, res in enumerate(results):
        diff = max_rel_diff(res["params"], ref["params"])
        assert diff <= 1e-5, f"rank {rank}: max relative parameter difference {diff:.3e} > 1e-5"
        assert len(res["losses"]) == STEPS
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-7)
        assert res["units"] == ["HPFSDPBlock", "HPFSDPBlock"]
        for name, (pl, local, total) in res["layout"].items():
            assert pl == placements, (name, pl)
        held = sum(local for _, local, _ in res["layout"].values())
        total = sum(t for _, _, t in res["layout"].values())
        assert abs(held / total - 1 / shard) < 0.1, f"rank {rank} holds {held}/{total} parameters, expected ~1/{shard}"
    # The S ranks of each shard group hold disjoint pieces that add up to each whole parameter.
    for first in range(0, world, shard):
        group = results[first : first + shard]
        for name, (_, _, total) in results[0]["layout"].items():
            assert sum(r["layout"][name][1] for r in group) == total, name
    # Every rank agrees on the final model.
    for res in results[1:]:
        assert max_rel_diff(res["params"], results[0]["params"]) == 0.0
