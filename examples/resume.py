"""Stop, then resume on a different mesh: sharded checkpoints reshard on load.

    # 1. FSDP on 2 processes for 40 steps; a sharded checkpoint every 20 steps (and last.ckpt)
    python examples/resume.py --devices 2 --mesh-shape 2 --max-steps 40
    # 2. continue to step 80 with HSDP 2x2 on 4 processes, from that checkpoint
    python examples/resume.py --devices 4 --mesh-shape 2 2 --max-steps 80 --resume runs/resume/checkpoints/last.ckpt

The second run restores the model, the AdamW state, the LR schedule, the step counter and the
data loop position, then carries on: its first training loss continues from where the first run
stopped instead of starting over at ~4.6 (the loss of an untrained model). The same works with
``ckpt_path`` from LightningCLI: ``python examples/train.py fit --config ... --ckpt_path PATH``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/resume.py` from anywhere

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from typing_extensions import override  # noqa: E402

from examples.gpt import CharDataModule, GPTLightningModule  # noqa: E402
from hp_lightning import HSDPStrategy  # noqa: E402


class RunReport(pl.Callback):
    """Where this run started and ended, and its first and last training losses (rank 0 writes JSON)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.report: dict[str, object] = {"losses": []}

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.report["start_step"] = trainer.global_step
        self.report["mesh"] = list(trainer.strategy.device_mesh.shape)
        rank_zero_info(f"Training from step {trainer.global_step} on {trainer.strategy!r}")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.report["losses"].append([trainer.global_step, float(outputs["loss"])])  # type: ignore[union-attr]

    @override
    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.report["end_step"] = trainer.global_step
        losses = self.report["losses"]
        rank_zero_info(
            f"Stopped at step {trainer.global_step}; training loss {losses[0][1]:.3f} at step {losses[0][0]} "  # type: ignore[index]
            f"→ {losses[-1][1]:.3f} at step {losses[-1][0]}"  # type: ignore[index]
        )
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.report, indent=2))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--mesh-shape", type=int, nargs="+", default=[2], help="e.g. 2 (FSDP) or 2 2 (HSDP)")
    parser.add_argument("--max-steps", type=int, default=40, help="stop at this global step (counted from 0, not from the resume)")
    parser.add_argument("--resume", type=Path, default=None, help="checkpoint to resume from (a sharded directory or a full file)")
    parser.add_argument("--out", type=Path, default=Path("runs/resume"))
    parser.add_argument("--save-every", type=int, default=20, help="sharded checkpoint every N steps")
    parser.add_argument("--global-batch", type=int, default=32, help="windows per step over all ranks (kept when the world size changes)")
    # A small model by default so both runs take seconds; the demo's model is the same code.
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args(argv)
    if args.global_batch % args.devices:
        parser.error(f"--global-batch {args.global_batch} must be divisible by --devices {args.devices}.")
    if args.resume is not None and not args.resume.exists():
        parser.error(f"--resume {args.resume} does not exist; run once without --resume first (see the usage above).")

    seed_everything(1234, verbose=False)
    model = GPTLightningModule(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=64)
    data = CharDataModule(block_size=64, batch_size=args.global_batch // args.devices, max_chars=200_000, val_windows=64)
    checkpoints = ModelCheckpoint(
        dirpath=args.out / "checkpoints",
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=args.save_every,
        save_top_k=-1,  # keep every periodic checkpoint
        save_last=True,  # and last.ckpt, replaced in place (atomically) by each save
        enable_version_counter=False,
    )
    label = "resumed" if args.resume else "first"
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=HSDPStrategy(mesh_shape=args.mesh_shape),
        max_steps=args.max_steps,
        limit_val_batches=0,
        callbacks=[checkpoints, RunReport(args.out / f"report_{label}.json")],
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data, ckpt_path=args.resume)
    if trainer.is_global_zero:
        saved = sorted(p.name for p in (args.out / "checkpoints").iterdir())
        print(f"Sharded checkpoints (directories) in {args.out / 'checkpoints'}: {saved}")


if __name__ == "__main__":
    main()
