"""How the Trainer stops on preemption: every rank at the same batch, after an optional checkpoint.

:class:`HSDPStrategy` replaces Lightning's SIGTERM handler (which starts a collective inside the
handler and can hang the job) with :class:`~hp_lightning.core.preemption.PreemptionWatch`,
replaces Lightning's per-batch SIGTERM broadcast on the trainer's loop (a world collective and a
device read per micro-batch), and adds :class:`PreemptionStop` to the trainer's callbacks. Once
per optimizer step the ranks agree whether any of them was signalled, in the step's one control
collective (:class:`~hp_lightning.core.agreement.StepAgreement`, host-side, shared with the
divergence check before the window's communicating backward). After the optimizer step (the last
micro-batch of the window) :class:`PreemptionStop` acts on that agreed signal: every rank saves
``last.ckpt`` (with ``save_on_preemption=True``) and raises
:class:`~hp_lightning.core.preemption.Preempted` together. Under ``SLURMEnvironment(auto_requeue=True)``
SLURM's requeue signal (``SIGUSR1`` by default) takes the same path and then runs Lightning's own
requeue (the ``hpc_ckpt`` save and ``scontrol requeue``) at that batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from hp_lightning._lightning_private import should_accumulate, slurm_save_and_requeue
from hp_lightning.core.agreement import StepAgreement
from hp_lightning.core.preemption import Preempted

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


class PreemptionStop(Callback):
    """Added by :class:`~hp_lightning.HSDPStrategy` (not meant to be added by hand).

    Args:
        agreement: the strategy's step agreement (it reads the strategy's signal record).
        save: save ``last.ckpt`` before stopping.
        requeue_signal: SLURM's requeue signal under auto-requeue (None: none).
    """

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
