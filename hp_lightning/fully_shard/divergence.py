"""Rank-divergent graphs named before they reach a collective.

When rank-dependent control flow gives a unit (or a replicate parameter) a gradient on some ranks
and not on others, the ranks issue different collectives: gloo aborts with ``Received data size
doesn't match expected size``, NCCL hangs until the timeout, equal sizes silently mix gradients.
:class:`DivergenceCheck` walks the autograd graph from the loss *before* backward; a backward that
communicates compares what it reaches (OR-ed over the window's silent micro-batches) across ranks
inside the step's control all-reduce (:class:`~hp_lightning.core.agreement.StepAgreement`, no
host-device sync), and every rank raises :class:`RankDivergenceError` alike if any differs.

Cost when nothing diverges (``docs/benchmarks.md``): one Python walk of the graph per backward and
two integers per checked parameter in that all-reduce; ``divergence_check="off"`` drops it. On a
Lightning root it hooks ``training_step`` and ``manual_backward``; other front ends call
:func:`check_before_backward` and enter :func:`gradients_stay_local`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import Node
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hp_lightning.core.agreement import StepAgreement

__all__ = [
    "DivergenceCheck",
    "RankDivergenceError",
    "check_before_backward",
    "divergence_check",
    "gradients_stay_local",
    "install",
]

_ATTR = "_hp_divergence_check"
#: Root methods whose loss is checked before Lightning runs backward on it.
_CHECKED_METHODS = ("training_step",)


class RankDivergenceError(RuntimeError):
    """Ranks are about to run different backward passes (raised on every rank alike)."""


@dataclass
class _Slot:
    """A parameter whose gradient must exist on all ranks or on none."""

    unit: str  # the sharding unit's module name ("<root>" for the root), or "replicate"
    name: str  # the parameter's qualified name
    module: nn.Module
    attr: str


def checked_slots(root: nn.Module, units: Sequence[nn.Module], replicated: Iterable[str]) -> list[_Slot]:
    """Every checked parameter, in a fixed order (identical on every rank)."""
    names = {id(m): name for name, m in root.named_modules()}
    owner: dict[int, str] = {}
    for unit in sorted([root, *units], key=lambda u: -len(names.get(id(u), ""))):
        unit_name = names.get(id(unit), "") or "<root>"
        for module in unit.modules():
            owner.setdefault(id(module), unit_name)
    replicated = set(replicated)
    slots: list[_Slot] = []
    seen: set[int] = set()
    for module_name, module in root.named_modules():
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            name = f"{module_name}.{attr}" if module_name else attr
            if isinstance(param, DTensor):
                slots.append(_Slot(owner.get(id(module), "<root>"), name, module, attr))
            elif name in replicated:
                slots.append(_Slot("replicate", name, module, attr))
    return slots


def _reached_leaves(outputs: Sequence[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors the graph from ``outputs`` accumulates gradients into.

    Only nodes without inputs are asked for a ``variable`` (an ``AccumulateGrad`` has no inputs;
    asking every node costs an ``AttributeError`` each): 35 instead of 57 us on 6 MLP blocks.
    """
    stack: list[Node | None] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    leaves = {id(t) for t in outputs if t.grad_fn is None and t.requires_grad}
    seen: set[int] = set()
    keep: list[Any] = []  # keeps node wrappers alive, so their ids stay unique during the walk
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        inputs = node.next_functions
        if inputs:
            stack.extend([next_node for next_node, _ in inputs])
        elif isinstance(variable := getattr(node, "variable", None), torch.Tensor):
            leaves.add(id(variable))
    return leaves


