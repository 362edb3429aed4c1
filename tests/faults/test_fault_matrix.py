"""The fault matrix: one real fault per case, injected into a real 2-rank training run.

Every case launches ``tests/scripts/fault_train.py`` on warm ranks (real processes forked from the
test session's forkserver, see ``tests/faults/harness.py``), or with Lightning's subprocess
launcher or torchrun where the launcher is part of what is tested: Lightning's child-process
observer racing the watchdog, torchrun's agent-held store and its root-cause record. Heartbeat and
grace are 2 s here (the defaults are 120 s and 30 s). It then asserts four things. The time from the fault to the end of the last process
stays under its bound. The bounds are correctness limits (seconds instead of the 30-minute
collective timeout), generous because the test machine is shared. The exit codes are right.
The original cause appears once, with its rank, and no rank prints a misleading traceback of
its own. Where a checkpoint is involved, the checkpoint survives.

Exit codes: the rank that failed exits with 1 (Python's code for an uncaught exception); the
ranks it stops exit with ``PEER_FAILED_EXIT_CODE`` (3). Under Lightning's launcher the shell sees
rank 0's code; torchrun exits with 1 and names the root cause in its summary.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

from hp_lightning.core.watchdog import PEER_FAILED_EXIT_CODE
from tests.faults.harness import FaultRun, launch, record

#: Seconds from a fault to the end of every process (launcher included). The watchdog polls once a
#: second; the rest is a loaded 2-core machine tearing down two Python processes.
BOUND = 45.0
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def expect_bounded(run: FaultRun, bound: float = BOUND) -> None:
    record(run, bound)
    assert not run.timed_out, f"hang: still running at the test's timeout\n{run.tail()}"
    assert run.fault is not None, f"the fault was never injected\n{run.tail()}"
    assert run.seconds_to_exit < bound, f"{run.seconds_to_exit:.1f} s to exit (bound {bound} s)\n{run.tail()}"
    assert not run.leftovers, f"processes left running: {run.leftovers}"


def expect_one_cause(run: FaultRun, failed_rank: int, cause: str) -> None:
    """The cause is printed once: the failed rank's traceback, and one watchdog line naming it."""
    assert run.tracebacks() == [f"rank{failed_rank}"], f"tracebacks from {run.tracebacks()}\n{run.tail()}"
    assert run.count(cause) >= 1, run.tail()
    lines = run.watchdog_lines()
    assert len(lines) == 1, lines
    assert f"because rank {failed_rank} failed first with" in lines[0] and cause in lines[0], lines
    for symptom in PEER_LOST:
        assert symptom not in run.output, f"a peer's misleading error was printed:\n{run.tail()}"


def expect_torchrun_root_cause(run: FaultRun, failed_rank: int, text: str) -> None:
    assert run.returncode == 1, run.tail()
    root = run.output.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2, run.tail()
    assert f"rank      : {failed_rank} " in root[1], root[1]
    assert text in root[1], root[1]


# ====================================================================== exceptions


def test_training_step_error_on_rank1(tmp_path):
    run = launch(tmp_path, "--fault", "training_step", "--rank", "1", "--step", "2")
    expect_bounded(run)
    expect_one_cause(run, 1, "ValueError: injected fault in training_step on rank 1 at step 2")
    assert run.returncode == PEER_FAILED_EXIT_CODE, run.tail()  # the shell sees rank 0, stopped for rank 1


def test_training_step_error_on_rank0_torchrun(tmp_path):
    run = launch(tmp_path, "--fault", "training_step", "--rank", "0", "--step", "2", launcher="torchrun")
    expect_bounded(run)
    expect_one_cause(run, 0, "ValueError: injected fault in training_step on rank 0 at step 2")
    expect_torchrun_root_cause(run, 0, "ValueError: injected fault in training_step on rank 0 at step 2")


def test_callback_error_on_rank0(tmp_path):
    run = launch(tmp_path, "--fault", "callback", "--rank", "0", "--step", "1")
    expect_bounded(run)
    expect_one_cause(run, 0, "RuntimeError: injected fault in a callback on rank 0 at step 1")
    assert run.returncode == 1, run.tail()  # rank 0 failed itself: Python's exit code


