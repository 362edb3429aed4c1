"""torchrun's in-place restart of an hp_lightning job: ``torchrun --max-restarts=1 restart_train.py OUT KILL_STEP``.

Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``) trains with a sharded checkpoint after every step
until rank 1 SIGKILLs itself in ``training_step`` at global step ``KILL_STEP``; torchrun then
restarts both ranks. The restarted attempt resumes from the newest checkpoint in ``OUT/ckpt`` and
trains to ``MAX_STEPS``; then, in the same processes, an uninterrupted run of the same recipe
trains from scratch. Rank 0 writes both runs' full parameters and step counts to
``OUT/result.pt`` for the test to compare (they must be bitwise equal).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import hp_lightning
from tests.helpers import RegressionModule, full_params, make_dataset, rank_loader, trainer_kwargs

MAX_STEPS = 4
WORLD = 2
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KilledOnce(RegressionModule):
    """Rank 1 of the first attempt dies by SIGKILL mid-fit, in ``training_step`` at ``kill_step``."""

    def __init__(self, kill_step: Optional[int] = None) -> None:
        super().__init__()
        self.kill_step = kill_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.kill_step is not None and ATTEMPT == 0 and self.global_rank == 1 and self.global_step == self.kill_step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def newest_checkpoint(folder: Path) -> Optional[str]:
    """The checkpoint of the highest step in ``folder`` (ModelCheckpoint's ``epoch=E-step=S.ckpt`` names)."""
    steps = {int(m.group(1)): p for p in folder.glob("*.ckpt") if (m := re.search(r"step=(\d+)", p.name))}
    return str(steps[max(steps)]) if steps else None


def fit(folder: Path, kill_step: Optional[int], ckpt_path: Optional[str]) -> tuple[dict[str, torch.Tensor], int]:
    seed_everything(0)
    model = KilledOnce(kill_step)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    strategy = hp_lightning.HSDPStrategy(resumable_dataloaders=True)
    trainer = Trainer(devices=WORLD, strategy=strategy, max_steps=MAX_STEPS, callbacks=[checkpoints],
                      **trainer_kwargs(enable_checkpointing=True))
    trainer.fit(model, rank_loader(make_dataset(), 16, WORLD), ckpt_path=ckpt_path)
    return full_params(model), trainer.global_step


def main(out: Path, kill_step: int) -> None:
    torch.set_num_threads(1)
    resume = newest_checkpoint(out / "ckpt") if ATTEMPT > 0 else None
    params, steps = fit(out / "ckpt", kill_step, resume)
    reference, reference_steps = fit(out / "uninterrupted", None, None)
    if int(os.environ["RANK"]) == 0:
        torch.save({"attempt": ATTEMPT, "resumed_from": resume, "params": params, "steps": steps,
                    "reference": reference, "reference_steps": reference_steps}, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    # Leave without interpreter finalization (gloo worker threads can abort it after the work is done).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
