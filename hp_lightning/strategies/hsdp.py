"""HSDPStrategy: Lightning hooks that delegate to hp_lightning's mesh, wrapping and sharding pieces."""

from __future__ import annotations

import signal
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.data import has_len
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from hp_lightning import _frontend as frontend
from hp_lightning import checkpoint as checkpoint_io
from hp_lightning.checkpoint import AsyncSaves
from hp_lightning._lightning_private import (
    before_resume,
    PathLike,
    Stateful,
    TrainerSubprocessScriptLauncher,
    distributed_is_initialized,
    replace_sigterm_broadcast,
    should_accumulate,
    sync_ddp_if_available,
)
from hp_lightning.core import agreement, devices, watchdog
from hp_lightning.core.accumulation import ACCUMULATION_MODES, check_mode, no_gradient_sync
from hp_lightning.core.introspection import ShardingSummary, summarize, units_in_order
from hp_lightning.core.mesh import ParallelMesh, describe, set_collective_timeout
from hp_lightning.core.options import DEFAULT_TIMEOUT, STATE_DICT_TYPES, HSDPOptions
from hp_lightning.core.parallelize import ShardedModel, ShardingPlan
from hp_lightning.core.prepare import prepare_model
from hp_lightning.core.materialize import meta_init_context, move_unsharded_states
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.fully_shard.divergence import gradients_stay_local
from hp_lightning.parallel.pipeline import PipelineRunner, gather_stages_on_rank0, split_stage
from hp_lightning.core.preemption import Preempted, PreemptionWatch
from hp_lightning.strategies.precision import HSDPPrecision, precision_from_lightning
from hp_lightning.strategies.preemption import PreemptionStop, preemption_checkpoint_path

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ACCUMULATION_MODES", "STATE_DICT_TYPES", "HSDPStrategy"]


