"""Fabric loops: a rank that raises is named once, and its peers stop with one line, every time.

Fabric has no exception hook of its own; the strategy reports an error that ends the main thread
before its traceback prints (``FaultWatchdog.report_uncaught_errors``). Reported at interpreter
exit instead, the waiting peer raced the failed rank's sockets closing: it printed gloo's
"Connection closed by peer" traceback, or left with exit code 3 and no line at all. Each case runs
``tests/scripts/fabric_fault.py`` on 2 real ranks, several times on warm ranks (the race showed
in some runs only), once under Fabric's own launcher and once under torchrun.
"""

from __future__ import annotations

import pytest

from hp_lightning.core.watchdog import PEER_FAILED_EXIT_CODE
from tests.faults.harness import ROOT, FaultRun, launch
from tests.faults.test_fault_matrix import PEER_LOST, expect_bounded, expect_torchrun_root_cause

SCRIPT = ROOT / "tests" / "scripts" / "fabric_fault.py"


def expect_named_once(run: FaultRun, failed: int) -> None:
    expect_bounded(run)
    cause = f"ValueError: injected fault in the Fabric loop on rank {failed} at step 2"
    assert run.tracebacks() == [f"rank{failed}"], f"tracebacks from {run.tracebacks()}\n{run.tail()}"
    lines = run.watchdog_lines()
    peer = 1 - failed
    assert lines == [
        f"[hp_lightning] rank {peer}: stopping (exit code 3) because rank {failed} failed first with {cause} "
        f"(its traceback is in rank {failed}'s output)."
    ], f"{lines}\n{run.tail()}"
    for symptom in PEER_LOST:
        assert symptom not in run.output, f"a peer's misleading error was printed:\n{run.tail()}"
    assert not list(run.out.glob("finished.*")), run.tail()


@pytest.mark.parametrize("failed", [1, 0])
def test_fabric_rank_error_is_named_once_in_every_run(tmp_path, failed):
    for attempt in range(4 if failed == 1 else 2):
        run = launch(tmp_path / str(attempt), "--fault", "error", "--rank", str(failed), "--step", "2", script=SCRIPT)
        expect_named_once(run, failed)
        assert run.returncode == (PEER_FAILED_EXIT_CODE if failed == 1 else 1), run.tail()


def test_fabric_rank_error_under_fabrics_launcher(tmp_path):
    run = launch(tmp_path, "--fault", "error", "--rank", "1", "--step", "2", launcher="lightning", script=SCRIPT)
    expect_named_once(run, 1)
    assert run.returncode == PEER_FAILED_EXIT_CODE, run.tail()  # the shell sees rank 0, stopped for rank 1


def test_fabric_rank_error_under_torchrun(tmp_path):
    run = launch(tmp_path, "--fault", "error", "--rank", "0", "--step", "2", launcher="torchrun", script=SCRIPT)
    expect_named_once(run, 0)
    expect_torchrun_root_cause(run, 0, "ValueError: injected fault in the Fabric loop on rank 0 at step 2")


def test_fabric_clean_run_is_left_alone(tmp_path):
    run = launch(tmp_path, script=SCRIPT)
    assert not run.timed_out and run.returncode == 0, run.tail()
    assert run.watchdog_lines() == [] and run.tracebacks() == [], run.tail()
    assert (tmp_path / "finished.0").read_text() == (tmp_path / "finished.1").read_text() == "6"
