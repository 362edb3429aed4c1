"""PP 2 x FSDP 2 on 4 ranks with one rank killed; ``tests/faults/test_pipeline_faults.py`` launches it.

Run under ``torchrun --nproc-per-node 4 pipeline_fault.py OUT --rank R --step S`` or on warm ranks
(``tests/faults/harness.py``). Each rank writes ``OUT/pid.<rank>``; rank R writes ``OUT/fault.json``
and SIGKILLs itself at global step S. Its pipeline peer's stage then fails inside torch's schedule,
which wraps the lost connection in ``RuntimeError("[Stage k] failed to run forward/backward")``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from hp_lightning import HSDPStrategy
from tests.helpers import trainer_kwargs
from tests.pipeline_models import PipelinedModule
from tests.scripts.fault_train import mark_fault


class KillAt(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.args.rank and trainer.global_step == self.args.step:
            mark_fault(self.args.out, "sigkill")
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--step", type=int, default=2)
    args = parser.parse_args()
    launch_rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    (args.out / f"pid.{launch_rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    seed_everything(0)
    strategy = HSDPStrategy(mesh_shape=[2], pipeline_parallel_size=2, pipeline_split_points=["net.blocks.2"], pipeline_microbatches=2)
    trainer = Trainer(devices=4, strategy=strategy, max_steps=6, callbacks=[KillAt(args)], **trainer_kwargs())
    trainer.fit(PipelinedModule())
    (args.out / f"finished.{trainer.global_rank}").write_text(str(trainer.global_step))
    os._exit(0)


if __name__ == "__main__":
    main()
