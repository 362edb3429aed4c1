"""The planner's predictions against the real HSDPStrategy on 4 gloo ranks (one launch, every case).

For FSDP 4, HSDP 2x2, FSDP 2 x TP 2 and PP 2 x FSDP 2 on the example GPT at two sizes, and HSDP
2x2 on a small Hugging Face Llama, each rank trains 2 optimizer steps under the Trainer with
CollectiveCounter around ``fit``; the last step's bytes per collective kind (and calls) must equal
the plan's exactly, for every rank. Its peak memory, measured by the benchmarks' CPU method (the
mallinfo2 heap less the non-tensor heap measured in the same run, see
:mod:`hp_lightning.planner.validate`), must be within +-15 % of the plan's peak.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from hp_lightning.planner import Candidate, Cluster, Workload, plan, resolve_model
from hp_lightning.planner.api import facts_of
from hp_lightning.planner.simulate import strategy_args_for
from hp_lightning.planner.validate import compare, measure_rank, predicted_for_rank
from tests.helpers import run_distributed

GPT_TP_PLAN = {
    "model.blocks.*.attn.qkv_heads": "colwise",
    "model.blocks.*.attn.proj": "rowwise",
    "model.blocks.*.mlp.fc": "colwise",
    "model.blocks.*.mlp.proj": "rowwise",
}
CLUSTER = Cluster(nodes=2, devices=2, device_memory=8e9)
#: Two sizes of the example GPT with the same work per step (and so the same test time): at 4 x 128
#: activations weigh as much as the model state, at 4 x 256 (4x the parameters, a quarter of the
#: tokens) the state and the gathered units make most of the peak.
GPT_SIZES = {
    "GPT 4x128": ({"n_layer": 4, "n_embd": 128}, Workload(micro_batch=4, seq_len=64, precision="32")),
    "GPT 4x256": ({"n_layer": 4, "n_embd": 256}, Workload(micro_batch=2, seq_len=32, precision="32")),
}
LLAMA = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False,
}
LLAMA_WORKLOAD = Workload(micro_batch=4, seq_len=64, precision="32")
#: Predicted peak / measured peak must lie in [1 - TOLERANCE, 1 + TOLERANCE] (the issue's acceptance).
TOLERANCE = 0.15


def _cases():
    cases = []
    for size, (init_args, workload) in GPT_SIZES.items():
        gpt = resolve_model("examples.gpt.GPTLightningModule", {**init_args, "warmup_steps": 1})
        pipeline = dataclasses.replace(workload, micro_batch=workload.micro_batch // 2, pipeline_microbatches=2)
        cases += [
            (f"{size} FSDP 4", gpt, Candidate((4,)), workload),
            (f"{size} HSDP 2x2", gpt, Candidate((2, 2)), workload),
            (f"{size} FSDP 2 x TP 2", gpt, Candidate((2,), tp=2), workload),
            (f"{size} PP 2 x FSDP 2", gpt, Candidate((2,), pp=2, pipeline_split_points=("model.blocks.2",)), pipeline),
        ]
    cases.append(("Llama HSDP 2x2", resolve_model(LLAMA), Candidate((2, 2)), LLAMA_WORKLOAD))
    return cases


def _measure_all(cases):
    return [measure_rank(spec, args, CLUSTER, workload, steps=2) for spec, args, workload in cases]


def _plan(label, spec, candidate, workload):
    result = plan(spec, cluster=CLUSTER, workload=workload, tp_plan=GPT_TP_PLAN if "TP" in label else None,
                  candidates=[candidate], progress=False, require_fit=False)
    entry = result.ranked[0]
    assert entry.error is None, (label, entry.error)
    return result, entry


def test_planner_predicts_bytes_exactly_and_memory():
    cases = _cases()
    # The ranks train while this process simulates: the strategy arguments need no simulation.
    launched = [(spec, strategy_args_for(candidate, workload, facts_of(spec, CLUSTER, GPT_TP_PLAN if "TP" in label else None), spec), workload)
                for label, spec, candidate, workload in cases]
    with ThreadPoolExecutor(max_workers=1) as pool:
        ranks = pool.submit(run_distributed, _measure_all, 4, launched, local_world_size=2)
        planned = [_plan(*case) for case in cases]
        measured = ranks.result()
    outside = _compare(cases, planned, launched, measured)
    if outside and all(gap > SAMPLING_GAP_MS for _, gap in outside):
        # Every miss had the heap sampler starved for longer than a peak lasts (a loaded machine):
        # measure once more; a miss with the sampler keeping up fails at once.
        print(f"sampler starved (gaps {[round(g, 1) for _, g in outside]} ms): measuring again")
        outside = _compare(cases, planned, launched, run_distributed(_measure_all, 4, launched, local_world_size=2))
    assert not outside, "\n".join(line for line, _ in outside)


#: Longest time between two heap samples (ms) under which a missed peak is the plan's fault, not the sampler's.
SAMPLING_GAP_MS = 5.0


def _compare(cases, planned, launched, measured) -> list[tuple[str, float]]:
    """Bytes must match exactly (asserted here); memory outside the band is returned with the sampling gap."""
    report, outside = [], []
    for i, ((label, *_), (result, entry)) in enumerate(zip(cases, planned)):
        assert result.strategy_args(entry) == launched[i][1], label  # what was trained is what was planned
        for rank_result in measured:
            m = rank_result[i]
            calls, peak = predicted_for_rank(entry, CLUSTER, m.rank)
            rows = compare(calls, m.calls)
            assert Counter(c.kind for c in calls) == Counter(k for k, *_ in m.calls), (label, m.rank, rows)
            assert all(p == q for p, q in rows.values()), (label, m.rank, rows)
            assert 0 < m.non_tensor_heap < m.heap_peak, (label, m.rank, m)
            ratio = peak / m.tensor_peak
            report.append(
                f"{label} rank {m.rank}: peak predicted {peak / 2**20:.2f} MiB, measured {m.tensor_peak / 2**20:.2f} MiB "
                f"(heap {m.heap_peak / 2**20:.2f} - non-tensor {m.non_tensor_heap / 2**20:.2f}) = {ratio:.3f}, "
                f"largest sampling gap {m.sampling_gap_ms:.1f} ms"
            )
            if abs(ratio - 1) > TOLERANCE:
                outside.append((report[-1], m.sampling_gap_ms))
    print("\n".join(report))
    return outside
