"""Facts about a sharded model's units: what each holds, gathers, prefetches and keeps.

What the sharding report, the gradient-memory monitor and the strategies read. Facts FSDP2 does
not expose publicly come through :mod:`hp_lightning.core._torch_private`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from hp_lightning.core import devices
from hp_lightning.core._torch_private import fsdp_state, held_gradients, managed_params, prefetch_targets, reshards_after_forward
from hp_lightning.core.mesh import MODEL_PARALLEL_DIM_NAMES, describe


def unit_names(root: nn.Module) -> dict[int, str]:
    """``id(module) -> qualified name`` below the root (``"<root>"`` for the root itself).

    The modules of one list unit (``fully_shard([ln_f, head])``) share the joined name ``ln_f+head``.
    """
    names = {id(m): (name or "<root>") for name, m in root.named_modules()}
    by_state: dict[int, list[nn.Module]] = {}
    for module in sharding_units(root):
        by_state.setdefault(id(fsdp_state(module)), []).append(module)
    for members in by_state.values():
        joined = "+".join(names[id(m)] for m in members)
        names.update({id(m): joined for m in members})
    return names


def sharding_units(module: nn.Module) -> list[Any]:
    """Every sharding unit in ``module``'s tree (root included), outermost first.

    Any FSDP2 unit counts (an :class:`~hp_lightning.HSDPModule` is one), so this layer needs
    nothing from :mod:`hp_lightning.fully_shard`.
    """
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def units_in_order(root: nn.Module, units: Optional[Sequence[nn.Module]] = None) -> list[Any]:
    """Every sharding unit, root first, then the others in forward order (``units`` when known)."""
    inner = list(units) if units is not None else [m for m in sharding_units(root) if m is not root]
    return [root, *[u for u in inner if u is not root]]


_DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _dtype(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _placement(p: Any) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    return str(p)


def _placements(param: Any) -> str:
    """``S(0)`` / ``R,S(0)`` on data-parallel meshes; each named dim spelled out once TP/EP are in (``shard:S(0),tp:S(1)``)."""
    names = tuple(param.device_mesh.mesh_dim_names or ())
    if not MODEL_PARALLEL_DIM_NAMES & set(names):
        return ",".join(_placement(p) for p in param.placements)
    return ",".join(f"{name}:{_placement(p)}" for name, p in zip(names, param.placements))


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


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage as cut at setup: the same on every rank, whichever stage the rank holds.

    Bytes are the whole stage's parameters before sharding: what balancing the stages compares (the
    per-unit table next to it covers only the reporting rank's own stage, sharded).

    Attributes:
        pipeline_rank: the pipeline rank that runs it (loop or V placement with virtual stages).
        units: its units that hold state, in model order.
        everywhere: its units with nothing in their ``state_dict`` (a loss, rotary tables), which the
            cut leaves on every stage.
    """

    index: int
    pipeline_rank: Optional[int]
    param_bytes: int
    units: tuple[str, ...]
    everywhere: tuple[str, ...] = ()


def stage_table(stages: Sequence[StageReport]) -> str:
    """The stages as lines: index, pipeline rank, parameter bytes (and share of the model), units (up to 6 named)."""
    total = sum(s.param_bytes for s in stages) or 1
    lines = [f"Pipeline stages ({len(stages)}): parameter bytes per stage, before sharding"]
    for stage in stages:
        units = list(stage.units)
        shown = ", ".join(units if len(units) <= 6 else [*units[:3], "...", *units[-2:]])
        rank = f" on pipeline rank {stage.pipeline_rank}" if stage.pipeline_rank is not None else ""
        lines.append(f"  stage {stage.index}{rank}: {stage.param_bytes:,} bytes ({100 * stage.param_bytes / total:.1f} %), {len(units)} unit(s): {shown}")
    everywhere = [u for stage in stages for u in stage.everywhere]
    if everywhere:
        lines.append(f"  on every stage (nothing in their state_dict): {', '.join(everywhere)}")
    return "\n".join(lines)


