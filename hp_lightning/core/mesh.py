"""Device meshes: FSDP (1-D), HSDP (2-D ``(replicate, shard)``) and their compositions with TP and EP.

The axis names live here and only here. Rank ``r`` of an HSDP mesh ``(R, S)`` sits at
``(r // S, r % S)``: each shard group is ``S`` consecutive ranks, which with ``S`` equal to the
devices per node keeps every all-gather and reduce-scatter inside one node and sends only the
gradient all-reduce across nodes.

Composed meshes (:class:`MeshLayout`) order their named dims outermost to innermost::

    ("pp",)  ("replicate",)  ("shard",) | ("expert_shard", "ep")  ("tp",)
    next      across nodes    inside a node                        fastest links

TP is innermost, so a TP group is consecutive ranks (one node). EP is carved out of the shard
dim, as torchtitan does: the ``ep`` ranks are data-parallel ranks too (each sees its own batch),
and ``shard`` is the flattened ``(expert_shard, ep)``; experts shard over ``(replicate,
expert_shard)``. ``pp`` is outermost: each stage is a block of consecutive ranks with a whole
data-parallel mesh of its own. A size-1 ``pp``/``tp``/``ep`` dim is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import cast, overload

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

from hp_lightning.core import devices
from hp_lightning.core._torch_private import flatten_mesh
from hp_lightning.core._torch_private import set_collective_timeout as set_group_timeout

REPLICATE_DIM = "replicate"
SHARD_DIM = "shard"
FSDP_DIM_NAMES: tuple[str] = (SHARD_DIM,)
HSDP_DIM_NAMES: tuple[str, str] = (REPLICATE_DIM, SHARD_DIM)
TP_DIM = "tp"
EP_DIM = "ep"
PP_DIM = "pp"
#: The part of the shard dim that is not expert-parallel: experts shard over it.
EXPERT_SHARD_DIM = "expert_shard"
#: A flattened dim over every data-parallel rank (for sampler ranks and ``sync_dist`` reductions).
DP_DIM = "dp"
#: Lightning ``ModelParallelStrategy``'s dim names: ``(data_parallel, tensor_parallel)``, always 2-D.
#: A mesh gets them with ``data_parallel_size`` (:class:`MeshLayout` ``lightning_names``).
LIGHTNING_DP_DIM = "data_parallel"
LIGHTNING_TP_DIM = "tensor_parallel"
#: The names a tensor-parallel dim goes by: TP applied by hand is recognized on either.
TP_DIM_NAMES: frozenset[str] = frozenset({TP_DIM, LIGHTNING_TP_DIM})
#: Dims that split a parameter's tensor itself (not data parallelism).
MODEL_PARALLEL_DIM_NAMES: frozenset[str] = TP_DIM_NAMES | {EP_DIM}

#: A mesh size of -1 means "whatever makes the product equal the world size" (as in reshape).
INFER = -1


@overload
def validate_mesh_shape(mesh_shape: None) -> None: ...
@overload
def validate_mesh_shape(mesh_shape: Sequence[int]) -> tuple[int, ...]: ...
def validate_mesh_shape(mesh_shape: Sequence[int] | None) -> tuple[int, ...] | None:
    """Check a user's ``mesh_shape`` for type and form, before any process exists.

    Accepts None (automatic HSDP ``(num_nodes, devices_per_node)``), ``(N,)`` (FSDP) or ``(R, S)``
    (HSDP), where at most one size may be -1 (inferred from the world size).
    """
    if mesh_shape is None:
        return None
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
        raise TypeError(
            f"mesh_shape must be None, (shard,) or (replicate, shard) as a list/tuple of ints; got "
            f"{type(mesh_shape).__name__} {mesh_shape!r}. Example: mesh_shape=[2, 4]."
        )
    for size in mesh_shape:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"mesh_shape sizes must be ints; got {type(size).__name__} {size!r} in {list(mesh_shape)}.")
    shape = tuple(mesh_shape)
    if len(shape) not in (1, 2):
        raise ValueError(
            f"mesh_shape must have 1 dim (FSDP) or 2 dims (replicate, shard) for HSDP; got {len(shape)} "
            f"dims {list(shape)}. For FSDP over all ranks use [-1]; for HSDP across nodes [num_nodes, -1]."
        )
    if any(size < 1 and size != INFER for size in shape):
        raise ValueError(
            f"mesh_shape sizes must be >= 1 (or -1 to infer one size); got {list(shape)}. "
            f"Example: [2, 4] for 2 replicas of 4 shards."
        )
    if shape.count(INFER) > 1:
        raise ValueError(f"mesh_shape may infer (-1) at most one size; got {list(shape)}. Fix one of them, e.g. [2, -1].")
    return shape


def resolve_mesh_shape(mesh_shape: Sequence[int] | None, *, world_size: int, num_nodes: int, devices_per_node: int) -> tuple[int, ...]:
    """Turn a validated ``mesh_shape`` into concrete sizes whose product is the world size (else a ValueError)."""
    shape = validate_mesh_shape(mesh_shape)
    if shape is None:
        shape = (num_nodes, devices_per_node)
    if INFER in shape:
        known = math.prod(size for size in shape if size != INFER)
        if world_size % known:
            raise ValueError(
                f"mesh_shape {list(shape)} cannot cover world size {world_size}: {known} does not divide it. "
                f"Choose sizes whose product is {world_size}."
            )
        shape = tuple(world_size // known if size == INFER else size for size in shape)
    product = math.prod(shape)
    if product != world_size:
        names = " x ".join(dim_names_for(shape))
        raise ValueError(
            f"mesh_shape {list(shape)} needs {names} == world size {world_size}; got {product}. "
            f"Use sizes that multiply to {world_size} (for example [{num_nodes}, {world_size // max(num_nodes, 1)}]), "
            f"or -1 for one size to infer it."
        )
    return shape


def dim_names_for(shape: Sequence[int]) -> tuple[str, ...]:
    return HSDP_DIM_NAMES if len(shape) == 2 else FSDP_DIM_NAMES


def default_device_type() -> str:
    """The device type of the current accelerator when there is one, else the CPU."""
    return devices.current_accelerator_type()


def build_device_mesh(device_type: str, shape: Sequence[int]) -> DeviceMesh:
    """Create the data-parallel mesh over the default process group (a collective call)."""
    return _build_mesh(device_type, tuple(shape), dim_names_for(shape))


def _build_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A mesh over the default process group (a collective call); a ValueError when the shape does not match the world."""
    if math.prod(shape) != dist.get_world_size():
        raise ValueError(f"A mesh of shape {list(shape)} needs world size {math.prod(shape)}; the process group has {dist.get_world_size()}.")
    return _torch_init_device_mesh(device_type, shape, mesh_dim_names=names)


