"""Ranks that disagree about settings are stopped at setup, with the setting and the ranks named.

One case launches the fault script with Lightning's launcher, with a rank whose mesh shape
differs. It checks that the run ends before training communicates and that the error is
printed once. The others run in one pair of real gloo ranks: each rank builds its own
``Trainer`` with one setting changed on rank 1, and the real
:func:`~hp_lightning.core.agreement.check_rank_agreement` compares what the real
:func:`~hp_lightning.core.agreement.setup_settings` collected.
"""

from __future__ import annotations

import pytest

from hp_lightning.core.agreement import RankDisagreementError, disagreement_message
from hp_lightning.core.watchdog import PEER_FAILED_EXIT_CODE
from tests.faults.harness import launch
from tests.faults.test_fault_matrix import BOUND, expect_bounded
from tests.helpers import run_distributed


def test_mesh_shape_disagreement_stops_setup_before_training(tmp_path):
    run = launch(tmp_path, "--fault", "disagree", "--rank", "1", "--mesh", "1", "2")
    expect_bounded(run, BOUND)
    assert run.returncode in (1, PEER_FAILED_EXIT_CODE), run.tail()  # rank 0 reported it, or was stopped for rank 1
    assert len(run.tracebacks()) == 1, run.tail()
    assert "RankDisagreementError: Ranks disagree about mesh shape, HSDPStrategy(mesh_shape=...) (checked at setup" in run.output, run.tail()
    assert "  - mesh shape: [2] on rank 0; [1, 2] on rank 1" in run.output
    assert "  - HSDPStrategy(mesh_shape=...): [2] on rank 0; [1, 2] on rank 1" in run.output
    assert not (tmp_path / "finished.0").exists() and "train_loss" not in run.output


