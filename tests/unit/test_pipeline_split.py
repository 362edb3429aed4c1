"""How a model is cut into pipeline stages (no process group): names kept, pieces removed, errors."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from hp_lightning.parallel.pipeline import auto_split_points, find_block_list, plan_table, resolve_split_points, split_stage, stage_plan, stage_units
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
    whole = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    h = x
    for stage in range(2):
        part = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
        part.load_state_dict(whole.state_dict())
        split_stage(part, ["2"], stage)
        # A stateless entry runs on its own stage only: kept on both, GELU would run twice (a silent wrong result).
        assert [k for k, _ in part.named_children()] == [["0", "1"], ["2", "3", "4"]][stage]
        h = part(h)
    torch.testing.assert_close(h, whole(x))


def test_stateless_container_entries_cut_on_the_meta_device_are_put_back_in_order_for_materialization() -> None:
    from hp_lightning.core.materialize.stage_units import _units_put_back

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    kept, removed = split_stage(model, ["2"], 1)
    assert removed == ["0", "1"] and list(model._modules) == ["2", "3", "4"]
    with _units_put_back(model):  # what materialize replays the whole build on
        assert list(model._modules) == ["0", "1", "2", "3", "4"]
    assert list(model._modules) == ["2", "3", "4"]


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


# ------------------------------------------------------------------ automatic split points (no processes)


def _stage_bytes(model: nn.Module, units: list[str]) -> int:
    """Bytes of the parameters named under ``units``, counted from ``named_parameters`` (independently of the planner)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if any(n.startswith(u + ".") for u in units))


def _best_largest_stage(model: nn.Module, entries: list[str], stages: int) -> int:
    """The smallest largest stage over every way to cut ``entries`` into ``stages`` non-empty runs (brute force)."""
    import itertools

    best = None
    for cut in itertools.combinations(range(1, len(entries)), stages - 1):
        plans = [p.param_bytes for p in stage_plan(model, [entries[i] for i in cut])]
        best = max(plans) if best is None else min(best, max(plans))
    assert best is not None
    return best


def _tiny_llama(layers: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_auto_splits_balance_the_example_gpt_by_parameter_bytes_on_the_meta_device(stages: int) -> None:
    from examples.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=65, block_size=16, n_layer=6, n_head=2, n_embd=32)
    with torch.device("meta"):
        model = GPT(config)
    points = auto_split_points(model, stages)
    plans = stage_plan(model, points)
    assert len(points) == stages - 1 and all(p.startswith("blocks.") for p in points)
    assert {"tok_emb", "pos_emb"} <= set(plans[0].units) and {"ln_f", "head"} <= set(plans[-1].units)
    assert all(any(u.startswith("blocks.") for u in p.units) for p in plans)  # every stage runs at least one block
    for plan in plans:  # the bytes shown are the stage's parameters, embeddings and head included
        assert plan.param_bytes == _stage_bytes(model, list(plan.units))
    entries = [f"blocks.{i}" for i in range(config.n_layer)]
    assert max(p.param_bytes for p in plans) == _best_largest_stage(model, entries, stages)
    torch.manual_seed(123)  # the same points from a real build: sizes only, never values
    assert auto_split_points(GPT(config), stages) == points
    table = plan_table(plans, ranks=list(range(stages)))
    assert f"Pipeline stages ({stages})" in table and f"stage 0 on pipeline rank 0: {plans[0].param_bytes:,} bytes" in table


def test_auto_splits_on_a_tiny_hugging_face_llama_and_the_cut_they_make() -> None:
    model = _tiny_llama(layers=5)
    entries = [f"model.layers.{i}" for i in range(5)]
    for stages in (2, 4):
        points = auto_split_points(model, stages)
        plans = stage_plan(model, points)
        assert points == sorted(points, key=entries.index) and set(points) <= set(entries[1:])
        assert plans[0].units[0] == "model.embed_tokens" and {"model.norm", "lm_head"} <= set(plans[-1].units)
        assert max(p.param_bytes for p in plans) == _best_largest_stage(model, entries, stages)
        assert sum(p.param_bytes for p in plans) == _stage_bytes(model, ["model", "lm_head"])  # nothing lost, nothing twice
    # The heavy embedding and head pull blocks away from the first and last stage.
    plans = stage_plan(model, auto_split_points(model, 4))
    assert len(plans[0].units) == 2 and len(plans[-1].units) == 4  # embed + 1 layer; 1 layer + norm, rotary, head
    points = auto_split_points(model, 2)
    planned = stage_plan(model, points)
    kept, _ = split_stage(model, points, 1)  # the cut keeps what the plan shows
    assert kept == list(planned[1].units)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == planned[1].param_bytes


