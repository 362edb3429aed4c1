"""When sharding units free their gathered parameters: per phase, and inside accumulation windows.

Every all-gather a unit skips is one its full-size parameters stay resident for. The root unit is
left as the strategy set it (it never reshards after forward: backward needs it at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hp_lightning.callbacks._common import all_units, in_accumulation_window, require_hsdp_strategy, root_module
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

PHASES = ("train", "validate", "test", "predict")


def _optional_bool(value: Any, name: str) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"ReshardSchedule({name}=...) expects True, False or None (None: as the strategy's "
            f"reshard_after_forward); got {type(value).__name__} {value!r}."
        )
    return value


class ReshardSchedule(Callback):
    """``reshard_after_forward`` per phase, and parameters kept gathered inside accumulation windows.

    Args:
        train: reshard each unit after its forward in training. True: least memory, two
            all-gathers per unit and micro-batch. False: one all-gather. None (default): the
            strategy's ``reshard_after_forward``.
        validate / test / predict: the same per stage (validate includes the sanity check); None:
            as ``train``. False keeps every unit gathered for the whole run (one all-gather per
            unit instead of one per batch, the full model resident), resharded when it ends.
        keep_unsharded_between_micro_batches: non-final micro-batches keep their parameters
            gathered after backward for the next one (the full model resident for the window);
            with ``train=False`` each unit is gathered once per window.

    Raises:
        TypeError: for non-bool arguments (at construction); in ``setup()`` when the trainer's
            strategy is not :class:`HSDPStrategy`.
    """

    def __init__(
        self,
        train: Optional[bool] = None,
        validate: Optional[bool] = None,
        test: Optional[bool] = None,
        predict: Optional[bool] = None,
        keep_unsharded_between_micro_batches: bool = False,
    ) -> None:
        self.train = _optional_bool(train, "train")
        self.validate = _optional_bool(validate, "validate")
        self.test = _optional_bool(test, "test")
        self.predict = _optional_bool(predict, "predict")
        if not isinstance(keep_unsharded_between_micro_batches, bool):
            raise TypeError(
                f"ReshardSchedule(keep_unsharded_between_micro_batches=...) expects True or False; got "
                f"{type(keep_unsharded_between_micro_batches).__name__} {keep_unsharded_between_micro_batches!r}."
            )
        self.keep_unsharded_between_micro_batches = keep_unsharded_between_micro_batches
        self._strategy_default: bool = True

    def reshard_after_forward(self, phase: str) -> bool:
        """The setting used in ``phase`` (one of ``"train"``, ``"validate"``, ``"test"``, ``"predict"``)."""
        if phase not in PHASES:
            raise ValueError(f"ReshardSchedule phase must be one of {PHASES}; got {phase!r}.")
        train = self._strategy_default if self.train is None else self.train
        value = getattr(self, phase)
        return train if value is None else value

    def _apply(self, trainer: pl.Trainer, phase: str) -> None:
        strategy = require_hsdp_strategy(trainer, self)
        flag = self.reshard_after_forward(phase)
        root = root_module(strategy)
        for unit in all_units(strategy):
            if unit is not root:
                unit.set_reshard_after_forward(flag, recurse=False)

    def _release(self, trainer: pl.Trainer) -> None:
        """Free whatever stayed gathered (evaluation with False, or a window cut short)."""
        strategy = trainer.strategy
        if isinstance(strategy, HSDPStrategy) and strategy.sharded_model is not None:
            root_module(strategy).set_reshard_after_backward(True)
            strategy.reshard_all()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = require_hsdp_strategy(trainer, self)
        default = getattr(strategy, "reshard_after_forward", None)
        self._strategy_default = bool(strategy.reshard_after_forward if default is None else default)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, "train")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.keep_unsharded_between_micro_batches or not pl_module.automatic_optimization:
            return  # manual optimization: micro_batch_sync applies it per micro-batch
        root = root_module(require_hsdp_strategy(trainer, self))
        root.set_reshard_after_backward(not in_accumulation_window(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, "validate")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._apply(trainer, "train")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, "test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, "predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release(trainer)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(train={self.train}, validate={self.validate}, test={self.test}, "
            f"predict={self.predict}, keep_unsharded_between_micro_batches={self.keep_unsharded_between_micro_batches})"
        )
