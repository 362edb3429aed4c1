"""PP x FSDP: one rank SIGKILLed; every other rank reports as stopped, naming it, every time.

The killed rank's pipeline peer fails inside torch's schedule, which re-raises the lost
connection as ``RuntimeError("[Stage 0] failed to run forward ...") from e``. Read as an error of
its own, that rank printed a chained gloo traceback and exited 1, and torchrun listed it as a
failure. Consequences are now recognised through explicit causes (``is_communication_error``).
"""

from __future__ import annotations

import pytest

from hp_lightning.core.watchdog import PEER_FAILED_EXIT_CODE
from tests.faults.harness import ROOT, launch
from tests.faults.test_fault_matrix import PEER_LOST, expect_bounded

SCRIPT = ROOT / "tests" / "scripts" / "pipeline_fault.py"


@pytest.mark.parametrize("launcher", ["warm", "torchrun"])
def test_killed_rank_under_pp_x_fsdp_leaves_every_other_rank_stopped(tmp_path, launcher):
    # Rank 3: stage 1 of the second data-parallel rank; rank 1 is its pipeline peer (stage 0).
    attempts = 2 if launcher == "warm" else 1
    for attempt in range(attempts):
        run = launch(tmp_path / str(attempt), "--rank", "3", "--step", "2", launcher=launcher, script=SCRIPT, world=4)
        expect_bounded(run)
        assert run.tracebacks() == [], f"tracebacks from {run.tracebacks()}\n{run.tail()}"
        lines = [line for line in run.watchdog_lines() if "pipeline stage 0 of 2" not in line]  # setup's info line aside
        assert len(lines) == 3, f"{lines}\n{run.tail()}"
        for rank in (0, 1, 2):
            mine = [line for line in lines if line.startswith(f"[hp_lightning] rank {rank}: stopping (exit code 3) because rank 3")]
            assert len(mine) == 1, f"rank {rank}: {lines}\n{run.tail()}"
        for symptom in (*PEER_LOST, "failed to run forward", "failed to run backward"):
            assert symptom not in run.output, f"a peer's misleading error was printed:\n{run.tail()}"
        if launcher == "warm":
            assert run.returncode == PEER_FAILED_EXIT_CODE, run.tail()
        else:
            root = run.output.split("Root Cause (first observed failure):", 1)
            assert len(root) == 2 and "rank      : 3 " in root[1] and "Signal 9 (SIGKILL)" in root[1], run.tail()
            # The stopped ranks are listed with exit code 3, not as failures of their own (exit 1).
            assert "exitcode  : 1 " not in run.output, run.tail()
