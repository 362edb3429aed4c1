"""Replaying a :class:`~hp_lightning.core.materialize.recording.ConstructionRecord` on real memory,
in the recorded order and from the recorded RNG state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lightning.core.materialize.ops import _EMPTY_FACTORIES, _func_name, _leaves, _map_leaves, _poison
from hp_lightning.core.materialize.recording import _Links, _Node, _Ref


class _Replay:
    """Runs a :class:`ConstructionRecord` again on real memory (see the module docstring).

    Recorded tensors that are parameters or buffers of the model resolve to those (through
    :class:`_FullTensorWrites`, which turns sharded ones into full tensors); the others (the
    intermediates of construction, layers that were deep-copied and dropped) are recomputed as
    plain tensors and freed after their last use.
    """

    def __init__(self, links: _Links, on_marker: Callable[[nn.Module], None], loaded: frozenset[int] = frozenset()) -> None:
        self.links = links
        self.on_marker = on_marker
        self.values: dict[int, torch.Tensor] = {}  # group -> value
        self.last_use = self._last_uses()
        #: Operations to leave out: with slots a file fills (``loaded``), those that feed no other slot.
        self.skipped = self._feeding_nothing(loaded) if loaded else set()

    def _feeding_nothing(self, loaded: frozenset[int]) -> set[int]:
        """Indices of the recorded operations whose results reach no slot outside ``loaded`` (slot groups).

        Walked backwards: an operation is needed when it produces (or writes in place) a needed
        group, and then every group it reads is needed too. The others, such as the random draws of
        a weight the file replaces, or of a tensor construction made and dropped (an HF ``lm_head``
        before its tie), cost nothing when left out: only their random numbers are no longer drawn.
        """
        needed = {group for group in self.links.slots if group not in loaded}
        skipped: set[int] = set()
        for index in range(len(self.links.record.nodes) - 1, -1, -1):
            node = self.links.record.nodes[index]
            outputs = {self.links.group_of[k] for k in node.outputs}
            if outputs and not outputs & needed:
                skipped.add(index)
                continue
            needed |= self._groups(node)
        return skipped

    def _groups(self, node: _Node) -> set[int]:
        refs = [v.key for v in _leaves((node.args, node.kwargs)) if isinstance(v, _Ref)]
        return {self.links.group_of[k] for k in [*refs, *node.outputs]}

    def _last_uses(self) -> dict[int, list[int]]:
        last: dict[int, int] = {}
        for i, node in enumerate(self.links.record.nodes):
            for group in self._groups(node):
                last[group] = i
        by_node: dict[int, list[int]] = {}
        for group, i in last.items():
            by_node.setdefault(i, []).append(group)
        return by_node

    def _slot_tensor(self, group: int) -> torch.Tensor | None:
        slot = self.links.slots.get(group)
        if slot is None:
            return None
        module, name = slot
        return module._parameters[name] if name in module._parameters else module._buffers[name]

    def _resolve(self, value: Any) -> Any:
        if not isinstance(value, _Ref):
            return value
        group = self.links.group_of[value.key]
        slot = self._slot_tensor(group)
        if slot is not None:
            return slot
        if group in self.values:
            return self.values[group]
        original = self.links.record.tensors[value.key]
        if not original.is_meta:
            return original  # a real tensor construction used (kept by reference)
        raise _ReplayError(f"a recorded tensor of shape {tuple(original.shape)} is used before it was produced")

    def run(self) -> None:
        record = self.links.record
        markers = iter(sorted(record.markers, key=lambda marker: marker[0]))
        pending = next(markers, None)
        for index, node in enumerate(record.nodes):
            while pending is not None and pending[0] <= index:
                self.on_marker(pending[1])
                pending = next(markers, None)
            if index not in self.skipped:
                self._run_node(index, node)
        while pending is not None:
            self.on_marker(pending[1])
            pending = next(markers, None)

    def _run_node(self, index: int, node: _Node) -> None:
        args = _map_leaves(self._resolve, node.args)
        kwargs = _map_leaves(self._resolve, node.kwargs)
        name = _func_name(node.func)
        try:
            out = node.func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported with the operation named
            raise _ReplayError(f"{name} failed on real memory ({type(exc).__name__}: {exc})") from exc
        outputs = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        if name in _EMPTY_FACTORIES:
            for t in outputs:
                _poison(t)
        for key, value in zip(node.outputs, outputs):
            group = self.links.group_of[key]
            target = self._slot_tensor(group)
            if target is None:
                self.values[group] = value
            elif name not in _EMPTY_FACTORIES and value is not target:
                # e.g. nn.Parameter(torch.ones(d)), or a deep copy: the recorded value of the slot.
                target.copy_(value)
        for group in self.last_use.get(index, ()):
            self.values.pop(group, None)


class _ReplayError(RuntimeError):
    """The record cannot be replayed; the rules are used instead."""
