"""How an accumulation window communicates: ``"skip"``, ``"every"`` or ``"defer_all_reduce"``.

With ``accumulate_grad_batches=k`` Lightning runs k-1 micro-batches inside
``strategy.block_backward_sync()`` and the k-th normally. :class:`HSDPStrategy` owns that
mechanism (:mod:`hp_lightning.core.accumulation` says what each mode costs); its
``accumulation_mode`` argument sets the mode for the whole run, and
:class:`GradientAccumulationSync` is the policy that switches it through
``strategy.set_accumulation_mode()``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from hp_lightning.callbacks._common import require_hsdp_strategy, root_module
from hp_lightning.callbacks.resharding import ReshardSchedule
from hp_lightning.core.accumulation import check_mode as _check_mode
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

AccumulationMode = Literal["skip", "every", "defer_all_reduce"]


def check_mode(mode: Any, owner: str = "GradientAccumulationSync(mode=...)") -> str:
    """Validate an accumulation mode string (case-insensitive)."""
    return _check_mode(mode, owner)


class GradientAccumulationSync(Callback):
    """Choose how gradients are communicated inside an accumulation window.

    The window size is Lightning's: ``Trainer(accumulate_grad_batches=k)`` or a
    ``GradientAccumulationScheduler`` changing k at epoch boundaries; this callback only says what
    the k-1 non-final micro-batches communicate. For manual optimization use
    :func:`micro_batch_sync`, which honours the same mode.

    Args:
        mode: ``"skip"`` (default): no gradient collective until the last micro-batch; least
            communication, but every unit's full-size gradient stays resident between
            micro-batches. ``"every"``: reduce-scatter and all-reduce every micro-batch; only
            1/S-size gradient shards are kept (least memory, k times the traffic).
            ``"defer_all_reduce"`` (HSDP): reduce-scatter inside the shard group every
            micro-batch, all-reduce across replicate groups once, on the last; the memory of
            ``"every"`` with the cross-node traffic of ``"skip"``. On a 1-D (FSDP) mesh there is
            no all-reduce to defer and it behaves as ``"every"`` (a warning says so).

    Raises:
        TypeError / ValueError: for a mode that is not one of the three strings (at construction);
            TypeError in ``setup()`` when the trainer's strategy is not :class:`HSDPStrategy`.
    """

    def __init__(self, mode: AccumulationMode = "skip") -> None:
        self.mode: str = check_mode(mode)
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
        # A GradientAccumulationScheduler sets k in its own on_train_epoch_start; Lightning then
        # decides per batch which micro-batches are blocked. Re-assert the mode in case another
        # component changed it, and record the window for inspection.
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

    Non-final micro-batches run inside the strategy's ``block_backward_sync()``, so they
    communicate as ``strategy.accumulation_mode`` says (set by :class:`GradientAccumulationSync`);
    the last one runs normally. When a :class:`~hp_lightning.callbacks.ReshardSchedule` with
    ``keep_unsharded_between_micro_batches=True`` is among the callbacks, non-final micro-batches
    also keep their parameters gathered for the next one. On other parallel strategies (DDP, ...)
    it enters their ``block_backward_sync()`` (DDP's ``no_sync``), so the same training_step runs
    everywhere::

        def training_step(self, batch, batch_idx):
            last = (batch_idx + 1) % self.k == 0
            loss = self.loss(batch) / self.k
            with micro_batch_sync(self.trainer, last_micro_batch=last):
                self.manual_backward(loss)
            if last:
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()

    Args:
        trainer: the running trainer (``self.trainer`` in a LightningModule).
        last_micro_batch: True for the micro-batch after which the optimizer steps.

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
