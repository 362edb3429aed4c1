"""Lightning glue for fault tolerance: a Callback the Trainer front end adds when the option is set.

The only module of ``hp_lightning.ft`` that imports Lightning. Per optimizer step (accumulation
window): the first micro-batch joins the quorum (a returning group heals here) and snapshots the LR
schedulers; the non-final ones communicate nothing (``accumulation_mode="skip"``, required); the
optimizer's ``step(closure)`` runs Lightning's closure, votes, and steps only a committed step,
taking back the step Lightning is counting otherwise, so ``trainer.global_step`` is torchft's step
in every later hook. After an uncommitted step the schedulers go back to the snapshot at
``on_train_batch_end``, and what Lightning does after that hook (plateau schedulers, the loggers'
step) is taken back at the next hook; the window's batches are not trained again (torchft's semantics).

Healed with the weights: optimizer state, LR schedulers, loop counters, callbacks' state and the
data position. Required (checked at fit start): automatic optimization and one optimizer. Data is
split by the *fixed* replica group (:func:`replica_group_sampler`: Lightning's loader prefetches
before the quorum is known), not by participants as :class:`ParticipantBatches` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from hp_lightning.core.fault_tolerance import FaultTolerance, check_accumulation_mode
from hp_lightning.ft.data import PositionedLoader
from hp_lightning.ft.engine import FaultTolerantHSDP, Participation

__all__ = ["CommittingOptimizer", "FaultToleranceCallback", "replica_group_sampler"]


class CommittingOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step(closure)`` runs the closure, then steps only a committed step (the rest is the wrapped one's)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, ft: FaultTolerantHSDP, on_uncommitted: Callable[[], None] | None = None
    ) -> None:
        # No Optimizer.__init__: this object owns no parameters of its own.
        self.optimizer = optimizer
        self.ft = ft
        #: Called right after a vote that did not commit, before the caller counts the step.
        self.on_uncommitted = on_uncommitted
        self.last_committed: bool | None = None
        #: Whether a vote ran since the owner last cleared it (the end of an accumulation window).
        self.voted = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # read-only view of the wrapped optimizer's
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # read-only view of the wrapped optimizer's
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @override
    def step(self, closure: Any = None) -> Any:
        if closure is None and not self.ft.in_step:
            # Not a training step: torch's state-dict API initializing the optimizer's state before
            # a checkpoint loads into it (zero gradients, lr 0). Nothing to vote on.
            return self.optimizer.step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_committed = self.ft.commit()
        self.voted = True
        if not self.last_committed and self.on_uncommitted is not None:
            self.on_uncommitted()
        return loss


def _log_participation(previous: Participation | None, now: Participation) -> None:
    """One info line (group rank 0) when the quorum changes or this group heals; nothing on an ordinary step."""
    if now.healed:
        rank_zero_info(f"fault_tolerance: healed from a live replica group at step {now.step} ({now.count} group(s) take part).")
    elif previous is not None and previous.count != now.count:
        rank_zero_info(f"fault_tolerance: step {now.step}: {now.count} replica group(s) take part (was {previous.count}).")


class _SchedulersState:
    """The Trainer's LR schedulers as one stateful object (healed, and rolled back on no commit)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [config.scheduler.state_dict() for config in self.trainer.lr_scheduler_configs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for config, sd in zip(self.trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(sd)


def _optimizer_step_progress(trainer: Trainer) -> Any:
    """Lightning's counter behind ``trainer.global_step`` under automatic optimization (Lightning 2.x)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step


#: The training epoch loop's checkpoint key for the step it gives loggers (its ``_batches_that_stepped``).
_LOGGER_STEP_KEY = "_batches_that_stepped"


def _logger_step(trainer: Trainer) -> int:
    """The step Lightning gives loggers, through the loop's own checkpoint hooks rather than its private attribute."""
    return int(trainer.fit_loop.epoch_loop.on_save_checkpoint().get(_LOGGER_STEP_KEY, 0))


def _set_logger_step(trainer: Trainer, step: int) -> None:
    trainer.fit_loop.epoch_loop.on_load_checkpoint({_LOGGER_STEP_KEY: step})