def test_auto_splits_of_a_pipelined_module_find_its_blocks_and_options_default_to_auto() -> None:
    from hp_lightning.core.options import HSDPOptions

    assert HSDPOptions(pipeline_parallel_size=2).pipeline_split_points == "auto"
    assert HSDPOptions(pipeline_parallel_size=2, pipeline_split_points="auto").pipeline_split_points == "auto"
    assert HSDPOptions(pipeline_split_points="auto").pipeline_split_points is None  # no pipeline: nothing to cut
    assert HSDPOptions(pipeline_parallel_size=2, pipeline_split_points=["net.blocks.1"]).pipeline_split_points == ["net.blocks.1"]
    with pytest.raises(TypeError, match=r"expects 'auto' or a list of module names; got str 'net.blocks.2'"):
        HSDPOptions(pipeline_parallel_size=2, pipeline_split_points="net.blocks.2")
    model = PipelinedModule()
    assert find_block_list(model) == "net.blocks"
    assert resolve_split_points(model, "auto", 4) == ["net.blocks.1", "net.blocks.2", "net.blocks.3"]
    assert resolve_split_points(model, ["net.blocks.3"], 2) == ["net.blocks.3"]  # explicit points kept as given


def test_auto_splits_refuse_models_they_cannot_cut_into_the_stages_asked_for() -> None:
    with pytest.raises(ValueError, match=r"4 stages .* need at least one block each, but 'model.layers' holds 2\. Use fewer stages"):
        auto_split_points(_tiny_llama(layers=2), 4)
    with pytest.raises(ValueError, match=r"balances stages over the entries of a list of blocks.*Linear has none.*Name the split points"):
        auto_split_points(nn.Linear(4, 4), 2)
    # A list inside a block (a mixture of experts' experts) is not where stages start: cutting it would cut the block.
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))

    class OneBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Experts()])

    with pytest.raises(ValueError, match="OneBlock has none"):
        auto_split_points(OneBlock(), 2)
    net = StagedNet()
    net.scale = nn.Parameter(torch.ones(()))  # on the way to every block: no stage could own it
    with pytest.raises(ValueError, match=r"\['scale'\] belong to 'the root module' itself"):
        auto_split_points(net, 2)


# ------------------------------------------------------------------ Hugging Face decoders under PP (no processes)


class HFWrapper(nn.Module):
    """What a user's LightningModule holds and calls, unchanged for one process: ``self.net(input_ids=x).logits``."""

    def __init__(self, kind: str = "llama") -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        if kind == "qwen2":
            config: Any = transformers.Qwen2Config(
                vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1
            )
            self.net = transformers.Qwen2ForCausalLM(config)
        else:
            config = transformers.LlamaConfig(
                vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2
            )
            self.net = transformers.LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x).logits


