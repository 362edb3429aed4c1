"""``get_model_state_dict`` / ``set_model_state_dict`` under the seed's names.

Thin layers over ``torch.distributed.checkpoint.state_dict``, with flags instead of an options
object and a setter that takes full tensors, this rank's shards or DTensors in one dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict as _torch_get_model_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict as _torch_set_model_state_dict

from hp_lightning.core.checks import ArgumentTypeError
from hp_lightning.fully_shard.api import to_model_placements

__all__ = ["get_model_state_dict", "set_model_state_dict"]


def get_model_state_dict(model: nn.Module, *, full_state_dict: bool = False, cpu_offload: bool = False, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict: DTensor shards (default), or whole tensors with ``full_state_dict``.

    Args:
        full_state_dict: gather every parameter whole (a collective; every rank gets it unless
            ``cpu_offload``, in which case rank 0 holds host copies and the others empty dicts).
        cpu_offload: move the result to host memory.
        options: a torch ``StateDictOptions``; when given, the two flags are ignored.

    Raises:
        TypeError (also a ValueError): ``model`` is not a module.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"get_model_state_dict expects an nn.Module; got {type(model).__name__}.")
    options = options or StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    return _torch_get_model_state_dict(model, options=options)


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Any], *, strict: bool = True, options: StateDictOptions | None = None) -> Any:
    """Load ``model_state_dict`` into the (sharded) model; entries may be full, local shards or DTensors.

    See :func:`~.api.to_model_placements` for how plain tensors are placed.

    Returns:
        torch's ``_IncompatibleKeys`` (missing and unexpected keys).

    Raises:
        TypeError (also a ValueError): ``model`` is not a module or the state dict not a mapping.
        ValueError: an entry of neither the full nor the local shape.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"set_model_state_dict expects an nn.Module; got {type(model).__name__}.")
    options = options or StateDictOptions(strict=strict)
    return _torch_set_model_state_dict(model, to_model_placements(model, model_state_dict), options=options)