class DivergenceCheck:
    """Compares, across ranks, which checked parameters the coming backward will reach.

    Args:
        units: the root's sharding units (the root excluded or included).
        replicated: qualified names of replicate parameters.
        device_type: the mesh's device type (for the fallback agreement on the default group).
        agreement: the step's control collective (the front end sets it); None: one on the default
            group, made on first use.
    """

    def __init__(self, root: nn.Module, units: Sequence[nn.Module], replicated: Iterable[str], device_type: str, agreement: StepAgreement | None = None) -> None:
        self.slots = checked_slots(root, [u for u in units if u is not root], replicated)
        self.device_type = device_type
        self.agreement = agreement
        self.enabled = True
        #: True while the coming backward passes issue no gradient collective (:func:`gradients_stay_local`).
        self.local_only = False
        self._window: list[int] | None = None  # OR of what this window's uncompared backward passes reach
        self._forward_params: dict[int, int] = {}  # id(parameter object seen in a unit's forward) -> slot index
        self._checked: Callable[[], Any] = lambda: None  # weak: the last loss checked (compared once)
        self._hooks = [
            unit.register_forward_pre_hook(self._remember_unsharded) for unit in units if isinstance(unit, FSDPModule)
        ]
        slots_of_module: dict[int, list[int]] = {}
        for i, slot in enumerate(self.slots):
            slots_of_module.setdefault(id(slot.module), []).append(i)
        #: Per unit, its checked slots as (the owning module's parameter dict, attribute, slot index).
        self._unit_slots = {
            id(u): [(m._parameters, self.slots[i].attr, i) for m in u.modules() for i in slots_of_module.get(id(m), ())]
            for u in units
        }

    def _remember_unsharded(self, unit: nn.Module, args: Any) -> None:
        # FSDP's own pre-forward hook ran first: the unit's modules now hold the gathered parameters
        # that this forward's graph will accumulate into.
        forward_params = self._forward_params
        for parameters, attr, i in self._unit_slots.get(id(unit), ()):
            param = parameters.get(attr)
            if param is not None:
                forward_params[id(param)] = i

    def _local_mask(self, outputs: Sequence[torch.Tensor]) -> list[int]:
        """Per slot, 1 when the backward from ``outputs`` reaches it (plain Python: nothing read from a tensor)."""
        leaves = _reached_leaves(outputs)
        mask = [0] * len(self.slots)
        for leaf in leaves:
            i = self._forward_params.get(leaf)
            if i is not None:
                mask[i] = 1
        for i, slot in enumerate(self.slots):  # the root's gathered parameters, replicate parameters
            param = slot.module._parameters.get(slot.attr)
            if param is not None and id(param) in leaves:
                mask[i] = 1
        return mask

    def check(self, loss: Any, *, skipped_counts: bool = False) -> None:
        """Raise :class:`RankDivergenceError` on every rank if the coming backward differs across ranks.

        Under :func:`gradients_stay_local` it only records; otherwise a collective: every rank must
        call it at the same backward passes.

        Args:
            loss: the loss (a tensor, or a mapping with ``"loss"``), or None.
            skipped_counts: a step without a loss (``training_step`` returned None) counts as a backward
                that reaches nothing, so a rank skipping a step others run is named instead of hanging them.
        """
        outputs = [t for t in _tensors(loss) if t.requires_grad]
        if not self.enabled or not torch.is_grad_enabled() or not dist.is_initialized():
            return
        if not outputs and not skipped_counts:
            return
        last = self._checked()
        if last is not None and any(t is last for t in outputs):
            return
        if outputs:
            self._checked = weakref.ref(outputs[0])
        mask = self._local_mask(outputs)
        self._forward_params.clear()
        if self._window is not None:
            mask = [a | b for a, b in zip(self._window, mask)]
        if self.local_only:  # this backward issues no gradient collective: nothing can mismatch yet
            self._window = mask
            return
        self._window = None
        if self.agreement is None:
            self.agreement = StepAgreement.for_default_group(self.device_type)
        # MAX of [reached, not reached] per slot: a slot that some rank reaches and some rank does
        # not has both set. Only then are the records gathered, for the message.
        n = len(self.slots)
        both = self.agreement.exchange([*mask, *(1 - m for m in mask)])
        if not any(both[i] and both[n + i] for i in range(n)):
            return
        group = self.agreement.group
        masks: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(masks, mask, group=group)
        raise RankDivergenceError(self._message(torch.tensor(masks, dtype=torch.uint8)))

    def forget_window(self) -> None:
        """Drop the record of uncompared backward passes (a window abandoned: a new ``fit``)."""
        self._window = None

    def _message(self, masks: torch.Tensor) -> str:
        differing = [i for i in range(len(self.slots)) if not bool((masks[:, i] == masks[0, i]).all())]
        by_unit: dict[str, list[int]] = {}
        for i in differing:
            by_unit.setdefault(self.slots[i].unit, []).append(i)
        parts = []
        for unit, indices in by_unit.items():
            with_grad = [r for r in range(masks.shape[0]) if masks[r, indices[0]]]
            without = [r for r in range(masks.shape[0]) if not masks[r, indices[0]]]
            names = [self.slots[i].name for i in indices]
            what = "replicate parameter(s)" if unit == "replicate" else f"sharding unit {unit!r}, parameter(s)"
            parts.append(
                f"{what} {names[:6]}{' ...' if len(names) > 6 else ''}: backward reaches them on ranks {with_grad} "
                f"but not on ranks {without}"
            )
        return (
            "Ranks are about to run different backward passes, so their gradient collectives would not match "
            "(gloo would abort with 'Received data size doesn't match', NCCL would hang, equal sizes would mix "
            "gradients): " + "; ".join(parts) + ". Likely cause: control flow that depends on the rank or on "
            "rank-local data (an `if self.global_rank == ...`, a branch or module used only for some batches, "
            "an auxiliary loss computed on some ranks only, experts chosen by routing). Make every rank use the "
            "same modules in every step: e.g. add the unused branch's output times zero to the loss "
            "(`loss = loss + 0.0 * aux.sum()`), or exclude those parameters from gradient sync with "
            "ignored_params. Stopped on every rank before backward."
        )

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, Mapping):
        value = value.get("loss")
    return [value] if isinstance(value, torch.Tensor) else []


