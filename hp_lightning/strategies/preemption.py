"""How the Trainer stops on preemption: every rank at the same batch, after an optional checkpoint.

Lightning's SIGTERM handler (a collective inside the handler: it can hang) and its per-batch
SIGTERM broadcast give way to :class:`~hp_lightning.core.preemption.PreemptionWatch`, which only
records the signal; the ranks agree on it once per optimizer step in the step's one host-side
collective (:class:`~hp_lightning.core.agreement.StepAgreement`). At the window's end
:class:`PreemptionStop` saves ``last.ckpt`` (``save_on_preemption=True``) and every rank raises
:class:`~hp_lightning.core.preemption.Preempted` together. Under
``SLURMEnvironment(auto_requeue=True)`` SLURM's requeue signal takes the same path, then runs
Lightning's own requeue at that batch.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from hp_lightning._lightning_private import should_accumulate, slurm_save_and_requeue
from hp_lightning.core.agreement import StepAgreement
from hp_lightning.core.preemption import Preempted, PreemptionWatch

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from hp_lightning.strategies.hsdp import HSDPStrategy


def preemption_checkpoint_path(trainer: pl.Trainer) -> Path:
    """Where a preemption save goes: the first ``ModelCheckpoint``'s ``last`` name, which ``ckpt_path="last"`` finds.

    Raises:
        ValueError: when the trainer has no ``ModelCheckpoint`` (nothing would find the save).
    """
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        raise ValueError(
            "HSDPStrategy(save_on_preemption=True) saves to the ModelCheckpoint's folder as "
            "'last.ckpt', where Trainer.fit(ckpt_path='last') finds it, but this trainer has no "
            "ModelCheckpoint. Keep Trainer(enable_checkpointing=True) (the default) or add a "
            "ModelCheckpoint callback, or set save_on_preemption=False."
        )
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


def add_preemption_stop(trainer: pl.Trainer, watch: PreemptionWatch, agreement: StepAgreement, environment: Any, *, save: bool) -> None:
    """Watch SIGTERM (and SLURM's requeue signal under auto-requeue) and add :class:`PreemptionStop` to ``trainer`` once.

    Raises:
        ValueError: for ``save`` on a trainer without a ``ModelCheckpoint``, at setup rather than at the signal.
    """
    if save:
        preemption_checkpoint_path(trainer)  # refuse a setup that could not save, now
    requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) and environment.auto_requeue else None
    watch.signals = (signal.SIGTERM,) if requeue is None else (signal.SIGTERM, requeue)
    if not any(isinstance(cb, PreemptionStop) for cb in trainer.callbacks):  # type: ignore[attr-defined]  # set by Lightning's connector, not declared on Trainer
        trainer.callbacks.append(PreemptionStop(agreement, save=save, requeue_signal=requeue))  # type: ignore[attr-defined]  # as above


def fold_lightning_sigterm(trainer: pl.Trainer, watch: PreemptionWatch) -> None:
    """In place of Lightning's per-batch SIGTERM broadcast: a SIGTERM its handler caught goes to the step's agreement."""
    if trainer.received_sigterm and not watch.received:
        watch.received = signal.SIGTERM


def install_eval_preemption(trainer: Optional[pl.Trainer], watch: PreemptionWatch) -> None:
    """Outside fit (validate, test, predict) there is no training batch to agree at: a signal stops this rank at once, the watchdog the others."""
    if trainer is not None and trainer.state.fn != TrainerFn.FITTING:

        def stop(signum: int) -> None:
            raise Preempted(signum, "during evaluation")

        watch.install(on_signal=stop)


class PreemptionStop(Callback):
    """Stops every rank at the agreed preemption; added by :class:`~hp_lightning.HSDPStrategy` (not by hand)."""

    def __init__(self, agreement: StepAgreement, save: bool, requeue_signal: Optional[int] = None) -> None:
        self.agreement = agreement
        self.save = save
        self.requeue_signal = requeue_signal
        #: The checkpoint written on preemption, once written.
        self.saved: Optional[Path] = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.automatic_optimization and should_accumulate(trainer):
            return  # only at the end of a window (its gradients would be lost): one agreement per step
        signum = self.agreement.step_signal()  # agreed before this window's backward, or now
        if not signum:
            return
        detail = f"stopped at step {trainer.global_step}"
        if signum == self.requeue_signal:
            # SLURM's warning before the time limit: Lightning's own requeue (hpc checkpoint,
            # `scontrol requeue`), run here, where every rank is, instead of in the signal handler.
            slurm_save_and_requeue(trainer, signum)
            detail += ", saved the hpc checkpoint and requeued the job (SLURM auto-requeue)"
        elif self.save:
            self.saved = preemption_checkpoint_path(trainer)
            trainer.save_checkpoint(self.saved)
            cast("HSDPStrategy", trainer.strategy).wait_for_checkpoint()  # published before the job ends, even with async_save (only HSDPStrategy adds this callback)
            detail += f", saved {self.saved} (resume with ckpt_path='last')"
        rank_zero_info(f"[hp_lightning] {Preempted(signum, detail)}")
        raise Preempted(signum, detail)
