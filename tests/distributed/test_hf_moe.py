"""A Hugging Face mixture of experts (tiny ``MixtralForCausalLM``) under TP and EP, against one process.

One 4-rank launch: FSDP 2 x TP 2 without a plan is refused, naming the plan's source (Hugging
Face's ``base_model_tp_plan``, whose expert styles torch cannot apply) and the plan to pass; with
that plan, logits and gradients equal one process. FSDP 4 x EP 2 on HF 5's experts modules (3-D
``[num_experts, ...]`` parameters, router choice as input): logits and gradients equal one process,
and the experts' tokens travel by all-to-all inside the ``ep`` groups only.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tests.helpers import run_distributed

SEQUENCES, LENGTH, VOCAB = 8, 6, 32


#: Mixtral's base_model_tp_plan as transformers 5.0-5.24 ship it: attention by torch's styles, the experts by
#: Hugging Face's own (5.25 ships the attention entries only). The refusal is tested on this plan on every release.
EXPERT_STYLES_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts",
}


def tiny_mixtral(tp_plan: dict[str, str] | None = None) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    if tp_plan is not None:
        config.base_model_tp_plan = dict(tp_plan)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=g)
    return ids, (5 * ids + 3) % VOCAB


def loss_of(model: torch.nn.Module, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()), logits.detach()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone() for n, p in model.named_parameters()}


def run_sharded(mesh: Any, plan: Any, tp_plan: dict[str, str] | None = None) -> dict[str, Any]:
    """This rank's data-parallel slice through the sharded model: its logits and the whole gradients."""
    from hp_lightning.core.diagnostics import CollectiveCounter
    from hp_lightning.recipe.prepare import prepare_model

    model = tiny_mixtral(tp_plan)
    cpu = torch.device("cpu")
    prepare_model(model, mesh, plan, init_device=cpu, device=cpu)
    ids, target = batch()
    per_rank = SEQUENCES // mesh.layout.dp_size
    mine = slice(mesh.dp_rank * per_rank, (mesh.dp_rank + 1) * per_rank)
    with CollectiveCounter() as comms:
        loss, logits = loss_of(model, ids[mine], target[mine])
        loss.backward()  # FSDP averages over the data-parallel ranks: the gradient of the mean loss
    return {
        "slice": (mine.start, mine.stop),
        "logits": logits,
        "grads": gradients(model),
        "all_to_all": sorted({call.ranks for call in comms.calls if call.kind.startswith("all_to_all")}),
        "placements": {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()},
    }


def worker() -> dict[str, Any]:
    import torch.distributed as dist

    from hp_lightning.core.mesh import MeshLayout, build_parallel_mesh
    from hp_lightning.core.options import HSDPOptions
    from hp_lightning.recipe.parallelize import ShardingPlan

    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    tp_mesh = build_parallel_mesh("cpu", MeshLayout(dp=(2,), tp=2))
    try:
        run_sharded(tp_mesh, ShardingPlan(), tp_plan=EXPERT_STYLES_PLAN)
        out["hf_plan"] = "no error"
    except ValueError as exc:
        out["hf_plan"] = str(exc)
    attention = {f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {"model.layers.*.self_attn.o_proj": "rowwise"}
    out["tp"] = run_sharded(tp_mesh, ShardingPlan.of(HSDPOptions(tp_plan=attention)))
    out["ep"] = run_sharded(build_parallel_mesh("cpu", MeshLayout(dp=(4,), ep=2)), ShardingPlan())
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(worker, 4, timeout=300)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    model = tiny_mixtral()
    loss, logits = loss_of(model, *batch())
    loss.backward()
    return {"logits": logits, "grads": gradients(model)}


def test_hf_plan_with_expert_styles_is_refused_naming_its_source(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        message = run["hf_plan"]
        assert "MixtralForCausalLM's config.base_model_tp_plan" in message, message
        assert "packed_colwise" in message and "moe_tp_experts" in message, message
        # The plan to pass instead: the attention projections, which torch's styles split.
        assert re.search(r"Pass tp_plan=\{'model\.layers\.\*\.self_attn\.q_proj': 'colwise'", message), message
        assert "experts" not in message.split("Pass tp_plan=")[1].split("}")[0], message


@pytest.mark.parametrize("case", ["tp", "ep"])
def test_mixtral_matches_one_process(runs: list[dict[str, Any]], reference: dict[str, Any], case: str) -> None:
    worst_logits = worst_grad = 0.0
    for run in runs:
        got = run[case]
        start, stop = got["slice"]
        worst_logits = max(worst_logits, float((got["logits"] - reference["logits"][start:stop]).abs().max()))
        assert sorted(got["grads"]) == sorted(reference["grads"])
        for name, grad in got["grads"].items():
            want = reference["grads"][name]
            worst_grad = max(worst_grad, float((grad - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    print(f"{case}: logits differ by {worst_logits:.2e}, gradients by {worst_grad:.2e} (relative) from one process")
    assert worst_logits <= 1e-5 and worst_grad <= 1e-4, (worst_logits, worst_grad)


def test_tp_splits_attention_and_ep_splits_the_experts(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        tp = run["tp"]["placements"]
        assert "Shard(dim=0)" in tp["model.layers.0.self_attn.q_proj.weight"], tp
        ep = run["ep"]["placements"]
        assert "Shard(dim=0)" in ep["model.layers.0.mlp.experts.gate_up_proj"], ep
        # Tokens reach their experts by all-to-all inside this rank's ep group only.
        groups = run["ep"]["all_to_all"]
        assert groups and all(len(g) == 2 and rank in g for g in groups), groups
