"""The cluster, the batch, and the candidate plans a world size allows.

A candidate is one ``HSDPStrategy`` configuration (data-parallel mesh, TP and PP sizes,
``reshard_after_forward``, ``cpu_offload``, activation checkpointing). :func:`enumerate_candidates`
lists those :func:`hp_lightning.core.mesh.resolve_layout` accepts and drops, with the reason, the
ones the model cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hp_lightning.core.mesh import MeshLayout, resolve_layout
from hp_lightning.core.units import auto_units
from hp_lightning.parallel.tensor import hf_tp_plan, resolve_tp_plan

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Cluster:
    """The machines the plan is for.

    Attributes:
        nodes: number of nodes.
        devices: devices (ranks) per node.
        device_memory: bytes each device holds.
        intra_node_bandwidth / inter_node_bandwidth: bytes/s one rank can send over its link
            (NVLink-class inside a node, the NIC between nodes).
        latency_s: per-message latency (the alpha of the alpha-beta model), both link classes.
        device_flops: achieved FLOP/s of one device on the model's matmuls (not the datasheet peak).
        memory_bandwidth: bytes/s of device memory (the optimizer step is bound by it).
        host_bandwidth: bytes/s between host and device (what CPU offload pays per step).
        overlap: share (0..1) of the shorter of compute and communication hidden under the longer
            (0 on CPU ranks, where gloo computes on the same cores; ~0.7 for FSDP2 on GPUs).
    """

    nodes: int = 1
    devices: int = 8
    device_memory: float = 80e9
    intra_node_bandwidth: float = 300e9
    inter_node_bandwidth: float = 25e9
    latency_s: float = 20e-6
    device_flops: float = 400e12
    memory_bandwidth: float = 2e12
    host_bandwidth: float = 25e9
    overlap: float = 0.7

    def __post_init__(self) -> None:
        for name in ("nodes", "devices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster({name}=...) expects an int >= 1; got {value!r}.")
        for name in ("device_memory", "intra_node_bandwidth", "inter_node_bandwidth", "device_flops", "memory_bandwidth", "host_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Cluster({name}=...) expects a number > 0; got {value!r}.")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Cluster(overlap=...) expects a share in [0, 1]; got {self.overlap!r}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices

    def node_of(self, rank: int) -> int:
        return rank // self.devices


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``accumulation`` micro-batches of ``micro_batch`` sequences per data-parallel rank.

    Attributes:
        micro_batch: sequences per micro-batch and data-parallel rank (under PP: per pipeline
            micro-batch; the batch a stage reads is ``micro_batch x pipeline_microbatches``).
        seq_len: tokens per sequence.
        accumulation: micro-batches per optimizer step (Lightning's ``accumulate_grad_batches``).
        precision: ``"32"`` (fp32 compute), ``"bf16-mixed"`` (bf16 gathers and compute, fp32 reduce) or
            ``"bf16-true"`` (bf16 everywhere).
        optimizer: ``"adamw"`` (two moments per parameter) or ``"sgd"`` (none).
        pipeline_microbatches: micro-batches per pipeline step (None: as many as stages).
    """

    micro_batch: int = 1
    seq_len: int = 2048
    accumulation: int = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    pipeline_microbatches: int | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload({name}=...) expects an int >= 1; got {value!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Workload(precision=...) expects one of {list(PRECISIONS)}; got {self.precision!r}.")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"Workload(optimizer=...) expects 'adamw' or 'sgd'; got {self.optimizer!r}.")

    def pp_microbatches(self, pp: int) -> int:
        return self.pipeline_microbatches or pp


#: precision -> (param_dtype, reduce_dtype) strings of HSDPStrategy, and whether the master weights are bf16.
PRECISIONS: dict[str, tuple[str | None, str | None, bool]] = {
    "32": (None, None, False),
    "bf16-mixed": ("bf16", "fp32", False),
    "bf16-true": (None, None, True),
}


@dataclass(frozen=True)
class Candidate:
    """One strategy configuration (see the module docstring)."""

    mesh_shape: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    pipeline_split_points: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        dp = "HSDP " + "x".join(map(str, self.mesh_shape)) if len(self.mesh_shape) == 2 else f"FSDP {self.mesh_shape[0]}"
        parts = ([f"PP {self.pp}"] if self.pp > 1 else []) + [dp] + ([f"TP {self.tp}"] if self.tp > 1 else [])
        flags = ([] if self.reshard_after_forward else ["keep-gathered"]) + (["offload"] if self.cpu_offload else [])
        flags += ["AC"] if self.activation_checkpointing else []
        return " x ".join(parts) + (f" [{', '.join(flags)}]" if flags else "")

    def layout(self, cluster: Cluster) -> MeshLayout:
        return resolve_layout(
            list(self.mesh_shape), world_size=cluster.world_size, num_nodes=cluster.nodes, devices_per_node=cluster.devices,
            tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp,
        )

    def strategy_args(self, workload: Workload, tp_plan: dict[str, Any] | None, blocks: Sequence[str] | None) -> dict[str, Any]:
        """``HSDPStrategy`` init args for this candidate (what the YAML block and ``--validate`` use)."""
        param_dtype, reduce_dtype, _ = PRECISIONS[workload.precision]
        args: dict[str, Any] = {"mesh_shape": list(self.mesh_shape)}
        if self.tp > 1:
            args["tensor_parallel_size"] = self.tp
            if tp_plan:
                args["tp_plan"] = dict(tp_plan)
        if self.pp > 1:
            args["pipeline_parallel_size"] = self.pp
            args["pipeline_split_points"] = list(self.pipeline_split_points or ())
            args["pipeline_microbatches"] = workload.pp_microbatches(self.pp)
        if not self.reshard_after_forward:
            args["reshard_after_forward"] = False
        if self.cpu_offload:
            args["cpu_offload"] = True
        if self.activation_checkpointing and blocks:
            args["activation_checkpointing"] = list(blocks)
        if param_dtype:
            args["param_dtype"] = param_dtype
        if reduce_dtype:
            args["reduce_dtype"] = reduce_dtype
        return args


@dataclass(frozen=True)
class ModelFacts:
    """What candidate pruning needs to know about the model (read once, on the meta device).

    Attributes:
        block_names: the automatic sharding units (repeated blocks), in forward order.
        block_class: their class name (what ``activation_checkpointing`` names).
        tp_plan: the TP plan given or shipped with the model (None: TP not possible).
        tp_divisors: the TP sizes every planned layer's split dim divides.
        pipeline_ok: whether the model can be cut into stages (its forward skips missing pieces).
    """

    block_names: tuple[str, ...]
    block_class: str | None
    tp_plan: dict[str, Any] | None
    tp_divisors: frozenset[int] = field(default_factory=frozenset)
    pipeline_ok: bool = True


def model_facts(module: nn.Module, tp_plan: dict[str, Any] | None, *, pipeline_ok: bool, max_tp: int) -> ModelFacts:
    """Blocks, TP plan and the TP sizes the planned layers allow."""
    names = {id(m): n for n, m in module.named_modules()}
    blocks = list(reversed(auto_units(module)))
    block_names = tuple(names[id(b)] for b in blocks)
    block_class = type(blocks[0]).__name__ if blocks else None
    plan = dict(tp_plan) if tp_plan else (hf_tp_plan(module) or None)
    divisors: set[int] = set()
    if plan:
        try:
            resolved = resolve_tp_plan(module, plan, "planner tp_plan")
        except ValueError:
            resolved = {}
        weights = [getattr(module.get_submodule(name), "weight", None) for name in resolved]
        dims = [int(s) for weight in weights if weight is not None for s in weight.shape]
        heads = [getattr(getattr(m, "config", None), k, None) for m in module.modules() for k in ("num_attention_heads", "num_key_value_heads")]
        heads += [getattr(m, "n_head", None) for m in module.modules()] + [getattr(getattr(module, "hparams", {}), "get", lambda _k: None)("n_head")]
        dims += [h for h in heads if isinstance(h, int) and h > 0]
        divisors = {t for t in range(2, max_tp + 1) if dims and all(d % t == 0 for d in dims)}
    return ModelFacts(block_names, block_class, plan, frozenset(divisors), pipeline_ok and len(block_names) >= 2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_points(block_names: Sequence[str], stages: int) -> tuple[str, ...]:
    """Stage starts that give every stage an equal share of blocks (the first stage also holds the embeddings)."""
    n = len(block_names)
    return tuple(block_names[(i * n) // stages] for i in range(1, stages))


@dataclass(frozen=True)
class Search:
    """Which knobs the search varies (each a tuple of values to try).

    Attributes:
        reshard_after_forward / cpu_offload / activation_checkpointing: values tried.
        tp_sizes / pp_sizes: sizes tried (None: every size the world and the model allow).
        hsdp: also try HSDP shapes (``[R, S]``), not only FSDP ``[S]``.
    """

    reshard_after_forward: tuple[bool, ...] = (True, False)
    cpu_offload: tuple[bool, ...] = (False, True)
    activation_checkpointing: tuple[bool, ...] = (False, True)
    tp_sizes: tuple[int, ...] | None = None
    pp_sizes: tuple[int, ...] | None = None
    hsdp: bool = True


def enumerate_candidates(cluster: Cluster, facts: ModelFacts, search: Search | None = None) -> tuple[list[Candidate], list[str]]:
    """Every candidate the world and the model allow, and why the others were dropped.

    Returns:
        (candidates, pruned) where ``pruned`` holds one line per dropped family of candidates.
    """
    search = search or Search()
    world = cluster.world_size
    pruned: list[str] = []
    tps = [t for t in _divisors(cluster.devices) if search.tp_sizes is None or t in search.tp_sizes]
    pruned += [f"TP {t}: does not divide the {cluster.devices} devices of a node (a TP group would cross nodes)" for t in search.tp_sizes or () if t not in tps]
    kept_tps = []
    for t in tps:
        if t == 1:
            kept_tps.append(t)
        elif facts.tp_plan is None:
            pruned.append(f"TP {t}: the model has no TP plan (pass tp_plan, or a Hugging Face model with base_model_tp_plan)")
        elif t not in facts.tp_divisors:
            pruned.append(f"TP {t}: does not divide the split dims / heads of the planned layers")
        else:
            kept_tps.append(t)
    pps = [p for p in _divisors(world) if search.pp_sizes is None or p in search.pp_sizes]
    kept_pps = []
    for p in pps:
        if p == 1:
            kept_pps.append(p)
        elif not facts.pipeline_ok:
            pruned.append(f"PP {p}: the model cannot be cut into stages (its forward must skip the pieces a stage lacks; see hp_lightning.parallel.pipeline)")
        elif p > len(facts.block_names):
            pruned.append(f"PP {p}: more stages than the model's {len(facts.block_names)} blocks")
        else:
            kept_pps.append(p)
    out: list[Candidate] = []
    for pp in kept_pps:
        for tp in kept_tps:
            if pp > 1 and tp > 1:
                continue  # hp_lightning composes PP with FSDP/HSDP only (validate_parallel_sizes)
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            shapes: list[tuple[int, ...]] = [(dp,)]
            if search.hsdp:
                shapes += [(r, dp // r) for r in _divisors(dp) if 1 < r < dp]
            for shape in shapes:
                points = split_points(facts.block_names, pp) if pp > 1 else None
                base = Candidate(shape, tp, pp, pipeline_split_points=points)
                try:
                    base.layout(cluster)
                except ValueError as exc:
                    pruned.append(f"{base.name}: {exc}")
                    continue
                for reshard in search.reshard_after_forward:
                    for offload in search.cpu_offload:
                        for ac in search.activation_checkpointing:
                            if ac and not facts.block_names:
                                continue
                            out.append(Candidate(shape, tp, pp, reshard, offload, ac, points))
    return out, pruned
