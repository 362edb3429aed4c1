"""Hugging Face decoder language models under pipeline parallelism, without a stage forward of the user's.

A ``*ForCausalLM`` (Llama, Qwen2, Mistral, Mixtral: ``lm_head`` around a decoder with
``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``) runs its whole forward every call: the
embeddings, every layer, the final norm and the head. Cut into stages
(:func:`~hp_lightning.parallel.pipeline.split_stage`), a stage holds its layers only, and that
forward would call the ``None`` left for another stage's piece (``'NoneType' object is not
callable``). :func:`adapt_hf_decoder_stages` makes HF's own forward run one stage instead, so the
LightningModule's ``forward`` (``self.net(input_ids=x).logits``) stays as it is for one process:

* a stage without the embeddings takes the hidden states it receives as ``inputs_embeds``
  (HF's forward then skips the embedding): a forward pre-hook on the decoder moves the stage's
  input from ``input_ids`` to ``inputs_embeds``;
* a stage without the final norm or the head gets a pass-through in their place (``nn.Identity``,
  :class:`StageOutput`), so it returns the hidden states its last layer computed, as ``.logits``. This placeholder is sound only
  because HF's forward applies them last, in this order (norm, then head), each to what came
  before; that is the structure :func:`find_hf_decoders` checks for;
* rotary tables (non-persistent buffers) stay on every stage, and each stage builds its own
  position ids and causal mask from the hidden states' length, as the whole model does: only the
  hidden states travel between stages.

Limits: the input is the token ids alone (no padding ``attention_mask``, no ``position_ids``,
no KV cache); a Mixtral's router auxiliary loss is not summed across stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: What :func:`find_hf_decoders` requires of a ``*ForCausalLM`` (its head) and of its decoder.
_HEAD_PIECES = ("model", "lm_head")
_DECODER_PIECES = ("embed_tokens", "layers", "norm")
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
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if not cls.__name__.endswith("ForCausalLM") or not cls.__module__.startswith("transformers."):
            continue
        children = module._modules
        decoder = children.get("model")
        if all(children.get(p) is not None for p in _HEAD_PIECES) and decoder is not None:
            pieces = decoder._modules
            order = [key for key in pieces if key in _DECODER_PIECES]
            in_forward_order = order == list(_DECODER_PIECES) and list(children).index("model") < list(children).index("lm_head")
            if all(pieces.get(p) is not None for p in _DECODER_PIECES) and isinstance(pieces["layers"], nn.ModuleList) and in_forward_order:
                found.append(name)
    return found


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
    if args:
        hidden, args = args[0], args[1:]
    else:
        hidden = kwargs.get("input_ids")
    if hidden is None:
        return args, kwargs  # already given as inputs_embeds
    kwargs = {**kwargs, "input_ids": None, "inputs_embeds": hidden}
    return args, kwargs


def adapt_hf_decoder_stages(model: nn.Module, decoders: list[str]) -> list[str]:
    """After the cut: make each HF causal LM found by :func:`find_hf_decoders` run this stage's part only.

    Args:
        model: the cut model, or one stage's view of it (several stages per rank).
        decoders: what :func:`find_hf_decoders` returned before the cut.

    Returns:
        What was adapted (``"<name>.model: input as inputs_embeds"``, ``"<name>.lm_head -> StageOutput"``...), for the log.

    A stage's pieces are a contiguous run of the forward's order (:func:`find_hf_decoders` checks
    that registration order is forward order), so a missing norm or head either ran on an earlier
    stage (its output is this stage's input) or runs on a later one: passing through is right.
    A decoder cut away whole (a split point at ``lm_head``) is left ``None``: that stage fails
    loudly, naming it.
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
        if pieces.get("norm") is None:
            decoder.norm = nn.Identity()
            done.append(f"{where}model.norm -> Identity")
        if lm._modules.get("lm_head") is None:
            lm.lm_head = StageOutput()
            done.append(f"{where}lm_head -> StageOutput")
    return done
