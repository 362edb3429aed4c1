"""Callbacks on real gloo ranks: HSDP 2x2 (4 ranks), accumulate_grad_batches=4.

One 4-rank launch trains every configuration in sequence (each a fresh Trainer and model), counts
collectives at the torch.distributed call, measures gradient bytes after each backward and
returns the final parameters; the test compares them with single-process Lightning references.

Collectives are attributed to units by payload: for a unit holding ``b`` bytes per rank on a
(2, 2) mesh, its reduce-scatter moves ``2b`` bytes over its shard group, its all-reduce ``b``
bytes over its replicate group, its all-gather ``2b`` bytes. The model's two blocks have equal
size, the root (input projection + head) a different one.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from tests.helpers import RegressionModule, full_params, loader, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs

WORLD = 4
MESH = [2, 2]
K = 4
MICRO_BATCH = 8  # global samples per micro-batch (2 per rank)
N_SAMPLES = 64  # 8 micro-batches per epoch: 2 optimizer steps at k=4


def scaling_by_step(trainer: Any, pl_module: Any, batch: Any) -> float:
    """A factor that changes every optimizer step (same on every rank): 1/2, 1/3, ..."""
    return 1.0 / (trainer.global_step + 2)


class StepScaledLoss(RegressionModule):
    """Single-process reference for GradientScaling(scaling_by_step): the loss scaled instead."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * scaling_by_step(self.trainer, self, batch)


