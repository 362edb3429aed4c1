"""DDP-style gradient all-reduce for ``replicate_params``.

FSDP2 has no public way to keep some parameters of a unit whole while syncing their gradients, so
they are handed to it as ``ignored_params`` and reduced here, with public torch.distributed calls:

* hooks on each parameter hand over this backward's own gradient once it is final, so what is
  reduced is the local gradient since the last reduction, never one already reduced. The earlier
  reduction is kept aside (copied just before autograd adds to ``.grad``) and the new one added to
  it: ``.grad`` holds only reduced values, the same bits on every rank (subtracting the local part
  back out would leave each rank its own rounding error, and replicas would drift by an ulp);
* each gradient is all-reduced when ready (with ``comm_fusion``, one bucket once the unit's last
  is ready), asynchronously, waited for at the end of backward so it overlaps;
* the result honours FSDP2's controls (gradient sync, the HSDP all-reduce toggle, reduce op,
  scaling factor) over the whole data-parallel domain.

``to_empty()`` and ``.to()`` across device types replace the parameter objects the hooks sit on, and
so does a user who assigns a new ``nn.Parameter`` by hand: the unit calls
:meth:`ReplicatedParamSync.follow_replaced` after every ``_apply`` and before every forward to hook the
new ones (else the replicas would drift apart silently). Per forward that is one attribute read per
replicate parameter.
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
        bucketed: one flat all-reduce for the whole unit (``comm_fusion=True``).
        module: the unit (or modules) holding them, where :meth:`follow_replaced` looks (None: not followed).
    """

    def __init__(self, params: Sequence[nn.Parameter], mesh: DeviceMesh, *, bucketed: bool, module: nn.Module | Sequence[nn.Module] | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.mesh = mesh
        self.bucketed = bucketed
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.scaling_factor: float | None = None
        self.reduce_op: str = "avg"
        self._ready: list[nn.Parameter] = []
        self._in_flight: list[tuple[torch.Tensor, list[nn.Parameter], dist.Work | None]] = []
        self._callback_queued = False
        #: This backward's gradient, from the gradient hook (also called by ``autograd.grad``, so
        #: it counts only once the accumulate hook confirms it went into ``.grad``).
        self._fresh: dict[nn.Parameter, torch.Tensor] = {}
        #: Local gradient accumulated since the last reduction.
        self._local: dict[nn.Parameter, torch.Tensor] = {}
        #: Per parameter: the ``.grad`` tensor holding reduced values (weakly: zero_grad frees it), and its expected version.
        self._reduced: dict[nn.Parameter, tuple[weakref.ref[torch.Tensor], int]] = {}
        #: Per parameter: a copy of its last reduction, taken before autograd adds a local gradient to ``.grad``.
        self._earlier: dict[nn.Parameter, torch.Tensor] = {}
        #: Per parameter (in ``params`` order): the module and attribute holding it, or None (not followed).
        self._owners: list[tuple[nn.Module, str] | None] = [None] * len(self.params)
        if module is not None:
            roots = [module] if isinstance(module, nn.Module) else list(module)
            where = {id(p): (owner, name) for root in roots for owner in root.modules() for name, p in owner._parameters.items() if p is not None}
            self._owners = [where.get(id(p)) for p in self.params]
            for root in roots:
                root.register_forward_pre_hook(lambda *_: self.follow_replaced())
        for param in self.params:
            self._hook(param)

    def _hook(self, param: nn.Parameter) -> None:
        param.register_hook(lambda grad, param=param: self._on_grad(param, grad))
        param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def follow_replaced(self) -> None:
        """Hook the parameters that now hold our parameters' places in their modules, where other objects do.

        Cheap (one attribute read per parameter); call after anything that may replace parameters.
        """
        for index, owner in enumerate(self._owners):
            if owner is None:
                continue
            module, name = owner
            current, old = module._parameters.get(name), self.params[index]
            if current is None or current is old:
                continue
            for table in (self._fresh, self._local, self._reduced, self._earlier):
                table.pop(old, None)
            self.params[index] = cast(nn.Parameter, current)
            self._hook(self.params[index])

    def _groups(self) -> list[dist.ProcessGroup]:
        if self.mesh.size() == dist.get_world_size():
            return [cast(dist.ProcessGroup, dist.group.WORLD)]  # initialized: this mesh spans it
        return [self.mesh.get_group(dim) for dim in reversed(range(self.mesh.ndim))]

    def _syncing(self) -> bool:
        # The HSDP all-reduce toggle defers the whole reduction: replicate gradients have no
        # shard-group stage to run early, so they are reduced once, on the final micro-batch.
        return self.requires_gradient_sync and self.requires_all_reduce

    def _on_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Gradient hook (before autograd adds ``grad`` to ``.grad``): note it; keep the reduced ``.grad`` it lands on."""
        self._fresh[param] = grad
        if param not in self._earlier and self._still_reduced(param):
            self._earlier[param] = cast(torch.Tensor, param.grad).detach().clone()

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
                self._earlier.pop(param, None)
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
        flat = grads[0].detach().clone() if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
        groups = self._groups()
        if len(groups) == 1:
            work = dist.all_reduce(flat, group=groups[0], async_op=True)
        else:
            for group in groups:
                dist.all_reduce(flat, group=group)
            work = None
        self._in_flight.append((flat, params, work))

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
            multiplier /= self.mesh.size()
        for flat, params, work in self._in_flight:
            if work is not None:
                work.wait()
            if multiplier != 1.0:
                flat.mul_(multiplier)
            offset = 0
            for param in params:
                numel = param.numel()
                reduced = flat[offset : offset + numel].view_as(param).to(param.dtype)
                offset += numel
                earlier = self._earlier.pop(param, None)
                if param.grad is None:
                    param.grad = reduced.clone()
                elif self._still_reduced(param):
                    # .grad = the earlier reduction (+ local gradients since, when any reached it): the earlier
                    # reduction + this one, from reduced values only (the same bits on every rank).
                    param.grad.copy_(reduced.add_(param.grad if earlier is None else earlier))
                else:
                    param.grad.copy_(reduced)  # .grad held only local gradient: exact
                self._reduced[param] = (weakref.ref(param.grad), param.grad._version)
        self._in_flight = []
