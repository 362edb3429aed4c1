"""Refusing what nothing covers (before anything is allocated) and what came out uninitialized or
absurd (after).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_lightning.core.materialize.full_tensors import _Slot
from hp_lightning.core.materialize.ops import _EMPTY_FACTORIES, ABSURD_MAGNITUDE, _func_name, _is_float, _is_inplace, _leaves, _local, _target
from hp_lightning.core.materialize.recording import _Links, _Node, _Ref
from hp_lightning.core.materialize.rules import _covering_rules, _parents


def _meta_slots(model: nn.Module) -> list[_Slot]:
    slots: list[_Slot] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        non_persistent: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_meta or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                qualified = f"{module_name}.{name}" if module_name else name
                slots.append(_Slot(module, name, qualified, kind, kind == "parameter" or name not in non_persistent))
    return slots


def _uncovered_message(model: nn.Module, slots: Sequence[_Slot], *, after_rules: bool) -> str:
    owner = type(model).__name__
    listed = "; ".join(s.describe() for s in slots[:8]) + (f"; and {len(slots) - 8} more" if len(slots) > 8 else "")
    classes = sorted({type(s.module).__name__ for s in slots})
    why = (
        "was still uninitialized after every init rule ran (its constructor's recording and the rules did not write it)"
        if after_rules
        else "has no init rule: its module defines no reset_parameters(), no ancestor defines init_weights(), and its "
        "value is not one construction recorded"
    )
    return (
        f"{owner} was built on the meta device, and {len(slots)} tensor(s) {why}: {listed}. Training would use "
        f"uninitialized memory, so setup stops here (on every rank). Fix one of: define reset_parameters() on "
        f"{', '.join(classes)} that writes every parameter and buffer it owns; define init_weights() on your "
        f"LightningModule that writes them (it runs after the rules, with sharded parameters acting as full "
        f"tensors); or build the model outside the meta device with HSDPStrategy(meta_init=False) "
        f"(or trainer.init_module(empty_init=False)), at the cost of the whole model in host memory on every rank."
    )


def check_coverage(model: nn.Module, slots: Sequence[_Slot], links: _Links | None, root_hook: bool) -> None:
    """Refuse, before allocating anything, tensors that no recording and no rule can initialize.

    Decided from module structure and the construction record only, which are identical on every
    rank, so every rank raises the same error and none waits in a collective.

    Raises:
        ValueError: naming each uncovered tensor, its module class and the fixes.
    """
    parents = _parents(model)
    defined = _defined_groups(links) if links is not None else set()
    uncovered = []
    for slot in slots:
        group = links.group_of_slot(slot) if links is not None else None
        if group not in defined and not _covering_rules(model, slot, parents, root_hook):
            uncovered.append(slot)
    if uncovered:
        raise ValueError(_uncovered_message(model, uncovered, after_rules=False))


def _defined_groups(links: _Links) -> set[int]:
    """Recorded tensors construction gave a value: written in place, or produced by more than ``empty``."""
    defined: set[int] = set()
    for node in links.record.nodes:
        name = _func_name(node.func)
        defined.update(links.group_of[r.key] for r in _leaves(_written_refs(node)) if isinstance(r, _Ref))
        if name not in _EMPTY_FACTORIES and not name.startswith("__get__:"):
            defined.update(links.group_of[k] for k in node.outputs)
    return defined


def _written_refs(node: _Node) -> list[Any]:
    """The recorded tensors a node writes (the recorded twin of :func:`_written`)."""
    refs = [node.kwargs["out"]] if "out" in node.kwargs else []
    if _is_inplace(_func_name(node.func)):
        refs.append(_target(node.args, node.kwargs))
    return refs


def check_values(slots: Sequence[_Slot], group: dist.ProcessGroup | None, device_type: str) -> None:
    """Last line of defence: name every initialized tensor that is NaN, infinite or absurdly large.

    One all-reduce of two numbers per tensor, so every rank sees every rank's shards and raises
    the same error. Buffers may legitimately hold infinities or huge finite values (attention
    masks filled with ``-inf`` or ``finfo.min``); only NaN counts for them.

    Raises:
        ValueError: naming the tensors and what was wrong with them.
    """
    floats = [s for s in slots if _is_float(_local(s.get()))]
    if not floats:
        return
    stats = torch.zeros(len(floats), 2, dtype=torch.float64)
    for i, slot in enumerate(floats):
        local = _local(slot.get()).detach()
        if not local.numel():
            continue
        values = local.abs()
        if slot.kind == "buffer":
            stats[i, 0] = float(torch.isnan(values).any())
        else:
            stats[i, 0] = float((~torch.isfinite(values)).any())
            finite = values[torch.isfinite(values)]
            stats[i, 1] = float(finite.max()) if finite.numel() else 0.0
    if dist.is_available() and dist.is_initialized():
        stats = stats.to(device_type)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        stats = stats.cpu()
    bad = [
        f"{slot.describe()}: {'NaN or infinite values' if stats[i, 0] else f'|x| up to {stats[i, 1]:.3g}'}"
        for i, slot in enumerate(floats)
        if stats[i, 0] or stats[i, 1] > ABSURD_MAGNITUDE
    ]
    if bad:
        raise ValueError(
            f"After meta-device initialization, {len(bad)} tensor(s) hold values no init rule would produce "
            f"(uninitialized memory or a rule that did not write them): {'; '.join(bad[:8])}. Give their module a "
            f"reset_parameters() (or your LightningModule an init_weights()) that writes them completely, or build "
            f"the model outside the meta device with HSDPStrategy(meta_init=False)."
        )
