"""DDP-style gradient all-reduce for ``replicate_params``.

PyTorch's FSDP2 has no public way to keep some parameters of a sharding unit whole while still
synchronizing their gradients (its ``DDPMeshInfo`` path is private and unit-wide, not
per-parameter). hp_lightning therefore hands those parameters to FSDP2 as ``ignored_params``
(not sharded, not reduced) and reduces their gradients itself, with public torch.distributed
calls only:

* a post-accumulate-grad hook per parameter notices when its gradient is final for this
  backward; a gradient hook hands it this backward's own gradient, so what is reduced is the
  local gradient since the last reduction, never a gradient an earlier synced micro-batch
  already reduced (``p.grad`` carries that one: reducing it again would count it once per rank
  under "sum" and scale it twice; the new part is added to it, as FSDP2 adds to its sharded
  ``.grad``);
* without ``comm_fusion`` each gradient is all-reduced on its own as soon as it is ready;
  with ``comm_fusion`` the unit's replicate gradients are flattened into one bucket and reduced
  with a single collective once the last of them is ready;
* the collectives run asynchronously and are waited for in an autograd-engine callback at the
  end of backward, so they overlap the rest of the backward pass;
* the result honours the same controls as FSDP2's own reduction: gradient sync on/off (gradient
  accumulation), the HSDP all-reduce toggle, the reduce op (avg / sum) and the scaling factor.

The reduction runs over the whole data-parallel domain (both axes of an HSDP mesh): the default
group when the mesh spans the world, else one all-reduce per mesh axis.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_lightning.core._torch_private import queue_backward_callback


class ReplicatedParamSync:
    """Reduces the gradients of one unit's replicate parameters across all data-parallel ranks.

    Args:
        params: the parameters kept whole on every rank.
        mesh: the unit's data-parallel mesh (1-D or 2-D).
        bucketed: one flat all-reduce for the whole unit (``comm_fusion=True``) instead of one
            per parameter.
    """

    def __init__(self, params: Sequence[nn.Parameter], mesh: DeviceMesh, *, bucketed: bool) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.mesh = mesh
        self.bucketed = bucketed
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.scaling_factor: float | None = None
        self.reduce_op: str = "avg"
        self._ready: list[nn.Parameter] = []
        self._in_flight: list[tuple[torch.Tensor, list[nn.Parameter], list[torch.Tensor | None], dist.Work | None]] = []
        self._callback_queued = False
        #: This backward's gradient, from the gradient hook (also called by ``autograd.grad``, so
        #: it counts only once the accumulate hook confirms it went into ``.grad``).
        self._fresh: dict[nn.Parameter, torch.Tensor] = {}
        #: Local gradient accumulated since the last reduction.
        self._local: dict[nn.Parameter, torch.Tensor] = {}
        #: Per parameter: the ``.grad`` tensor holding reduced values (weakly: zero_grad frees it), and its expected version.
        self._reduced: dict[nn.Parameter, tuple[weakref.ref[torch.Tensor], int]] = {}
        for param in self.params:
            param.register_hook(lambda grad, param=param: self._fresh.__setitem__(param, grad))
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.size()

    def _groups(self) -> list[dist.ProcessGroup]:
        if self.mesh.size() == dist.get_world_size():
            return [cast(dist.ProcessGroup, dist.group.WORLD)]  # initialized: this mesh spans it
        return [self.mesh.get_group(dim) for dim in reversed(range(self.mesh.ndim))]

    def _syncing(self) -> bool:
        # The HSDP all-reduce toggle defers the whole reduction: replicate gradients have no
        # shard-group stage to run early, so they are reduced once, on the final micro-batch.
        return self.requires_gradient_sync and self.requires_all_reduce

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        fresh = self._fresh.pop(param, None)
        if fresh is not None:
            held = self._local.get(param)
            self._local[param] = fresh.detach().clone() if held is None else held.add_(fresh)
        if param in self._reduced:
            grad, version = self._reduced[param]
            # Still the reduced .grad, changed only by this accumulation (else zeroed or replaced).
            current = param.grad
            if current is not None and current is grad() and current._version == version + 1:
                self._reduced[param] = (grad, current._version)
            else:
                del self._reduced[param]
        if not self._syncing():
            return
        if not self._callback_queued:
            queue_backward_callback(self._finish)
            self._callback_queued = True
        if not self.bucketed:
            self._launch([param])
            return
        self._ready.append(param)
        if len(self._ready) == len(self.params):
            self._launch(self._ready)
            self._ready = []

    def _still_reduced(self, param: nn.Parameter) -> bool:
        """Whether ``param.grad`` is the reduced gradient, changed since only by accumulation (not zeroed or replaced)."""
        entry = self._reduced.get(param)
        return entry is not None and param.grad is not None and param.grad is entry[0]() and param.grad._version == entry[1]

    def _launch(self, params: list[nn.Parameter]) -> None:
        local = [self._local.pop(p, None) for p in params]
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(local, params)]
        # Where .grad carries an earlier reduction, keep the local part to swap it for its reduction.
        carried = [g if p in self._reduced else None for g, p in zip(grads, params)]
        flat = grads[0].detach().clone() if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
        groups = self._groups()
        if len(groups) == 1:
            work = dist.all_reduce(flat, group=groups[0], async_op=True)
        else:
            for group in groups:
                dist.all_reduce(flat, group=group)
            work = None
        self._in_flight.append((flat, params, carried, work))

    def _finish(self) -> None:
        """End of backward: reduce a partly filled bucket, wait, scale and write the gradients back."""
        self._callback_queued = False
        if self._ready:
            # Some replicate parameters took no part in this backward; reduce zeros for them so
            # every rank issues the same collectives.
            missing = [p for p in self.params if not any(p is r for r in self._ready)]
            self._launch(self._ready + missing)
            self._ready = []
        multiplier = 1.0 if self.scaling_factor is None else float(self.scaling_factor)
        if self.reduce_op == "avg":
            multiplier /= self.data_parallel_size
        for flat, params, carried, work in self._in_flight:
            if work is not None:
                work.wait()
            if multiplier != 1.0:
                flat.mul_(multiplier)
            offset = 0
            for param, local in zip(params, carried):
                numel = param.numel()
                reduced = flat[offset : offset + numel].view_as(param).to(param.dtype)
                offset += numel
                if param.grad is None:
                    param.grad = reduced.clone()
                elif local is not None and self._still_reduced(param):
                    param.grad.add_(reduced - local.to(param.dtype))  # earlier reduction + this one
                else:
                    param.grad.copy_(reduced)  # .grad held only local gradient: exact
                self._reduced[param] = (weakref.ref(param.grad), param.grad._version)
        self._in_flight = []
