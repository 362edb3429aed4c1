"""Replica audit: do HSDP's replicas of every shard still hold the same bits?

HSDP keeps its replicas equal only by applying the same all-reduced gradients to the same
weights, so a bit flipped in one copy is never repaired. Every ``replica_check_every`` optimizer
steps, a checksum per sharding unit (the shards' bits summed as integers, so any single flipped bit
changes it) is compared across the replicate dim (:meth:`ReplicaAudit.check`). What it catches,
what it cannot (a corruption every replica shares) and its cost: ``docs/faults.md``, "Replica
audit". Parameters each rank keeps for itself (``ignored_params``) are not compared.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hp_lightning.core.ema import reshard_units
from hp_lightning.core.mesh import REPLICATE_DIM, MeshLayout, ParallelMesh

ACTIONS = ("raise", "warn")
#: Integer views of each element size, whose sum any single flipped bit changes (mod 2**64).
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

#: ``(unit name, the unit's own parameters)`` in a fixed order, the same on every replica.
Units = list[tuple[str, list[Tensor]]]


class ReplicaMismatchError(RuntimeError):
    """HSDP replicas of a shard hold different weights; the message names the units, the ranks and the step."""


def check_every(value: Any) -> Optional[int]:
    """``replica_check_every``: an int >= 1, or None (off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HSDPStrategy(replica_check_every=...) expects an int >= 1 (optimizer steps between checks) or None; got {value!r}.")
    return value


def check_action(value: Any) -> str:
    """``replica_check_action``: ``"raise"`` or ``"warn"``."""
    if not isinstance(value, str) or value.lower() not in ACTIONS:
        raise ValueError(f"HSDPStrategy(replica_check_action=...) expects one of {list(ACTIONS)}; got {value!r}.")
    return value.lower()


def check_layout(every: Optional[int], layout: MeshLayout) -> None:
    """Refuse an audit on a mesh without replicas (nothing to compare): before any process starts.

    Raises:
        ValueError: ``replica_check_every`` set on a 1-D (FSDP) mesh, one with a single replica, or
            Lightning's ``(data_parallel, tensor_parallel)`` mesh.
    """
    if every is None:
        return
    if layout.lightning_names or len(layout.dp) != 2 or layout.dp[0] < 2:
        raise ValueError(
            f"HSDPStrategy(replica_check_every={every}) compares the replicas of each shard across the replicate dim, but "
            f"this mesh has {'none' if layout.lightning_names or len(layout.dp) != 2 else 'one replica only'} "
            f"(data-parallel shape {list(layout.dp)}). Use an HSDP mesh_shape [R, S] with R >= 2, or "
            f"replica_check_every=None."
        )


def units_of(roots: Sequence[nn.Module], ignored: Collection[str] = ()) -> Units:
    """Each FSDP unit's own parameters (not those of units nested in it), by unit name; ``ignored`` names left out.

    Taken while the units are resharded (after sharding or an optimizer step): the parameters are
    then the sharded ones, which stay the same objects for the run.
    """
    units: Units = []
    for index, root in enumerate(roots):
        prefix = f"model {index}: " if len(roots) > 1 else ""
        modules = dict(root.named_modules())
        unit_names = sorted((n for n, m in modules.items() if isinstance(m, FSDPModule)), key=len, reverse=True)
        owner: dict[str, list[Tensor]] = {n: [] for n in unit_names}
        loose: list[Tensor] = []
        for name, param in root.named_parameters():
            if name in ignored:
                continue
            unit = next((n for n in unit_names if n == "" or name.startswith(n + ".")), None)
            (owner[unit] if unit is not None else loose).append(param)
        for name in sorted(owner, key=lambda n: list(modules).index(n)):
            if owner[name]:
                units.append((prefix + (name or "<root>"), owner[name]))
        if loose:
            units.append((prefix + "<not sharded>", loose))
    return units


def _word_sum(tensor: Tensor) -> Tensor:
    """The sum of ``tensor``'s bits read as integers, in int64 (wrapping: independent of the summation order), on its device.

    Read as int64 words where the bytes allow it (an int64 sum runs about 10x faster on CPU
    than widening smaller words), else as words of the element's size.
    """
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = local.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    size = flat.element_size()
    if flat.numel() * size % 8 == 0 and flat.storage_offset() * size % 8 == 0:
        return flat.view(torch.int64).sum()
    return flat.view(_WORDS[size]).sum(dtype=torch.int64)


@torch.no_grad()
def unit_checksums(units: Units) -> Tensor:
    """One int64 checksum per unit: the word sums of its local shards, added (one pass over the shards, on their device)."""
    sums = [torch.stack([_word_sum(t) for t in params]).sum() for _, params in units]
    return torch.stack(sums)


class ReplicaAudit:
    """Every ``every`` optimizer steps, compare each unit's checksum across ``replicate_group`` (the ranks holding copies).

    ``action``: ``"raise"`` (:class:`ReplicaMismatchError` on every rank, before anything else runs:
    no checkpoint is written after it) or ``"warn"`` (a warning on rank 0, training goes on).
    """

    def __init__(self, every: int, action: str, replicate_group: dist.ProcessGroup) -> None:
        checked = check_every(every)
        if checked is None:
            raise ValueError("ReplicaAudit needs every >= 1 (replica_check_every=None turns the audit off: build none).")
        self.every: int = checked
        self.action = check_action(action)
        self.group = replicate_group
        self.replicate_ranks = dist.get_process_group_ranks(replicate_group)
        #: Optimizer steps seen (the step number where the caller has none of its own).
        self.steps = 0
        #: The step of the last check that found every replica equal (None: none yet).
        self.last_good: Optional[int] = None
        #: Every mismatch message so far (under ``"warn"`` training went on after each).
        self.reports: list[str] = []
        self._units: Optional[tuple[tuple[int, ...], Units]] = None

    @classmethod
    def on_mesh(cls, every: Optional[int], action: str, mesh: ParallelMesh) -> Optional[ReplicaAudit]:
        """The audit for ``mesh`` (None when ``every`` is None); raises a ``ValueError`` as :func:`check_layout`."""
        if every is None:
            return None
        check_layout(every, mesh.layout)
        return cls(every, action, mesh.world[REPLICATE_DIM].get_group())

    def after_step(self, roots: Callable[[], tuple[Sequence[nn.Module], Collection[str]]], step: Optional[int] = None) -> None:
        """Count an optimizer step; on every ``every``-th one, check (a collective: every rank calls it).

        ``roots`` gives the sharded models and the names of parameters each rank keeps for itself
        (called on check steps only); ``step`` defaults to the steps counted here.

        Raises:
            ReplicaMismatchError: with ``action="raise"``, on every rank, when any unit's replicas differ.
        """
        self.steps += 1
        step = self.steps if step is None else step
        if step % self.every:
            return
        models, ignored = roots()
        message = self.check(self._units_for(models, ignored), step)
        if message is None:
            self.last_good = step
            return
        self.reports.append(message)
        if self.action == "raise":
            raise ReplicaMismatchError(message)
        if dist.get_rank() == 0:
            warnings.warn(message, UserWarning, stacklevel=2)

    def _units_for(self, models: Sequence[nn.Module], ignored: Collection[str]) -> Units:
        key = tuple(id(m) for m in models)
        if self._units is None or self._units[0] != key:
            for model in models:
                reshard_units(model)  # the sharded parameters (gathered ones are temporary): no collective
            self._units = (key, units_of(models, ignored))
        return self._units[1]

    def check(self, units: Units, step: int) -> Optional[str]:
        """Compare ``units`` across the replicate dim now; the mismatch message (the same on every rank), or None.

        One all-gather of the checksums over the replicate dim and one all-reduce of a flag over the
        world; only when a unit differs are the details gathered, so every rank names the same units.
        """
        mine = unit_checksums(units)
        table = torch.empty(len(self.replicate_ranks) * mine.numel(), dtype=torch.int64, device=mine.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 names it all_gather_single
        gather(table, mine, group=self.group)
        table = table.view(len(self.replicate_ranks), -1)
        flag = (table != table[:1]).any().to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank learns whether any replica anywhere differs
        if not flag.item():
            return None
        rows = table.cpu().tolist()
        found = [
            (name, tuple(zip(self.replicate_ranks, (row[u] for row in rows))))
            for u, (name, _) in enumerate(units)
            if len({row[u] for row in rows}) > 1
        ]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        return self._message(sorted({entry for part in everyone for entry in part}), step)

    def _message(self, found: list[tuple[str, tuple[tuple[int, int], ...]]], step: int) -> str:
        lines = []
        for name, copies in found:
            by_value: dict[int, list[int]] = {}
            for rank, value in copies:
                by_value.setdefault(value, []).append(rank)
            groups = sorted(by_value.items(), key=lambda item: (-len(item[1]), item[1]))
            held = "; ".join(f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))}: checksum {v & 0xFFFFFFFFFFFFFFFF:#018x}" for v, r in groups)
            lines.append(f"unit '{name}' differs between replicate ranks {', '.join(str(r) for r, _ in copies)} ({held})")
        since = f"after the check at step {self.last_good} found them equal" if self.last_good is not None else "since training started"
        good = (
            f"a checkpoint saved at or before step {self.last_good} (the last check that found the replicas equal)"
            if self.last_good is not None
            else "a checkpoint you trust: no earlier check of this run vouches for any (the first check is this one)"
        )
        stop = (
            f"Training stopped before writing another checkpoint. Resume from {good}, e.g. fit(ckpt_path=...), and check "
            f"the hosts of the ranks named (memory errors, device health)."
            if self.action == "raise"
            else "Training goes on (replica_check_action='warn'); checkpoints from now on hold divergent replicas."
        )
        return (
            f"Replica audit at optimizer step {step}: the replicas of {len(found)} sharding unit(s) no longer hold the same "
            f"weights, changed {since} (silent data corruption in one replica?): " + "; ".join(lines) + f". {stop}"
        )
