"""Pipeline parallelism (PP): each rank builds one stage of the model and runs it with ``torch.distributed.pipelining``.

The model is cut at *split points*, module names in its own hierarchy (``"net.blocks.2"`` starts
stage 1 at block 2), given or chosen (``"auto"``, :func:`auto_split_points`: the model's list of
blocks cut so that the largest stage holds the fewest parameter bytes, embeddings on the first
stage, final norm and head on the last). The cut follows torchtitan's convention, so parameter
names never change and a checkpoint of a pipelined run is keyed like one of the whole model:

* the modules the split points cut between (*units*) are the children of every module on the way
  to a split point, in registration order; the split points must be units, in that order;
* a stage keeps its units; every other unit that holds parameters or buffers is removed from it:
  an entry of an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` is deleted while the
  others keep their keys (``blocks.2`` stays ``blocks.2``; the list iterates and indexes over the
  entries it still holds, so ``for block in self.blocks``, ``self.layers[0]`` and torch's own
  ``nn.TransformerEncoder`` work unchanged); any other module is set to ``None``: the model's
  ``forward`` must skip a ``None`` module (``h = self.emb(x) if self.emb is not None else x``),
  as torchtitan's models do. A model that does not fails loudly (``'NoneType' object is not
  callable``). A pass-through placeholder would not: ``self.emb(x) + self.pos(pos)`` on a later
  stage would add positions to the hidden state silently;
* a unit with nothing in its ``state_dict`` (a loss module, an activation, a rotary-embedding
  table kept in non-persistent buffers) stays on every stage, unless it is an entry of a
  container: entries run in sequence, so an activation between two blocks of an
  ``nn.Sequential`` runs on its own stage only (kept everywhere, it would run once per stage);
* parameters held directly by a module on the way (not by a unit) belong to no single stage and
  are refused;
* a parameter the model uses under several names on different stages (an LM head tied to the
  embedding: ``head.weight = tok.weight``) becomes one copy per stage that holds one of its names,
  kept equal by Megatron-LM's rule (:class:`TiedParameter`): the copies start equal (the first
  holder's values are broadcast once), and every step their gradients are summed over the
  stages that hold them before the optimizer, so each copy takes the step one process takes.

The stage runs the LightningModule's ``forward`` on its units. Schedules are torch's own
(``ScheduleGPipe``, ``Schedule1F1B``); the loss is computed on the last stage per micro-batch.
Trade-off: more stages hold less of the model each, but every stage idles while the pipeline
fills and drains — the *bubble*, ``(stages - 1) / (micro-batches + stages - 1)`` of a step for
GPipe and 1F1B alike; 1F1B holds at most ``stages`` micro-batches of activations instead of all.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from hp_lightning.core import gradients
from hp_lightning.core.introspection import StageReport, stage_table
from hp_lightning.core.materialize import DetachedUnit, record_detached_units
from hp_lightning.parallel.pipeline_schedules import SCHEDULE_SPECS, _held_entries, _HeldEntries, rank_of_stage
from hp_lightning.parallel.pipeline_schedules import SCHEDULES as SCHEDULES

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


def stage_units(model: nn.Module, split_points: Sequence[str]) -> list[str]:
    """The modules the split points cut between, in registration order (see the module docstring).

    Raises:
        ValueError: a split point that is not such a module, split points out of order, or a
            parameter held by a module on the way to a split point (it would belong to no stage).
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


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


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


def _enclosing_block(model: nn.Module, point: str, no_split: set[str]) -> Optional[tuple[str, nn.Module]]:
    """The outermost block strictly above ``point``: an entry of a container (not a container itself) or a
    Hugging Face ``_no_split_modules`` class. None when the point is not inside one (or not a module)."""
    parts = point.split(".")
    parent: nn.Module = model
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        module = parent._modules.get(parts[depth - 1])
        if module is None:
            return None  # not a module: reported later with the cut points
        entry = isinstance(parent, _CONTAINERS) and not isinstance(module, _CONTAINERS)
        if entry or type(module).__name__ in no_split:
            return name, module
        parent = module
    return None


