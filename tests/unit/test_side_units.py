"""LLM-aware automatic units: large embeddings and the head (with the final norm) get units of their own.

The rule (``hp_lightning.core.units.side_units``): outside the blocks, the embeddings form one
unit and the Linear head plus the norms after the last block another, each only when its
parameters reach half the median block's bytes; modules that share a parameter with anything
outside their group (tied embeddings) stay in the root.
"""

from __future__ import annotations

from torch import nn

from examples.gpt import GPT, GPTConfig
from hp_lightning.core.units import auto_units, side_units


def names(model: nn.Module, groups: list[list[nn.Module]]) -> list[list[str]]:
    lookup = {id(m): n for n, m in model.named_modules()}
    return [[lookup[id(m)] for m in group] for group in groups]


def test_large_vocabulary_gives_embeddings_and_head_units():
    gpt = GPT(GPTConfig(vocab_size=4096, n_layer=2, n_head=2, n_embd=32, block_size=16))
    assert names(gpt, side_units(gpt, auto_units(gpt))) == [["tok_emb", "pos_emb"], ["ln_f", "head"]]


def test_small_vocabulary_leaves_them_in_the_root():
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))  # 96 tokens: 3k vs 12k per block
    assert side_units(gpt, auto_units(gpt)) == []


def test_tied_embeddings_stay_in_the_root():
    gpt = GPT(GPTConfig(vocab_size=4096, n_layer=2, n_head=2, n_embd=32, block_size=16))
    gpt.head.weight = gpt.tok_emb.weight  # one parameter cannot belong to two units
    assert side_units(gpt, auto_units(gpt)) == []


def test_no_blocks_no_side_units():
    model = nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 1000))
    assert side_units(model, auto_units(model)) == []
