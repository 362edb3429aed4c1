"""What the strategy actually did to the model: a per-unit table, checked once the model is sharded.

One row per sharding unit: parameter tensors and elements it owns, bytes each rank holds
(this rank, and the smallest and largest over all ranks: uneven dim-0 splits show up here),
placements, compute and reduce dtypes, offload, whether it reshards after forward, and which units
it prefetches. Warnings point at two silent costs:

* a unit mixing frozen and trainable parameters: the frozen ones are all-gathered with the
  trainable ones in every forward and backward, and the unit's memory cannot be tuned apart;
* a mesh that shards nothing (shard axis of size 1): every rank holds the whole model, DDP's
  memory with FSDP's overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import Replicate, Shard
from typing_extensions import override

from hp_lightning import devices
from hp_lightning.callbacks._common import (
    all_units,
    param_groups,
    prefetch_targets,
    require_hsdp_strategy,
    reshards_after_forward,
    root_module,
    unit_names,
)
from hp_lightning.mesh import describe
from hp_lightning.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

_DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _dtype(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _placement(p: Any) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    return str(p)


@dataclass(frozen=True)
class UnitReport:
    """One sharding unit as this rank sees it."""

    name: str
    tensors: int
    elements: int
    local_bytes: int
    min_bytes: int
    max_bytes: int
    placements: str
    compute_dtype: str
    reduce_dtype: str
    offload: bool
    reshard_after_forward: bool
    forward_prefetch: tuple[str, ...]
    backward_prefetch: tuple[str, ...]
    frozen: int
    trainable: int


@dataclass
class ShardingSummary:
    """The whole report: mesh, units, parameters outside the units, warnings."""

    mesh: str
    units: list[UnitReport]
    unsharded_params: dict[str, int] = field(default_factory=dict)  # name -> bytes (replicate / ignored)
    warnings: list[str] = field(default_factory=list)

    @property
    def local_bytes(self) -> int:
        return sum(u.local_bytes for u in self.units) + sum(self.unsharded_params.values())

    def table(self) -> str:
        head = ("unit", "tensors", "elements", "bytes/rank", "min..max", "placements", "compute", "reduce", "offload", "reshard_fwd", "prefetch fwd / bwd")
        rows = [head]
        for u in self.units:
            rows.append((
                u.name,
                str(u.tensors),
                f"{u.elements:,}",
                f"{u.local_bytes:,}",
                f"{u.min_bytes:,}..{u.max_bytes:,}",
                u.placements,
                u.compute_dtype,
                u.reduce_dtype,
                devices.CPU if u.offload else "-",
                "yes" if u.reshard_after_forward else "no",
                f"{','.join(u.forward_prefetch) or '-'} / {','.join(u.backward_prefetch) or '-'}",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        out = [f"Sharding report ({self.mesh})", *lines]
        if self.unsharded_params:
            total = sum(self.unsharded_params.values())
            out.append(f"not sharded (replicate / ignored): {len(self.unsharded_params)} tensors, {total:,} bytes on every rank")
        out.append(f"total on this rank: {self.local_bytes:,} bytes of parameters")
        out.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(out)


def _min_max_over_ranks(values: list[int], device: torch.device) -> tuple[list[int], list[int]]:
    """Element-wise min and max over all ranks, in one all-reduce (max of x and of -x)."""
    if not dist.is_available() or not dist.is_initialized() or not values:
        return list(values), list(values)
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = len(values)
    result = both.tolist()
    return [-v for v in result[n:]], result[:n]


def sharding_summary(strategy: HSDPStrategy) -> ShardingSummary:
    """Build the report from the sharded model. A collective: every rank must call it."""
    root = root_module(strategy)
    names = unit_names(root)
    units = all_units(strategy)
    mesh = strategy.device_mesh
    partial: list[dict[str, Any]] = []
    for unit in units:
        tensors = elements = local = frozen = trainable = 0
        placements: set[str] = set()
        compute: set[str] = set()
        reduce: set[str] = set()
        offload = False
        for group in param_groups(unit):
            offload = offload or isinstance(group.offload_policy, CPUOffloadPolicy)
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                shard = param.to_local()
                tensors += 1
                elements += param.numel()
                local += shard.numel() * shard.element_size()
                placements.add(",".join(_placement(p) for p in param.placements))
                frozen += not param.requires_grad
                trainable += bool(param.requires_grad)
                compute_dtype = group.mp_policy.param_dtype or param.dtype
                compute.add(_dtype(compute_dtype))
                reduce.add(_dtype(group.mp_policy.reduce_dtype or compute_dtype))
        partial.append(dict(
            name=names.get(id(unit), type(unit).__name__),
            tensors=tensors,
            elements=elements,
            local_bytes=local,
            placements=" | ".join(sorted(placements)) or "-",
            compute_dtype="/".join(sorted(compute)) or "-",
            reduce_dtype="/".join(sorted(reduce)) or "-",
            offload=offload,
            reshard_after_forward=reshards_after_forward(unit),
            forward_prefetch=tuple(names.get(id(m), "?") for m in prefetch_targets(unit, "forward")),
            backward_prefetch=tuple(names.get(id(m), "?") for m in prefetch_targets(unit, "backward")),
            frozen=frozen,
            trainable=trainable,
        ))
    lows, highs = _min_max_over_ranks([p["local_bytes"] for p in partial], strategy.root_device)
    rows = [UnitReport(min_bytes=lo, max_bytes=hi, **p) for p, lo, hi in zip(partial, lows, highs)]

    sharded_model = strategy.sharded_model
    outside = set(sharded_model.ignored + sharded_model.replicated) if sharded_model is not None else set()
    unsharded = {n: p.numel() * p.element_size() for n, p in root.named_parameters() if n in outside}

    warnings: list[str] = []
    for row in rows:
        if row.frozen and row.trainable:
            warnings.append(
                f"unit {row.name!r} mixes {row.frozen} frozen and {row.trainable} trainable parameter tensors: the "
                f"frozen ones are all-gathered with the trainable ones in every forward and backward. Give them a "
                f"unit of their own (shard_modules) so their gathers can be tuned apart, or keep them whole with "
                f"ignored_params if they are small."
            )
    shard_size = mesh.shape[-1]
    if shard_size == 1:
        warnings.append(
            f"{describe(mesh)} shards nothing: its shard axis has size 1, so every rank holds the whole "
            f"model and FSDP only adds overhead. Use mesh_shape=[R, S] with S > 1 (e.g. S = devices per node)."
        )
    elif rows and all(r.tensors == 0 for r in rows):
        warnings.append(
            "no parameter is sharded: every parameter is in ignored_params or replicate_params. Remove some "
            "patterns from them to shard the model."
        )
    return ShardingSummary(mesh=describe(mesh), units=rows, unsharded_params=unsharded, warnings=warnings)


class ShardingReport(Callback):
    """Report how the model was sharded, once per setup, before the first step.

    Builds a :class:`ShardingSummary` (one small all-reduce for the min/max bytes over ranks),
    logs its table on rank 0 and emits its warnings.

    Args:
        log_table: log the table on rank 0 (``lightning.pytorch`` logger, INFO).
        path: also write the table to this text file (rank 0); None: don't.
        warn: emit the warnings (mixed frozen/trainable units, meshes that shard nothing).

    Attributes:
        summary: the last report (every rank has its own, with its own ``local_bytes``).

    Raises:
        TypeError: in ``setup()`` when the trainer's strategy is not :class:`HSDPStrategy`, or for
            non-bool flags / a non-string path at construction.
    """

    def __init__(self, log_table: bool = True, path: Optional[str] = None, warn: bool = True) -> None:
        for name, value in (("log_table", log_table), ("warn", warn)):
            if not isinstance(value, bool):
                raise TypeError(f"ShardingReport({name}=...) expects True or False; got {type(value).__name__} {value!r}.")
        if path is not None and not isinstance(path, (str, Path)):
            raise TypeError(f"ShardingReport(path=...) expects a file path string or None; got {type(path).__name__} {path!r}.")
        self.log_table = log_table
        self.path = None if path is None else str(path)
        self.warn = warn
        self.summary: Optional[ShardingSummary] = None
        self._pending = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_hsdp_strategy(trainer, self)
        self._pending = True  # once per trainer run, at the first *_start hook after sharding

    def _report(self, trainer: pl.Trainer) -> None:
        if not self._pending:
            return
        self._pending = False
        strategy = require_hsdp_strategy(trainer, self)
        self.summary = sharding_summary(strategy)
        text = self.summary.table()
        if self.log_table:
            rank_zero_info(text)
        if self.path is not None and trainer.is_global_zero:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(text + "\n")
        if self.warn:
            for message in self.summary.warnings:
                rank_zero_warn(f"ShardingReport: {message}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)
