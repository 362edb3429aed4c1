"""Cutting a model into stages (rules: :mod:`hp_lightning.parallel.pipeline`): its *units*, and :func:`split_stage`."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Optional, Union

from torch import nn

from hp_lightning.core.materialize import DetachedUnit, record_detached_units
from hp_lightning.parallel.pipeline.ties import TIES_ATTR, find_ties
from hp_lightning.parallel.pipeline_schedules import _held_entries, _HeldEntries


def stage_units(model: nn.Module, split_points: Sequence[str]) -> list[str]:
    """The modules the split points cut between, in registration order (see the module docstring).

    Raises:
        ValueError: a split point that is not such a module, split points out of order, or a parameter held on the way.
    """
    _refuse_points_inside_blocks(model, split_points)
    on_the_way = {""} | {p.rsplit(".", i)[0] for p in split_points for i in range(1, p.count(".") + 1)}
    for name in sorted(on_the_way, key=len):
        try:
            owner = model.get_submodule(name)
        except AttributeError:
            continue  # reported below as a split point that is not a module
        direct = [n for n, _ in owner.named_parameters(recurse=False)] + [n for n, _ in owner.named_buffers(recurse=False)]
        if direct:
            where = f"{name}." if name else ""
            raise ValueError(
                f"Pipeline split: {[where + n for n in direct]} belong to {name or 'the root module'!r} itself, on the way "
                f"to a split point, so no single stage would own them. Move them into a submodule (e.g. the embedding or "
                f"head module) or choose split points below a module without its own parameters."
            )
    units = _cut_points(model, on_the_way)
    missing = [p for p in split_points if p not in units]
    if missing:
        names = [n for n, _ in model.named_modules() if n]
        close = {p: difflib.get_close_matches(p, names, n=1) for p in missing}
        hints = "; ".join(f"did you mean {c[0]!r} for {p!r}?" for p, c in close.items() if c)
        raise ValueError(
            f"Pipeline split points {missing} are not modules the model can be cut at. The cut points here are "
            f"(in order): {units[:24]}{' ...' if len(units) > 24 else ''}.{' ' + hints if hints else ''}"
        )
    positions = [units.index(p) for p in split_points]
    if positions != sorted(positions) or positions[0] == 0:
        raise ValueError(
            f"Pipeline split points {list(split_points)} must follow the model's order and leave a first stage: "
            f"each starts a stage, in the order {units[:24]}."
        )
    return units


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
#: Where :func:`split_stage` records the parameter names of the model before the cut.
WHOLE_MODEL_PARAMS_ATTR = "_hp_pipeline_whole_model_params"
#: Where :func:`split_stage` records the ``(name, class)`` of every submodule before the cut.
WHOLE_MODEL_MODULES_ATTR = "_hp_pipeline_whole_model_modules"


def whole_model_params(model: nn.Module) -> Optional[frozenset[str]]:
    """The parameter names ``model`` had before :func:`split_stage` cut it to its stages (None: never cut).

    The options' parameter globs are written against the whole model: only a glob that matches
    none of these names is a mistake.
    """
    return model.__dict__.get(WHOLE_MODEL_PARAMS_ATTR)


def whole_model_modules(model: nn.Module) -> Optional[tuple[tuple[str, type], ...]]:
    """The ``(name, class)`` of every submodule ``model`` had before :func:`split_stage` cut it (None: never cut).

    The options' module specs are written against the whole model, as the parameter globs are.
    """
    return model.__dict__.get(WHOLE_MODEL_MODULES_ATTR)


def _cut_points(model: nn.Module, on_the_way: set[str]) -> list[str]:
    """The units: walking from the root, the children of every module on the way to a split point."""
    units: list[str] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}{child_name}"
            if full in on_the_way:
                walk(f"{full}.", child)
            else:
                units.append(full)

    walk("", model)
    return units


def enclosing_block(model: nn.Module, point: str, no_split: set[str]) -> Optional[tuple[str, nn.Module]]:
    """The outermost block strictly above ``point``: an entry of a container (not a container itself) or a
    Hugging Face ``_no_split_modules`` class. None when the point is not inside one (or not a module)."""
    parts = point.split(".")
    parent: nn.Module = model
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        module = parent._modules.get(parts[depth - 1])
        if module is None:
            return None  # not a module: reported later with the cut points
        entry = isinstance(parent, CONTAINERS) and not isinstance(module, CONTAINERS)
        if entry or type(module).__name__ in no_split:
            return name, module
        parent = module
    return None


def _refuse_points_inside_blocks(model: nn.Module, split_points: Sequence[str]) -> None:
    """Refuse split points inside a block (``net.blocks.2.fc1``): a block's forward calls all of its layers.

    Blocks are container entries and Hugging Face's ``_no_split_modules`` classes.

    Raises:
        ValueError: naming the split point, the block it lies in, the option and the cut points.
    """
    no_split = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    inside = {p: b for p in split_points if (b := enclosing_block(model, p, no_split)) is not None}
    if not inside:
        return
    fixed = [inside[p][0] if p in inside else p for p in split_points]
    on_the_way = {""} | {p.rsplit(".", i)[0] for p in fixed for i in range(1, p.count(".") + 1)}
    units = _cut_points(model, on_the_way)
    described = "; ".join(f"{p!r} lies inside the block {b!r} ({type(m).__name__})" for p, (b, m) in inside.items())
    raise ValueError(
        f"HSDPStrategy(pipeline_split_points={list(split_points)}) names points that are not cut points: {described}. "
        f"A block's forward runs all of its layers, so a stage holding part of it could not run it. A stage starts "
        f"at a block, never inside one: use {fixed}, or another of the cut points (in order): "
        f"{units[:24]}{' ...' if len(units) > 24 else ''}."
    )


def stays_on_every_stage(model: nn.Module, unit: str) -> bool:
    """Whether the cut leaves ``unit`` on every stage: nothing in its ``state_dict``, and not a container's entry.

    A container's entries run in sequence: a stateless activation between blocks belongs to its
    stage, or it would run once on every stage.
    """
    parent_name, _, _ = unit.rpartition(".")
    return not model.get_submodule(unit).state_dict() and not isinstance(model.get_submodule(parent_name), CONTAINERS)


def units_by_stage(units: Sequence[str], split_points: Sequence[str]) -> list[list[str]]:
    """Each stage's units (``units`` from :func:`stage_units`, cut at ``split_points``)."""
    bounds = [0, *(units.index(p) for p in split_points), len(units)]
    return [list(units[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]


def split_stage(model: nn.Module, split_points: Sequence[str], stage_index: Union[int, Sequence[int]]) -> tuple[list[str], list[str]]:
    """Cut ``model`` in place down to stage ``stage_index`` (or to several stages); return (kept units, removed units).

    Also records on ``model`` the parameters tied across stages, the whole model's names
    (:func:`whole_model_params`) and, on the meta device, the units removed (so materialization
    consumes the random-number generator as a build of the whole model does).
    """
    units = stage_units(model, split_points)
    model.__dict__.setdefault(WHOLE_MODEL_PARAMS_ATTR, frozenset(name for name, _ in model.named_parameters()))
    model.__dict__.setdefault(WHOLE_MODEL_MODULES_ATTR, tuple((name, type(module)) for name, module in model.named_modules() if name))
    bounds = [0, *(units.index(p) for p in split_points), len(units)]
    model.__dict__[TIES_ATTR] = find_ties(model, units, bounds)
    stages = [stage_index] if isinstance(stage_index, int) else sorted(stage_index)
    kept = [unit for stage in stages for unit in units[bounds[stage] : bounds[stage + 1]]]
    removed = []
    detached: list[DetachedUnit] = []
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    kept_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False) if any(n.startswith(u + ".") for u in kept)}
    for name in units:
        if name in kept:
            continue
        module = model.get_submodule(name)
        if stays_on_every_stage(model, name):
            continue  # nothing a checkpoint holds (a loss, rotary tables), outside a container: every stage keeps it
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        tensors = [*module.parameters(), *module.buffers()]
        # A container entry without tensors (an activation) is recorded too, so that putting the
        # removed units back for materialization restores the container's whole order.
        if any(t.is_meta for t in tensors) or (on_meta and not tensors):
            shared = {n: kept_names[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in kept_names}
            detached.append(DetachedUnit(parent, attr, module, tuple(parent._modules), shared))
        if isinstance(parent, CONTAINERS):
            del parent._modules[attr]  # the other entries keep their keys, so every name stays the same
            if isinstance(parent, nn.ModuleList) and not isinstance(parent, _HeldEntries):
                parent.__class__ = _held_entries(type(parent))
        else:
            setattr(parent, attr, None)
        removed.append(name)
    record_detached_units(model, detached)
    return kept, removed
