"""Hugging Face decoder language models under pipeline parallelism, without a stage forward of the user's.

A ``*ForCausalLM`` (Llama, Qwen2, Mistral, Mixtral) runs its whole forward every call, so a stage
holding only some pieces would call the ``None`` left for another stage's.
:func:`adapt_hf_decoder_stages` makes HF's own forward run one stage, so the LightningModule's
``forward`` stays as it is: a stage without the embeddings takes the hidden states it receives as
``inputs_embeds`` (a forward pre-hook on the decoder); one without the final norm or head gets a
pass-through in their place (``nn.Identity``, :class:`StageOutput`), sound only because HF applies
them last, in this order (:func:`find_hf_decoders` checks); rotary tables stay on every stage.

Limits: token ids alone (no padding ``attention_mask``, ``position_ids`` or KV cache); a
Mixtral's router auxiliary loss is not summed across stages. Any other Hugging Face model the
split points cut is refused at setup (:func:`refuse_hf_models_the_adapter_cannot_run`) unless the
LightningModule says its forward is stage-aware (:data:`STAGE_FORWARD_ATTR`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

#: What :func:`find_hf_decoders` requires of a ``*ForCausalLM`` (its head) and of its decoder.
_HEAD_PIECES = ("model", "lm_head")
_DECODER_PIECES = ("embed_tokens", "layers", "norm")
#: ``pipeline_stage_forward = True`` on the LightningModule says its ``forward`` runs one stage itself
#: (opting out of :func:`refuse_hf_models_the_adapter_cannot_run`): a marker, since whether a forward
#: calls the HF model cannot be seen before it runs.
STAGE_FORWARD_ATTR = "pipeline_stage_forward"
#: Marks a decoder whose stage input is routed to ``inputs_embeds`` (so a second setup does not add a second hook).
_ROUTED_ATTR = "_hp_stage_input_routed"


def find_hf_decoders(model: nn.Module) -> list[str]:
    """The Hugging Face ``*ForCausalLM`` modules inside ``model`` with the structure the stage forward needs.

    That is: ``model`` (the decoder: ``embed_tokens``, an ``nn.ModuleList`` ``layers``, ``norm``)
    and ``lm_head`` children, registered in the order the forward runs them, a ``transformers``
    class. Call it before the cut (the pieces are still modules then).

    Returns:
        The name of each, in registration order.
    """
    return [name for name, module in model.named_modules() if _why_not_adapted(module) is None]


def _is_hf_model(module: nn.Module) -> bool:
    """A ``transformers`` ``PreTrainedModel`` (read from the class hierarchy: ``transformers`` need not be installed)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def _why_not_adapted(module: nn.Module) -> Optional[str]:
    """What :func:`find_hf_decoders` misses in a module: the class, or the pieces missing / out of forward order (None: nothing)."""
    bases = [c for c in type(module).__mro__ if c.__name__.endswith("ForCausalLM") and c.__module__.startswith("transformers.")]
    if not bases:
        return f"it is not a *ForCausalLM (its children: {list(module._modules)})"
    if getattr(type(module), "forward", None) is not getattr(bases[0], "forward", None):
        return f"its class overrides the forward of transformers' {bases[0].__name__} (the adapter runs that forward only)"
    children = module._modules
    missing = [p for p in _HEAD_PIECES if children.get(p) is None]
    decoder = children.get("model")
    if decoder is not None:
        pieces = decoder._modules
        missing += [f"model.{p}" for p in _DECODER_PIECES if pieces.get(p) is None]
        if pieces.get("layers") is not None and not isinstance(pieces["layers"], nn.ModuleList):
            missing.append(f"model.layers as an nn.ModuleList (it is a {type(pieces['layers']).__name__})")
    if missing:
        return f"it lacks {', '.join(missing)}"
    order = [f"model.{key}" for key in decoder._modules if key in _DECODER_PIECES] if decoder is not None else []
    head_order = [key for key in children if key in _HEAD_PIECES]
    if order == [f"model.{p}" for p in _DECODER_PIECES] and head_order == list(_HEAD_PIECES):
        return None
    return f"its pieces are registered in the order {order} / {head_order}, not the forward's"