def test_data_loading_error_in_worker_on_rank1(tmp_path):
    run = launch(tmp_path, "--fault", "data", "--rank", "1", "--step", "2")
    expect_bounded(run)
    expect_one_cause(run, 1, "injected fault in data loading on rank 1")
    assert "Caught ValueError in DataLoader worker process 0: ValueError: injected fault in data loading" in run.watchdog_lines()[0]
    assert run.returncode == PEER_FAILED_EXIT_CODE, run.tail()


# ====================================================================== killed ranks


def expect_lost(run: FaultRun, lost_rank: int) -> None:
    lines = run.watchdog_lines()
    assert len(lines) == 1, f"{lines}\n{run.tail()}"
    assert f"because rank {lost_rank} (pid" in lines[0] and "ended without reporting an error" in lines[0], lines
    assert run.tracebacks() == [], f"tracebacks from {run.tracebacks()}\n{run.tail()}"


def test_sigkill_rank1_lightning_launcher(tmp_path):
    # Lightning's launcher: its child-process observer (every 5 s) would SIGKILL rank 0 for the
    # lost child; the watchdog ends rank 0 first, with its own exit code and one line.
    run = launch(tmp_path, "--fault", "sigkill", "--rank", "1", "--step", "2", launcher="lightning")
    expect_bounded(run)
    expect_lost(run, 1)
    assert run.returncode == PEER_FAILED_EXIT_CODE, run.tail()


def test_sigkill_rank0_torchrun(tmp_path):
    run = launch(tmp_path, "--fault", "sigkill", "--rank", "0", "--step", "2", launcher="torchrun")
    expect_bounded(run)
    expect_lost(run, 0)
    expect_torchrun_root_cause(run, 0, "Signal 9 (SIGKILL)")


def test_sigkill_rank0_that_hosts_the_store(tmp_path):
    # Rank 0 serves the job's store (as the main process does under Lightning's launcher): rank 1 loses both.
    run = launch(tmp_path, "--fault", "sigkill", "--rank", "0", "--step", "2")
    expect_bounded(run)
    assert run.returncode == -signal.SIGKILL, run.tail()
    lines = run.watchdog_lines()
    assert len(lines) == 1 and "rank 1: stopping (exit code 3) because rank 0" in lines[0], f"{lines}\n{run.tail()}"
    assert run.tracebacks() == [], run.tail()


# ====================================================================== ranks that do not end


def test_failed_rank_kept_alive_by_a_thread_is_ended_after_the_grace(tmp_path):
    # A non-daemon thread (an uploader, a profiler) keeps rank 1 alive after its error: without the
    # watchdog, rank 0 would wait in its collective for the 30-minute timeout.
    grace = 2.0
    run = launch(tmp_path, "--fault", "stuck", "--rank", "1", "--step", "2", "--exit-grace", str(grace))
    expect_bounded(run, grace + BOUND)
    assert run.seconds_to_exit > grace - 1, "rank 0 should have waited for rank 1 to print its error"
    lines = run.watchdog_lines()
    expected = f"rank 1: this rank failed, and its process was still running {grace:g} s after its main thread ended (threads still running: ['uploader'])"
    assert any(expected in line for line in lines), lines
    assert any("rank 0: stopping (exit code 3) because rank 1 failed first with ValueError" in l for l in lines), lines
    assert run.tracebacks() == ["rank1"], run.tail()
    assert run.returncode == PEER_FAILED_EXIT_CODE, run.tail()


def test_frozen_rank_is_found_by_its_heartbeat_and_ended(tmp_path):
    # SIGSTOP: the process is alive but does nothing, its sockets stay open (gloo never notices).
    heartbeat = 2.0
    run = launch(tmp_path, "--fault", "sigstop", "--rank", "1", "--step", "2", "--heartbeat-timeout", str(heartbeat))
    expect_bounded(run, heartbeat + BOUND)
    assert run.seconds_to_exit > heartbeat - 1
    lines = run.watchdog_lines()
    assert len(lines) == 1, lines
    assert "because rank 1 (pid" in lines[0] and "stopped responding: no heartbeat for" in lines[0], lines
    assert "hp_lightning ended it with SIGKILL" in lines[0], lines
    assert run.returncode == PEER_FAILED_EXIT_CODE and run.tracebacks() == [], run.tail()


