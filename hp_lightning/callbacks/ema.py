"""An exponential moving average (EMA) of the weights, kept on the shards: no gather, no collective per step.

Lightning's own weight averaging refuses sharded models, and gathering would undo the sharding:
the average is kept as DTensors with the parameters' placements
(:class:`~hp_lightning.core.ema.AveragedWeights`), each rank folding its shards in after each
optimizer step with one fused local op (``torch._foreach_lerp_``; no collective, no host read).

* **Memory**: one local shard per parameter in ``dtype`` (fp32 by default); one more copy in the
  parameters' dtype while the average is swapped in.
* **Checkpoints**: a sharded save writes the average's shards beside the optimizer's state (a
  resume reshards them); a full save writes it whole in the callback's state.
* **Export**: ``strategy.save_hf(path, ema=True)``, or offline ``python -m hp_lightning.checkpoint
  export-hf CKPT OUT --ema``.

With Fabric the same object drives a loop::

    ema = ShardedEMA(decay=0.999)
    ema.attach(model)                      # after fabric.setup(...)
    ...; optimizer.step(); ema.update()
    with ema.swapped():                    # evaluate the average
        evaluate(model)
    fabric.save(path, {"model": model, "optimizer": optimizer, "ema": ema.averages})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from hp_lightning.callbacks._common import require_hsdp_strategy
from hp_lightning.checkpoint import layout
from hp_lightning.checkpoint.collective import on_rank0
from hp_lightning.checkpoint.integrity import ReadCheck
from hp_lightning.checkpoint.read import dcp_index, dcp_load, read_full_file
from hp_lightning.core.checks import parse_dtype
from hp_lightning.core.ema import AVERAGE, CHECKPOINT_KEY, FORMAT, AveragedWeights, attach, averaged_weights_in

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from hp_lightning.strategies.hsdp import HSDPStrategy

#: The stages whose loop runs on the average when listed in ``swap_in``.
STAGES = ("validate", "test", "predict")
DecayFn = Callable[[int], float]


def _check_decay(decay: Any) -> Union[float, DecayFn]:
    if callable(decay):
        return decay
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not math.isfinite(decay) or not 0.0 <= decay < 1.0:
        raise ValueError(f"ShardedEMA(decay=...) expects a number in [0, 1) or a callable decay(updates) -> float; got {decay!r}.")
    return float(decay)


def _name(decay: Union[float, DecayFn]) -> str:
    """The decay as the same text in every process (a function by its import path, not its address)."""
    if callable(decay):
        return f"{getattr(decay, '__module__', '?')}.{getattr(decay, '__qualname__', type(decay).__name__)}"
    return repr(decay)


def _check_count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"ShardedEMA({name}=...) expects an int >= {least}; got {value!r}.")
    return value


class ShardedEMA(Callback):
    """Keep an exponential moving average of the weights on the shards; evaluate, save and export it.

    After optimizer step ``s`` (from ``start_step``, every ``every_n_steps``-th):
    ``average = d x average + (1 - d) x weights``. The average starts as a copy of the weights at
    ``start_step``; before that evaluation runs on the weights and ``save_hf(..., ema=True)`` is refused.

    Args:
        decay: ``d`` in [0, 1), or a callable ``decay(updates) -> float`` (in YAML: its import
            path). 0.999 averages over about 1000 updates; with ``every_n_steps=N`` use ``decay ** N``
            for the same horizon.
        warmup: cap the decay at ``(1 + n) / (10 + n)`` after ``n`` updates.
        every_n_steps: update on every N-th optimizer step only.
        start_step: the optimizer step at which the average starts.
        dtype: the average's dtype (``"fp32"`` default; None: each parameter's own). fp32 over
            bf16 weights keeps the small per-step changes from rounding away.
        swap_in: the stages that run on the average: any of ``"validate"`` (also the sanity
            check), ``"test"``, ``"predict"``. The weights are put back when the stage ends.

    Raises:
        ValueError / TypeError: for arguments out of range (at construction); in ``setup()`` for
            a strategy other than :class:`~hp_lightning.HSDPStrategy`.
    """

    def __init__(
        self,
        decay: Union[float, DecayFn] = 0.999,
        warmup: bool = False,
        every_n_steps: int = 1,
        start_step: int = 0,
        dtype: Optional[str] = "fp32",
        swap_in: Sequence[str] = STAGES,
    ) -> None:
        self.decay = _check_decay(decay)
        if not isinstance(warmup, bool):
            raise TypeError(f"ShardedEMA(warmup=...) expects True or False; got {warmup!r}.")
        self.warmup = warmup
        self.every_n_steps = _check_count(every_n_steps, "every_n_steps", 1)
        self.start_step = _check_count(start_step, "start_step", 0)
        self.dtype = parse_dtype(dtype, name="ShardedEMA(dtype=...)")
        if isinstance(swap_in, str) or any(stage not in STAGES for stage in swap_in):
            raise ValueError(f"ShardedEMA(swap_in=...) expects a list of {list(STAGES)}; got {swap_in!r}.")
        self.swap_in = tuple(swap_in)
        self._averages: Optional[AveragedWeights] = None
        self._trainer_mode = False
        self._restored = False  # this fit's checkpoint held an average (loaded into it)
        self._last_step = -1
        self._swap: Optional[AbstractContextManager] = None
        self._fit_trainer: Optional[pl.Trainer] = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(decay=_name(self.decay), every_n_steps=self.every_n_steps, start_step=self.start_step)

    # ------------------------------------------------------------------ the average

    @property
    def averages(self) -> AveragedWeights:
        """The average (pass it to ``fabric.save`` / ``fabric.load`` as a state entry); RuntimeError before there is one."""
        if self._averages is None:
            raise RuntimeError("ShardedEMA has no average yet: it is created at the start of fit (Trainer) or by ema.attach(model) (Fabric).")
        return self._averages

    def attach(self, module: nn.Module) -> AveragedWeights:
        """Follow ``module``'s trainable parameters (call after ``fabric.setup``); returns the average (started if ``start_step=0``)."""
        inner = getattr(module, "module", None)
        if hasattr(module, "_forward_module") and isinstance(inner, nn.Module):
            module = inner  # Fabric's wrapper: follow the model inside it
        self._averages = AveragedWeights(module, dtype=self.dtype)
        attach(module, self._averages)
        if self.start_step == 0:
            self._averages.copy_weights()
        return self._averages

    def update(self) -> None:
        """Fabric: call after each ``optimizer.step()``; folds the weights in when this step is due (no collective)."""
        averages = self.averages
        steps = int(averages.counters["steps"]) + 1
        averages.set_counters(steps=steps)
        self._after_step(steps)

    def swapped(self) -> AbstractContextManager:
        """The average in the model inside the block, the weights back after it; the weights alone before the average starts."""
        averages = self.averages
        return averages.swapped() if averages.valid else nullcontext()

    def _decay_now(self, updates: int) -> float:
        decay = self.decay(updates) if callable(self.decay) else self.decay
        if callable(self.decay) and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0):
            raise ValueError(f"ShardedEMA(decay={_name(self.decay)}) returned {decay!r} after {updates} updates; it must return a number in [0, 1].")
        if self.warmup:
            decay = min(decay, (1 + updates) / (10 + updates))
        return float(decay)

    def _after_step(self, step: int) -> None:
        """Optimizer step ``step`` is done: start, update, or nothing."""
        averages = self.averages
        if step < self.start_step:
            return
        if not averages.valid:
            averages.copy_weights()  # the average starts as the weights of its first step
            return
        if (step - self.start_step) % self.every_n_steps == 0:
            averages.update(self._decay_now(averages.updates))

    # ------------------------------------------------------------------ Trainer hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_hsdp_strategy(trainer, self)
        self._trainer_mode = True

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After sharding, before a checkpoint is restored: the resume loads into this average.
        if not trainer.optimizers:
            raise ValueError("ShardedEMA averages the weights after optimizer steps, but configure_optimizers returned no optimizer.")
        if self._averages is None or not self._averages.parameters_unchanged(pl_module):
            self._averages = AveragedWeights(pl_module, dtype=self.dtype)
            attach(pl_module, self._averages)
        self._restored = False
        self._fit_trainer = trainer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        averages = self.averages
        resumed_without = trainer.ckpt_path is not None and not self._restored
        if resumed_without or not averages.valid:
            if resumed_without:
                rank_zero_warn(
                    f"ShardedEMA: the checkpoint {str(trainer.ckpt_path)!r} holds no average under {self.state_key!r} (saved "
                    f"without ShardedEMA, weights only, or with another decay / every_n_steps / start_step); the average "
                    f"starts again from the restored weights."
                )
            averages.set_counters(valid=False, updates=0)
            if trainer.global_step >= self.start_step:
                averages.copy_weights()
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # inside an accumulation window: the weights did not move
        self._last_step = step
        self._after_step(step)

    def _swap_for(self, trainer: pl.Trainer, stage: str) -> None:
        if stage not in self.swap_in or self._swap is not None:
            return
        if self._averages is None or not self._averages.valid:
            if trainer.state.fn == TrainerFn.FITTING:
                return  # before the average starts the weights are the model (the sanity check, start_step)
            raise RuntimeError(
                f"ShardedEMA(swap_in={list(self.swap_in)}): trainer.{stage}() has no average to run on: none was trained in "
                f"this process, and Lightning restores callback state only in fit. Run {stage} after fit with the same "
                f"callback, export the average with strategy.save_hf(path, ema=True), or drop '{stage}' from swap_in."
            )
        if not self._averages.parameters_unchanged(trainer.lightning_module):
            raise RuntimeError(
                f"ShardedEMA: the model's parameters are not the ones its average follows (the model was sharded again, or "
                f"is another one), so trainer.{stage}() cannot run on the average. Use the trainer that trained it."
            )
        self._swap = self._averages.swapped()
        self._swap.__enter__()

    def _swap_back(self) -> None:
        if self._swap is not None:
            swap, self._swap = self._swap, None
            swap.__exit__(None, None, None)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_for(trainer, "validate")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_back()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_for(trainer, "test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_back()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_for(trainer, "predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_back()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._swap_back()  # a caught error leaves the model with its weights

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        """The counters (the average itself is added by :meth:`on_save_checkpoint`); TypeError outside a Trainer."""
        if not self._trainer_mode:
            raise TypeError(
                "ShardedEMA.state_dict() is the Trainer's callback state; with Fabric save the average itself: "
                "fabric.save(path, {'model': model, 'optimizer': optimizer, 'ema': ema.averages})."
            )
        if self._averages is None:
            return {}
        counters = self._averages.counters
        return {"format": FORMAT, "updates": int(counters["updates"]), "valid": bool(counters["valid"])}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._averages is None:
            return
        if self._swap is not None:
            raise RuntimeError(
                "ShardedEMA: a checkpoint is being saved while the average is swapped into the model (during "
                "validation, test or predict), so it would store the average as the weights. Save outside these stages."
            )
        strategy: HSDPStrategy = require_hsdp_strategy(trainer, self)
        state = strategy.optimizer_state(self._averages)  # every rank: sharded, or gathered whole on rank 0
        mine = checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, self.state_dict())
        if strategy.options.state_dict_type == "sharded":
            optimizers = checkpoint.get("optimizer_states") or []
            if not optimizers:
                raise RuntimeError("ShardedEMA: this sharded checkpoint has no optimizer state to keep the average beside.")
            optimizers[0][CHECKPOINT_KEY] = state  # written by DCP with the optimizer's shards
            mine["stored"] = "sharded"
        else:
            mine[AVERAGE] = state  # whole tensors on rank 0 (the one that writes the file)
            mine["stored"] = "full"

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the average saved with the checkpoint this ``fit`` resumes (any mesh); ValueError when it does not fit."""
        if not state_dict or state_dict.get("format") != FORMAT:
            return
        averages = self.averages
        trainer = self._fit_trainer
        if trainer is None:
            raise RuntimeError("ShardedEMA.load_state_dict is called by the Trainer while fit restores a checkpoint.")
        counters = {"updates": state_dict.get("updates", 0), "valid": state_dict.get("valid", True)}
        whole: Optional[dict[str, torch.Tensor]]
        if state_dict.get("stored") == "full":
            whole = {name: entry[AVERAGE] for name, entry in state_dict[AVERAGE].get("state", {}).items()}
        else:
            whole = self._read_sharded(Path(trainer.strategy.broadcast(str(trainer.ckpt_path))))
        if whole is None:  # read in place, shard by shard
            averages.set_counters(**counters)
            self._restored = True
            return
        missing = averages.load_whole(whole, counters)
        if missing:
            raise ValueError(f"ShardedEMA: the checkpoint's average lacks {len(missing)} parameter(s) of this model, e.g. {missing[:4]}.")
        self._restored = True

    def _read_sharded(self, path: Path) -> Optional[dict[str, torch.Tensor]]:
        """Read this rank's shards of the average from sharded directory ``path`` into it (None), or return the
        whole average of a single file that a sharded save was consolidated into (rank 0 reads it again)."""
        averages = self.averages
        if not path.is_dir():
            return on_rank0(lambda: averaged_weights_in(read_full_file(path)))
        # The average's own tensors, keyed as the save keyed them: DCP reads each rank's part into them, resharding.
        request = averages.sharded_state()
        stored = {key[3] for key in dcp_index(path) if key[:3] == ("optimizer_0", CHECKPOINT_KEY, "state") and len(key) == 5}
        missing = sorted(set(request) - stored)
        if missing:  # a partial load would leave them as they are: refused instead
            raise ValueError(f"ShardedEMA: {str(path)!r} holds no average for {len(missing)} parameter(s) of this model, e.g. {missing[:4]}.")
        check = ReadCheck(path, layout.read_manifest(path)["files"])
        dcp_load({"optimizer_0": {CHECKPOINT_KEY: {"state": request}}}, path, weights_only=None,
                 no_dist=not dist.is_initialized(), allow_partial_load=True, check=check)
        return None
