"""The checks of option values that the options (:mod:`hp_lightning.core.options`) and the APIs above share.

Each kind of value (a dtype, a TP plan, a pipeline schedule) is checked by one function, here, at the
bottom of the package: the options validate at construction without importing the layers that later
use the values (:mod:`hp_lightning.fully_shard`, :mod:`hp_lightning.parallel`), which re-export these names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` that ``except ValueError`` also catches.

    HyperParallel raises ``ValueError`` for every bad argument; Python convention (and torch) raise
    ``TypeError`` for a wrong type. Being both, code written against either keeps catching it. Its
    public name is ``hp_lightning.fully_shard.ArgumentTypeError``, the seed API that raises it.
    """


# ------------------------------------------------------------------ dtypes, reduction (fully_shard)


#: Accepted spellings of the floating dtypes FSDP computes or reduces in.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}


def parse_dtype(value: str | torch.dtype | None, *, name: str) -> torch.dtype | None:
    """Turn ``"bf16"`` / ``torch.bfloat16`` / ``None`` (inherit) into a floating ``torch.dtype`` (or None); ``name``: the option, for the error."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in DTYPE_NAMES:
            raise ValueError(
                f"{name} must be one of {sorted(DTYPE_NAMES)} or None; got {value!r}. "
                f"Use for example {name}='bf16'."
            )
        dtype = DTYPE_NAMES[key]
    else:
        raise ArgumentTypeError(f"{name} must be a string like 'bf16', a torch.dtype or None; got {type(value).__name__} {value!r}.")
    if not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype; got {dtype}. Use 'bf16', 'fp16' or 'fp32'.")
    return dtype


#: Gradient reduce ops: "avg" divides the summed gradients by the data-parallel size.
REDUCE_OPS = ("avg", "sum")


def validate_scaling_factor(factor: Any, owner: str) -> float | None:
    """Check a gradient scaling factor: a finite number > 0 (not a bool), or None (no scaling)."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ArgumentTypeError(f"{owner} expects a finite number > 0 or None (no scaling); got {type(factor).__name__} {factor!r}.")
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{owner} expects a finite number > 0 or None (no scaling); got {factor!r}.")
    return float(factor)


# ------------------------------------------------------------------ tensor parallel plans (parallel.tensor)


StyleSpec = Union[str, ParallelStyle]

#: Style names accepted in plans (Hugging Face's names) → the torch style each stands for.
TP_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    # Linear: weight split on output features; input replicated, output sharded on the last dim.
    "colwise": ColwiseParallel,
    # Linear: weight split on input features; input sharded on the last dim, output all-reduced.
    "rowwise": RowwiseParallel,
    # Colwise, then the output gathered (e.g. an LM head whose logits every rank needs).
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # Embedding split on the vocabulary; token ids replicated, output all-reduced.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Norms and dropout on sequence-sharded activations.
    "sequence_parallel": SequenceParallel,
}

