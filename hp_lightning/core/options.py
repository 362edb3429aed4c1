"""The strategy options, written once: small frozen dataclasses grouped by owner, one flat constructor.

Each group (:data:`OPTION_GROUPS`: parallel sizes, sharding recipe, precision, checkpoints, faults,
pipeline) is a frozen, keyword-only dataclass. :class:`HSDPOptions` is every group at once, with flat
fields: ``HSDPOptions(mesh_shape=[2, 4], cpu_offload=True)`` is the constructor users, YAML and both
front ends share, and an ``HSDPOptions`` is also an instance of each group, so code that needs only
the checkpoint options can take a :class:`CheckpointOptions`.

Every value is checked and normalized at construction (in ``Trainer(...)`` / ``Fabric(...)``,
before any process or group exists). :meth:`HSDPOptions.layout` resolves the mesh sizes once for
a world; :meth:`HSDPOptions.settings` is what every rank must agree on before the mesh is built.

Each field is declared once, with :func:`option`: its annotation is what the resolved options hold
(``options.param_dtype`` is a ``torch.dtype``), ``accepts=`` what a user may pass, ``doc`` its
documentation, kept at run time (a ``.pyc``-only install has its ``--help`` too). Adding an option:
a field in the group that owns it (with a check in that group's ``_normalize``), the code that uses
it, then ``make generate`` (``scripts/generate.py``), which writes what derives from the fields.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from hp_lightning.core import replica_audit
from hp_lightning.core.accumulation import check_mode
from hp_lightning.core.checks import REDUCE_OPS, check_schedule, parse_dtype, validate_scaling_factor, validate_split_points, validate_tp_plan
from hp_lightning.core.checks import SCHEDULES as PIPELINE_SCHEDULES
from hp_lightning.core.fault_tolerance import FaultTolerance, check_accumulation_mode
from hp_lightning.core.mesh import MeshLayout, check_data_parallel_size, resolve_layout, validate_mesh_shape, validate_parallel_sizes
from hp_lightning.core.units import validate_unit_specs
from hp_lightning.core.watchdog import check_seconds

if TYPE_CHECKING:
    from typing import Unpack

    from hp_lightning.core.option_inputs import OptionInputs

STATE_DICT_TYPES = ("sharded", "full")
#: ``activation_checkpointing_mode``: what a checkpointed block recomputes.
CHECKPOINTING_MODES = ("full", "selective_op")
#: ``divergence_check``: compare what each rank's backward reaches before gradient collectives, or not.
DIVERGENCE_CHECKS = ("per_step", "off")
#: torch.distributed's default collective timeout (30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=30)


def option(default: object, doc: str, *, accepts: object = None) -> Any:
    """A strategy option: a dataclass field with its default (what a user may pass, normalized like any value), its
    documentation and, when a user may pass more than the normalized value's type (the field's annotation), the type
    of what they may pass (``accepts``)."""
    return field(default=default, metadata={"doc": " ".join(inspect.cleandoc(doc).split()), "accepts": accepts})


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"HSDPStrategy({name}=...) expects True or False; got {type(value).__name__} {value!r}.")
    return value


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"HSDPStrategy({name}=...) expects one of {list(choices)}; got {value!r}.")
    return value.lower()


def _check_divergence_check(value: Any) -> str:
    """``"per_step"`` or ``"off"``; YAML reads a bare ``off`` as False (and ``on`` as True), so the booleans mean the same."""
    if isinstance(value, bool):
        return "per_step" if value else "off"
    return _check_choice(value, "divergence_check", DIVERGENCE_CHECKS)


def _check_microbatches(value: Any, stages: int) -> int:
    """Micro-batches per batch; None: as many as stages (the least that keeps every stage busy in steady state)."""
    if value is None:
        return stages
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HSDPStrategy(pipeline_microbatches=...) expects an int >= 1 or None; got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"HSDPStrategy(pipeline_microbatches=...) expects an int >= 1 or None; got {value}.")
    return value


def _check_timeout(timeout: Any, name: str = "timeout") -> timedelta:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"HSDPStrategy({name}=...) expects seconds (a number) or a timedelta; got {type(timeout).__name__} {timeout!r}.")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"HSDPStrategy({name}=...) must be > 0 seconds; got {seconds}. Example: {name}=1800.")
    return timedelta(seconds=seconds)


def _check_patterns(patterns: Any, name: str) -> Optional[list[str]]:
    if patterns is None:
        return None
    if isinstance(patterns, str) or not isinstance(patterns, Sequence):
        raise TypeError(f"HSDPStrategy({name}=...) expects a list of strings; got {type(patterns).__name__} {patterns!r}. Example: {name}=['head.*'].")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise TypeError(f"HSDPStrategy({name}=...) items must be non-empty strings; got {p!r}.")
    return list(patterns)


def _check_placement(placement: Any) -> Optional[dict[str, int]]:
    if placement is None:
        return None
    if not isinstance(placement, Mapping):
        raise TypeError(f"HSDPStrategy(shard_placement=...) expects a mapping of parameter-name glob to dim; got {type(placement).__name__}. Example: {{'*.w2.weight': 1}}.")
    for pattern, dim in placement.items():
        if not isinstance(pattern, str) or isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"HSDPStrategy(shard_placement=...) maps strings to ints; got {pattern!r}: {dim!r}.")
    return dict(placement)


def _check_prefetch(prefetch: Any) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"HSDPStrategy(prefetch=...) expects an int >= 0 (0 = off); got {prefetch!r}.")
    return prefetch


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(f"HSDPStrategy({name}=...) expects an int >= 1; got {type(value).__name__} {value!r}.")
    return value


#: The keyword arguments of ``torch.compile`` the ``compile`` option passes on.
COMPILE_ARGUMENTS = ("backend", "mode", "fullgraph", "dynamic", "options")


def _check_compile(value: Any, done: Mapping[str, Any]) -> Union[bool, dict[str, Any]]:
    """``compile``: a bool or a mapping of ``torch.compile`` arguments; refused under PP and EP (not supported yet)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - set(COMPILE_ARGUMENTS))
        if unknown:
            raise ValueError(f"HSDPStrategy(compile={dict(value)!r}): unknown key(s) {unknown}; torch.compile takes {list(COMPILE_ARGUMENTS)}.")
        value = dict(value)
    elif not isinstance(value, bool):
        raise TypeError(
            f"HSDPStrategy(compile=...) expects True/False or a mapping of torch.compile arguments such as "
            f"{{'backend': 'inductor', 'fullgraph': True}}; got {type(value).__name__} {value!r}."
        )
    if value is not False:
        for name in ("pipeline_parallel_size", "expert_parallel_size"):
            if done.get(name, 1) > 1:
                raise ValueError(
                    f"HSDPStrategy(compile=...) with {name}={done[name]} is not supported yet: compile each stage's or expert "
                    f"block's forward yourself (module.compile()) or set compile=False."
                )
    return value


