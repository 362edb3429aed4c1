"""One simulated rank: hp_lightning's real recipe on a fake world, one step on fake tensors.

:func:`simulate_rank` builds the rank's mesh, model and stage with the strategy's own code on a
*fake* process group, applies :func:`hp_lightning.recipe.parallelize.parallelize` (nothing
re-derived), then runs two optimizer steps on *fake* tensors, counting every collective and every
storage (:class:`LiveBytes`); the second step is reported. Pipeline transfers, which a fake world
cannot pair, are added from the stage's output shape.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from hp_lightning.core import devices
from hp_lightning.core._torch_private import (  # fake process groups and fake tensors have no public home in torch yet
    TorchDispatchMode,
    data_dependent_errors,
    fake_process_group,
    fake_tensor_mode,
    local_tensor,
    tree_flatten,
)
from hp_lightning.core.accumulation import no_gradient_sync
from hp_lightning.core.diagnostics import CollectiveCall, CollectiveCounter
from hp_lightning.core.mesh import build_parallel_mesh
from hp_lightning.core.options import HSDPOptions
from hp_lightning.fully_shard.divergence import checked_slots
from hp_lightning.parallel.pipeline import hold_gathered, plan_cut
from hp_lightning.planner.candidates import PRECISIONS, Candidate, Cluster, ModelFacts, Workload
from hp_lightning.planner.model import ModelBuildError, ModelSpec, no_warnings, step_loss
from hp_lightning.recipe.parallelize import ShardingPlan, parallelize

if TYPE_CHECKING:
    import lightning.pytorch as pl


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive on this rank, and their peak, at op granularity.

    Every storage an op creates counts with its size until it dies. FSDP2 frees and re-allocates
    unsharded parameters by ``resize_`` (outside the dispatcher): those storages are marked with
    :meth:`track_resizable` and counted at their *current* size. Storages created before the mode
    are added with :meth:`track`. Works on fake tensors: their storages have sizes, not memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self._fixed: dict[int, tuple[weakref.ref, int]] = {}
        self._resizable: dict[int, weakref.ref] = {}
        self._fixed_total = 0
        self.peak = 0

    def _gone(self, key: int) -> None:
        self._untrack_fixed(key)
        self._resizable.pop(key, None)

    def _untrack_fixed(self, key: int) -> weakref.ref | None:
        entry = self._fixed.pop(key, None)
        if entry is None:
            return None
        self._fixed_total -= entry[1]
        return entry[0]

    @staticmethod
    def _storage(tensor: Any) -> Any:
        if isinstance(tensor, DTensor):
            tensor = local_tensor(tensor)
        return tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else None

    def track(self, tensor: Any) -> None:
        storage = self._storage(tensor)
        if storage is None:
            return
        key = id(storage)
        if key in self._fixed or key in self._resizable:
            return
        size = storage.nbytes()
        self._fixed[key] = (weakref.ref(storage, lambda _ref: self._gone(key)), size)
        self._fixed_total += size

    def track_resizable(self, tensor: Any) -> None:
        storage = self._storage(tensor)
        if storage is None:
            return
        key = id(storage)
        if key not in self._resizable:
            self._resizable[key] = self._untrack_fixed(key) or weakref.ref(storage, lambda _ref: self._gone(key))

    def now(self) -> int:
        storages = [ref() for ref in list(self._resizable.values())]
        return self._fixed_total + sum(storage.nbytes() for storage in storages if storage is not None)

    def watch_units(self, units: list[nn.Module]) -> list[Any]:
        """Mark each unit's unsharded parameters resizable when FSDP2 has gathered them (a pre-forward hook).

        Under TP those are DTensors whose local tensor is freed by ``resize_`` too: DTensors are marked as well.
        """

        def mark(unit: nn.Module, _args: Any) -> None:
            for module in unit.modules():
                for param in module._parameters.values():
                    if param is not None:
                        self.track_resizable(param)

        return [unit.register_forward_pre_hook(mark) for unit in units]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.track(tensor)
        self.peak = max(self.peak, self.now())
        return out


@dataclass
class RankRun:
    """What one simulated rank did in its steady-state optimizer step."""

    rank: int
    stage: int
    calls: list[CollectiveCall]
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    start_bytes: int  # live storage at the start of the step (parameters + optimizer state + kept buffers)
    peak_bytes: int  # live storage at the step's peak
    stage_numel: int  # parameters of this rank's stage, unsharded and before TP (for FLOPs)
    block_numel: int  # of those, inside the blocks (what activation checkpointing recomputes)
    divergence_slots: int  # parameters the strategy's per-step divergence check compares
    divergence_check: bool  # the options' divergence_check, as the strategy resolves it ("per_step")
    tokens: int  # tokens this rank processes per optimizer step
    gloo_peak_bytes: int = 0  # the peak on CPU ranks (gloo), whose collectives stage through temporaries


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def strategy_args_for(candidate: Candidate, workload: Workload, facts: ModelFacts, spec: ModelSpec) -> dict[str, Any]:
    """The ``HSDPStrategy`` arguments of a candidate, with the user's own strategy arguments kept."""
    args = {k: v for k, v in spec.strategy_args.items() if k not in _CANDIDATE_KEYS}
    args.update(candidate.strategy_args(workload, facts.tp_plan, [facts.block_class] if facts.block_class else None))
    return args


