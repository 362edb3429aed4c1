"""Pipeline parallelism (PP): each rank builds one stage of the model and runs it with ``torch.distributed.pipelining``.

The model is cut at *split points*, module names in its own hierarchy (``"net.blocks.2"`` starts
stage 1 at block 2). The cut follows torchtitan's convention, so parameter names never change and
a checkpoint of a pipelined run is keyed like one of the whole model:

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
  table kept in non-persistent buffers) stays on every stage;
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
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from hp_lightning.core import gradients
from hp_lightning.core.materialize import DetachedUnit, record_detached_units

#: Schedule names (YAML) to torch's schedule classes (one stage per rank).
SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def validate_split_points(split_points: Any, stages: int) -> Optional[list[str]]:
    """Check ``pipeline_split_points`` against ``pipeline_parallel_size`` before any process exists."""
    if split_points is None:
        if stages > 1:
            raise ValueError(
                f"HSDPStrategy(pipeline_parallel_size={stages}) needs pipeline_split_points: {stages - 1} module name(s) "
                f"where a stage starts; got None. Example for 2 stages: pipeline_split_points=['net.blocks.2']."
            )
        return None
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise TypeError(
            f"HSDPStrategy(pipeline_split_points=...) expects a list of module names; got "
            f"{type(split_points).__name__} {split_points!r}. Example: ['net.blocks.2']."
        )
    points = list(split_points)
    if any(not isinstance(p, str) or not p for p in points):
        raise TypeError(f"HSDPStrategy(pipeline_split_points=...) items must be non-empty module names; got {points!r}.")
    if len(points) != stages - 1:
        raise ValueError(
            f"HSDPStrategy(pipeline_parallel_size={stages}) cuts the model {stages - 1} time(s), so it needs "
            f"{stages - 1} split point(s); got {len(points)}: {points}."
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


def split_stage(model: nn.Module, split_points: Sequence[str], stage_index: int) -> tuple[list[str], list[str]]:
    """Cut ``model`` in place down to stage ``stage_index``; return (kept units, removed units).

    Also records on ``model`` the parameters tied across stages (:func:`tied_parameters`; the
    :class:`PipelineRunner` keeps their copies equal) and, when the model is still on the meta
    device, the units removed (so that materialization consumes the random-number generator as
    a build of the whole model does, and this stage's tensors get the values they get there).
    """
    units = stage_units(model, split_points)
    bounds = [0, *(units.index(p) for p in split_points), len(units)]
    model.__dict__[TIES_ATTR] = _find_ties(model, units, bounds)
    kept = units[bounds[stage_index] : bounds[stage_index + 1]]
    removed = []
    detached: list[DetachedUnit] = []
    kept_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False) if any(n.startswith(u + ".") for u in kept)}
    for name in units:
        if name in kept:
            continue
        module = model.get_submodule(name)
        if not module.state_dict():
            continue  # nothing a checkpoint holds (a loss, an activation, rotary tables): every stage keeps it
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
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


class _HeldEntries:
    """Mixin for a stage's ``ModuleList`` that lost entries: integer indices count the entries it holds.

    ``nn.ModuleList`` looks an integer index up by its key (``self.layers[0]`` is key ``"0"``);
    after a cut the first held entry may be ``"2"``. Iteration, ``len`` and slices already go by
    the held entries.
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
    """One rank's stage and schedule; :meth:`step` runs one batch through the pipeline (forward and backward).

    Args:
        stage_module: this rank's stage, the FSDP root (the schedule drives its gradient sync).
        loss_fn: ``(output, target) -> loss`` of one micro-batch, on the last stage.
        loss_scale: the loss each micro-batch's backward uses is ``loss / loss_scale`` (micro-batches
            times accumulated batches), so gradients sum to those of the mean loss.
    """

    def __init__(
        self,
        stage_module: nn.Module,
        *,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        replicated = [name or "(stage root)" for name, m in stage_module.named_modules() if getattr(m, "_hp_replicated", None) is not None]
        if replicated:
            raise ValueError(
                f"PipelineRunner needs a stage without replicate_params; got units with replicate_params at {replicated}. "
                f"torch's pipeline schedules turn gradient sync off for every micro-batch and reduce FSDP's gradients "
                f"themselves, so those parameters would never be all-reduced. Let fully_shard shard them under a pipeline."
            )
        self.stage_index, self.num_stages, self.microbatches, self.group = stage_index, num_stages, microbatches, group
        self.loss_scale = float(microbatches)
        self._loss_fn = loss_fn
        self._predicting = False
        self.stage = _TorchPipelineStage(stage_module, stage_index, num_stages, device, group=group)
        self.tied = TiedCopies(stage_module, stage_index=stage_index, num_stages=num_stages, group=group)
        # scale_grads=False: the loss is scaled instead, so gradients accumulated over Lightning's
        # accumulate_grad_batches are never divided twice.
        self.schedule = SCHEDULES[schedule](self.stage, n_microbatches=microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

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
        loss = self._share_loss(losses) if target is not None else None
        if outputs:
            box = [output if self.is_last else None]
            dist.broadcast_object_list(box, group=self.group, group_src=self.num_stages - 1)
            output = box[0]
        return loss, output

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the micro-batch losses, computed on the last stage and sent to every stage."""
        device = self.stage.device
        if self.is_last:
            loss = torch.stack([part.detach().float() for part in losses]).mean().to(device) * self.loss_scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        dist.broadcast(loss, group=self.group, group_src=self.num_stages - 1)
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
