"""torchrun's in-place restart of an hp_lightning job: ``torchrun ... restart_train.py OUT PLAN``.

``PLAN`` is a global step (one node, ``torchrun --standalone --nproc-per-node 2``): rank 1
SIGKILLs itself in ``training_step`` at that step of the first attempt. ``PLAN`` is ``nodes``
(two torchrun agents, ``--nnodes 2 --nproc-per-node 2``, 4 ranks): :data:`NODES_PLAN`, which
restarts the job once and leaves the two agents with different restart counts.

Every attempt trains with a sharded checkpoint after every step and resumes from the newest one
(the first attempt finds none); which ranks die, and when, follows from the checkpoint an attempt
resumed from (not from ``TORCHELASTIC_RESTART_COUNT``, which nodes need not share). The attempt
that reaches ``MAX_STEPS`` then trains an uninterrupted run of the same recipe from scratch in
the same processes. Rank 0 writes both runs' full parameters and step counts to
``OUT/result.pt`` for the test to compare (they must be bitwise equal); every rank writes
``OUT/final.<rank>.json``: its restart count, the attempt its ranks agreed on, the checkpoint it
resumed from.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import hp_lightning
from hp_lightning.core.watchdog import elastic
from tests.helpers import RegressionModule, full_params, make_dataset, rank_loader, trainer_kwargs

MAX_STEPS = 4
DEVICES = 2
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Kill(NamedTuple):
    """At global step ``step``: ``ranks`` SIGKILL themselves, every other rank sleeps ``others_sleep`` seconds first."""

    ranks: frozenset[int]
    step: int
    others_sleep: float = 0.0


#: ``nodes``: by the step of the checkpoint an attempt resumed from (None: none). Both ranks of node 1
#: die while node 0's ranks are busy for 4 s: node 0's agent, whose workers are still running when
#: node 1's agent re-joins the rendezvous, restarts them without counting a restart (membership
#: changes are not retries), so the second attempt runs with node 0 one restart behind node 1; it
#: trains to the end.
NODES_PLAN: dict[Optional[int], Kill] = {None: Kill(frozenset({2, 3}), 1, others_sleep=4.0)}


class KilledOnce(RegressionModule):
    """The ranks of :attr:`kill` die by SIGKILL mid-fit, in ``training_step`` at its step.

    Set after construction: Lightning saves ``__init__``'s arguments in every checkpoint.
    """

    kill: Optional[Kill] = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.kill is not None and self.global_step == self.kill.step:
            if self.global_rank in self.kill.ranks:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.kill.others_sleep)
        return super().training_step(batch, batch_idx)


def newest_checkpoint(folder: Path) -> Optional[str]:
    """The checkpoint of the highest step in ``folder`` (ModelCheckpoint's ``epoch=E-step=S.ckpt`` names)."""
    steps = {int(m.group(1)): p for p in folder.glob("*.ckpt") if (m := re.search(r"step=(\d+)", p.name))}
    return str(steps[max(steps)]) if steps else None


def fit(folder: Path, kill: Optional[Kill], ckpt_path: Optional[str], nodes: int) -> tuple[dict[str, torch.Tensor], int]:
    seed_everything(0)
    model = KilledOnce()
    model.kill = kill
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    strategy = hp_lightning.HSDPStrategy(resumable_dataloaders=True)
    trainer = Trainer(devices=DEVICES, num_nodes=nodes, strategy=strategy, max_steps=MAX_STEPS, callbacks=[checkpoints],
                      **trainer_kwargs(enable_checkpointing=True))
    trainer.fit(model, rank_loader(make_dataset(), 16, DEVICES * nodes), ckpt_path=ckpt_path)
    return full_params(model), trainer.global_step


def main(out: Path, plan: str) -> None:
    torch.set_num_threads(1)
    nodes = 2 if plan == "nodes" else 1
    kills = NODES_PLAN if plan == "nodes" else {None: Kill(frozenset({1}), int(plan))}
    resume = newest_checkpoint(out / "ckpt")
    resumed_step = int(re.search(r"step=(\d+)", resume).group(1)) if resume else None  # type: ignore[union-attr]
    params, steps = fit(out / "ckpt", kills.get(resumed_step), resume, nodes)
    reference, reference_steps = fit(out / "uninterrupted", None, None, nodes)
    rank = int(os.environ["RANK"])
    agreed = elastic.agreed_attempt()
    with open(out / f"final.{rank}.json", "w") as f:
        json.dump({"restart_count": ATTEMPT, "attempt": agreed.number if agreed else None, "resumed_from": resume}, f)
    if rank == 0:
        torch.save({"attempt": ATTEMPT, "resumed_from": resume, "params": params, "steps": steps,
                    "reference": reference, "reference_steps": reference_steps}, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    # Leave without interpreter finalization (gloo worker threads can abort it after the work is done).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