def _refuse_points_inside_blocks(model: nn.Module, split_points: Sequence[str]) -> None:
    """Refuse split points inside a block (``net.blocks.2.fc1``): neither stage could run that block.

    A block's ``forward`` calls all of its layers, so the stage holding some of them would call a
    ``None`` in place of the others (``'NoneType' object is not callable`` at step 0). Blocks are
    the entries of ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` and Hugging Face's
    ``_no_split_modules`` classes; a stage starts at a block, never inside one.

    Raises:
        ValueError: naming the split point, the block it lies in, the option and the cut points.
    """
    no_split: set[str] = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    inside = {p: b for p in split_points if (b := _enclosing_block(model, p, no_split)) is not None}
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


#: Where :func:`split_stage` records, on the cut model, its parameters tied across stages.
TIES_ATTR = "_hp_pipeline_ties"
#: Set on a stage's copy of a tied parameter that is not the first holder's: gradient norms
#: count the tied parameter once (on its first holder), as one process holding it once does.
TIED_REPLICA_ATTR = gradients.TIED_REPLICA_ATTR


@dataclass(frozen=True)
class TiedParameter:
    """One parameter that the model reaches under several names, held by more than one stage.

    Attributes:
        names: every name of the parameter in the whole model, in ``named_parameters`` order.
        stages: the stage holding each of ``names``.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]

    @property
    def holders(self) -> tuple[int, ...]:
        """The stages holding a copy, in order; the first one's copy is the reference."""
        return tuple(sorted(set(self.stages)))

    def name_on(self, stage: int) -> Optional[str]:
        """The first of the names ``stage`` holds (None when it holds no copy)."""
        return next((n for n, s in zip(self.names, self.stages) if s == stage), None)


def tied_parameters(model: nn.Module) -> tuple[TiedParameter, ...]:
    """The parameters :func:`split_stage` found tied across stages (empty before a cut, or without ties)."""
    return model.__dict__.get(TIES_ATTR, ())


def _find_ties(model: nn.Module, units: Sequence[str], bounds: Sequence[int]) -> tuple[TiedParameter, ...]:
    """Parameters reached under several names whose names lie on different stages (same on every rank)."""
    stage_of_unit = {unit: next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1]) for i, unit in enumerate(units)}
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    ties = []
    for names in names_of.values():
        if len(names) < 2:
            continue
        stages = tuple(next(stage_of_unit[u] for u in units if name.startswith(u + ".")) for name in names)
        if len(set(stages)) > 1:
            ties.append(TiedParameter(tuple(names), stages))
    return tuple(ties)


def stays_on_every_stage(model: nn.Module, unit: str) -> bool:
    """Whether the cut leaves ``unit`` on every stage: nothing in its ``state_dict``, and not a container's entry.

    A loss module, an attribute activation or rotary tables in non-persistent buffers are used
    by name and cost nothing, so every stage keeps them. A container's entries run in sequence
    (``nn.Sequential``, a loop over an ``nn.ModuleList``): an entry belongs to its stage even
    without state, or a stateless activation between blocks would run once on every stage.
    """
    parent_name, _, _ = unit.rpartition(".")
    return not model.get_submodule(unit).state_dict() and not isinstance(model.get_submodule(parent_name), _CONTAINERS)