def _callable_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _check_parallelize_fn(fn: Any) -> Optional[Callable[[nn.Module, DeviceMesh], nn.Module]]:
    if fn is not None and not callable(fn):
        raise TypeError(
            f"HSDPStrategy(parallelize_fn=...) expects a callable (module, device_mesh) -> module, or None; got "
            f"{type(fn).__name__} {fn!r}."
        )
    return fn


def _check_backend(backend: Any) -> Optional[str]:
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"HSDPStrategy(process_group_backend=...) expects a string like 'gloo' or None; got {backend!r}.")
    return backend


class _OptionGroup:
    """What every group shares: normalization at construction, and the field documentation."""

    def __post_init__(self) -> None:
        values: dict[str, Any] = {}
        for group in _groups_of(type(self)):
            values.update(group._normalize(self, values))  # type: ignore[attr-defined]
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        """This group's fields, checked and normalized (``done``: the groups before it, for combined checks).

        A TypeError / ValueError names the option, what it expects, what it got.
        """
        return {}


def _groups_of(cls: type) -> list[type]:
    """The option groups ``cls`` is made of, in field order (for a group alone: itself)."""
    return [c for c in reversed(cls.__mro__) if issubclass(c, _OptionGroup) and c is not _OptionGroup and "_normalize" in c.__dict__]


