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


def test_script_with_trainer_devices_4_uses_lightning_subprocess_launcher(tmp_path, reference):
    out = tmp_path / "params.pt"
    env = _env()
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "4"], env=env, cwd=tmp_path, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(out, reference, world=4, proc=proc)


def test_script_under_torchrun(tmp_path, reference):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun ships with torch and must be on PATH next to the interpreter"
    out = tmp_path / "params.pt"
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(SCRIPT), str(out), "2"]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp_path, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(out, reference, world=2, proc=proc)
