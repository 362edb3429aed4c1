"""Launch like a user: a script with Trainer(devices=2) (Lightning's subprocess launcher) and torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
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


def test_two_torchrun_agents_re_form_the_job_whatever_restart_count_each_node_holds(tmp_path):
    """Two torchrun agents on this machine (``--nnodes 2``, c10d rendezvous on 127.0.0.1, 2 ranks each), the
    plan of ``restart_train.py nodes``: both ranks of node 1 killed while node 0's are busy.

    Also the one-node case's test (``--standalone`` is this same c10d rendezvous on one agent): a restarted
    attempt forms a fresh process group (no dead attempt's address read) and resumes from the newest
    checkpoint bitwise equal to an uninterrupted run. The in-place restart of a single standalone agent
    runs in the lighthouse test below and in tests/distributed/test_fault_tolerance.py.

    Node 0's agent restarts its healthy workers for node 1's re-join without counting a restart, so the second
    attempt's nodes hold different ``TORCHELASTIC_RESTART_COUNT``s (a prefix keyed on it split the job's
    rendezvous in two, and one half read a dead attempt's addresses). Its ranks agree on one attempt through the
    agents' store, train to the end from the newest checkpoint, and end bitwise equal to an uninterrupted run."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun ships with torch and must be on PATH next to the interpreter"
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", "two-agents", "--max-restarts", "1", "--monitor-interval", "0.1", str(RESTART_SCRIPT), str(tmp_path), "nodes"]
    logs = [open(tmp_path / f"agent{n}.log", "w") for n in range(2)]
    agents = [subprocess.Popen(cmd, env=_env(), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    try:
        codes = [agent.wait(timeout=400) for agent in agents]
    finally:
        for agent, log in zip(agents, logs):
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            log.close()
    output = "\n".join(f"--- agent {n}:\n" + (tmp_path / f"agent{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], output
    finals = [json.loads((tmp_path / f"final.{rank}.json").read_text()) for rank in range(4)]
    assert all(f["resumed_from"] == str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt") for f in finals), finals
    assert len({f["attempt"] for f in finals}) == 1, finals  # one agreed attempt on every rank
    counts = [f["restart_count"] for f in finals]
    assert counts[0] == counts[1] and counts[2] == counts[3] and counts[0] < counts[2], finals
    result = torch.load(tmp_path / "result.pt")
    assert result["steps"] == result["reference_steps"] == 4
    for name, value in result["params"].items():
        assert torch.equal(value, result["reference"][name]), f"{name}: resumed run differs from the uninterrupted one"
    assert "Connection refused" not in output and "connectFullMesh" not in output, output


def _lighthouse(port: int) -> subprocess.Popen:
    """torchft's own lighthouse binary on 127.0.0.1:``port`` (a process of its own, so it can be stopped like a crash)."""
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    assert binary is not None, "torchft installs torchft_lighthouse next to the interpreter"
    return subprocess.Popen([binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--quorum_tick_ms", "10",
                             "--heartbeat_timeout_ms", "3000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(what: str, predicate, timeout: float, job: subprocess.Popen, log: Path) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert job.poll() is None, f"torchrun ended ({job.returncode}) while waiting for {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)
    return time.time()


def test_torchrun_restart_waits_for_a_lighthouse_that_is_restarting(tmp_path):
    """A replica group (the engine loop, ``ft_torchrun_group.py ... alone``) under ``torchrun --max-restarts=1``:
    its rank 1 dies after 3 steps and the lighthouse is stopped before the new attempt starts. The new attempt
    finds the lighthouse it reached before unreachable, says so once and waits (not the wrong-address exit of the
    test above); the lighthouse comes back on the same address, and the group trains to the end."""
    pytest.importorskip("torchft", reason="fault tolerance needs the 'ft' extra (torchft)")
    import pickle

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None
    port = free_port()
    lighthouse = _lighthouse(port)
    log_path = tmp_path / "torchrun.log"
    script = ROOT / "tests" / "scripts" / "ft_torchrun_group.py"
    env = {**_env(), "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        job = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script),
                                str(tmp_path), f"http://127.0.0.1:{port}", "engine", "alone"],
                               env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        def progress() -> list[dict]:
            path = tmp_path / "progress_g1_r0.jsonl"
            return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

        _wait_for("the first attempt's rank to die", lambda: "failed (exitcode" in log_path.read_text(), 240, job, log_path)
        lighthouse.kill()
        lighthouse.wait()
        _wait_for("the restarted attempt to wait for the lighthouse", lambda: "join_timeout=120s" in log_path.read_text(),
                  240, job, log_path)
        assert not progress(), "the restarted attempt trained without a lighthouse"
        back = time.time()
        lighthouse = _lighthouse(port)
        resumed = _wait_for("the restarted attempt's first step", lambda: any(e["committed"] for e in progress()), 120, job, log_path)
        print(f"\nlighthouse restarted -> the restarted group's first committed step: {resumed - back:.2f}s")
        stop_at = progress()[-1]["step"] + 2
        (tmp_path / "stop_at.tmp").write_text(str(stop_at))
        (tmp_path / "stop_at.tmp").rename(tmp_path / "stop_at")
        assert job.wait(timeout=120) == 0, log_path.read_text()[-4000:]
    finally:
        for process in (job, lighthouse):
            if process.poll() is None:
                process.kill()
                process.wait()
    output = log_path.read_text()
    assert output.count("answered earlier in this run but does not now") == 1, output[-4000:]
    assert "No restart can fix this" not in output, output[-4000:]
    for rank in range(2):
        status, result = pickle.loads((tmp_path / f"result_g1_r{rank}.pkl").read_bytes())
        assert status == "ok", result
        assert result["attempt"] == 1 and result["step"] == stop_at, (result["attempt"], result["step"], stop_at)
