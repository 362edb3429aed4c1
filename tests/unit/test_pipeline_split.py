"""How a model is cut into pipeline stages (no process group): names kept, pieces removed, errors."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from hp_lightning.parallel.pipeline import split_stage, stage_units
from tests.pipeline_models import PipelinedModule, StagedNet


def test_units_follow_registration_order_down_to_the_split_points() -> None:
    model = PipelinedModule()
    assert stage_units(model, ["net.blocks.2"]) == ["net.inp", "net.blocks.0", "net.blocks.1", "net.blocks.2", "net.blocks.3", "net.head"]
    assert stage_units(model, ["net.head"]) == ["net.inp", "net.blocks", "net.head"]  # blocks stay whole


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_stage_keeps_its_units_under_their_own_names(stage: int) -> None:
    torch.manual_seed(0)
    whole = PipelinedModule()
    torch.manual_seed(0)
    model = PipelinedModule()
    kept, removed = split_stage(model, ["net.blocks.1", "net.blocks.3"], stage)
    expected = [["net.inp", "net.blocks.0"], ["net.blocks.1", "net.blocks.2"], ["net.blocks.3", "net.head"]][stage]
    assert kept == expected
    names = {n for n, _ in model.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters() if any(n.startswith(u + ".") for u in expected)}
    assert [k for k, _ in model.net.blocks.named_children()] == [["0"], ["1", "2"], ["3"]][stage]  # keys kept
    assert model.net.blocks[0] is model.net.blocks.get_submodule(["0", "1", "3"][stage])  # index = held entry
    assert pickle.loads(pickle.dumps(model)).net.blocks[0].fc1.weight.shape == model.net.blocks[0].fc1.weight.shape
    assert (model.net.inp is None) == (stage != 0) and (model.net.head is None) == (stage != 2)
    # The stages in sequence compute what the whole model computes.
    x = torch.randn(3, 8)
    h = x
    for s in range(3):
        torch.manual_seed(0)
        part = PipelinedModule()
        split_stage(part, ["net.blocks.1", "net.blocks.3"], s)
        h = part(h)
    torch.testing.assert_close(h, whole(x))


def test_module_dict_entries_are_deleted_and_stateless_modules_kept() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
            self.act = nn.ReLU()

    model = Model()
    kept, removed = split_stage(model, ["layers.b"], 1)
    assert kept == ["layers.b", "act"] and removed == ["layers.a"] and list(model.layers) == ["b"]
    assert isinstance(model.act, nn.ReLU)  # no state: every stage keeps it


def test_bad_split_points_are_named() -> None:
    model = PipelinedModule()
    with pytest.raises(ValueError, match=r"\['net.blocks.9'\] are not modules the model can be cut at.*net.blocks.3"):
        stage_units(model, ["net.blocks.9"])
    with pytest.raises(ValueError, match="must follow the model's order"):
        stage_units(model, ["net.blocks.3", "net.blocks.1"])
    with pytest.raises(ValueError, match="leave a first stage"):
        stage_units(model, ["net.inp"])


def test_parameters_on_the_way_to_a_split_point_are_refused() -> None:
    net = StagedNet()
    net.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"\['scale'\] belong to 'the root module' itself, on the way to a split point"):
        stage_units(net, ["blocks.2"])


def test_a_batch_that_is_not_an_input_target_pair_is_refused_not_truncated() -> None:
    from hp_lightning import HSDPStrategy

    strategy = HSDPStrategy()
    x, y, mask = torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(2)
    assert strategy._pipeline_batch(((x, y),), {})[1] is y
    with pytest.raises(TypeError, match="cannot tell input from target in a tuple of 3.*pipeline_batch"):
        strategy._pipeline_batch(((x, y, mask),), {})


class EncoderLM(nn.Module):
    """torch's own ``nn.TransformerEncoder`` between an embedding and a head (a user's model, not ours)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.head = nn.Linear(16, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        h = self.encoder(h)
        return self.head(h) if self.head is not None else h


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torchs_transformer_encoder_is_cut_between_its_layers(mode: str) -> None:
    torch.manual_seed(0)
    whole = EncoderLM().train(mode == "train")
    tokens = torch.randint(0, 50, (3, 7))
    h = tokens
    for stage in range(2):
        part = EncoderLM()
        part.load_state_dict(whole.state_dict())
        kept, _ = split_stage(part, ["encoder.layers.2"], stage)
        assert kept == [["emb", "encoder.layers.0", "encoder.layers.1"], ["encoder.layers.2", "encoder.layers.3", "head"]][stage]
        assert set(part.state_dict()) == {k for k in whole.state_dict() if any(k.startswith(u + ".") for u in kept)}
        h = part.train(mode == "train")(h)  # the encoder reads self.layers[0] and loops over what it holds
    torch.testing.assert_close(h, whole(tokens))


def test_sequential_entries_are_deleted_and_the_rest_run_in_order() -> None:
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    h = x
    for stage in range(2):
        part = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
        part.load_state_dict(whole.state_dict())
        split_stage(part, ["2"], stage)
        assert [k for k, _ in part.named_children()] == [["0", "1"], ["1", "2", "3"]][stage]  # ReLU: stateless, kept
        h = part(h)
    torch.testing.assert_close(h, whole(x))


def test_a_hugging_face_decoder_cut_fails_loudly_not_silently() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    model = transformers.LlamaModel(config)
    kept, removed = split_stage(model, ["layers.1"], 0)  # HF's forward calls self.norm unconditionally
    assert removed == ["layers.1", "norm"] and model.rotary_emb is not None  # non-persistent tables stay everywhere
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        model(torch.randint(0, 64, (1, 5)))


def test_split_points_inside_a_block_are_refused_naming_the_block_and_the_cut_points() -> None:
    model = PipelinedModule()
    with pytest.raises(ValueError) as caught:
        stage_units(model, ["net.blocks.2.fc1"])  # cut inside block 2: neither stage could run it
    message = str(caught.value)
    assert "pipeline_split_points=['net.blocks.2.fc1']" in message
    assert "'net.blocks.2.fc1' lies inside the block 'net.blocks.2' (Block)" in message
    assert "use ['net.blocks.2']" in message and "'net.blocks.3', 'net.head'" in message
    with pytest.raises(ValueError, match=r"'net.blocks.3.norm' lies inside the block 'net.blocks.3'"):
        stage_units(model, ["net.blocks.1", "net.blocks.3.norm"])


def test_split_points_inside_a_hugging_face_no_split_module_are_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp' lies inside the block 'model.layers.1' \(LlamaDecoderLayer\)"):
        stage_units(model, ["model.layers.1.mlp"])
    assert "model.layers.1" in stage_units(model, ["model.layers.1"])