class _AfterBatchEnd:
    """What Lightning changes after ``on_train_batch_end`` with no hook between (per-step ``ReduceLROnPlateau``
    schedulers, scheduler progress, the loggers' step), as it was when an uncommitted step began.

    Restored at the next hook, so these follow committed steps only.
    """

    def __init__(self, trainer: Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        self.plateau = {
            index: config.scheduler.state_dict()
            for index, config in enumerate(trainer.lr_scheduler_configs)
            if config.reduce_on_plateau and config.interval == "step"
        }
        self.scheduler_progress = epoch_loop.scheduler_progress.state_dict()
        self.logger_step = _logger_step(trainer)

    def restore(self, trainer: Trainer) -> None:
        configs = trainer.lr_scheduler_configs
        for index, state in self.plateau.items():
            configs[index].scheduler.load_state_dict(state)
        trainer.fit_loop.epoch_loop.scheduler_progress.load_state_dict(self.scheduler_progress)
        _set_logger_step(trainer, self.logger_step)


def _uncount_step(trainer: Trainer) -> None:
    """Take back the optimizer step Lightning is counting, from inside ``optimizer.step`` (an uncommitted step).

    Lightning counts *ready* before the step and *completed* after it returns; taking both back
    here leaves ``trainer.global_step`` at torchft's step in every later hook.
    """
    progress = _optimizer_step_progress(trainer)
    for tracker in (progress.total, progress.current):
        tracker.ready -= 1
        tracker.completed -= 1


class _LoopProgress:
    """Lightning's fit-loop counters (epoch, batch index, optimizer and scheduler steps, the loggers' step) as one healed object.

    Read and written through the loops' public progress objects (not the loops' own
    ``load_state_dict``, which would mark them as restarting from a checkpoint).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _progress(self) -> dict[str, Any]:
        epoch_loop = self.trainer.fit_loop.epoch_loop
        return {
            "epoch": self.trainer.fit_loop.epoch_progress,
            "batch": epoch_loop.batch_progress,
            "scheduler": epoch_loop.scheduler_progress,
            "optimizer": epoch_loop.automatic_optimization.optim_progress,
        }

    def state_dict(self) -> dict[str, Any]:
        return {**{name: progress.state_dict() for name, progress in self._progress().items()}, "logger_step": _logger_step(self.trainer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, progress in self._progress().items():
            progress.load_state_dict(state[name])
        _set_logger_step(self.trainer, int(state["logger_step"]))


class _CallbacksState:
    """Every other callback's ``state_dict()`` (those that keep one), by ``state_key``: healed with the weights."""

    def __init__(self, trainer: Trainer, own: Callback) -> None:
        self.trainer = trainer
        self.own = own

    def _callbacks(self) -> dict[str, Callback]:
        return {cb.state_key: cb for cb in self.trainer.callbacks if cb is not self.own}  # type: ignore[attr-defined]  # set by Lightning's connector

    def state_dict(self) -> dict[str, Any]:
        return {key: state for key, cb in self._callbacks().items() if (state := cb.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        callbacks = self._callbacks()
        missing = sorted(set(state) - set(callbacks))
        if missing:
            raise ValueError(
                f"Healing from a peer replica group: it has callbacks with state that this group lacks: {missing}. Every "
                f"replica group must run the same callbacks (the same Trainer configuration)."
            )
        for key, sd in state.items():
            callbacks[key].load_state_dict(sd)


class _DataPosition:
    """Which batch of which epoch the current step trains on: the same on every participating group."""

    def __init__(self) -> None:
        self.epoch = 0
        self.index = -1  # before the first batch

    def advance(self, current_epoch: int) -> None:
        """The next batch: the following one in this epoch, or the first of a new epoch."""
        if current_epoch == self.epoch:
            self.index += 1
        else:
            self.epoch, self.index = current_epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class FaultToleranceCallback(Callback):
    """Joins torchft's quorum every step and keeps the Trainer's counters and data with the commit.

    Added by :class:`~hp_lightning.HSDPStrategy` for its ``fault_tolerance`` option (a FaultTolerance
    or a dict of its fields), which calls :meth:`before_batch` from ``batch_to_device``.
    """

    def __init__(self, config: FaultTolerance | dict[str, Any]) -> None:
        resolved = FaultTolerance.from_value(config)
        if resolved is None:
            raise ValueError("FaultToleranceCallback expects a FaultTolerance (or a dict of its fields); got None.")
        self.config = resolved
        self.ft: FaultTolerantHSDP | None = None
        self._optimizer: CommittingOptimizer | None = None
        self._schedulers_before: dict[str, Any] | None = None
        self._after_batch_end_before: _AfterBatchEnd | None = None
        #: Set by an uncommitted step: restored at the next hook (see :meth:`_take_back_after_batch_end`).
        self._take_back: _AfterBatchEnd | None = None
        self._in_step = False
        self._data = _DataPosition()
        #: The training loader the strategy wrapped (None: the data position is not healed).
        self.loader: PositionedLoader | None = None
        #: The sampler epoch each generation of the loader's batches was read under.
        self._epoch_of: dict[int, int] = {}
        #: torchft's committed step count when fit ended (the same as ``trainer.global_step``).
        self.final_step: int | None = None
        #: The current step's quorum (set at each batch start): what a module may log or split by.
        self.participation: Participation | None = None
        #: (epoch, in-epoch batch index) of every training batch (micro-batch) this group ran, in order.
        self.positions: list[tuple[int, int]] = []
        #: The current batch's place in its accumulation window (0: the quorum ran at it).
        self.micro_batch = -1

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("fault_tolerance supports automatic optimization only; set automatic_optimization=True.")
        check_accumulation_mode(getattr(trainer.strategy, "accumulation_mode", "skip"), trainer.accumulate_grad_batches)
        if len(trainer.optimizers) != 1:
            raise ValueError(f"fault_tolerance expects exactly one optimizer; got {len(trainer.optimizers)}.")
        schedulers = _SchedulersState(trainer)
        self.ft = FaultTolerantHSDP(
            self.config, pl_module, trainer.optimizers[0],
            extra={
                "lr_schedulers": schedulers,
                "loops": _LoopProgress(trainer),
                "callbacks": _CallbacksState(trainer, self),
                "data": self._data,
            },
            # The strategy's own fault watchdog (its fault_watchdog option) ends the group on a failure.
            group_watchdog=False,
        )
        self._schedulers = schedulers
        self._optimizer = CommittingOptimizer(trainer.optimizers[0], self.ft, on_uncommitted=lambda: _uncount_step(trainer))
        trainer.strategy.optimizers = [self._optimizer]

    def before_batch(self, trainer: Trainer, batch: Any) -> Any:
        """Return the batch the quorum's data position names; at a window's first micro-batch join the quorum first.

        Normally that is the batch in hand; right after a heal it is re-read from the dataset.
        """
        assert self.ft is not None
        held = self._held_position(trainer)
        if self.ft.participation is None:
            # The first step of this run: a run resumed from a checkpoint continues its counters there.
            if trainer.global_step:
                self.ft.restore_step(trainer.global_step)
            if held is not None:
                self._data.epoch, self._data.index = held[0], held[1] - 1
        self._data.advance(trainer.current_epoch)
        self.micro_batch += 1
        if not self._in_step:  # the first micro-batch of an optimizer step's window
            self._begin_window(trainer)
        position = (self._data.epoch, self._data.index)
        self.positions.append(position)
        if held is None or held == position:
            return batch
        return self._reread(trainer, position)

    def _held_position(self, trainer: Trainer) -> tuple[int, int] | None:
        loader = self.loader
        if loader is None:
            return None
        generation, index = loader.take()
        # A generation not seen yet is a new epoch's iteration, read under the epoch Lightning set.
        return self._epoch_of.setdefault(generation, trainer.current_epoch), index

    def _reread(self, trainer: Trainer, position: tuple[int, int]) -> Any:
        loader = self.loader
        assert loader is not None
        epoch, index = position
        sampler = getattr(loader.batch_sampler, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]  # checked just above
        continue_at = index + 1 + loader.pending
        if loader.upcoming != continue_at or self._epoch_of.get(loader.upcoming_generation) != epoch:
            self._epoch_of[loader.jump(continue_at)] = epoch
        batch = trainer.precision_plugin.convert_input(loader.batch_at(index))
        datamodule = getattr(trainer, "datamodule", None)  # set by Lightning's data connector, not declared on Trainer
        if datamodule is not None and is_overridden("on_before_batch_transfer", datamodule):
            return datamodule.on_before_batch_transfer(batch, 0)
        return trainer.lightning_module.on_before_batch_transfer(batch, 0)

    def _begin_window(self, trainer: Trainer) -> None:
        """Join the quorum for the step whose window starts now; snapshot what an uncommitted step takes back."""
        assert self.ft is not None
        self._take_back_after_batch_end(trainer)  # before the quorum: a heal then overrides it
        self.micro_batch = 0
        previous = self.participation
        self.participation = self.ft.begin_step()  # a returning group's counters, data position, weights heal here
        _log_participation(previous, self.participation)
        self._in_step = True
        self._schedulers_before = self._schedulers.state_dict()
        self._after_batch_end_before = _AfterBatchEnd(trainer)

    def _take_back_after_batch_end(self, trainer: Trainer) -> None:
        """After an uncommitted step: restore plateau schedulers, scheduler progress and the loggers' step (once)."""
        if self._take_back is not None:
            self._take_back.restore(trainer)
            self._take_back = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._in_step:  # added by hand, without the strategy's option: no data healing
            self._begin_window(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Before epoch-interval schedulers step and ModelCheckpoint saves (both come after this hook).
        self._take_back_after_batch_end(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_back_after_batch_end(trainer)

    @property
    def last_committed(self) -> bool | None:
        """Whether the last step was applied (None before the first)."""
        return None if self._optimizer is None else self._optimizer.last_committed

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group saves (see :attr:`FaultTolerantHSDP.writes_checkpoints`); before fit: group 0."""
        return self.ft.writes_checkpoints if self.ft is not None else self.config.replica_group == 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._optimizer is not None
        if not self._optimizer.voted:  # a non-final micro-batch: the window goes on
            return
        self._optimizer.voted = False
        self._in_step = False
        if self._optimizer.last_committed is False:
            # Not applied: Lightning stepped its schedulers after the step; take that back (the step
            # counter was taken back inside the step already, see _uncount_step).
            assert self._schedulers_before is not None and self._after_batch_end_before is not None
            self._schedulers.load_state_dict(self._schedulers_before)
            self._after_batch_end_before.restore(trainer)  # scheduler progress now; plateau and loggers' step again later
            self._take_back = self._after_batch_end_before
            window = trainer.accumulate_grad_batches
            batches = "its batch" if window == 1 else f"the {window} batches of its window up to"
            rank_zero_info(
                f"fault_tolerance: step {trainer.global_step} was not committed (a replica group failed during it); "
                f"{batches} (epoch {self._data.epoch}, index {self._data.index}) are not trained again, as with torchft's "
                f"own sampler: this epoch ends one optimizer step early."
            )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.ft is not None:
            self.final_step = self.ft.step
            self.ft.shutdown()
            self.ft = None


def replica_group_sampler(
    dataset: Any, config: FaultTolerance, *, group_rank: int, group_world_size: int, shuffle: bool = True, seed: int = 0
) -> Any:
    """torchft's ``DistributedSampler``: this rank's shard among all groups' ranks (fixed by group, plain HSDP's split).

    Use it with ``Trainer(use_distributed_sampler=False)``; Lightning's would give every group the same samples.
    """
    from torchft.data import DistributedSampler

    return DistributedSampler(
        dataset, replica_rank=config.replica_group, num_replica_groups=config.num_replica_groups,
        group_rank=group_rank, num_replicas=group_world_size, shuffle=shuffle, seed=seed,
    )
