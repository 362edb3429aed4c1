"""A module's own parameter names and the names a Hugging Face file gives the same tensors.

``torch.compile`` adds ``_orig_mod.`` to every name; peft nests the model as ``base_model.model`` and
moves each adapted layer's weight to ``base_layer``, next to the adapter's own parameters (which no
base checkpoint holds). :class:`FileNames` maps each name to the model's own files' name, or None for
an adapter's, from the module's structure (peft's classes), never guessed from the strings.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Optional

from torch import nn

#: The segment ``torch.compile``'s wrapper puts into every name under it.
COMPILED = "_orig_mod"


def without_compile_wrapper(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod`` segments (torch's state-dict API drops them too)."""
    return ".".join(part for part in name.split(".") if part != COMPILED)


class FileNames:
    """Own names (as ``state_dict()``, ``named_parameters()`` or torch's ``get_model_state_dict`` give them) -> file names."""

    def __init__(self, module: nn.Module) -> None:
        self._nested: list[str] = []  # "<path>.base_model.model." -> "<path>."  (peft's PeftModel)
        self._adapted: list[str] = []  # "<path>.base_layer." -> "<path>."  (an adapted layer's own weights)
        self._adapters: list[str] = []  # "<path>.lora_A." ...: an adapter's own parameters
        peft = sys.modules.get("peft")
        if peft is None:  # a model holding peft's modules has imported peft
            return
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer

        for path, sub in module.named_modules():
            path = without_compile_wrapper(path)
            dotted = f"{path}." if path else ""
            if isinstance(sub, PeftModel):
                self._nested.append(f"{dotted}base_model.model.")
            if isinstance(sub, BaseTunerLayer):
                self._adapted.append(f"{dotted}base_layer.")
                self._adapters.extend(f"{dotted}{attribute}." for attribute in sub.adapter_layer_names)
        # Longest first: a PeftModel inside another module's path is rewritten before an outer one.
        self._nested.sort(key=len, reverse=True)

    @property
    def has_adapters(self) -> bool:
        """Whether the module holds peft adapters (its names differ from its files')."""
        return bool(self._adapted or self._nested)

    def is_adapter(self, name: str) -> bool:
        """Whether ``name`` is an adapter's own parameter (no base checkpoint holds it)."""
        name = without_compile_wrapper(name)
        return any(name.startswith(prefix) for prefix in self._adapters)

    def file_name(self, name: str) -> Optional[str]:
        """The name the model's own files give the tensor ``name``; None for an adapter's parameter."""
        name = without_compile_wrapper(name)
        if self.is_adapter(name):
            return None
        for prefix in self._adapted:
            if name.startswith(prefix):
                name = prefix[: -len("base_layer.")] + name[len(prefix):]
                break
        for prefix in self._nested:
            if name.startswith(prefix):
                name = prefix[: -len("base_model.model.")] + name[len(prefix):]
        return name

    def mapping(self, names: Iterable[str]) -> dict[str, str]:
        """File name -> own name, for every name that is not an adapter's."""
        out: dict[str, str] = {}
        for name in names:
            file = self.file_name(name)
            if file is not None:
                out[file] = name
        return out
