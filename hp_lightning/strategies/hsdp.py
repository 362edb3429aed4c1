"""HSDPStrategy: the Trainer's hooks over :class:`~hp_lightning.frontends.core.StrategyCore`.

What both front ends share (options, launch, process group, mesh, collectives, accumulation,
timeouts, checkpoint writes) is in the core; this module keeps what only the Trainer calls:
``setup`` with its optimizers and callbacks, the step methods (run by
:mod:`hp_lightning.strategies.pipeline_steps`, directly or through a pipeline schedule), the loop
boundaries, preemption, data loaders, and the Trainer's checkpoint hooks.
"""

from __future__ import annotations

import signal
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.data import has_len
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from hp_lightning import checkpoint as hp_checkpoint
from hp_lightning._lightning_private import (
    PathLike,
    Stateful,
    TrainerSubprocessScriptLauncher,
    before_resume,
    replace_sigterm_broadcast,
    should_accumulate,
)
from hp_lightning.core import agreement, devices
from hp_lightning.core.accumulation import ACCUMULATION_MODES
from hp_lightning.core.introspection import ShardingSummary
from hp_lightning.core.materialize import move_unsharded_states
from hp_lightning.core.options import STATE_DICT_TYPES
from hp_lightning.core.parallelize import ShardedModel
from hp_lightning.core.preemption import Preempted, PreemptionWatch
from hp_lightning.core.prepare import prepare_model
from hp_lightning.frontends.core import StrategyCore
from hp_lightning.ft.data import PositionedLoader
from hp_lightning.ft.lightning import FaultToleranceCallback
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.fully_shard.divergence import divergence_check
from hp_lightning.strategies.pipeline_steps import DirectSteps, PipelineSteps, split_batch
from hp_lightning.strategies.precision import HSDPPrecision, precision_from_lightning
from hp_lightning.strategies.preemption import PreemptionStop, preemption_checkpoint_path

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ACCUMULATION_MODES", "STATE_DICT_TYPES", "HSDPStrategy"]


