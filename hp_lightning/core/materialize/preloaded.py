"""Weights that come from a file: allocated, never initialized (``load_weights`` before setup).

Initializing tensors a file then overwrites is, for a large model, a full pass of random number
generation thrown away. A loader told the weights before the model is materialized
(``hp_lightning.load_weights`` on a module built by the strategy's meta-device context) registers a
:class:`PendingWeights` instead; :func:`~hp_lightning.core.materialize.materialize` then runs the
init program with the file's tensors replaced by meta-device stand-ins (operations on them cost
nothing) and lets the loader fill them. The other tensors (rotary ``inv_freq``, a new head) are
initialized as usual, but their random draws no longer follow the skipped ones: they equal a build
without the file only when they use no random numbers or come first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from hp_lightning.core.materialize.ops import _LINKS_ATTR, _RECORD_ATTR, has_meta_tensors

#: The module attribute a loader registers its :class:`PendingWeights` under.
PENDING_WEIGHTS_ATTR = "_hp_pending_weights"


class PendingWeights(Protocol):
    """Weights a loader will write into a module once its tensors exist. Both methods are called
    on every rank, in the same order (they may communicate)."""

    def covered(self) -> set[str]:
        """The names (relative to the module the loader was given) of the tensors the file fills."""
        ...

    def load(self) -> None:
        """Fill them (the tensors are allocated, NaN)."""
        ...


def awaits_materialization(module: nn.Module) -> bool:
    """Whether ``module`` has meta-device tensors that hp_lightning will materialize at setup: it was built
    inside the strategy's meta-device context (``configure_model``, ``init_module()``) and not set up yet."""
    return has_meta_tensors(module) and any(_RECORD_ATTR in m.__dict__ or _LINKS_ATTR in m.__dict__ for m in module.modules())


def defer_weights(module: nn.Module, pending: PendingWeights) -> None:
    """Register ``pending`` on ``module``: the next :func:`materialize` of a model holding it loads it."""
    module.__dict__.setdefault(PENDING_WEIGHTS_ATTR, []).append(pending)


#: Wrappers that appear in module names but not in state-dict keys (activation checkpointing, compile).
_WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def state_dict_name(qualified: str) -> str:
    """A parameter's name from ``named_modules`` as a state dict spells it (wrappers left out)."""
    for wrapper in _WRAPPER_NAMES:
        qualified = qualified.replace(wrapper, "")
    return qualified


def take_pending_weights(model: nn.Module) -> list[tuple[str, PendingWeights]]:
    """Every loader registered on ``model`` or a submodule, with the submodule's state-dict prefix; removed from them."""
    found: list[tuple[str, PendingWeights]] = []
    for name, module in model.named_modules():
        for pending in module.__dict__.pop(PENDING_WEIGHTS_ATTR, []):
            found.append((state_dict_name(f"{name}.") if name else "", pending))
    return found


@contextmanager
def meta_stand_ins(model: nn.Module, names: set[str]) -> Iterator[None]:
    """Within the block, the parameters and buffers called ``names`` are meta-device tensors of the same
    shape and dtype (tied ones share one stand-in); the originals are put back after, untouched."""
    swapped: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
    stand_in_of: dict[int, torch.Tensor] = {}
    try:
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            tables: tuple[dict[str, torch.Tensor | None], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, tensor in list(table.items()):
                    if tensor is None or state_dict_name(f"{prefix}{name}") not in names:
                        continue
                    stand_in = stand_in_of.get(id(tensor))
                    if stand_in is None:
                        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                        stand_in = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
                        stand_in_of[id(tensor)] = stand_in
                    swapped.append((table, name, tensor))
                    table[name] = stand_in
        yield
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor
