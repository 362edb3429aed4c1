"""Device meshes for FSDP (1-D) and HSDP (2-D ``(replicate, shard)``): shapes, validation, build.

The axis names live here and only here. Rank ``r`` of an HSDP mesh ``(R, S)`` sits at
``(r // S, r % S)``: each shard group is ``S`` consecutive ranks, which with ``S`` equal to the
devices per node keeps every all-gather and reduce-scatter inside one node and sends only the
gradient all-reduce across nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

from hp_lightning.core import devices
from hp_lightning.core._torch_private import set_collective_timeout as set_group_timeout

REPLICATE_DIM = "replicate"
SHARD_DIM = "shard"
FSDP_DIM_NAMES: tuple[str] = (SHARD_DIM,)
HSDP_DIM_NAMES: tuple[str, str] = (REPLICATE_DIM, SHARD_DIM)

#: A mesh size of -1 means "whatever makes the product equal the world size" (as in reshape).
INFER = -1


def validate_mesh_shape(mesh_shape: Sequence[int] | None) -> tuple[int, ...] | None:
    """Check a user's ``mesh_shape`` for type and form, before any process exists.

    Accepts None (automatic HSDP ``(num_nodes, devices_per_node)``), ``(N,)`` (FSDP) or ``(R, S)``
    (HSDP), where at most one size may be -1 (inferred from the world size).

    Raises:
        TypeError: when it is not a list/tuple of ints.
        ValueError: for 0-D or >2-D shapes, sizes < 1 other than -1, or more than one -1.
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


def resolve_mesh_shape(
    mesh_shape: Sequence[int] | None, *, world_size: int, num_nodes: int, devices_per_node: int
) -> tuple[int, ...]:
    """Turn a validated ``mesh_shape`` into concrete sizes whose product is the world size.

    Raises:
        ValueError: when the sizes cannot multiply to ``world_size``.
    """
    shape = validate_mesh_shape(mesh_shape)
    if shape is None:
        shape = (num_nodes, devices_per_node)
    if INFER in shape:
        known = 1
        for size in shape:
            if size != INFER:
                known *= size
        if world_size % known:
            raise ValueError(
                f"mesh_shape {list(shape)} cannot cover world size {world_size}: {known} does not divide it. "
                f"Choose sizes whose product is {world_size}."
            )
        shape = tuple(world_size // known if size == INFER else size for size in shape)
    product = 1
    for size in shape:
        product *= size
    if product != world_size:
        names = " x ".join(HSDP_DIM_NAMES if len(shape) == 2 else FSDP_DIM_NAMES)
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
    """Create the data-parallel mesh over the default process group (a collective call).

    Raises:
        ValueError: when the shape does not match the initialized world size.
    """
    shape = tuple(shape)
    world = dist.get_world_size()
    product = 1
    for size in shape:
        product *= size
    if product != world:
        raise ValueError(f"A mesh of shape {list(shape)} needs world size {product}; the process group has {world}.")
    return _torch_init_device_mesh(device_type, shape, mesh_dim_names=dim_names_for(shape))


def init_device_mesh(
    device_type: str | None = None,
    mesh_shape: Sequence[int] = (),
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """The seed's ``init_device_mesh(device_type, mesh_shape, mesh_dim_names=...)``.

    ``device_type=None`` picks the current accelerator (or the CPU); names default to
    ``("shard",)`` for 1-D and ``("replicate", "shard")`` for 2-D meshes.
    """
    shape = validate_mesh_shape(mesh_shape) if len(mesh_shape) <= 2 else tuple(mesh_shape)
    if shape is None or INFER in shape:
        raise ValueError(f"init_device_mesh expects explicit sizes >= 1; got {mesh_shape!r}. Example: (2, 4).")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else dim_names_for(shape)
    return _torch_init_device_mesh(device_type or default_device_type(), tuple(shape), mesh_dim_names=names)


def set_collective_timeout(mesh: DeviceMesh, timeout: timedelta) -> None:
    """Give the world group and every group of ``mesh`` a new collective timeout.

    torchtitan's split: a long timeout while ranks start at different speeds (rendezvous,
    compilation, checkpoint loading), a short one once training is in step, so a rank that
    stops answering in a collective ends the job in seconds to minutes instead of 30 minutes.
    """
    groups = [dist.group.WORLD, *(mesh.get_group(dim) for dim in range(mesh.ndim))]
    for group in {id(g): g for g in groups}.values():
        set_group_timeout(group, timeout)


def describe(mesh: DeviceMesh) -> str:
    kind = "HSDP" if mesh.ndim == 2 else "FSDP"
    dims = ", ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names or (), mesh.shape))
    return f"{kind} mesh ({dims}) on {mesh.device_type}"


__all__ = [
    "FSDP_DIM_NAMES",
    "HSDP_DIM_NAMES",
    "INFER",
    "REPLICATE_DIM",
    "SHARD_DIM",
    "build_device_mesh",
    "default_device_type",
    "describe",
    "dim_names_for",
    "init_device_mesh",
    "resolve_mesh_shape",
    "set_collective_timeout",
    "validate_mesh_shape",
]
