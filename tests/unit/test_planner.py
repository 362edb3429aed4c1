"""The planner in process: candidates, byte formulas, ranking by link speed, errors, YAML output.

Exactness against real ranks is ``tests/distributed/test_planner_validate.py``; here the planner's
own simulation is checked against FSDP2's documented sizes and the strategy's control payload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math

import pytest
import torch
import yaml
from torch import nn

from hp_lightning.planner import (
    Candidate,
    Cluster,
    ClusterTooSmall,
    ModelBuildError,
    Search,
    Workload,
    plan,
    resolve_model,
)
from hp_lightning.planner.candidates import GBIT, enumerate_candidates, model_facts
from hp_lightning.planner.comms import control_calls, link_of
from hp_lightning.planner.simulate import schedule_order

GPT = "examples.gpt.GPTLightningModule"
SMALL = {"n_layer": 2, "n_embd": 64}
TP_PLAN = {"model.blocks.*.attn.qkv_heads": "colwise", "model.blocks.*.attn.proj": "rowwise",
           "model.blocks.*.mlp.fc": "colwise", "model.blocks.*.mlp.proj": "rowwise"}
TINY = Workload(micro_batch=2, seq_len=16, precision="32")


@pytest.fixture(autouse=True)
def _no_process_group_left_over():
    """The planner refuses to run inside a process with a process group (a training job); a one-process
    Trainer run earlier in this test session leaves its world-1 group behind, so end it first."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield


def _facts(tp_plan=None, **init_args):
    spec = resolve_model(GPT, {**SMALL, **init_args})
    return model_facts(spec.build(), tp_plan, pipeline_ok=True, max_tp=2)


def test_candidates_pruned_to_what_world_and_model_allow():
    cluster = Cluster(nodes=2, devices=2)
    no_tp, pruned = enumerate_candidates(cluster, _facts(), Search(cpu_offload=(False,), activation_checkpointing=(False,), reshard_after_forward=(True,)))
    names = sorted(c.name for c in no_tp)
    assert names == ["FSDP 4", "HSDP 2x2", "PP 2 x FSDP 2"]
    assert any("TP 2: the model has no TP plan" in p for p in pruned)
    assert any("PP 4: more stages than the model's 2 blocks" in p for p in pruned)
    with_tp, _ = enumerate_candidates(cluster, _facts(TP_PLAN), Search(cpu_offload=(False,), activation_checkpointing=(False,), reshard_after_forward=(True,)))
    assert "FSDP 2 x TP 2" in {c.name for c in with_tp}
    # n_head=3 cannot be split over 2 TP ranks
    odd, pruned = enumerate_candidates(cluster, _facts(TP_PLAN, n_head=3, n_embd=48), Search(tp_sizes=(2,)))
    assert all(c.tp == 1 for c in odd) and any("TP 2: does not divide" in p for p in pruned)
    every, _ = enumerate_candidates(cluster, _facts())
    assert len(every) == 3 * 2 * 2 * 2  # meshes x reshard x offload x activation checkpointing