def test_frozen_store_host_is_detected_and_ended(tmp_path):
    # Rank 0 serves the job's store: frozen, it leaves the store's socket open but silent, and a
    # store client would wait for it without end.
    heartbeat = 2.0
    run = launch(tmp_path, "--fault", "sigstop", "--rank", "0", "--step", "2", "--heartbeat-timeout", str(heartbeat))
    expect_bounded(run, heartbeat + BOUND)
    lines = run.watchdog_lines()
    assert len(lines) == 1, lines
    assert "rank 1: stopping (exit code 3) because" in lines[0] and "rank 0" in lines[0], lines
    assert "ended it with SIGKILL" in lines[0], lines
    assert run.tracebacks() == [], run.tail()


def test_deadlocked_main_thread_is_named_even_though_its_heartbeat_goes_on(tmp_path):
    # Under torchrun: the store is the agent's, and the agent's record must name the deadlock.
    launcher = "torchrun"
    heartbeat = 2.0
    run = launch(tmp_path, "--fault", "deadlock", "--rank", "1", "--step", "2", "--heartbeat-timeout", str(heartbeat), launcher=launcher)
    expect_bounded(run, heartbeat + BOUND)
    lines = run.watchdog_lines()
    mine = [l for l in lines if l.startswith("[hp_lightning] rank 1 is deadlocked: its main thread has not moved for")]
    assert len(mine) == 1 and "in on_train_batch_start" in run.output, run.tail()
    # The rank waiting for it in a collective is not blamed: it is stopped, naming rank 1.
    assert any("rank 0: stopping (exit code 3) because rank 1 (pid" in l and "deadlocked" in l for l in lines), lines
    if launcher == "torchrun":
        expect_torchrun_root_cause(run, 1, "rank 1: deadlocked")


def test_failed_rank_that_catches_its_error_is_ended_after_the_grace(tmp_path):
    grace = 2.0
    run = launch(tmp_path, "--fault", "caught", "--rank", "1", "--step", "2", "--exit-grace", str(grace))
    expect_bounded(run, grace + BOUND)
    assert "rank 1: caught the error, carrying on" in run.output, run.tail()
    lines = run.watchdog_lines()
    assert any("rank 0: stopping (exit code 3) because rank 1 failed first with ValueError" in l for l in lines), lines
    assert any(f"rank 1: this rank failed and the other ranks were stopped for it, but its main thread was still running {grace:g} s later" in l for l in lines), lines


def test_train_timeout_bounds_a_collective_after_the_first_step(tmp_path):
    # No watchdog: only the collective timeout can end rank 0's wait for rank 1 (asleep for 8 s).
    run = launch(tmp_path, "--fault", "sleepy", "--rank", "1", "--step", "2", "--no-watchdog", "--train-timeout", "2")
    assert not run.timed_out and run.fault is not None, run.tail()
    waited = run.ended["rank0"] - run.fault["time"]
    assert waited < 7, f"rank 0 waited {waited:.1f} s in its collective; train_timeout=2 should end it before rank 1 wakes"
    assert "timed out" in run.output.lower() or "timeout" in run.output.lower(), run.tail()


def test_checkpoint_error_on_every_rank_is_printed_once(tmp_path):
    run = launch(tmp_path, "--fault", "junk_ckpt")
    expect_bounded(run)
    assert run.count(r"Traceback \(most recent call last\)") == 1, run.tail()
    assert run.count(r"junk\.ckpt' is not a checkpoint") >= 1, run.tail()
    lines = run.watchdog_lines()
    # Whichever rank posts first speaks for both; the other prints one line naming it.
    assert len(lines) == 1 and re.search(r"rank [01]: exiting with the same error as rank [01], which reported it first", lines[0]), lines


@pytest.mark.parametrize(("fault", "launcher"), [("bad_mesh", "torchrun"), ("bad_backend", "warm")])
def test_configuration_error_on_every_rank_prints_one_traceback(tmp_path, fault, launcher):
    # Raised before the process group exists: the ranks meet on the store alone (the agent's
    # under torchrun, rank 0's otherwise).
    run = launch(tmp_path, "--fault", fault, launcher=launcher)
    expect_bounded(run)
    # One traceback from the ranks (rank 0's); the agent's own ChildFailedError summary aside.
    ranks_tracebacks = run.count(r"Traceback \(most recent call last\)") - run.count(r"^torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError")
    assert ranks_tracebacks == 1, run.tail()
    # Not anchored to a line start: both ranks write to one pipe, so the line may land inside rank 0's traceback.
    assert run.count(r"\[hp_lightning\] rank 1: exiting with ") == 1, run.tail()


