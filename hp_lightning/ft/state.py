"""The whole training state a returning replica group copies from a live one.

Rank ``i`` of the returning group receives rank ``i``'s state of a live group: both shard the same
model over the same number of ranks, so each local shard (parameters, buffers, optimizer moments)
has the same shape and is copied in place, without any gathering. DTensors travel as their local
tensors (torchft's HTTP transport pickles plain tensors) and become DTensors again on arrival,
with the receiving parameter's mesh and placements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Stateful", "TrainingState"]

_LOCAL = "__hp_local_shard__"


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict(sd)``: LR schedulers, loop progress, callbacks."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _to_transport(value: Any) -> Any:
    """``value`` with every DTensor replaced by a marked local shard (recursively through dicts/lists)."""
    if isinstance(value, DTensor):
        return {_LOCAL: value.to_local().detach()}
    if isinstance(value, dict):
        return {k: _to_transport(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_transport(v) for v in value)
    return value


def _is_local(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and _LOCAL in value


class TrainingState:
    """Model shards, optimizer shards and named ``extra`` stateful objects (schedulers, loop progress), as one state dict."""

    def __init__(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], extra: Mapping[str, Stateful] | None = None
    ) -> None:
        self.model = model
        self.optimizers = list(optimizers)
        self.extra: dict[str, Stateful] = dict(extra or {})
        for name, obj in self.extra.items():
            self._check_stateful(name, obj)
        #: How many times a peer's state was loaded into this one (each heal adds one).
        self.heals = 0

    @staticmethod
    def _check_stateful(name: str, obj: Any) -> None:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"TrainingState extra[{name!r}] needs state_dict() and load_state_dict(); got {type(obj).__name__}. "
                f"Wrap plain values in an object with both methods."
            )

    def add(self, name: str, obj: Stateful) -> None:
        """Heal ``obj`` (e.g. an LR scheduler) with the rest of the state, under ``name`` (ValueError if taken)."""
        if name in self.extra:
            raise ValueError(f"TrainingState already holds {name!r}; choose another name.")
        self._check_stateful(name, obj)
        self.extra[name] = obj

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: local shards only (no collective), ready for torchft's transport.

        The tensors are the live ones, not copies: torchft serves them only between the quorum and
        the commit vote, while nothing changes them (the optimizer steps after the vote).
        """
        params = {name: _to_transport(p.detach()) for name, p in self.model.named_parameters()}
        buffers = {name: b.detach() for name, b in self.model.named_buffers()}
        return {
            "model": {"params": params, "buffers": buffers},
            "optimizers": [_to_transport(opt.state_dict()) for opt in self.optimizers],
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a peer rank's state into this rank's, in place; ValueError when the layouts differ (names, shapes, counts)."""
        params = dict(self.model.named_parameters())
        given = state["model"]["params"]
        if set(given) != set(params):
            raise ValueError(
                f"Healing from a peer replica group: parameter names differ (missing here: "
                f"{sorted(set(given) - set(params))[:5]}, extra here: {sorted(set(params) - set(given))[:5]}). Every "
                f"replica group must build and shard the same model."
            )
        for name, param in params.items():
            local = param.to_local() if isinstance(param, DTensor) else param
            src = given[name][_LOCAL] if _is_local(given[name]) else given[name]
            if src.shape != local.shape:
                raise ValueError(
                    f"Healing from a peer replica group: {name!r} has local shard shape {tuple(src.shape)} there, "
                    f"{tuple(local.shape)} here. Every replica group must have the same number of ranks and sharding."
                )
            local.copy_(src)
        buffers = dict(self.model.named_buffers())
        for name, src in state["model"]["buffers"].items():
            if name in buffers:
                buffers[name].copy_(src)
        if len(state["optimizers"]) != len(self.optimizers):
            raise ValueError(
                f"Healing from a peer replica group: {len(state['optimizers'])} optimizer(s) there, "
                f"{len(self.optimizers)} here."
            )
        for opt, opt_state in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(_from_transport_optimizer(opt, opt_state))
        missing = sorted(set(self.extra) - set(state["extra"]))
        if missing:
            raise ValueError(f"Healing from a peer replica group: the peer sent no state for {missing}.")
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])
        self.heals += 1


def _from_transport_optimizer(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with the peer's local shards turned into DTensors like this rank's parameters."""
    params = [p for group in opt.param_groups for p in group["params"]]
    out_state: dict[Any, Any] = {}
    for index, entries in state["state"].items():
        param = params[index]
        restored = {}
        for key, value in entries.items():
            if not _is_local(value):
                restored[key] = value.clone() if isinstance(value, torch.Tensor) else value
            elif isinstance(param, DTensor):
                restored[key] = DTensor.from_local(
                    value[_LOCAL].clone(), param.device_mesh, param.placements, run_check=False, shape=param.size(), stride=param.stride()
                )
            else:
                restored[key] = value[_LOCAL].clone()
        out_state[index] = restored
    return {"state": out_state, "param_groups": state["param_groups"]}
