"""Full tensors for init code: inside init rules and replay, sharded parameters behave like whole
tensors; each is written back into its local shard (:class:`_FullTensorWrites`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from hp_lightning.core.materialize.ops import _ALIASING_PROPERTIES, _METADATA, _OVERWRITING, _func_name, _leaves, _local, _map_leaves, _poison, _written


@dataclass
class _Slot:
    """A parameter or buffer that started on the meta device."""

    module: nn.Module
    name: str
    qualified: str
    kind: str  # "parameter" or "buffer"
    persistent: bool

    def get(self) -> torch.Tensor:
        table = self.module._parameters if self.kind == "parameter" else self.module._buffers
        return cast(torch.Tensor, table[self.name])  # a slot is made only for a tensor that is there

    def describe(self) -> str:
        note = "" if self.persistent else ", non-persistent: no checkpoint holds it"
        return f"{self.qualified} ({type(self.module).__name__} {self.kind}{note})"


@dataclass
class _Cached:
    full: torch.Tensor
    views_out: bool = False


class _FullTensorWrites(TorchFunctionMode):
    """Inside init code, sharded parameters act as full tensors; writes land in the local shards.

    Any operation that involves a sharded parameter runs on a full-size temporary instead: built
    from the shards with one all-gather when the operation reads values the parameter already
    has, or left as NaN when nothing was written yet (or the operation overwrites everything).
    After an operation that writes it, the local shard is copied back (every rank computes the
    same full tensor, so shards of one tensor are slices of one value). Temporaries are cached
    for the next operation on the same parameter (``trunc_normal_`` is five of them); at most
    ``capacity`` are alive. Writes to the other tracked tensors (buffers, whole parameters) are
    counted, so that coverage can be checked: ``sharded`` holds the sharded parameters by ``id``,
    ``tracked`` every slot tensor by storage pointer.
    """

    def __init__(self, sharded: dict[int, DTensor], tracked: dict[int, torch.Tensor], capacity: int = 2) -> None:
        super().__init__()
        self.sharded = sharded
        self.by_storage = {_local(p).untyped_storage().data_ptr(): p for p in sharded.values() if _local(p).numel()}
        self.tracked = tracked
        self.capacity = capacity
        self.cache: dict[int, _Cached] = {}
        self.written: set[int] = set()  # ids of sharded params and storage pointers of tracked tensors

    def _canonical(self, t: Any) -> DTensor | None:
        if not isinstance(t, DTensor):
            return None
        if id(t) in self.sharded:
            return self.sharded[id(t)]
        local = _local(t)
        return self.by_storage.get(local.untyped_storage().data_ptr()) if local.numel() else None

    def _full(self, param: DTensor, *, read: bool) -> torch.Tensor:
        entry = self.cache.pop(id(param), None)
        if entry is None:
            while len(self.cache) >= self.capacity:
                self._evict(next(iter(self.cache)))
            local = _local(param)
            if read and id(param) in self.written:
                full = param.full_tensor()
            else:
                full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
                _poison(full)
            entry = _Cached(full)
        self.cache[id(param)] = entry  # most recently used last
        return entry.full

    def _write_back(self, param: DTensor, full: torch.Tensor) -> None:
        local = _local(param)
        if local.numel():
            shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None).to_local()
            if shard.shape != local.shape:
                raise RuntimeError(
                    f"Cannot write an initialized shard of shape {tuple(shard.shape)} into the local shard of "
                    f"shape {tuple(local.shape)} (placements {param.placements}); please report this layout."
                )
            local.copy_(shard)
        self.written.add(id(param))

    def _evict(self, key: int) -> None:
        entry = self.cache.pop(key)
        if entry.views_out:
            self._write_back(self.sharded[key], entry.full)

    def flush(self) -> None:
        """Write back every temporary that handed out views, and drop all temporaries."""
        for key in list(self.cache):
            self._evict(key)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch protocol
        kwargs = kwargs or {}
        name = _func_name(func)
        flat = _leaves((args, kwargs))
        involved = {id(p): p for t in flat if (p := self._canonical(t)) is not None}
        if not involved or name in _METADATA or name.startswith("__get__:") and name[8:] not in _ALIASING_PROPERTIES:
            out = func(*args, **kwargs)
            self._track_plain(func, args, kwargs)
            return out
        if name.startswith("__get__:"):  # .data / .T of a sharded parameter: a view of its full value
            param = next(iter(involved.values()))
            if name == "__get__:data":
                return param
            full = self._full(param, read=True)
            self.cache[id(param)].views_out = True
            return func.__self__.__get__(full)
        if name in ("set_", "resize_", "as_strided_"):
            raise ValueError(
                f"An init rule calls Tensor.{name} on a sharded parameter of shape {tuple(next(iter(involved.values())).shape)}; "
                f"write its values in place instead (nn.init.*, copy_, fill_)."
            )
        writes = {id(p) for t in _written(func, args, kwargs) if (p := self._canonical(t)) is not None}
        overwrites = name in _OVERWRITING
        fulls = {key: self._full(param, read=not (key in writes and overwrites and len(writes) == 1)) for key, param in involved.items()}

        def swap(value: Any) -> Any:
            p = self._canonical(value)
            return fulls[id(p)] if p is not None else value

        if name == "__set__:data" and (target := self._canonical(args[0])) is not None:
            fulls[id(target)].copy_(swap(args[1]))
            self._write_back(target, fulls[id(target)])
            return None
        out = func(*_map_leaves(swap, tuple(args)), **_map_leaves(swap, kwargs))
        for key in writes:
            self._write_back(self.sharded[key], fulls[key])
        # Results aliasing a temporary: hand back the parameter itself, or remember the view.
        for key, full in fulls.items():
            if out is full:
                return self.sharded[key]
            for t in _leaves(out):
                if isinstance(t, torch.Tensor) and t._base is full:
                    self.cache[key].views_out = True
        self._track_plain(func, args, kwargs)
        return out

    def _track_plain(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        for t in _written(func, args, kwargs):
            if not isinstance(t, DTensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.tracked:
                    self.written.add(ptr)

    def was_written(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DTensor):
            p = self._canonical(tensor)
            return p is not None and id(p) in self.written
        return tensor.untyped_storage().data_ptr() in self.written
