"""The one call both front ends make to turn a user's model into a sharded, initialized one."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_lightning.core import agreement
from hp_lightning.core.materialize import link_construction, materialize, move_unsharded_states, refuse_metrics_on_meta
from hp_lightning.core.mesh import ParallelMesh
from hp_lightning.core.units import zero_units_warning
from hp_lightning.fully_shard import divergence
from hp_lightning.recipe.parallelize import ShardedModel, ShardingPlan, parallelize

_PREPARED = "_hp_sharded_model"


def prepared(model: nn.Module) -> ShardedModel | None:
    """What :func:`prepare_model` made of ``model`` earlier (None when it has not run on it)."""
    return model.__dict__.get(_PREPARED)


def prepare_model(model: nn.Module, mesh: ParallelMesh | DeviceMesh, plan: ShardingPlan, *, init_device: torch.device, device: torch.device) -> ShardedModel:
    """Shard ``model`` per ``plan``, then allocate and initialize what is still on the meta device.

    The steps are commented below; materialization runs always, also when the user sharded
    everything. Idempotent: a model prepared before (``fit`` then ``test``) is only re-placed.

    Args:
        model: the module to shard in place (a LightningModule or any ``nn.Module``).
        mesh: the strategy's mesh, or a plain data-parallel mesh.
        init_device: where meta tensors are allocated (the host under CPU offload).
        device: where unsharded state lives for training.
    """
    mesh = ParallelMesh.of(mesh)
    # Under PP each stage holds its own part of the model: only its ranks compare and share values.
    stage_ranks = mesh.dp_group if mesh.layout.pp > 1 else None
    sharded = prepared(model)
    if sharded is None:
        refuse_metrics_on_meta(model)  # same on every rank, before any collective
        # Before fully_shard replaces the parameters: which recorded construction step made each one.
        link_construction(model)
        sharded = parallelize(model, mesh, plan)
        # fully_shard does not communicate; materialize does: compare the models and units first.
        agreement.check_rank_agreement(agreement.sharding_settings(model, sharded), stage="sharding", group=stage_ranks)
        model.__dict__[_PREPARED] = sharded
        warn_without_units(model, sharded, mesh.dp)
        # Before every backward: do all ranks reach the same units and parameters? (one small all-reduce)
        divergence.install(model, sharded.units, sharded.replicated, mesh.device_type)
    materialize(model, mesh, init_device, group=stage_ranks)
    move_unsharded_states(model, device)
    return sharded


def warn_without_units(model: nn.Module, sharded: ShardedModel, mesh: DeviceMesh) -> None:
    """Warn (once, from rank 0) when the plan has no unit but the root: sharding then saves little."""
    if sharded.units or not any(True for _ in model.parameters()):
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(zero_units_warning(model, mesh.size()), UserWarning, stacklevel=3)
