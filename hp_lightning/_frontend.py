"""The steps both front ends (Trainer and Fabric strategies) take the same way, written once.

Each takes the strategy (either kind: both have ``options``, ``cluster_environment``,
``root_device``, ranks and world size) and does one thing: check the mesh against the world
before launch, join the process group, start the fault watchdog, agree on the settings and build
the mesh. The strategies keep only what differs between Trainer and Fabric.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.distributed.device_mesh import DeviceMesh

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from hp_lightning._lightning_private import all_gather_ddp_if_available, init_dist_connection
from hp_lightning.core import agreement, devices, watchdog
from hp_lightning.fully_shard.divergence import divergence_check
from hp_lightning.core.mesh import MeshLayout, ParallelMesh, build_parallel_mesh, resolve_layout


class MeshAccess:
    """The mesh properties both strategies expose, over the ``ParallelMesh`` they keep in ``_mesh``."""

    _mesh: Optional[ParallelMesh] = None
    #: When the mesh exists, in the front end's words (for the error before that).
    _mesh_available: str = "once the processes are set up"

    @property
    def parallel_mesh(self) -> ParallelMesh:
        """The mesh and its per-technique sub-meshes."""
        if self._mesh is None:
            raise RuntimeError(f"HSDPStrategy.device_mesh is available {self._mesh_available}.")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The whole named mesh: ``("shard",)`` or ``("replicate", "shard")``, plus ``"tp"``/``"ep"`` when on."""
        return self.parallel_mesh.world

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """What FSDP shards over (the whole mesh without TP/EP)."""
        return self.parallel_mesh.dp

    def data_parallel_sampler_kwargs(self, world_size: int, global_rank: int) -> dict[str, Any]:
        """Every data-parallel rank reads different data; the ranks of one TP group (or pipeline) the same."""
        if self._mesh is None or (self._mesh.layout.tp == 1 and self._mesh.layout.pp == 1):
            return {"num_replicas": world_size, "rank": global_rank}
        return {"num_replicas": self._mesh.dp_size, "rank": self._mesh.dp_rank}

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank votes, TP peers and pipeline stages included (Lightning's ``ModelCheckpoint`` asks).

        Lightning sums the votes with ``reduce``/``all_reduce`` and compares with the world size;
        those default to the data-parallel group here under TP/PP, whose sum never reaches it, so
        "all agree" would always be False (``ModelCheckpoint`` would stop keeping better checkpoints).
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)  # type: ignore[attr-defined]
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == dist.get_world_size()) if all else bool(votes)

    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        """Gather from every data-parallel rank (as ``reduce``/``all_reduce``): TP peers and pipeline
        stages hold the same samples, and gathering over them would return each sample TP x PP times."""
        return all_gather_ddp_if_available(tensor, group=self.data_parallel_group(group), sync_grads=sync_grads)

    def scope_metrics_to_data_parallel(self, module: Any) -> None:
        """Under TP/PP, torchmetrics ``Metric`` objects sync over the data-parallel group.

        Their default, the world group, would count each sample once per TP peer and pipeline
        stage (sums, counts and concatenations off by TP x PP; ratios hide it). A metric given a
        ``process_group`` of its own keeps it.
        """
        if self._mesh is None or (self._mesh.layout.tp == 1 and self._mesh.layout.pp == 1):
            return
        try:
            from torchmetrics import Metric
        except ImportError:
            return
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = self._mesh.dp_group

    def warn_ignored_params_in_checkpoint(self) -> None:
        """Once: ``ignored_params`` differ per rank, a checkpoint holds rank 0's copy and a resume gives it to every rank."""
        if getattr(self, "_warned_ignored", False) or not getattr(self.options, "ignored_params", None):  # type: ignore[attr-defined]
            return
        self._warned_ignored = True
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"HSDPStrategy(ignored_params={list(self.options.ignored_params)}): these parameters are trained by each rank on "  # type: ignore[attr-defined]
            f"its own and differ between ranks; a checkpoint holds rank 0's copy, and a resume gives that copy to every "
            f"rank. Keep them identical (replicate_params all-reduces their gradients) if every rank's copy matters."
        )

    def data_parallel_group(self, group: Any) -> Any:
        """``group``, or the data-parallel group under TP/PP when none is given (TP peers hold the same value)."""
        if group is None and self._mesh is not None and (self._mesh.layout.tp > 1 or self._mesh.layout.pp > 1):
            return self._mesh.dp_group
        return group


