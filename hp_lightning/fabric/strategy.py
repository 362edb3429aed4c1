"""HSDPStrategy for Lightning Fabric: Fabric's hooks over the same engine as the Trainer strategy.

Everything that shards, initializes, clips, accumulates or checkpoints is in
:mod:`hp_lightning.core` and :mod:`hp_lightning.checkpoint`; this module only answers Fabric's
calls (``launch``, ``init_module``, ``setup``, ``no_backward_sync``, ``clip_gradients``,
``save`` / ``load``, collectives) and keeps the objects Fabric hands it.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import Optimizable, ReduceOp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from hp_lightning import _frontend as frontend
from hp_lightning import checkpoint as checkpoint_io
from hp_lightning.checkpoint import AsyncSaves
from hp_lightning._lightning_private import (
    BackwardSyncControl,
    FabricSubprocessScriptLauncher,
    PathLike,
    distributed_is_initialized,
    sync_ddp_if_available,
)
from hp_lightning.checkpoint.collective import on_rank0
from hp_lightning.core import agreement, devices, watchdog
from hp_lightning.core.accumulation import check_mode, no_gradient_sync
from hp_lightning.core.gradients import clip_grad_norm_, clip_grad_value_
from hp_lightning.core.introspection import ShardingSummary, summarize, units_in_order
from hp_lightning.core.materialize import meta_init_context, move_unsharded_states
from hp_lightning.core.mesh import ParallelMesh, describe, set_collective_timeout
from hp_lightning.core.options import DEFAULT_TIMEOUT, HSDPOptions
from hp_lightning.core.parallelize import ShardedModel, ShardingPlan
from hp_lightning.core.prepare import prepare_model, prepared
from hp_lightning.fabric import state as fabric_state
from hp_lightning.fabric.precision import HSDPPrecision, precision_from_fabric
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.fully_shard.divergence import check_before_backward, gradients_stay_local

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["HSDPStrategy"]


class HSDPStrategy(frontend.MeshAccess, ParallelStrategy):
    """FSDP / HSDP training with PyTorch FSDP2 under Lightning Fabric.

    ``Fabric(strategy="hsdp")`` shards every model passed to ``fabric.setup`` with the same plan
    as ``Trainer(strategy="hsdp")``: each repeated block becomes a sharding unit, the rest
    (embeddings, heads, norms) belongs to the root unit. Gradients are reduce-scattered inside
    shard groups of consecutive ranks and all-reduced across replicate groups; under
    ``fabric.no_backward_sync(model)`` the non-final micro-batches communicate what
    ``accumulation_mode`` says (nothing, by default). Checkpoints use the Trainer's layout, so
    either front end resumes the other's.

    The keyword arguments are the Trainer strategy's (:class:`hp_lightning.HSDPStrategy`), with
    the same meaning and validation; they are documented there and summarized here.

    Args:
        accelerator, parallel_devices, cluster_environment, precision: set by Fabric's connector
            from ``Fabric(accelerator=..., devices=..., num_nodes=..., precision=...)``.
        checkpoint_io: not supported: checkpoints go through :mod:`hp_lightning.checkpoint`.
        mesh_shape: the data-parallel dims. None → HSDP ``(num_nodes, devices_per_node / tp)``;
            ``[N]`` → FSDP; ``[R, S]`` → R replicas of S shards; one size may be -1.
        tensor_parallel_size / expert_parallel_size: TP ranks (dim ``"tp"``, innermost, same
            batch) and EP ranks (dim ``"ep"``, carved out of the shard dim); 1 = off.
        tp_plan: module-name glob → style name or ``ParallelStyle`` (None → the Hugging Face
            models' own ``base_model_tp_plan``).
        expert_modules: module-name globs of grouped-experts modules (None → ``["*experts"]``).
        shard_modules: sharding units (classes, dotted paths, class names, module-name globs);
            None → HF ``_no_split_modules``, else the blocks of repeated ``nn.ModuleList`` s.
        reshard_after_forward: free gathered unit parameters after forward (less memory) or keep
            them for backward (one all-gather fewer per unit and step).
        param_dtype / reduce_dtype: override what ``Fabric(precision=...)`` implies.
        cpu_offload: sharded parameters, gradients and optimizer state on the host.
        activation_checkpointing: blocks whose activations are recomputed in backward.
        ignored_params: parameter-name globs left alone (not sharded, gradients not synchronized).
        replicate_params: parameter-name globs kept whole on every rank, gradients all-reduced.
        comm_fusion: bucket the replicate-parameter all-reduces of each unit into one.
        reduce_op: ``"avg"`` (mean over data-parallel ranks) or ``"sum"``.
        gradient_scaling_factor: multiply reduced gradients by this factor (None: off).
        shard_placement: parameter-name glob → dim to shard on (default dim 0).
        prefetch: each unit all-gathers the next N units in forward, the previous N in backward.
        forward_methods: extra model methods that run the model outside ``forward`` (e.g.
            ``generate``, registered automatically when present).
        accumulation_mode: what ``fabric.no_backward_sync(model)`` lets non-final micro-batches
            communicate: ``"skip"`` (nothing; full-size gradients held between micro-batches),
            ``"every"`` (reduce-scatter and all-reduce; sharded gradients only) or
            ``"defer_all_reduce"`` (reduce-scatter only; the HSDP all-reduce once per window).
            :meth:`set_accumulation_mode` changes it later.
        state_dict_type: what ``fabric.save`` writes: ``"sharded"`` (a directory, one shard per
            rank, fast) or ``"full"`` (one file rank 0 writes, loadable on a single process).
        sharding_report: log the table of units, bytes per rank, placements and dtypes at setup.
        process_group_backend: None → gloo for CPU, nccl for CUDA, hccl for NPU.
        timeout: collective timeout, in seconds or as a timedelta: until the first optimizer
            step, and for the whole run unless ``train_timeout`` is set.
        train_timeout: a shorter collective timeout from the first ``optimizer.step()`` on, once
            rendezvous and checkpoint loading are behind. None keeps ``timeout``.
        fault_watchdog: when one rank fails, stop every rank within seconds with the failure
            named once (see :mod:`hp_lightning.core.watchdog`). Fabric has no teardown hook: the
            watchdog is stopped at interpreter exit, or by :meth:`teardown`.
        heartbeat_timeout: seconds without a heartbeat before a rank counts as lost.
        failure_exit_grace: seconds a failed rank gets to print its traceback and exit.
        save_on_preemption: the Trainer's option (save ``last.ckpt`` on SIGTERM); accepted so
            both front ends read the same configuration, but only ``False`` is valid here: a
            Fabric loop has no ModelCheckpoint to save to.
        divergence_check: ``"per_step"`` (default): ``fabric.backward(loss)`` first compares
            across ranks which units and parameters the backward reaches (before each backward
            that issues gradient collectives; inside ``fabric.no_backward_sync`` under
            ``accumulation_mode="skip"`` it only records, locally), in one small all-reduce on a
            host-side gloo group (see :mod:`hp_lightning.fully_shard.divergence`). ``"off"`` (or
            False, as YAML reads a bare ``off``): no comparison and no collective.
        meta_init: build under ``fabric.init_module()`` on the meta device, recording
            construction, and initialize after sharding (see :meth:`module_init_context`). False
            builds real tensors: every rank holds the whole model until it is sharded.

    Raises:
        TypeError / ValueError: for any option of the wrong type or value, in ``Fabric(...)``;
            ValueError for ``save_on_preemption=True``; TypeError for a ``checkpoint_io`` plugin.
        checkpoint_checksums: sharded saves also record every file's SHA-256, checked in full before
            every load; False (default): sizes and the manifest, checked without reading the data.
        resumable_dataloaders: Trainer only (the Trainer wraps plain training loaders so a
            mid-epoch resume continues the epoch). Fabric saves what you pass to ``fabric.save``:
            put a ``StatefulDataLoader`` (or a ``ResumableLoader``) in that state to resume mid-epoch.
        pipeline_parallel_size / pipeline_split_points / pipeline_schedule / pipeline_microbatches:
            Trainer only so far (a ``ValueError`` here for a size above 1); see the seed call
            ``hp_lightning.PipelineStage`` for a Fabric loop.
        async_save: ``fabric.save`` of a sharded checkpoint returns once the state is copied to
            host memory; the files are written in the background and published when every rank
            is done. At most one in flight: the next save, a load and :meth:`teardown` wait for it;
            call :meth:`wait_for_checkpoint` before reading it yourself.
    """

    _mesh_available = "once the processes are set up (after fabric.launch())"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
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
        fault_watchdog: bool = True,
        heartbeat_timeout: float = 120.0,
        failure_exit_grace: float = 30.0,
        save_on_preemption: bool = False,
        divergence_check: Union[Literal["per_step", "off"], bool] = "per_step",
        train_timeout: Optional[Union[float, timedelta]] = None,
        meta_init: bool = True,
        resumable_dataloaders: bool = False,
        checkpoint_checksums: bool = False,
        async_save: bool = False,
        pipeline_parallel_size: int = 1,
        pipeline_split_points: Optional[Sequence[str]] = None,
        pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b",
        pipeline_microbatches: Optional[int] = None,
    ) -> None:
        # Validate everything here: this runs in Fabric(...) before any process or group exists.
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
            fault_watchdog=fault_watchdog,
            heartbeat_timeout=heartbeat_timeout,
            failure_exit_grace=failure_exit_grace,
            save_on_preemption=save_on_preemption,
            divergence_check=divergence_check,
            train_timeout=train_timeout,
            meta_init=meta_init,
            resumable_dataloaders=resumable_dataloaders,
            checkpoint_checksums=checkpoint_checksums,
            async_save=async_save,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_split_points=pipeline_split_points,
            pipeline_schedule=pipeline_schedule,
            pipeline_microbatches=pipeline_microbatches,
        )
        if self.options.pipeline_parallel_size > 1:
            raise ValueError(
                f"HSDPStrategy(pipeline_parallel_size={self.options.pipeline_parallel_size}) is a Trainer option so far: "
                f"the Trainer strategy runs the schedule inside its step. With Fabric, build the stage yourself: "
                f"hp_lightning.PipelineStage(stage_module, stage_index, stage_num, group=mesh['pp'].get_group()) and "
                f"torch.distributed.pipelining's schedules, and set pipeline_parallel_size=1 here."
            )
        if self.options.save_on_preemption:
            raise ValueError(
                "HSDPStrategy(save_on_preemption=True) is a Trainer option: it saves the ModelCheckpoint's 'last.ckpt' "
                "at the end of an accumulation window, and a Fabric loop has neither. Leave it False with Fabric and "
                "save from your loop, e.g. fabric.save(path, state) when your SIGTERM handler has set a flag."
            )
        if checkpoint_io is not None:
            raise TypeError(_NO_CHECKPOINT_IO.format(got=type(checkpoint_io).__name__))
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._num_nodes = 1
        self._process_group_backend = self.options.process_group_backend
        self._accumulation_mode = self.options.accumulation_mode
        self._backward_sync_control = _NoGradientSync(self)
        self._mesh: Optional[ParallelMesh] = None
        self._async_saves = AsyncSaves()
        self._models: list[nn.Module] = []
        # Parameters sharding replaced (by id, weakly held): an optimizer still holding one is stale.
        self._replaced: dict[int, weakref.ref] = {}
        self._watchdog: Optional[watchdog.FaultWatchdog] = None
        self._train_timeout_set = False
        # The divergence check's collective: on a host-side gloo group from setup_environment on.
        self._agreement = agreement.StepAgreement()

    # ------------------------------------------------------------------ properties

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The root and units of the last model set up (None before)."""
        return prepared(self._models[-1]) if self._models else None

    @property
    def state_dict_type(self) -> str:
        return self.options.state_dict_type

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of the mesh (both axes) sees different data.
        return self.data_parallel_sampler_kwargs(self.world_size, self.global_rank)

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property  # type: ignore[override]
    @override
    def precision(self) -> HSDPPrecision:
        plugin = self._precision
        if plugin is None:
            plugin = self._precision = HSDPPrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # Fabric's connector hands us the plugin for Fabric(precision=...) inside Fabric(...):
        # converting here refuses unsupported precisions before any process starts.
        self._precision = None if precision is None else precision_from_fabric(precision)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io  # never used for saving: see save_checkpoint

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise TypeError(_NO_CHECKPOINT_IO.format(got=type(io).__name__))

    # ------------------------------------------------------------------ launch and process group

    @override
    def _configure_launcher(self) -> None:
        # Fabric calls this inside Fabric(...) once devices and nodes are known: the last moment
        # to refuse a mesh that cannot cover the world before any process starts.
        frontend.check_mesh_fits(self)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = FabricSubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._process_group_backend = frontend.join_process_group(self, self._process_group_backend)
        # First thing once the process group exists: from here on, a failure anywhere stops every rank.
        self._watchdog = frontend.start_watchdog(self, self._watchdog)
        if self._watchdog is not None:
            self._watchdog.report_uncaught_errors()  # posted before the traceback prints, not at exit
            atexit.unregister(self._leave_at_exit)  # once per strategy, however often Fabric launches
            atexit.register(self._leave_at_exit)
        self._mesh = frontend.agree_and_build_mesh(self, self.precision.precision)
        frontend.move_agreement_to_host_group(self, self._agreement)
        self.precision.device_type = self.root_device.type

    def _set_world_ranks(self) -> None:
        # Fabric's connector calls this too (by this name) before launching.
        frontend.set_world_ranks(self)

    # ------------------------------------------------------------------ model and optimizers

    def sharding_plan(self) -> ShardingPlan:
        """The plan :func:`hp_lightning.core.parallelize.parallelize` applies, from this strategy's options."""
        return self.options.sharding_plan(
            derived_param_dtype=self.precision.derived_param_dtype,
            derived_reduce_dtype=self.precision.derived_reduce_dtype,
            device_type=self.root_device.type,
        )

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Where ``fabric.init_module(empty_init=...)`` creates the model's tensors.

        On the meta device, with construction recorded
        (:func:`hp_lightning.core.materialize.meta_init_context`), unless ``empty_init=False`` or
        ``HSDPStrategy(meta_init=False)`` (None follows the option; ``empty_init=True`` always
        builds on meta), as the Trainer strategy does: nothing is allocated until ``fabric.setup``
        has sharded the model, then each rank allocates and initializes only its shards. Real
        tensors (``empty_init=False``) suit loading weights before setup, at the cost of every
        rank holding the whole model until it is sharded.
        """
        on_meta = empty_init is True or (empty_init is None and self.options.meta_init)
        stack = ExitStack()
        stack.enter_context(meta_init_context() if on_meta else self._init_device())
        stack.enter_context(self.precision.module_init_context())
        return stack

    def _init_device(self) -> torch.device:
        return devices.cpu_device() if self.options.cpu_offload else self.root_device

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place with :meth:`sharding_plan` and initialize what is on the meta device.

        Units the user sharded already (``hp_lightning.fully_shard`` or torch's ``fully_shard``)
        are kept. Sharding replaces the module's parameters with sharded ones: create optimizers
        afterwards, or pass them to ``fabric.setup(model, optimizer)``, which rebinds them.

        Raises:
            TypeError: for a module wrapped in FSDP1 (``FullyShardedDataParallel``).
        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise TypeError(
                f"{type(module).__name__} contains FullyShardedDataParallel (FSDP1) modules; HSDPStrategy shards with "
                f"FSDP2. Pass the plain module (or one sharded with hp_lightning.fully_shard / torch's fully_shard)."
            )
        before = list(module.parameters())
        prepare_model(module, self.parallel_mesh, self.sharding_plan(), init_device=self._init_device(), device=self.root_device)
        frontend.configure_divergence_check(module, self._agreement, self.options.divergence_check)
        self.scope_metrics_to_data_parallel(module)
        current = {id(p) for p in module.parameters()}
        for param in before:
            if id(param) not in current:
                self._replaced[id(param)] = weakref.ref(param)
        if all(m is not module for m in self._models):
            self._models.append(module)
        if self.options.sharding_report:
            summary = self.sharding_summary(module)
            rank_zero_info(summary.table())
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[LRScheduler] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[LRScheduler]]:
        """Shard ``module``, then point ``optimizers`` at the sharded parameters (``fabric.setup(model, optimizer)``).

        Sharding replaces every parameter (FSDP2 registers new DTensor parameters), so an
        optimizer created before setup would update tensors the model no longer uses. Each of its
        parameters is swapped for the sharded one of the same name; its hyperparameters and
        param groups are kept.

        Raises:
            ValueError: when an optimizer holds a parameter that is not the model's, or already
                holds state (it stepped before setup): create it after ``fabric.setup_module(model)``.
        """
        names_before = {id(p): (name, p) for name, p in module.named_parameters()}
        module = self.setup_module(module)
        after = dict(module.named_parameters())
        for index, optimizer in enumerate(optimizers):
            _rebind_optimizer(optimizer, names_before, after, index)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that ``optimizer`` (``fabric.setup_optimizers``) holds the sharded parameters.

        Raises:
            ValueError: when no model was set up yet, or the optimizer holds parameters that
                sharding replaced (it was created before ``fabric.setup_module(model)``).
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stale = [p for p in params if self._was_replaced(p)]
        if not self._models or stale:
            reason = (
                "no model was set up yet" if not self._models
                else f"it holds {len(stale)} of the model's parameters from before sharding, which the model no longer uses"
            )
            raise ValueError(
                f"fabric.setup_optimizers(optimizer): {reason}. HSDPStrategy replaces the parameters when it shards "
                f"the model, so create the optimizer afterwards: model = fabric.setup_module(model); "
                f"optimizer = torch.optim.AdamW(model.parameters()); optimizer = fabric.setup_optimizers(optimizer). "
                f"Or pass both to fabric.setup(model, optimizer), which points the optimizer at the sharded parameters."
            )
        return optimizer

    def _was_replaced(self, param: Tensor) -> bool:
        ref = self._replaced.get(id(param))
        return ref is not None and ref() is param

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Before setup the model stays where it is (meta or host): sharding places the shards and
        # allocates only them. Afterwards only unsharded state (buffers, whole parameters) moves.
        if prepared(module) is not None:
            move_unsharded_states(module, self.root_device)

    def sharding_summary(self, module: Optional[nn.Module] = None) -> ShardingSummary:
        """The per-unit table of what was sharded (a collective: every rank must call it).

        Args:
            module: a model this strategy set up (default: the last one).

        Raises:
            RuntimeError: before ``fabric.setup`` has sharded a model.
        """
        module = module if module is not None else (self._models[-1] if self._models else None)
        sharded = prepared(module) if module is not None else None
        if module is None or sharded is None or not isinstance(module, HSDPModule):
            raise RuntimeError("HSDPStrategy.sharding_summary() is available once fabric.setup(...) has sharded the model.")
        return summarize(
            module, units_in_order(module, sharded.units), self.parallel_mesh.world, [*sharded.ignored, *sharded.replicated], self.root_device
        )

    def reshard_all(self) -> None:
        """Free every gathered unit, so ``model.parameters()`` are the sharded DTensors again.

        A forward under ``torch.no_grad()`` (evaluation) has no backward to free what it gathered,
        and the root keeps its parameters after forward by design; call this after evaluation to
        release that memory. Saving and loading call it themselves.
        """
        for model in self._models:
            for unit in model.modules():
                if isinstance(unit, HSDPModule):
                    unit.reshard()

    # ------------------------------------------------------------------ gradient accumulation and clipping

    @property
    def accumulation_mode(self) -> str:
        """What non-final micro-batches communicate under ``fabric.no_backward_sync``: ``"skip"``, ``"every"`` or ``"defer_all_reduce"``."""
        return self._accumulation_mode

    def set_accumulation_mode(self, mode: str) -> str:
        """Change :attr:`accumulation_mode` from the next micro-batch on; returns the previous mode.

        Raises:
            TypeError / ValueError: for anything but one of the three mode strings.
        """
        previous = self._accumulation_mode
        self._accumulation_mode = check_mode(mode, "HSDPStrategy.set_accumulation_mode(...)")
        return previous

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss)``: first compare across ranks which parameters this backward reaches.

        Ranks whose backward would reach different parameters (rank-dependent control flow)
        would issue different gradient collectives and hang or mix gradients; they raise together
        instead, naming the parameters (:mod:`hp_lightning.fully_shard.divergence`: one small
        all-reduce on a host-side group per backward that issues gradient collectives; inside
        ``fabric.no_backward_sync`` under ``"skip"`` only a local record). Call
        ``fabric.backward(loss)``, not ``loss.backward()``.

        Raises:
            RankDivergenceError: on every rank, when some rank's backward reaches other parameters.
        """
        for model in [module] if module is not None else self._models:
            check_before_backward(model, tensor)
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self.options.train_timeout is not None and not self._train_timeout_set:
            # After the first step every rank is in step: a collective that waits longer is a hang.
            set_collective_timeout(self.parallel_mesh, self.options.train_timeout)
            self._train_timeout_set = True
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Scale the optimizer's gradients so their global norm (over every shard) is at most ``max_norm``.

        Returns:
            The global norm before clipping, the same on every rank.
        """
        self.precision.unscale_gradients(optimizer)
        same_params = self._mesh.dp_group if self._mesh is not None else None  # ignored parameters: one norm per replica
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite, same_params=same_params)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    # ------------------------------------------------------------------ collectives

    @override
    def all_reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, self.data_parallel_group(group), reduce_op=reduce_op)
        return tensor

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

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self,
        path: PathLike,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write ``state`` in the Trainer's checkpoint layout (see :mod:`hp_lightning.fabric.state`), from every rank.

        ``state_dict_type="sharded"`` writes a directory in which every rank saves its own shards
        (fast, light on memory, loads into any mesh); ``"full"`` gathers one tensor at a time to
        rank 0, which writes a single file (portable, loadable on one CPU process). Either way the
        save appears whole or not at all.

        Raises:
            TypeError: for ``storage_options`` (no CheckpointIO plugin is involved).
            ValueError: for ``filter`` (the Trainer's layout stores whole states), for a
                ``state`` without exactly one sharded model, or one using a reserved key.
        """
        if storage_options is not None:
            raise TypeError(f"HSDPStrategy.save_checkpoint does not take storage_options (no CheckpointIO plugin is used); got {storage_options!r}.")
        if filter is not None:
            raise ValueError(
                f"fabric.save(..., filter=...) is not supported by HSDPStrategy: checkpoints hold whole model and optimizer "
                f"states, as the Trainer's do, so either front end can resume them. Got a filter for {sorted(filter)}; "
                f"save without it (hp_lightning.checkpoint.load_weights(..., strict=False) loads a subset later)."
            )
        self.warn_ignored_params_in_checkpoint()
        parts = fabric_state.split_state(state, "fabric.save")
        self.reshard_all()
        target = Path(self.broadcast(str(path)))
        full = self.options.state_dict_type == "full"
        checkpoint = fabric_state.to_checkpoint(parts, full=full)
        if self.options.async_save:
            self._async_saves.save(checkpoint, target, checksums=self.options.checkpoint_checksums)
            return
        self.wait_for_checkpoint()
        checkpoint_io.save_checkpoint(checkpoint, target, sharded=not full, checksums=self.options.checkpoint_checksums)

    def wait_for_checkpoint(self) -> None:
        """Block until an ``async_save`` in flight is written and published (every rank calls it)."""
        self._async_saves.wait()

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint of either front end (or any format hp_lightning reads).

        The model and optimizers are loaded in place, resharded to this mesh whatever the mesh of
        the save; LR schedulers and objects with ``load_state_dict`` are restored in place, other
        entries replaced in ``state``.

        Args:
            path: a sharded checkpoint directory or a single file (Fabric's, the Trainer's,
                Lightning's ``.ckpt``, a bare state dict, ``.safetensors``).
            state: ``{"model": model, "optimizer": optimizer, ...}``; a module alone
                (``fabric.load_raw(path, model)``) loads its weights only; None returns a
                single-file checkpoint's whole contents.
            strict: missing or unexpected entries are errors (else they are left as they are).
            weights_only: passed to ``torch.load`` for the pickled parts (None: False).

        Returns:
            What the checkpoint holds beyond what ``state`` asked for.

        Raises:
            ValueError: for ``state=None`` on a sharded directory (it has no meaning without a
                model), an optimizer alone, or a ``state`` without exactly one sharded model.
            FileNotFoundError, KeyError, CorruptCheckpointError: as :func:`hp_lightning.checkpoint.load_checkpoint`.
        """
        self.wait_for_checkpoint()
        source = Path(self.broadcast(str(path)))
        if not state:
            if source.is_dir():
                raise ValueError(
                    f"fabric.load({str(source)!r}) without state: a sharded checkpoint is read into a model. Pass "
                    f"state={{'model': model, ...}}, or make one file first: python -m hp_lightning.checkpoint consolidate {source} full.ckpt"
                )
            return checkpoint_io.read_full_file(source, weights_only=weights_only)
        self.reshard_all()
        if isinstance(state, nn.Module):
            checkpoint_io.load_weights(state, source, strict=strict, weights_only=weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise ValueError(
                "fabric.load(path, optimizer): an optimizer's sharded state is keyed by the model's parameter names; "
                "pass both: fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        parts = fabric_state.split_state(state, "fabric.load")
        record = None
        if len(parts.optimizers) > 1 or len(parts.schedulers) > 1:
            record = on_rank0(lambda: fabric_state.read_record(source, weights_only))
        label = repr(str(source))
        optimizers = fabric_state.in_stored_order(parts.optimizers, (record or {}).get("optimizers"), "optimizers", label)
        schedulers = fabric_state.in_stored_order(parts.schedulers, (record or {}).get("lr_schedulers"), "LR schedulers", label)
        rest = checkpoint_io.load_checkpoint(
            source, parts.model, [o for _, o in optimizers], strict=strict, weights_only=weights_only
        )
        return fabric_state.restore_rest(parts, rest, state, strict=strict, source=label, scheduler_order=schedulers)

    # ------------------------------------------------------------------ teardown

    def _leave_at_exit(self) -> None:
        """At interpreter exit (Fabric has no teardown hook): report an uncaught error, else stop watching."""
        fault_watchdog = self._watchdog
        if fault_watchdog is None:
            return
        failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if isinstance(failure, BaseException):
            fault_watchdog.report(failure)  # the other ranks stop instead of waiting for this one
        else:
            fault_watchdog.stop()

    @override
    def teardown(self) -> None:
        """Finish a save in flight, stop the fault watchdog and release the environment (call it when the process goes on without Fabric)."""
        self.wait_for_checkpoint()
        self._async_saves.close()
        if self._watchdog is not None:
            self._watchdog.stop()
            atexit.unregister(self._leave_at_exit)
        super().teardown()

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


_NO_CHECKPOINT_IO = (
    "The Fabric HSDPStrategy writes checkpoints with hp_lightning.checkpoint (sharded DCP directories or full files, "
    "the Trainer's layout), so a CheckpointIO plugin would never be called; got {got}. Remove it from "
    "Fabric(plugins=...) and choose the format with HSDPStrategy(state_dict_type='sharded' | 'full')."
)


class _NoGradientSync(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the strategy's accumulation mode for non-final micro-batches."""

    def __init__(self, strategy: HSDPStrategy) -> None:
        self._strategy = weakref.proxy(strategy)

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """Enter :func:`hp_lightning.core.accumulation.no_gradient_sync` with the strategy's mode (when ``enabled``).

        Raises:
            TypeError: for a module this strategy has not sharded.
        """
        if not enabled:
            return nullcontext()
        if not isinstance(module, HSDPModule):
            raise TypeError(
                f"fabric.no_backward_sync(model) needs the model set up with HSDPStrategy; got a {type(module).__name__} "
                f"that is not sharded. Call model = fabric.setup(model, ...) first."
            )
        mode = self._strategy.accumulation_mode
        stack = ExitStack()
        stack.enter_context(no_gradient_sync(module, mode))
        # Under "skip" these backward passes communicate nothing: the divergence check only records.
        stack.enter_context(gradients_stay_local(module, mode == "skip"))
        return stack


def _rebind_optimizer(
    optimizer: Optimizer, before: Mapping[int, tuple[str, Tensor]], after: Mapping[str, Tensor], index: int
) -> None:
    """Swap each of ``optimizer``'s pre-sharding parameters for the sharded one of the same name."""
    current = {id(p) for p in after.values()}
    groups: list[list[Tensor]] = []
    moved = 0
    for group_index, group in enumerate(optimizer.param_groups):
        params = []
        for param in group["params"]:
            if id(param) in current:
                params.append(param)
            elif id(param) in before:
                params.append(after[before[id(param)][0]])
                moved += 1
            else:
                raise ValueError(
                    f"fabric.setup(model, optimizer): optimizer {index} (param group {group_index}) holds a parameter of "
                    f"shape {tuple(param.shape)} that is not one of the model's, so it cannot be pointed at a sharded one. "
                    f"Build the optimizer from model.parameters(), or create it after fabric.setup_module(model) and pass "
                    f"it to fabric.setup_optimizers(optimizer)."
                )
        groups.append(params)
    if moved and any(optimizer.state.values()):
        raise ValueError(
            f"fabric.setup(model, optimizer): optimizer {index} already holds state (it stepped before setup) for "
            f"parameters that sharding replaced; that state cannot follow them. Create the optimizer after "
            f"fabric.setup_module(model), then call fabric.setup_optimizers(optimizer)."
        )
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params