#: Strategy arguments a candidate decides (a YAML's own values for them are replaced).
_CANDIDATE_KEYS = {
    "mesh_shape", "tensor_parallel_size", "pipeline_parallel_size", "pipeline_split_points", "pipeline_microbatches",
    "reshard_after_forward", "cpu_offload", "activation_checkpointing", "param_dtype", "reduce_dtype", "tp_plan",
}


def schedule_order(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The forward ("F") and backward ("B") actions of one stage in torch's single-stage schedules."""
    if kind == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while True:
        order.append(("B", backward))
        backward += 1
        if forward == microbatches:
            break
        order.append(("F", forward))
        forward += 1
    order += [("B", i) for i in range(backward, microbatches)]
    return order


def simulate_rank(
    spec: ModelSpec,
    candidate: Candidate,
    cluster: Cluster,
    workload: Workload,
    facts: ModelFacts,
    rank: int,
    *,
    stage_input: tuple[tuple[int, ...], torch.dtype] | None = None,
) -> tuple[RankRun, tuple[tuple[int, ...], torch.dtype] | None]:
    """Simulate ``rank`` under ``candidate``; returns its run and (under PP) its stage's output shape and dtype.

    Raises:
        ModelBuildError: the model cannot be built, sharded or run on fake tensors (reason included).
    """
    args = strategy_args_for(candidate, workload, facts, spec)
    args.pop("cpu_offload", None)  # offload moves state to the host; collectives and shapes are the same
    options = HSDPOptions(**args)
    plan = ShardingPlan.of(options, device_type=devices.CPU)
    fake = fake_tensor_mode()
    with fake_process_group(rank, cluster.world_size), no_warnings():
        # The strategy's own steps: the mesh sizes from the options, the stage cut, the recipe, the pipeline's gathering.
        layout = options.layout(world_size=cluster.world_size, num_nodes=cluster.nodes, devices_per_node=cluster.devices)
        mesh = build_parallel_mesh(devices.CPU, layout)
        module = spec.build()
        if PRECISIONS[workload.precision][2]:
            module.to(torch.bfloat16)
        stage = mesh.pp.get_local_rank() if mesh.pp is not None else 0
        if candidate.pp > 1:
            plan_cut(module, options, stage).apply(module)
        unique = {id(p): p for p in module.parameters()}
        stage_numel = sum(p.numel() for p in unique.values())
        modules = dict(module.named_modules(remove_duplicate=False))
        block_ids = {id(p) for name in facts.block_names if name in modules for p in modules[name].parameters()}
        block_numel = sum(p.numel() for i, p in unique.items() if i in block_ids)
        try:
            sharded = parallelize(module, mesh, plan)
        except (ValueError, TypeError) as exc:
            raise ModelBuildError(f"{candidate.name}: hp_lightning refuses this plan for the model: {exc}") from exc
        if candidate.pp > 1:
            hold_gathered([module], options)
        slots = divergence_slots(module, sharded.replicated)
        with fake:
            module.to_empty(device=devices.cpu_device())
            trainable = [p for p in module.parameters() if p.requires_grad]
            optimizer = (torch.optim.AdamW if workload.optimizer == "adamw" else torch.optim.SGD)(trainable, lr=1e-3)
        live = LiveBytes()
        live.watch_units([module, *sharded.units])
        for t in [*module.parameters(), *module.buffers()]:
            live.track(t)
        vocab = spec.vocab_size(module)
        dp_batch = workload.micro_batch * (workload.pp_microbatches(candidate.pp) if candidate.pp > 1 else 1)
        counter = CollectiveCounter()
        gloo_peak = [0]  # the steady step's peak with gloo's staging buffers (see gloo_staging_bytes)
        counter.listeners.append(lambda call: gloo_peak.__setitem__(0, max(gloo_peak[0], live.now() + gloo_staging_bytes(call))))
        io_bytes = (0, 0)
        output_meta: tuple[tuple[int, ...], torch.dtype] | None = None
        try:
            for step in range(2):
                if step == 1:
                    counter.reset()
                    start = live.peak = live.now()
                    gloo_peak[0] = 0
                with counter, fake, live:
                    if candidate.pp > 1:
                        optimizer.zero_grad(set_to_none=True)  # the strategy drops a window's gradients before its schedule
                        io_bytes, output_meta = _pipeline_step(module, mesh, stage, candidate, workload, vocab, stage_input, options.pipeline_schedule)
                    else:
                        _plain_step(module, workload, vocab, optimizer)
                    optimizer.step()
        except data_dependent_errors() as exc:
            raise ModelBuildError(
                f"{candidate.name}: the model's step reads tensor values ({type(exc).__name__}: {exc}), which a fake-tensor "
                f"run cannot; the planner needs a forward/backward whose control flow does not depend on data."
            ) from exc
        # FSDP2's sharded gradients have the shape and dtype of the sharded parameters.
        params_bytes = sum(_local_bytes(p) for p in module.parameters())
        grads = sum(_local_bytes(p) for p in module.parameters() if p.requires_grad)
        optimizer_bytes = sum(
            _local_bytes(t) for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        run = RankRun(
            rank=rank, stage=stage, calls=list(counter.calls), params_bytes=params_bytes, grads_bytes=grads,
            optimizer_bytes=optimizer_bytes, start_bytes=start, peak_bytes=live.peak,
            gloo_peak_bytes=max(live.peak, gloo_peak[0]),
            stage_numel=stage_numel, block_numel=block_numel, divergence_slots=slots, divergence_check=options.divergence_check == "per_step",
            tokens=dp_batch * workload.seq_len * workload.accumulation,
        )
        if candidate.pp > 1:
            run.calls.extend(_pipeline_p2p(rank, stage, candidate.pp, cluster.world_size // candidate.pp, workload, io_bytes))
        return run, output_meta


def gloo_staging_bytes(call: CollectiveCall) -> int:
    """Heap gloo allocates, on top of the call's own tensors, while a collective of ``call`` runs on CPU.

    Measured on torch 2.13 (``docs/planning.md``): an all-gather assembles its output in a temporary;
    a reduce-scatter copies its whole input and reduces ring chunks of ``input / ranks``; an
    all-reduce works in chunks of ``tensor / ranks`` (``call.bytes`` is the larger tensor). On a GPU
    NCCL's buffers are its own: this counts only for a plan validated on CPU ranks.
    """
    ranks = max(len(call.ranks), 1)
    if call.kind == "all_gather":
        return call.bytes
    if call.kind == "reduce_scatter":
        return call.bytes + call.bytes // ranks
    if call.kind == "all_reduce":
        return call.bytes // ranks
    return 0


def divergence_slots(module: nn.Module, replicated: list[str]) -> int:
    """Parameters the strategy's divergence check compares (trainable sharded or replicate ones, once each).

    :mod:`hp_lightning.fully_shard.divergence`'s own rule: its per-step control all-reduce carries
    two flags per such parameter and the preemption signal.
    """
    return len(checked_slots(module, [], replicated))


def _tokens(workload: Workload, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, vocab, (batch, workload.seq_len)), torch.randint(0, vocab, (batch, workload.seq_len))


def _plain_step(module: pl.LightningModule, workload: Workload, vocab: int, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step's micro-batches as Lightning runs them.

    Gradients are dropped after the first forward, before its backward (Lightning's closure); no
    gradient sync before the window's last micro-batch.
    """
    for i in range(workload.accumulation):
        last = i == workload.accumulation - 1
        with nullcontext() if last else no_gradient_sync(module, "skip"):
            loss = step_loss(module, _tokens(workload, workload.micro_batch, vocab)) / workload.accumulation
            if i == 0:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()


def _pipeline_step(
    module: nn.Module, mesh: Any, stage: int, candidate: Candidate, workload: Workload, vocab: int,
    stage_input: tuple[tuple[int, ...], torch.dtype] | None, schedule: str,
) -> tuple[tuple[int, int], tuple[tuple[int, ...], torch.dtype]]:
    """One pipeline step of this stage: torch's schedule order, torch's stage gradient-sync calls."""
    if workload.accumulation != 1:
        raise ModelBuildError("The planner simulates pipeline steps without gradient accumulation; set accumulation=1 with PP.")
    stages = candidate.pp
    microbatches = workload.pp_microbatches(stages)
    torch_stage = PipelineStage(module, stage, stages, devices.cpu_device(), group=mesh.pp.get_group())
    # As torch's schedules run a stage: it has a backward (torch 2.15's perform_reduce_grad reduces FSDP's gradients
    # only then) and, where FSDP finalizes backward manually (2.15's FSDPModule.set_manual_backward_finalization,
    # which the stage turns on before each forward), that is on.
    torch_stage.has_backward = True
    manual_finalization = getattr(module, "set_manual_backward_finalization", None) if isinstance(module, FSDPModule) else None
    outputs: dict[int, Any] = {}
    inputs: dict[int, Any] = {}
    in_bytes = out_bytes = 0
    meta: tuple[tuple[int, ...], torch.dtype] = ((), torch.float32)
    order = schedule_order(schedule, stage, stages, microbatches)
    for action, index in order:
        if action == "F":
            if manual_finalization is not None:
                manual_finalization(True)
            if stage == 0:
                x, y = _tokens(workload, workload.micro_batch, vocab)
            else:
                assert stage_input is not None
                shape, dtype = stage_input
                x = torch.empty(shape, dtype=dtype).requires_grad_(True)
                _, y = _tokens(workload, workload.micro_batch, vocab)
                in_bytes = x.numel() * x.element_size()
            out = module(x)
            if stage == stages - 1:
                out = cast(Any, module).pipeline_loss(out, y) / microbatches  # the model's own hook (ModelSpec contract)
            else:
                out_bytes = out.numel() * out.element_size()
                meta = (tuple(out.shape), out.dtype)
            outputs[index], inputs[index] = out, x
        else:
            out, x = outputs.pop(index), inputs.pop(index)
            grads = None if stage == stages - 1 else torch.ones_like(out)
            values = [x] if stage > 0 else []
            torch_stage.backward_maybe_with_nosync(
                "full", {"stage_output": out, "output_grads": grads, "input_values": values}, last_backward=index == microbatches - 1
            )
    torch_stage.perform_reduce_grad(1)
    return (in_bytes, out_bytes), meta


def _pipeline_p2p(rank: int, stage: int, stages: int, stride: int, workload: Workload, io_bytes: tuple[int, int]) -> list[CollectiveCall]:
    """The sends and receives of one pipeline step: activations forward, their gradients back, per micro-batch."""
    microbatches = workload.pp_microbatches(stages)
    in_bytes, out_bytes = io_bytes
    calls: list[CollectiveCall] = []
    for _ in range(microbatches):
        if stage > 0:
            pair = tuple(sorted((rank, rank - stride)))
            calls += [CollectiveCall("recv", pair, in_bytes, torch.float32), CollectiveCall("send", pair, in_bytes, torch.float32)]
        if stage < stages - 1:
            pair = tuple(sorted((rank, rank + stride)))
            calls += [CollectiveCall("send", pair, out_bytes, torch.float32), CollectiveCall("recv", pair, out_bytes, torch.float32)]
    return calls

