"""Tensor parallelism: torch's ``parallelize_module``, with plans written the way users write them.

The engine is torch's (:func:`torch.distributed.tensor.parallel.parallelize_module` and its
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` styles). This module adds what
a plan in a YAML file or a Hugging Face config needs:

* **style names** (Hugging Face's spelling) for the styles; :data:`TP_STYLES` lists them;
* **globs** over module names (``"blocks.*.attn.qkv"``), each of which must match something;
* the plan a Hugging Face model ships (``config.base_model_tp_plan``) found and prefixed with the
  base model's path, so ``tensor_parallel_size=2`` alone is enough for a ``LlamaForCausalLM``;
* recording for meta-device builds: parameters TP replaces are linked to their recorded
  construction first, so setup can initialize them exactly.

The trade-off TP makes: every rank of a TP group holds 1/T of each planned weight and computes
1/T of each planned matmul, paying one all-reduce (rowwise) per pair of layers in forward and
one in backward; the ranks of a TP group see the same batch. Keep TP inside a node.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any, Callable, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module

__all__ = ["TP_STYLES", "hf_tp_plan", "parallelize_module", "resolve_tp_plan", "tp_applied", "validate_tp_plan"]

StyleSpec = Union[str, ParallelStyle]

#: Style names accepted in plans (Hugging Face's names) → the torch style each stands for.
TP_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    # Linear: weight split on output features; input replicated, output sharded on the last dim.
    "colwise": ColwiseParallel,
    # Linear: weight split on input features; input sharded on the last dim, output all-reduced.
    "rowwise": RowwiseParallel,
    # Colwise, then the output gathered (e.g. an LM head whose logits every rank needs).
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # Embedding split on the vocabulary; token ids replicated, output all-reduced.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Norms and dropout on sequence-sharded activations.
    "sequence_parallel": SequenceParallel,
}

#: Module types torch's colwise/rowwise styles support.
_SPLITTABLE = (nn.Linear, nn.Embedding)


def validate_tp_plan(plan: Any, owner: str = "HSDPStrategy(tp_plan=...)") -> dict[str, StyleSpec] | None:
    """Check a plan's form (a mapping of non-empty glob → style name or ParallelStyle), before any process exists.

    Raises:
        TypeError: not a mapping, or keys/values of the wrong type.
        ValueError: an unknown style name.
    """
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{owner} expects a mapping of module-name glob to style name; got {type(plan).__name__} {plan!r}. "
            f"Example: {{'blocks.*.attn.qkv': 'colwise', 'blocks.*.attn.proj': 'rowwise'}}."
        )
    out: dict[str, StyleSpec] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"{owner} keys are non-empty module-name globs; got {pattern!r}.")
        if isinstance(style, str):
            if style not in TP_STYLES:
                raise ValueError(
                    f"{owner} maps {pattern!r} to the unknown style {style!r}; known styles: {sorted(TP_STYLES)}."
                )
        elif not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{owner} maps {pattern!r} to {type(style).__name__} {style!r}; expected a style name "
                f"({sorted(TP_STYLES)}) or a torch ParallelStyle."
            )
        out[pattern] = style
    return out


def _style(spec: StyleSpec) -> ParallelStyle:
    return TP_STYLES[spec]() if isinstance(spec, str) else spec


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, StyleSpec], owner: str = "tp_plan") -> dict[str, ParallelStyle]:
    """Expand the globs of ``plan`` to ``{module name: style}`` (the first matching pattern wins).

    Raises:
        ValueError: a pattern that matches no module, or a colwise/rowwise style on a module that
            is neither ``nn.Linear`` nor ``nn.Embedding``.
    """
    plan = validate_tp_plan(plan, owner) or {}
    modules = {name: module for name, module in model.named_modules() if name}
    resolved: dict[str, ParallelStyle] = {}
    for pattern, spec in plan.items():
        matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(
                f"{owner} pattern {pattern!r} matches no module of {type(model).__name__}; module names look like "
                f"{list(modules)[:8]}. Fix the pattern (globs over dotted names, e.g. 'layers.*.attn.q_proj')."
            )
        for name in matched:
            if name in resolved:
                continue
            style = _style(spec)
            if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(modules[name], _SPLITTABLE):
                raise ValueError(
                    f"{owner} gives {name!r} ({type(modules[name]).__name__}) the style {spec!r}, which splits "
                    f"nn.Linear and nn.Embedding weights only. Point the pattern at the Linear layers inside it."
                )
            resolved[name] = style
    return resolved


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The TP plans Hugging Face models inside ``model`` ship (``config.base_model_tp_plan``), prefixed.

    The plan's keys are relative to the base model (``model.model`` of a ``LlamaForCausalLM``);
    embeddings and the head are left out by Hugging Face and stay replicated over TP.
    """
    plan: dict[str, str] = {}
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        base_plan = getattr(config, "base_model_tp_plan", None)
        if not base_plan or not hasattr(module, "base_model_prefix"):
            continue
        prefix = module.base_model_prefix
        base = f"{path}.{prefix}" if path else prefix
        if not hasattr(module, prefix):  # ``module`` is the base model itself
            base = path
        for pattern, style in base_plan.items():
            key = f"{base}.{pattern}" if base else pattern
            plan.setdefault(key, style)
    return plan


def tp_applied(model: nn.Module, tp_mesh: DeviceMesh) -> bool:
    """Whether some parameter of ``model`` is already a DTensor on ``tp_mesh`` (TP applied by hand)."""
    return any(isinstance(p, DTensor) and p.device_mesh == tp_mesh for p in model.parameters())


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan: Mapping[str, StyleSpec] | ParallelStyle) -> nn.Module:
    """The seed's ``parallelize_module(model, mesh["tp"], tp_plan)``: torch's, with named styles and globs.

    ``parallelize_plan`` is a ParallelStyle for ``module`` itself, or a mapping of module-name
    globs to style names (:data:`TP_STYLES`) or ParallelStyles. Call it before ``fully_shard``;
    inside ``configure_model`` (meta device) it keeps the parameters' recorded construction, so
    the strategy initializes them after sharding as if the model had been built for real.

    Raises:
        TypeError / ValueError: a malformed plan, a pattern matching nothing, a style on the wrong module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module; got {type(module).__name__}.")
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        raise TypeError(
            f"parallelize_module expects the 1-D tensor-parallel sub-mesh (mesh['tp']); got "
            f"{type(device_mesh).__name__} {getattr(device_mesh, 'shape', '')}."
        )
    from hp_lightning.core.materialize import link_construction

    link_construction(module)
    if isinstance(parallelize_plan, ParallelStyle):
        return _torch_parallelize_module(module, device_mesh, parallelize_plan)
    return _torch_parallelize_module(module, device_mesh, resolve_tp_plan(module, parallelize_plan, "parallelize_module plan"))
