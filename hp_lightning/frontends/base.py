"""StrategyBase: everything the Trainer and Fabric strategies do the same way, once.

Both front ends are ``class HSDPStrategy(StrategyBase, <Lightning's ParallelStrategy>)``; their
constructors are in :mod:`hp_lightning.frontends.constructors`. The base holds launch, process
group, watchdog, rank agreement, mesh, collectives, sharding, accumulation modes, timeouts,
checkpoint writes and teardown. An adapter keeps only the hooks its front end calls differently;
a hook it must provide is a ``_``-method below that raises ``NotImplementedError``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Union, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from hp_lightning import checkpoint as hp_checkpoint
from hp_lightning._lightning_private import PathLike, all_gather_ddp_if_available, distributed_is_initialized, init_dist_connection, sync_ddp_if_available
from hp_lightning.checkpoint import AsyncSaves
from hp_lightning.core import agreement, devices, replica_audit, watchdog
from hp_lightning.core.accumulation import check_mode, no_gradient_sync
from hp_lightning.core.ema import require_average
from hp_lightning.core.fault_tolerance import FaultTolerance, check_accumulation_mode
from hp_lightning.core.introspection import ShardingSummary, summarize, units_in_order
from hp_lightning.core.materialize import link_construction, meta_init_context
from hp_lightning.core.mesh import MeshLayout, ParallelMesh, build_parallel_mesh, describe, set_collective_timeout
from hp_lightning.core.options import HSDPOptions
from hp_lightning.core.watchdog import elastic
from hp_lightning.frontends.precision import PrecisionCore
from hp_lightning.fully_shard import HSDPModule
from hp_lightning.fully_shard.divergence import divergence_check, gradients_stay_local
from hp_lightning.recipe.parallelize import ShardedModel, ShardingPlan
from hp_lightning.recipe.prepare import prepare_model, prepared

__all__ = ["StrategyBase", "refuse_fsdp1"]


def refuse_fsdp1(module: nn.Module) -> None:
    """TypeError for a module that contains FSDP1 (``FullyShardedDataParallel``) modules: FSDP2 cannot shard them again."""
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            f"{type(module).__name__} contains FullyShardedDataParallel (FSDP1) modules; HSDPStrategy shards with "
            f"FSDP2. Pass the plain module (or one sharded with hp_lightning.fully_shard / torch's fully_shard)."
        )


def _gather_root_on_submodule_entry(root: nn.Module) -> None:
    """Let a direct submodule of the sharded root run outside a step, as inside one (``pl_module.net(x)``).

    Outside a step (a callback's ``on_train_end``) the root's own parameters would still be
    sharded ("mixed torch.Tensor and DTensor"): a forward pre-hook on each direct child that uses
    them calls ``root.unshard()`` while one is still a DTensor (inside a step: one attribute read).
    Meant for inference: a backward through such a call is not reduced across ranks.
    """
    if not isinstance(root, FSDPModule) or getattr(root, "_hp_entry_hooks", False):
        return
    in_units = {id(p) for m in root.modules() if m is not root and isinstance(m, FSDPModule) for p in m.parameters()}
    for child in root.children():
        witness = next(
            ((m, n) for m in child.modules() for n, p in m.named_parameters(recurse=False) if id(p) not in in_units), None
        )
        if witness is None:
            continue
        module, name = witness

        def gather_root(_: nn.Module, args: Any, module: nn.Module = module, name: str = name) -> None:
            if isinstance(getattr(module, name), DTensor):  # still sharded: outside the root's forward
                root.unshard()

        child.register_forward_pre_hook(gather_root)
    root._hp_entry_hooks = True  # type: ignore[assignment]  # once per root (fit, then test: the same module)


_REGISTERED: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("hsdp", "HSDP over (nodes, devices per node) with FSDP2", {}),
    ("hp_fsdp", "FSDP2 over all ranks (1-D mesh)", {"mesh_shape": [-1]}),
    ("hsdp_cpu_offload", "HSDP with shards, gradients and optimizer state on the host", {"cpu_offload": True}),
    ("hsdp_ft", "one replica group of fault-tolerant HSDP on torchft (HP_FT_REPLICA_GROUP / HP_FT_NUM_REPLICA_GROUPS)",
     {"fault_tolerance": "env"}),
)


class StrategyBase:
    """The shared half of both ``HSDPStrategy`` classes; ``options``: every option, validated at construction."""

    options: HSDPOptions
    #: The launcher Lightning's connector gets when the processes are not created externally.
    _launcher_class: ClassVar[type]
    #: When the mesh exists, in the front end's words (for the error before that).
    _mesh_available: ClassVar[str] = "once the processes are set up"
    _mesh: Optional[ParallelMesh] = None

    def _init_base(self, lightning_args: dict[str, Any], options: HSDPOptions) -> None:
        """What both constructors do, with the front end's ``ParallelStrategy`` arguments and the validated options."""
        self.options = options
        self._refuse_options(options, lightning_args)
        self._process_group_backend = options.process_group_backend
        self._accumulation_mode: str = options.accumulation_mode
        self._num_nodes = 1
        self._layout: Optional[MeshLayout] = None
        super().__init__(**lightning_args)
        self._watchdog: Optional[watchdog.FaultWatchdog] = None
        # The step's one control collective (preemption, divergence): on a host group from setup on.
        self._agreement = agreement.StepAgreement()
        self._train_timeout_set = False
        self._async_saves = AsyncSaves()
        self._failed = False
        self._replica_audit: Optional[replica_audit.ReplicaAudit] = None
        self._init_front_end()

    # ------------------------------------------------------------------ what the adapters provide

    def _refuse_options(self, options: HSDPOptions, lightning_args: dict[str, Any]) -> None:
        """Raise for what this front end cannot honour (before Lightning's base is set up)."""

    def _init_front_end(self) -> None:
        """The adapter's own state, after the base's."""

    @property
    def _hsdp_precision(self) -> PrecisionCore:
        """The adapter's precision plugin (each adapter defines it: Trainer and Fabric keep it under different names)."""
        raise NotImplementedError(f"{type(self).__name__} must define _hsdp_precision (HSDPStrategy and HSDPFabricStrategy do)")

    def _sharded_roots(self) -> list[nn.Module]:
        """The models this strategy sharded (roots), for :meth:`reshard_all` (each adapter defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must define _sharded_roots (HSDPStrategy and HSDPFabricStrategy do)")

    def _agreement_trainer(self) -> Any:
        """The Trainer whose checkpoint folders and loop lengths every rank must share (None: Fabric)."""
        return None

    def _watchdog_started(self) -> None:
        """Right after the fault watchdog starts (before the first collective that could fail)."""

    def _report_scope(self) -> dict[str, Any]:
        """Extra arguments of :func:`~hp_lightning.core.introspection.summarize` (the Trainer's pipeline: this rank's stage)."""
        return {}

    # ------------------------------------------------------------------ properties

    @property
    def state_dict_type(self) -> str:
        return self.options.state_dict_type

    @property
    def fault_tolerance_config(self) -> Optional[FaultTolerance]:
        """The ``fault_tolerance`` option as resolved at construction (None: off)."""
        return self.options.fault_tolerance  # HSDPOptions resolves "env" and dicts

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    def reshard_after_forward(self) -> bool:
        """The ``reshard_after_forward`` units were sharded with (the root always keeps its parameters)."""
        return self.options.reshard_after_forward

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # type: ignore[attr-defined]
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def parallel_mesh(self) -> ParallelMesh:
        """The mesh and its per-technique sub-meshes."""
        if self._mesh is None:
            raise RuntimeError(f"HSDPStrategy.device_mesh is available {self._mesh_available}.")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The whole named mesh: ``("shard",)`` or ``("replicate", "shard")``, plus ``"pp"``/``"tp"``/``"ep"`` when on."""
        return self.parallel_mesh.world

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """What FSDP shards over (the whole mesh without TP/EP/PP)."""
        return self.parallel_mesh.dp

    @property
    def layout(self) -> MeshLayout:
        """The sizes of every mesh dim, resolved once from the options and the world (before launch)."""
        if self._layout is None:
            world = self.num_nodes * self.num_processes
            self._layout = self.options.layout(world_size=world, num_nodes=self.num_nodes, devices_per_node=self.num_processes)
        return self._layout

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every data-parallel rank reads different data; the ranks of one TP group (or pipeline) the same.

        Under ``fault_tolerance`` group ``g``'s rank ``r`` is rank ``g x group size + r`` (torchft's split:
        while a group is down its share of each global batch is skipped).
        """
        config = self.fault_tolerance_config
        if config is not None:
            group_size: int = self.world_size  # type: ignore[attr-defined]  # Lightning's ParallelStrategy
            rank: int = self.global_rank  # type: ignore[attr-defined]  # as above
            return {"num_replicas": config.num_replica_groups * group_size, "rank": config.replica_group * group_size + rank}
        if self._mesh is None or not self._tp_or_pp:
            return {"num_replicas": self.world_size, "rank": self.global_rank}  # type: ignore[attr-defined]
        return {"num_replicas": self._mesh.dp_size, "rank": self._mesh.dp_rank}

    @property
    def _tp_or_pp(self) -> bool:
        return self._mesh is not None and (self._mesh.layout.tp > 1 or self._mesh.layout.pp > 1)

    # ------------------------------------------------------------------ launch, process group, mesh

    def _configure_launcher(self) -> None:
        # Lightning calls this inside Trainer(...) / Fabric(...) once devices and nodes are known:
        # the last moment to refuse a mesh that cannot cover the world before any process starts.
        try:
            self._layout = None
            self.layout  # noqa: B018  (resolved here, once: setup_environment builds the mesh from it)
            replica_audit.check_layout(self.options.replica_check_every, self.layout)
        except ValueError as exc:
            watchdog.print_once_per_job(exc)  # every torchrun worker raises it: one traceback per job
            raise
        environment = self.cluster_environment  # type: ignore[attr-defined]
        assert environment is not None
        if not environment.creates_processes_externally:
            self._launcher = self._launcher_class(environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self._join_process_group()
        # First thing once the process group exists: from here on, a failure anywhere stops every rank.
        if self.options.fault_watchdog:
            options = self.options
            self._watchdog = self._watchdog or watchdog.FaultWatchdog(
                heartbeat_timeout=options.heartbeat_timeout, exit_grace=options.failure_exit_grace
            )
            node = self.node_rank * self.num_processes  # type: ignore[attr-defined]
            self._watchdog.start(self.global_rank, self.world_size, range(node, node + self.num_processes))  # type: ignore[attr-defined]
            self._watchdog_started()
        if self.layout.world_size != self.world_size:  # type: ignore[attr-defined]  # a launcher's own world
            self._layout = self.options.layout(world_size=self.world_size, num_nodes=self.num_nodes, devices_per_node=self.num_processes)  # type: ignore[attr-defined]
        # Compared across ranks before any group exists (a difference would hang), then built.
        settings = agreement.setup_settings(
            self.options.settings(), self._hsdp_precision.precision, self._agreement_trainer(), self.layout.shape
        )
        agreement.check_rank_agreement(settings, stage="setup")
        self._mesh = build_parallel_mesh(self.root_device.type, self.layout)
        self._replica_audit = replica_audit.ReplicaAudit.on_mesh(self.options.replica_check_every, self.options.replica_check_action, self._mesh)
        if self._agreement.group is None:  # once: later setups (fit, then test) reuse it
            self._agreement.group = agreement.host_group(self.options.timeout)
        self._hsdp_precision.data_parallel_group = self._mesh.dp_group  # clipping: one norm per replica
        self._hsdp_precision.device_type = self.root_device.type

    def _join_process_group(self) -> None:
        """Create the default process group (with gloo beside the accelerator's under CPU offload; errors printed once per job)."""
        try:
            reset_seed()
            self._set_world_ranks()
            device = self.root_device
            backend = self._process_group_backend or devices.process_group_backend(device.type, host_collectives=self.options.cpu_offload)
            device_id = device if devices.is_accelerator(device.type) else None
            environment = self.cluster_environment  # type: ignore[attr-defined]
            # Under torchrun's agent store: keys of this attempt only, so a restart never meets the last one's.
            store = elastic.attempt_store(environment.main_address, environment.main_port, self.options.timeout)
            init_dist_connection(environment, backend, timeout=self.options.timeout, device_id=device_id, store=store)
        except Exception as exc:
            watchdog.print_once_per_job(exc)  # e.g. a backend that cannot start: the same on every rank
            raise
        self._process_group_backend = backend

    def _set_world_ranks(self) -> None:
        """Tell the cluster environment and the rank-zero helpers this process's global rank."""
        environment = self.cluster_environment  # type: ignore[attr-defined]
        if environment is not None:
            environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
            environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    #: The Trainer's connector calls it by this name, Fabric's by the private one.
    set_world_ranks = _set_world_ranks

    # ------------------------------------------------------------------ model

    def sharding_plan(self) -> ShardingPlan:
        """The plan :func:`hp_lightning.recipe.parallelize.parallelize` applies, from this strategy's options."""
        return ShardingPlan.of(
            self.options,
            derived_param_dtype=self._hsdp_precision.derived_param_dtype,
            derived_reduce_dtype=self._hsdp_precision.derived_reduce_dtype,
            device_type=self.root_device.type,
        )

    def _init_context(self, empty_init: Optional[bool], otherwise: AbstractContextManager) -> AbstractContextManager:
        """Meta device with construction recorded when ``empty_init`` (None: the ``meta_init`` option) says so, else ``otherwise``."""
        on_meta = empty_init is True or (empty_init is None and self.options.meta_init)
        return meta_init_context() if on_meta else otherwise

    def _init_device(self) -> torch.device:
        """Where whole parameters are created and initialized: the host under ``cpu_offload``, else the training device."""
        return devices.cpu_device() if self.options.cpu_offload else self.root_device

    def _apply_parallelize_fn(self, module: nn.Module, *, in_place: bool) -> nn.Module:
        """Run the ``parallelize_fn`` option on ``module`` with the whole mesh, as Lightning's ``ModelParallelStrategy`` does.

        Raises:
            TypeError: for FSDP1 modules, or a result that is no module (or, ``in_place``, another module).
        """
        refuse_fsdp1(module)
        fn = self.options.parallelize_fn
        if fn is None:
            return module
        link_construction(module)  # a meta-built module keeps its recorded construction through TP
        result = fn(module, self.device_mesh)
        name = getattr(fn, "__qualname__", repr(fn))
        if not isinstance(result, nn.Module):
            raise TypeError(
                f"HSDPStrategy(parallelize_fn={name}) returned {type(result).__name__}; it must return the module "
                f"(parallelize it in place and `return module`)."
            )
        if in_place and result is not module:
            raise TypeError(
                f"HSDPStrategy(parallelize_fn={name}) returned a different module ({type(result).__name__}) than the "
                f"{type(module).__name__} it was given; the Trainer keeps your LightningModule, so parallelize it in "
                f"place and return it."
            )
        return result

    def _shard(self, model: nn.Module) -> ShardedModel:
        """Shard ``model`` in place with :meth:`sharding_plan` (units the user sharded are kept), initialize what is on meta.

        Raises:
            TypeError: for FSDP1 (``FullyShardedDataParallel``) modules inside ``model``.
        """
        refuse_fsdp1(model)
        sharded = prepare_model(model, self.parallel_mesh, self.sharding_plan(), init_device=self._init_device(), device=self.root_device)
        self._after_sharding(model)
        return sharded

    def _after_sharding(self, model: nn.Module) -> None:
        """Point the model's divergence check at the step agreement; scope metrics to data parallel."""
        check = divergence_check(model)
        if check is not None:
            check.agreement = self._agreement
            check.enabled = self.options.divergence_check != "off"
        self.scope_metrics_to_data_parallel(model)
        _gather_root_on_submodule_entry(model)

    def _report_sharding(self, table: Callable[[], str]) -> None:
        """``sharding_report=True``: log ``table()`` on rank 0 at setup (every rank builds it: it may gather)."""
        if self.options.sharding_report:
            rank_zero_info(table())

    def _another_group_writes(self) -> bool:
        """Under ``fault_tolerance`` one participating replica group writes (and removes) checkpoints; the others hold the same state."""
        ft = getattr(self, "_fault_tolerance", None)  # each front end's own: the Trainer's callback, Fabric's engine
        return ft is not None and not ft.writes_checkpoints

    def sharding_summary(self, module: Optional[nn.Module] = None) -> ShardingSummary:
        """The per-unit table of ``module`` (default: the last model sharded); a collective.

        Raises:
            RuntimeError: before the strategy has sharded a model (setup).
        """
        roots = self._sharded_roots()
        module = module if module is not None else (roots[-1] if roots else None)
        sharded: Optional[ShardedModel] = prepared(module) if module is not None else None
        if module is None or sharded is None or not isinstance(module, HSDPModule):
            raise RuntimeError("HSDPStrategy.sharding_summary() is available once the strategy has sharded the model (setup).")
        mesh, scope = self.parallel_mesh, self._report_scope()
        return summarize(module, units_in_order(module, sharded.units), mesh.world, [*sharded.ignored, *sharded.replicated], self.root_device, **scope)

    def reshard_all(self) -> None:
        """Free every gathered unit (evaluation and the root leave them gathered): the parameters are DTensors again."""
        for model in self._sharded_roots():
            for unit in model.modules():
                if isinstance(unit, HSDPModule):
                    unit.reshard()

    def scope_metrics_to_data_parallel(self, module: nn.Module) -> None:
        """Under TP/PP, torchmetrics ``Metric`` objects without a ``process_group`` sync over the data-parallel group.

        The world group would count each sample once per TP peer and pipeline stage.
        """
        if not self._tp_or_pp:
            return
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = self.parallel_mesh.dp_group

    # ------------------------------------------------------------------ accumulation and steps

    @property
    def accumulation_mode(self) -> str:
        """What non-final micro-batches communicate: ``"skip"``, ``"every"`` or ``"defer_all_reduce"``."""
        return self._accumulation_mode

    def set_accumulation_mode(self, mode: str) -> str:
        """Change :attr:`accumulation_mode` from the next micro-batch on; returns the previous mode.

        Raises:
            TypeError / ValueError: for anything but one of the three mode strings; under
                ``fault_tolerance`` for anything but ``"skip"`` (torchft averages once per window).
        """
        previous = self._accumulation_mode
        checked = check_mode(mode, "HSDPStrategy.set_accumulation_mode(...)")
        if self.fault_tolerance_config is not None:
            check_accumulation_mode(checked)
        self._accumulation_mode = checked
        return previous

    def _non_final_micro_batch(self, module: nn.Module) -> AbstractContextManager:
        """What a non-final micro-batch of ``module`` communicates (under ``"skip"`` the divergence check only records)."""
        stack = ExitStack()
        stack.enter_context(no_gradient_sync(module, self._accumulation_mode))
        stack.enter_context(gradients_stay_local(module, self._accumulation_mode == "skip"))
        return stack

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)  # type: ignore[misc]
        if self.options.train_timeout is not None and not self._train_timeout_set:
            # After the first step every rank is in step: a collective that waits longer is a hang.
            set_collective_timeout(self.parallel_mesh, cast(timedelta, self.options.train_timeout))  # HSDPOptions normalizes it to a timedelta
            self._train_timeout_set = True
        if self._replica_audit is not None:  # off by default; a check every replica_check_every steps, nothing between
            trainer = self._agreement_trainer()
            self._replica_audit.after_step(self._audited_models, None if trainer is None else trainer.global_step + 1)
        return output

    def _audited_models(self) -> tuple[list[nn.Module], set[str]]:
        """The sharded models the replica audit checksums, and the parameters each rank keeps for itself (not compared)."""
        roots = self._sharded_roots()
        ignored = {name for root in roots if (sharded := prepared(root)) is not None for name in sharded.ignored}
        return roots, ignored

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: Optional[str] = None) -> None:
        if distributed_is_initialized():
            dist.barrier(device_ids=devices.barrier_device_ids(self.root_device))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    def all_reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Union[Tensor, Any]:
        """Reduce over the data-parallel group by default (TP peers and pipeline stages hold the same value)."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, self.data_parallel_group(group), reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        """Gather from every data-parallel rank by default (TP peers and pipeline stages hold the same samples)."""
        return all_gather_ddp_if_available(tensor, group=self.data_parallel_group(group), sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank votes, TP peers and pipeline stages included (Lightning's ``ModelCheckpoint`` asks).

        Lightning's own sums over :meth:`all_reduce`, the data-parallel group under TP/PP, whose sum
        never reaches the world size it compares with.
        """
        if not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == dist.get_world_size()) if all else bool(votes)

    def data_parallel_group(self, group: Any) -> Any:
        """``group``, or the data-parallel group under TP/PP when none is given (TP peers hold the same value)."""
        return self.parallel_mesh.dp_group if group is None and self._tp_or_pp else group

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_target(self, filepath: PathLike, storage_options: Optional[Any]) -> Optional[Path]:
        """Where every rank writes a save: rank 0's path; None where another replica group writes it (``fault_tolerance``).

        TypeError for ``storage_options`` (no CheckpointIO plugin is involved).
        """
        if storage_options is not None:
            raise TypeError(f"HSDPStrategy.save_checkpoint does not take storage_options (no CheckpointIO plugin is used); got {storage_options!r}.")
        return None if self._another_group_writes() else Path(self.broadcast(str(filepath)))

    def _checkpoint_source(self, path: PathLike) -> Path:
        """Rank 0's ``path``, once a save in flight is published (never read what it is still writing)."""
        self.wait_for_checkpoint()
        return Path(self.broadcast(str(path)))

    def _write_checkpoint(self, checkpoint: dict[str, Any], path: Path, *, in_background: bool) -> None:
        """Write in the layout ``state_dict_type`` says, in the background when asked (after the one in flight)."""
        self._warn_ignored_params_in_checkpoint()
        checksums = self.options.checkpoint_checksums
        if in_background:
            self._async_saves.save(checkpoint, path, checksums=checksums)
            return
        self.wait_for_checkpoint()  # a save never overtakes the one in flight
        hp_checkpoint.save_checkpoint(checkpoint, path, sharded=self.options.state_dict_type == "sharded", checksums=checksums)

    def _warn_ignored_params_in_checkpoint(self) -> None:
        """Once: ``ignored_params`` differ per rank, a checkpoint holds rank 0's copy and a resume gives it to every rank."""
        if getattr(self, "_warned_ignored", False) or not self.options.ignored_params:
            return
        self._warned_ignored = True
        rank_zero_warn(
            f"HSDPStrategy(ignored_params={list(self.options.ignored_params)}): these parameters are trained by each rank on "
            f"its own and differ between ranks; a checkpoint holds rank 0's copy, and a resume gives that copy to every "
            f"rank. Keep them identical (replicate_params all-reduces their gradients) if every rank's copy matters."
        )

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether an ``async_save`` checkpoint may still be writing (until :meth:`wait_for_checkpoint`)."""
        return self._async_saves.in_flight

    def wait_for_checkpoint(self) -> None:
        """Block until an ``async_save`` in flight is published (every rank calls it); raises the save's error on every rank."""
        self._async_saves.wait()

    def save_hf(
        self,
        path: Union[str, Path],
        module: Optional[nn.Module] = None,
        *,
        prefix: str = "",
        config: Optional[Union[str, Path]] = None,
        max_shard_size: Union[int, str] = "5GB",
        dtype: Optional[str] = None,
        overwrite: bool = False,
        ema: bool = False,
        peft: Optional[str] = None,
    ) -> Path:
        """Write the sharded model as a Hugging Face directory (``from_pretrained`` loads it); call on every rank.

        Each rank writes its own shards (no gather); the arguments are
        :func:`hp_lightning.checkpoint.hf.save_hf`'s. ``module`` None: the LightningModule (Trainer) or
        the one model set up (Fabric). ``ema=True`` writes the average of the ``ShardedEMA`` following
        ``module`` (swapped in for the write, put back after).

        Raises:
            FileExistsError, ValueError: as :func:`hp_lightning.checkpoint.hf.save_hf`; ValueError
                also when ``module`` is None and there is not exactly one model to write, or with
                ``ema=True`` when no average follows ``module`` or it has not started.
        """
        if module is None:
            candidates = [m for m in [getattr(self, "lightning_module", None)] if isinstance(m, nn.Module)] or self._sharded_roots()
            if len(candidates) != 1:
                raise ValueError(f"save_hf needs module=... here: {len(candidates)} models are set up; pass the one to write.")
            module = candidates[0]
        self.wait_for_checkpoint()
        with require_average(module, "save_hf(ema=True)").swapped() if ema else nullcontext():
            return hp_checkpoint.save_hf(
                module, Path(path), prefix=prefix, config=None if config is None else Path(config),
                max_shard_size=max_shard_size, dtype=dtype, overwrite=overwrite, peft=peft,
            )

    # ------------------------------------------------------------------ teardown, registration

    def _end_watching(self, failure: Optional[BaseException]) -> None:
        """An orderly end (None) stops the fault watchdog; a failure is posted for the other ranks (or, one caused by another rank's, ends quietly)."""
        if self._watchdog is None:
            return
        if failure is None:
            self._watchdog.stop()
        else:
            self._watchdog.report(failure)

    def _stop_background(self) -> None:
        """Finish (unless this rank failed: no collective then) and close saves; stop the watchdog."""
        if not self._failed:
            self.wait_for_checkpoint()
        self._async_saves.close()
        if self._watchdog is not None:
            self._watchdog.stop()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, init_params in _REGISTERED:
            strategy_registry.register(name, cls, description=description, **init_params)

    def __repr__(self) -> str:
        mesh = describe(self._mesh.world) if self._mesh is not None else f"mesh_shape={self.options.mesh_shape}"
        return f"{type(self).__name__}({mesh})"