# ====================================================================== non-finite gradients


def test_nan_gradient_on_one_shard_stops_every_rank_naming_step_unit_and_parameter(tmp_path):
    # Only rank 1's shard of one weight holds the NaN; rank 0 must stop at the same step.
    run = launch(tmp_path, "--fault", "nan", "--rank", "1", "--step", "2", "--param", "net.blocks.1.fc2.weight")
    expect_bounded(run)
    assert run.returncode in (1, PEER_FAILED_EXIT_CODE), run.tail()
    assert len(run.tracebacks()) == 1, run.tail()
    assert (
        "NonFiniteGradientError: Non-finite gradients at global step 2 (epoch 0, batch 2), found before the optimizer "
        "step, so the weights were not updated. First: parameter 'net.blocks.1.fc2.weight' in sharding unit "
        "'net.blocks.1', NaN on rank 1." in run.output
    ), run.tail()
    assert len(run.watchdog_lines()) == 1 and "NonFiniteGradientError" in run.watchdog_lines()[0]


def test_clip_error_if_nonfinite_is_honoured_on_every_rank(tmp_path):
    # configure_gradient_clipping calls clip_grad_norm_(..., error_if_nonfinite=True); the NaN is
    # in rank 0's shard only, yet the norm is global, so both ranks refuse to step.
    run = launch(tmp_path, "--fault", "nan_clip", "--rank", "0", "--step", "2")
    expect_bounded(run)
    assert len(run.tracebacks()) == 1, run.tail()
    message = "RuntimeError: The total norm of order 2.0 of the gradients is non-finite (nan), so they cannot be clipped."
    assert message in run.output, run.tail()
    lines = run.watchdog_lines()
    assert len(lines) == 1 and message.split(": ", 1)[1][:40] in lines[0], lines


# ====================================================================== checkpoints and clean runs


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_a_sharded_save_keeps_the_previous_checkpoint(tmp_path, mode):
    from hp_lightning.checkpoint import load_checkpoint
    from tests.helpers import RegressionModule

    # Saves at steps 2 and 4; rank 1 dies right after writing its shards of step 4 (no manifest yet);
    # with async_save, on the background writer thread while its main thread trains on.
    run = launch(tmp_path, "--fault", "save_kill", "--rank", "1", "--step", "4", *(["--async-save"] if mode == "async" else []))
    expect_bounded(run)
    assert (run.fault["thread"] == "MainThread") == (mode == "sync"), run.fault
    expect_lost(run, 1)
    checkpoints = tmp_path / "ckpts"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["epoch=0-step=2.ckpt"]
    model = RegressionModule()
    rest = load_checkpoint(checkpoints / "epoch=0-step=2.ckpt", model, [])  # verifies sizes and checksums
    assert rest["global_step"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    partial = [p for p in checkpoints.iterdir() if "step=4" in p.name]
    if mode == "async" and not partial:
        return  # rank 0's background publisher saw DCP's write fail and removed the staging directory
    assert len(partial) == 1 and ".hp-partial-" in partial[0].name, partial
    with pytest.raises(ValueError, match="staging entry of a save that did not finish"):
        load_checkpoint(partial[0], RegressionModule(), [])


def test_clean_run_is_left_alone(tmp_path):
    # No false alarm: ranks finishing (and rank 0's store going away first) are not failures.
    # (tests/integration/test_launchers.py checks the same under Lightning's launcher and torchrun.)
    run = launch(tmp_path, "--fault", "none")
    assert not run.timed_out and run.returncode == 0, run.tail()
    assert run.watchdog_lines() == [] and run.tracebacks() == [], run.tail()
    assert (tmp_path / "finished.0").read_text() == (tmp_path / "finished.1").read_text() == "6"
    assert (tmp_path / "validated.0").exists() and (tmp_path / "validated.1").exists(), run.tail()
    assert not run.leftovers, run.leftovers
