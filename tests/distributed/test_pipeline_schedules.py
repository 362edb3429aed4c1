"""Every torch pipeline schedule by name, with virtual stages, against one process training the whole model.

Two launches. On 2 ranks (P = 2, no data parallelism) every schedule trains the same model, data
and AdamW steps as one process, with one stage per rank (gpipe, 1f1b) or two (the interleaved,
looped and zero-bubble ones; loop placement, or V placement for zbv / dualpipev); 1f1b and zbv
cut where ``pipeline_split_points="auto"`` says. On 4 ranks
(PP 2 x FSDP 2): 1f1b, interleaved_1f1b and zbv against one process; the collectives of one step
counted at 2, 4 and 8 micro-batches (each unit all-gathers and reduce-scatters once per step by
default, M times per step's backward with ``pipeline_keep_gathered=False``), with the sharding
report's plan of every stage (units, bytes, pipeline rank) on every rank; and a zbv checkpoint
(4 stages) resumed by 1f1b (2 stages), whose checkpoint resumes as plain FSDP over 4 ranks; and a
tiny Hugging Face ``LlamaForCausalLM`` (its LightningModule's forward written for one process) under
1f1b and zbv, and a tiny ``Qwen2ForCausalLM`` under 1f1b, with automatic split points, built on the
meta device, against one process.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_lightning.core.options import HSDPOptions
from tests.distributed.test_pipeline import fit
from tests.helpers import max_rel_diff, run_distributed

STEPS = 3
SPLIT_4 = ["net.blocks.1", "net.blocks.2", "net.blocks.3"]  # 4 stages: [inp, b0] [b1] [b2] [b3, head]
#: name -> stages per rank: the schedules of one stage per rank, and the others with two.
SCHEDULES_2_RANKS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}
SCHEDULES_4_RANKS = {"1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}
RESUME_SAMPLES = 32  # two global batches per epoch: each save is at an epoch's end
#: On 2 ranks these cut the model where pipeline_split_points="auto" says (balanced parameter bytes), the others where they are told.
AUTO_ON_2_RANKS = ("1f1b", "zbv")
#: A tiny HF Llama under PP 2 x FSDP 2: one stage per rank, and two with V placement (rank 0 holds the embeddings and the head).
HF_SCHEDULES = {"1f1b": 1, "zbv": 2}
#: A tiny HF Qwen2 (biased q/k/v, one KV head) under PP 2 x FSDP 2: one schedule is enough for what differs from Llama.
QWEN2_SCHEDULES = {"1f1b": 1}


def options(schedule: str, per_rank: int, auto: bool = False, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict(pipeline_schedule=schedule, pipeline_stages_per_rank=per_rank, pipeline_microbatches=4, **extra)
    if auto:
        out["pipeline_split_points"] = "auto"
    elif per_rank == 2:
        out["pipeline_split_points"] = SPLIT_4
    return out


def units_with_params(model: torch.nn.Module) -> int:
    """FSDP units (parameter groups) this rank holds: each should gather and reduce once per step."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    states = {id(fully_shard.state(m)) for m in model.modules() if isinstance(m, FSDPModule) and fully_shard.state(m)._fsdp_param_group}
    return len(states)


