"""Bad composition input is refused in ``HSDPStrategy(...)`` / ``Trainer(...)`` or before any collective.

Sizes that do not fit the world, unknown TP styles, patterns that match nothing, styles on the
wrong module, expert counts EP cannot split: each a ValueError/TypeError naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from examples.moe import GroupedExperts
from hp_lightning import HSDPStrategy
from hp_lightning.core.mesh import MeshLayout, resolve_layout
from hp_lightning.parallel.expert import check_expert_split
from hp_lightning.parallel.tensor import hf_tp_plan, resolve_tp_plan


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tp_plan": {"blocks.*.fc": "diagonal"}}, ValueError, "unknown style 'diagonal'"),
        ({"tp_plan": ["blocks.*.fc"]}, TypeError, "expects a mapping"),
        ({"tp_plan": {"blocks.*.fc": 3}}, TypeError, "expected a style name"),
        ({"tensor_parallel_size": 0}, ValueError, "int >= 1"),
        ({"tensor_parallel_size": "2"}, TypeError, "expects an int"),
        ({"expert_parallel_size": 2.0}, TypeError, "expects an int"),
        ({"tensor_parallel_size": 2, "expert_parallel_size": 2}, ValueError, "not supported yet"),
        ({"expert_modules": "experts"}, TypeError, "list of strings"),
    ],
)
def test_strategy_arguments_are_checked_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        HSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not divide the world size 4"),
        (
            {"mesh_shape": [4], "tensor_parallel_size": 2},
            r"needs prod\(mesh_shape\) x tensor_parallel_size x pipeline_parallel_size == world size 4 .*"
            r"got 4 x 2 x 1 = 8\. Either set mesh_shape to sizes that multiply to 4 / \(2 x 1\) = 2 .*"
            r"or set tensor_parallel_size=1 for this mesh_shape",
        ),
        ({"mesh_shape": [4], "expert_parallel_size": 3}, "expert_parallel_size=3 does not divide the shard dim"),
    ],
)
def test_sizes_that_do_not_fit_the_world_fail_in_trainer(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", devices=4, strategy=HSDPStrategy(**kwargs), logger=False)


@pytest.mark.parametrize(
    ("mesh_shape", "world", "tp", "pp", "numbers", "other"),
    [
        ([2], 2, 2, 1, "got 2 x 2 x 1 = 4", "set tensor_parallel_size=1"),  # the reported case
        ([2, 2], 8, 1, 4, "got 4 x 1 x 4 = 16", "so that 4 x tp x pp divides 8"),  # no TP size alone fixes it
        ([3, -1], 8, 2, 1, "got 3 x 2 x 1 = 6 (before the -1 is inferred)", "so that 3 x tp x pp divides 8"),
    ],
)
def test_composed_sizes_state_the_product_rule_with_the_numbers_and_both_options(mesh_shape, world, tp, pp, numbers, other):
    with pytest.raises(ValueError) as caught:
        resolve_layout(mesh_shape, world_size=world, num_nodes=1, devices_per_node=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    message = str(caught.value)
    assert "prod(mesh_shape) x tensor_parallel_size x pipeline_parallel_size == world size" in message
    assert f"world size {world}" in message and numbers in message and other in message
    assert "expert_parallel_size" in message and f"= {world // (tp * pp)}" in message


def test_layouts_order_dims_and_carve_ep_out_of_shard():
    fsdp_tp = resolve_layout([-1], world_size=8, num_nodes=1, devices_per_node=8, tensor_parallel_size=2)
    assert fsdp_tp == MeshLayout(dp=(4,), tp=2) and fsdp_tp.names == ("shard", "tp") and fsdp_tp.shape == (4, 2)
    default = resolve_layout(None, world_size=16, num_nodes=2, devices_per_node=8, tensor_parallel_size=2)
    assert default.names == ("replicate", "shard", "tp") and default.shape == (2, 4, 2)
    ep = resolve_layout([2, 4], world_size=8, num_nodes=2, devices_per_node=4, expert_parallel_size=2)
    assert ep.names == ("replicate", "expert_shard", "ep") and ep.shape == (2, 2, 2) and ep.dp_size == 8
    plain = resolve_layout([2, 2], world_size=4, num_nodes=1, devices_per_node=4)
    assert not plain.composed and plain.names == ("replicate", "shard")
    with pytest.raises(ValueError, match="would cross nodes"):
        resolve_layout(None, world_size=12, num_nodes=2, devices_per_node=6, tensor_parallel_size=4)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(4, 8), "norm": nn.LayerNorm(8)}) for _ in range(2))


def test_tp_plan_patterns_must_match_and_styles_must_fit():
    model = Tiny()
    resolved = resolve_tp_plan(model, {"blocks.*.fc": "colwise"})
    assert sorted(resolved) == ["blocks.0.fc", "blocks.1.fc"]
    with pytest.raises(ValueError, match="matches no module of Tiny"):
        resolve_tp_plan(model, {"layers.*.fc": "colwise"})
    with pytest.raises(ValueError, match="splits nn.Linear and nn.Embedding weights only"):
        resolve_tp_plan(model, {"blocks.*.norm": "rowwise"})


def test_expert_counts_must_split_evenly():
    assert check_expert_split(GroupedExperts(4, 8, 4), 2) == 4
    with pytest.raises(ValueError, match="expert_parallel_size=2 does not divide the 3 experts"):
        check_expert_split(GroupedExperts(4, 8, 3), 2)
    with pytest.raises(ValueError, match="experts as dim 0"):
        check_expert_split(nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 3)), 2)


def test_hugging_face_plans_are_found_and_prefixed():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    holder = nn.Module()
    holder.model = transformers.LlamaForCausalLM(config)
    plan = hf_tp_plan(holder)
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    assert sorted(resolve_tp_plan(holder, plan))[0] == "model.model.layers.0.mlp.down_proj"


def test_a_plan_on_gpt2_conv1d_says_conv1d_is_not_supported_and_what_to_do():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8))
    with pytest.raises(ValueError) as caught:
        resolve_tp_plan(gpt2, {"h.*.attn.c_attn": "colwise"}, "HSDPStrategy(tp_plan=...)")
    message = str(caught.value)
    assert "'h.0.attn.c_attn' (Conv1D)" in message and "it is Hugging Face's Conv1D" in message
    assert "ParallelStyles do not support" in message and "Leave it out of the plan" in message
    assert "nn.Linear (weight = conv.weight.T)" in message and "Linear layers inside" not in message
    with pytest.raises(ValueError, match=r"'h.0.attn' \(GPT2Attention\).*it holds \['h.0.attn.c_attn', 'h.0.attn.c_proj'\]"):
        resolve_tp_plan(gpt2, {"h.*.attn": "rowwise"})
    # A module with Linear layers inside is pointed at them, by name.
    with pytest.raises(ValueError, match=r"Point the pattern at the layers inside it: \['blocks.0.fc'\]"):
        resolve_tp_plan(Tiny(), {"blocks.0": "colwise"})


def test_a_colwise_attention_split_its_module_cannot_run_is_refused_at_setup():
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5Model(transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4))
    attention = {"encoder.block.*.layer.0.SelfAttention.[qkv]": "colwise", "encoder.block.*.layer.0.SelfAttention.o": "rowwise"}
    with pytest.raises(ValueError) as caught:
        resolve_tp_plan(t5, attention, "HSDPStrategy(tp_plan=...)")
    message = str(caught.value)
    assert "'encoder.block.0.layer.0.SelfAttention' (T5Attention, n_heads=4)" in message
    assert "forward computes with self.n_heads" in message and "split the MLPs only" in message
    # The MLPs split fine; and a by-hand parallelize_module (which may fix n_heads itself) is not checked.
    mlp = {"encoder.block.*.layer.1.DenseReluDense.wi": "colwise", "encoder.block.*.layer.1.DenseReluDense.wo": "rowwise"}
    assert len(resolve_tp_plan(t5, mlp)) == 2
    assert len(resolve_tp_plan(t5, attention, check_heads=False)) == 4
    # Attention that infers its local head count (Llama: view(..., -1, head_dim)) passes with HF's own plan.
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    ))
    assert "model.layers.0.self_attn.q_proj" in resolve_tp_plan(llama, hf_tp_plan(llama))