def test_pipeline_split_and_schedule_order():
    facts = _facts(n_layer=4)
    cands, _ = enumerate_candidates(Cluster(nodes=1, devices=4), facts, Search(pp_sizes=(4,), hsdp=False, cpu_offload=(False,), activation_checkpointing=(False,), reshard_after_forward=(True,)))
    assert [c.pipeline_split_points for c in cands if c.pp == 4] == [("model.blocks.1", "model.blocks.2", "model.blocks.3")]
    # torch's 1F1B: the first of 2 stages warms up with 2 forwards, the last alternates
    assert schedule_order("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", 1, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert schedule_order("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def _padded_bytes(module: nn.Module, shards: int, itemsize: int = 4) -> int:
    """FSDP2's flat all-gather size of a unit: each parameter's dim 0 padded to a multiple of the shard count."""
    return sum(math.ceil(p.shape[0] / shards) * shards * (p.numel() // p.shape[0]) * itemsize for p in module.parameters())


def test_fsdp_and_hsdp_bytes_follow_fsdp2_sizes():
    cluster = Cluster(nodes=2, devices=2)
    spec = resolve_model(GPT, SMALL)
    meta = spec.build()
    block = _padded_bytes(meta.model.blocks[0], 4)
    root = sum(_padded_bytes(m, 4) for m in (meta.model.tok_emb, meta.model.pos_emb, meta.model.ln_f, meta.model.head))
    slots = sum(1 for p in meta.parameters() if p.requires_grad)
    result = plan(spec, cluster=cluster, workload=TINY, candidates=[Candidate((4,)), Candidate((2, 2))], progress=False)
    fsdp = result.find("FSDP 4")
    gathers = sorted(c.bytes for c in fsdp.calls if c.kind == "all_gather")
    # forward: root + 2 blocks; backward: the 2 blocks again (resharded after forward); the root stays gathered
    assert gathers == sorted([root] + [block] * 4)
    assert sorted(c.bytes for c in fsdp.calls if c.kind == "reduce_scatter") == sorted([root, block, block])
    control = [c for c in fsdp.calls if c.dtype == torch.int32]
    assert [(c.kind, c.bytes, c.ranks) for c in control] == [("all_reduce", 4 * (1 + 2 * slots), (0, 1, 2, 3))]
    hsdp = result.find("HSDP 2x2")
    block2, root2 = _padded_bytes(meta.model.blocks[0], 2), sum(_padded_bytes(m, 2) for m in (meta.model.tok_emb, meta.model.pos_emb, meta.model.ln_f, meta.model.head))
    replicas = sorted(c.bytes for c in hsdp.calls if c.kind == "all_reduce" and c.floating)
    assert replicas == sorted([root2 // 2, block2 // 2, block2 // 2])  # each shard all-reduced across replicas
    assert {link_of(c.ranks, cluster) for c in hsdp.calls if c.kind in ("all_gather", "reduce_scatter")} == {"intra"}
    assert {link_of(c.ranks, cluster) for c in hsdp.calls if c.kind == "all_reduce" and c.floating} == {"inter"}
    # memory: the sharded state is a quarter (FSDP 4) and a half (HSDP 2x2) of the model's fp32 bytes (padding aside)
    total = sum(p.numel() for p in meta.parameters()) * 4
    assert fsdp.memory.params == pytest.approx(total / 4, rel=0.02) and hsdp.memory.params == pytest.approx(total / 2, rel=0.02)
    assert fsdp.memory.optimizer == 2 * fsdp.memory.params and fsdp.memory.grads == fsdp.memory.params
    assert fsdp.memory.peak > fsdp.memory.params + fsdp.memory.grads + fsdp.memory.optimizer


def test_pipeline_control_calls():
    result = plan(GPT, SMALL, cluster=Cluster(nodes=2, devices=2), workload=Workload(micro_batch=1, seq_len=16, precision="32", pipeline_microbatches=2),
                  candidates=[Candidate((2,), pp=2, pipeline_split_points=("model.blocks.1",))], progress=False)
    entry = result.ranked[0]
    last = entry.runs[1]
    assert [(c.kind, c.ranks, c.bytes) for c in control_calls(last, entry.candidate, result.cluster)] == [
        ("broadcast", (0, 2), 4), ("all_reduce", (2, 3), 4), ("all_reduce", (0, 1, 2, 3), 4)]
    sends = [c for c in entry.runs[0].calls if c.kind == "send"]
    assert len(sends) == 2 and all(c.bytes == 1 * 16 * 64 * 4 for c in sends)  # one activation (1 x 16 x 64 fp32) per micro-batch


def simulated_cpu_cluster(link_gbit: float) -> Cluster:
    """The benchmark's 2 x 2 CPU cluster (benchmarks/results/cluster.md), with its shaped link.

    The loopback, compute and memory constants describe the 2-core machine the benchmark ran on
    (docs/planning.md says how they were chosen); gloo computes on the same cores: no overlap.
    """
    return Cluster(nodes=2, devices=2, device_memory=6e9, intra_node_bandwidth=2e9, inter_node_bandwidth=link_gbit * GBIT,
                   latency_s=1e-4, device_flops=13e9, memory_bandwidth=2e9, overlap=0.0)


def test_ranking_follows_the_measured_link_speeds():
    model = {"n_layer": 6, "n_embd": 256, "n_head": 4, "vocab_size": 32768, "block_size": 32}
    workload = Workload(micro_batch=4, seq_len=32, precision="32")
    planned = plan(GPT, model, cluster=simulated_cpu_cluster(1), workload=workload, candidates=[Candidate((4,)), Candidate((2, 2))], progress=False)
    # The 10 Gbit/s cluster differs only in its link: the same simulation, ranked again.
    results = {1: planned, 10: planned.with_cluster(simulated_cpu_cluster(10))}
    ranked = {gbit: [e.candidate.name for e in result.ranked] for gbit, result in results.items()}
    for gbit, result in results.items():
        print(gbit, {e.candidate.name: e.time.total for e in result.ranked})
    assert ranked[1] == ["HSDP 2x2", "FSDP 4"]  # measured: HSDP 1.32x faster at 1 Gbit/s
    assert ranked[10] == ["FSDP 4", "HSDP 2x2"]  # measured: HSDP 0.90x (slower) at 10 Gbit/s
    # Ranked again for the cluster it was planned on, it is what plan() returned; another shape needs plan().
    again = results[10].with_cluster(simulated_cpu_cluster(1))
    assert [(e.candidate, e.time, e.memory, e.calls) for e in again.ranked] == [(e.candidate, e.time, e.memory, e.calls) for e in planned.ranked]
    with pytest.raises(ValueError, match=r"for 2 node\(s\) x 2 device\(s\); got 1 x 4"):
        planned.with_cluster(dataclasses.replace(simulated_cpu_cluster(1), nodes=1, devices=4))


class _ReadsValues(nn.Module):
    def __init__(self, vocab_size: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 4)
        self.scale = float(self.emb.weight.sum())  # reads a value: impossible on the meta device


def test_errors_are_clear():
    with pytest.raises(ModelBuildError, match="cannot be built on the meta device"):
        plan(f"{__name__}._ReadsValues", cluster=Cluster(nodes=1, devices=2), workload=TINY, progress=False)
    with pytest.raises(ModelBuildError, match="does not import"):
        plan("no_such_pkg.Model", cluster=Cluster(nodes=1, devices=2), progress=False)
    with pytest.raises(ValueError, match="expects an int >= 1"):
        Cluster(nodes=0)
    big = {"n_layer": 2, "n_embd": 256, "vocab_size": 1024, "block_size": 16}
    with pytest.raises(ClusterTooSmall, match=r"smallest cluster of this kind that could hold it is (\d+) node") as info:
        plan(GPT, big, cluster=Cluster(nodes=1, devices=2, device_memory=20e6), workload=Workload(micro_batch=1, seq_len=16, precision="32"),
             search=Search(reshard_after_forward=(True,), cpu_offload=(False,), activation_checkpointing=(False,)), progress=False)
    nodes = int(info.value.args[0].split("could hold it is ")[1].split(" node")[0])
    # the named cluster does hold it: the error carries that cluster's plan, whose best candidate the message names
    assert nodes > 1
    smallest = info.value.smallest
    assert smallest is not None and (smallest.cluster.nodes, smallest.cluster.devices, smallest.cluster.device_memory) == (nodes, 2, 20e6)
    assert smallest.best is not None and smallest.best.fits and f"{smallest.best.candidate.name} peaks at" in info.value.args[0]
    assert info.value.result.best is None and info.value.result.cluster.nodes == 1


def test_yaml_block_parses_with_the_example_cli(tmp_path):
    import hp_lightning
    from examples.train import main

    result = plan(GPT, SMALL, cluster=Cluster(nodes=1, devices=2, device_memory=1e9), workload=TINY, tp_plan=TP_PLAN,
                  search=Search(reshard_after_forward=(True,), cpu_offload=(False,), activation_checkpointing=(True,), pp_sizes=(1,)), progress=False)
    block = yaml.safe_load(result.strategy_yaml())
    init_args = block["trainer"]["strategy"]["init_args"]
    hp_lightning.HSDPStrategy(**init_args)  # every option valid
    config = {"trainer": {**block["trainer"], "accelerator": "cpu", "max_steps": 1}, "model": SMALL, "data": {"block_size": 64}}
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(path), "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(out.getvalue())
    assert printed["trainer"]["strategy"]["class_path"] == "hp_lightning.HSDPStrategy"
    assert printed["trainer"]["strategy"]["init_args"]["mesh_shape"] == init_args["mesh_shape"]


def test_cli_dispatch(capsys):
    from hp_lightning.__main__ import main

    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert main(["plan", GPT, "--init-args", '{"n_layer": 2, "n_embd": 64}', "--nodes", "1", "--devices", "2", "--seq-len", "16",
                 "--precision", "32", "--no-offload", "--no-ac", "--keep-gathered", "never", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "FSDP 2" in out and "class_path: hp_lightning.HSDPStrategy" in out


def test_cpu_memory_method_separates_tensors_from_the_heap():
    """--validate's measure: the heap sampler sees a tensor's bytes, the census counts only this run's tensors."""
    import gc
    import time

    from hp_lightning.core.diagnostics import HeapSampler
    from hp_lightning.planner.validate import _frozen_gc, live_tensor_bytes, measure_rank, run_validation

    size = 4 * 2**20
    try:
        with HeapSampler() as heap, _frozen_gc():
            assert live_tensor_bytes() == 0  # what existed before is frozen out of the census
            start = time.time_ns()
            block = torch.ones(size // 4)
            view = block[: size // 8]  # a view shares the storage: counted once
            heap.sample()
            held = heap.heap_at(time.time_ns())
            tensors = live_tensor_bytes()
            del block, view
            heap.sample()
            peak, after = heap.heap_peak(start, time.time_ns()), heap.heap_at(time.time_ns())
    finally:
        gc.unfreeze()  # _frozen_gc leaves the objects before it frozen (a measuring process's state); not this test session's
    assert tensors == size
    # Within 1 MiB either way: malloc's headers and Python's objects add, and a thread of the test runner
    # (pytest-xdist's channel) may free buffers of its own meanwhile.
    assert abs(held - size) < 2**20 and abs(peak - size) < 2**20, (held, peak, size)
    assert after < 2**20
    with pytest.raises(ValueError, match="at least 2 optimizer steps"):
        measure_rank(resolve_model(GPT, SMALL), {}, Cluster(nodes=1, devices=1), TINY, steps=1)
    with pytest.raises(ValueError, match="at least 2 optimizer steps"):
        run_validation(None, None, steps=1)
