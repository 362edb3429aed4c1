"""Write your own policy callback: toggle the sharded model's runtime controls per unit and per phase.

    python examples/custom_callback.py            # FSDP on 2 CPU processes, 30 steps

After setup, ``trainer.strategy.sharded_model`` holds the root and the sharding units (in
forward order); each is an ``HSDPModule`` with the seed's runtime controls:
``set_reshard_after_forward``, ``set_requires_gradient_sync``, ``set_gradient_scaling_factor``,
``set_reduce_op_type``, ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``,
``unshard()`` / ``reshard()``.

:class:`HoldLastUnits` uses one of them. In training, backward starts with the last blocks, right
after their forward: resharding them after forward only to all-gather them again a moment later
is wasted communication. So the callback keeps the last ``count`` units gathered from forward to
backward (one all-gather per step instead of two), and restores resharding for validation, where
no backward follows. :class:`GatherProbe` shows the effect: it looks, right after each unit's
forward, at whether the unit's parameters are still gathered (plain tensors) or back to shards
(DTensors).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/custom_callback.py` from anywhere

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from typing_extensions import override  # noqa: E402

from examples.gpt import CharDataModule, GPTLightningModule  # noqa: E402
from hp_lightning import HSDPModule, HSDPStrategy  # noqa: E402


def sharding_units(trainer: Trainer) -> list[HSDPModule]:
    """The strategy's sharding units in forward order (the root excluded).

    Raises:
        TypeError: when the Trainer does not run HSDPStrategy.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, HSDPStrategy) or strategy.sharded_model is None:
        raise TypeError(f"This callback needs Trainer(strategy=HSDPStrategy(...)) or 'hsdp'; got {type(strategy).__name__}.")
    return strategy.sharded_model.units


class HoldLastUnits(pl.Callback):
    """Keep the last ``count`` units gathered between their forward and backward in training.

    Args:
        count: how many of the last units to hold (each costs its full-size parameters in memory).
    """

    def __init__(self, count: int = 1) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"HoldLastUnits(count=...) expects an int >= 1; got {count!r}.")
        self.count = count

    def _set(self, trainer: Trainer, reshard: bool) -> None:
        units = sharding_units(trainer)
        for unit in units[-self.count :]:
            # recurse=False: only this unit, not units nested inside it.
            unit.set_reshard_after_forward(reshard, recurse=False)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._set(trainer, reshard=False)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._set(trainer, reshard=True)  # no backward follows: free every unit after its forward

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # validation inside fit: training resumes next
            self._set(trainer, reshard=False)


class GatherProbe(pl.Callback):
    """Counts, per phase and unit, the forwards after which the unit's parameters were still gathered."""

    def __init__(self) -> None:
        self.gathered: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.forwards: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._handles: list[Any] = []

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        # Registered after fully_shard, so these hooks run after FSDP's own post-forward (reshard).
        for index, unit in enumerate(sharding_units(trainer)):
            self._handles.append(unit.register_forward_hook(self._probe(trainer, index)))

    def _probe(self, trainer: Trainer, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            phase = "train" if trainer.training else "validate"
            still_gathered = not isinstance(next(module.parameters()), DTensor)
            self.forwards[phase][index] += 1
            self.gathered[phase][index] += int(still_gathered)

        return hook

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()

    def summary(self) -> dict[str, list[str]]:
        """Per phase, per unit: ``"gathered/forwards"``."""
        return {
            phase: [f"{self.gathered[phase][i]}/{self.forwards[phase][i]}" for i in sorted(self.forwards[phase])]
            for phase in self.forwards
        }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--hold", type=int, default=1, help="how many of the last units to hold gathered")
    parser.add_argument("--report", type=Path, default=None, help="write the probe's counts as JSON here")
    args = parser.parse_args(argv)

    seed_everything(1234, verbose=False)
    model = GPTLightningModule(n_layer=4, n_head=4, n_embd=64)
    data = CharDataModule(block_size=64, batch_size=16, max_chars=200_000, val_windows=64)
    probe = GatherProbe()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="hp_fsdp",  # the registered name for HSDPStrategy(mesh_shape=[-1])
        max_steps=args.max_steps,
        val_check_interval=max(args.max_steps // 2, 1),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[HoldLastUnits(args.hold), probe],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)
    summary = probe.summary()
    rank_zero_info("Forwards after which each unit (block 0 .. last) was still gathered:")
    for phase, cells in summary.items():
        rank_zero_info(f"  {phase:9s} " + "  ".join(f"block{i}: {c}" for i, c in enumerate(cells)))
    if args.report is not None and trainer.is_global_zero:
        args.report.write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