@dataclass(frozen=True, kw_only=True)
class ParallelOptions(_OptionGroup):
    """How the world is cut: the data-parallel mesh, tensor, expert and pipeline parallel sizes, the backend."""

    mesh_shape: Optional[tuple[int, ...]] = option(None, accepts=Optional[Sequence[int]], doc="""
        The data-parallel dims. ``None``: HSDP ``(num_nodes, devices per node / tp)``; ``[N]``: FSDP
        over N ranks; ``[R, S]``: HSDP, R replicas of S shards, each shard group S consecutive ranks.
        One size may be ``-1`` (inferred from the world size): ``[-1]`` is FSDP over everything,
        ``[4, -1]`` four replicas. The product must equal the world size divided by
        ``tensor_parallel_size`` and ``pipeline_parallel_size``.""")

    data_parallel_size: Union[int, Literal["auto"], None] = option(None, """
        Lightning ``ModelParallelStrategy``'s mesh, for code written for it: dims
        ``("data_parallel", "tensor_parallel")``, 2-D even at ``tensor_parallel_size=1``, FSDP over
        ``data_parallel``; ``"auto"``: the world size over ``tensor_parallel_size``. A
        ``configure_model`` that slices ``self.device_mesh["data_parallel"]`` / ``["tensor_parallel"]``
        then runs unchanged. ``None`` (default): hp_lightning's mesh (``mesh_shape``; dims
        ``replicate``/``shard``/``tp``/``ep``/``pp``). Not with ``mesh_shape``, EP or PP.""")

    tensor_parallel_size: int = option(1, """
        Ranks per tensor-parallel group: the innermost mesh dim ``"tp"`` (consecutive ranks, one
        node). The ranks of a TP group see the same batch; the sampler splits data over the
        data-parallel ranks only. Must divide the devices per node (default mesh) or the world. 1 = off.""")

    expert_parallel_size: int = option(1, """
        Ranks the experts are split over: dim ``"ep"``, carved out of the shard dim (so EP ranks are
        data-parallel ranks, each with its own batch). Must divide the shard dim and the number of
        experts. Not combinable with ``tensor_parallel_size > 1`` yet. 1 = off.""")

    pipeline_parallel_size: int = option(1, """
        Pipeline stages: the outermost mesh dim ``"pp"``. Each rank builds only its stage (cut from
        the model at ``pipeline_split_points``, meta-initialized) and shards it over its own
        data-parallel sub-mesh; torch's ``PipelineStage`` and schedules run it inside the Trainer's
        step methods. The LightningModule provides ``forward`` (a stage's input to its output) and
        ``pipeline_loss(output, target)``; ``pipeline_batch(batch)`` may override the default
        ``(batch[0], batch[1])`` split into input and target. Trainer only (Fabric: a ValueError above
        1; build ``hp_lightning.PipelineStage`` yourself); not with TP/EP yet. Sharded checkpoints
        resume across pipeline sizes; a ``full`` one is gathered on rank 0 from every stage. 1 = off.""")

    tp_plan: Optional[dict[str, Union[str, ParallelStyle]]] = option(None, accepts=Optional[Mapping[str, Union[str, ParallelStyle]]], doc="""
        Module-name glob → style: ``colwise``, ``rowwise``, ``colwise_gather_output``,
        ``embedding_rowwise``, ``sequence_parallel`` (torch's ``ColwiseParallel`` / ``RowwiseParallel``
        / ``SequenceParallel``; Hugging Face's names), or a torch ``ParallelStyle`` from Python, applied
        before sharding. ``None``: the ``base_model_tp_plan`` of Hugging Face models inside the module.
        A pattern that matches nothing, an unknown style, or a colwise/rowwise style on a module that
        is not ``Linear``/``Embedding`` is an error. Unused at ``tensor_parallel_size=1``.""")

    parallelize_fn: Optional[Callable[[nn.Module, DeviceMesh], nn.Module]] = option(None, """
        Your own parallelization, as Lightning's Fabric ``ModelParallelStrategy(parallelize_fn=...)``
        takes it: called at setup as ``parallelize_fn(module, device_mesh)`` with the whole mesh
        (``self.device_mesh``), before hp_lightning shards what it left unsharded; it applies TP
        (``parallelize_module``) and/or ``fully_shard`` in place and returns the module (Fabric may
        return another one). From YAML: an import path (``my_pkg.parallel.apply_tp``). ``None``: only
        the strategy's own plan (the Trainer's ``configure_model`` does the same job).""")

    expert_modules: Optional[list[str]] = option(None, accepts=Optional[Sequence[str]], doc="""
        Module-name globs of grouped-experts modules (parameters ``[num_experts, ...]``, forward
        ``(tokens sorted by expert, counts per expert)``; see ``examples/moe.py``). ``None``:
        ``["*experts"]``. Unused at ``expert_parallel_size=1``.""")

    process_group_backend: Optional[str] = option(None, """
        ``None``: ``gloo`` on CPU, ``nccl`` on CUDA, ``hccl`` on Ascend NPU; under ``cpu_offload``
        gloo is added for host tensors (``"cpu:gloo,cuda:nccl"``).""")

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        tp, ep, pp = validate_parallel_sizes(self.tensor_parallel_size, self.expert_parallel_size, self.pipeline_parallel_size)
        return {
            "mesh_shape": validate_mesh_shape(self.mesh_shape),
            "data_parallel_size": check_data_parallel_size(
                self.data_parallel_size, mesh_shape=self.mesh_shape, expert_parallel_size=ep, pipeline_parallel_size=pp
            ),
            "tensor_parallel_size": tp,
            "expert_parallel_size": ep,
            "pipeline_parallel_size": pp,
            "tp_plan": validate_tp_plan(self.tp_plan),
            "parallelize_fn": _check_parallelize_fn(self.parallelize_fn),
            "expert_modules": _check_patterns(self.expert_modules, "expert_modules"),
            "process_group_backend": _check_backend(self.process_group_backend),
        }

    def layout(self, *, world_size: int, num_nodes: int, devices_per_node: int) -> MeshLayout:
        """The sizes of every mesh dim for this world: resolved once, then carried to the mesh and the recipe."""
        mesh_shape: Optional[Sequence[int]] = self.mesh_shape
        if mesh_shape is None and getattr(self, "fault_tolerance", None) is not None:
            mesh_shape = [world_size]  # a replica group shards over all its ranks; the groups replicate
        return resolve_layout(
            mesh_shape, world_size=world_size, num_nodes=num_nodes, devices_per_node=devices_per_node,
            tensor_parallel_size=self.tensor_parallel_size, expert_parallel_size=self.expert_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size, data_parallel_size=self.data_parallel_size,
        )


