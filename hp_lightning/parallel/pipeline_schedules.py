"""torch's pipeline schedules by name, how many stages each rank holds under them, and where.

One stage per rank (``gpipe``, ``1f1b``): the bubble is ``(P - 1) / (M + P - 1)`` of a step. Several
stages per rank (``pipeline_stages_per_rank`` = ``V``): the model is cut into ``P x V`` stages and
the pipeline fills ``V`` times faster (``interleaved_1f1b``: about ``(P - 1) / (V M + P - 1)``; the
zero-bubble ones also split each backward into input and weight parts), at the cost of ``V`` times
more activation sends and more micro-batches in flight. Placement follows torch's
:func:`generate_stage_to_rank_mapping`: *loop* (rank ``r`` holds ``r, r + P, ...``) or *V*
(``zbv``, ``dualpipev``: ``r`` and ``2P - 1 - r``, so the turn of the V costs no send).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Optional

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

# Re-exported: the schedule table and its check live with the option checks, below the options.
from hp_lightning.core._torch_private import prefetch_targets
from hp_lightning.core.checks import SCHEDULE_SPECS
from hp_lightning.core.checks import SCHEDULES as SCHEDULES
from hp_lightning.core.checks import ScheduleSpec as ScheduleSpec
from hp_lightning.core.checks import check_schedule as check_schedule


def stages_of_rank(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices ``pp_rank`` holds under ``schedule``, in increasing order."""
    mapping = generate_stage_to_rank_mapping(pp, pp * stages_per_rank, style=SCHEDULE_SPECS[schedule].style)
    return sorted(stage for stage, rank in mapping.items() if rank == pp_rank)


def rank_of_stage(schedule: str, stage: int, pp: int, stages_per_rank: int) -> int:
    """The pipeline rank that holds ``stage``."""
    return generate_stage_to_rank_mapping(pp, pp * stages_per_rank, style=SCHEDULE_SPECS[schedule].style)[stage]


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
#: What ``nn.Module.__init__`` creates on an instance: a view gets its own copies, so hooks and
#: children registered on it later never reach the module it was copied from.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """``module`` with the same attributes and its own copies of nn.Module's bookkeeping (hooks, children)."""
    clone = copy.copy(module)
    for key in _MODULE_INTERNALS:
        value = module.__dict__.get(key)
        if isinstance(value, (dict, set)):
            clone.__dict__[key] = copy.copy(value)
    return clone


def stage_view(model: nn.Module, drop: Sequence[str]) -> nn.Module:
    """A tree sharing ``model``'s modules, without the units named in ``drop`` (another stage's).

    Only the modules on the way to a dropped unit are shallow copies: each of a rank's stages runs
    the LightningModule's ``forward`` on its own units under the original names, while the
    LightningModule keeps all of the rank's parameters. A dropped container entry is deleted, another unit becomes None.
    """
    dropped = set(drop)
    on_the_way = {""} | {name.rsplit(".", i)[0] for name in dropped for i in range(1, name.count(".") + 1)}

    def copy_path(module: nn.Module, prefix: str) -> nn.Module:
        clone = _shallow_copy(module)
        children: dict[str, Optional[nn.Module]] = {}
        for name, child in module._modules.items():
            full = f"{prefix}{name}"
            if full in dropped:
                if not isinstance(module, _CONTAINERS):
                    children[name] = None
            elif full in on_the_way and child is not None:
                children[name] = copy_path(child, f"{full}.")
            else:
                children[name] = child
        clone.__dict__["_modules"] = children
        if isinstance(clone, nn.ModuleList) and len(children) != len(module._modules) and not isinstance(clone, StageModuleList):
            clone.__class__ = _held_entries(type(clone))
        return clone

    return copy_path(model, "")


def stage_pieces(model: nn.Module, units: Sequence[str], recipe_units: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of a stage's ``units`` holding parameters that no recipe unit will own.

    On a rank with several stages the root cannot own them (it spans stages): they become one
    FSDP unit per stage instead (an embedding, a head and its norm, gathered together).

    Raises:
        ValueError: a recipe unit that spans a cut, or a module with parameters of its own around recipe units.
    """
    recipe = {id(m) for m in recipe_units}
    on_the_way = {name.rsplit(".", i)[0] for name in units for i in range(1, name.count(".") + 1)}
    spanning = [name for name in on_the_way if id(model.get_submodule(name)) in recipe]
    if spanning:
        raise ValueError(
            f"HSDPStrategy(pipeline_stages_per_rank > 1): the sharding units {sorted(spanning)} span a pipeline cut, so they would "
            f"belong to two stages. Choose shard_modules inside the stages' units (e.g. the blocks), or leave shard_modules unset."
        )

    def pieces(name: str, module: nn.Module) -> list[nn.Module]:
        if id(module) in recipe:
            return []
        if not any(id(m) in recipe for m in module.modules() if m is not module):
            return [module] if any(True for _ in module.parameters()) else []
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"HSDPStrategy(pipeline_stages_per_rank > 1): {[f'{name}.{n}' for n in own]} belong to {name!r} itself, around its "
                f"sharding units, so no FSDP unit of one stage could own them. Move them into a submodule, or use one stage per rank."
            )
        return [p for child_name, child in module.named_children() for p in pieces(f"{name}.{child_name}", child)]

    return [p for unit in units for p in pieces(unit, model.get_submodule(unit))]


def keep_prefetch_inside_stages(stage_modules: Sequence[nn.Module]) -> None:
    """Drop prefetches from one stage's units to another's: each stage is its own FSDP root, gathered when the schedule runs it."""
    stage_of = {id(m): s for s, root in enumerate(stage_modules) for m in root.modules() if isinstance(m, FSDPModule) and m is not root}
    for unit_id, stage in list(stage_of.items()):
        unit = next(m for m in stage_modules[stage].modules() if id(m) == unit_id)
        for direction in ("forward", "backward"):
            targets = prefetch_targets(unit, direction)
            inside = [t for t in targets if stage_of.get(id(t)) == stage]
            if len(inside) != len(targets):
                setter = unit.set_modules_to_forward_prefetch if direction == "forward" else unit.set_modules_to_backward_prefetch
                setter(inside)  # type: ignore[operator]


class _HeldEntries:
    """Mixin for a stage's ``ModuleList`` that lost entries: integer indices count the entries it holds.

    ``nn.ModuleList`` looks an integer index up by its key, and after a cut the first held entry may be ``"2"``.
    """

    def __getitem__(self, index: Any) -> Any:
        held = list(self._modules.values())  # type: ignore[attr-defined]
        return nn.ModuleList(held[index]) if isinstance(index, slice) else held[index]


class StageModuleList(_HeldEntries, nn.ModuleList):
    """An ``nn.ModuleList`` holding one pipeline stage's entries under their original keys."""


def _held_entries(cls: type) -> type:
    """``cls`` (``nn.ModuleList`` or a user's subclass) with :class:`_HeldEntries` indexing."""
    if cls is nn.ModuleList:
        return StageModuleList  # importable by name, so a cut model still pickles
    return type(cls.__name__, (_HeldEntries, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