def init_device_mesh(device_type: str | None = None, mesh_shape: Sequence[int] = (), *, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """The seed's ``init_device_mesh(device_type, mesh_shape, mesh_dim_names=...)``.

    ``device_type=None`` picks the current accelerator (or the CPU); names default to
    ``("shard",)`` for 1-D and ``("replicate", "shard")`` for 2-D meshes.
    """
    shape = validate_mesh_shape(mesh_shape) if len(mesh_shape) <= 2 else tuple(mesh_shape)
    if shape is None or INFER in shape:
        raise ValueError(f"init_device_mesh expects explicit sizes >= 1; got {mesh_shape!r}. Example: (2, 4).")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else dim_names_for(shape)
    return _torch_init_device_mesh(device_type or default_device_type(), tuple(shape), mesh_dim_names=names)


def _check_parallel_size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HSDPStrategy({name}=...) expects an int >= 1; got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"HSDPStrategy({name}=...) expects an int >= 1 (1 = off); got {value}.")
    return value


def validate_parallel_sizes(tensor_parallel_size: object, expert_parallel_size: object, pipeline_parallel_size: object = 1) -> tuple[int, int, int]:
    """Check the TP, EP and PP sizes for type and range, before any process exists."""
    tp = _check_parallel_size(tensor_parallel_size, "tensor_parallel_size")
    ep = _check_parallel_size(expert_parallel_size, "expert_parallel_size")
    pp = _check_parallel_size(pipeline_parallel_size, "pipeline_parallel_size")
    if tp > 1 and ep > 1:
        raise ValueError(
            f"HSDPStrategy(tensor_parallel_size={tp}, expert_parallel_size={ep}): TP and EP in one model are not "
            f"supported yet (experts would need their own TP plan). Use one of them with FSDP/HSDP."
        )
    if pp > 1 and (tp > 1 or ep > 1):
        raise ValueError(
            f"HSDPStrategy(...) got pipeline_parallel_size={pp} with tensor_parallel_size={tp}, expert_parallel_size={ep}: "
            f"pipeline parallelism composes with FSDP/HSDP only so far; TP or EP inside a stage is not supported yet. Set "
            f"tensor_parallel_size=1 and expert_parallel_size=1, or pipeline_parallel_size=1."
        )
    return tp, ep, pp