@dataclass
class ShardingSummary:
    """The whole report: mesh, units, parameters outside the units, warnings; under PP, every stage's plan."""

    mesh: str
    units: list[UnitReport]
    unsharded_params: dict[str, int] = field(default_factory=dict)  # name -> bytes (replicate / ignored)
    warnings: list[str] = field(default_factory=list)
    #: Under a pipeline: every stage's units and bytes, as cut (empty without one).
    stages: list[StageReport] = field(default_factory=list)

    @property
    def local_bytes(self) -> int:
        return sum(u.local_bytes for u in self.units) + sum(self.unsharded_params.values())

    def table(self) -> str:
        head = ("unit", "tensors", "elements", "bytes/rank", "min..max", "placements", "compute", "reduce", "offload", "reshard_fwd", "prefetch fwd / bwd")
        rows = [head]
        for u in self.units:
            rows.append((
                u.name, str(u.tensors), f"{u.elements:,}", f"{u.local_bytes:,}", f"{u.min_bytes:,}..{u.max_bytes:,}",
                u.placements, u.compute_dtype, u.reduce_dtype, devices.CPU if u.offload else "-", "yes" if u.reshard_after_forward else "no",
                f"{','.join(u.forward_prefetch) or '-'} / {','.join(u.backward_prefetch) or '-'}",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        out = [f"Sharding report ({self.mesh})", *lines]
        if self.unsharded_params:
            out.append(f"not sharded (replicate / ignored): {len(self.unsharded_params)} tensors, {sum(self.unsharded_params.values()):,} bytes on every rank")
        out.append(f"total on this rank: {self.local_bytes:,} bytes of parameters")
        if self.stages:
            out.append(stage_table(self.stages))
        out.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(out)


def _min_max_over_ranks(values: list[int], device: torch.device, group: Any = None) -> tuple[list[int], list[int]]:
    """Element-wise min and max over the ranks of ``group`` (None: all), in one all-reduce (max of x and of -x)."""
    if not dist.is_available() or not dist.is_initialized() or not values:
        return list(values), list(values)
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    result = both.tolist()
    return [-v for v in result[n:]], result[:n]


#: A unit whose trainable parameters hold at most this share of its elements is frozen-base training
#: (adapters beside frozen weights): the mixed-unit warning is not given for it.
ADAPTER_SHARE = 0.1


def summarize(
    root: nn.Module,
    units: Sequence[nn.Module],
    mesh: DeviceMesh,
    unsharded_names: Iterable[str],
    device: torch.device,
    group: Any = None,
    stage: Optional[tuple[int, int]] = None,
    stages: Sequence[StageReport] = (),
) -> ShardingSummary:
    """The per-unit report of a sharded model. A collective: every rank must call it.

    Args:
        units: the sharding units, root first (see :func:`units_in_order`).
        mesh: the data-parallel mesh.
        unsharded_names: replicate / ignored parameter names (listed apart, with their bytes).
        device: where the one all-reduce of byte counts runs.
        group: the ranks holding the same units (None: all; a pipeline stage's ranks under PP).
        stage: (pipeline rank, pipeline size) under PP, named in the report's title.
        stages: under PP, every stage's plan (:class:`StageReport`), listed after the units.
    """
    names = unit_names(root)
    partial: list[dict[str, Any]] = []
    trainable_share: list[float] = []  # per unit: the trainable parameters' share of its elements
    for unit in units:
        managed = managed_params(unit)  # (sharded parameter, mp_policy, offload_policy)
        params = [param for param, _, _ in managed]
        trainable = [param for param in params if param.requires_grad]
        elements = sum(param.numel() for param in params)
        partial.append(dict(
            name=names.get(id(unit), type(unit).__name__),
            tensors=len(params),
            elements=elements,
            local_bytes=sum(shard.numel() * shard.element_size() for shard in (param.to_local() for param in params)),
            placements=" | ".join(sorted({_placements(param) for param in params})) or "-",
            compute_dtype="/".join(sorted({_dtype(mp.param_dtype or param.dtype) for param, mp, _ in managed})) or "-",
            reduce_dtype="/".join(sorted({_dtype(mp.reduce_dtype or mp.param_dtype or param.dtype) for param, mp, _ in managed})) or "-",
            offload=any(isinstance(offload, CPUOffloadPolicy) for _, _, offload in managed),
            reshard_after_forward=reshards_after_forward(unit),
            forward_prefetch=tuple(dict.fromkeys(names.get(id(m), "?") for m in prefetch_targets(unit, "forward"))),
            backward_prefetch=tuple(dict.fromkeys(names.get(id(m), "?") for m in prefetch_targets(unit, "backward"))),
            frozen=len(params) - len(trainable),
            trainable=len(trainable),
        ))
        trainable_share.append(sum(param.numel() for param in trainable) / elements if elements else 0.0)
    lows, highs = _min_max_over_ranks([p["local_bytes"] for p in partial], device, group)
    rows = [UnitReport(min_bytes=lo, max_bytes=hi, **p) for p, lo, hi in zip(partial, lows, highs)]

    outside = set(unsharded_names)
    unsharded = {n: p.numel() * p.element_size() for n, p in root.named_parameters() if n in outside}

    warnings: list[str] = []
    for row, share in zip(rows, trainable_share):
        # Frozen-base fine-tuning (LoRA and other adapters): the base weights are gathered because the
        # forward and the adapters' input gradients need them; they get no gradient, reduce-scatter or
        # optimizer state. Nothing to tune apart, so no advice.
        if row.frozen and row.trainable and share > ADAPTER_SHARE:
            warnings.append(
                f"unit {row.name!r} mixes {row.frozen} frozen and {row.trainable} trainable parameter tensors: the "
                f"frozen ones are all-gathered with the trainable ones in every forward and backward. Give them a "
                f"unit of their own (shard_modules) so their gathers can be tuned apart, or keep them whole with "
                f"ignored_params if they are small."
            )
    if mesh.shape[-1] == 1:
        warnings.append(
            f"{describe(mesh)} shards nothing: its shard axis has size 1, so every rank holds the whole "
            f"model and FSDP only adds overhead. Use mesh_shape=[R, S] with S > 1 (e.g. S = devices per node)."
        )
    elif rows and all(r.tensors == 0 for r in rows):
        warnings.append(
            "no parameter is sharded: every parameter is in ignored_params or replicate_params. Remove some "
            "patterns from them to shard the model."
        )
    where = describe(mesh) if stage is None else f"pipeline rank {stage[0]} of {stage[1]}; {describe(mesh)}"
    return ShardingSummary(mesh=where, units=rows, unsharded_params=unsharded, warnings=warnings, stages=list(stages))


def live_gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient storage ``model`` holds right now on this rank.

    Counts sharded gradients (a DTensor's local shard), what FSDP2 holds outside ``param.grad``
    (:func:`~hp_lightning.core._torch_private.held_gradients`) and plain gradients of replicate /
    ignored parameters. Each storage is counted once, by its full size (views share it).
    """
    seen: dict[tuple[str, int], int] = {}
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    for tensor in [*grads, *(held for unit in sharding_units(model) for held in held_gradients(unit))]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[(str(local.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
