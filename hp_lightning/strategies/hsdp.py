"""HSDPStrategy: the Trainer's hooks over :class:`~hp_lightning.frontends.base.StrategyBase`.

Only what the Trainer calls: ``setup`` with its optimizers and callbacks, the step methods (run by
:mod:`hp_lightning.strategies.pipeline_steps`), the loop boundaries, preemption, data loaders and
the checkpoint hooks.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from hp_lightning import checkpoint as hp_checkpoint
from hp_lightning._lightning_private import (
    PathLike,
    TrainerSubprocessScriptLauncher,
    before_resume,
    replace_sigterm_broadcast,
)
from hp_lightning.core import agreement
from hp_lightning.core.accumulation import ACCUMULATION_MODES
from hp_lightning.core.materialize import move_unsharded_states
from hp_lightning.core.options import STATE_DICT_TYPES
from hp_lightning.core.preemption import Preempted, PreemptionWatch
from hp_lightning.frontends.base import StrategyBase
from hp_lightning.frontends.constructors import TrainerConstructor
from hp_lightning.ft.data import PositionedLoader
from hp_lightning.ft.lightning import FaultToleranceCallback
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.fully_shard.divergence import divergence_check
from hp_lightning.recipe.parallelize import ShardedModel
from hp_lightning.strategies.pipeline_steps import DirectSteps, PipelineSteps
from hp_lightning.strategies.precision import HSDPPrecision, precision_from_lightning
from hp_lightning.strategies.preemption import add_preemption_stop, fold_lightning_sigterm, install_eval_preemption
from hp_lightning.strategies.trainer_loop import add_fault_tolerance, mid_window_save_warning, resumable_training_loader

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ACCUMULATION_MODES", "STATE_DICT_TYPES", "HSDPStrategy"]


class HSDPStrategy(TrainerConstructor, ParallelStrategy):
    """FSDP / HSDP training with PyTorch FSDP2 under the Lightning Trainer.

    ``Trainer(strategy="hsdp")`` shards every LightningModule: each repeated block becomes a
    sharding unit, the rest (embeddings, heads, norms) belongs to the root unit. Gradients are
    reduce-scattered inside shard groups of consecutive ranks and all-reduced across replicate
    groups. The keyword arguments are :class:`~hp_lightning.core.options.HSDPOptions`.
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
        # Set inside Trainer(...): converting here refuses unsupported precisions before any process starts.
        self._precision_plugin = None if precision_plugin is None else precision_from_lightning(precision_plugin)

    @property
    def _hsdp_precision(self) -> HSDPPrecision:
        return self.precision_plugin

    def _sharded_roots(self) -> list[nn.Module]:
        return [self.model] if isinstance(self.model, HSDPModule) else []

    def _agreement_trainer(self) -> Any:
        # Lightning's public property: it raises when the module is not attached (never a silent skip of the checks).
        module = self.lightning_module
        return None if module is None else module.trainer

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
        self._apply_parallelize_fn(self.model, in_place=True)
        self._sharded = self._shard(self.model)  # the units the user sharded in configure_model are kept
        self.barrier()
        self._steps.after_sharding()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            add_preemption_stop(trainer, self._preemption, self._agreement, self.cluster_environment, save=self.options.save_on_preemption)
            config = self.fault_tolerance_config
            self._fault_tolerance = add_fault_tolerance(trainer, config) if config is not None else None
            # Lightning's per-batch SIGTERM broadcast gives way to the once-per-step agreement PreemptionStop acts on.
            replace_sigterm_broadcast(trainer, lambda: fold_lightning_sigterm(trainer, self._preemption))
        self.setup_precision_plugin()
        self._report_sharding(lambda: self.sharding_summary().table())

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

    def _report_scope(self) -> dict[str, Any]:
        return self._steps.report_scope()

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

        On the meta device unless ``empty_init=False`` or ``meta_init=False`` (None follows the
        option); what is built on meta is initialized after sharding by replaying its construction.
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

    #: Lightning's name for :meth:`~hp_lightning.frontends.base.StrategyBase.all_reduce`.
    reduce = StrategyBase.all_reduce

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
        install_eval_preemption(self.lightning_module.trainer if self.lightning_module is not None else None, self._preemption)

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
        path = self._checkpoint_target(filepath, storage_options)
        if path is None:
            return
        if self._mesh is not None:  # a data loader's position is per data-parallel rank (see loader_resume_warning)
            checkpoint = {**checkpoint, hp_checkpoint.DATA_PARALLEL_KEY: self._mesh.dp_size}
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not getattr(self, "_warned_mid_window", False) and (warning := mid_window_save_warning(trainer, self.lightning_module)):
            self._warned_mid_window = True  # once per run
            rank_zero_warn(warning)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self._write_checkpoint(checkpoint, path, in_background=self.options.async_save and fitting)

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        path = self._checkpoint_source(checkpoint_path)
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

        Lightning restarts it at the start of its epoch; :class:`~hp_lightning.checkpoint.ResumableLoader`
        skips the batches served at the sampler. A stateful loader (torchdata's ``StatefulDataLoader``)
        is never wrapped; evaluation loaders always start from their beginning.
        """
        training = self._training()
        if training and self._fault_tolerance is not None:
            # The data position heals with the weights: the loader must say which batch each step holds.
            self._fault_tolerance.loader = PositionedLoader(dataloader)
            return self._fault_tolerance.loader
        return resumable_training_loader(dataloader) if training and self.options.resumable_dataloaders else dataloader

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        if self._another_group_writes():
            return
        if self.is_global_zero:  # held back until the save in flight (if any) is published
            self._async_saves.remove(Path(filepath))

    # ------------------------------------------------------------------ teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown then leaves an unfinished async save unpublished: no collective
        # A preemption in training stops every rank here together: an orderly end, not a failure.
        orderly = isinstance(exception, Preempted) and exception.detail != "during evaluation"
        self._end_watching(None if orderly else exception)

    @override
    def teardown(self) -> None:
        self._stop_background()
        self._preemption.restore()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
