"""Replica group 1 of the engine loop under ``torchrun --max-restarts=1``: ``ft_torchrun_group.py OUT LIGHTHOUSE``.

The loop is ``tests/distributed/test_fault_tolerance.py``'s (same model, data split and commit).
In attempt 0, rank 1 SIGKILLs itself in the step after the group has committed 3 steps with group
0 (which the harness starts once this attempt trains), before its backward (so the survivors' step
cannot commit). torchrun restarts both ranks in
place; the new attempt forms a fresh process group (:func:`hp_lightning.ft.init_process_group`:
the agent's store outlives the dead attempt), heals from group 0 and trains until the harness
writes ``OUT/stop_at``. Progress lines: attempt 0 in ``progress_g1a0_r<rank>.jsonl``, attempt 1 in
``progress_g1_r<rank>.jsonl`` (what the harness watches); the result in ``result_g1_r<rank>.pkl``.
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


def main(out: Path, lighthouse: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import hp_lightning.ft as hp_ft
    from tests.distributed.test_fault_tolerance import FT_TIMEOUT, GROUP_WORLD, _build, _local_state, _loss, _train_until_stopped
    from tests.helpers import full_params

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    hp_ft.init_process_group("gloo")
    model, optimizer = _build(init_device_mesh("cpu", (GROUP_WORLD,)))
    config = hp_ft.FaultTolerance(replica_group=1, num_replica_groups=2, min_replicas=1, lighthouse=lighthouse,
                                  quorum_timeout=30.0, timeout=FT_TIMEOUT, connect_timeout=10.0)
    ft = hp_ft.FaultTolerantHSDP(config, model, optimizer)

    committed_together = 0

    def step(idx: list[int]) -> bool:
        nonlocal committed_together
        together = ft.participation is not None and ft.participation.count == 2
        if attempt == 0 and rank == 1 and together and committed_together >= 3:
            os.kill(os.getpid(), signal.SIGKILL)
        _loss(model, idx).backward()
        committed = ft.commit()
        committed_together += together and committed
        return committed

    progress = out / (f"progress_g1_r{rank}.jsonl" if attempt else f"progress_g1a0_r{rank}.jsonl")
    history = _train_until_stopped(ft, step, rank, str(out), None, progress)
    result = {"attempt": attempt, "state": _local_state(model, optimizer), "step": ft.step, "history": history,
              "full": full_params(model)}
    ft.shutdown()
    torch.distributed.barrier()
    return result


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    try:
        status = ("ok", main(out_dir, sys.argv[2]))
    except BaseException as exc:  # noqa: BLE001 - written for the test, then re-raised for torchrun
        status = ("error", f"group 1 rank {os.environ.get('RANK')}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(out_dir / f"result_g1_r{os.environ['RANK']}.pkl", "wb") as f:
        pickle.dump(status, f)
    sys.stdout.flush()
    os._exit(0 if status[0] == "ok" else 1)
