"""Preemption: SIGTERM to one rank or to the whole job ends every rank together, within seconds.

Lightning's own SIGTERM handler broadcasts a flag from inside the signal handler; with ranks at
different points of a step that collective pairs with the wrong one and the job hangs (4 of 6
runs in the outside audit). Each case launches ``tests/scripts/fault_train.py`` on 2 real ranks
(under each launcher: how the signal arrives is the launcher's part),
sends SIGTERM at step 2 and asserts: every process gone within the bound, exit code 143 (128 +
SIGTERM), one line saying where it stopped, no traceback, nothing left running. With
``save_on_preemption=True`` the run saves ``last.ckpt`` on the way out, and a second launch with
``ckpt_path="last"`` ends with exactly the parameters of a run that was never interrupted.
"""

from __future__ import annotations

import pytest
import torch

from hp_lightning.core.preemption import PREEMPTED_EXIT_CODE
from tests.faults.harness import FaultRun, launch
from tests.faults.test_fault_matrix import BOUND, expect_bounded

STOPPED = "[hp_lightning] preempted by SIGTERM: stopped at step 3"


def expect_clean_preemption(run: FaultRun) -> None:
    expect_bounded(run, BOUND)
    assert run.tracebacks() == [], run.tail()
    assert run.count(r"^\[hp_lightning\] preempted by SIGTERM: stopped at step 3") == 1, run.tail()


@pytest.mark.parametrize(
    ("fault", "launcher"),
    # SIGTERM to one rank under Lightning's launcher: test_sigterm_to_one_rank_saves_and_resumes_to_the_exact_step.
    [("sigterm_job", "torchrun"), ("sigterm_job", "slurm")],
)
def test_sigterm_stops_every_rank_at_the_same_step(tmp_path, fault, launcher):
    run = launch(tmp_path, "--fault", fault, "--rank", "1", "--step", "2", launcher=launcher)
    expect_clean_preemption(run)
    if launcher == "slurm":
        assert run.count(r"cluster environment SLURMEnvironment") == 2, run.tail()
    if launcher == "lightning":
        assert run.returncode == PREEMPTED_EXIT_CODE, run.tail()
    elif launcher == "slurm":
        assert run.returncode != 0, run.tail()  # the srun stand-in (bash) ends by the same SIGTERM
    else:
        assert run.returncode != 0 and f"exitcode  : {PREEMPTED_EXIT_CODE}" in run.output, run.tail()
    assert not list(tmp_path.glob("finished.*")), "training went on after the preemption"


def test_sigterm_to_one_rank_saves_and_resumes_to_the_exact_step(tmp_path):
    preempted, reference = tmp_path / "preempted", tmp_path / "reference"
    # SIGTERM to rank 1 alone, under Lightning's launcher: every rank stops at the same step. With
    # async_save: the preemption save must still be published before the job ends.
    run = launch(preempted, "--fault", "sigterm_rank", "--rank", "1", "--step", "2", "--save-on-preemption", "--async-save", "--dump", launcher="lightning")
    expect_clean_preemption(run)
    assert run.returncode == PREEMPTED_EXIT_CODE, run.tail()
    assert not list(preempted.glob("finished.*")), "training went on after the preemption"
    assert f"saved {preempted / 'ckpts' / 'last.ckpt'} (resume with ckpt_path='last')" in run.output, run.tail()
    assert sorted(p.name for p in (preempted / "ckpts").iterdir()) == ["last.ckpt"]  # published whole, nothing partial

    (preempted / "fault.json").unlink()
    resumed = launch(preempted, "--resume", "--dump")
    assert resumed.returncode == 0, resumed.tail()
    straight = launch(reference, "--dump")
    assert straight.returncode == 0, straight.tail()
    a, b = torch.load(preempted / "params.pt"), torch.load(reference / "params.pt")
    assert a["global_step"] == b["global_step"] == 6
    for name, value in b["params"].items():
        assert torch.equal(a["params"][name], value), name


def test_slurm_requeue_signal_saves_the_hpc_checkpoint_at_a_common_batch(tmp_path):
    # Lightning's own SIGUSR1 handler saves (a collective, for a sharded model) inside the signal
    # handler; here every rank reaches the save together, then Lightning's requeue runs
    # (`scontrol` is not installed here, so it reports a failed requeue, as it would off SLURM).
    run = launch(tmp_path, "--fault", "sigusr1_job", "--rank", "1", "--step", "2", launcher="slurm")
    expect_bounded(run, BOUND)
    assert run.tracebacks() == [], run.tail()
    assert run.count(r"cluster environment SLURMEnvironment") == 2, run.tail()
    assert run.count(r"^\[hp_lightning\] preempted by SIGUSR1: stopped at step 3, saved the hpc checkpoint and requeued") == 1, run.tail()
    assert sorted(p.name for p in tmp_path.glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"], run.tail()
    assert "Requeuing SLURM job 4242 failed" in run.output or "requeue" in run.output.lower(), run.tail()
