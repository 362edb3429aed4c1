"""Fault-tolerant HSDP: FSDP2 inside each replica group, torchft's Manager across groups.

Each replica group is its own job (launcher, rendezvous, default process group) and shards the
model over its own ranks only. The replicate all-reduce is torchft's: FSDP2's
``set_all_reduce_hook`` calls :meth:`torchft.Manager.allreduce` on every unit's reduce-scattered
gradient, over a process group torchft rebuilds at each quorum, so a dead group costs one
uncommitted step instead of a hung job.

One optimizer step is::

    ft.begin_step()        # quorum with the live groups; a returning group heals here
    loss.backward()        # reduce-scatter in the group, then average across participants
    ft.commit()            # every rank of every participant votes; only then optimizer.step()

An uncommitted step is not applied: the optimizer does not step, gradients are dropped and the
step counters (torchft's and the data position derived from them) stay where they were.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hp_lightning.core.devices import CPU, CUDA
from hp_lightning.core.fault_tolerance import FaultTolerance, check_lighthouse_reachable, require_torchft
from hp_lightning.core.watchdog import elastic, waiting_on_purpose
from hp_lightning.ft.state import Stateful, TrainingState

__all__ = ["FaultTolerantHSDP", "Participation"]

#: The key under which the training state registers with torchft's Manager.
STATE_KEY = "hp_lightning"


@dataclasses.dataclass(frozen=True)
class Participation:
    """Where this group stands in the current step's quorum.

    Attributes:
        rank: this group's rank among the participating groups (what selects its data share).
        count: how many groups take part (what gradients are averaged over).
        step: committed optimizer steps so far, the same on every participant (the data position).
        healed: whether this group copied a live peer's state at this step's quorum (a returning
            group's first step, or the first step under ``init_sync``).
    """

    rank: int
    count: int
    step: int
    healed: bool = False


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _check_sharding(model: nn.Module, group_world_size: int) -> None:
    """ValueError for layouts this wiring would reduce wrongly: no FSDP2 unit, another mesh than the group's, ``replicate_params``."""
    units = _units(model)
    if not units:
        raise ValueError(
            "FaultTolerantHSDP expects a model sharded with fully_shard (FSDP2) inside the replica group; found no "
            "sharded unit. Call hp_lightning.fully_shard(unit, mesh=group_mesh) on each block, then on the root."
        )
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        # (n,) or (1, n): a replicate dimension of size 1 inside the group is a no-op.
        within_group = all(size == 1 for size in mesh.shape[:-1]) and mesh.size() == group_world_size
        if mesh.ndim > 2 or not within_group:
            raise ValueError(
                f"FaultTolerantHSDP shards inside each replica group and replicates across groups through torchft, "
                f"so every parameter must be sharded on the group's own mesh of {group_world_size} rank(s) ((n,) or (1, n)); "
                f"{name!r} lives on a mesh of shape {tuple(mesh.shape)}. Build the mesh over this group only "
                f"(init_device_mesh(device, ({group_world_size},))); a 2-D HSDP mesh or tensor parallelism are not "
                f"supported with fault tolerance yet."
            )
    if any(getattr(unit, "_hp_replicated", None) is not None for unit in units):
        raise ValueError(
            "FaultTolerantHSDP does not support fully_shard(replicate_params=...) yet: their all-reduce would stay "
            "inside the replica group. Shard those parameters (drop replicate_params) or run without fault tolerance."
        )


#: The torchrun run note (:func:`~hp_lightning.core.watchdog.elastic.run_note`) naming the lighthouse an attempt reached.
LIGHTHOUSE_NOTE = "fault_tolerance.lighthouse"


def _reach_lighthouse(config: FaultTolerance, address: str, group_rank: int) -> None:
    """Return once the lighthouse at ``address`` answers; tell a restarting lighthouse from a wrong address.

    An address that never answered in this torchrun run is a configuration error: after
    ``connect_timeout`` the job ends without a restart. One that answered an earlier attempt
    (noted in the agents' store) is likely restarting: the group waits up to ``join_timeout``,
    then the job ends (another attempt would only multiply the wait).

    Raises:
        ConnectionError: the lighthouse did not answer in time.
    """
    try:
        check_lighthouse_reachable(address, config.connect_timeout)
    except ConnectionError:
        if elastic.run_note(LIGHTHOUSE_NOTE) != address:
            # A wrong address fails every attempt alike: under torchrun, end the job instead of retrying.
            elastic.end_job_without_restart(f"fault_tolerance: no lighthouse reachable at {address}.")
            raise
        if group_rank == 0:
            sys.stderr.write(
                f"[hp_lightning] fault_tolerance: the lighthouse at {address} answered earlier in this run but does not "
                f"now; waiting for it up to join_timeout={config.join_timeout:g}s (it may be restarting).\n"
            )
            sys.stderr.flush()
        try:
            with waiting_on_purpose():  # join_timeout may exceed the fault watchdog's heartbeat_timeout
                check_lighthouse_reachable(address, config.join_timeout)
        except ConnectionError as exc:
            reason = (
                f"fault_tolerance: the lighthouse at {address} answered earlier in this run, but not within "
                f"join_timeout={config.join_timeout:g}s after this replica group's restart (last error: {exc.__cause__}). "
                f"Restart it at that address (`python -m hp_lightning.ft lighthouse --bind <host:port>`), or raise join_timeout."
            )
            elastic.end_job_without_restart(reason)
            raise ConnectionError(reason) from None
    if group_rank == 0:
        elastic.set_run_note(LIGHTHOUSE_NOTE, address)


class FaultTolerantHSDP:
    """Wires one replica group's sharded model and optimizers to torchft's Manager.

    Build it on every rank of the group, after the group's process group exists (it reads the
    rendezvous store from ``MASTER_ADDR`` / ``MASTER_PORT``) and the optimizers are built on the
    sharded parameters (a 1-D mesh over this group's ranks).

    Args:
        extra: named stateful objects healed with the weights (LR schedulers, loop progress, ...).
        device_type: ``"cpu"`` (gloo across groups) or ``"cuda"`` (NCCL); None: the parameters'.
        group_watchdog: run a :class:`~hp_lightning.core.watchdog.FaultWatchdog` over the group's
            ranks, so one dead rank ends its whole group within seconds (a lingering rank would keep
            the group heartbeating and the survivors waiting for their quorum timeout). False only
            when something else does this (the strategies' ``fault_watchdog`` option).

    Raises:
        ValueError / TypeError: for a layout torchft's replicate all-reduce cannot serve.
        ConnectionError: when the lighthouse does not answer within ``config.connect_timeout``.
        ImportError: without torchft.
    """

    def __init__(
        self,
        config: FaultTolerance,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        extra: Mapping[str, Stateful] | None = None,
        device_type: str | None = None,
        group_watchdog: bool = True,
    ) -> None:
        if not isinstance(config, FaultTolerance):
            raise TypeError(f"FaultTolerantHSDP(config=...) expects a FaultTolerance; got {type(config).__name__}.")
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("FaultTolerantHSDP(optimizers=...) expects a torch.optim.Optimizer or a non-empty list of them.")
        if not dist.is_initialized():
            raise RuntimeError(
                "FaultTolerantHSDP needs the replica group's own process group first: "
                "torch.distributed.init_process_group(...) over this group's ranks (torchrun/SLURM per group)."
            )
        missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(key)]
        if missing:
            raise RuntimeError(
                f"FaultTolerantHSDP reads the group's rendezvous store from MASTER_ADDR/MASTER_PORT; {missing} not set. "
                f"Launch each replica group with torchrun, SLURM or Lightning's launcher, which set them."
            )
        group_rank, group_world_size = dist.get_rank(), dist.get_world_size()
        _check_sharding(model, group_world_size)
        if device_type is None:
            device_type = next(model.parameters()).device.type
        if device_type not in (CPU, CUDA):
            raise ValueError(
                f"FaultTolerantHSDP: torchft's cross-group process groups are gloo (CPU) and NCCL (CUDA); the model is "
                f"on {device_type!r}, which has none yet. Train on {CPU!r} or {CUDA!r}, or without fault tolerance."
            )
        lighthouse = config.lighthouse_address()
        _reach_lighthouse(config, lighthouse, group_rank)
        torchft = require_torchft()
        from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        # torchft's Manager exchanges these unprefixed in MASTER_ADDR:MASTER_PORT's store; a restarted
        # attempt (torchrun --max-restarts, whose agent store outlives the attempt) must not read the dead one's.
        elastic.clear_stale_keys((MANAGER_ADDR_KEY, REPLICA_ID_KEY), group_rank=group_rank)

        timeout = timedelta(seconds=config.timeout)
        cross_group_pg = ProcessGroupNCCL(timeout=timeout) if device_type == CUDA else ProcessGroupGloo(timeout=timeout)

        self.config = config
        self.model = model
        self.optimizers = optimizers
        self.state = TrainingState(model, optimizers, extra)
        self.manager = torchft.Manager(
            pg=cross_group_pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout),
            connect_timeout=timedelta(seconds=config.connect_timeout),
            rank=group_rank,
            world_size=group_world_size,
            lighthouse_addr=lighthouse,
            replica_id=config.replica_id(),
            port=config.manager_port,
            init_sync=config.init_sync,
            hostname=config.hostname or socket.gethostname(),
        )
        self.manager.register_state_dict_fn(STATE_KEY, self.state.load_state_dict, self.state.state_dict)
        self._install_all_reduce_hooks()
        self._in_step = False
        #: The current (or last) step's quorum; None before the first step.
        self.participation: Participation | None = None
        self._watchdog: Any = None
        if group_watchdog:
            from hp_lightning.core.watchdog import FaultWatchdog

            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", group_world_size))
            first_local = group_rank - int(os.environ.get("LOCAL_RANK", group_rank % local_world))
            self._watchdog = FaultWatchdog(heartbeat_timeout=config.timeout, exit_grace=min(5.0, config.timeout))
            self._watchdog.start(group_rank, group_world_size, range(first_local, first_local + local_world))

    def _install_all_reduce_hooks(self) -> None:
        manager = self.manager

        def average_across_replica_groups(reduce_output: torch.Tensor) -> None:
            # The unit's reduce-scattered gradient shard: average it over the participating groups.
            # A failed collective is recorded by the Manager (the step will not commit), not raised.
            manager.allreduce(reduce_output).wait()

        for unit in _units(self.model):
            unit.set_all_reduce_hook(average_across_replica_groups)

    def add_state(self, name: str, obj: Stateful) -> None:
        """Heal ``obj`` (an LR scheduler, loop progress, a callback) with the weights."""
        self.state.add(name, obj)

    @property
    def in_step(self) -> bool:
        """Between :meth:`begin_step` and :meth:`commit`."""
        return self._in_step

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group saves (and removes) checkpoints: the first participant of the quorum (group 0 before any)."""
        if self.participation is None:
            return self.config.replica_group == 0
        return self.participation.rank == 0

    @property
    def step(self) -> int:
        """Committed optimizer steps: the quorum's, on every participant."""
        return self.manager.current_step()

    def restore_step(self, step: int) -> None:
        """Continue torchft's step count at ``step`` (a resume from a checkpoint); call before the first :meth:`begin_step`.

        Raises:
            RuntimeError: after the first step.
            ValueError: for a negative step.
        """
        if self.participation is not None:
            raise RuntimeError("FaultTolerantHSDP.restore_step(...) must come before the first begin_step().")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"FaultTolerantHSDP.restore_step(step=...) expects an int >= 0; got {step!r}.")
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def begin_step(self) -> Participation:
        """Before forward: join this step's quorum (healing from a live group if behind), clear the gradients."""
        heals = self.state.heals
        self.manager.start_quorum()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self._in_step = True
        rank = self.manager.participating_rank()
        self.participation = Participation(
            rank=-1 if rank is None else rank, count=self.manager.num_participants(), step=self.step,
            healed=self.state.heals != heals,
        )
        return self.participation

    def commit(self) -> bool:
        """Vote on this step after backward; step the optimizers only if every participant's rank agrees.

        Returns whether it was applied (False: gradients dropped); RuntimeError without :meth:`begin_step` first.
        """
        if not self._in_step:
            raise RuntimeError("FaultTolerantHSDP.commit() needs begin_step() first, once per optimizer step.")
        self._in_step = False
        committed = self.manager.should_commit()
        if committed:
            # Hold off healing peers' reads while the live tensors change.
            self.manager.disallow_state_dict_read()
            try:
                for opt in self.optimizers:
                    opt.step()
            finally:
                self.manager.allow_state_dict_read()
        else:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        return committed

    def shutdown(self) -> None:
        """Stop this rank's manager server, checkpoint server and group watchdog (threads and ports)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self.manager.shutdown(wait=False)