class HSDPStrategy(frontend.MeshAccess, ParallelStrategy):
    """FSDP / HSDP training with PyTorch FSDP2 under the Lightning Trainer.

    ``Trainer(strategy="hsdp")`` shards every LightningModule: each repeated block becomes a
    sharding unit, the rest (embeddings, heads, norms) belongs to the root unit. Gradients are
    reduce-scattered inside shard groups of consecutive ranks and all-reduced across replicate
    groups; with gradient accumulation nothing is communicated until the last micro-batch.

    Args:
        mesh_shape: the data-parallel dims. None → HSDP ``(num_nodes, devices_per_node / tp)``;
            ``[N]`` → FSDP over N ranks; ``[R, S]`` → HSDP, R replicas of S shards (S consecutive
            ranks each). One size may be -1 (inferred from the world size / tp).
        tensor_parallel_size: ranks per tensor-parallel group (the innermost mesh dim ``"tp"``;
            its ranks see the same batch). 1 = off.
        expert_parallel_size: ranks the experts are split over (dim ``"ep"``, carved out of the
            shard dim: EP ranks are data-parallel ranks too). 1 = off.
        tp_plan: module-name glob → style name (``"colwise"``, ``"rowwise"``,
            ``"colwise_gather_output"``, ``"embedding_rowwise"``, ``"sequence_parallel"``) or a
            torch ``ParallelStyle``, applied before sharding. None → the Hugging Face models' own
            ``base_model_tp_plan``. Unused when ``tensor_parallel_size=1``.
        expert_modules: module-name globs of the grouped-experts modules to split over ``ep``
            (None → ``["*experts"]``). Unused when ``expert_parallel_size=1``.
        pipeline_parallel_size: pipeline stages (the outermost mesh dim ``"pp"``); each rank
            builds only its stage and shards it over its own data-parallel sub-mesh. 1 = off.
        pipeline_split_points: module names where stages 1, 2, ... start (``["net.blocks.2"]``);
            see :mod:`hp_lightning.parallel.pipeline` for how the model is cut and what its
            ``forward`` must allow. The LightningModule provides ``forward`` (one stage's input to
            its output) and ``pipeline_loss(output, target)``; ``pipeline_batch(batch)`` may
            override the default ``(batch[0], batch[1])`` split into input and target.
        pipeline_schedule: ``"1f1b"`` (default: at most ``stages`` micro-batches of activations
            alive) or ``"gpipe"`` (all micro-batches forward, then all backward); torch's schedules.
        pipeline_microbatches: micro-batches per batch (None → the number of stages); more
            shrink the bubble, ``(stages - 1) / (microbatches + stages - 1)`` of each step.
        shard_modules: sharding units as classes, dotted class paths, class names or module-name
            globs. None → HF ``_no_split_modules``, else the blocks of repeated ``nn.ModuleList`` s.
        reshard_after_forward: free gathered unit parameters after forward (less memory) or keep
            them for backward (one all-gather fewer per unit and step).
        param_dtype: compute dtype of gathered parameters (``"bf16"``, ``"fp32"``, ...); None →
            derived from ``Trainer(precision=...)``.
        reduce_dtype: dtype of gradient reduction; None → derived from the precision.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the host.
        activation_checkpointing: blocks (same forms as ``shard_modules``) whose activations are
            recomputed in backward instead of stored.
        ignored_params: parameter-name globs left alone: not sharded, gradients not synchronized.
        replicate_params: parameter-name globs kept whole on every rank, gradients all-reduced.
        comm_fusion: bucket the replicate-parameter all-reduces of each unit into one.
        reduce_op: ``"avg"`` (mean over data-parallel ranks) or ``"sum"``.
        gradient_scaling_factor: multiply reduced gradients by this factor (None: off).
        shard_placement: parameter-name glob → dim to shard on (default dim 0).
        prefetch: each unit all-gathers the next N units in forward and the previous N in
            backward; 0 leaves prefetching to FSDP2's defaults.
        forward_methods: extra LightningModule methods that run the model outside the step
            methods (``generate`` is registered automatically when present).
        accumulation_mode: what the non-final micro-batches of an accumulation window
            communicate: ``"skip"`` (nothing), ``"every"`` (reduce-scatter and all-reduce) or
            ``"defer_all_reduce"`` (reduce-scatter only; HSDP). See
            :mod:`hp_lightning.core.accumulation`; :meth:`set_accumulation_mode` changes it later.
        state_dict_type: ``"sharded"`` (a directory, one shard per rank) or ``"full"`` (one file
            rank 0 writes, loadable on a single CPU process).
        sharding_report: log the table of units, bytes per rank, placements and dtypes at setup
            (the same table as the ``ShardingReport`` callback).
        process_group_backend: None → gloo for CPU, nccl for CUDA, hccl for NPU (with gloo added
            for host tensors under ``cpu_offload``: ``"cpu:gloo,cuda:nccl"``).
        timeout: collective timeout, in seconds or as a timedelta: until the first optimizer
            step, and for the whole run unless ``train_timeout`` is set.
        train_timeout: a shorter collective timeout from the first optimizer step on, once
            rendezvous, compilation and checkpoint loading are behind (as torchtitan does).
            None keeps ``timeout``.
        fault_watchdog: when one rank fails (an exception, SIGKILL, the OOM killer, a frozen
            process), stop every rank within seconds, with the first failure named once and the
            others exiting with code 3 (see :mod:`hp_lightning.core.watchdog`). Costs a thread and
            three small store operations per rank and second. Off: a failure surfaces on the
            other ranks as a gloo/NCCL error, or as a hang until ``timeout``.
        heartbeat_timeout: seconds without a heartbeat before a rank counts as lost (frozen,
            deadlocked, host down). Dead processes on the same host are found within a second
            regardless; the heartbeat thread runs beside the training loop, so long steps are fine.
        failure_exit_grace: seconds a failed rank gets to print its traceback and exit; the
            other ranks wait that long at most, and a failed process still alive after it
            (a non-daemon thread) is ended.
        save_on_preemption: on SIGTERM (preemption), save ``last.ckpt`` in the
            ``ModelCheckpoint`` folder before stopping, so ``fit(ckpt_path="last")`` resumes at
            that step. Either way every rank stops at the same batch, at the end of its
            accumulation window, with exit code 143 (see :mod:`hp_lightning.core.preemption`).
        divergence_check: ``"per_step"`` (default): before each backward that issues gradient
            collectives (the window's last under ``accumulation_mode="skip"``), the ranks compare
            which units and parameters their backward passes reach, and a rank-dependent graph
            stops every rank with a ``RankDivergenceError`` naming them, instead of a hang or
            mixed gradients (see :mod:`hp_lightning.fully_shard.divergence`). It costs a Python
            walk of the autograd graph per backward and two integers per parameter in the step's
            one control all-reduce (host-side, shared with preemption; ``docs/benchmarks.md``).
            ``"off"``: no walk, and the control all-reduce carries the preemption signal only.
            (YAML reads a bare ``off`` as False: False means ``"off"``, True ``"per_step"``.)
        meta_init: build ``configure_model`` (and ``trainer.init_module()``) on the meta device,
            recording construction, and initialize after sharding by replaying it and the
            modules' own rules: the model never exists whole on a rank, and equals the one a
            real build would give; a tensor nothing initializes is an error at setup (see
            ``docs/models.md``). False builds on the host: every rank holds the whole model once.
        checkpoint_checksums: sharded saves also record every file's SHA-256 (a read-back of the
            new files, spread over the ranks), and every resume checks every byte against them
            (a full read). False: the manifest records sizes, and a resume checks those and the
            manifest without reading the data (a same-size alteration is then not caught;
            ``python -m hp_lightning.checkpoint verify`` reports which check it could make).
        resumable_dataloaders: opt in to wrapping a plain sized training ``DataLoader`` in
            :class:`hp_lightning.ResumableLoader` (said once in the log), so a run resumed
            mid-epoch continues the epoch instead of restarting it. Off (default), plain loaders
            are left alone and restart their epoch on resume, as in Lightning (which warns when
            the checkpoint was taken mid-epoch). Recommended instead: torchdata's
            ``StatefulDataLoader``, which Lightning checkpoints itself (never wrapped).
        async_save: sharded saves during ``fit`` copy the state to host memory and return; a
            background thread writes the files and the checkpoint is published (atomically) when
            every rank's write is done. At most one save is in flight: the next one due first
            waits for it. Saves outside ``fit``, on preemption and at the end of ``fit`` are
            complete when they return. Needs ``state_dict_type="sharded"``.
    """

    strategy_name = "hsdp"
    _mesh_available = "once the processes are set up (from configure_model on)"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        *,
        mesh_shape: Optional[Sequence[int]] = None,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        tp_plan: Optional[dict[str, str]] = None,
        expert_modules: Optional[Sequence[str]] = None,
        shard_modules: Optional[Sequence[Union[str, type]]] = None,
        reshard_after_forward: bool = True,
        param_dtype: Optional[str] = None,
        reduce_dtype: Optional[str] = None,
        cpu_offload: bool = False,
        activation_checkpointing: Optional[Sequence[Union[str, type]]] = None,
        ignored_params: Optional[Sequence[str]] = None,
        replicate_params: Optional[Sequence[str]] = None,
        comm_fusion: bool = False,
        reduce_op: Literal["avg", "sum"] = "avg",
        gradient_scaling_factor: Optional[float] = None,
        shard_placement: Optional[Mapping[str, int]] = None,
        prefetch: int = 1,
        forward_methods: Optional[Sequence[str]] = None,
        accumulation_mode: Literal["skip", "every", "defer_all_reduce"] = "skip",
        state_dict_type: Literal["sharded", "full"] = "sharded",
        sharding_report: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT,
        train_timeout: Optional[Union[float, timedelta]] = None,
        fault_watchdog: bool = True,
        heartbeat_timeout: float = 120.0,
        failure_exit_grace: float = 30.0,
        save_on_preemption: bool = False,
        divergence_check: Union[Literal["per_step", "off"], bool] = "per_step",
        meta_init: bool = True,
        resumable_dataloaders: bool = False,
        checkpoint_checksums: bool = False,
        async_save: bool = False,
        pipeline_parallel_size: int = 1,
        pipeline_split_points: Optional[Sequence[str]] = None,
        pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b",
        pipeline_microbatches: Optional[int] = None,
    ) -> None:
        # Validate everything here: this runs in Trainer(...) before any process or group exists.
        self.options = HSDPOptions(
            mesh_shape=mesh_shape,
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel_size=expert_parallel_size,
            tp_plan=tp_plan,
            expert_modules=expert_modules,
            shard_modules=shard_modules,
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            ignored_params=ignored_params,
            replicate_params=replicate_params,
            comm_fusion=comm_fusion,
            reduce_op=reduce_op,
            gradient_scaling_factor=gradient_scaling_factor,
            shard_placement=shard_placement,
            prefetch=prefetch,
            forward_methods=forward_methods,
            accumulation_mode=accumulation_mode,
            state_dict_type=state_dict_type,
            sharding_report=sharding_report,
            process_group_backend=process_group_backend,
            timeout=timeout,
            train_timeout=train_timeout,
            fault_watchdog=fault_watchdog,
            heartbeat_timeout=heartbeat_timeout,
            failure_exit_grace=failure_exit_grace,
            save_on_preemption=save_on_preemption,
            divergence_check=divergence_check,
            meta_init=meta_init,
            resumable_dataloaders=resumable_dataloaders,
            checkpoint_checksums=checkpoint_checksums,
            async_save=async_save,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_split_points=pipeline_split_points,
            pipeline_schedule=pipeline_schedule,
            pipeline_microbatches=pipeline_microbatches,
        )
        self._process_group_backend = self.options.process_group_backend
        self._accumulation_mode = self.options.accumulation_mode
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._mesh: Optional[ParallelMesh] = None
        self._sharded: Optional[ShardedModel] = None
        self._watchdog: Optional[watchdog.FaultWatchdog] = None
        self._preemption = PreemptionWatch()
        # The step's one control collective (preemption, divergence): on a host group from setup on.
        self._agreement = agreement.StepAgreement()
        self._train_timeout_set = False
        self._async_saves = AsyncSaves()
        self._failed = False
        self._pipeline: Optional[PipelineRunner] = None
        self._pipeline_grads: list[tuple[torch.nn.Parameter, Optional[Tensor]]] = []
        self._pipeline_elsewhere: frozenset[str] = frozenset()  # model keys the other stages hold

    # ------------------------------------------------------------------ properties

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The root and units after setup (None before)."""
        return self._sharded

    @property
    def state_dict_type(self) -> str:
        return self.options.state_dict_type

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    def reshard_after_forward(self) -> bool:
        """The ``reshard_after_forward`` units were sharded with (the root always keeps its parameters)."""
        return self.options.reshard_after_forward

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.data_parallel_sampler_kwargs(self.world_size, self.global_rank)

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to inject a DistributedSampler (custom strategies must say so)."""
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property  # type: ignore[override]
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

    # ------------------------------------------------------------------ launch and process group

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this inside Trainer(...) once devices and nodes are known: the last
        # moment to refuse a mesh that cannot cover the world before any process starts.
        frontend.check_mesh_fits(self)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = TrainerSubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._process_group_backend = frontend.join_process_group(self, self._process_group_backend)
        # First thing once the process group exists: from here on, a failure anywhere stops every rank.
        self._watchdog = frontend.start_watchdog(self, self._watchdog)
        trainer = getattr(self.lightning_module, "_trainer", None)
        self._mesh = frontend.agree_and_build_mesh(self, self.precision_plugin.precision, trainer)
        frontend.move_agreement_to_host_group(self, self._agreement)
        self._agreement.local_signal = lambda: self._preemption.received
        self.precision_plugin.data_parallel_group = self._mesh.dp_group  # gradient clipping: one norm per replica
        if trainer is not None:
            # Every rank must resume from the same checkpoint, or from none: compared when known.
            before_resume(trainer, lambda path: agreement.check_rank_agreement(agreement.resume_settings(path), stage="resume"))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh.world
        self.precision_plugin.device_type = self.root_device.type

    def set_world_ranks(self) -> None:
        frontend.set_world_ranks(self)

    # ------------------------------------------------------------------ model setup

    def sharding_plan(self) -> ShardingPlan:
        """The plan :func:`hp_lightning.core.parallelize.parallelize` applies, from this strategy's options."""
        return self.options.sharding_plan(
            derived_param_dtype=self.precision_plugin.derived_param_dtype,
            derived_reduce_dtype=self.precision_plugin.derived_reduce_dtype,
            device_type=self.root_device.type,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self._failed = False
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if self.options.pipeline_parallel_size > 1:
            self._cut_pipeline_stage(trainer)  # before sharding: this rank never holds the other stages
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
        frontend.configure_divergence_check(self.model, self._agreement, self.options.divergence_check)
        self.scope_metrics_to_data_parallel(self.model)
        if self.options.pipeline_parallel_size > 1:
            self._start_pipeline()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._add_preemption_stop(trainer)
            # Lightning's per-batch SIGTERM broadcast (a world collective and a device read each
            # micro-batch) gives way to the once-per-step agreement PreemptionStop acts on.
            replace_sigterm_broadcast(trainer, lambda: self._fold_lightning_sigterm(trainer))
        self.setup_precision_plugin()
        if self.options.sharding_report:
            rank_zero_info(self.sharding_summary().table())

    # ------------------------------------------------------------------ pipeline parallelism

    def _cut_pipeline_stage(self, trainer: pl.Trainer) -> None:
        """Refuse what PP cannot run yet (before any collective), then cut the model to this rank's stage."""
        module = self.lightning_module
        assert module is not None and self.model is not None
        pp = self.options.pipeline_parallel_size
        where = f"HSDPStrategy(pipeline_parallel_size={pp})"
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError(f"{where}: the pipeline schedule runs forward and backward itself, so manual optimization cannot; set automatic_optimization=True.")
        if not is_overridden("forward", module, LightningModule):
            raise ValueError(f"{where}: each stage runs the LightningModule's forward(x) on its part of the model; {type(module).__name__} does not define forward.")
        if trainer.state.fn != TrainerFn.PREDICTING and not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(
                f"{where}: the last stage computes the loss with the LightningModule's pipeline_loss(output, target), which "
                f"{type(module).__name__} does not define. Add e.g. `def pipeline_loss(self, output, target): return F.mse_loss(output, target)`."
            )
        not_called = [hook for hook in ("training_step", "validation_step", "test_step", "predict_step") if is_overridden(hook, module, LightningModule)]
        if not_called:
            rank_zero_warn(
                f"{where}: the pipeline schedule runs each stage's forward and the last stage's pipeline_loss, so "
                f"{type(module).__name__}'s {not_called} are not called: train_loss / val_loss / test_loss are logged, and "
                f"predict returns the last stage's forward output. Put per-batch work in pipeline_batch / pipeline_loss or a callback."
            )
        stage = self.parallel_mesh.pp.get_local_rank()
        if module.__dict__.get("_hp_pipeline_stage") is not None:  # cut by an earlier fit/validate/predict
            self._pipeline_elsewhere = module.__dict__["_hp_pipeline_elsewhere"]
            return
        before = set(module.state_dict(keep_vars=True))
        kept, removed = split_stage(module, self.options.pipeline_split_points, stage)
        self._pipeline_elsewhere = frozenset(before - set(module.state_dict(keep_vars=True)))
        module.__dict__["_hp_pipeline_stage"] = stage
        module.__dict__["_hp_pipeline_elsewhere"] = self._pipeline_elsewhere
        rank_zero_info(f"[hp_lightning] pipeline stage 0 of {pp}: {kept}; the other stages hold {len(removed)} more unit(s)")

    def _start_pipeline(self) -> None:
        assert self.model is not None and self.lightning_module is not None
        mesh = self.parallel_mesh
        self._pipeline = PipelineRunner(
            self.model,
            stage_index=mesh.pp.get_local_rank(),
            num_stages=self.options.pipeline_parallel_size,
            device=self.root_device,
            group=mesh.pp.get_group(),
            schedule=self.options.pipeline_schedule,
            microbatches=self.options.pipeline_microbatches,
            loss_fn=getattr(self.lightning_module, "pipeline_loss", None),
        )
        self.precision_plugin.pipeline_group = mesh.pp.get_group()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None and module.trainer is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        inputs, target = self._pipeline_batch(args, kwargs)
        accumulate = module.trainer.accumulate_grad_batches
        params = list(module.parameters())
        if batch_idx % accumulate == 0:  # a new window: what Lightning's zero_grad would do, before our backward
            for p in params:
                p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._pipeline.step(inputs, target, accumulate=accumulate)
        # The schedule ran backward already; Lightning zeroes gradients after training_step and
        # before backward, so they wait aside until backward() puts them back.
        self._pipeline_grads = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None
        module.log("train_loss", loss, sync_dist=True)
        return loss

    def _pipeline_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """(input, target) of a step's batch: the LightningModule's ``pipeline_batch``, else ``batch[0], batch[1]``."""
        batch = args[0] if args else kwargs["batch"]
        split = getattr(self.lightning_module, "pipeline_batch", None)
        if callable(split):
            return split(batch)
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch[0], batch[1]
        if isinstance(batch, torch.Tensor):
            return batch, None
        got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else f"a {type(batch).__name__}"
        raise TypeError(
            f"Pipeline: cannot tell input from target in {got} (the default reads (input, target) pairs only, so "
            f"nothing is dropped silently); define pipeline_batch(self, batch) -> (input, target) on the LightningModule."
        )

    def _pipeline_eval_step(self, metric: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> STEP_OUTPUT:
        assert self._pipeline is not None and self.lightning_module is not None
        inputs, target = self._pipeline_batch(args, kwargs)
        loss, _ = self._pipeline.evaluate(inputs, target)
        self.lightning_module.log(metric, loss, sync_dist=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval_step("val_loss", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval_step("test_loss", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        inputs, _ = self._pipeline_batch(args, kwargs)
        return self._pipeline.evaluate(inputs, None, outputs=True)[1]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Lightning's sequence, hooks included, with the schedule's gradients in place of a backward.
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        for p, grad in self._pipeline_grads:
            p.grad = grad
        self._pipeline_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _add_preemption_stop(self, trainer: pl.Trainer) -> None:
        if self.options.save_on_preemption:
            preemption_checkpoint_path(trainer)  # refuse a setup that could not save, now
        environment = self.cluster_environment
        requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) and environment.auto_requeue else None
        self._preemption.signals = (signal.SIGTERM,) if requeue is None else (signal.SIGTERM, requeue)
        if not any(isinstance(cb, PreemptionStop) for cb in trainer.callbacks):
            trainer.callbacks.append(
                PreemptionStop(self._agreement, save=self.options.save_on_preemption, requeue_signal=requeue)
            )

    def sharding_summary(self) -> ShardingSummary:
        """The per-unit table of what was sharded (a collective: every rank must call it)."""
        if not isinstance(self.model, HSDPModule) or self._sharded is None:
            raise RuntimeError("HSDPStrategy.sharding_summary() is available once setup() has sharded the model.")
        sharded = self._sharded
        return summarize(
            self.model,
            units_in_order(self.model, sharded.units),
            self.parallel_mesh.world,
            [*sharded.ignored, *sharded.replicated],
            self.root_device,
            **self._pipeline_report_scope(),
        )

    def _pipeline_report_scope(self) -> dict[str, Any]:
        """Under PP, the report covers this stage: its ranks' min/max, its index in the title."""
        mesh = self._mesh
        if mesh is None or mesh.layout.pp == 1:
            return {}
        return {"group": mesh.dp_group, "stage": (mesh.pp.get_local_rank(), mesh.layout.pp)}

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers are (re)built on the sharded parameters: references to the unsharded ones
        # from before setup would be stale.
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

        On the meta device, with construction recorded (:func:`hp_lightning.core.materialize.meta_init_context`),
        unless ``empty_init=False`` or ``HSDPStrategy(meta_init=False)`` (None follows the option;
        ``empty_init=True`` always builds on meta). Whatever is built on meta is initialized at
        setup, after sharding, by replaying its construction and its modules' rules, so no
        combination trains on uninitialized memory; loaded weights then overwrite it.
        """
        on_meta = empty_init is True or (empty_init is None and self.options.meta_init)
        device_context = meta_init_context() if on_meta else nullcontext()
        with device_context, self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ gradient accumulation

    @property
    def accumulation_mode(self) -> str:
        """What non-final micro-batches communicate: ``"skip"``, ``"every"`` or ``"defer_all_reduce"``."""
        return self._accumulation_mode

    def set_accumulation_mode(self, mode: str) -> str:
        """Change :attr:`accumulation_mode` from the next micro-batch on; returns the previous mode.

        The API :class:`~hp_lightning.callbacks.GradientAccumulationSync` calls.

        Raises:
            TypeError / ValueError: for anything but one of the three mode strings.
        """
        previous = self._accumulation_mode
        self._accumulation_mode = check_mode(mode, "HSDPStrategy.set_accumulation_mode(...)")
        return previous

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of an accumulation window, per :attr:`accumulation_mode`.

        Under a pipeline the schedule drives each stage's gradient sync itself.
        """
        assert self.model is not None
        if self._pipeline is not None:
            yield
            return
        # Under "skip" these backward passes communicate nothing: the divergence check only records.
        with no_gradient_sync(self.model, self._accumulation_mode), gradients_stay_local(
            self.model, self._accumulation_mode == "skip"
        ):
            yield

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.options.train_timeout is not None and not self._train_timeout_set:
            # After the first step every rank is in step: a collective that waits longer is a hang.
            set_collective_timeout(self.parallel_mesh, self.options.train_timeout)
            self._train_timeout_set = True
        return output

    # ------------------------------------------------------------------ loop boundaries

    def reshard_all(self) -> None:
        """Free every gathered unit, so ``model.parameters()`` are the sharded DTensors again.

        Evaluation has no backward to free what forward gathered (the root keeps its parameters
        after forward by design); without this the root would stay whole after validation.
        """
        if isinstance(self.model, HSDPModule):
            for unit in self.model.modules():
                if isinstance(unit, HSDPModule):
                    unit.reshard()

    @override
    def on_train_start(self) -> None:
        # Lightning registered its SIGTERM handler (a collective inside a signal handler) just
        # before the loops; ours only records the signal, and PreemptionStop acts on it.
        self._preemption.install()
        self._agreement.reset()
        frontend.forget_divergence_window(self.model)

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

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not distributed_is_initialized():
            return
        dist.barrier(device_ids=devices.barrier_device_ids(self.root_device))

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, self.data_parallel_group(group), reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        full = self.options.state_dict_type == "full"
        if full and self._pipeline is not None:
            stages = self._gather_stages(checkpoint_io.model_state_dict(self.model, full=False))
            return {key: value for stage in stages for key, value in stage.items()}
        return checkpoint_io.model_state_dict(self.model, full=full)

    def _gather_stages(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Every pipeline stage's ``state``, whole, on rank 0 (a collective; empty elsewhere)."""
        assert self._pipeline is not None
        return gather_stages_on_rank0(state, stage_leader=self.parallel_mesh.dp_rank == 0, pipeline_group=self._pipeline.group)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Already loaded into the sharded model by load_checkpoint(); nothing left to do here.
        return None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        full = self.options.state_dict_type == "full"
        if self._pipeline is None:
            return checkpoint_io.optimizer_state_dict(self.model, optimizer, full=full)
        state = checkpoint_io.optimizer_state_dict(self.model, optimizer, full=False)
        # Each stage's groups list its own parameters; the checkpoint's list every stage's, in
        # model order, so any mesh (a pipeline of another size, or none) can load it.
        mine = [list(group["params"]) for group in state["param_groups"]]
        stages: list[Any] = [None] * self._pipeline.num_stages
        dist.all_gather_object(stages, mine, group=self._pipeline.group)
        for index, group in enumerate(state["param_groups"]):
            group["params"] = [name for stage in stages for name in stage[index]]
        if not full:
            return state
        parts = self._gather_stages(state)
        if not parts:
            return {}
        return {"state": {k: v for part in parts for k, v in part["state"].items()}, "param_groups": state["param_groups"]}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Already loaded (and resharded) by load_checkpoint().
        return None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"HSDPStrategy.save_checkpoint does not take storage_options; got {storage_options!r}.")
        path = Path(self.broadcast(str(filepath)))
        self.warn_ignored_params_in_checkpoint()
        if self._mesh is not None:  # a data loader's position is per data-parallel rank (see loader_resume_warning)
            checkpoint = {**checkpoint, checkpoint_io.DATA_PARALLEL_KEY: self._mesh.dp_size}
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._warn_mid_window_save(trainer)
        if self.options.async_save and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._async_saves.save(checkpoint, path, checksums=self.options.checkpoint_checksums)
            return
        self.wait_for_checkpoint()  # a save never overtakes the one in flight
        checkpoint_io.save_checkpoint(
            checkpoint, path, sharded=self.options.state_dict_type == "sharded", checksums=self.options.checkpoint_checksums
        )

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

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether an ``async_save`` checkpoint may still be writing (until :meth:`wait_for_checkpoint`)."""
        return self._async_saves.in_flight

    def wait_for_checkpoint(self) -> None:
        """Block until an ``async_save`` in flight is written and published (every rank calls it).

        A no-op without one. Raises the save's error, if it failed, on every rank.
        """
        self._async_saves.wait()

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None
        assert self.lightning_module is not None
        self.wait_for_checkpoint()  # never read what a save in flight is still writing
        path = Path(self.broadcast(str(checkpoint_path)))
        rest = checkpoint_io.load_checkpoint(
            path,
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            elsewhere=self._pipeline_elsewhere,
        )
        if warning := checkpoint_io.loader_resume_warning(rest, self.parallel_mesh.dp_size):
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
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        training = trainer is not None and trainer.state.stage == RunningStage.TRAINING
        if not (training and self.options.resumable_dataloaders and isinstance(dataloader, DataLoader) and has_len(dataloader)):
            return dataloader
        if isinstance(dataloader, Stateful):
            return dataloader
        rank_zero_info(
            "HSDPStrategy(resumable_dataloaders=True) wraps the training DataLoader in hp_lightning.ResumableLoader, so a "
            "mid-epoch resume continues the epoch. torchdata's StatefulDataLoader is checkpointed by Lightning itself "
            "and is not wrapped."
        )
        return checkpoint_io.ResumableLoader(dataloader)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
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
        if not self._failed:
            self.wait_for_checkpoint()
        self._async_saves.close()
        self._preemption.restore()
        if self._watchdog is not None:
            self._watchdog.stop()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hsdp", cls, description="HSDP over (nodes, devices per node) with FSDP2")
        strategy_registry.register("hp_fsdp", cls, description="FSDP2 over all ranks (1-D mesh)", mesh_shape=[-1])
        strategy_registry.register(
            "hsdp_cpu_offload", cls, description="HSDP with shards, gradients and optimizer state on the host", cpu_offload=True
        )

    def __repr__(self) -> str:
        mesh = describe(self._mesh.world) if self._mesh is not None else f"mesh_shape={self.options.mesh_shape}"
        return f"{type(self).__name__}({mesh})"


