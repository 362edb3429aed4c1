"""Model and optimizer state of a sharded model: getting it sharded or whole, and checking it against a model.

All state goes through ``torch.distributed.checkpoint.state_dict``, so keys are the model's own
parameter names (no FSDP wrapper prefixes) and optimizer state is keyed by those names, which is
what lets a checkpoint load into another world size or mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer

Shape = Optional[tuple[int, ...]]  # None: a non-tensor entry (e.g. a module's extra state)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper."""
    inner = getattr(optimizer, "optimizer", None)  # Lightning's and Fabric's wrappers expose it publicly
    return inner if isinstance(inner, Optimizer) else optimizer


# Whole tensors, gathered by torch one at a time and kept (on the CPU) by rank 0 only: the other
# ranks drop each at once, so no rank holds more than one whole tensor of gathered state on its device.
_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state_dict(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """The model's state: local shards as DTensors (``full=False``) or whole CPU tensors on rank 0.

    ``full=True`` returns an empty dict on other ranks: they never hold the whole model.
    """
    state = get_model_state_dict(model, options=_FULL_ON_RANK0 if full else None)
    return {} if full and _rank() != 0 else state


def optimizer_state_dict(model: nn.Module, optimizer: Any, *, full: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names, sharded like the model or whole on rank 0."""
    state = get_optimizer_state_dict(model, unwrap_optimizer(optimizer), options=_FULL_ON_RANK0 if full else None)
    return {} if full and _rank() != 0 else state


# ---------------------------------------------------------------- keys and shapes


def model_shapes(model: nn.Module) -> dict[str, Shape]:
    """Global shape of every entry of the model's state dict (the same on every rank)."""
    return {key: _shape(value) for key, value in get_model_state_dict(model).items()}


def _shape(value: Any) -> Shape:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def state_shapes(state: Mapping[str, Any]) -> dict[str, Shape]:
    return {key: _shape(value) for key, value in state.items()}


def _listing(keys: Sequence[str], limit: int = 8) -> str:
    keys = sorted(keys)
    return f"{keys[:limit]}{f' and {len(keys) - limit} more' if len(keys) > limit else ''}"


def check_model_keys(expected: Mapping[str, Shape], stored: Mapping[str, Shape], *, strict: bool, source: str) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's model entries with the model's; return (missing, unexpected).

    Raises:
        ValueError: shapes that differ (always), a checkpoint sharing no key with the model
            (always: it belongs to another model), missing or unexpected keys when ``strict``.
    """
    common = expected.keys() & stored.keys()
    if expected and not common:
        raise ValueError(
            f"Checkpoint {source} shares no key with the model: it stores {len(stored)} entries like "
            f"{_listing(list(stored), 3)}, the model expects {len(expected)} like {_listing(list(expected), 3)}. "
            f"It is another model's checkpoint, or its keys carry another prefix (see load_weights(prefix=...))."
        )
    mismatched = [
        f"{key!r}: {have} in the checkpoint, {want} in the model"
        for key in sorted(common)
        for have, want in [(stored[key], expected[key])]
        if want is not None and have is not None and tuple(have) != tuple(want)
    ]
    if mismatched:
        raise ValueError(
            f"Checkpoint {source} does not fit the model: {'; '.join(mismatched[:6])}"
            f"{f' (and {len(mismatched) - 6} more)' if len(mismatched) > 6 else ''}. It was saved from a model "
            f"configured differently (compare the hyper-parameters); build the model with the checkpoint's configuration."
        )
    missing = sorted(expected.keys() - stored.keys())
    unexpected = sorted(stored.keys() - expected.keys())
    if strict and (missing or unexpected):
        parts = [f"{what} keys {_listing(keys)}" for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise ValueError(
            f"Checkpoint {source} does not match the model (strict loading): {'; '.join(parts)}. Load a "
            f"checkpoint of this model, or set `self.strict_loading = False` in the LightningModule (or "
            f"strict=False) to load the matching keys and keep the others as initialized."
        )
    return missing, unexpected


# ---------------------------------------------------------------- optimizer state keyed by name


def optimizer_param_names(model: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """Parameter names of each of the optimizer's param groups, in the optimizer's order (each must be ``model``'s)."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter by its first name, as torch's state-dict API
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        try:
            groups.append([names[id(p)] for p in group["params"]])
        except KeyError:
            raise ValueError(
                f"Optimizer param group {index} holds a parameter that is not in the model; build optimizers from "
                f"self.parameters() (after sharding) in configure_optimizers."
            ) from None
    return groups


def is_keyed_by_position(optimizer_state: Mapping[str, Any]) -> bool:
    """Whether a saved optimizer state uses torch's native integer ids rather than parameter names."""
    params = [p for group in optimizer_state.get("param_groups", []) for p in group.get("params", [])]
    keys = list(optimizer_state.get("state", {}))
    return any(isinstance(k, int) for k in params + keys)


def positions_to_names(optimizer_state: Mapping[str, Any], names: list[list[str]], source: str) -> dict[str, Any]:
    """Re-key a native ``optimizer.state_dict()`` (integer ids) by parameter name, matching by position.

    Plain PyTorch and single-device Lightning checkpoints number parameters in the optimizer's
    order; the same order in this run's optimizer (param groups of the same sizes) gives each number its name.
    """
    groups = optimizer_state.get("param_groups", [])
    sizes = [len(g.get("params", [])) for g in groups]
    if sizes != [len(g) for g in names]:
        raise ValueError(
            f"Optimizer state in {source} has param groups of sizes {sizes}; this run's optimizer has "
            f"{[len(g) for g in names]}. Configure the same optimizer param groups as the run that saved it."
        )
    by_id: dict[Any, str] = {}  # saved id (an int) -> parameter name
    for saved_group, group_names in zip(groups, names):
        by_id.update(zip(saved_group["params"], group_names))
    state = {by_id[k]: v for k, v in optimizer_state.get("state", {}).items() if k in by_id}
    new_groups = [{**g, "params": list(n)} for g, n in zip(groups, names)]
    return {"state": state, "param_groups": new_groups}


def names_to_positions(optimizer_state: Mapping[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """The inverse of :func:`positions_to_names` (to read position-keyed state stored in a DCP directory)."""
    index = {name: i for i, name in enumerate(n for group in names for n in group)}
    groups, start = [], 0
    for group, group_names in zip(optimizer_state["param_groups"], names):
        groups.append({**group, "params": list(range(start, start + len(group_names)))})
        start += len(group_names)
    return {"state": {index[k]: v for k, v in optimizer_state["state"].items()}, "param_groups": groups}


def check_optimizer_state(expected: Mapping[str, Any], stored_state_keys: Mapping[Any, Sequence[str]], stored_groups: int, *, index: int, source: str) -> None:
    """Check that a checkpoint holds, for every parameter, the state entries this optimizer keeps.

    Args:
        expected: this run's optimizer state dict (initialized, keyed by name).
        stored_state_keys: per parameter name, the entries the checkpoint holds (``exp_avg`` ...).
        stored_groups: number of param groups in the checkpoint (it must be this optimizer's).
    """
    groups = len(expected["param_groups"])
    if stored_groups != groups:
        raise ValueError(
            f"Checkpoint {source}: optimizer {index} has {stored_groups} param groups stored, this run's has {groups}. "
            f"Configure the same optimizer as the run that saved it."
        )
    if stored_state_keys and expected["state"] and not (stored_state_keys.keys() & expected["state"].keys()):
        raise ValueError(
            f"Checkpoint {source}: optimizer {index} state is kept for parameters "
            f"{_listing([str(k) for k in stored_state_keys], 3)}, none of which is a parameter of this optimizer "
            f"({_listing(list(expected['state']), 3)}). It belongs to another model or another optimizer layout."
        )
    lacking = []
    for name, entries in expected["state"].items():
        if name not in stored_state_keys:
            continue  # a parameter without state yet (e.g. never stepped): fresh state is right
        if missing := sorted(set(entries) - set(stored_state_keys[name])):
            lacking.append(f"{name!r} lacks {missing}")
    if lacking:
        raise ValueError(
            f"Checkpoint {source}: optimizer {index} state does not fit this run's optimizer: {'; '.join(lacking[:4])}"
            f"{' ...' if len(lacking) > 4 else ''}. It was saved with another optimizer class or settings; "
            f"configure the same optimizer, or load the weights only (hp_lightning.checkpoint.load_weights)."
        )