@dataclass(frozen=True, kw_only=True)
class ShardingOptions(_OptionGroup):
    """The recipe: which modules become units, where parameters live, how gradients reduce and accumulate."""

    shard_modules: Optional[list[Union[str, type]]] = option(None, accepts=Optional[Sequence[Union[str, type]]], doc="""
        The sharding units (classes, dotted class paths, class names or module-name globs): each is
        all-gathered in one call and reduce-scattered in one call. ``None``: the classes in HF's
        ``_no_split_modules`` when the model has it, else the blocks of every repeated
        ``nn.ModuleList``; then, with ``None`` only, LLM-aware units outside the blocks: all
        ``nn.Embedding`` s form one unit and the ``nn.Linear`` head with the norms after the last block
        another, each when its parameters reach half the median block's bytes and none is shared with
        a module outside the group (tied embeddings stay in the root). Everything else belongs to the
        root unit.""")

    reshard_after_forward: bool = option(True, """
        True: free each unit's gathered parameters after its forward (least memory; gathered again
        in backward). False: keep them until backward (one all-gather fewer per unit and step, the full
        unit resident). The root never reshards after forward.""")

    cpu_offload: bool = option(False, """
        Keep sharded parameters, gradients and optimizer state in host memory; each unit is copied
        to the device only while it computes. The optimizer step runs on the CPU.""")

    activation_checkpointing: Optional[list[Union[str, type]]] = option(None, accepts=Optional[Sequence[Union[str, type]]], doc="""
        Blocks (same forms as ``shard_modules``) whose activations are recomputed in backward
        instead of stored: one extra forward per block. State-dict keys do not change. Under a
        pipeline, this and every module spec or parameter glob below name the whole model: a stage
        applies the ones it holds, and only an entry that matches nothing anywhere is refused.""")

    activation_checkpointing_mode: Literal["full", "selective_op"] = option("full", """
        What the ``activation_checkpointing`` blocks recompute. ``"full"``: the whole block (only
        its input is kept; the least memory, one extra forward per block). ``"selective_op"``: torch's
        selective checkpointing with a policy that keeps the outputs of the expensive ops (matrix
        products, attention) and recomputes the cheap ones (norms, activations, elementwise):
        memory between none and full, step time close to none (torchtitan's op-level SAC).""")

    activation_checkpointing_every: int = option(1, """
        Checkpoint every N-th of the ``activation_checkpointing`` blocks, in model order, starting
        with the first (1: all of them): fewer recomputed blocks, more memory (torchtitan's selective
        layer checkpointing).""")

    compile: Union[bool, dict[str, Any]] = option(False, accepts=Union[bool, Mapping[str, Any]], doc="""
        ``torch.compile`` each block's ``forward`` (the sharding units the plan chooses, not the
        root): after TP and activation checkpointing, before sharding, as torchtitan does; FSDP's
        gather and free hooks stay outside the compiled region. ``True``: torch's defaults (inductor);
        a mapping: ``torch.compile``'s keyword arguments (``backend``, ``mode``, ``fullgraph``,
        ``dynamic``, ``options``). Module names and state-dict keys do not change (no
        ``_orig_mod.``). The first steps pay the compilation (seconds to minutes); a recompile
        after them would mean shapes or modes change every step. Not with pipeline or expert parallelism yet.""")

    ignored_params: Optional[list[str]] = option(None, accepts=Optional[Sequence[str]], doc="""
        Parameter-name globs left alone: not sharded, gradients **not** synchronized. For frozen
        parameters, or parameters each rank keeps for itself (a trainable one diverges across ranks).
        Every glob must match a parameter; none may be in ``replicate_params`` too.""")

    replicate_params: Optional[list[str]] = option(None, accepts=Optional[Sequence[str]], doc="""
        Parameter-name globs kept whole on every rank, gradients all-reduced DDP-style: for small
        parameters where a shard is not worth a collective (norms, biases). Not under a pipeline.""")

    comm_fusion: bool = option(False, """
        Bucket each unit's replicate-parameter all-reduces into one call.""")

    reduce_op: Literal["avg", "sum"] = option("avg", """
        ``"avg"``: gradients are the mean over data-parallel ranks (what single-process training
        with the global batch gives); ``"sum"``: their sum.""")

    gradient_scaling_factor: Optional[float] = option(None, """
        Multiply reduced gradients by this factor (``None``: off). Fixed for the run; the
        ``GradientScaling`` callback changes it per step.""")

    shard_placement: Optional[dict[str, int]] = option(None, accepts=Optional[Mapping[str, int]], doc="""
        Parameter-name glob → dimension to shard on (first matching glob wins); unmatched
        parameters shard on dim 0.""")

    prefetch: int = option(1, """
        Each unit all-gathers the next N units in forward and the previous N in backward,
        overlapping communication with compute; 0 leaves it to FSDP2's defaults.""")

    forward_methods: Optional[list[str]] = option(None, accepts=Optional[Sequence[str]], doc="""
        Methods that run the model outside the step methods (Trainer) or ``forward`` (Fabric), so
        the root's parameters are gathered when they are entered. ``generate`` is registered
        automatically when the module has it.""")

    accumulation_mode: Literal["skip", "every", "defer_all_reduce"] = option("skip", """
        What the non-final micro-batches of an accumulation window (Fabric: under
        ``fabric.no_backward_sync``) communicate: ``"skip"`` nothing (full-size gradients held between
        micro-batches), ``"every"`` reduce-scatter and all-reduce (sharded gradients only),
        ``"defer_all_reduce"`` reduce-scatter only (the HSDP all-reduce once per window). See
        :mod:`hp_lightning.core.accumulation`; the ``GradientAccumulationSync`` callback and
        ``strategy.set_accumulation_mode()`` change it later.""")

    meta_init: bool = option(True, """
        Build ``configure_model`` / ``trainer.init_module()`` / ``fabric.init_module()`` on the meta
        device, recording construction; after sharding, replay it (and the modules' own init rules) on
        the local shards, so the model never exists whole on a rank and equals a host-built one with
        the same seed; a tensor nothing initializes is an error at setup (see ``docs/models.md``).
        False: build on the host (every rank holds the whole model once).""")

    sharding_report: bool = option(False, """
        Log the per-unit sharding table (units, bytes per rank, placements, dtypes, offload,
        prefetch) on rank 0 at setup; the ``ShardingReport`` callback builds the same table.""")

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "shard_modules": validate_unit_specs(self.shard_modules, "shard_modules") or None,
            "reshard_after_forward": _check_bool(self.reshard_after_forward, "reshard_after_forward"),
            "cpu_offload": _check_bool(self.cpu_offload, "cpu_offload"),
            "activation_checkpointing": validate_unit_specs(self.activation_checkpointing, "activation_checkpointing") or None,
            "activation_checkpointing_mode": _check_choice(self.activation_checkpointing_mode, "activation_checkpointing_mode", CHECKPOINTING_MODES),
            "activation_checkpointing_every": _check_positive_int(self.activation_checkpointing_every, "activation_checkpointing_every"),
            "compile": _check_compile(self.compile, done),
            "ignored_params": _check_patterns(self.ignored_params, "ignored_params"),
            "replicate_params": _check_patterns(self.replicate_params, "replicate_params"),
            "comm_fusion": _check_bool(self.comm_fusion, "comm_fusion"),
            "reduce_op": _check_choice(self.reduce_op, "reduce_op", REDUCE_OPS),
            "gradient_scaling_factor": validate_scaling_factor(self.gradient_scaling_factor, "HSDPStrategy(gradient_scaling_factor=...)"),
            "shard_placement": _check_placement(self.shard_placement),
            "prefetch": _check_prefetch(self.prefetch),
            "forward_methods": _check_patterns(self.forward_methods, "forward_methods"),
            "accumulation_mode": check_mode(self.accumulation_mode, "HSDPStrategy(accumulation_mode=...)"),
            "meta_init": _check_bool(self.meta_init, "meta_init"),
            "sharding_report": _check_bool(self.sharding_report, "sharding_report"),
        }


