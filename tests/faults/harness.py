"""Launch ``tests/scripts/fault_train.py`` like a user would, and watch every rank until it is gone.

:func:`launch` starts the script with Lightning's subprocess launcher (``python script.py``), with
``torchrun``, as ``srun`` would (``slurm``), or ``warm``: each rank forked from the test session's
forkserver (torch and Lightning already imported, see ``tests/helpers.py``), in a session of its
own, running the script as ``__main__`` with the environment an external launcher gives; rank 0
serves the store, as under Lightning's launcher. Warm ranks are real processes on real gloo and
leave by the script's own exit paths (an uncaught error goes through ``sys.excepthook``, non-daemon
threads are waited for, ``atexit`` runs, as at interpreter exit); they skip only the interpreter
start-up, so every case whose subject is not the launcher uses them.

It then follows every process: the launcher or main process, and each rank, found through the
``pid.<rank>`` files the script writes. It records when each one ended. A zombie (ended, not yet
reaped) counts as ended. Output goes to a file, not a pipe, so an orphaned rank cannot keep the
test waiting for end-of-file. Whatever is still running at the timeout is killed, so that a hang
fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
#: (test, bound s, measured s, exit code) of every bounded case, printed at the end of the session.
MEASURED: list[tuple[str, float, float, Optional[int]]] = []
SCRIPT = ROOT / "tests" / "scripts" / "fault_train.py"
WORLD = 2


def _env() -> dict[str, str]:
    drop = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


@dataclass
class FaultRun:
    """What one launch did: exit code, output, the injected fault, and when each process ended."""

    returncode: Optional[int]
    output: str
    out: Path
    fault: Optional[dict]
    ended: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False
    #: Processes of the launch's session still running 10 s after every rank ended (then killed).
    leftovers: list[str] = field(default_factory=list)

    @property
    def seconds_to_exit(self) -> float:
        """From the fault to the end of the last process (launcher and every rank)."""
        assert self.fault is not None, f"the fault was never injected; output:\n{self.tail()}"
        return max(self.ended.values()) - self.fault["time"]

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.output, flags=re.MULTILINE))

    def tracebacks(self) -> list[str]:
        """Ranks that printed an uncaught traceback (torch prefixes each line with ``[rankN]:``)."""
        return re.findall(r"^\[(rank\d+)\]: Traceback \(most recent call last\)", self.output, flags=re.MULTILINE)

    def watchdog_lines(self) -> list[str]:
        # Not anchored to a line start: the ranks share one pipe, so a line can land inside another rank's output.
        return re.findall(r"\[hp_lightning\] [^\n]*", self.output)

    def tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]


def _warm_rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """One rank of a ``warm`` launch: what ``python fault_train.py ...`` does, minus the imports."""
    import atexit
    import runpy
    import threading

    os.setsid()  # a fault that signals "its process group" reaches this job only, never pytest
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(argv[1])
    sys.argv = argv
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - an uncaught error, as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    # Interpreter exit: the main thread is done, non-daemon threads are waited for, then atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch_warm(out: Path, script_args: tuple[str, ...], timeout: float, script: Path = SCRIPT, world: int = WORLD) -> FaultRun:
    from tests.helpers import rank_context

    env = _env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
    log = out / "output.txt"
    log.write_bytes(b"")
    argv = [str(script), str(out), *script_args]
    ctx = rank_context()
    procs = [
        ctx.Process(target=_warm_rank, args=(argv, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, str(log)), name=f"warm-rank{r}")
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    started, ended = time.monotonic(), {}
    timed_out = False
    while len(ended) < world:
        for rank, proc in enumerate(procs):
            if f"rank{rank}" not in ended and not _running(proc.pid):
                ended[f"rank{rank}"] = time.time()
        if time.monotonic() - started > timeout:
            timed_out = True
            break
        time.sleep(0.05)
    # 20 s: an orphaned DataLoader worker notices its parent is gone within 5 s of starting, and a
    # spawned one takes seconds to start on a loaded machine.
    leftovers = [] if timed_out else [m for proc in procs for m in _wait_for_session(proc.pid, 20.0)]
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.join(5)
    fault_file = out / "fault.json"
    fault = json.loads(fault_file.read_text()) if fault_file.exists() else None
    # The code a shell would see under Lightning's launcher: rank 0's (its main process).
    return FaultRun(procs[0].exitcode, log.read_text(errors="replace"), out, fault, ended, timed_out, leftovers)


def launch(
    out: Path, *script_args: str, launcher: str = "warm", timeout: float = 150, script: Path = SCRIPT, world: int = WORLD
) -> FaultRun:
    """Run a fault script (default ``fault_train.py``) on ``world`` ranks; return once every process has ended (or ``timeout`` passed)."""
    out.mkdir(parents=True, exist_ok=True)
    if launcher == "warm":
        return _launch_warm(out, script_args, timeout, script, world)
    env = _env()
    port = str(free_port())
    if launcher == "lightning":
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", port
        cmd = [sys.executable, str(script), str(out), *script_args]
    elif launcher == "slurm":
        # What `srun --ntasks=2` does on one node: start every task with SLURM's variables set;
        # Lightning then picks SLURMEnvironment (with auto_requeue, its default).
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(world),
            SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="hp_lightning_faults", SLURM_NODELIST="127.0.0.1",
        )
        tasks = " ".join(
            f"SLURM_PROCID={r} SLURM_LOCALID={r} {shlex.quote(sys.executable)} {shlex.quote(str(script))} "
            f"{' '.join(shlex.quote(a) for a in (str(out), *script_args))} &"
            for r in range(world)
        )
        cmd = ["bash", "-c", f"{tasks} wait"]
    elif launcher == "torchrun":
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
        assert torchrun is not None, "torchrun ships with torch and must be on PATH next to the interpreter"
        cmd = [torchrun, "--nproc-per-node", str(world), "--master-port", port, str(script), str(out), *script_args]
    else:
        raise ValueError(f"launcher must be 'warm', 'lightning', 'slurm' or 'torchrun'; got {launcher!r}")
    log = out / "output.txt"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    started, ended, pids = time.monotonic(), {}, {}
    timed_out = False
    while True:
        now_wall = time.time()
        if "main" not in ended and proc.poll() is not None:
            ended["main"] = now_wall
        for rank in range(world):
            pid_file = out / f"pid.{rank}"
            if rank not in pids and pid_file.exists() and pid_file.read_text().strip():
                pids[rank] = int(pid_file.read_text())
        for rank, pid in pids.items():
            if f"rank{rank}" not in ended and not _running(pid):
                ended[f"rank{rank}"] = now_wall
        if "main" in ended and all(f"rank{r}" in ended for r in pids):
            break
        if time.monotonic() - started > timeout:
            timed_out = True
            break
        time.sleep(0.05)
    leftovers = [] if timed_out else _wait_for_session(proc.pid, 10.0)
    _kill_everything(proc, pids.values())
    proc.wait()
    fault_file = out / "fault.json"
    fault = json.loads(fault_file.read_text()) if fault_file.exists() else None
    return FaultRun(proc.returncode, log.read_text(errors="replace"), out, fault, ended, timed_out, leftovers)


def _session_members(session: int) -> list[str]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            members.append(f"{entry.name}: {cmdline[:200]}")
    return members


def _wait_for_session(session: int, seconds: float) -> list[str]:
    """Processes still running in the launch's session after up to ``seconds`` (e.g. orphaned workers)."""
    deadline = time.monotonic() + seconds
    while True:
        members = _session_members(session)
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def _kill_everything(proc: subprocess.Popen, pids) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def record(run: FaultRun, bound: float) -> None:
    """Keep this case's measurement for the summary table (see ``tests/faults/conftest.py``)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    seconds = run.seconds_to_exit if run.fault is not None and run.ended else float("nan")
    MEASURED.append((test, bound, seconds, run.returncode))