def _checked_method(check: DivergenceCheck, method: Callable[..., Any], loss_from_result: bool, root: nn.Module) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not loss_from_result:
            check.check(args[0] if args else kwargs.get("loss"))
            return method(*args, **kwargs)
        result = method(*args, **kwargs)
        # Under automatic optimization the returned loss is what backward runs on (None: skipped).
        check.check(result, skipped_counts=bool(getattr(root, "automatic_optimization", False)))
        return result

    # Lightning reads a step method's signature one ``__wrapped__`` level down (``batch_idx``
    # passed or not, ``is_overridden``): point that level at what it would see without us.
    wrapped.__wrapped__ = getattr(method, "__wrapped__", method)
    return wrapped


def install(root: nn.Module, units: Sequence[nn.Module], replicated: Iterable[str], device_type: str) -> DivergenceCheck:
    """Check every backward of ``root``: before Lightning's (the ``training_step`` loss, ``manual_backward``).

    Idempotent. Other front ends call :func:`check_before_backward` with the loss instead.
    """
    existing = divergence_check(root)
    if existing is not None:
        return existing
    check = DivergenceCheck(root, units, replicated, device_type)
    root.__dict__[_ATTR] = check
    for method in _CHECKED_METHODS:
        if callable(getattr(root, method, None)):
            setattr(root, method, _checked_method(check, getattr(root, method), loss_from_result=True, root=root))
    manual_backward = getattr(root, "manual_backward", None)
    if callable(manual_backward):
        # A LightningModule method: nn.Module's typed __setattr__ accepts only tensors and modules.
        cast(Any, root).manual_backward = _checked_method(check, manual_backward, loss_from_result=False, root=root)
    return check


def divergence_check(root: nn.Module) -> DivergenceCheck | None:
    """The check :func:`install` put on ``root`` (None when there is none)."""
    return root.__dict__.get(_ATTR)


def check_before_backward(root: nn.Module, loss: Any) -> None:
    """Compare the coming backward of ``loss`` across ranks (a collective; no-op without a check installed).

    Raises:
        RankDivergenceError: on every rank, when some rank's backward reaches different parameters.
    """
    check = divergence_check(root)
    if check is not None:
        check.check(loss)


@contextmanager
def gradients_stay_local(root: nn.Module, local: bool = True) -> Generator[None, None, None]:
    """Backward passes inside issue no gradient collective: only record what they reach (when ``local``).

    For the non-final micro-batches of ``accumulation_mode="skip"``: the record is compared at the
    next backward outside. A no-op without a check installed or with ``local=False``.
    """
    check = divergence_check(root)
    if check is None or not local:
        yield
        return
    previous, check.local_only = check.local_only, True
    try:
        yield
    finally:
        check.local_only = previous