@pytest.mark.parametrize(("kind", "stages"), [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_hugging_face_causal_lms_run_their_own_forward_one_stage_at_a_time(kind: str, stages: int) -> None:
    from hp_lightning.parallel.pipeline_hf import adapt_hf_decoder_stages, find_hf_decoders

    torch.manual_seed(0)
    whole = HFWrapper(kind).eval()
    tokens = torch.randint(0, 96, (2, 7))
    points = auto_split_points(whole, stages)
    h: torch.Tensor = tokens
    for stage in range(stages):
        part = HFWrapper(kind).eval()
        part.load_state_dict(whole.state_dict())
        decoders = find_hf_decoders(part)
        assert decoders == ["net"]
        split_stage(part, points, stage)
        adapted = adapt_hf_decoder_stages(part, decoders)
        assert ("net.model: input as inputs_embeds" in adapted) == (stage > 0)
        assert ("net.lm_head -> StageOutput" in adapted) == (stage < stages - 1)
        assert set(part.state_dict()) <= set(whole.state_dict())  # the placeholders hold nothing a checkpoint sees
        h = part(h)  # the user's forward, HF's own forward inside: embeddings / layers / norm + head as this stage holds them
        assert h._base is None  # a tensor of its own: torch's zero-bubble schedules detach stage outputs in place
        assert h.shape[-1] == (96 if stage == stages - 1 else 16)
    torch.testing.assert_close(h, whole(tokens))


def test_only_hugging_face_causal_lms_with_a_decoder_in_forward_order_are_adapted() -> None:
    from hp_lightning.parallel.pipeline_hf import find_hf_decoders

    assert find_hf_decoders(PipelinedModule()) == []  # our own models keep their own forward
    model = HFWrapper()
    pieces = model.net._modules["model"]._modules
    embed = pieces.pop("embed_tokens")
    pieces["embed_tokens"] = embed  # registered after the norm: registration order is no longer the forward's
    assert find_hf_decoders(model) == []


def test_a_cut_hugging_face_model_the_stage_forward_cannot_run_is_refused_before_the_cut() -> None:
    from hp_lightning.parallel.pipeline_hf import refuse_hf_models_the_adapter_cannot_run

    transformers = pytest.importorskip("transformers")
    where = "HSDPStrategy(pipeline_parallel_size=2)"

    class GPT2Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
            self.model = transformers.GPT2LMHeadModel(config)

    # GPT-2: not a *ForCausalLM; its forward always runs wte / wpe / ln_f. Refused, naming the class, the cut and both fixes.
    with pytest.raises(ValueError) as caught:
        refuse_hf_models_the_adapter_cannot_run(GPT2Holder(), ["model.transformer.h.2"], where)
    message = str(caught.value)
    assert message.startswith(f"{where}: split point 'model.transformer.h.2' cuts the Hugging Face GPT2LMHeadModel at 'model'"), message
    assert "model.embed_tokens, model.layers (an nn.ModuleList), model.norm and lm_head" in message
    assert "it is not a *ForCausalLM (its children: ['transformer', 'lm_head'])" in message
    assert "set `pipeline_stage_forward = True`" in message and "GPT2Holder" in message
    # Kept whole on one stage (the cut is outside it), or a stage-aware forward declared: nothing to refuse.
    refuse_hf_models_the_adapter_cannot_run(GPT2Holder(), ["model"], where)
    opted_out = GPT2Holder()
    opted_out.pipeline_stage_forward = True  # type: ignore[assignment]
    refuse_hf_models_the_adapter_cannot_run(opted_out, ["model.transformer.h.2"], where)

    # A Llama the adapter runs passes; the same Llama with its embeddings registered after the norm does not.
    llama = HFWrapper()
    refuse_hf_models_the_adapter_cannot_run(llama, ["net.model.layers.2"], where)
    refuse_hf_models_the_adapter_cannot_run(llama, ["net.model.norm"], where)  # the last stage: final norm + head
    with pytest.raises(ValueError, match=r"split point 'net.lm_head' puts the head .* LlamaForCausalLM at 'net' on a stage of its own"):
        refuse_hf_models_the_adapter_cannot_run(llama, ["net.lm_head"], where)  # failed at the first step before
    pieces = llama.net._modules["model"]._modules
    pieces["embed_tokens"] = pieces.pop("embed_tokens")
    with pytest.raises(ValueError, match=r"LlamaForCausalLM at 'net'.*registered in the order \['model.layers', 'model.norm', 'model.embed_tokens'\]"):
        refuse_hf_models_the_adapter_cannot_run(llama, ["net.model.layers.2"], where)
    # A *ForCausalLM lacking a piece says which.
    del llama.net._modules["model"]._modules["norm"]
    with pytest.raises(ValueError, match=r"it lacks model\.norm"):
        refuse_hf_models_the_adapter_cannot_run(llama, ["net.model.layers.2"], where)
    # Our own models are not Hugging Face's: left to their own forward.
    refuse_hf_models_the_adapter_cannot_run(PipelinedModule(), ["net.blocks.2"], where)


def test_a_split_at_the_final_norm_makes_a_last_stage_of_norm_and_head() -> None:
    """A split point at ``model.norm`` leaves the last stage no layer: it runs the final norm and the head."""
    from hp_lightning.parallel.pipeline_hf import adapt_hf_decoder_stages, find_hf_decoders

    torch.manual_seed(0)
    whole = HFWrapper().eval()
    tokens = torch.randint(0, 96, (2, 7))
    h: torch.Tensor = tokens
    for stage in range(2):
        part = HFWrapper().eval()
        part.load_state_dict(whole.state_dict())
        decoders = find_hf_decoders(part)
        split_stage(part, ["net.model.norm"], stage)
        adapted = adapt_hf_decoder_stages(part, decoders)
        assert ("net.model.layers -> empty" in adapted) == (stage == 1)
        h = part(h)
    torch.testing.assert_close(h, whole(tokens))


def test_a_subclass_of_a_hugging_face_causal_lm_is_adapted_unless_it_overrides_forward() -> None:
    from hp_lightning.parallel.pipeline_hf import find_hf_decoders, refuse_hf_models_the_adapter_cannot_run

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2
    )

    class MyLlama(transformers.LlamaForCausalLM):  # a user's subclass, transformers' forward inherited
        pass

    class MyForwardLlama(transformers.LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    class Holder(nn.Module):
        def __init__(self, cls: type) -> None:
            super().__init__()
            self.net = cls(config)

    assert find_hf_decoders(Holder(MyLlama)) == ["net"] and find_hf_decoders(Holder(MyForwardLlama)) == []
    refuse_hf_models_the_adapter_cannot_run(Holder(MyLlama), ["net.model.layers.2"], "W")
    with pytest.raises(ValueError, match=r"its class overrides the forward of transformers' LlamaForCausalLM"):
        refuse_hf_models_the_adapter_cannot_run(Holder(MyForwardLlama), ["net.model.layers.2"], "W")
