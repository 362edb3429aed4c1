"""Composition: FSDP/HSDP x tensor parallelism and x expert parallelism, against one process.

Real gloo ranks, fp32, AdamW. Every launch checks several things (launches are the expensive part):

* FSDP 2 x TP 2 (4 ranks): parameters and logged losses equal a single-process run of the same
  model on the same global batches, plain and with ``accumulate_grad_batches=2`` plus clipping;
  TP collectives only inside ``tp`` groups, FSDP's only inside ``shard`` groups; TP peers see
  the same batches, data-parallel ranks disjoint ones; a sharded checkpoint is written.
* FSDP 4 (4 ranks) resumes that TP checkpoint exactly and writes its own.
* HSDP (2, 2) x TP 2 (8 ranks, marked ``eight_ranks``): parity, and it resumes the FSDP 4 checkpoint.
* FSDP 2 x EP 2 (4 ranks, a mixture-of-experts model): parity with accumulation and clipping;
  all-to-alls only inside ``ep`` groups.
* The seed's FSDP + TP and FSDP + EP snippets run as written (device type adapted), and a model
  built on the meta device equals its CPU twin after TP + FSDP.

Reference batches: Lightning's own DistributedSampler (shuffled, seed 0) on each data-parallel
rank; the single process reads the union of the ranks' b-th batches as its b-th batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch import Trainer, seed_everything
from torch import nn

from examples.moe import MoE
from tests.helpers import LossRecorder, full_params, make_dataset, max_rel_diff, run_distributed, trainer_kwargs

GLOBAL_BATCH = 16
STEPS = 4
TP_PLAN = {"net.blocks.*.fc": "colwise", "net.blocks.*.proj": "rowwise"}


class Block(nn.Module):
    """Pre-norm residual feed-forward block: dense (fc → GELU → proj) or a mixture of experts."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        if experts:
            self.moe = MoE(width, 2 * width, experts, top_k=2)
        else:
            self.fc = nn.Linear(width, 4 * width)
            self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.moe(h) if hasattr(self, "moe") else self.proj(torch.nn.functional.gelu(self.fc(h))))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, experts: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, experts) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class ComposedModule(pl.LightningModule):
    """Builds its net in ``__init__`` (every rank the same weights), logs the synchronized loss."""

    def __init__(self, experts: int = 0, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = Net(experts=experts)
        self.optimizer = optimizer
        self.batches: list[torch.Tensor] = []
        self.samples_seen = torchmetrics.SumMetric()  # synced over data-parallel ranks only (TP peers see the same)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append(x.detach().clone())
        self.samples_seen.update(torch.tensor(float(x.shape[0])))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # SGD shows a wrong gradient scale (Adam is blind to it); AdamW the rest.
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class GlobalBatches(torch.utils.data.Sampler):
    """The single-process order: batch b is the concatenation of every dp rank's b-th batch."""

    def __init__(self, dataset, dp: int, per_rank: int) -> None:
        self.order: list[int] = []
        ranks = [list(torch.utils.data.DistributedSampler(dataset, dp, r, shuffle=True, seed=0)) for r in range(dp)]
        for b in range(len(ranks[0]) // per_rank):
            for r in range(dp):
                self.order += ranks[r][b * per_rank : (b + 1) * per_rank]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def reference(dp: int, experts: int = 0, accumulate: int = 1, clip: float | None = None, optimizer: str = "adamw") -> dict:
    seed_everything(0)
    model = ComposedModule(experts, optimizer)
    recorder = LossRecorder()
    data = make_dataset()
    per_rank = GLOBAL_BATCH // dp // accumulate
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank * dp, sampler=GlobalBatches(data, dp, per_rank))
    trainer = Trainer(
        devices=1, max_steps=STEPS, callbacks=[recorder], accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        use_distributed_sampler=False, **trainer_kwargs(),
    )
    trainer.fit(model, loader)
    return {"params": full_params(model), "losses": recorder.losses}


class CountSteps(pl.Callback):
    """Counts collectives (with their groups) over the training batches after the first."""

    def __init__(self) -> None:
        from hp_lightning.core.diagnostics import CollectiveCounter

        self.counter = CollectiveCounter()
        self._in = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= 1 and not self._in:
            self.counter.__enter__()
            self._in = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._in:
            self.counter.__exit__(None, None, None)
            self._in = False

    def summary(self) -> dict:
        kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        return {
            "counts": dict(self.counter.by_kind()),
            "groups": {k: sorted(self.counter.groups(k)) for k in kinds},
        }


def fit(strategy_kwargs: dict, *, world: int, experts: int = 0, accumulate: int = 1, clip: float | None = None,
        steps: int = STEPS, save: str | None = None, resume: str | None = None, count: bool = False,
        optimizer: str = "adamw") -> dict:
    import hp_lightning

    seed_everything(0)
    model = ComposedModule(experts, optimizer)
    recorder = LossRecorder()
    counter = CountSteps()
    strategy = hp_lightning.HSDPStrategy(**strategy_kwargs)
    trainer = Trainer(
        devices=world, strategy=strategy, max_steps=steps, callbacks=[recorder, *([counter] if count else [])],
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, **trainer_kwargs(),
    )
    tp = strategy_kwargs.get("tensor_parallel_size", 1)
    per_rank = GLOBAL_BATCH // (world // tp) // accumulate
    # A plain shuffled loader: Lightning injects the DistributedSampler the strategy describes.
    trainer.fit(model, torch.utils.data.DataLoader(make_dataset(), batch_size=per_rank, shuffle=True), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    out = {
        "params": full_params(model),
        "losses": recorder.losses,
        "batches": [b.sum().item() for b in model.batches],
        "mesh": (tuple(trainer.strategy.device_mesh.mesh_dim_names), tuple(trainer.strategy.device_mesh.shape)),
        "placements": {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()},
        "report": trainer.strategy.sharding_summary().table(),
        "samples_seen": float(model.samples_seen.compute()),
        "gathered_rows": tuple(trainer.strategy.all_gather(torch.zeros(3)).shape),
        # Every rank votes (ModelCheckpoint's "is this better" decision), TP peers included.
        "votes": [trainer.strategy.reduce_boolean_decision(trainer.global_rank == 0, all=a) for a in (True, False)]
        + [trainer.strategy.reduce_boolean_decision(True)],
    }
    if count:
        out.update(counter.summary())
    return out


def assert_parity(results: list[dict], ref: dict, tol: float = 1e-5, losses: bool = True) -> None:
    for rank, res in enumerate(results):
        diff = max_rel_diff(res["params"], ref["params"])
        assert diff <= tol, f"rank {rank}: parameters differ from the single process by {diff:.2e} (> {tol})"
        if not losses:  # under accumulation the logged value is per micro-batch: parameters say it all
            continue
        assert len(res["losses"]) == len(ref["losses"]) == STEPS
        for got, want in zip(res["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, res["losses"], ref["losses"])


# ---------------------------------------------------------------------------------------------- TP


def _tp_worker(ckpt: str, full_ckpt: str) -> dict:
    kwargs = {"mesh_shape": [2], "tensor_parallel_size": 2, "tp_plan": TP_PLAN}
    plain = fit(kwargs, world=4, count=True, save=ckpt)
    accumulated = fit({**kwargs, "state_dict_type": "full"}, world=4, accumulate=2, clip=0.05, save=full_ckpt)
    sgd = fit(kwargs, world=4, optimizer="sgd")
    return {"plain": plain, "accumulated": accumulated, "sgd": sgd}


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("tp")
    ckpt, full_ckpt = str(directory / "tp.ckpt"), str(directory / "tp_full.ckpt")
    return {"ckpt": ckpt, "full": full_ckpt, "results": run_distributed(_tp_worker, 4, ckpt, full_ckpt, timeout=300)}


def test_fsdp_x_tp_matches_single_process(tp_run):
    results = tp_run["results"]
    # all(rank == 0) is False, any(...) True, all(True) True: every rank voted, TP peers included.
    assert [r["plain"]["votes"] for r in results] == [[False, True, True]] * 4
    # A torchmetrics sum and all_gather count each sample once (over the 2 dp ranks, not the 4 ranks).
    assert [r["plain"]["samples_seen"] for r in results] == [float(STEPS * GLOBAL_BATCH)] * 4
    assert [r["plain"]["gathered_rows"] for r in results] == [(2, 3)] * 4
    assert_parity([r["plain"] for r in results], reference(dp=2))
    assert_parity([r["accumulated"] for r in results], reference(dp=2, accumulate=2, clip=0.05), losses=False)
    assert_parity([r["sgd"] for r in results], reference(dp=2, optimizer="sgd"))
    plain = results[0]["plain"]
    assert plain["mesh"] == (("shard", "tp"), (2, 2))
    # Both splits on the TP-planned layers; the rest only data-parallel.
    assert plain["placements"]["net.blocks.0.proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert "_StridedShard" in plain["placements"]["net.blocks.0.fc.weight"]
    assert plain["placements"]["net.inp.weight"] == "(Shard(dim=0),)"
    assert "FSDP x TP mesh (shard=2, tp=2)" in plain["report"] and "shard:S(0),tp:S(1)" in plain["report"], plain["report"]


def test_fsdp_x_tp_collectives_stay_in_their_groups(tp_run):
    tp_groups, shard_groups = {(0, 1), (2, 3)}, {(0, 2), (1, 3)}
    for res in tp_run["results"]:
        plain = res["plain"]
        groups = {k: set(map(tuple, v)) for k, v in plain["groups"].items()}
        assert groups["all_gather"] and groups["all_gather"] <= shard_groups, groups
        assert groups["reduce_scatter"] and groups["reduce_scatter"] <= shard_groups, groups
        # Rowwise layers all-reduce their outputs inside tp groups; loss logging over dp groups.
        assert groups["all_reduce"] & tp_groups, groups
        assert groups["all_reduce"] <= tp_groups | shard_groups | {(0, 1, 2, 3)}, groups
        assert not groups["all_to_all"]


def test_tp_peers_see_the_same_batches_dp_ranks_disjoint_ones(tp_run):
    batches = [r["plain"]["batches"] for r in tp_run["results"]]
    assert batches[0] == batches[1] and batches[2] == batches[3]  # one TP group each
    assert all(a != b for a, b in zip(batches[0], batches[2]))  # the two data-parallel ranks


def test_tp_checkpoints_gather_to_plain_tensors_on_one_cpu_process(tp_run, tmp_path):
    from hp_lightning.checkpoint.__main__ import main as checkpoint_cli

    def weights(path: str) -> dict:
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        assert all(type(v) is torch.Tensor for v in state.values())
        return {k: v for k, v in state.items() if k.startswith("net.")}

    # A full checkpoint written by the TP x FSDP run itself.
    assert max_rel_diff(weights(tp_run["full"]), tp_run["results"][0]["accumulated"]["params"]) <= 1e-6
    # The converter CLI on the sharded one, in this process (no process group); its `python -m` entry point
    # is tests/unit/test_checkpoint_cli.py's.
    out = tmp_path / "consolidated.ckpt"
    assert checkpoint_cli(["consolidate", tp_run["ckpt"], str(out)]) == 0
    assert max_rel_diff(weights(str(out)), tp_run["results"][0]["plain"]["params"]) <= 1e-6


def _fsdp4_resume_worker(tp_ckpt: str, fsdp_ckpt: str) -> dict:
    resumed = fit({"mesh_shape": [4]}, world=4, resume=tp_ckpt)  # global step 4 = max_steps: load only
    continued = fit({"mesh_shape": [4]}, world=4, resume=tp_ckpt, steps=STEPS + 2, save=fsdp_ckpt)
    return {"resumed": resumed["params"], "continued": continued["params"]}


@pytest.fixture(scope="module")
def fsdp4_resume(tp_run, tmp_path_factory) -> dict:
    fsdp_ckpt = str(tmp_path_factory.mktemp("fsdp4") / "fsdp4.ckpt")
    results = run_distributed(_fsdp4_resume_worker, 4, tp_run["ckpt"], fsdp_ckpt, timeout=300)
    return {"ckpt": fsdp_ckpt, "results": results}


def test_tp_checkpoint_resumes_on_fsdp4_exactly(tp_run, fsdp4_resume):
    saved = tp_run["results"][0]["plain"]["params"]
    for res in fsdp4_resume["results"]:
        assert max_rel_diff(res["resumed"], saved) <= 1e-6


def _hsdp_tp_worker(fsdp_ckpt: str) -> dict:
    kwargs = {"mesh_shape": [2, 2], "tensor_parallel_size": 2, "tp_plan": TP_PLAN}
    run = fit(kwargs, world=8)
    back = fit(kwargs, world=8, resume=fsdp_ckpt, steps=STEPS + 2)  # FSDP 4 → HSDP x TP: load only
    return {"run": run, "back": back["params"]}


@pytest.mark.eight_ranks
def test_hsdp_x_tp_on_eight_ranks_matches_and_resumes_fsdp4(fsdp4_resume):
    results = run_distributed(_hsdp_tp_worker, 8, fsdp4_resume["ckpt"], timeout=420)
    assert results[0]["run"]["mesh"] == (("replicate", "shard", "tp"), (2, 2, 2))
    assert_parity([r["run"] for r in results], reference(dp=4))
    saved = fsdp4_resume["results"][0]["continued"]
    for res in results:
        assert max_rel_diff(res["back"], saved) <= 1e-6


# ---------------------------------------------------------------------------------------------- EP


def _ep_worker() -> dict:
    kwargs = {"mesh_shape": [4], "expert_parallel_size": 2}
    plain = fit(kwargs, world=4, experts=4, count=True)
    accumulated = fit(kwargs, world=4, experts=4, accumulate=2, clip=0.05)
    sgd = fit(kwargs, world=4, experts=4, optimizer="sgd")
    # HSDP 2 x 2 with ep = shard size: the experts shard over one rank (torch divides twice there).
    one_rank = fit({"mesh_shape": [2, 2], "expert_parallel_size": 2}, world=4, experts=4, optimizer="sgd")
    return {"plain": plain, "accumulated": accumulated, "sgd": sgd, "one_rank": one_rank}


def test_fsdp_x_ep_matches_single_process_and_all_to_all_stays_in_ep_groups():
    results = run_distributed(_ep_worker, 4, timeout=300)
    assert_parity([r["plain"] for r in results], reference(dp=4, experts=4))
    assert_parity([r["accumulated"] for r in results], reference(dp=4, experts=4, accumulate=2, clip=0.05), losses=False)
    # Expert gradients average over all 4 data-parallel ranks (FSDP over 2, the ep all-to-all over 2).
    sgd_reference = reference(dp=4, experts=4, optimizer="sgd")
    assert_parity([r["sgd"] for r in results], sgd_reference)
    assert_parity([r["one_rank"] for r in results], sgd_reference)
    assert results[0]["one_rank"]["mesh"][1] == (2, 1, 2), results[0]["one_rank"]["mesh"]
    plain = results[0]["plain"]
    assert plain["mesh"] == (("expert_shard", "ep"), (2, 2))
    assert "Shard(dim=0)" in plain["placements"]["net.blocks.0.moe.experts.w_in"]
    ep_groups, expert_shard_groups, shard_groups = {(0, 1), (2, 3)}, {(0, 2), (1, 3)}, {(0, 1, 2, 3)}
    for res in results:
        groups = {k: set(map(tuple, v)) for k, v in res["plain"]["groups"].items()}
        assert groups["all_to_all"] and groups["all_to_all"] <= ep_groups, groups
        assert groups["all_gather"] <= shard_groups | expert_shard_groups, groups
        assert groups["all_gather"] & expert_shard_groups and groups["all_gather"] & shard_groups, groups
        assert groups["reduce_scatter"] <= shard_groups | expert_shard_groups, groups


# ---------------------------------------------------------------------------------------------- seed API


def _seed_snippets() -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import hp_lightning
    from hp_lightning import ExpertParallel, fully_shard, init_device_mesh, parallelize_module

    dist.init_process_group("gloo")
    out = {}
    # FSDP + TP, as in the seed (device "npu" → "cpu").
    torch.manual_seed(0)
    model = Net()
    twin = Net()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(6, 8)
    dp_size, tp_size = 2, 2
    mesh = init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    tp_plan = {"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}
    parallelize_module(model, mesh["tp"], tp_plan)
    model = fully_shard(model, mesh=mesh["dp"])
    out["tp"] = float((model(x) - twin(x)).abs().max())
    # FSDP + EP, as in the seed: experts split over "ep", the MoE block sharded over "fsdp".
    torch.manual_seed(1)
    moe = MoE(8, 16, num_experts=4, top_k=2)
    moe_twin = MoE(8, 16, num_experts=4, top_k=2)
    moe_twin.load_state_dict(moe.state_dict())
    fsdp_size, ep_size = 2, 2
    mesh = init_device_mesh("cpu", (fsdp_size, ep_size), mesh_dim_names=("fsdp", "ep"))
    ExpertParallel().apply(moe.experts, mesh["ep"])
    fully_shard(moe, mesh=mesh["fsdp"])
    tokens = torch.randn(5, 8)  # the same tokens on every rank of an ep group
    y = moe(tokens)
    y.sum().backward()
    y_twin = moe_twin(tokens)
    y_twin.sum().backward()
    out["ep"] = float((y - y_twin).abs().max())
    grad = moe.experts.w_in.grad
    out["ep_grad"] = float((grad.full_tensor() - moe_twin.experts.w_in.grad).abs().max())
    out["experts_unit"] = isinstance(moe.experts, hp_lightning.HSDPModule)
    # Meta-device construction + TP + FSDP equals the model built on the CPU.
    from hp_lightning.core.materialize import meta_init_context
    from hp_lightning.core.mesh import MeshLayout, build_parallel_mesh
    from hp_lightning.core.options import HSDPOptions
    from hp_lightning.recipe.parallelize import ShardingPlan
    from hp_lightning.recipe.prepare import prepare_model

    cpu = {"init_device": torch.device("cpu"), "device": torch.device("cpu")}
    composed = build_parallel_mesh("cpu", MeshLayout(dp=(2,), tp=2))
    torch.manual_seed(2)
    real = Net().state_dict()
    torch.manual_seed(2)
    with meta_init_context():
        meta = Net()
    prepare_model(meta, composed, ShardingPlan.of(HSDPOptions(tp_plan=tp_plan)), **cpu)
    out["meta"] = max(float((v.full_tensor() - real[k]).abs().max()) for k, v in meta.state_dict().items() if isinstance(v, DTensor))
    # Refused at setup, on every rank, before any collective: no plan at all, a pattern matching nothing.
    out["errors"] = []
    for plan in (ShardingPlan(), ShardingPlan.of(HSDPOptions(tp_plan={"layers.*.fc": "colwise"})),
                 ShardingPlan.of(HSDPOptions(tp_plan=tp_plan, replicate_params=["blocks.0.fc.weight"]))):
        try:
            prepare_model(Net(), composed, plan, **cpu)
        except ValueError as exc:
            out["errors"].append(str(exc))
    # A Hugging Face model with tensor_parallel_size > 1 and no plan: its own base_model_tp_plan.
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(3)
    llama = LlamaForCausalLM(config)
    llama_twin = copy.deepcopy(llama)
    prepare_model(llama, composed, ShardingPlan(), **cpu)
    ids = torch.randint(0, 32, (2, 5))
    out["hf"] = float((llama(ids).logits - llama_twin(ids).logits).abs().max())
    out["hf_q"] = str(llama.model.layers[0].self_attn.q_proj.weight.placements)
    # LLM-aware automatic units (FSDP 4): embeddings and final norm + head are units, the root holds nothing.
    from examples.gpt import GPT, GPTConfig
    from hp_lightning.core.diagnostics import CollectiveCounter
    from hp_lightning.core.introspection import summarize, units_in_order

    torch.manual_seed(4)
    gpt = GPT(GPTConfig(vocab_size=4096, n_layer=2, n_head=2, n_embd=32, block_size=16))
    gpt_twin = copy.deepcopy(gpt)
    fsdp4 = build_parallel_mesh("cpu", MeshLayout(dp=(4,)))
    sharded = prepare_model(gpt, fsdp4, ShardingPlan(), **cpu)
    out["llm_report"] = summarize(gpt, units_in_order(gpt, sharded.units), fsdp4.world, [], torch.device("cpu")).table()
    tokens = torch.randint(0, 4096, (2, 16))
    gpt(tokens).mean().backward()  # lazy init
    with CollectiveCounter() as comms:
        logits = gpt(tokens)
        logits.mean().backward()
    out["llm_counts"] = dict(comms.by_kind())
    out["llm_forward"] = float((logits - gpt_twin(tokens)).abs().max())
    return out


def test_seed_snippets_run_as_written_meta_init_is_exact_hf_plans_apply_and_bad_plans_fail():
    for res in run_distributed(_seed_snippets, 4):
        assert res["tp"] < 1e-5 and res["ep"] < 1e-5, res
        assert res["ep_grad"] < 1e-5, res  # expert gradients averaged over the ep ranks too
        assert res["experts_unit"]
        assert res["meta"] == 0.0, res
        assert "there is no TP plan" in res["errors"][0] and "matches no module of Net" in res["errors"][1], res["errors"]
        assert "cannot be kept whole" in res["errors"][2] and "blocks.0.fc.weight" in res["errors"][2], res["errors"]
        assert res["hf"] < 1e-5 and "Shard(dim=0)" in res["hf_q"], res
        rows = {line.split()[0]: line.split() for line in res["llm_report"].splitlines()[3:-1]}
        assert rows["<root>"][1] == "0", res["llm_report"]  # the root keeps no parameter gathered
        assert rows["tok_emb+pos_emb"][9] == "yes" and rows["ln_f+head"][9] == "no", res["llm_report"]
        # embeddings 2 (forward + backward), 2 blocks x 2, head 1 (kept from forward); one reduce-scatter per unit
        assert res["llm_counts"] == {"all_gather": 7, "reduce_scatter": 4}, res["llm_counts"]
        assert res["llm_forward"] < 1e-5


# ---------------------------------------------------------------------------------------------- Fabric


def _fabric_tp() -> dict:
    from lightning.fabric import Fabric

    from hp_lightning import FabricHSDPStrategy

    strategy = FabricHSDPStrategy(mesh_shape=[2], tensor_parallel_size=2, tp_plan={"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"})
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    twin = Net()
    twin.load_state_dict(model.state_dict())
    model = fabric.setup_module(model)
    x = torch.randn(4, 8)
    out = model(x)
    fabric.backward(out.sum())
    dp_value = torch.tensor(float(fabric.global_rank // 2))  # the same on both ranks of a TP group
    return {
        "forward": float((out - twin(x)).abs().max()),
        "mesh": str(fabric.strategy.device_mesh),
        "sampler": fabric.strategy.distributed_sampler_kwargs,
        "dp_sum": float(fabric.strategy.all_reduce(dp_value, reduce_op="sum")),
    }


def test_fabric_takes_the_same_composition_options():
    for rank, res in enumerate(run_distributed(_fabric_tp, 4)):
        assert res["forward"] < 1e-5 and "(shard=2, tp=2)" in res["mesh"], res
        assert res["sampler"] == {"num_replicas": 2, "rank": rank // 2}  # TP peers: one data-parallel rank
        assert res["dp_sum"] == 1.0  # 0 + 1 over the data-parallel ranks, not 0 + 0 + 1 + 1 over the world