class ManualAccumulation(RegressionModule):
    """Manual optimization with micro_batch_sync; same math as automatic accumulation over K."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        from hp_lightning.callbacks import micro_batch_sync

        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y) / K
        last = (batch_idx + 1) % K == 0
        with micro_batch_sync(self.trainer, last_micro_batch=last):
            self.manual_backward(loss)
        if last:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()


class StepCollectives(Callback):
    """Collectives of each optimizer step (its whole window), split by kind and process group."""

    def __init__(self, comms: Any, shard_group: tuple[int, ...], replicate_group: tuple[int, ...]) -> None:
        self.comms = comms
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.steps: list[dict[str, Counter]] = []

    def on_train_start(self, trainer, pl_module):
        self.comms.reset()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        calls = self.comms.calls
        self.steps.append({
            "reduce_scatter": Counter(c.bytes for c in calls if c.kind == "reduce_scatter" and c.ranks == self.shard_group),
            "all_reduce": Counter(c.bytes for c in calls if c.kind == "all_reduce" and c.ranks == self.replicate_group),
            "all_gather": Counter(c.bytes for c in calls if c.kind == "all_gather" and c.ranks == self.shard_group),
        })
        self.comms.reset()


def _local_bytes(params) -> int:
    """Bytes of the local shards, straight from the DTensors."""
    return sum(p.to_local().numel() * p.to_local().element_size() for p in params)


def _train(module, callbacks, *, epochs: int = 1, accumulate: int = K, sync_mode: str | None = None) -> dict:
    import hp_lightning
    from hp_lightning.callbacks import GradientAccumulationSync, GradientMemoryMonitor
    from hp_lightning.core.diagnostics import CollectiveCounter

    rank = int(os.environ["RANK"])
    shard_group = tuple(range(rank - rank % 2, rank - rank % 2 + 2))
    replicate_group = (rank % 2, rank % 2 + 2)
    monitor = GradientMemoryMonitor()
    with CollectiveCounter() as comms:
        recorder = StepCollectives(comms, shard_group, replicate_group)
        extra = [GradientAccumulationSync(sync_mode)] if sync_mode else []
        trainer = Trainer(
            devices=WORLD,
            strategy=hp_lightning.HSDPStrategy(mesh_shape=MESH),
            max_epochs=epochs,
            accumulate_grad_batches=accumulate,
            callbacks=[recorder, monitor, *extra, *callbacks],
            **trainer_kwargs(),
        )
        trainer.fit(module, rank_loader(make_dataset(N_SAMPLES), MICRO_BATCH, WORLD))
    sharded = trainer.strategy.sharded_model
    names = {id(m): n or "<root>" for n, m in module.named_modules()}
    inner = {id(p) for u in sharded.units for p in u.parameters()}
    unit_bytes = {names[id(u)]: _local_bytes(u.parameters()) for u in sharded.units}
    unit_bytes["<root>"] = _local_bytes(p for p in module.parameters() if id(p) not in inner)
    return {
        "params": full_params(module),
        "steps": recorder.steps,
        "grad_bytes": monitor.per_backward,
        "unit_bytes": unit_bytes,
    }


def _validate(module, callbacks) -> dict:
    """trainer.validate on the 2x2 mesh; all-gathers of the whole run, and whether units end resharded."""
    import hp_lightning
    from hp_lightning.core.diagnostics import CollectiveCounter
    from torch.distributed.tensor import DTensor

    with CollectiveCounter() as comms:
        trainer = Trainer(devices=WORLD, strategy=hp_lightning.HSDPStrategy(mesh_shape=MESH), callbacks=callbacks, **trainer_kwargs())
        trainer.validate(module, rank_loader(make_dataset(N_SAMPLES), MICRO_BATCH, WORLD))
    rank = int(os.environ["RANK"])
    shard_group = (rank - rank % 2, rank - rank % 2 + 1)
    return {
        "all_gather": Counter(c.bytes for c in comms.calls if c.kind == "all_gather" and c.ranks == shard_group),
        "resharded_at_end": all(isinstance(p, DTensor) for p in module.parameters()),
    }


def worker(report_path: str) -> dict[str, Any]:
    import hp_lightning
    from hp_lightning.callbacks import GradientScaling, ReshardSchedule, ShardingReport

    out: dict[str, Any] = {}
    for mode in ("skip", "every", "defer_all_reduce"):
        seed_everything(0)
        report = ShardingReport(log_table=False)
        out[mode] = _train(RegressionModule(), [report], sync_mode=mode)
        out[mode]["report"] = report.summary
    for train, keep in ((True, True), (False, False), (False, True)):
        seed_everything(0)
        out[("reshard", train, keep)] = _train(RegressionModule(), [ReshardSchedule(train=train, keep_unsharded_between_micro_batches=keep)])
    out[("reshard", True, False)] = out["skip"]  # the strategy's default: reshard after forward, not kept
    seed_everything(0)
    out["scheduler"] = _train(
        RegressionModule(), [GradientAccumulationScheduler({0: 2, 1: 4})], epochs=2, accumulate=1, sync_mode="defer_all_reduce"
    )
    seed_everything(0)
    out["scaling"] = _train(RegressionModule(optimizer="sgd"), [GradientScaling(factor=scaling_by_step)], sync_mode="every")
    seed_everything(0)
    out["manual"] = _train(
        ManualAccumulation(), [ReshardSchedule(keep_unsharded_between_micro_batches=True)], accumulate=1, sync_mode="defer_all_reduce"
    )
    # Evaluation: each unit gathered once per batch (default), or once for the whole run.
    for keep in (False, True):
        seed_everything(0)
        out[("validate", keep)] = _validate(RegressionModule(), [ReshardSchedule(validate=False)] if keep else [])
    # Warnings: a mesh that shards nothing, a unit mixing frozen and trainable parameters.
    seed_everything(0)
    frozen = RegressionModule()
    frozen.net.blocks[0].fc1.requires_grad_(False)
    report = ShardingReport(path=report_path)
    trainer = Trainer(devices=WORLD, strategy=hp_lightning.HSDPStrategy(mesh_shape=[4, 1]), callbacks=[report], **trainer_kwargs())
    trainer.validate(frozen, rank_loader(make_dataset(16), MICRO_BATCH, WORLD))
    out["warnings"] = report.summary.warnings
    return out


def reference(module, *, epochs: int = 1, accumulate: int = K, callbacks=()) -> dict[str, torch.Tensor]:
    trainer = Trainer(devices=1, max_epochs=epochs, accumulate_grad_batches=accumulate, callbacks=list(callbacks), **trainer_kwargs())
    trainer.fit(module, loader(make_dataset(N_SAMPLES), MICRO_BATCH))
    return full_params(module)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    path = tmp_path_factory.mktemp("report") / "sharding.txt"
    res = run_distributed(worker, WORLD, str(path), timeout=600)
    res[0]["report_file"] = path.read_text()
    return res


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    refs = {}
    seed_everything(0)
    refs["adamw"] = reference(RegressionModule())
    seed_everything(0)
    refs["scheduler"] = reference(RegressionModule(), epochs=2, accumulate=1, callbacks=[GradientAccumulationScheduler({0: 2, 1: 4})])
    seed_everything(0)
    refs["scaled_sgd"] = reference(StepScaledLoss(optimizer="sgd"))
    seed_everything(0)
    refs["sgd"] = reference(RegressionModule(optimizer="sgd"))
    return refs


def per_unit(counts: Counter, unit_bytes: dict[str, int], payload_factor: int) -> dict[str, float]:
    """Calls per unit, from a Counter of payload bytes (units of equal size split their calls evenly)."""
    same_size = Counter(unit_bytes.values())
    return {name: counts[payload_factor * b] / same_size[b] for name, b in unit_bytes.items()}


# Per optimizer step and unit at k=4: (reduce-scatters over the shard group, all-reduces over the replicate group).
EXPECTED_SYNC = {"every": (4, 4), "skip": (1, 1), "defer_all_reduce": (4, 1)}


def test_units_are_told_apart_by_payload(results):
    sizes = results[0]["skip"]["unit_bytes"]
    assert set(sizes) == {"<root>", "net.blocks.0", "net.blocks.1"}
    assert sizes["<root>"] != sizes["net.blocks.0"] == sizes["net.blocks.1"]


@pytest.mark.parametrize("mode", list(EXPECTED_SYNC))
def test_collectives_per_step_and_unit(results, mode):
    reduce_scatters, all_reduces = EXPECTED_SYNC[mode]
    for rank, res in enumerate(results):
        steps = res[mode]["steps"]
        assert len(steps) == N_SAMPLES // MICRO_BATCH // K == 2
        for step in steps:
            sizes = res[mode]["unit_bytes"]
            assert set(per_unit(step["reduce_scatter"], sizes, 2).values()) == {reduce_scatters}, (rank, mode, step)
            assert set(per_unit(step["all_reduce"], sizes, 1).values()) == {all_reduces}, (rank, mode, step)
            # Nothing else of those kinds on those groups.
            assert sum(step["reduce_scatter"].values()) == 3 * reduce_scatters
            assert sum(step["all_reduce"].values()) == 3 * all_reduces


def test_final_parameters_equal_across_modes_and_reference(results, references):
    ref = references["adamw"]
    for rank, res in enumerate(results):
        for config in ("skip", "every", "defer_all_reduce", ("reshard", True, True), ("reshard", False, False), ("reshard", False, True), "manual"):
            diff = max_rel_diff(res[config]["params"], ref)
            assert diff <= 1e-5, f"rank {rank} {config}: max relative difference to the single process {diff:.2e}"
        skip = res["skip"]["params"]
        for mode in ("every", "defer_all_reduce"):
            assert max_rel_diff(res[mode]["params"], skip) <= 1e-5


def test_gradient_memory_every_below_skip(results):
    for rank, res in enumerate(results):
        local = sum(res["skip"]["unit_bytes"].values())  # this rank's parameter shard bytes
        full = 2 * local  # shard group of 2, even split
        # "skip": full-size gradients held after each non-final micro-batch, shards after the last.
        assert res["skip"]["grad_bytes"] == [full, full, full, local] * 2, rank
        # "every" and "defer_all_reduce": never more than the 1/S shards (reduced or partial).
        assert res["every"]["grad_bytes"] == [local] * 8, rank
        assert res["defer_all_reduce"]["grad_bytes"] == [local] * 8, rank
        assert max(res["every"]["grad_bytes"]) < max(res["skip"]["grad_bytes"])


# All-gathers per accumulation window and unit (block, root) for ReshardSchedule(train=..., keep=...).
EXPECTED_GATHERS = {
    (True, False): (2 * K, K),  # gathered for forward and again for backward, every micro-batch
    (True, True): (K + 1, 1),  # kept after backward: the next forward reuses; backward re-gathers
    (False, False): (K, K),  # kept from forward to backward, freed after it
    (False, True): (1, 1),  # gathered once per window
}


@pytest.mark.parametrize(("train", "keep"), list(EXPECTED_GATHERS))
def test_all_gathers_per_window(results, train, keep):
    block, root = EXPECTED_GATHERS[(train, keep)]
    for rank, res in enumerate(results):
        run = res[("reshard", train, keep)]
        for step in run["steps"]:
            gathers = per_unit(step["all_gather"], run["unit_bytes"], 2)
            assert gathers == {"<root>": root, "net.blocks.0": block, "net.blocks.1": block}, (rank, train, keep, step)


def test_manual_optimization_helper(results):
    for rank, res in enumerate(results):
        run = res["manual"]
        for step in run["steps"]:
            sizes = run["unit_bytes"]
            assert set(per_unit(step["reduce_scatter"], sizes, 2).values()) == {K}
            assert set(per_unit(step["all_reduce"], sizes, 1).values()) == {1}
            gathers = per_unit(step["all_gather"], sizes, 2)
            # Blocks stay gathered between micro-batches; the root (kept after forward, not
            # resharded after the window's non-final backwards) is gathered once per window.
            assert gathers["net.blocks.0"] == gathers["net.blocks.1"] == K + 1
            assert gathers["<root>"] == 1


def test_scheduler_changes_window_at_epoch_boundary(results, references):
    for rank, res in enumerate(results):
        run = res["scheduler"]
        windows = [2] * 4 + [4] * 2  # epoch 0: k=2 (4 steps); epoch 1: k=4 (2 steps)
        assert len(run["steps"]) == len(windows)
        for k, step in zip(windows, run["steps"]):
            assert set(per_unit(step["reduce_scatter"], run["unit_bytes"], 2).values()) == {k}, (rank, k, step)
            assert set(per_unit(step["all_reduce"], run["unit_bytes"], 1).values()) == {1}, (rank, k, step)
        assert max_rel_diff(run["params"], references["scheduler"]) <= 1e-5


def test_gradient_scaling_factor(results, references):
    for rank, res in enumerate(results):
        scaled = res["scaling"]["params"]
        # Scaling reduced gradients by 1/(step+2) equals scaling the loss by it in one process ...
        assert max_rel_diff(scaled, references["scaled_sgd"]) <= 1e-5, rank
        # ... and is not a no-op.
        assert max_rel_diff(scaled, references["sgd"]) > 1e-3, rank


def test_report_bytes_match_local_shards(results):
    for rank, res in enumerate(results):
        summary = res["skip"]["report"]
        rows = {u.name: u for u in summary.units}
        assert {n: u.local_bytes for n, u in rows.items()} == res["skip"]["unit_bytes"], rank
        for row in rows.values():
            assert row.min_bytes == row.max_bytes == row.local_bytes
            assert row.elements * 4 == 2 * row.local_bytes  # two shards make the whole unit
            assert row.placements == "R,S(0)" and row.compute_dtype == row.reduce_dtype == "fp32"
        assert rows["<root>"].reshard_after_forward is False and rows["net.blocks.0"].reshard_after_forward is True
        assert rows["net.blocks.0"].forward_prefetch == ("net.blocks.1",)
        assert summary.warnings == []
    # HSDP groups: the two ranks of each shard group hold disjoint halves of every unit.
    for first in (0, 2):
        a, b = (results[r]["skip"]["report"].units for r in (first, first + 1))
        for ua, ub in zip(a, b):
            assert (ua.local_bytes + ub.local_bytes) == ua.elements * 4


def test_report_warnings_and_file(results):
    warnings = results[0]["warnings"]
    assert len(warnings) == 2, warnings
    assert "'net.blocks.0' mixes 2 frozen and 4 trainable" in warnings[0]
    assert "shards nothing" in warnings[1]
    text = results[0]["report_file"]
    assert "net.blocks.0" in text and "shards nothing" in text


def test_reshard_schedule_keeps_units_gathered_in_validation(results):
    batches = N_SAMPLES // MICRO_BATCH
    for rank, res in enumerate(results):
        sizes = res["skip"]["unit_bytes"]
        default = per_unit(res[("validate", False)]["all_gather"], sizes, 2)
        kept = per_unit(res[("validate", True)]["all_gather"], sizes, 2)
        assert default == {"<root>": 1, "net.blocks.0": batches, "net.blocks.1": batches}, rank
        assert kept == {"<root>": 1, "net.blocks.0": 1, "net.blocks.1": 1}, rank
        assert res[("validate", True)]["resharded_at_end"] is True
