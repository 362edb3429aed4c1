"""What the Trainer strategy adds to the fit loop, as functions its hooks call (they are not hooks themselves)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lightning.fabric.utilities.data import has_len
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from hp_lightning import checkpoint as hp_checkpoint
from hp_lightning._lightning_private import Stateful, should_accumulate
from hp_lightning.core.fault_tolerance import FaultTolerance
from hp_lightning.ft.lightning import FaultToleranceCallback

if TYPE_CHECKING:
    import lightning.pytorch as pl


def add_fault_tolerance(trainer: pl.Trainer, config: FaultTolerance) -> FaultToleranceCallback:
    """Add the callback that runs torchft's quorum and commit to ``trainer`` (ValueError if it has one already); returns it."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector, not declared on Trainer
    if any(isinstance(cb, FaultToleranceCallback) for cb in callbacks):
        raise ValueError(
            "HSDPStrategy(fault_tolerance=...) adds its own FaultToleranceCallback; the Trainer has one already. Remove "
            "it from callbacks=[...] (the option is the way to turn fault tolerance on)."
        )
    callback = FaultToleranceCallback(config)
    callbacks.append(callback)
    return callback


def mid_window_save_warning(trainer: Optional[pl.Trainer], module: Optional[pl.LightningModule]) -> Optional[str]:
    """Why a checkpoint saved now (inside an accumulation window) differs from the uninterrupted run (None: it does not)."""
    if trainer is None or module is None or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
        return None
    if not module.automatic_optimization or trainer.accumulate_grad_batches == 1 or not should_accumulate(trainer):
        return None
    return (
        f"A checkpoint was saved inside a gradient-accumulation window (accumulate_grad_batches="
        f"{trainer.accumulate_grad_batches}, at global step {trainer.global_step}): the gradients accumulated in this "
        f"window so far are not in it, so a resume from it continues with the next batch and steps without them (it "
        f"differs from the uninterrupted run). Save at window ends: ModelCheckpoint(every_n_train_steps=...), or a "
        f"val_check_interval that is a multiple of accumulate_grad_batches."
    )


def resumable_training_loader(dataloader: object) -> object:
    """A plain sized ``DataLoader`` wrapped in :class:`~hp_lightning.checkpoint.ResumableLoader`; anything else as it is."""
    if not isinstance(dataloader, DataLoader) or not has_len(dataloader) or isinstance(dataloader, Stateful):
        return dataloader
    rank_zero_info(
        "HSDPStrategy(resumable_dataloaders=True) wraps the training DataLoader in hp_lightning.ResumableLoader, so a "
        "mid-epoch resume continues the epoch. torchdata's StatefulDataLoader is checkpointed by Lightning itself "
        "and is not wrapped."
    )
    return hp_checkpoint.ResumableLoader(dataloader)
