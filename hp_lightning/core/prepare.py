"""The one call both front ends make to turn a user's model into a sharded, initialized one."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_lightning.core import agreement
from hp_lightning.core.materialize import materialize, move_unsharded_states
from hp_lightning.core.parallelize import ShardedModel, ShardingPlan, parallelize

_PREPARED = "_hp_sharded_model"


def prepared(model: nn.Module) -> ShardedModel | None:
    """What :func:`prepare_model` made of ``model`` earlier (None when it has not run on it)."""
    return model.__dict__.get(_PREPARED)


def prepare_model(
    model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan, *, init_device: torch.device, device: torch.device
) -> ShardedModel:
    """Shard ``model`` per ``plan``, then allocate and initialize what is still on the meta device.

    In this order: the recipe (:func:`~hp_lightning.core.parallelize.parallelize`; units the
    user sharded already are kept), a check that every rank built the same model and units
    (before the first collective that depends on them), materialization of meta tensors (always,
    also when the user sharded everything), then whole parameters and buffers moved to ``device``.
    Idempotent: a model prepared before (``fit`` then ``test``) is only re-placed.

    Args:
        model: the module to shard in place (a LightningModule or any ``nn.Module``).
        mesh: the data-parallel mesh.
        plan: what to shard and how.
        init_device: where meta tensors are allocated (the host under CPU offload).
        device: where unsharded state lives for training.
    """
    sharded = prepared(model)
    if sharded is None:
        sharded = parallelize(model, mesh, plan)
        # fully_shard does not communicate; materialize does: compare the models and units first.
        agreement.check_rank_agreement(agreement.sharding_settings(model, sharded), stage="sharding")
        model.__dict__[_PREPARED] = sharded
    materialize(model, mesh, init_device)
    move_unsharded_states(model, device)
    return sharded
