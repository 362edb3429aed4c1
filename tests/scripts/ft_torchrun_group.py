"""Replica group 1 under ``torchrun --max-restarts=1``: ``ft_torchrun_group.py OUT LIGHTHOUSE [engine|trainer] [alone]``.

``engine`` (the default): the loop of ``tests/distributed/test_fault_tolerance.py`` (same model,
data split and commit), its process group from :func:`hp_lightning.ft.init_process_group`.
``trainer``: that file's Lightning job (``Trainer(strategy=HSDPStrategy(fault_tolerance=...))``,
LR schedulers, a logger), its process group from the strategy.

In attempt 0, rank 1 SIGKILLs itself in the step after the group has committed 3 steps with group
0 (which the harness starts beside it; ``alone``: 3 steps, no other group), before its backward
(so the survivors' step cannot commit). torchrun restarts both ranks in place; the new attempt
forms a fresh process group (the agent's store outlives the dead attempt), heals from group 0 and
trains until the harness writes ``OUT/stop_at``. Progress lines: attempt 0 in
``progress_g1a0_r<rank>.jsonl``, attempt 1 in ``progress_g1_r<rank>.jsonl`` (what the harness
watches); the result in ``result_g1_r<rank>.pkl``.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from pathlib import Path

import torch

os.environ.setdefault("RUST_LOG", "warn")

#: Steps group 1's first attempt commits together with group 0 before its rank 1 is killed.
KILL_AFTER_TOGETHER = 3


def engine(out: Path, lighthouse: str, attempt: int, rank: int, progress: Path, together: int = 2) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import hp_lightning.ft as hp_ft
    from tests.distributed.test_fault_tolerance import FT_TIMEOUT, GROUP_WORLD, _build, _local_state, _loss, _train_until_stopped
    from tests.helpers import full_params

    hp_ft.init_process_group("gloo")
    model, optimizer = _build(init_device_mesh("cpu", (GROUP_WORLD,)))
    config = hp_ft.FaultTolerance(replica_group=1, num_replica_groups=2, min_replicas=1, lighthouse=lighthouse,
                                  quorum_timeout=30.0, timeout=FT_TIMEOUT, connect_timeout=10.0, join_timeout=120.0)
    ft = hp_ft.FaultTolerantHSDP(config, model, optimizer)

    committed_together, together_groups = 0, together

    def step(idx: list[int]) -> bool:
        nonlocal committed_together
        together = ft.participation is not None and ft.participation.count == together_groups
        if attempt == 0 and rank == 1 and together and committed_together >= KILL_AFTER_TOGETHER:
            os.kill(os.getpid(), signal.SIGKILL)
        _loss(model, idx).backward()
        committed = ft.commit()
        committed_together += together and committed
        return committed

    history = _train_until_stopped(ft, step, rank, str(out), None, progress)
    result = {"state": _local_state(model, optimizer), "step": ft.step, "history": history, "full": full_params(model)}
    ft.shutdown()
    torch.distributed.barrier()
    return result


def trainer(out: Path, lighthouse: str, attempt: int, rank: int, progress: Path) -> dict:
    from tests.distributed.test_fault_tolerance import _lightning_rank

    return _lightning_rank(1, rank, lighthouse, str(out), None, 1, progress,
                           kill_after_together=KILL_AFTER_TOGETHER if attempt == 0 else None)


def main(out: Path, lighthouse: str, front_end: str, alone: bool) -> dict:
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    torch.set_num_threads(1)
    progress = out / (f"progress_g1_r{rank}.jsonl" if attempt else f"progress_g1a0_r{rank}.jsonl")
    if front_end == "trainer":
        return {"attempt": attempt, **trainer(out, lighthouse, attempt, rank, progress)}
    return {"attempt": attempt, **engine(out, lighthouse, attempt, rank, progress, together=1 if alone else 2)}


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    try:
        status = ("ok", main(out_dir, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "engine", "alone" in sys.argv[4:]))
    except BaseException as exc:  # noqa: BLE001 - written for the test, then re-raised for torchrun
        status = ("error", f"group 1 rank {os.environ.get('RANK')}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(out_dir / f"result_g1_r{os.environ['RANK']}.pkl", "wb") as f:
        pickle.dump(status, f)
    sys.stdout.flush()
    os._exit(0 if status[0] == "ok" else 1)
