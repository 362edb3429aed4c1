"""How an accumulation window communicates: ``"skip"``, ``"every"`` or ``"defer_all_reduce"``.

:class:`HSDPStrategy` owns the mechanism (its ``accumulation_mode`` option; what each mode costs:
:mod:`hp_lightning.core.accumulation`); :class:`GradientAccumulationSync` switches it per run.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Literal, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from hp_lightning.callbacks._common import require_hsdp_strategy, root_module
from hp_lightning.callbacks.resharding import ReshardSchedule
from hp_lightning.core.accumulation import check_mode
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

AccumulationMode = Literal["skip", "every", "defer_all_reduce"]


class GradientAccumulationSync(Callback):
    """Choose what the k-1 non-final micro-batches of an accumulation window communicate (k is Lightning's).

    For manual optimization use :func:`micro_batch_sync`, which honours the same mode.

    Args:
        mode: ``"skip"`` (default; least traffic, full-size gradients resident between
            micro-batches), ``"every"`` (least memory, k times the traffic) or ``"defer_all_reduce"``
            (HSDP: the all-reduce once per window; on a 1-D mesh as ``"every"``, with a warning).
            What each costs: :mod:`hp_lightning.core.accumulation`.

    Raises:
        TypeError / ValueError: for a mode that is not one of the three strings (at construction);
            TypeError in ``setup()`` when the trainer's strategy is not :class:`HSDPStrategy`.
    """

    def __init__(self, mode: AccumulationMode = "skip") -> None:
        self.mode: str = check_mode(mode, "GradientAccumulationSync(mode=...)")
        self._previous_mode: Optional[str] = None
        #: ``accumulate_grad_batches`` seen at the start of each training epoch (epoch -> k).
        self.window_sizes: dict[int, int] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = require_hsdp_strategy(trainer, self)
        if self.mode == "defer_all_reduce" and strategy.data_parallel_mesh.ndim != 2:
            rank_zero_warn(
                f"GradientAccumulationSync(mode='defer_all_reduce') needs an HSDP (replicate, shard) "
                f"mesh to defer the all-reduce; this mesh is 1-D {tuple(strategy.data_parallel_mesh.shape)}, so "
                f"micro-batches reduce-scatter every time, as mode='every'. Use mesh_shape=[R, S] for HSDP."
            )
        previous = strategy.set_accumulation_mode(self.mode)
        if self._previous_mode is None:
            self._previous_mode = previous

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A GradientAccumulationScheduler sets k in its own on_train_epoch_start: re-assert the mode in
        # case another component changed it, and record the window for inspection.
        strategy = require_hsdp_strategy(trainer, self)
        strategy.set_accumulation_mode(self.mode)
        self.window_sizes[trainer.current_epoch] = trainer.accumulate_grad_batches

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, HSDPStrategy) and self._previous_mode is not None:
            strategy.set_accumulation_mode(self._previous_mode)
        self._previous_mode = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r})"


@contextmanager
def micro_batch_sync(trainer: pl.Trainer, *, last_micro_batch: bool) -> Generator[None, None, None]:
    """Wrap ``manual_backward`` of one micro-batch in manual optimization.

    Non-final micro-batches run inside the strategy's ``block_backward_sync()`` (on HSDP per
    ``accumulation_mode``, keeping parameters gathered under a ``ReshardSchedule`` with
    ``keep_unsharded_between_micro_batches=True``; on DDP its ``no_sync``)::

        def training_step(self, batch, batch_idx):
            last = (batch_idx + 1) % self.k == 0
            loss = self.loss(batch) / self.k
            with micro_batch_sync(self.trainer, last_micro_batch=last):
                self.manual_backward(loss)
            if last:
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()

    Raises:
        TypeError: when ``last_micro_batch`` is not a bool.
    """
    if not isinstance(last_micro_batch, bool):
        raise TypeError(
            f"micro_batch_sync(last_micro_batch=...) expects True or False; got "
            f"{type(last_micro_batch).__name__} {last_micro_batch!r}. Example: last_micro_batch=(batch_idx + 1) % k == 0."
        )
    strategy = trainer.strategy
    if not isinstance(strategy, HSDPStrategy):
        blocking = strategy.block_backward_sync() if isinstance(strategy, ParallelStrategy) and not last_micro_batch else nullcontext()
        with blocking:
            yield
        return
    keep = not last_micro_batch and any(
        isinstance(cb, ReshardSchedule) and cb.keep_unsharded_between_micro_batches for cb in trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector, not declared on Trainer
    )
    root = root_module(strategy)
    root.set_reshard_after_backward(not keep)
    with nullcontext() if last_micro_batch else strategy.block_backward_sync():
        yield