def _disagreements(tmp: str) -> dict[str, str]:
    """On each rank: build this rank's trainer for every case, compare; return case -> error text."""
    import os

    import torch
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import hp_lightning
    from hp_lightning.core import agreement as faults
    from tests.faults.guarded import GuardedHSDPStrategy
    from tests.helpers import TinyNet, trainer_kwargs

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    odd = rank == 1

    def settings(strategy: dict | None = None, **trainer_args) -> dict:
        trainer = Trainer(devices=2, strategy=GuardedHSDPStrategy(**(strategy or {})), **trainer_kwargs(**trainer_args))
        return faults.setup_settings(trainer.strategy.options.settings(), trainer.strategy.precision_plugin.precision, trainer, (2,))

    def outcome(values: dict, stage: str = "setup") -> str:
        try:
            faults.check_rank_agreement(values, stage=stage)
        except RankDisagreementError as exc:
            return str(exc)
        return "agreed"

    results = {"same": outcome(settings())}
    results["precision"] = outcome(settings(precision="bf16-mixed" if odd else "32-true"))
    results["units"] = outcome(settings({"shard_modules": ["Block"] if odd else None}))
    results["ckpt_path"] = outcome(faults.resume_settings(os.path.join(tmp, f"run-{rank}", "last.ckpt")), stage="resume")
    results["checkpoint dirpath"] = outcome(
        settings(enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt", str(rank)))])
    )
    results["accumulation"] = outcome(settings(accumulate_grad_batches=2 if odd else 1))
    saved = hp_lightning.__version__, torch.__version__
    if odd:  # a node with other packages installed
        hp_lightning.__version__, torch.__version__ = "0.2.0", "2.12.1+cu126"
    results["versions"] = outcome(settings())
    hp_lightning.__version__, torch.__version__ = saved
    model = TinyNet(depth=3 if odd else 2)  # e.g. a config read per node
    results["model"] = outcome(faults.sharding_settings(model, None), stage="sharding")
    results.update(_resume_cases(tmp, rank))
    dist.destroy_process_group()
    return results


def _resume_cases(tmp: str, rank: int) -> dict[str, str]:
    """Real fits: one that saves, then resumes where only rank 1 has a path, and with different paths."""
    import os
    import shutil

    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hp_lightning import HSDPStrategy
    from tests.helpers import RegressionModule, make_dataset, rank_loader, trainer_kwargs

    def fit(ckpt_path, steps: int) -> str:
        trainer = Trainer(
            devices=2,
            strategy=HSDPStrategy(mesh_shape=[2], fault_watchdog=False),
            max_steps=steps,
            callbacks=[ModelCheckpoint(dirpath=os.path.join(tmp, "resume"), save_last=True)],
            **trainer_kwargs(enable_checkpointing=True),
        )
        try:
            trainer.fit(RegressionModule(), rank_loader(make_dataset(), 16, 2), ckpt_path=ckpt_path)
        except Exception as exc:  # noqa: BLE001 - the test compares the message
            return f"{type(exc).__name__}: {exc}"
        return "resumed" if ckpt_path else "trained"

    out = {"first fit": fit(None, 2)}
    last = os.path.join(tmp, "resume", "last.ckpt")
    if rank == 0:
        shutil.copytree(last, os.path.join(tmp, "copy.ckpt"))
    dist.barrier()
    out["only rank 1 resumes"] = fit(last if rank == 1 else None, 3)
    out["different paths"] = fit(last if rank == 0 else os.path.join(tmp, "copy.ckpt"), 3)
    out["same path"] = fit(last, 3)
    return out


@pytest.fixture(scope="module")
def disagreements(tmp_path_factory) -> dict[str, str]:
    per_rank = run_distributed(_disagreements, 2, str(tmp_path_factory.mktemp("agree")))
    assert per_rank[0] == per_rank[1], "every rank must raise the same error"
    return per_rank[0]


def test_identical_settings_pass(disagreements):
    assert disagreements["same"] == "agreed"
    assert disagreements["first fit"] == "trained" and disagreements["same path"] == "resumed"


@pytest.mark.parametrize("case", ["only rank 1 resumes", "different paths"])
def test_resume_disagreement_is_refused_before_loading(disagreements, case):
    # Lightning reads the checkpoint only on ranks with a path: unchecked, one rank waits in a
    # collective the others never join (a hang), or rank 0's path silently wins.
    message = disagreements[case]
    assert message.startswith("RankDisagreementError: Ranks disagree about checkpoint to resume (ckpt_path) (checked at resume"), message
    assert "on rank 0;" in message and "on rank 1" in message


@pytest.mark.parametrize(
    "case, expected",
    [
        ("precision", ["Ranks disagree about precision (checked at setup", "  - precision: '32-true' on rank 0; 'bf16-mixed' on rank 1"]),
        ("units", ["  - HSDPStrategy(shard_modules=...): None on rank 0; ['Block'] on rank 1"]),
        ("ckpt_path", ["Ranks disagree about checkpoint to resume (ckpt_path)", "run-0/last.ckpt' on rank 0;", "run-1/last.ckpt' on rank 1"]),
        ("checkpoint dirpath", ["  - ModelCheckpoint(dirpath=...): ['", "ckpt/0'] on rank 0; ['", "ckpt/1'] on rank 1"]),
        ("accumulation", ["  - Trainer(accumulate_grad_batches=...): 1 on rank 0; 2 on rank 1"]),
        ("versions", ["Ranks disagree about hp_lightning version, torch version", "  - hp_lightning version: '0.1.0' on rank 0; '0.2.0' on rank 1", "'2.12.1+cu126' on rank 1"]),
        ("model", ["Ranks disagree about model parameters (checked at sharding", "  - model parameters: '16 tensors, 2,420 elements", "on rank 0; '22 tensors, 3,524 elements"]),
    ],
)
def test_each_differing_setting_is_named_with_its_ranks(disagreements, case, expected):
    message = disagreements[case]
    for text in expected:
        assert text in message, message
    assert "Every rank must run the same code with the same configuration" in message


def test_message_groups_many_ranks_by_value():
    settings = [{"mesh shape": "(4, 2)"}] * 6 + [{"mesh shape": "(2, 4)"}] * 2
    message = disagreement_message(settings, "setup")
    assert "  - mesh shape: (4, 2) on ranks 0-5; (2, 4) on ranks 6-7" in message
    assert disagreement_message([{"a": "1"}, {"a": "1"}], "setup") is None
    assert "  - b: <not set> on rank 0; 2 on rank 1" in disagreement_message([{"a": "1"}, {"a": "1", "b": "2"}], "setup")