@dataclass(frozen=True, kw_only=True)
class PrecisionOptions(_OptionGroup):
    """Dtypes of compute and gradient reduction, over what the front end's ``precision=`` implies."""

    param_dtype: Optional[torch.dtype] = option(None, accepts=Union[str, torch.dtype, None], doc="""
        Dtype of gathered parameters, i.e. of compute (``"bf16"``, ``"fp32"``, ...; a
        ``torch.dtype`` from Python). ``None``: from ``precision=`` (``bf16-mixed`` → bf16). Accepted:
        ``bf16``/``bfloat16``, ``fp16``/``float16``/``half``, ``fp32``/``float32``/``float``,
        ``fp64``/``float64``.""")

    reduce_dtype: Optional[torch.dtype] = option(None, accepts=Union[str, torch.dtype, None], doc="""
        Dtype gradients are reduced in. ``None``: from ``precision=`` (``bf16-mixed`` → fp32).""")

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "param_dtype": parse_dtype(self.param_dtype, name="param_dtype"),
            "reduce_dtype": parse_dtype(self.reduce_dtype, name="reduce_dtype"),
        }


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions(_OptionGroup):
    """What a save writes, how it is checked on resume, and how training data resumes."""

    state_dict_type: Literal["sharded", "full"] = option("sharded", """
        ``"sharded"``: a checkpoint is a directory, each rank writes its shards; loads into any world
        size and mesh. ``"full"``: one file rank 0 writes, gathered one parameter at a time; loads with
        ``LightningModule.load_from_checkpoint`` on one CPU process. ``python -m hp_lightning.checkpoint
        consolidate DIR OUT.ckpt`` turns a sharded directory into a full file.""")

    async_save: bool = option(False, """
        Sharded saves (Trainer: during ``fit``) return once the state is copied to host memory; a
        background thread writes the files and the checkpoint is published atomically when every
        rank's write is done. At most one save in flight: the next one (and a load) first waits for it.
        Trainer saves outside ``fit``, on preemption and at the end of ``fit`` are complete when they
        return. Needs ``state_dict_type="sharded"``.""")

    checkpoint_checksums: bool = option(False, """
        Sharded saves also record every file's SHA-256 (a read-back of the new files, spread over
        the ranks), and every resume checks every byte against them (a full read). False: the manifest
        records sizes, and a resume checks those and the manifest without reading the data (a
        same-size alteration is then not caught; ``python -m hp_lightning.checkpoint verify`` says
        which check it could make).""")

    resumable_dataloaders: bool = option(False, """
        Trainer: opt in to wrapping a plain sized training ``DataLoader`` in
        ``hp_lightning.ResumableLoader`` (said once in the log), so a run resumed mid-epoch continues
        its epoch. False: plain loaders restart their epoch on resume, as in Lightning. Recommended
        instead: torchdata's ``StatefulDataLoader``, checkpointed by Lightning itself and never
        wrapped. Fabric: put the loader in ``fabric.save``'s state.""")

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        values = {
            "state_dict_type": _check_choice(self.state_dict_type, "state_dict_type", STATE_DICT_TYPES),
            "async_save": _check_bool(self.async_save, "async_save"),
            "checkpoint_checksums": _check_bool(self.checkpoint_checksums, "checkpoint_checksums"),
            "resumable_dataloaders": _check_bool(self.resumable_dataloaders, "resumable_dataloaders"),
        }
        if values["async_save"] and values["state_dict_type"] != "sharded":
            raise ValueError(
                f"HSDPStrategy(async_save=True) writes sharded checkpoints in the background, but got state_dict_type="
                f"{values['state_dict_type']!r}, which gathers the whole state on rank 0 and writes one file. Use "
                f"state_dict_type='sharded' (convert afterwards with `python -m hp_lightning.checkpoint consolidate`), "
                f"or async_save=False."
            )
        return values


