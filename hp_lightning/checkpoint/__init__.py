"""Checkpoint IO: sharded (DCP directory) and full (one file) state, atomic saves, any-mesh resume."""

from hp_lightning.checkpoint.io import (
    FORMAT_VERSION,
    is_sharded_checkpoint,
    load_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    remove_checkpoint,
    save_checkpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "model_state_dict",
    "optimizer_state_dict",
    "remove_checkpoint",
    "save_checkpoint",
]
