"""The plan of a cut: each stage's units and parameter bytes, as a table and as the sharding report carries it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from torch import nn

from hp_lightning.core.introspection import StageReport, stage_table
from hp_lightning.parallel.pipeline.cut import stage_units, stays_on_every_stage, units_by_stage


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage as cut: its units and the bytes of the parameters it holds (whole, before sharding).

    Attributes:
        index: the stage's index among ``P x V``.
        units: its units (:func:`stage_units`), in model order.
        param_bytes: bytes of its parameters, each counted once (a tied copy counts on each holder).
        everywhere: those of its units the cut leaves on every stage (:func:`stays_on_every_stage`).
    """

    index: int
    units: tuple[str, ...]
    param_bytes: int
    everywhere: tuple[str, ...] = ()


def param_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the parameters of ``modules``, each counted once (works on the meta device)."""
    params = {id(p): p for module in modules for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def stage_plan(model: nn.Module, split_points: Sequence[str]) -> list[StagePlan]:
    """Each stage's units and parameter bytes for ``split_points`` (call it before the cut: it reads the whole model)."""
    per_stage = units_by_stage(stage_units(model, split_points), split_points)
    return [
        StagePlan(
            index,
            tuple(units),
            param_bytes([model.get_submodule(u) for u in units]),
            tuple(u for u in units if stays_on_every_stage(model, u)),
        )
        for index, units in enumerate(per_stage)
    ]


def stage_reports(plans: Sequence[StagePlan], ranks: Optional[Sequence[int]] = None) -> list[StageReport]:
    """The plans as the sharding report carries them (:class:`~hp_lightning.core.introspection.StageReport`)."""
    return [
        StageReport(
            index=plan.index,
            pipeline_rank=ranks[plan.index] if ranks is not None else None,
            param_bytes=plan.param_bytes,
            units=tuple(u for u in plan.units if u not in plan.everywhere),
            everywhere=plan.everywhere,
        )
        for plan in plans
    ]


def plan_table(plans: Sequence[StagePlan], ranks: Optional[Sequence[int]] = None) -> str:
    """The stages as a table: index, pipeline rank, parameter bytes (and share of the model), units (those with state)."""
    return stage_table(stage_reports(plans, ranks))
