"""Tensor parallelism: torch's ``parallelize_module``, with plans written the way users write them.

The engine is torch's; this module adds Hugging Face's style names (:data:`TP_STYLES`), globs over
module names that must each match something, the plan a Hugging Face model ships
(``config.base_model_tp_plan``, prefixed with the base model's path), and recorded construction
kept for meta-device builds. Trade-off: each TP rank holds and computes ``1/T`` of each planned
layer, paying one all-reduce per pair of layers in forward and one in backward, and the ranks of a
TP group see the same batch. Keep TP inside a node.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module

from hp_lightning.core.checks import TP_STYLES, StyleSpec, validate_tp_plan
from hp_lightning.core.materialize import link_construction
from hp_lightning.core.mesh import TP_DIM_NAMES

__all__ = ["TP_STYLES", "hf_tp_plan", "parallelize_module", "resolve_tp_plan", "tp_applied", "validate_tp_plan"]

#: Module types torch's colwise/rowwise styles support.
_SPLITTABLE = (nn.Linear, nn.Embedding)


def _unsplittable_message(owner: str, name: str, module: nn.Module, spec: StyleSpec) -> str:
    """Why ``module`` cannot take a colwise/rowwise style, and what to do instead."""
    cls = type(module).__name__
    inner = [n for n, m in module.named_modules() if n and isinstance(m, _SPLITTABLE)]
    head = (
        f"{owner} gives {name!r} ({cls}) the style {spec!r}, which splits nn.Linear and nn.Embedding weights "
        f"only (torch's ColwiseParallel / RowwiseParallel)."
    )
    if inner:
        return f"{head} Point the pattern at the layers inside it: {[f'{name}.{n}' for n in inner[:6]]}."
    convs = [n for n, m in module.named_modules() if type(m).__name__ == "Conv1D" and hasattr(m, "nf")]
    if convs:
        where = "it is" if convs == [""] else f"it holds {[f'{name}.{n}' for n in convs[:6]]}, which are"
        return (
            f"{head} {where} Hugging Face's Conv1D (GPT-2 style, weight stored as [in, out]), which torch's "
            f"ParallelStyles do not support. Leave it out of the plan (it stays whole on every TP rank, still "
            f"sharded by FSDP), or replace the Conv1D layers by nn.Linear (weight = conv.weight.T) in "
            f"configure_model before TP."
        )
    return (
        f"{head} {cls} holds no such layer. Leave it out of the plan (it stays whole on every TP rank, still "
        f"sharded by FSDP), or give it a torch ParallelStyle written for {cls}."
    )


#: Attribute names under which attention modules keep their head count.
_HEAD_COUNT_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_heads")


def _forward_reads(module: nn.Module, attr: str) -> bool:
    """Whether ``type(module).forward``'s source visibly reads ``self.<attr>`` (False when it cannot be read)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{attr}\b", source) is not None


def check_head_split(model: nn.Module, resolved: Mapping[str, ParallelStyle], owner: str) -> None:
    """Refuse a colwise split of an attention projection whose module computes with its full head count.

    Colwise TP leaves each rank ``1/T`` of the heads; a module whose ``forward`` reads its head
    count (``self.n_heads`` in T5's attention) would fail deep in forward or compute wrong numbers,
    while one that infers it (``view(..., -1, head_dim)``, Llama) passes. Checked: the parent of each
    colwise ``nn.Linear``, its int head-count attributes, and its ``forward``'s source.

    Raises:
        ValueError: naming the module, the attribute, the projection and the fix.
    """
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        layer = modules.get(name)
        if not isinstance(style, ColwiseParallel) or not isinstance(layer, nn.Linear) or "." not in name:
            continue
        parent_name = name.rpartition(".")[0]
        parent = modules[parent_name]
        for attr in _HEAD_COUNT_ATTRS:
            heads = getattr(parent, attr, None)
            if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0 or layer.out_features % heads:
                continue
            if _forward_reads(parent, attr):
                cls = type(parent).__name__
                raise ValueError(
                    f"{owner} splits {name!r} colwise, so each TP rank holds 1/tensor_parallel_size of the heads of "
                    f"{parent_name!r} ({cls}, {attr}={heads}); but {cls}.forward computes with self.{attr}, the full "
                    f"head count (T5's attention builds its relative-attention bias for all heads), so its shapes "
                    f"would not match on any rank. Leave the projections of {parent_name!r} out of the plan "
                    f"(split the MLPs only), or apply TP yourself in configure_model with "
                    f"hp_lightning.parallelize_module and set {attr} (and whatever else holds all heads) to the "
                    f"local count."
                )


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, StyleSpec], owner: str = "tp_plan", *, check_heads: bool = True) -> dict[str, ParallelStyle]:
    """Expand the globs of ``plan`` to ``{module name: style}`` (the first matching pattern wins).

    Args:
        plan: module-name glob -> style name or ParallelStyle.
        owner: the option's name, for messages.
        check_heads: refuse head splits :func:`check_head_split` refuses (``parallelize_module``'s
            caller may set the local head count after the call instead).

    Raises:
        ValueError: a pattern that matches no module, a colwise/rowwise style on neither ``nn.Linear`` nor ``nn.Embedding``, or a bad head split.
    """
    if isinstance(plan, HFTPPlan):
        _refuse_hf_styles(model, plan)
        owner = f"{owner} (here {plan.source}, as tp_plan was not given)"
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
            style = TP_STYLES[spec]() if isinstance(spec, str) else spec
            if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(modules[name], _SPLITTABLE):
                raise ValueError(_unsplittable_message(owner, name, modules[name], spec))
            resolved[name] = style
    if check_heads:
        check_head_split(model, resolved, owner)
    return resolved