@dataclass(frozen=True, kw_only=True)
class FaultOptions(_OptionGroup):
    """Timeouts and what happens when a rank fails, is preempted or diverges."""

    timeout: timedelta = option(DEFAULT_TIMEOUT, accepts=Union[float, timedelta], doc="""
        Collective timeout, in seconds or as a ``timedelta``: until the first optimizer step, and for
        the whole run unless ``train_timeout`` is set.""")

    train_timeout: Optional[timedelta] = option(None, accepts=Union[float, timedelta, None], doc="""
        A shorter collective timeout from the first optimizer step on, once rendezvous, compilation
        and checkpoint loading are behind (as torchtitan does): a rank stuck in a collective ends the
        job in minutes. ``None`` keeps ``timeout``.""")

    fault_watchdog: bool = option(True, """
        When one rank fails (an exception, SIGKILL, the OOM killer, a frozen process), stop every
        rank within seconds: the failed rank with its own traceback, the others with one line naming
        it and exit code 3 (see :mod:`hp_lightning.core.watchdog`). A thread per rank: four small store
        operations a second, and a sleep on the local peers' pidfds that only their exit wakes (about
        1 ms of CPU a second, measured). Fabric stops it at interpreter exit or in ``teardown()``. False: a
        failure shows on the other ranks as a gloo/NCCL error, or as a hang until ``timeout``.""")

    heartbeat_timeout: float = option(120.0, """
        Seconds without a heartbeat before a rank counts as lost (frozen, deadlocked, host down).
        The heartbeat has its own thread, so long steps do not trip it; dead processes on the same
        host are found within a second regardless.""")

    failure_exit_grace: float = option(30.0, """
        Seconds a failed rank gets to print its traceback and exit; the others wait at most that
        long, and a failed process still kept alive by a non-daemon thread after it is ended.""")

    save_on_preemption: bool = option(False, """
        Trainer: on SIGTERM (preemption) every rank stops at the same batch at the end of its
        accumulation window (exit code 143); with True they first save ``last.ckpt`` in the
        ``ModelCheckpoint`` folder, which ``fit(ckpt_path="last")`` resumes exactly (see
        :mod:`hp_lightning.core.preemption`). Fabric accepts only False: a Fabric loop has no
        ModelCheckpoint to save to.""")

    divergence_check: Literal["per_step", "off"] = option("per_step", accepts=Union[Literal["per_step", "off"], bool], doc="""
        ``"per_step"``: before each backward that issues gradient collectives (under
        ``accumulation_mode="skip"`` the window's last; the others only record, locally), the ranks
        compare which units and parameters their backward passes reach, and a rank-dependent graph
        stops every rank with a ``RankDivergenceError`` naming them, instead of a hang or mixed
        gradients (see :mod:`hp_lightning.fully_shard.divergence`). Cost: a Python walk of the autograd
        graph per backward and two integers per parameter in the step's one control all-reduce
        (host-side gloo, shared with the preemption decision; ``docs/benchmarks.md``). ``"off"``: no
        walk, and the control all-reduce carries the preemption signal only. (YAML reads a bare
        ``off`` as False: False means ``"off"``, True ``"per_step"``.)""")

    replica_check_every: Optional[int] = option(None, """
        Replica audit: every N optimizer steps, right after the step, each rank checksums its local
        shards per sharding unit (the bits summed as integers, on the device) and the replicate dim
        compares them, so a replica corrupted silently (a flipped bit on one host) is found at the next
        check, naming the unit, the replicate ranks and the step (see
        :mod:`hp_lightning.core.replica_audit`). Cost per check: one read of the local shards, an
        all-gather of one int64 per unit over the replicate dim, a one-integer all-reduce over the
        world and one host read; nothing on the other steps. Needs an HSDP mesh with at least 2
        replicas. None (default): off.""")

    replica_check_action: Literal["raise", "warn"] = option("raise", """
        What a replica mismatch does: ``"raise"`` stops every rank with ``ReplicaMismatchError``
        at that step, before another checkpoint is written (resume from the last good one);
        ``"warn"`` warns on rank 0 and trains on.""")

    fault_tolerance: Optional[FaultTolerance] = option(None, accepts=Union[FaultTolerance, dict[str, Any], Literal["env"], None], doc="""
        Fault-tolerant HSDP on torchft (``pip install 'hp-lightning[ft]'``, :mod:`hp_lightning.ft`):
        this job is one *replica group*; it shards over its own ranks (a 1-D mesh), and torchft's
        Manager averages the gradients over the groups alive at each step, so a dead group costs the
        others one uncommitted step, not a restart, and a restarted group copies the whole training
        state from a live one. A dict of :class:`~hp_lightning.ft.FaultTolerance`'s fields
        (``{"replica_group": 0, "num_replica_groups": 2}``), or ``"env"``: read ``HP_FT_REPLICA_GROUP``,
        ``HP_FT_NUM_REPLICA_GROUPS`` (and ``HP_FT_MIN_REPLICAS``) when the strategy is built, so one
        config serves every group (the registered name ``hsdp_ft``). Not yet with TP, EP, PP, a 2-D
        mesh or ``replicate_params``; needs ``accumulation_mode="skip"`` (one cross-group average per
        accumulation window). Cost: a quorum and a commit vote per optimizer step (see
        ``docs/fault-tolerance.md``).""")

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "fault_tolerance": _check_fault_tolerance(self.fault_tolerance, done),
            "timeout": _check_timeout(self.timeout),
            "train_timeout": None if self.train_timeout is None else _check_timeout(self.train_timeout, "train_timeout"),
            "fault_watchdog": _check_bool(self.fault_watchdog, "fault_watchdog"),
            "heartbeat_timeout": check_seconds(self.heartbeat_timeout, "heartbeat_timeout", "HSDPStrategy"),
            "failure_exit_grace": check_seconds(self.failure_exit_grace, "failure_exit_grace", "HSDPStrategy"),
            "save_on_preemption": _check_bool(self.save_on_preemption, "save_on_preemption"),
            "divergence_check": _check_divergence_check(self.divergence_check),
            "replica_check_every": replica_audit.check_every(self.replica_check_every),
            "replica_check_action": replica_audit.check_action(self.replica_check_action),
        }