def units_by_stage(units: Sequence[str], split_points: Sequence[str]) -> list[list[str]]:
    """Each stage's units (``units`` from :func:`stage_units`, cut at ``split_points``)."""
    bounds = [0, *(units.index(p) for p in split_points), len(units)]
    return [list(units[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]


# ------------------------------------------------------------------ automatic split points


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage as cut: its units and the bytes of the parameters it holds (whole, before sharding).

    Attributes:
        index: the stage's index among ``P x V``.
        units: its units (:func:`stage_units`), in model order.
        param_bytes: bytes of its parameters, each counted once (a parameter tied across stages
            counts on every stage holding a copy: each holds it).
        everywhere: those of its units with nothing in their ``state_dict`` (a loss, an
            activation, rotary tables): the cut leaves them on every stage.
    """

    index: int
    units: tuple[str, ...]
    param_bytes: int
    everywhere: tuple[str, ...] = ()


def _param_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the parameters of ``modules``, each counted once (works on the meta device)."""
    seen: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            seen[id(param)] = param.numel() * param.element_size()
    return sum(seen.values())


def stage_plan(model: nn.Module, split_points: Sequence[str]) -> list[StagePlan]:
    """Each stage's units and parameter bytes for ``split_points`` (call it before the cut: it reads the whole model)."""
    per_stage = units_by_stage(stage_units(model, split_points), split_points)
    return [
        StagePlan(
            index,
            tuple(units),
            _param_bytes([model.get_submodule(u) for u in units]),
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


def find_block_list(model: nn.Module) -> str:
    """The name of the model's list of blocks, where automatic split points may cut.

    The candidates are the ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` modules whose
    entries are modules (not containers) holding parameters, that lie inside no block themselves
    (so a MoE layer's list of experts inside a block is never one); the one holding the most
    parameter bytes wins (the first in registration order on a tie): a decoder's ``layers``, a
    GPT's ``blocks``, ``nn.TransformerEncoder``'s ``layers``.

    Raises:
        ValueError: a model without such a list (naming the fix: explicit split points).
    """
    no_split: set[str] = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    best: Optional[tuple[int, str]] = None
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS) or len(module._modules) < 2:
            continue
        entries = [child for child in module._modules.values() if child is not None]
        if any(isinstance(child, _CONTAINERS) for child in entries) or not any(_param_bytes([c]) for c in entries):
            continue
        first = f"{name}.{next(iter(module._modules))}" if name else next(iter(module._modules))
        if _enclosing_block(model, first, no_split) is not None:
            continue  # a list inside a block (experts, a block's own sub-layers): not where stages start
        size = _param_bytes(entries)
        if best is None or size > best[0]:
            best = (size, name)
    if best is None:
        raise ValueError(
            f"HSDPStrategy(pipeline_split_points='auto') balances stages over the entries of a list of blocks "
            f"(an nn.ModuleList / nn.Sequential / nn.ModuleDict of modules with parameters); {type(model).__name__} has none. "
            f"Name the split points yourself: pipeline_split_points=['<module where stage 1 starts>', ...]."
        )
    return best[1]


def _balanced_bounds(costs: Sequence[int], first: int, last: int, stages: int) -> list[int]:
    """Where stages 1.. start among ``costs`` (one per block): the smallest largest stage, then the evenest.

    Stage 0 also carries ``first`` (what runs before the blocks), the last stage ``last``; every
    stage holds at least one block. Exact (dynamic programming over contiguous cuts): first the
    minimal largest stage ``M``, then, among the cuts whose every stage is at most ``M``, the one
    with the smallest sum of squared stage costs (ties: the earliest cuts). Deterministic.
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (first if stage == 0 else 0) + (last if stage == stages - 1 else 0)

    inf = float("inf")
    # best_max[s][j]: the smallest largest stage putting blocks [0, j) on stages 0..s.
    best_max = [[inf] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best_max[0][j] = cost(0, 0, j)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            best_max[s][j] = min(max(best_max[s - 1][i], cost(s, i, j)) for i in range(s, j))
    limit = best_max[stages - 1][n]
    squares = [[inf] * (n + 1) for _ in range(stages)]
    start: list[list[int]] = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        if cost(0, 0, j) <= limit:
            squares[0][j] = cost(0, 0, j) ** 2
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = cost(s, i, j)
                if c <= limit and squares[s - 1][i] + c * c < squares[s][j]:
                    squares[s][j], start[s][j] = squares[s - 1][i] + c * c, i
    bounds, j = [], n
    for s in range(stages - 1, 0, -1):
        j = start[s][j]
        bounds.append(j)
    return bounds[::-1]


def auto_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points that balance ``num_stages`` stages by parameter bytes (``pipeline_split_points='auto'``).

    Stages start at entries of the model's list of blocks (:func:`find_block_list`); what runs
    before the list (embeddings) counts on the first stage, what runs after it (final norm, head)
    on the last, and every stage holds at least one block. Parameter bytes are what a stage's
    memory and all-gathers scale with; a block's compute scales with them too when the blocks are
    alike (a decoder's layers). Reads sizes only, so it runs on the meta-device model before the
    cut and gives the same points on every rank.

    Raises:
        ValueError: a model without a list of blocks, or with fewer blocks than stages (naming
            the sizes and the fixes), or a cut :func:`stage_units` refuses.
    """
    blocks = find_block_list(model)
    container = model.get_submodule(blocks)
    keys = list(container._modules)
    entries = [f"{blocks}.{key}" if blocks else key for key in keys]
    if len(entries) < num_stages:
        raise ValueError(
            f"HSDPStrategy(pipeline_split_points='auto'): {num_stages} stages (pipeline_parallel_size x pipeline_stages_per_rank) "
            f"need at least one block each, but {blocks or 'the model'!r} holds {len(entries)}. Use fewer stages "
            f"(a smaller pipeline_parallel_size or pipeline_stages_per_rank), or a model with at least {num_stages} blocks."
        )
    if num_stages == 1:
        return []
    units = stage_units(model, entries[1:])  # every entry a cut point: also checks nothing sits on the way
    first_block, last_block = units.index(entries[0]), units.index(entries[-1])
    before = _param_bytes([model.get_submodule(u) for u in units[:first_block]])
    after = _param_bytes([model.get_submodule(u) for u in units[last_block + 1 :]])
    costs = [_param_bytes([model.get_submodule(e)]) for e in entries]
    points = [entries[i] for i in _balanced_bounds(costs, before, after, num_stages)]
    stage_units(model, points)
    return points


def resolve_split_points(model: nn.Module, split_points: Union[str, Sequence[str]], num_stages: int) -> list[str]:
    """The split points to cut at: ``split_points`` as given, or computed for ``"auto"`` (:func:`auto_split_points`)."""
    if split_points == AUTO:
        return auto_split_points(model, num_stages)
    return list(split_points)


def split_stage(model: nn.Module, split_points: Sequence[str], stage_index: Union[int, Sequence[int]]) -> tuple[list[str], list[str]]:
    """Cut ``model`` in place down to stage ``stage_index`` (or to several stages); return (kept units, removed units).

    Also records on ``model`` the parameters tied across stages (:func:`tied_parameters`; the
    :class:`PipelineRunner` keeps their copies equal) and, when the model is still on the meta
    device, the units removed (so that materialization consumes the random-number generator as
    a build of the whole model does, and this stage's tensors get the values they get there).
    """
    units = stage_units(model, split_points)
    bounds = [0, *(units.index(p) for p in split_points), len(units)]
    model.__dict__[TIES_ATTR] = _find_ties(model, units, bounds)
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
        if isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            del parent._modules[attr]  # the other entries keep their keys, so every name stays the same
            if isinstance(parent, nn.ModuleList) and not isinstance(parent, _HeldEntries):
                parent.__class__ = _held_entries(type(parent))
        else:
            setattr(parent, attr, None)
        removed.append(name)
    record_detached_units(model, detached)
    return kept, removed


def PipelineStage(
    submodule: nn.Module,
    stage_index: int,
    stage_num: int,
    device: Optional[torch.device] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> _TorchPipelineStage:
    """The seed's ``PipelineStage(stage_model, stage_index, stage_num=pp_size)``: torch's ``PipelineStage``.

    Args:
        submodule: this rank's stage (already ``fully_shard``-ed over its data-parallel sub-mesh).
        device: where the stage runs (default: the current accelerator, else the CPU).
        group: the pipeline group, e.g. ``mesh["pp"].get_group()``; may be left out only when the
            world is exactly the stages (no data parallelism).

    Raises:
        ValueError: without ``group`` when the world has more ranks than stages.
    """
    if group is None and dist.is_initialized() and dist.get_world_size() != stage_num:
        raise ValueError(
            f"PipelineStage(stage_num={stage_num}) on a world of {dist.get_world_size()} ranks needs the pipeline group: "
            f"pass group=mesh['pp'].get_group() (the ranks that hold this rank's other stages)."
        )
    if device is None:
        from hp_lightning.core import devices

        device_type = devices.current_accelerator_type()
        module = devices.device_module(device_type)
        device = torch.device(device_type, module.current_device()) if module is not None else devices.cpu_device()
    return _TorchPipelineStage(submodule, stage_index, stage_num, device, group=group)


class PipelineRunner:
    """One rank's stage(s) and schedule; :meth:`step` runs one batch through the pipeline (forward and backward).

    Args:
        stage_module: this rank's stage, an FSDP root (the schedule drives its gradient sync); or,
            with several stages per rank, one root per stage, in ``stage_index`` order.
        stage_index: the stage's index (or the stages' indices, increasing) among ``num_stages``.
        num_stages: stages in the whole pipeline (ranks x stages per rank).
        schedule: a name of :data:`SCHEDULES`; multi-stage schedules take every stage of the rank.
        loss_fn: ``(output, target) -> loss`` of one micro-batch, on the last stage.

    Raises:
        ValueError: a stage with ``replicate_params``, a stage count the schedule cannot run, or
            parameters tied across stages with several stages per rank.
    """

    def __init__(
        self,
        stage_module: Union[nn.Module, Sequence[nn.Module]],
        *,
        stage_index: Union[int, Sequence[int]],
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        modules = [stage_module] if isinstance(stage_module, nn.Module) else list(stage_module)
        indices = [stage_index] if isinstance(stage_index, int) else list(stage_index)
        replicated = [
            name or "(stage root)" for module in modules for name, m in module.named_modules() if getattr(m, "_hp_replicated", None) is not None
        ]
        if replicated:
            raise ValueError(
                f"PipelineRunner needs a stage without replicate_params; got units with replicate_params at {replicated}. "
                f"torch's pipeline schedules turn gradient sync off for every micro-batch and reduce FSDP's gradients "
                f"themselves, so those parameters would never be all-reduced. Let fully_shard shard them under a pipeline."
            )
        pp = dist.get_world_size(group)
        spec = SCHEDULE_SPECS[schedule]
        per_rank = num_stages // pp
        if len(modules) != len(indices) or num_stages % pp or len(modules) != per_rank or (not spec.multi and per_rank != 1):
            raise ValueError(
                f"PipelineRunner(schedule={schedule!r}): {len(modules)} stage module(s) with indices {indices} do not fit "
                f"{num_stages} stages on {pp} ranks ({'one stage per rank' if not spec.multi else 'the same count on every rank'})."
            )
        if per_rank > 1 and tied_parameters(modules[0]):
            raise ValueError(
                f"Pipeline: parameters tied across stages ({[list(t.names) for t in tied_parameters(modules[0])]}) are kept "
                f"equal only with one stage per rank so far; set pipeline_stages_per_rank=1 or untie them in the model."
            )
        self.stage_indices, self.num_stages, self.pp_size = indices, num_stages, pp
        self.stage_index = indices[0]
        self.microbatches, self.group, self.schedule_name = microbatches, group, schedule
        self.last_rank = rank_of_stage(schedule, num_stages - 1, pp, per_rank) if spec.multi else pp - 1
        self.loss_scale = float(microbatches)
        self._loss_fn = loss_fn
        self._predicting = False
        self.stages = [_TorchPipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, indices)]
        self.stage = self.stages[0]
        self.stage_modules = modules
        self.tied = TiedCopies(modules[0], stage_index=indices[0], num_stages=num_stages, group=group)
        # scale_grads=False: the loss is scaled instead, so gradients accumulated over Lightning's
        # accumulate_grad_batches are never divided twice.
        target: Any = self.stages if spec.multi else self.stage
        self.schedule = spec.cls(target, n_microbatches=microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        """This rank feeds the pipeline (holds stage 0)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """This rank computes the loss (holds the last stage)."""
        return self.num_stages - 1 in self.stage_indices

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        if self._predicting:  # no target: nothing to compute
            return torch.zeros((), device=output.device)
        return self._loss_fn(output, target) / self.loss_scale

    def _check_batch(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"Pipeline: a batch of {inputs.shape[0]} samples per data-parallel rank does not split into "
                f"pipeline_microbatches={self.microbatches} equal micro-batches. Use a batch size divisible by it."
            )

    def _run(self, run: Callable[..., Any], inputs: torch.Tensor, target: Any, losses: list[torch.Tensor]) -> Any:
        """One schedule call with each stage's part: the input on the first, target and losses on the last."""
        if self.is_first and self.is_last:
            return run(inputs, target=target, losses=losses)
        if self.is_first:
            return run(inputs)
        if self.is_last:
            return run(target=target, losses=losses)
        return run()

    def step(self, inputs: torch.Tensor, target: Any, *, accumulate: int = 1) -> torch.Tensor:
        """Forward and backward of one batch, split into micro-batches; the batch's mean loss on every stage.

        Raises:
            ValueError: a batch that does not split into ``microbatches`` equal parts.
        """
        self._check_batch(inputs)
        self.loss_scale = float(self.microbatches * accumulate)
        losses: list[torch.Tensor] = []
        earlier = self.tied.set_aside_grads()
        self._run(self.schedule.step, inputs, target, losses)
        self.tied.sum_grads(earlier)
        return self._share_loss(losses)

    def evaluate(self, inputs: torch.Tensor, target: Any = None, *, outputs: bool = False) -> tuple[Optional[torch.Tensor], Any]:
        """Forward only (torch's ``eval`` schedule): the mean loss (with a target) and, if asked, the last stage's output, on every stage."""
        self._check_batch(inputs)
        self.loss_scale = float(self.microbatches)
        losses: list[torch.Tensor] = []
        # torch's schedules compute a loss on the last stage whenever they have a loss function: a
        # prediction gets a placeholder target (one number per sample) and the loss is skipped.
        self._predicting = target is None
        try:
            output = self._run(self.schedule.eval, inputs, torch.zeros(inputs.shape[0]) if target is None else target, losses)
        finally:
            self._predicting = False
            self._reshard()  # a forward without backward leaves gathered what it gathered
        loss = self._share_loss(losses) if target is not None else None
        if outputs:
            box = [output if self.is_last else None]
            dist.broadcast_object_list(box, group=self.group, group_src=self.last_rank)
            output = box[0]
        return loss, output

    def _reshard(self) -> None:
        """Free every gathered unit of this rank's stages (kept gathered across micro-batches under ``pipeline_keep_gathered``)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.stage_modules:
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the micro-batch losses, computed on the last stage and sent to every stage."""
        device = self.stage.device
        if self.is_last:
            loss = torch.stack([part.detach().float() for part in losses]).mean().to(device) * self.loss_scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss


class TiedCopies:
    """This stage's copies of parameters tied across stages, kept equal by Megatron-LM's rule.

    A tied parameter (``head.weight = tok.weight`` with the embedding on the first stage and the
    head on the last) is one tensor in one process; cut into stages it is one copy per stage that
    holds one of its names. Two things keep the copies one parameter:

    * they start equal: once, after materialization, the first holder's values are broadcast to
      the others (shard ``i`` to shard ``i``: every stage has the same data-parallel mesh, so the
      copies' shards line up; checked here before anything is sent);
    * every batch, each copy's new gradient (this batch's contribution only, so that Lightning's
      gradient accumulation never counts one twice) is summed over the holders, before the
      optimizer: every copy then has the whole gradient one process computes, and equal copies
      with equal gradients take equal optimizer steps.

    Gradient norms count the tied parameter once: the copies of the holders after the first are
    marked (``TIED_REPLICA_ATTR``) and :func:`hp_lightning.core.gradients.total_grad_norm`
    leaves them out. Cost: one all-reduce of the tied parameter's shard per batch, between the
    holders (for an LM, the embedding's shard; nothing when no parameter is tied).

    Raises:
        ValueError: copies whose shapes, dtypes or sharding differ between the stages (on every
            rank of the pipeline group alike).
    """

    def __init__(self, stage_module: nn.Module, *, stage_index: int, num_stages: int, group: dist.ProcessGroup) -> None:
        self.copies: list[tuple[TiedParameter, nn.Parameter, dist.ProcessGroup, int]] = []
        ties = tied_parameters(stage_module)
        if not ties:
            return
        groups = self._groups(ties, num_stages, group)
        stage_ranks = dist.get_process_group_ranks(group)
        mine = []
        for tie, tie_group in zip(ties, groups):
            name = tie.name_on(stage_index)
            param = stage_module.get_parameter(name) if name is not None else None
            mine.append(None if param is None else _layout(param))
            if param is not None:
                assert tie_group is not None
                self.copies.append((tie, param, tie_group, stage_ranks[tie.holders[0]]))
        layouts: list[Any] = [None] * num_stages
        dist.all_gather_object(layouts, mine, group=group)
        for index, tie in enumerate(ties):
            seen = {stage: layouts[stage][index] for stage in tie.holders}
            if len(set(seen.values())) > 1:
                described = "; ".join(f"stage {s} ({tie.name_on(s)}): {layout}" for s, layout in seen.items())
                raise ValueError(
                    f"Pipeline: {list(tie.names)} are one tied parameter held by stages {list(tie.holders)}, whose "
                    f"copies must have the same shape, dtype and sharding to be kept equal shard by shard; got {described}. "
                    f"Shard them alike (the same shard_placement_fn result for both names), or untie them in the model."
                )
        with torch.no_grad():
            for tie, param, tie_group, first in self.copies:
                dist.broadcast(_local_of(param), src=first, group=tie_group)
                if stage_index != tie.holders[0]:
                    setattr(param, TIED_REPLICA_ATTR, True)

    @staticmethod
    def _groups(ties: Sequence[TiedParameter], num_stages: int, group: dist.ProcessGroup) -> list[Optional[dist.ProcessGroup]]:
        """Each tie's group of holders (this rank's): the pipeline group, or a subgroup built on every rank."""
        everyone = tuple(range(num_stages))
        if all(tie.holders == everyone for tie in ties):
            return [group] * len(ties)
        # new_group is a collective of the whole world: every rank builds every pipeline group's subgroups,
        # in the same order (the ties are found identically on every rank).
        pipelines: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, tuple(dist.get_process_group_ranks(group)))
        me = dist.get_rank()
        out: list[Optional[dist.ProcessGroup]] = []
        for tie in ties:
            if tie.holders == everyone:
                out.append(group)
                continue
            chosen = None
            for ranks in sorted(set(pipelines)):
                holders = [ranks[s] for s in tie.holders]
                subgroup = dist.new_group(holders)
                if me in holders:
                    chosen = subgroup
            out.append(chosen)
        return out

    def set_aside_grads(self) -> list[Optional[torch.Tensor]]:
        """Take the copies' gradients aside (an accumulation window's earlier batches), leaving None."""
        earlier = []
        for _, param, _, _ in self.copies:
            earlier.append(param.grad)
            param.grad = None
        return earlier

    @torch.no_grad()
    def sum_grads(self, earlier: list[Optional[torch.Tensor]]) -> None:
        """Sum this batch's gradient of each copy over its holders, then add the earlier batches' back."""
        for (_, param, tie_group, _), before in zip(self.copies, earlier):
            new = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(_local_of(new), group=tie_group)
            if before is not None:
                before.add_(new)
                new = before
            param.grad = new


def _local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes land in it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _layout(param: torch.Tensor) -> str:
    """What must agree between two copies of a tied parameter for their shards to line up."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return (
            f"shape {tuple(param.shape)}, {param.dtype}, placements {tuple(map(str, param.placements))} over a mesh of "
            f"{tuple(param.device_mesh.shape)}, local shard {tuple(param.to_local().shape)}"
        )
    return f"shape {tuple(param.shape)}, {param.dtype}, whole on every rank"


def _whole_on_stage_leader(value: Any, leader: bool) -> Any:
    """One tensor made whole within its stage (a collective over the stage's ranks); kept on the CPU by the leader."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    elif not isinstance(value, torch.Tensor):
        return value if leader else None
    return value.detach().cpu().clone() if leader else None


def gather_stages_on_rank0(state: dict[str, Any], *, stage_leader: bool, pipeline_group: dist.ProcessGroup) -> list[dict[str, Any]]:
    """Every stage's ``state`` with whole CPU tensors, on global rank 0 (an empty list elsewhere).

    torch's ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` keeps whole tensors on
    global rank 0 only, which holds one stage; so here each tensor is gathered within its stage
    (one at a time, as torch does), kept by the stage's first data-parallel rank, and those ranks
    send their stage to rank 0 over the pipeline group. Rank 0 then holds the whole model, as a
    ``full`` checkpoint must; the others never do.

    Args:
        state: a model state dict, or an optimizer one (``{"state": {name: {entry: tensor}}, ...}``).
        stage_leader: this rank is its stage's first data-parallel rank (in rank 0's pipeline group).
    """
    if "state" in state and "param_groups" in state:
        mine: Any = {
            "state": {name: {k: _whole_on_stage_leader(v, stage_leader) for k, v in entries.items()} for name, entries in state["state"].items()},
            "param_groups": state["param_groups"],
        }
    else:
        mine = {key: _whole_on_stage_leader(value, stage_leader) for key, value in state.items()}
    if not stage_leader:
        return []
    stages: Optional[list[Any]] = [None] * dist.get_world_size(pipeline_group) if dist.get_rank() == 0 else None
    dist.gather_object(mine, stages, group=pipeline_group, group_dst=0)
    return stages or []
