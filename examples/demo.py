"""hp_lightning in one command (``make demo``): HSDP 2x2 on 4 CPU processes, checkpoint, sample.

1. Trains the character GPT of ``examples/gpt.py`` on the standard library's source with
   ``HSDPStrategy(mesh_shape=[2, 2])``: 2 replicas x 2 shards, gloo, 4 processes launched by
   Lightning. Validation loss is printed as it falls.
2. Saves a sharded checkpoint (a directory; each rank writes its own shards).
3. Consolidates it into one full file: ``python -m hp_lightning.checkpoint consolidate SRC OUT``.
4. In one process, loads that file with the plain ``GPTLightningModule.load_from_checkpoint``
   and prints sampled text.

Options: ``--steps`` (default 300), ``--out`` (default ``runs/demo``). Takes 2-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/demo.py` from anywhere

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from typing_extensions import override  # noqa: E402

from examples.gpt import CharDataModule, GPTLightningModule  # noqa: E402
from examples.sample import load_model, sample  # noqa: E402
from hp_lightning import HSDPStrategy  # noqa: E402


class ValidationLossHistory(pl.Callback):
    """Records the epoch-level ``val_loss`` at each validation (rank 0 prints it above the progress bar)."""

    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics["val_loss"])
        change = f"   ({value - self.history[-1][1]:+.3f})" if self.history else ""
        self.history.append((trainer.global_step, value))
        rank_zero_info(f"  step {trainer.global_step:4d}   val_loss {value:.3f}{change}")


def consolidate(sharded_dir: Path, out_file: Path) -> None:
    """Sharded checkpoint directory → one full ``.ckpt`` file, with hp_lightning's command-line tool."""
    command = [sys.executable, "-m", "hp_lightning.checkpoint", "consolidate", str(sharded_dir), str(out_file)]
    print("$ " + " ".join(["python", *command[1:]]), flush=True)
    subprocess.run(command, check=True)


def train(steps: int, out: Path, devices: int = 4, mesh_shape: tuple[int, ...] = (2, 2)) -> tuple[Trainer, ValidationLossHistory]:
    """Fit the GPT under HSDP; every rank runs this (Lightning re-launches this script per rank)."""
    seed_everything(1234, verbose=False)
    model = GPTLightningModule(block_size=64, n_layer=4, n_head=4, n_embd=128, learning_rate=3e-3, warmup_steps=20)
    data = CharDataModule(block_size=64, batch_size=16, val_windows=256)
    history = ValidationLossHistory()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=HSDPStrategy(mesh_shape=list(mesh_shape)),
        max_steps=steps,
        val_check_interval=max(steps // 6, 1),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[history],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    rank_zero_info(
        f"{model.describe()}\nTraining {steps} steps on {devices} CPU processes, {trainer.strategy!r}.\n"
        f"An untrained model scores val_loss ln({model.config.vocab_size}) = {math.log(model.config.vocab_size):.2f}."
    )
    trainer.fit(model, data)
    return trainer, history


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default runs/demo)")
    parser.add_argument("--max-new-tokens", type=int, default=240)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out: Path = args.out.resolve()

    trainer, history = train(args.steps, out)
    sharded_dir = out / "sharded.ckpt"
    trainer.save_checkpoint(sharded_dir, weights_only=False)  # a collective: every rank writes its shards
    if not trainer.is_global_zero:
        return  # the other ranks are done; the rest happens in one process

    layout = sorted(p.name for p in sharded_dir.iterdir())
    print(f"\nSharded checkpoint: {sharded_dir}/ ({', '.join(layout)})")
    full_file = out / "gpt.ckpt"
    consolidate(sharded_dir, full_file)
    print(f"Consolidated checkpoint: {full_file} ({full_file.stat().st_size / 1e6:.1f} MB)")

    model = load_model(full_file)
    for text in sample(model, max_new_tokens=args.max_new_tokens):
        print(f"\n{'-' * 72}\n{text}")
    print("-" * 72)

    summary: dict[str, Any] = {
        "steps": args.steps,
        "val_loss": history.history,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    curve = "  ".join(f"{step}:{loss:.2f}" for step, loss in history.history)
    print(f"\nValidation loss by step: {curve}")
    print(f"Done in {summary['wall_seconds']:.0f} s (this process). Files are under {out}.")
    if len(history.history) >= 2 and history.history[-1][1] >= history.history[0][1]:
        raise SystemExit(f"The validation loss did not fall ({curve}); something is wrong with this setup.")


if __name__ == "__main__":
    main()
