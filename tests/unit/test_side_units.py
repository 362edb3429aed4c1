"""LLM-aware automatic units: large embeddings and the head (with the final norm) get units of their own.

The rule (``hp_lightning.core.units.side_units``): outside the blocks, the embeddings form one
unit and the Linear head plus the norms after the last block another, each only when its
parameters reach half the median block's bytes; modules that share a parameter with anything
outside their group (tied embeddings) stay in the root.
"""

from __future__ import annotations

import pytest
from torch import nn

from examples.gpt import GPT, GPTConfig
from hp_lightning.core.units import auto_units, select_modules, side_units


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


# ---------------------------------------------------------------- ties across automatic and named units


def tiny_bert_mlm() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(config)


def unit_names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    lookup = {id(m): n for n, m in model.named_modules()}
    return [lookup[id(m)] for m in units]


def test_no_split_unit_tied_to_the_root_is_left_to_the_root():
    bert = tiny_bert_mlm()  # BertEmbeddings (in _no_split_modules) holds the decoder's tied weight
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    units = auto_units(bert)
    assert unit_names(bert, units) == ["bert.encoder.layer.1", "bert.encoder.layer.0"]
    assert side_units(bert, units) == []  # the tied word embeddings cannot be a side unit either


class TiedBlocks(nn.Module):
    """Repeated blocks whose first layer is tied to the head, outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(3))
        self.head = nn.Linear(8, 8)
        self.head.weight = self.blocks[0][0].weight


def test_repeated_block_tied_outside_is_left_to_the_root():
    model = TiedBlocks()
    assert unit_names(model, auto_units(model)) == ["blocks.2", "blocks.1"]


def test_named_units_that_split_a_tie_are_refused_naming_both_modules_and_the_fix():
    bert = tiny_bert_mlm()
    with pytest.raises(ValueError) as caught:
        select_modules(bert, ["BertEmbeddings", "BertLayer"])
    message = str(caught.value)
    assert "'bert.embeddings.word_embeddings'" in message and "'cls.predictions.decoder'" in message
    assert "in unit 'bert.embeddings'" in message and "in the root" in message
    assert "drop 'bert.embeddings' (BertEmbeddings) from shard_modules" in message
    # Named units that keep the tie inside one unit are fine, and so is activation checkpointing.
    assert unit_names(bert, select_modules(bert, ["BertLayer"])) == ["bert.encoder.layer.1", "bert.encoder.layer.0"]
    assert select_modules(bert, ["BertEmbeddings"], option="activation_checkpointing")


def test_a_tie_between_two_named_units_names_both():
    model = TiedBlocks()
    model.head.weight = model.blocks[0][0].weight
    model.blocks[2][2].weight = model.blocks[0][0].weight
    with pytest.raises(ValueError, match=r"'blocks\.0\.0' \(Linear, in unit 'blocks\.0'\) and 'blocks\.2\.2' \(Linear, in unit 'blocks\.2'\)"):
        select_modules(model, ["blocks.*"])