def validate_tp_plan(plan: Any, owner: str = "HSDPStrategy(tp_plan=...)") -> dict[str, StyleSpec] | None:
    """Check a plan's form (a mapping of non-empty glob → known style name or ParallelStyle), before any process exists."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{owner} expects a mapping of module-name glob to style name; got {type(plan).__name__} {plan!r}. "
            f"Example: {{'blocks.*.attn.qkv': 'colwise', 'blocks.*.attn.proj': 'rowwise'}}."
        )
    out: dict[str, StyleSpec] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"{owner} keys are non-empty module-name globs; got {pattern!r}.")
        if isinstance(style, str):
            if style not in TP_STYLES:
                raise ValueError(
                    f"{owner} maps {pattern!r} to the unknown style {style!r}; known styles: {sorted(TP_STYLES)}."
                )
        elif not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{owner} maps {pattern!r} to {type(style).__name__} {style!r}; expected a style name "
                f"({sorted(TP_STYLES)}) or a torch ParallelStyle."
            )
        out[pattern] = style
    return out


# ------------------------------------------------------------------ pipeline split points and schedules (parallel.pipeline*)


#: ``pipeline_split_points`` value that asks for balanced stages (also what ``None`` means under a pipeline).
AUTO = "auto"


def validate_split_points(split_points: Any, pp: int, stages_per_rank: int = 1) -> Union[None, str, list[str]]:
    """Check ``pipeline_split_points`` against ``pipeline_parallel_size x pipeline_stages_per_rank`` stages, before any process exists.

    Returns:
        None without a pipeline; ``"auto"`` (given, or left out under a pipeline: the points are
        chosen from the model at setup, :func:`auto_split_points`); else the list of names.
    """
    stages = pp * stages_per_rank if pp > 1 else 1
    sizes = f"pipeline_parallel_size={pp}" + (f", pipeline_stages_per_rank={stages_per_rank}" if stages_per_rank > 1 else "")
    if split_points is None or split_points == AUTO:
        return AUTO if stages > 1 else None
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise TypeError(
            f"HSDPStrategy(pipeline_split_points=...) expects 'auto' or a list of module names; got "
            f"{type(split_points).__name__} {split_points!r}. Example: ['net.blocks.2'], or 'auto' to balance the stages."
        )
    points = list(split_points)
    if any(not isinstance(p, str) or not p for p in points):
        raise TypeError(f"HSDPStrategy(pipeline_split_points=...) items must be non-empty module names; got {points!r}.")
    if len(points) != stages - 1:
        raise ValueError(
            f"HSDPStrategy({sizes}) cuts the model into {stages} stages, so it needs "
            f"{stages - 1} split point(s); got {len(points)}: {points}. Or set pipeline_split_points='auto'."
        )
    if len(set(points)) != len(points):
        raise ValueError(f"HSDPStrategy(pipeline_split_points=...) names a module twice: {points}.")
    return points


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule needs: torch's class, whether it takes a list of stages, their placement.

    Attributes:
        multi: the class takes a list of this rank's stages (``PipelineScheduleMulti``).
        style: ``"loop"`` or ``"v"`` (see the module docstring).
        stages_per_rank: the ``pipeline_stages_per_rank`` values it runs with (None: any >= 1).
    """

    cls: type
    multi: bool
    style: str = "loop"
    stages_per_rank: Optional[tuple[int, ...]] = None


#: Schedule names (YAML) to what torch runs.
SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(ScheduleGPipe, multi=False, stages_per_rank=(1,)),
    "1f1b": ScheduleSpec(Schedule1F1B, multi=False, stages_per_rank=(1,)),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, multi=True),
    "looped_bfs": ScheduleSpec(ScheduleLoopedBFS, multi=True),
    "interleaved_zb": ScheduleSpec(ScheduleInterleavedZeroBubble, multi=True),
    "zbv": ScheduleSpec(ScheduleZBVZeroBubble, multi=True, style="v", stages_per_rank=(2,)),
    "dualpipev": ScheduleSpec(ScheduleDualPipeV, multi=True, style="v", stages_per_rank=(2,)),
}

#: Schedule names to torch's classes.
SCHEDULES: dict[str, type] = {name: spec.cls for name, spec in SCHEDULE_SPECS.items()}


def check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """Refuse a schedule that cannot run with these sizes: stages per rank or micro-batches (before any process group exists)."""
    if pp <= 1:
        return
    spec = SCHEDULE_SPECS[schedule]
    where = f"HSDPStrategy(pipeline_schedule={schedule!r}, pipeline_stages_per_rank={stages_per_rank})"
    if spec.stages_per_rank is not None and stages_per_rank not in spec.stages_per_rank:
        if spec.multi:
            fix = f"set pipeline_stages_per_rank={spec.stages_per_rank[0]} (and {pp * spec.stages_per_rank[0] - 1} split points, or 'auto')"
        else:
            fix = "use interleaved_1f1b, looped_bfs or interleaved_zb for several stages per rank, or set pipeline_stages_per_rank=1"
        raise ValueError(f"{where}: {schedule} runs exactly {spec.stages_per_rank[0]} stage(s) per rank; got {stages_per_rank}. Fix: {fix}.")
    stages = pp * stages_per_rank
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"{where}: 1f1b needs at least as many micro-batches as stages ({pp}); got pipeline_microbatches={microbatches}.")
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"{where}: {schedule} runs the micro-batches in rounds of {pp} (one per rank), so pipeline_microbatches "
                f"must be a multiple of max(1, microbatches // {pp}) = {rounds}; got {microbatches}. Use a multiple of {pp}."
            )
    if schedule == "dualpipev" and microbatches < stages:
        raise ValueError(f"{where}: dualpipev needs at least as many micro-batches as stages ({stages}); got pipeline_microbatches={microbatches}.")