def counted(mesh: list[int], schedule: str, per_rank: int, microbatches: int, keep: bool = True) -> dict[str, Any]:
    """One step's all-gathers / reduce-scatters on this rank, and the rank's unit count."""
    import lightning.pytorch as pl

    captured: dict[str, Any] = {}

    class Units(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            captured["units"] = units_with_params(pl_module)

    strategy = dict(options(schedule, per_rank, mesh_shape=mesh, pipeline_keep_gathered=keep), pipeline_microbatches=microbatches)
    run = fit(4, strategy, {}, count=True, steps=2, extra_callbacks=[Units()])
    calls = run["collectives"]
    return {
        "all_gather": len(calls.get("all_gather", [])),
        "reduce_scatter": len(calls.get("reduce_scatter", [])),
        "units": captured["units"],
        "report": run["report"],
        "stages": run["stages"],
    }


#: Sharding options away from their defaults, each visible on a module FSDP shards (the globs match on every stage).
PLAN_OPTIONS = dict(reduce_dtype="fp64", shard_placement={"*[!m].weight": 1}, ignored_params=["*.bias"])


def plan_seen(module: torch.nn.Module) -> dict[str, Any]:
    """What FSDP was told for every module it shards on this rank: the stage pieces and views of virtual stages included."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from hp_lightning.core._torch_private import managed_params

    views = module.__dict__.get("_hp_pipeline_views", [])
    roots = [m for m in [*module.modules(), *views] if isinstance(m, FSDPModule)]
    params = dict(module.named_parameters())
    return {
        "roots": len(roots),
        "views": len(views),
        "reduce_dtypes": sorted({str(policy.reduce_dtype) for m in roots for _, policy, _ in managed_params(m)}),
        "placements": {n: [repr(x) for x in p.placements] for n, p in params.items() if isinstance(p, DTensor)},
        "plain": sorted(n for n, p in params.items() if not isinstance(p, DTensor)),
        "dim1": repr(Shard(1)),
    }


def worker_2() -> dict[str, Any]:
    import logging

    import lightning.pytorch as pl
    from lightning_utilities.core import rank_zero

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    rank_zero.log.addHandler(handler)  # what rank_zero_info writes (sharding_report=True logs the stage plan)
    out: dict[str, Any] = {}
    for name, v in SCHEDULES_2_RANKS.items():
        extra = dict(sharding_report=True) if name == "zbv" else {}
        out[name] = fit(2, options(name, v, name in AUTO_ON_2_RANKS, mesh_shape=[1], **extra), {}, steps=STEPS)
    rank_zero.log.removeHandler(handler)
    out["plan_logged"] = [line for line in logged if line.startswith("Pipeline stages")]

    class Seen(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            out["plan_seen"] = plan_seen(pl_module)

    # Virtual stages (V placement: rank 0 holds the input projection and the head, sharded as stage pieces) with a plan
    # away from the defaults: every module sharded on the rank must follow it, the pieces and views as the recipe's units.
    out["zbv_plan"] = fit(2, options("zbv", 2, mesh_shape=[1], **PLAN_OPTIONS), {}, steps=STEPS, extra_callbacks=[Seen()])
    return out


def worker_4(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: fit(4, options(name, v, mesh_shape=[2]), {}, steps=STEPS) for name, v in SCHEDULES_4_RANKS.items()}
    # A Hugging Face LlamaForCausalLM, its LightningModule's forward unchanged, cut where "auto" says, built on the meta device.
    for name, v in HF_SCHEDULES.items():
        out[f"hf_llama_{name}"] = fit(4, options(name, v, auto=True, mesh_shape=[2]), {}, steps=STEPS, net="hf_llama")
    for name, v in QWEN2_SCHEDULES.items():
        out[f"hf_qwen2_{name}"] = fit(4, options(name, v, auto=True, mesh_shape=[2]), {}, steps=STEPS, net="hf_qwen2")
    out["counts"] = {f"{name}_m{m}": counted([2], name, v, m) for name, v in SCHEDULES_4_RANKS.items() for m in (2, 4, 8)}
    out["counts_regather"] = {f"1f1b_m{m}": counted([2], "1f1b", 1, m, keep=False) for m in (2, 4)}
    # zbv (4 stages, 2 per rank) -> 1f1b (2 stages) -> plain FSDP over 4 ranks: one run continued.
    root = Path(tmp)
    fit(4, options("zbv", 2, mesh_shape=[2]), {}, steps=2, save_to=root / "zbv", samples=RESUME_SAMPLES)
    fit(4, options("1f1b", 1, mesh_shape=[2]), {}, steps=4, save_to=root / "1f1b", ckpt_path=root / "zbv" / "step=2.ckpt", samples=RESUME_SAMPLES)
    out["fsdp_from_1f1b"] = fit(4, dict(mesh_shape=[4]), {}, steps=6, pipeline=False, ckpt_path=root / "1f1b" / "step=4.ckpt", samples=RESUME_SAMPLES)
    return out


@pytest.fixture(scope="module")
def runs_2() -> list[dict[str, Any]]:
    return run_distributed(worker_2, 2, timeout=300)


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(worker_4, 4, str(tmp_path_factory.mktemp("schedules")), timeout=400)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return {
        "train": fit(1, None, {}, steps=STEPS),
        "resume6": fit(1, None, {}, steps=6, samples=RESUME_SAMPLES),
        "hf_llama": fit(1, None, {}, steps=STEPS, net="hf_llama"),
        "hf_qwen2": fit(1, None, {}, steps=STEPS, net="hf_qwen2"),
    }


#: Max relative parameter difference allowed after the AdamW steps for the Hugging Face models. Adam
#: normalizes each gradient element, so fp32 rounding differences between a stage-split forward and
#: one process grow to ~1e-5 of a tensor's largest value (transformers 5.24's Llama: 1.3e-5; the
#: example GPT stays under 1e-5); a wrong stage, tie or gradient shows as 1e-3 or more.
HF_TOLERANCE = 3e-5


def check_parity(runs: list[dict[str, Any]], name: str, ref: dict[str, Any]) -> float:
    whole: dict[str, torch.Tensor] = {}
    for rank in runs:
        whole.update(rank[name]["params"])
    assert sorted(whole) == sorted(ref["params"]), f"{name}: the stages together hold the whole model, under its own names"
    diff = max_rel_diff(whole, ref["params"])
    for rank in runs:  # every rank logs the batch's loss, computed on the last stage
        assert rank[name]["losses"] == pytest.approx(ref["losses"], abs=1e-6), (name, rank[name]["losses"], ref["losses"])
    return diff


def test_every_schedule_on_two_ranks_matches_one_process(runs_2: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    diffs = {name: check_parity(runs_2, name, reference["train"]) for name in SCHEDULES_2_RANKS}
    print(f"max relative parameter difference after {STEPS} AdamW steps: {diffs}")
    assert all(d <= 1e-5 for d in diffs.values()), diffs
    # Virtual stages: with two per rank, each rank holds units of two stages (loop: 0 and 2 / 1 and 3; V: 0 and 3 / 1 and 2).
    # zbv and 1f1b cut where pipeline_split_points="auto" says: 4 equal blocks over 4 stages, one each; over 2 stages
    # two each (the input projection outweighs the head, so one more block on stage 0 would be the larger stage).
    rank0 = held_units(runs_2[0]["zbv"]["params"])
    assert rank0 == {"inp", "blocks.0", "blocks.3", "head"}, rank0
    rank0_loop = held_units(runs_2[0]["interleaved_1f1b"]["params"])
    assert rank0_loop == {"inp", "blocks.0", "blocks.2"}, rank0_loop
    assert held_units(runs_2[0]["1f1b"]["params"]) == {"inp", "blocks.0", "blocks.1"}
    assert held_units(runs_2[1]["1f1b"]["params"]) == {"blocks.2", "blocks.3", "head"}
    # sharding_report=True: rank 0 logs every stage's pipeline rank, parameter bytes and units once, at setup.
    (plan,) = runs_2[0]["plan_logged"]
    print(plan)
    assert "Pipeline stages (4)" in plan and runs_2[1]["plan_logged"] == []
    assert re.search(r"stage 0 on pipeline rank 0: [\d,]+ bytes .*: net.inp, net.blocks.0\n", plan), plan
    assert re.search(r"stage 3 on pipeline rank 0: [\d,]+ bytes .*: net.blocks.3, net.head", plan), plan
    assert re.search(r"stage 1 on pipeline rank 1: 4,416 bytes .*1 unit\(s\): net.blocks.1\n", plan), plan  # one Block(16): 1,104 fp32


def test_virtual_stages_shard_every_module_with_the_whole_plan(runs_2: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    # The stage pieces (rank 0: the input projection of stage 0, the head of stage 3) and each stage's view are sharded
    # outside the recipe's units; they get every option of the plan all the same (one fully_shard call site).
    assert check_parity(runs_2, "zbv_plan", reference["train"]) <= 1e-5  # one data-parallel rank: the options change no number
    for run in runs_2:
        seen = run["plan_seen"]
        assert seen["views"] == 2 and seen["roots"] >= 4, seen
        assert seen["reduce_dtypes"] == ["torch.float64"], seen
        weights = {n: v for n, v in seen["placements"].items() if not n.endswith("norm.weight")}
        assert weights and all(v == [seen["dim1"]] for v in weights.values()), weights
        assert seen["plain"] and all(n.endswith(".bias") for n in seen["plain"]), seen["plain"]
        assert not [n for n in seen["placements"] if n.endswith(".bias")], seen["placements"]
    rank0 = runs_2[0]["plan_seen"]
    assert {"net.inp.weight", "net.head.weight"} <= set(rank0["placements"]) and {"net.inp.bias", "net.head.bias"} <= set(rank0["plain"]), rank0


def held_units(params: dict[str, torch.Tensor]) -> set[str]:
    """``net.blocks.2.fc1.weight`` -> ``blocks.2``; ``net.inp.weight`` -> ``inp``: the units a rank's parameters belong to."""
    return {n.split(".")[1] + ("." + n.split(".")[2] if n.split(".")[1] == "blocks" else "") for n in params}


def test_pp2_x_fsdp2_matches_one_process(runs_4: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    diffs = {name: check_parity(runs_4, name, reference["train"]) for name in SCHEDULES_4_RANKS}
    print(f"PP 2 x FSDP 2, max relative parameter difference after {STEPS} AdamW steps: {diffs}")
    assert all(d <= 1e-5 for d in diffs.values()), diffs


def test_a_hugging_face_llama_under_pp2_x_fsdp2_matches_one_process(runs_4: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    diffs = {name: check_parity(runs_4, f"hf_llama_{name}", reference["hf_llama"]) for name in HF_SCHEDULES}
    print(f"HF LlamaForCausalLM, PP 2 x FSDP 2, auto split points, max relative parameter difference after {STEPS} AdamW steps: {diffs}")
    assert all(d <= HF_TOLERANCE for d in diffs.values()), diffs
    # zbv: rank 0 holds stages 0 and 3 (V placement), so the embeddings and the head; rank 2 (stages 1, 2) neither.
    names = set(runs_4[0]["hf_llama_zbv"]["params"])
    assert {"net.model.embed_tokens.weight", "net.lm_head.weight", "net.model.norm.weight"} <= names
    assert not any(n.startswith(("net.model.embed_tokens", "net.lm_head")) for n in runs_4[2]["hf_llama_zbv"]["params"])


def test_a_hugging_face_qwen2_under_pp2_x_fsdp2_matches_one_process(runs_4: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    diffs = {name: check_parity(runs_4, f"hf_qwen2_{name}", reference["hf_qwen2"]) for name in QWEN2_SCHEDULES}
    print(f"HF Qwen2ForCausalLM, PP 2 x FSDP 2, auto split points, max relative parameter difference after {STEPS} AdamW steps: {diffs}")
    assert all(d <= HF_TOLERANCE for d in diffs.values()), diffs
    # 1f1b: stage 0 (ranks 0, 1) holds the embeddings, stage 1 (ranks 2, 3) the final norm and the head; q/k/v biases travel with their layers.
    first, last = set(runs_4[0]["hf_qwen2_1f1b"]["params"]), set(runs_4[2]["hf_qwen2_1f1b"]["params"])
    assert "net.model.embed_tokens.weight" in first and not any(n.startswith("net.lm_head") or n.startswith("net.model.norm") for n in first)
    assert {"net.lm_head.weight", "net.model.norm.weight"} <= last and "net.model.embed_tokens.weight" not in last
    assert any(n.endswith("self_attn.q_proj.bias") for n in first) and any(n.endswith("self_attn.q_proj.bias") for n in last)


def test_fsdp_inside_a_stage_communicates_once_per_step(runs_4: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs_4):
        for key, count in run["counts"].items():
            # One all-gather and one reduce-scatter per unit per step, at M = 2, 4 and 8 alike.
            assert count["all_gather"] == count["units"] and count["reduce_scatter"] == count["units"], (rank, key, count)
        numbers = {key: {k: count[k] for k in ("all_gather", "reduce_scatter", "units")} for key, count in run["counts"].items()}
        regather = {key: {k: count[k] for k in ("all_gather", "reduce_scatter", "units")} for key, count in run["counts_regather"].items()}
        print(f"rank {rank}: {numbers}; without keep_gathered: {regather}")
        m2, m4 = run["counts_regather"]["1f1b_m2"], run["counts_regather"]["1f1b_m4"]
        # Trading memory back: every micro-batch's backward gathers its units again; reductions stay once per step.
        assert m4["all_gather"] > m2["all_gather"] > m2["units"] and m2["reduce_scatter"] == m4["reduce_scatter"] == m2["units"], (m2, m4)


def test_the_sharding_report_carries_every_stage_plan(runs_4: list[dict[str, Any]]) -> None:
    from tests.pipeline_models import StagedNet

    whole_bytes = sum(p.numel() * p.element_size() for p in StagedNet().parameters())
    for rank, run in enumerate(runs_4):
        count = run["counts"]["zbv_m4"]  # 4 stages, V placement: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
        stages = count["stages"]
        assert stages == runs_4[0]["counts"]["zbv_m4"]["stages"], "every rank reports the same plan"
        assert [s.index for s in stages] == [0, 1, 2, 3] and [s.pipeline_rank for s in stages] == [0, 1, 1, 0], stages
        assert [s.units for s in stages] == [("net.inp", "net.blocks.0"), ("net.blocks.1",), ("net.blocks.2",), ("net.blocks.3", "net.head")]
        assert stages[1].param_bytes == stages[2].param_bytes == 4_416 and sum(s.param_bytes for s in stages) == whole_bytes  # Block(16): 1,104 fp32
        report = count["report"]
        assert report.startswith(f"Sharding report (pipeline rank {rank // 2} of 2; "), report
        assert "Pipeline stages (4): parameter bytes per stage, before sharding" in report, report
        assert re.search(r"^  stage 3 on pipeline rank 0: [\d,]+ bytes \([\d.]+ %\), 2 unit\(s\): net.blocks.3, net.head$", report, re.M), report
        assert "  stage 1 on pipeline rank 1: 4,416 bytes" in report, report
    print(runs_4[0]["counts"]["zbv_m4"]["report"])


def test_checkpoints_resume_across_schedules_stage_counts_and_plain_fsdp(runs_4: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    resumed = runs_4[0]["fsdp_from_1f1b"]
    diff = max_rel_diff(resumed["params"], reference["resume6"]["params"])
    print(f"zbv (4 stages) -> 1f1b (2 stages) -> FSDP 4: {diff:.2e} max relative difference at step 6")
    assert diff <= 1e-5
    assert resumed["losses"] == pytest.approx(reference["resume6"]["losses"][4:], abs=1e-6)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(pipeline_schedule="zbv"), r"zbv runs exactly 2 stage\(s\) per rank; got 1\. Fix: set pipeline_stages_per_rank=2"),
        (dict(pipeline_schedule="1f1b", pipeline_stages_per_rank=2), r"1f1b runs exactly 1 stage\(s\) per rank; got 2\. Fix: use interleaved_1f1b"),
        (dict(pipeline_schedule="interleaved_1f1b", pipeline_stages_per_rank=2, pipeline_microbatches=5), r"must be a multiple of .* = 2; got 5"),
        (dict(pipeline_schedule="dualpipev", pipeline_stages_per_rank=2, pipeline_microbatches=2), r"at least as many micro-batches as stages \(4\)"),
        (dict(pipeline_schedule="zbv", pipeline_stages_per_rank=2, pipeline_split_points=["net.blocks.2"]), r"into 4 stages, so it needs 3 split point"),
        (dict(pipeline_stages_per_rank=0), r"pipeline_stages_per_rank=\.\.\.\) expects an int >= 1; got 0"),
    ],
)
def test_schedules_refuse_what_they_cannot_run_at_option_validation(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HSDPOptions(**{"pipeline_parallel_size": 2, "pipeline_split_points": SPLIT_4 if given.get("pipeline_stages_per_rank") == 2 else ["net.blocks.2"], **given})


def test_microbatches_default_to_the_stage_count() -> None:
    assert HSDPOptions(pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_stages_per_rank=2, pipeline_split_points=SPLIT_4).pipeline_microbatches == 4
    assert HSDPOptions(pipeline_parallel_size=2, pipeline_split_points=["net.blocks.2"]).pipeline_microbatches == 2