@dataclass(frozen=True)
class MeshLayout:
    """Concrete sizes of every parallelism; the product is the world size.

    Attributes:
        dp: the data-parallel shape, ``(S,)`` (FSDP) or ``(R, S)`` (HSDP).
        tp: tensor-parallel size (ranks of one TP group see the same batch).
        ep: expert-parallel size, a divisor of ``S`` (EP ranks are data-parallel ranks).
        pp: pipeline stages (outermost; each stage has the whole ``dp`` mesh).
        lightning_names: Lightning ``ModelParallelStrategy``'s mesh: dims ``("data_parallel",
            "tensor_parallel")``, 2-D even when ``tp`` is 1 (``dp`` 1-D, no EP/PP).
    """

    dp: tuple[int, ...]
    tp: int = 1
    ep: int = 1
    pp: int = 1
    lightning_names: bool = False

    @property
    def dp_size(self) -> int:
        return math.prod(self.dp)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp * self.pp

    @property
    def composed(self) -> bool:
        """Whether the root mesh has dims beyond the data-parallel ones."""
        return self.tp > 1 or self.ep > 1 or self.pp > 1 or self.lightning_names

    @property
    def dp_names(self) -> tuple[str, ...]:
        """The root mesh's data-parallel dims (what FSDP shards over)."""
        return (LIGHTNING_DP_DIM,) if self.lightning_names else dim_names_for(self.dp)

    @property
    def names(self) -> tuple[str, ...]:
        """Dim names of the root mesh, outermost first."""
        if self.lightning_names:
            return (LIGHTNING_DP_DIM, LIGHTNING_TP_DIM)
        names = [PP_DIM] if self.pp > 1 else []
        names += [REPLICATE_DIM] if len(self.dp) == 2 else []
        names += [EXPERT_SHARD_DIM, EP_DIM] if self.ep > 1 else [SHARD_DIM]
        return (*names, *([TP_DIM] if self.tp > 1 else []))

    @property
    def shape(self) -> tuple[int, ...]:
        if self.lightning_names:
            return (self.dp_size, self.tp)
        shape = [self.pp] if self.pp > 1 else []
        shape += [self.dp[0]] if len(self.dp) == 2 else []
        shape += [self.dp[-1] // self.ep, self.ep] if self.ep > 1 else [self.dp[-1]]
        return (*shape, *([self.tp] if self.tp > 1 else []))


def resolve_layout(
    mesh_shape: Sequence[int] | None,
    *,
    world_size: int,
    num_nodes: int,
    devices_per_node: int,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int | str | None = None,
) -> MeshLayout:
    """Concrete sizes of every dim for this world, or the error saying which size to change.

    ``data_parallel_size`` (an int or ``"auto"``: the world over ``tensor_parallel_size``) asks
    for Lightning ``ModelParallelStrategy``'s mesh instead: ``(data_parallel, tensor_parallel)``.

    ``mesh_shape`` describes the data-parallel dims only: their product is the world size divided
    by ``tensor_parallel_size`` and ``pipeline_parallel_size``; None is HSDP
    ``(num_nodes, devices_per_node / tp)`` (FSDP over ``world / pp`` ranks under PP).
    """
    tp, ep, pp = validate_parallel_sizes(tensor_parallel_size, expert_parallel_size, pipeline_parallel_size)
    if data_parallel_size is not None:
        return _lightning_layout(data_parallel_size, tp, world_size)
    for name, size, choice in (
        ("tensor_parallel_size", tp, "a TP size that divides the devices per node"),
        ("pipeline_parallel_size", pp, "a number of stages that divides it"),
    ):
        if world_size % size:
            raise ValueError(
                f"{name}={size} does not divide the world size {world_size} ({num_nodes} node(s) x "
                f"{devices_per_node} device(s)). Choose {choice}, e.g. 2."
            )
    dp_world = world_size // tp // pp
    if mesh_shape is not None and (tp > 1 or pp > 1):
        _check_composed_product(validate_mesh_shape(mesh_shape), world_size=world_size, tp=tp, ep=ep, pp=pp)
    if mesh_shape is None and pp > 1:
        mesh_shape = [dp_world]
    if mesh_shape is None and tp > 1:
        if devices_per_node % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the {devices_per_node} devices per node, so a TP group "
                f"would cross nodes. Choose a divisor of {devices_per_node}, or set mesh_shape explicitly."
            )
        mesh_shape = [num_nodes, devices_per_node // tp]
    dp = resolve_mesh_shape(mesh_shape, world_size=dp_world, num_nodes=num_nodes, devices_per_node=devices_per_node // tp or 1)
    if dp[-1] % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide the shard dim ({dp[-1]} ranks of mesh {list(dp)}); EP ranks "
            f"are carved out of it. Choose an EP size that divides {dp[-1]}."
        )
    return MeshLayout(dp=tuple(dp), tp=tp, ep=ep, pp=pp)


def _lightning_layout(data_parallel_size: int | str, tp: int, world_size: int) -> MeshLayout:
    """Lightning ``ModelParallelStrategy``'s ``(data_parallel, tensor_parallel)`` mesh for this world."""
    dp = world_size // tp if data_parallel_size == "auto" else data_parallel_size
    if not isinstance(dp, int) or dp * tp != world_size:
        raise ValueError(
            f"HSDPStrategy(data_parallel_size={data_parallel_size!r}, tensor_parallel_size={tp}) needs "
            f"data_parallel_size x tensor_parallel_size == world size {world_size}; "
            + (f"{tp} does not divide {world_size}: choose a tensor_parallel_size that does." if world_size % tp
               else f"set data_parallel_size={world_size // tp} or 'auto'.")
        )
    return MeshLayout(dp=(dp,), tp=tp, lightning_names=True)


def check_data_parallel_size(value: object, *, mesh_shape: object, expert_parallel_size: int, pipeline_parallel_size: int) -> int | str | None:
    """Check ``data_parallel_size`` (Lightning ``ModelParallelStrategy``'s argument) before any process exists.

    Lightning's 2-D mesh has no ``mesh_shape``, EP or PP: together with any of them it is an error.
    """
    if value is None:
        return None
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(
            f"HSDPStrategy(data_parallel_size=...) expects None, 'auto' or an int >= 1 (Lightning "
            f"ModelParallelStrategy's argument); got {type(value).__name__} {value!r}."
        )
    if isinstance(value, int) and value < 1:
        raise ValueError(f"HSDPStrategy(data_parallel_size=...) expects an int >= 1 or 'auto'; got {value}.")
    given = {"mesh_shape": (mesh_shape, None), "expert_parallel_size": (expert_parallel_size, 1), "pipeline_parallel_size": (pipeline_parallel_size, 1)}
    clashes = [f"{name}={v!r}" for name, (v, default) in given.items() if v != default]
    if clashes:
        raise ValueError(
            f"HSDPStrategy(data_parallel_size={value!r}) builds Lightning ModelParallelStrategy's 2-D mesh "
            f"(data_parallel, tensor_parallel); it does not combine with {', '.join(clashes)}. Drop "
            f"data_parallel_size and use mesh_shape (the mesh dims are then named replicate/shard/tp/ep/pp), "
            f"or drop {', '.join(c.split('=')[0] for c in clashes)}."
        )
    return value


def _check_composed_product(shape: tuple[int, ...], *, world_size: int, tp: int, ep: int, pp: int) -> None:
    """Check ``prod(mesh_shape) x tp x pp == world`` (EP lies inside the shard dim); the error names both ways out."""
    known = math.prod(size for size in shape if size != INFER)
    infers = INFER in shape
    if world_size % (tp * pp):
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {tp * pp} does not divide the world size "
            f"{world_size}, so no mesh_shape can fill the rest. Choose sizes whose product divides {world_size}."
        )
    fits = (world_size // (tp * pp)) % known == 0 if infers else known * tp * pp == world_size
    if fits:
        return
    dp_world = world_size // (tp * pp)
    product = f"{known} x {tp} x {pp} = {known * tp * pp}" + (" (before the -1 is inferred)" if infers else "")
    if not infers and world_size % (known * pp) == 0:
        other = f"set tensor_parallel_size={world_size // (known * pp)} for this mesh_shape"
    else:
        other = f"change tensor_parallel_size / pipeline_parallel_size so that {known} x tp x pp divides {world_size}"
    raise ValueError(
        f"HSDPStrategy(mesh_shape={list(shape)}, tensor_parallel_size={tp}, pipeline_parallel_size={pp}) needs "
        f"prod(mesh_shape) x tensor_parallel_size x pipeline_parallel_size == world size {world_size} "
        f"(mesh_shape gives the data-parallel dims only; expert_parallel_size, here {ep}, is carved out of its "
        f"shard dim and does not multiply); got {product}. Either set mesh_shape to sizes that multiply to "
        f"{world_size} / ({tp} x {pp}) = {dp_world} (e.g. [{dp_world}], or [-1] to infer it), or {other}."
    )


@dataclass(frozen=True, eq=False)
class ParallelMesh:
    """The root mesh and the sub-meshes each technique runs on (without TP/EP/PP the root *is* the data-parallel mesh)."""

    world: DeviceMesh
    layout: MeshLayout

    @classmethod
    def of(cls, mesh: DeviceMesh | ParallelMesh) -> ParallelMesh:
        """Wrap a plain data-parallel mesh (the seed's ``fully_shard`` world) as one without TP/EP."""
        if isinstance(mesh, ParallelMesh):
            return mesh
        return cls(world=mesh, layout=MeshLayout(dp=tuple(mesh.shape)))

    @property
    def device_type(self) -> str:
        return self.world.device_type

    @cached_property
    def dp(self) -> DeviceMesh:
        """What FSDP shards over: ``(replicate, shard)`` or ``(shard,)``."""
        if not self.layout.composed:
            return self.world
        if self.layout.ep > 1 and SHARD_DIM not in (self.world.mesh_dim_names or ()):
            flatten_mesh(self.world[EXPERT_SHARD_DIM, EP_DIM], SHARD_DIM)
        return self.world[self.layout.dp_names]

    @property
    def tp(self) -> DeviceMesh | None:
        return self.world[LIGHTNING_TP_DIM if self.layout.lightning_names else TP_DIM] if self.layout.tp > 1 else None

    @property
    def ep(self) -> DeviceMesh | None:
        return self.world[EP_DIM] if self.layout.ep > 1 else None

    @property
    def pp(self) -> DeviceMesh | None:
        return self.world[PP_DIM] if self.layout.pp > 1 else None

    @property
    def expert_dp(self) -> DeviceMesh | None:
        """What FSDP shards experts over: the data-parallel dims without ``ep``."""
        if self.layout.ep == 1:
            return None
        return self.world[(REPLICATE_DIM, EXPERT_SHARD_DIM) if len(self.layout.dp) == 2 else (EXPERT_SHARD_DIM,)]

    @cached_property
    def dp_group(self) -> dist.ProcessGroup:
        """One process group over every data-parallel rank (the world group without TP and PP)."""
        if self.layout.tp == 1 and self.layout.pp == 1:
            return cast(dist.ProcessGroup, dist.group.WORLD)  # a mesh exists: the default group does too
        dp = self.dp
        return dp.get_group() if dp.ndim == 1 else flatten_mesh(dp, DP_DIM).get_group()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (TP peers share it: they see the same batch)."""
        rank = 0
        for coordinate, size in zip(self.dp.get_coordinate() or (), self.dp.shape):
            rank = rank * size + coordinate
        return rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size


def build_parallel_mesh(device_type: str, layout: MeshLayout) -> ParallelMesh:
    """Create the root mesh for ``layout`` (a collective call) and its sub-meshes."""
    mesh = ParallelMesh(_build_mesh(device_type, layout.shape, layout.names), layout)
    mesh.dp  # noqa: B018 - flattened dims are created on every rank together, here
    if layout.tp > 1 or layout.pp > 1:
        mesh.dp_group  # noqa: B018
    return mesh


def set_collective_timeout(mesh: DeviceMesh | ParallelMesh, timeout: timedelta) -> None:
    """Give the world group and every group of ``mesh`` a new collective timeout.

    torchtitan's split: a long timeout while ranks start at different speeds (rendezvous,
    compilation, checkpoint loading), a short one once training is in step, so a rank that
    stops answering in a collective ends the job in seconds to minutes instead of 30 minutes.
    """
    meshes = [mesh.world, mesh.dp, mesh.expert_dp] if isinstance(mesh, ParallelMesh) else [mesh]
    groups = [dist.group.WORLD, *(m.get_group(dim) for m in meshes if m is not None for dim in range(m.ndim))]
    if isinstance(mesh, ParallelMesh) and (mesh.layout.tp > 1 or mesh.layout.pp > 1):
        groups.append(mesh.dp_group)  # flattened: not a dim of the root mesh
    for group in {id(g): g for g in groups}.values():
        set_group_timeout(group, timeout)


def describe(mesh: DeviceMesh) -> str:
    names = tuple(mesh.mesh_dim_names or ())
    composed = any(dim in names for dim in (TP_DIM, EP_DIM, PP_DIM, LIGHTNING_TP_DIM))
    kind = "HSDP" if (REPLICATE_DIM in names if composed else mesh.ndim == 2) else "FSDP"
    if LIGHTNING_TP_DIM in names and mesh.size(names.index(LIGHTNING_TP_DIM)) > 1:
        kind += " x TP"
    kind += "".join(f" x {dim.upper()}" for dim in (EP_DIM, TP_DIM, PP_DIM) if dim in names)
    dims = ", ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names or (), mesh.shape))
    return f"{kind} mesh ({dims}) on {mesh.device_type}"