def refuse_hf_models_the_adapter_cannot_run(model: nn.Module, split_points: list[str], where: str) -> None:
    """Refuse, at setup, a Hugging Face model the split points cut whose forward the stage adapter cannot run.

    Call it before the cut: it reads only structure and names, so every rank decides alike. Checked:
    every outermost ``transformers`` model :func:`find_hf_decoders` does not recognise that a split
    point falls strictly inside. Skipped under :data:`STAGE_FORWARD_ATTR`.

    Args:
        model: the LightningModule, whole (before the cut; the meta device is fine).
        split_points: the module names where stages 1, 2, ... start.
        where: the option's owner, for the message (``"HSDPStrategy(pipeline_parallel_size=2)"``).

    Raises:
        ValueError: naming the model's class and place, the split point inside it and the fixes.
    """
    if getattr(model, STAGE_FORWARD_ATTR, False) is True:
        return
    adapted = find_hf_decoders(model)
    outer: list[str] = []
    for name, module in model.named_modules():
        if not name or not _is_hf_model(module) or any(name == o or name.startswith(f"{o}.") for o in outer):
            continue
        outer.append(name)
        if name in adapted:
            head = f"{name}.lm_head"
            if head in split_points:  # the head alone on a stage: HF's forward would call the decoder that stage lacks
                raise ValueError(
                    f"{where}: split point {head!r} puts the head of the Hugging Face {type(module).__name__} at {name!r} "
                    f"on a stage of its own, but its forward runs the decoder ({name}.model) before the head, and that "
                    f"stage would hold none of it. Split at {name + '.model.norm'!r} instead (the last stage then runs the "
                    f"final norm and the head), or at a layer ({name + '.model.layers.<i>'!r}), or use "
                    f"pipeline_split_points: auto."
                )
            continue
        inside = [point for point in split_points if point.startswith(f"{name}.")]
        if not inside:
            continue
        raise ValueError(
            f"{where}: split point {inside[0]!r} cuts the Hugging Face {type(module).__name__} at {name!r}, whose own forward "
            f"always runs every piece, so a stage lacking one would fail at its first step ('NoneType' object is not callable). "
            f"The pipeline runs a cut Hugging Face model only for a *ForCausalLM with model.embed_tokens, model.layers (an "
            f"nn.ModuleList), model.norm and lm_head, registered in that (forward) order; {_why_not_adapted(module)}. Fix: write a "
            f"stage-aware forward on {type(model).__name__} (run the pieces this stage holds, skip those that are None, take "
            f"hidden states on later stages, e.g. iterate the model's block list yourself) and set "
            f"`{STAGE_FORWARD_ATTR} = True` on it; or keep the model whole on one stage (split points outside {name!r}); or "
            f"use a model with the structure above."
        )


class StageOutput(nn.Module):
    """The head's place on a stage before the last: the hidden states, as a tensor of their own.

    HF's forward hands the head a slice of the hidden states (``logits_to_keep``), a view; torch's
    zero-bubble schedules detach a stage's outputs in place, which a view refuses, so a view is
    copied (one hidden-state tensor per micro-batch); anything else passes as it is.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.clone() if hidden._base is not None else hidden


def _route_stage_input(decoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a decoder without its embeddings: the stage's input is hidden states, given as ``inputs_embeds``."""
    if decoder._modules.get("embed_tokens") is not None:
        return args, kwargs
    hidden = args[0] if args else kwargs.get("input_ids")
    args = args[1:]
    if hidden is None:
        return args, kwargs  # already given as inputs_embeds
    return args, {**kwargs, "input_ids": None, "inputs_embeds": hidden}


def adapt_hf_decoder_stages(model: nn.Module, decoders: list[str]) -> list[str]:
    """After the cut: make each HF causal LM found by :func:`find_hf_decoders` run this stage's part only.

    Args:
        model: the cut model, or one stage's view of it (several stages per rank).
        decoders: what :func:`find_hf_decoders` returned before the cut.

    Returns:
        What was adapted (``"<name>.lm_head -> StageOutput"``...), for the log.

    A stage's pieces are a contiguous run of the forward's order, so a missing norm or head ran on
    an earlier stage or runs on a later one: passing through is right. A decoder cut away whole is
    left ``None`` (that stage fails loudly, naming it).
    """
    done = []
    for name in decoders:
        lm = model.get_submodule(name)
        decoder = lm._modules.get("model")
        if decoder is None:
            continue
        where = f"{name}." if name else ""
        pieces = decoder._modules
        if pieces.get("embed_tokens") is None and not getattr(decoder, _ROUTED_ATTR, False):
            decoder.register_forward_pre_hook(_route_stage_input, with_kwargs=True)
            object.__setattr__(decoder, _ROUTED_ATTR, True)
            done.append(f"{where}model: input as inputs_embeds")
        if pieces.get("layers") is None:  # a stage of the final norm (and head) alone: no layer to run
            decoder.layers = nn.ModuleList()
            done.append(f"{where}model.layers -> empty")
        if pieces.get("norm") is None:
            decoder.norm = nn.Identity()
            done.append(f"{where}model.norm -> Identity")
        if lm._modules.get("lm_head") is None:
            lm.lm_head = StageOutput()
            done.append(f"{where}lm_head -> StageOutput")
    return done
