"""Launch like a user: a script with Trainer(devices=2) (Lightning's subprocess launcher) and torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from tests.helpers import RegressionModule, free_port, full_params, loader, make_dataset, max_rel_diff, trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "launch_train.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    seed_everything(0)
    model = RegressionModule()
    Trainer(devices=1, max_steps=3, **trainer_kwargs()).fit(model, loader(make_dataset(), 16))
    return full_params(model)


def _check(out: Path, reference, world: int, proc: subprocess.CompletedProcess) -> None:
    # A clean run raises no false alarm: no watchdog line, no traceback (the launcher's own store
    # going away at the end included; tests/faults checks the same on warm ranks).
    output = proc.stdout + proc.stderr
    assert "[hp_lightning]" not in output and "Traceback" not in output, output[-3000:]
    result = torch.load(out)
    assert result["world"] == world and result["mesh"] == (world,)
    assert max_rel_diff(result["params"], reference) <= 1e-5
    # pl_module.net(x) from a callback's on_train_end (outside the loop) works as inside it.
    assert torch.allclose(result["submodule_output"], result["submodule_expected"], rtol=1e-5, atol=1e-6)


def test_script_with_trainer_devices_2_uses_lightning_subprocess_launcher(tmp_path, reference):
    """``python script.py`` with ``Trainer(devices=2)``: Lightning starts the second rank as a fresh interpreter."""
    out = tmp_path / "params.pt"
    env = _env()
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "2"], env=env, cwd=tmp_path, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(out, reference, world=2, proc=proc)


def test_script_under_torchrun(tmp_path, reference):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun ships with torch and must be on PATH next to the interpreter"
    out = tmp_path / "params.pt"
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(SCRIPT), str(out), "2"]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp_path, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(out, reference, world=2, proc=proc)


RESTART_SCRIPT = ROOT / "tests" / "scripts" / "restart_train.py"


def test_torchrun_max_restarts_resumes_from_last_checkpoint_exactly(tmp_path):
    """``torchrun --standalone --max-restarts=1``: rank 1 is SIGKILLed mid-fit (step 2 of 4); torchrun
    restarts both ranks in place, the new attempt forms its process group (a fresh rendezvous in the
    agent's store, which outlives the dead attempt), resumes from the newest checkpoint and ends
    bitwise equal to an uninterrupted run of the same recipe (run afterwards in the same processes)."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun ships with torch and must be on PATH next to the interpreter"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(RESTART_SCRIPT), str(tmp_path), "2"]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp_path, timeout=400, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    result = torch.load(tmp_path / "result.pt")
    assert result["attempt"] == 1, "the job did not go through torchrun's restart"
    assert result["resumed_from"] == str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"), result["resumed_from"]
    assert result["steps"] == result["reference_steps"] == 4
    assert result["params"].keys() == result["reference"].keys()
    for name, value in result["params"].items():
        assert torch.equal(value, result["reference"][name]), f"{name}: resumed run differs from the uninterrupted one"
    assert "Connection refused" not in output and "connectFullMesh" not in output, output[-4000:]


def test_torchrun_wrong_lighthouse_ends_the_job_instead_of_restarting(tmp_path):
    """``--max-restarts=100`` and a lighthouse address nothing listens at: one attempt, a clear error, no retry."""
    pytest.importorskip("torchft", reason="fault tolerance needs the 'ft' extra (torchft)")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None
    script = ROOT / "tests" / "scripts" / "ft_no_lighthouse.py"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "100", str(script), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp_path, timeout=300, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert sorted(p.name for p in tmp_path.glob("attempt.*")) == ["attempt.0.0", "attempt.0.1"], output[-4000:]
    assert "no lighthouse reachable at http://127.0.0.1:" in output and "No restart can fix this" in output, output[-4000:]
