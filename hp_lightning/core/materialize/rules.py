"""The init program without a recording: each module's own rule (``reset_parameters``,
``_reset_parameters``, Hugging Face ``init_weights``, the LightningModule's ``init_weights()``),
in construction order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from hp_lightning.core.materialize.full_tensors import _Slot
from hp_lightning.core.materialize.ops import _local


def _is_hf_pretrained(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (duck-typed: transformers is optional)."""
    return all(callable(getattr(module, a, None)) for a in ("post_init", "_init_weights", "init_weights")) and hasattr(module, "config")


def _untie(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Give each tied HF target (``lm_head.weight``) a plain full-size stand-in; return what to restore.

    A Hugging Face model built for real initializes ``lm_head.weight`` as its own tensor (its
    ``nn.Linear`` constructor, then ``_init_weights``) and only then ties it to the input
    embedding, discarding those values. Built on the meta device, the tie exists before our
    initialization, which would then overwrite the embedding. The stand-ins take those writes
    (one full tensor each, for the duration); ``tie_weights`` at the end of ``init_weights``
    re-ties, and :func:`_retie` restores whatever is still untied.
    """
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for target, source in dict(tied).items():
        try:
            target_module_name, _, target_attr = str(target).rpartition(".")
            target_module = model.get_submodule(target_module_name)
            original = target_module._parameters.get(target_attr)
            if original is None or original is not model.get_parameter(str(source)):
                continue
        except (AttributeError, KeyError):
            continue
        local = _local(original)
        stand_in = nn.Parameter(torch.empty(original.shape, dtype=local.dtype, device=local.device), original.requires_grad)
        target_module._parameters[target_attr] = stand_in
        swapped.append((target_module, target_attr, original))
    return swapped


def _retie(swapped: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for module, attr, original in swapped:
        if module._parameters.get(attr) is not original:
            module._parameters[attr] = original


def _hf_init_weights(module: nn.Module, swapped: list[tuple[nn.Module, str, nn.Parameter]] | None = None) -> None:
    """``PreTrainedModel.init_weights()`` as its ``post_init`` runs it on a real build: untied first (here, or by an
    earlier step that left what it swapped in ``swapped``), re-tied after."""
    swapped = _untie(module) if swapped is None else swapped
    try:
        cast(Any, module).init_weights()  # an HF PreTrainedModel (checked by the caller)
    finally:
        _retie(swapped)


def _owns_state(module: nn.Module) -> bool:
    return any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])


def _constructor_rule(module: nn.Module) -> Callable[[], Any] | None:
    """What the module's constructor runs to initialize itself, by torch convention."""
    private_rule = getattr(module, "_reset_parameters", None)
    if callable(private_rule):
        return private_rule  # nn.MultiheadAttention, nn.Transformer
    public_rule = getattr(module, "reset_parameters", None)
    if _owns_state(module) and callable(public_rule):
        return public_rule
    return None


#: Containers whose constructor deep-copies one given layer into ``layers`` (equal initial values).
_CLONING_CONTAINERS: tuple[type[nn.TransformerEncoder], type[nn.TransformerDecoder]] = (nn.TransformerEncoder, nn.TransformerDecoder)


@dataclass
class _Step:
    """One init rule: ``run()`` on ``module`` (described in errors)."""

    module: nn.Module
    what: str
    run: Callable[[], Any]


def _clone_layers(container: nn.TransformerEncoder | nn.TransformerDecoder) -> Callable[[], None]:
    def run() -> None:
        layers = list(container.layers)
        first = dict(layers[0].named_parameters()) | dict(layers[0].named_buffers())
        for layer in layers[1:]:
            for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
                tensor.copy_(first[name])

    return run


def _rule_program(model: nn.Module, root_hook: bool) -> list[_Step]:
    """Rules in constructor order (post-order: children, then the parent's own rule).

    A module's ``init_weights()`` counts as its constructor's last step (HF ``post_init``,
    GPT-2-style models), unless the root defines its own hook (``root_hook``), which then runs
    last and replaces them.
    """
    steps: list[_Step] = []

    def visit(module: nn.Module) -> None:
        hf = _is_hf_pretrained(module)
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        if hf:
            # Its constructor runs before post_init ties weights: rules see untied targets.
            steps.append(_Step(module, "untie", lambda: swapped.extend(_untie(module))))
        if isinstance(module, _CLONING_CONTAINERS) and len(getattr(module, "layers", ())) > 1:
            visit(module.layers[0])
            steps.append(_Step(module, "copies of layers.0 (its constructor deep-copies one layer)", _clone_layers(module)))
            for name, child in module.named_children():
                if name != "layers":
                    visit(child)
        else:
            for child in module.children():
                visit(child)
        rule = _constructor_rule(module)
        if rule is not None:
            steps.append(_Step(module, f"{type(module).__name__}.{rule.__name__}()", rule))
        hook = getattr(module, "init_weights", None)
        if hf:
            steps.append(_Step(module, f"{type(module).__name__}.init_weights()", partial(_hf_init_weights, module, swapped)))
        elif callable(hook) and module is not model and not root_hook:
            steps.append(_Step(module, f"{type(module).__name__}.init_weights()", hook))

    visit(model)
    return steps


def _root_hook(model: nn.Module) -> _Step | None:
    hook = getattr(model, "init_weights", None)
    if callable(hook):
        return _Step(model, f"{type(model).__name__}.init_weights()", hook)
    return None


def _covering_rules(model: nn.Module, slot: _Slot, parents: dict[int, nn.Module], root_hook: bool) -> list[str]:
    """Rules that may write ``slot``: its module's constructor rule, or a rule of an ancestor."""
    rules = []
    own = _constructor_rule(slot.module)
    if own is not None:
        rules.append(f"{type(slot.module).__name__}.{own.__name__}()")
    current = slot.module
    while id(current) in parents:
        current = parents[id(current)]
        if callable(getattr(current, "_reset_parameters", None)):
            rules.append(f"{type(current).__name__}._reset_parameters()")
        if callable(getattr(current, "init_weights", None)) and (current is model or _is_hf_pretrained(current) or not root_hook):
            rules.append(f"{type(current).__name__}.init_weights()")
        if isinstance(current, _CLONING_CONTAINERS):
            rules.append(f"{type(current).__name__} layer copies")
    return rules


def _parents(model: nn.Module) -> dict[int, nn.Module]:
    """Each submodule's parent inside ``model`` (by id; the first parent when shared)."""
    parents: dict[int, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    return parents