def _check_fault_tolerance(value: Any, done: Mapping[str, Any]) -> Optional[FaultTolerance]:
    """The option resolved (``"env"`` read now), and the layouts torchft's replicate all-reduce cannot serve refused."""
    config = FaultTolerance.from_value(value)
    if config is None:
        return None
    composed = [f"{name}={done[name]}" for name in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size") if done.get(name, 1) != 1]
    if done.get("data_parallel_size") is not None:
        composed.append(f"data_parallel_size={done['data_parallel_size']!r}")
    mesh = done.get("mesh_shape")
    if mesh is not None and (len(mesh) > 2 or (len(mesh) == 2 and mesh[0] != 1)):
        composed.append(f"mesh_shape={list(mesh)}")
    if done.get("replicate_params"):
        composed.append(f"replicate_params={list(done['replicate_params'])}")
    if composed:
        raise ValueError(
            f"HSDPStrategy(fault_tolerance=...) shards inside each replica group over a 1-D mesh and replicates across "
            f"groups through torchft; it does not support {', '.join(composed)} yet. Drop those (one replica group per "
            f"job, mesh_shape=None or [-1]), or train without fault_tolerance."
        )
    check_accumulation_mode(done.get("accumulation_mode", "skip"))
    return config


@dataclass(frozen=True, kw_only=True)
class PipelineOptions(_OptionGroup):
    """How the model is cut into ``pipeline_parallel_size`` stages and how the schedule runs them."""

    pipeline_split_points: Union[Literal["auto"], list[str], None] = option(None, accepts=Union[Literal["auto"], Sequence[str], None], doc="""
        Module names where stages 1, 2, ... start (``["net.blocks.2"]``); ``P x V - 1`` of them, in
        the model's order. ``"auto"`` (also what ``None`` means under a pipeline): cut the model's list
        of blocks (a decoder's ``layers``, a GPT's ``blocks``) so that the largest stage holds the
        fewest parameter bytes, embeddings counted on the first stage and the final norm and head on
        the last; computed at setup from the (meta-device) model, the same on every rank, and shown by
        ``sharding_report``. A stage keeps its modules under their own names; the others are deleted
        from a ``ModuleList`` / ``Sequential`` / ``ModuleDict`` and become ``None`` elsewhere, so
        ``forward`` must skip a ``None`` module (torchtitan's convention; see
        :mod:`hp_lightning.parallel.pipeline`).""")

    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"] = option("1f1b", """
        torch's schedule: ``1f1b`` (at most ``stages`` micro-batches of activations alive),
        ``gpipe`` (all forwards, then all backwards), both one stage per rank; with several stages
        per rank (``pipeline_stages_per_rank``) ``interleaved_1f1b``, ``looped_bfs``,
        ``interleaved_zb`` (loop placement: rank ``r`` holds stages ``r, r + P, ...``) and ``zbv``,
        ``dualpipev`` (exactly 2 per rank, V placement: ``r`` and ``2P - 1 - r``). Interleaving
        shrinks the bubble about ``V`` times; the zero-bubble ones fill it with weight gradients
        (see :mod:`hp_lightning.parallel.pipeline_schedules`).""")

    pipeline_stages_per_rank: int = option(1, """
        Virtual stages per rank ``V``: the model is cut into ``pipeline_parallel_size x V`` stages
        (so ``P V - 1`` split points), each its own FSDP root. 1 for ``gpipe`` / ``1f1b``, 2 for
        ``zbv`` / ``dualpipev``, any for the others. More stages: a smaller bubble, more sends.""")

    pipeline_microbatches: int = option(None, accepts=Optional[int], doc="""
        Micro-batches per batch (``None``: as many as stages, ``P x V``); the per-rank batch must
        divide by it. More shrink the bubble, ``(stages - 1) / (microbatches + stages - 1)`` of each
        step for 1F1B.""")

    pipeline_keep_gathered: bool = option(True, """
        Under PP, keep each stage's parameters gathered from the first micro-batch's forward to the
        step's gradient reduction: one all-gather and one reduce-scatter per unit per step, whatever
        the micro-batch count (torch's schedules already reduce gradients once, after the last
        micro-batch). Costs the stage's unsharded parameters for the whole step (about the stage's
        parameter bytes x (1 - 1/shard size) more than sharded). False: units reshard after each
        micro-batch's forward as ``reshard_after_forward`` says, and all-gather again for its
        backward: all-gathers grow with the micro-batch count, peak memory drops to one unit.""")

    def _normalize(self, done: Mapping[str, Any]) -> dict[str, Any]:
        pp = done.get("pipeline_parallel_size", 1)
        if pp > 1 and done.get("replicate_params"):
            raise ValueError(
                f"HSDPStrategy(replicate_params=...) needs pipeline_parallel_size=1; got replicate_params="
                f"{list(done['replicate_params'])} with pipeline_parallel_size={pp}. torch's pipeline schedules turn "
                f"gradient sync off for every micro-batch and reduce FSDP's gradients themselves, so replicate parameters "
                f"would never be all-reduced (each rank would train its own copy). Let FSDP shard them under a pipeline."
            )
        schedule = _check_choice(self.pipeline_schedule, "pipeline_schedule", tuple(PIPELINE_SCHEDULES))
        per_rank = self.pipeline_stages_per_rank
        if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1:
            raise ValueError(f"HSDPStrategy(pipeline_stages_per_rank=...) expects an int >= 1; got {per_rank!r}.")
        microbatches = _check_microbatches(self.pipeline_microbatches, pp * per_rank if pp > 1 else 1)
        check_schedule(schedule, pp, per_rank, microbatches)
        return {
            "pipeline_split_points": validate_split_points(self.pipeline_split_points, pp, per_rank),
            "pipeline_schedule": schedule,
            "pipeline_stages_per_rank": per_rank,
            "pipeline_microbatches": microbatches,
            "pipeline_keep_gathered": _check_bool(self.pipeline_keep_gathered, "pipeline_keep_gathered"),
        }


#: The groups, in the order their fields appear (and are checked: later groups may read earlier ones).
OPTION_GROUPS: tuple[type[_OptionGroup], ...] = (
    ParallelOptions, ShardingOptions, PrecisionOptions, CheckpointOptions, FaultOptions, PipelineOptions,
)


@dataclass(frozen=True, kw_only=True)
class HSDPOptions(PipelineOptions, FaultOptions, CheckpointOptions, PrecisionOptions, ShardingOptions, ParallelOptions):
    """Every option of both front ends' ``HSDPStrategy``, flat: ``HSDPOptions(mesh_shape=[2, 4], ...)``.

    An instance of every group (:data:`OPTION_GROUPS`); fields in the groups' order. Each field's
    meaning is its docstring (:func:`field_docs`). It takes what a user may pass
    (:func:`input_types`), raising TypeError / ValueError on construction for a wrong one, and
    holds the normalized values (:func:`field_types`).
    """

    if TYPE_CHECKING:  # what type checkers read; at run time the dataclass's own __init__ (the same keywords)

        def __init__(self, **options: Unpack[OptionInputs]) -> None: ...

    def settings(self, owner: str = "HSDPStrategy") -> dict[str, Any]:
        """Every option as ``"HSDPStrategy(name=...)" -> value``: what all ranks must agree on."""
        settings = {f"{owner}({f.name}=...)": getattr(self, f.name) for f in fields(self)}
        # Callables compare by name: a function's repr holds an address, different in each process.
        if self.parallelize_fn is not None:
            settings[f"{owner}(parallelize_fn=...)"] = _callable_name(self.parallelize_fn)
        if isinstance(self.compile, Mapping):
            settings[f"{owner}(compile=...)"] = {k: _callable_name(v) if callable(v) else v for k, v in self.compile.items()}
        if self.tp_plan:  # style objects compare by name: their default repr holds an address
            settings[f"{owner}(tp_plan=...)"] = {k: v if isinstance(v, str) else type(v).__name__ for k, v in self.tp_plan.items()}
        return settings


# ------------------------------------------------------------------ the field documentation and types


@cache
def field_docs(cls: type = HSDPOptions) -> dict[str, str]:
    """Each field's documentation (``option(..., doc)``), by name, in field order, whitespace folded.

    The front ends' constructor docstrings (what ``--help`` shows) and ``docs/configuration.md`` are built from it.
    """
    return {f.name: f.metadata["doc"] for f in fields(cls)}


@cache
def field_types(cls: type = HSDPOptions) -> dict[str, Any]:
    """Each field's annotation, resolved: the type of the normalized value an ``HSDPOptions`` holds."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


@cache
def input_types(cls: type = HSDPOptions) -> dict[str, Any]:
    """What a user may pass for each field (``accepts``, else the field's type): the front ends' constructors' annotations."""
    stored = field_types(cls)
    return {f.name: stored[f.name] if f.metadata["accepts"] is None else f.metadata["accepts"] for f in fields(cls)}


def option_parameters(cls: type = HSDPOptions) -> list[inspect.Parameter]:
    """Every option as a keyword-only parameter (what a user may pass, and the default): the constructors' signatures at run time."""
    types = input_types(cls)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name]) for f in fields(cls)]


def group_of(name: str) -> type:
    """The option group that owns field ``name``."""
    for group in OPTION_GROUPS:
        if name in group.__dataclass_fields__:  # type: ignore[attr-defined]
            return group
    raise KeyError(name)