class HFTPPlan(dict):
    """A TP plan read from Hugging Face configs; ``source`` says where it came from (for messages)."""

    source: str = "a Hugging Face config's base_model_tp_plan"


def _refuse_hf_styles(model: nn.Module, plan: HFTPPlan) -> None:
    """Refuse Hugging Face's own styles (``packed_colwise``, ``moe_tp_experts``, ...), which torch has no counterpart of.

    The message lists the entries torch can apply, as a ``tp_plan`` to pass instead.

    Raises:
        ValueError: naming the source, the entries and the plan to pass.
    """
    unknown = {k: v for k, v in plan.items() if isinstance(v, str) and v not in TP_STYLES}
    if not unknown:
        return
    modules = {name: module for name, module in model.named_modules() if name}
    usable = {
        pattern: style
        for pattern, style in plan.items()
        if pattern not in unknown
        and any(fnmatch.fnmatchcase(n, pattern) and isinstance(m, _SPLITTABLE) for n, m in modules.items())
    }
    raise ValueError(
        f"tensor_parallel_size > 1 without tp_plan uses the plan Hugging Face ships, {plan.source}; it maps "
        f"{unknown} to Hugging Face's own styles {sorted(set(unknown.values()))}, which split 3-D expert parameters "
        f"([num_experts, ...]) inside Hugging Face's TP engine and have no torch ParallelStyle (hp_lightning applies "
        f"torch's: {sorted(TP_STYLES)}). Pass tp_plan={usable} to split what torch can (the experts then stay whole "
        f"over TP, still sharded by FSDP), and/or split the experts over ranks with expert_parallel_size."
    )


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The TP plans Hugging Face models inside ``model`` ship (``config.base_model_tp_plan``), prefixed.

    Embeddings and the head are left out by Hugging Face and stay replicated over TP. The result is
    an :class:`HFTPPlan`, so that errors say where the plan came from.
    """
    plan = HFTPPlan()
    sources: list[str] = []
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
            plan.setdefault(f"{base}.{pattern}" if base else pattern, style)
        sources.append(f"{type(module).__name__}'s config.base_model_tp_plan" + (f" (at {path!r})" if path else ""))
    if sources:
        plan.source = ", ".join(dict.fromkeys(sources))
    return plan


def tp_applied(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is already split by tensor parallelism (TP applied by hand).

    Recognized on any mesh with a ``tp`` / ``tensor_parallel`` dim: the user's TP mesh alone, or the
    2-D ``(shard, tp)`` mesh their own ``fully_shard`` leaves after it.
    """
    return any(isinstance(p, DTensor) and TP_DIM_NAMES & set(p.device_mesh.mesh_dim_names or ()) for p in model.parameters())


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan: Mapping[str, StyleSpec] | ParallelStyle) -> nn.Module:
    """The seed's ``parallelize_module(model, mesh["tp"], tp_plan)``: torch's, with named styles and globs.

    ``parallelize_plan`` is a ParallelStyle for ``module`` itself, or a mapping of module-name
    globs to style names (:data:`TP_STYLES`) or ParallelStyles. Call it before ``fully_shard``
    (inside ``configure_model`` it keeps the recorded construction). Head counts are not checked:
    set a module's to the local count after this call (``attn.n_heads //= tp``), as torchtitan does.

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
    link_construction(module)
    if isinstance(parallelize_plan, ParallelStyle):
        return _torch_parallelize_module(module, device_mesh, parallelize_plan)
    resolved = resolve_tp_plan(module, parallelize_plan, "parallelize_module plan", check_heads=False)
    return _torch_parallelize_module(module, device_mesh, resolved)