def check_mesh_fits(strategy: Any) -> None:
    """Refuse a mesh that cannot cover the world, in ``Trainer(...)`` / ``Fabric(...)`` (before launch).

    Raises:
        ValueError: the sizes do not multiply to ``num_nodes x devices``; printed once per job.
    """
    try:
        layout(strategy, world_size=strategy.num_nodes * strategy.num_processes)
    except ValueError as exc:
        watchdog.print_once_per_job(exc)  # every torchrun worker raises it: one traceback per job
        raise


def layout(strategy: Any, world_size: int) -> MeshLayout:
    """The sizes of every mesh dim for this strategy's options and world (or the ValueError)."""
    options = strategy.options
    return resolve_layout(
        options.mesh_shape,
        world_size=world_size,
        num_nodes=strategy.num_nodes,
        devices_per_node=strategy.num_processes,
        tensor_parallel_size=options.tensor_parallel_size,
        expert_parallel_size=options.expert_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
    )


def set_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment and the rank-zero helpers this process's global rank."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def join_process_group(strategy: Any, backend: Optional[str]) -> str:
    """Create the default process group (a configuration error is printed once per job); return the backend.

    Under CPU offload whole parameters are initialized on the host and broadcast from there, so
    accelerator ranks also get gloo (``"cpu:gloo,cuda:nccl"``).
    """
    try:
        reset_seed()
        set_world_ranks(strategy)
        backend = backend or devices.process_group_backend(
            strategy.root_device.type, host_collectives=strategy.options.cpu_offload
        )
        device_id = strategy.root_device if devices.is_accelerator(strategy.root_device.type) else None
        init_dist_connection(strategy.cluster_environment, backend, timeout=strategy.options.timeout, device_id=device_id)
    except Exception as exc:
        watchdog.print_once_per_job(exc)  # e.g. a backend that cannot start: the same on every rank
        raise
    return backend


def start_watchdog(strategy: Any, running: Optional[watchdog.FaultWatchdog]) -> Optional[watchdog.FaultWatchdog]:
    """The fault watchdog, started once the process group exists (None when the option is off)."""
    options = strategy.options
    if not options.fault_watchdog:
        return None
    running = running or watchdog.FaultWatchdog(heartbeat_timeout=options.heartbeat_timeout, exit_grace=options.failure_exit_grace)
    running.start(strategy.global_rank, strategy.world_size, _local_ranks(strategy))
    return running


def agree_and_build_mesh(strategy: Any, precision: Optional[str], trainer: Any = None) -> ParallelMesh:
    """Compare the settings across ranks (before any group exists: a difference would hang), then build the mesh."""
    sizes = layout(strategy, world_size=strategy.world_size)
    settings = agreement.setup_settings(strategy.options.settings(), precision, trainer, sizes.shape)
    agreement.check_rank_agreement(settings, stage="setup")
    return build_parallel_mesh(strategy.root_device.type, sizes)


def _local_ranks(strategy: Any) -> range:
    """Global ranks on this node: Lightning and torchrun place them in consecutive blocks."""
    return range(strategy.node_rank * strategy.num_processes, (strategy.node_rank + 1) * strategy.num_processes)


def move_agreement_to_host_group(strategy: Any, step_agreement: agreement.StepAgreement) -> None:
    """Give the strategy's step agreement its host-side gloo group, once (a collective the first time).

    Called right after the mesh is built, on every rank: later setups (``fit`` then ``test``) reuse it.
    """
    if step_agreement.group is None:
        step_agreement.group = agreement.host_group(strategy.options.timeout)


def configure_divergence_check(model: Any, step_agreement: agreement.StepAgreement, mode: str) -> None:
    """Point ``model``'s divergence check at the strategy's step agreement, on or off per ``divergence_check``."""
    check = divergence_check(model)
    if check is not None:
        check.agreement = step_agreement
        check.enabled = mode != "off"


def forget_divergence_window(model: Any) -> None:
    """A new run starts a new accumulation window: drop what an interrupted one recorded."""
    check = divergence_check(model) if model is not None else None
    if check is not None:
        check.forget_window()
