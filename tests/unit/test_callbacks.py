"""Callback construction, the strategy check and LightningCLI YAML (no process group needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from hp_lightning.callbacks import (
    GradientAccumulationSync,
    GradientMemoryMonitor,
    GradientScaling,
    ReshardSchedule,
    ShardingReport,
    micro_batch_sync,
)
from tests.helpers import RegressionModule, loader, make_dataset, trainer_kwargs


def half(trainer, pl_module, batch) -> float:
    """A scaling function named by import path in YAML."""
    return 0.5


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: GradientAccumulationSync("sometimes"), ValueError, "expects one of ['skip', 'every', 'defer_all_reduce']; got 'sometimes'"),
        (lambda: GradientAccumulationSync(4), TypeError, "as a string; got int 4"),
        (lambda: GradientScaling(0.0), ValueError, "finite number > 0 or None"),
        (lambda: GradientScaling(float("inf")), ValueError, "finite number > 0"),
        (lambda: GradientScaling(True), TypeError, "got bool True"),
        (lambda: GradientScaling("0.5"), TypeError, "got str '0.5'"),
        (lambda: GradientScaling(0.5, reduce_op="mean"), ValueError, "['avg', 'sum'] or None; got 'mean'"),
        (lambda: ReshardSchedule(train="yes"), TypeError, "ReshardSchedule(train=...) expects True, False or None"),
        (lambda: ReshardSchedule(validate=0), TypeError, "ReshardSchedule(validate=...)"),
        (lambda: ReshardSchedule(keep_unsharded_between_micro_batches=None), TypeError, "expects True or False; got NoneType"),
        (lambda: ShardingReport(warn="no"), TypeError, "ShardingReport(warn=...) expects True or False"),
        (lambda: ShardingReport(path=3), TypeError, "ShardingReport(path=...) expects a file path"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(build, error, message):
    with pytest.raises(error) as info:
        build()
    assert message in str(info.value)


def test_defaults_and_normalization():
    assert GradientAccumulationSync().mode == "skip"
    assert GradientAccumulationSync("DEFER_ALL_REDUCE").mode == "defer_all_reduce"
    assert GradientScaling(2).factor == 2.0 and isinstance(GradientScaling(2).factor, float)
    assert GradientScaling(half).factor is half
    assert GradientScaling(None, reduce_op="SUM").reduce_op == "sum"
    schedule = ReshardSchedule(train=False, predict=True)
    schedule._strategy_default = True
    assert [schedule.reshard_after_forward(p) for p in ("train", "validate", "test", "predict")] == [False, False, False, True]
    assert ReshardSchedule().reshard_after_forward("validate") is True  # as the strategy (default True)
    with pytest.raises(ValueError, match="phase must be one of"):
        schedule.reshard_after_forward("sanity")


def test_micro_batch_sync_refuses_a_non_bool():
    with pytest.raises(TypeError, match=r"last_micro_batch=\.\.\.\) expects True or False; got int 1"):
        with micro_batch_sync(None, last_micro_batch=1):  # type: ignore[arg-type]
            pass


# ---------------------------------------------------------------- strategy check


@pytest.mark.parametrize(
    "callback",
    [GradientAccumulationSync("every"), GradientScaling(0.5), ReshardSchedule(), ShardingReport(), GradientMemoryMonitor()],
    ids=lambda c: type(c).__name__,
)
def test_each_callback_refuses_a_strategy_other_than_hsdp(callback):
    trainer = Trainer(devices=1, max_steps=1, callbacks=[callback], **trainer_kwargs())
    model = RegressionModule()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError) as info:
        trainer.fit(model, loader(make_dataset(16), 4))
    text = str(info.value)
    assert type(callback).__name__ in text and "SingleDeviceStrategy" in text and "strategy='hsdp'" in text
    # Refused in setup(), before any step.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- LightningCLI YAML

YAML = """
trainer:
  accelerator: cpu
  devices: 1
  strategy: hsdp
  logger: false
  callbacks:
    - class_path: hp_lightning.callbacks.GradientAccumulationSync
      init_args:
        mode: defer_all_reduce
    - class_path: hp_lightning.callbacks.GradientScaling
      init_args:
        factor: 0.25
        reduce_op: sum
    - class_path: hp_lightning.callbacks.GradientScaling
      init_args:
        factor: tests.unit.test_callbacks.half
    - class_path: hp_lightning.callbacks.ReshardSchedule
      init_args:
        train: true
        validate: false
        keep_unsharded_between_micro_batches: true
    - class_path: hp_lightning.callbacks.ShardingReport
      init_args:
        path: {path}
        warn: false
    - class_path: hp_lightning.callbacks.GradientMemoryMonitor
"""


def test_every_callback_from_lightning_cli_yaml(tmp_path: Path):
    config = tmp_path / "config.yaml"
    config.write_text(YAML.format(path=tmp_path / "report.txt"))
    cli = LightningCLI(RegressionModule, run=False, args=["--config", str(config)], save_config_callback=None)
    found = [cb for cb in cli.trainer.callbacks if type(cb).__module__.startswith("hp_lightning.callbacks")]
    assert [type(cb).__name__ for cb in found] == [
        "GradientAccumulationSync",
        "GradientScaling",
        "GradientScaling",
        "ReshardSchedule",
        "ShardingReport",
        "GradientMemoryMonitor",
    ]
    sync, scaling, scaling_fn, schedule, report, _ = found
    assert sync.mode == "defer_all_reduce"
    assert scaling.factor == 0.25 and scaling.reduce_op == "sum"
    assert scaling_fn.factor is half
    assert (schedule.train, schedule.validate, schedule.test, schedule.keep_unsharded_between_micro_batches) == (True, False, None, True)
    assert report.path == str(tmp_path / "report.txt") and report.warn is False and report.log_table is True
    assert type(cli.trainer.strategy).__name__ == "HSDPStrategy"


def test_yaml_with_an_unknown_mode_is_refused(tmp_path: Path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(YAML.format(path=tmp_path / "r.txt").replace("defer_all_reduce", "sometimes"))
    with pytest.raises(SystemExit):
        LightningCLI(RegressionModule, run=False, args=["--config", str(config)], save_config_callback=None)
    assert "sometimes" in capsys.readouterr().err
