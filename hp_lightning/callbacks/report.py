"""What the strategy actually did to the model: a per-unit table, checked once the model is sharded.

One row per sharding unit (parameters, bytes per rank with min/max over ranks, placements, dtypes,
offload, resharding, prefetch); warnings for units mixing frozen and trainable parameters and for
meshes that shard nothing (:class:`~hp_lightning.core.introspection.ShardingSummary`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from hp_lightning.callbacks._common import require_hsdp_strategy
from hp_lightning.core.introspection import ShardingSummary, UnitReport
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShardingReport", "ShardingSummary", "UnitReport", "sharding_summary"]


def sharding_summary(strategy: HSDPStrategy) -> ShardingSummary:
    """The report of the strategy's sharded model (:meth:`HSDPStrategy.sharding_summary`). A collective."""
    return strategy.sharding_summary()


class ShardingReport(Callback):
    """Report how the model was sharded, once per setup, before the first step (one small all-reduce).

    Args:
        log_table: log the table on rank 0 (``lightning.pytorch`` logger, INFO).
        path: also write the table to this text file (rank 0); None: don't.
        warn: emit the summary's warnings.

    Attributes:
        summary: the last report (every rank has its own, with its own ``local_bytes``).

    Raises:
        TypeError: in ``setup()`` when the trainer's strategy is not :class:`HSDPStrategy`, or for
            non-bool flags / a non-string path at construction.
    """

    def __init__(self, log_table: bool = True, path: Optional[str] = None, warn: bool = True) -> None:
        for name, value in (("log_table", log_table), ("warn", warn)):
            if not isinstance(value, bool):
                raise TypeError(f"ShardingReport({name}=...) expects True or False; got {type(value).__name__} {value!r}.")
        if path is not None and not isinstance(path, (str, Path)):
            raise TypeError(f"ShardingReport(path=...) expects a file path string or None; got {type(path).__name__} {path!r}.")
        self.log_table = log_table
        self.path = None if path is None else str(path)
        self.warn = warn
        self.summary: Optional[ShardingSummary] = None
        self._pending = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_hsdp_strategy(trainer, self)
        self._pending = True  # once per trainer run, at the first *_start hook after sharding

    def _report(self, trainer: pl.Trainer) -> None:
        if not self._pending:
            return
        self._pending = False
        strategy = require_hsdp_strategy(trainer, self)
        self.summary = sharding_summary(strategy)
        text = self.summary.table()
        if self.log_table:
            rank_zero_info(text)
        if self.path is not None and trainer.is_global_zero:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(text + "\n")
        if self.warn:
            for message in self.summary.warnings:
                rank_zero_warn(f"ShardingReport: {message}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)
