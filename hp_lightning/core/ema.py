"""An exponential moving average of a sharded model's weights, kept on the shards.

:class:`AveragedWeights` holds, for every trainable parameter, a tensor with the parameter's own
layout (a DTensor with the same placements, or a plain tensor for a parameter kept whole), in the
dtype asked for. Because the average of a shard depends only on that shard, every replica and
every mesh computes the same numbers a single process would.

It is a ``torch.optim.Optimizer`` in form only (it never steps the model): its state is the
average, one ``"average"`` entry per parameter, and its one param group carries the counters.
torch's distributed state-dict API therefore saves it like optimizer state (sharded, or whole on
rank 0), and :func:`averaged_weights_in` reads it back out of a checkpoint.

No Lightning here: :class:`~hp_lightning.callbacks.ShardedEMA` drives it from the Trainer's hooks
or a Fabric loop; ``save_hf(..., ema=True)`` finds it through :func:`attached_average`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

#: Where a Trainer checkpoint keeps the average: inside optimizer 0's state dict (sharded) or in the callback's state (full).
CHECKPOINT_KEY = "hp_lightning_ema"
#: The state entry of each parameter.
AVERAGE = "average"
#: Marks the callback state that holds (or points at) the average, whatever the callback's state key.
FORMAT = "hp_lightning.ema/1"
#: The module attribute (in ``__dict__``, not a submodule: the model's state dict stays as it was) holding its average.
_ATTACHED = "_hp_averaged_weights"
#: The counters the param group carries (see :attr:`AveragedWeights.counters`).
_COUNTERS = ("updates", "valid", "steps")


def reshard_units(module: nn.Module) -> None:
    """Free every gathered FSDP unit inside ``module``, so its parameters are the sharded ones again (no collective)."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _local(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); call under ``torch.no_grad()`` (then no autograd node)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AveragedWeights(torch.optim.Optimizer):
    """The average of ``module``'s trainable parameters, laid out like them; updated in place.

    Args:
        module: the (sharded) model; its trainable parameters are taken once, resharded first.
        dtype: the average's dtype (None: each parameter's own). fp32 over bf16 weights keeps
            small updates (``(1 - decay) x step``) from rounding away.

    Raises:
        ValueError: for a module without trainable parameters.
    """

    def __init__(self, module: nn.Module, *, dtype: Optional[torch.dtype] = torch.float32) -> None:
        reshard_units(module)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"AveragedWeights: {type(module).__name__} has no trainable parameters to average.")
        super().__init__(params, {"updates": 0, "valid": False, "steps": 0})
        self.module = module
        self._params = params
        with torch.no_grad():
            for p in self._params:
                local = _local(p)
                average = local.detach().to(dtype=dtype or local.dtype, copy=True)
                if isinstance(p, DTensor):
                    average = DTensor.from_local(average, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                self.state[p][AVERAGE] = average
        self._averages = [_local(self.state[p][AVERAGE]) for p in self._params]
        #: Each parameter's name as checkpoints key it (torch's canonical names: wrappers' prefixes dropped).
        groups: list[dict[str, Any]] = get_optimizer_state_dict(module, self)["param_groups"]  # type: ignore[assignment]
        self.names: list[str] = [str(name) for group in groups for name in group["params"]]
        # Same dtype as the weights: one lerp over them all; others (fp32 over bf16): a scale and an add.
        self._same = [i for i, p in enumerate(self._params) if self._averages[i].dtype == _local(p).dtype]
        self._cast = [i for i in range(len(self._params)) if i not in set(self._same)]

    @property
    def counters(self) -> dict[str, Any]:
        """``updates`` (averaging steps so far), ``valid`` (the average holds one), ``steps`` (optimizer steps seen, Fabric)."""
        return self.param_groups[0]

    @property
    def updates(self) -> int:
        return int(self.counters["updates"])

    @property
    def valid(self) -> bool:
        """Whether the average holds an average (it started); before, the weights are the only model."""
        return bool(self.counters["valid"])

    def set_counters(self, **values: Any) -> None:
        for key, value in values.items():
            if key not in _COUNTERS:
                raise KeyError(key)
            self.counters[key] = value

    def _weights(self) -> list[Tensor]:
        return [_local(p) for p in self._params]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """``average = decay x average + (1 - decay) x weights`` on every local shard (fused, no collective, no host read)."""
        weight = 1.0 - float(decay)
        weights = self._weights()
        if self._same:
            torch._foreach_lerp_([self._averages[i] for i in self._same], [weights[i] for i in self._same], weight)
        if self._cast:
            averages = [self._averages[i] for i in self._cast]
            torch._foreach_mul_(averages, float(decay))
            torch._foreach_add_(averages, [weights[i] for i in self._cast], alpha=weight)
        self.counters["updates"] = self.updates + 1

    @torch.no_grad()
    def copy_weights(self) -> None:
        """Start the average over: it becomes the current weights (and valid)."""
        torch._foreach_copy_(self._averages, self._weights())
        self.set_counters(valid=True, updates=0)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The average in the parameters' local shards inside the block, the weights back after it (even on error).

        Costs one extra copy of the local shards while swapped. Every FSDP unit is resharded first,
        so the next forward gathers the swapped shards rather than reusing weights gathered before.
        """
        reshard_units(self.module)
        with torch.no_grad():
            weights = self._weights()
            kept = [w.clone() for w in weights]
            torch._foreach_copy_(weights, self._averages)
        try:
            yield
        finally:
            reshard_units(self.module)  # nothing gathered from the average outlives the block
            with torch.no_grad():
                torch._foreach_copy_(self._weights(), kept)

    def sharded_state(self) -> dict[str, dict[str, Tensor]]:
        """``{name: {"average": tensor}}`` of this average's own tensors: what a sharded checkpoint stores, and
        what a load reads into in place (each rank its part)."""
        return {name: {AVERAGE: self.state[p][AVERAGE]} for name, p in zip(self.names, self._params)}

    def parameters_unchanged(self, module: nn.Module) -> bool:
        """Whether ``module``'s trainable parameters are still the very tensors this average follows."""
        current = [p for p in module.parameters() if p.requires_grad]
        return len(current) == len(self._params) and all(a is b for a, b in zip(current, self._params))

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Not an optimizer step: the average is folded in by :meth:`update` (``ShardedEMA`` decides when)."""
        raise TypeError("AveragedWeights is not stepped like an optimizer: call ShardedEMA.update() (or AveragedWeights.update(decay)).")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the average has no gradients, and the model's belong to its optimizer."""

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a saved average into this one (values cast to this average's dtype; the layout is kept).

        Accepts torch's optimizer layout (parameters by position, as ``set_optimizer_state_dict``
        passes it). The counters come from the saved param group.

        Raises:
            ValueError: a saved state for other parameters (count or shapes).
        """
        groups = state_dict["param_groups"]
        saved = [pid for group in groups for pid in group["params"]]
        if len(saved) != len(self._params):
            raise ValueError(f"AveragedWeights: the saved average covers {len(saved)} parameters, this one {len(self._params)}.")
        state = state_dict["state"]
        for pid, param, mine in zip(saved, self._params, self._averages):
            entry = state.get(pid, {}) if isinstance(state, Mapping) else {}
            if AVERAGE not in entry:
                raise ValueError(f"AveragedWeights: the saved state has no average for parameter {pid!r}.")
            value = entry[AVERAGE]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"AveragedWeights: saved average {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}.")
            if isinstance(value, DTensor):
                value = _local(value) if isinstance(param, DTensor) and value.placements == param.placements else value.full_tensor()
            if value.shape != mine.shape:  # a whole tensor: this rank's part of it, cut locally (no communication)
                value = local_part(value, param)
            if value.data_ptr() != mine.data_ptr():
                mine.copy_(value)
        self.set_counters(**{k: v for k, v in groups[0].items() if k in _COUNTERS})

    @torch.no_grad()
    def load_whole(self, averages: Mapping[str, Tensor], counters: Mapping[str, Any]) -> list[str]:
        """Copy whole tensors by parameter name into this rank's shards (each rank cuts its own part); return the names missing."""
        missing = []
        for name, param, mine in zip(self.names, self._params, self._averages):
            if name not in averages:
                missing.append(name)
                continue
            value = averages[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"ShardedEMA: the saved average of {name!r} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}.")
            mine.copy_(local_part(value, param))
        self.set_counters(**{k: v for k, v in counters.items() if k in _COUNTERS})
        return missing


def local_part(whole: Tensor, param: Tensor) -> Tensor:
    """This rank's part of ``whole`` laid out like ``param`` (a DTensor's local shard), cut locally: no collective."""
    if not isinstance(param, DTensor):
        return whole
    whole = whole.to(device=_local(param).device)
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()


def attach(module: nn.Module, averaged: AveragedWeights) -> None:
    """Record ``averaged`` as ``module``'s average (``save_hf(..., ema=True)`` looks it up here)."""
    module.__dict__[_ATTACHED] = averaged


def attached_average(module: nn.Module) -> Optional[AveragedWeights]:
    """The average attached to ``module`` (or to the module a Fabric wrapper holds), if any."""
    for candidate in (module, getattr(module, "module", None)):
        if isinstance(candidate, nn.Module) and isinstance(candidate.__dict__.get(_ATTACHED), AveragedWeights):
            return candidate.__dict__[_ATTACHED]
    return None


def require_average(module: nn.Module, what: str) -> AveragedWeights:
    """The attached average, ready to swap in, or a ``ValueError``: no ``ShardedEMA`` follows ``module``, or its average has not started yet."""
    averaged = attached_average(module)
    if averaged is None:
        raise ValueError(
            f"{what}: no averaged weights follow {type(module).__name__}. Add hp_lightning.callbacks.ShardedEMA to the "
            f"Trainer's callbacks (with Fabric: ema.attach(model)), or leave ema=False to write the weights."
        )
    if not averaged.valid:
        raise ValueError(
            f"{what}: the ShardedEMA average has not started yet (start_step not reached, or no optimizer step since "
            f"it was attached), so there is no average to write. Train past start_step, or write the weights (ema=False)."
        )
    return averaged


def averaged_weights_in(checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
    """The averaged weights a Trainer checkpoint holds, by parameter name (whole tensors, as read by one process).

    Looks in optimizer 0's state (a sharded save, read whole by ``read_sharded`` or consolidated)
    and in the callback states (a full save). What ``export-hf --ema`` writes in place of the
    weights under the same names (:func:`hp_lightning.checkpoint.hf.export_hf`).

    Raises:
        KeyError: the checkpoint holds no average (saved without ``ShardedEMA``, or weights only).
    """
    for optimizer_state in checkpoint.get("optimizer_states") or []:
        found = optimizer_state.get(CHECKPOINT_KEY) if isinstance(optimizer_state, Mapping) else None
        if isinstance(found, Mapping):
            return _averages_by_name(found)
    for callback_state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(callback_state, Mapping) and callback_state.get("format") == FORMAT and isinstance(callback_state.get(AVERAGE), Mapping):
            return _averages_by_name(callback_state[AVERAGE])
    raise KeyError("The checkpoint holds no ShardedEMA average (saved without the callback, or weights only).")


def _averages_by_name(state: Mapping[str, Any]) -> dict[str, Tensor]:
    """``{"state": {name: {"average": t}}, ...}`` (torch's optimizer layout, keyed by name) -> ``{name: t}``."""
    return {str(name): entry[AVERAGE] for name, entry in state.get("state", {}).items() if isinstance(entry, Mapping) and AVERAGE in entry}