class HSDPStrategy(StrategyCore, ParallelStrategy):
    """FSDP / HSDP training with PyTorch FSDP2 under the Lightning Trainer.

    ``Trainer(strategy="hsdp")`` shards every LightningModule: each repeated block becomes a
    sharding unit, the rest (embeddings, heads, norms) belongs to the root unit. Gradients are
    reduce-scattered inside shard groups of consecutive ranks and all-reduced across replicate
    groups; with gradient accumulation nothing is communicated until the last micro-batch.

    The keyword arguments are :class:`~hp_lightning.core.options.HSDPOptions` (documented there,
    in ``docs/configuration.md`` and in ``--help``), shared with the Fabric strategy
    (:class:`hp_lightning.fabric.HSDPFabricStrategy`).
    """

    strategy_name = "hsdp"
    _mesh_available = "once the processes are set up (from configure_model on)"
    _launcher_class = TrainerSubprocessScriptLauncher

    def _init_front_end(self) -> None:
        self._preemption = PreemptionWatch()
        self._sharded: Optional[ShardedModel] = None
        #: With ``fault_tolerance``: the callback that runs torchft's quorum and commit (from setup on).
        self._fault_tolerance: Optional[FaultToleranceCallback] = None
        # Chosen once: the step methods run directly, or through the pipeline schedule.
        self._steps = PipelineSteps(self) if self.options.pipeline_parallel_size > 1 else DirectSteps(self)

    # ------------------------------------------------------------------ properties

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The root and units after setup (None before)."""
        return self._sharded

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to inject a DistributedSampler (custom strategies must say so)."""
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    @override
    def precision_plugin(self) -> HSDPPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = HSDPPrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Lightning's connector hands us the plugin for Trainer(precision=...) inside Trainer(...):
        # converting here refuses unsupported precisions before any process starts.
        self._precision_plugin = None if precision_plugin is None else precision_from_lightning(precision_plugin)

    @property
    def _hsdp_precision(self) -> HSDPPrecision:
        return self.precision_plugin

    def _sharded_roots(self) -> list[nn.Module]:
        return [self.model] if isinstance(self.model, HSDPModule) else []

    def _agreement_trainer(self) -> Any:
        return getattr(self.lightning_module, "_trainer", None)

    # ------------------------------------------------------------------ setup

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._agreement.local_signal = lambda: self._preemption.received
        trainer = self._agreement_trainer()
        if trainer is not None:
            # Every rank must resume from the same checkpoint, or from none: compared when known.
            before_resume(trainer, lambda path: agreement.check_rank_agreement(agreement.resume_settings(path), stage="resume"))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.parallel_mesh.world

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self._failed = False
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self._steps.before_sharding(trainer)  # under PP: this rank never holds the other stages
        # Units the user sharded in configure_model are kept; everything else is sharded here,
        # and whatever is still on the meta device is allocated and initialized.
        self._sharded = prepare_model(
            self.model,
            self.parallel_mesh,
            self.sharding_plan(),
            init_device=devices.cpu_device() if self.options.cpu_offload else self.root_device,
            device=self.root_device,
        )
        self.barrier()
        self._after_sharding(self.model)
        self._steps.after_sharding()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._add_preemption_stop(trainer)
            self._add_fault_tolerance(trainer)
            # Lightning's per-batch SIGTERM broadcast (a world collective and a device read each
            # micro-batch) gives way to the once-per-step agreement PreemptionStop acts on.
            replace_sigterm_broadcast(trainer, lambda: self._fold_lightning_sigterm(trainer))
        self.setup_precision_plugin()
        if self.options.sharding_report:
            rank_zero_info(self.sharding_summary().table())

    def _add_preemption_stop(self, trainer: pl.Trainer) -> None:
        if self.options.save_on_preemption:
            preemption_checkpoint_path(trainer)  # refuse a setup that could not save, now
        environment = self.cluster_environment
        requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) and environment.auto_requeue else None
        self._preemption.signals = (signal.SIGTERM,) if requeue is None else (signal.SIGTERM, requeue)
        if not any(isinstance(cb, PreemptionStop) for cb in trainer.callbacks):  # type: ignore[attr-defined]  # set by Lightning's connector, not declared on Trainer
            trainer.callbacks.append(PreemptionStop(self._agreement, save=self.options.save_on_preemption, requeue_signal=requeue))  # type: ignore[attr-defined]  # as above

    def _add_fault_tolerance(self, trainer: pl.Trainer) -> None:
        config = self.fault_tolerance_config
        if config is None:
            return
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector, not declared on Trainer
        if any(isinstance(cb, FaultToleranceCallback) for cb in callbacks):
            raise ValueError(
                "HSDPStrategy(fault_tolerance=...) adds its own FaultToleranceCallback; the Trainer has one already. Remove "
                "it from callbacks=[...] (the option is the way to turn fault tolerance on)."
            )
        self._fault_tolerance = FaultToleranceCallback(config)
        callbacks.append(self._fault_tolerance)

    @property
    def fault_tolerance(self) -> Optional[FaultToleranceCallback]:
        """With the ``fault_tolerance`` option, during fit: the quorum's participation, commits, data positions."""
        return self._fault_tolerance

    def _training(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.stage == RunningStage.TRAINING

    @override
    def batch_to_device(self, batch: Any, device: Optional[Any] = None, dataloader_idx: int = 0) -> Any:
        if self._fault_tolerance is not None and self._training():
            # The quorum first: a returning group heals here, and its batch becomes the quorum's.
            assert self.lightning_module is not None
            batch = self._fault_tolerance.before_batch(self.lightning_module.trainer, batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def sharding_summary(self) -> ShardingSummary:
        """The per-unit table of what was sharded (a collective: every rank must call it)."""
        return self._summary(self.model if self.sharded_model is not None else None, **self._steps.report_scope())

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Rebuilt on the sharded parameters: references to the unsharded ones would be stale.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        # FSDP places the shards; only unsharded state moves.
        assert self.model is not None
        move_unsharded_states(self.model, self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Where ``configure_model`` and ``trainer.init_module(empty_init=...)`` create tensors.

        On the meta device, with construction recorded, unless ``empty_init=False`` or
        ``meta_init=False`` (None follows the option). Whatever is built on meta is initialized at
        setup, after sharding, by replaying its construction and its modules' rules, so no
        combination trains on uninitialized memory; loaded weights then overwrite it.
        """
        with self._init_context(empty_init, nullcontext()), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ steps (see pipeline_steps)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._steps.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._steps.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._steps.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        return self._steps.backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of an accumulation window, per :attr:`accumulation_mode` (a pipeline syncs itself)."""
        with self._steps.block_backward_sync():
            yield

    def _pipeline_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """(input, target) of a step's batch (:func:`~hp_lightning.strategies.pipeline_steps.split_batch`)."""
        return split_batch(self.lightning_module, args, kwargs)

    #: Lightning's name for :meth:`~hp_lightning.frontends.core.StrategyCore.all_reduce`.
    reduce = StrategyCore.all_reduce

    # ------------------------------------------------------------------ loop boundaries, preemption

    @override
    def on_train_start(self) -> None:
        # Lightning registered its SIGTERM handler (a collective inside a signal handler) just
        # before the loops; ours only records the signal, and PreemptionStop acts on it.
        self._preemption.install()
        self._agreement.reset()
        check = divergence_check(self.model) if self.model is not None else None
        if check is not None:
            check.forget_window()  # a new run starts a new accumulation window

    def _fold_lightning_sigterm(self, trainer: pl.Trainer) -> None:
        """Before each training batch, where Lightning broadcast its SIGTERM flag: no collective.

        A SIGTERM that Lightning's own handler caught (before ours took over at ``on_train_start``)
        is handed to the step's agreement, so every rank acts on it at the same batch.
        """
        if trainer.received_sigterm and not self._preemption.received:
            self._preemption.received = signal.SIGTERM

    @override
    def on_validation_start(self) -> None:
        self._install_eval_preemption()

    @override
    def on_test_start(self) -> None:
        self._install_eval_preemption()

    @override
    def on_predict_start(self) -> None:
        self._install_eval_preemption()

    def _install_eval_preemption(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            # No training batch to agree at: stop this rank now; the watchdog stops the others.
            def stop(signum: int) -> None:
                raise Preempted(signum, "during evaluation")

            self._preemption.install(on_signal=stop)

    @override
    def on_validation_end(self) -> None:
        self.reshard_all()

    @override
    def on_test_end(self) -> None:
        self.reshard_all()

    @override
    def on_predict_end(self) -> None:
        self.reshard_all()

    @override
    def on_train_end(self) -> None:
        self.reshard_all()
        self.wait_for_checkpoint()  # fit returns with every checkpoint published

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self._steps.model_state_dict(full=self.options.state_dict_type == "full")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        return None  # already loaded into the sharded model by load_checkpoint()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        return self._steps.optimizer_state(optimizer, full=self.options.state_dict_type == "full")

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return None  # already loaded (and resharded) by load_checkpoint()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"HSDPStrategy.save_checkpoint does not take storage_options; got {storage_options!r}.")
        if self._fault_tolerance is not None and not self._fault_tolerance.writes_checkpoints:
            return  # under fault tolerance one participating group writes; the others hold the same state
        path = Path(self.broadcast(str(filepath)))
        if self._mesh is not None:  # a data loader's position is per data-parallel rank (see loader_resume_warning)
            checkpoint = {**checkpoint, hp_checkpoint.DATA_PARALLEL_KEY: self._mesh.dp_size}
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._warn_mid_window_save(trainer)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self._write_checkpoint(checkpoint, path, in_background=self.options.async_save and fitting)

    def _warn_mid_window_save(self, trainer: Optional[pl.Trainer]) -> None:
        """Once per run: a save inside an accumulation window does not hold the window's gradients so far."""
        module = self.lightning_module
        if trainer is None or module is None or getattr(self, "_warned_mid_window", False):
            return
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or not module.automatic_optimization:
            return
        if trainer.accumulate_grad_batches == 1 or not should_accumulate(trainer):
            return
        self._warned_mid_window = True
        rank_zero_warn(
            f"A checkpoint was saved inside a gradient-accumulation window (accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}, at global step {trainer.global_step}): the gradients accumulated in this "
            f"window so far are not in it, so a resume from it continues with the next batch and steps without them (it "
            f"differs from the uninterrupted run). Save at window ends: ModelCheckpoint(every_n_train_steps=...), or a "
            f"val_check_interval that is a multiple of accumulate_grad_batches."
        )

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        self.wait_for_checkpoint()  # never read what a save in flight is still writing
        path = Path(self.broadcast(str(checkpoint_path)))
        rest = hp_checkpoint.load_checkpoint(
            path,
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            elsewhere=self._steps.elsewhere,
        )
        if warning := hp_checkpoint.loader_resume_warning(rest, self.parallel_mesh.dp_size):
            rank_zero_warn(warning)
        return rest

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With ``resumable_dataloaders=True``, a plain sized training ``DataLoader`` resumes mid-epoch.

        Lightning restarts a plain ``DataLoader`` at the start of its epoch on resume (and says so
        when the checkpoint was taken mid-epoch); the opt-in wrapper
        (:class:`~hp_lightning.checkpoint.ResumableLoader`, said once in the log) records the
        batches served and skips them at the sampler on resume (nothing is reloaded). A loader
        with its own state (torchdata's ``StatefulDataLoader``, recommended: Lightning checkpoints
        it natively) is never wrapped. Evaluation loaders always start from their beginning.
        """
        training = self._training()
        if training and self._fault_tolerance is not None:
            # The data position heals with the weights: the loader must say which batch each step holds.
            self._fault_tolerance.loader = PositionedLoader(dataloader)
            return self._fault_tolerance.loader
        if not (training and self.options.resumable_dataloaders and isinstance(dataloader, DataLoader) and has_len(dataloader)):
            return dataloader
        if isinstance(dataloader, Stateful):
            return dataloader
        rank_zero_info(
            "HSDPStrategy(resumable_dataloaders=True) wraps the training DataLoader in hp_lightning.ResumableLoader, so a "
            "mid-epoch resume continues the epoch. torchdata's StatefulDataLoader is checkpointed by Lightning itself "
            "and is not wrapped."
        )
        return hp_checkpoint.ResumableLoader(dataloader)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        if self._fault_tolerance is not None and not self._fault_tolerance.writes_checkpoints:
            return  # the writing group removes its own (see save_checkpoint)
        if self.is_global_zero:  # held back until the save in flight (if any) is published
            self._async_saves.remove(Path(filepath))

    # ------------------------------------------------------------------ teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown then leaves an unfinished async save unpublished: no collective
        if self._watchdog is None:
            return
        if isinstance(exception, Preempted) and exception.detail != "during evaluation":
            self._watchdog.stop()  # every rank stops here together: an orderly end, not a failure
            return
        # Post this rank's failure for the others, or (a consequence of another rank's) exit quietly.
        self._watchdog.report(exception)

    @override
    def teardown(self) -> None:
        self._stop_background()
        self._preemption.restore()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
