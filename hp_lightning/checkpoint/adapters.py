"""Exporting a model fine-tuned with peft adapters (LoRA), for :func:`hp_lightning.checkpoint.hf.save_hf`.

* ``merged_adapters``: each LoRA layer's weight with its adapter folded in, ``W + scale B A``, by
  peft's own ``get_delta_weight`` on the sharded DTensors (never gathering a layer's weight);
* ``adapter_state``: the adapters alone, gathered whole (they are small), named as peft names them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_lightning.checkpoint.names import FileNames, without_compile_wrapper

#: peft's file of adapter weights (``PeftModel.from_pretrained`` reads it).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_EXPORTS = ("merged", "adapter")


def check_peft_export(names: FileNames, peft: Optional[str]) -> None:
    """Refuse an export that would misname a peft model's weights, or a ``peft`` choice without adapters."""
    if peft is not None and peft not in PEFT_EXPORTS:
        raise ValueError(f"save_hf(peft=...) expects 'merged', 'adapter' or None; got {peft!r}.")
    if names.has_adapters and peft is None:
        raise ValueError(
            "save_hf: the model holds peft adapters, so its keys are not the base model's (a plain export would load "
            "in from_pretrained with the adapted layers left at random values). Pass peft='merged' (the base model with "
            "the adapters folded in: from_pretrained loads the fine-tuned model) or peft='adapter' (peft's adapter "
            "directory: PeftModel.from_pretrained(base_model, path))."
        )
    if not names.has_adapters and peft is not None:
        raise ValueError(f"save_hf(peft={peft!r}): the model holds no peft adapters; drop peft=.")


def _tuner_layers(module: nn.Module) -> list[tuple[str, Any]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(without_compile_wrapper(path), layer) for path, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)]


def merged_adapters(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (torch's ``get_model_state_dict`` of ``module``) with each active LoRA adapter folded into its base weight.

    A collective where the weights are sharded. Adapters already merged by peft are not added twice;
    a delta that is not ``scale B A`` on the weight alone (DoRA, a LoRA bias) is a ValueError.
    """
    state = dict(state)
    for path, layer in _tuner_layers(module):
        key = f"{path}.base_layer.weight" if path else "base_layer.weight"
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "merged_adapters", ()):
                continue
            unsupported = (
                not hasattr(layer, "get_delta_weight")
                or getattr(layer, "use_dora", {}).get(adapter, False)
                or getattr(layer, "lora_bias", {}).get(adapter, False)
                or key not in state
            )
            if unsupported:
                raise ValueError(
                    f"save_hf(peft='merged'): {path} ({type(layer).__name__}, adapter {adapter!r}) cannot be folded into its "
                    f"weight here (DoRA, a LoRA bias or another tuner). Export it with peft='adapter'."
                )
            with torch.no_grad():
                delta = layer.get_delta_weight(adapter)
                state[key] = state[key] + delta.to(state[key].dtype)
    return state


def adapter_state(module: nn.Module, names: FileNames) -> tuple[Any, dict[str, torch.Tensor]]:
    """``module``'s one ``PeftModel`` and its active adapter's tensors, whole, under peft's file names (a collective)."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    found = [(without_compile_wrapper(path), m) for path, m in module.named_modules() if isinstance(m, PeftModel)]
    if len(found) != 1:
        raise ValueError(
            f"save_hf(peft='adapter') writes one PeftModel's adapters; {type(module).__name__} holds {len(found)} "
            f"(pass module=<the PeftModel or the module holding it>)."
        )
    path, peft_model = found[0]
    inside = f"{path}." if path else ""
    whole: dict[str, torch.Tensor] = {}
    for name, value in get_model_state_dict(module).items():
        if name.startswith(inside) and names.is_adapter(name) and isinstance(value, torch.Tensor):
            whole[name[len(inside):]] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
    return peft_model, get_peft_model_state_dict(peft_model, state_dict=whole, adapter_name=peft_model.active_adapter)
