"""Pipeline parallelism × FSDP/HSDP under the Trainer, against one process training the whole model.

One 4-rank launch (2 stages × 2 data-parallel ranks) runs every configuration; the reference runs
here, on one process, with the same model, data (global batch 16), AdamW and steps. Final
parameters (each stage's, gathered within the stage) and every logged ``train_loss`` are compared.
Checkpoints: a pipeline's sharded save resumes as FSDP over 4 ranks, whose save resumes as the
pipeline again, each continuing the same run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers import full_params, max_rel_diff, run_distributed, trainer_kwargs
from tests.pipeline_models import VOCAB, LossLog, PipelinedModule, tiny_hf_model

STEPS = 4
RESUME_SAMPLES = 32  # two global batches per epoch
SPLIT = ["net.blocks.2"]
CONFIGS: dict[str, dict[str, Any]] = {
    # name: (strategy options, trainer options)
    "fsdp2_1f1b_m2": {
        "strategy": dict(mesh_shape=[2], pipeline_schedule="1f1b", pipeline_microbatches=2),
        "trainer": dict(val_check_interval=2, limit_val_batches=2),  # validation after steps 2 and 4
    },
    "fsdp2_gpipe_m4_acc2_clip": {
        "strategy": dict(mesh_shape=[2], pipeline_schedule="gpipe", pipeline_microbatches=4),
        "trainer": dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
    },
    "hsdp1x2_1f1b_m4": {"strategy": dict(mesh_shape=[1, 2], pipeline_schedule="1f1b", pipeline_microbatches=4), "trainer": {}},
    # Built in configure_model on the meta device: each rank materializes its own stage only.
    "hsdp1x2_gpipe_m2_meta": {"strategy": dict(mesh_shape=[1, 2], pipeline_schedule="gpipe", pipeline_microbatches=2), "trainer": {}, "meta": True},
    # torch's own nn.TransformerEncoder, cut between its layers, built on the meta device.
    "encoder_fsdp2_1f1b_m2_meta": {
        "strategy": dict(mesh_shape=[2], pipeline_microbatches=2, pipeline_split_points=["net.encoder.layers.2"]),
        "trainer": {},
        "meta": True,
        "net": "encoder",
    },
}


class CountOneStep(Callback):
    """Records every collective (with its group, or the peer pair for send/recv) during the second batch."""

    def __init__(self) -> None:
        from hp_lightning.core.diagnostics import CollectiveCounter

        self.counter = CollectiveCounter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.counter.__exit__(None, None, None)

    def summary(self) -> dict[str, list[tuple[int, ...]]]:
        out: dict[str, list[tuple[int, ...]]] = {}
        for call in self.counter.calls:
            out.setdefault(call.kind, []).append(call.ranks)
        return out


def fit(
    world: int,
    strategy: Optional[dict[str, Any]],
    trainer_options: dict[str, Any],
    *,
    count: bool = False,
    steps: int = STEPS,
    pipeline: bool = True,
    save_to: Optional[Path] = None,
    ckpt_path: Optional[Path] = None,
    samples: int = 128,
    meta: bool = False,
    net: str = "staged",
    extra_callbacks: tuple[Callback, ...] | list[Callback] = (),
) -> dict[str, Any]:
    import hp_lightning

    seed_everything(0)
    if net.startswith("hf_"):  # "hf_llama", "hf_qwen2"
        model: PipelinedModule = HFCausalLM(net.removeprefix("hf_"), samples=samples)
    else:
        model = PipelinedModule(samples=samples, build_in_configure_model=meta, net=net)
    log, counter = LossLog(), CountOneStep()
    callbacks: list[Callback] = [log, *([counter] if count else []), *extra_callbacks]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_train_steps=steps, save_top_k=-1, filename="{step}"))
    kwargs = trainer_kwargs(enable_checkpointing=save_to is not None, **{"limit_val_batches": 0, **trainer_options})
    if strategy is None:
        trainer = Trainer(devices=1, max_steps=steps, callbacks=callbacks, **kwargs)
    else:
        options = {"pipeline_parallel_size": 2, "pipeline_split_points": SPLIT, **strategy} if pipeline else strategy
        trainer = Trainer(devices=world, strategy=hp_lightning.HSDPStrategy(**options), max_steps=steps, callbacks=callbacks, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    out = {"params": full_params(model), "losses": log.losses, "val_losses": log.val_losses}
    out["collectives"] = counter.summary() if count else None
    summary = trainer.strategy.sharding_summary() if count else None  # a collective within each stage
    out["report"] = summary.table() if summary is not None else None
    out["stages"] = summary.stages if summary is not None else None  # under PP: every stage's plan
    if trainer_options.get("limit_val_batches"):  # then also predict, through the pipeline's forward-only schedule
        out["predictions"] = torch.cat([p.detach() for p in trainer.predict(model)])
    return out


def worker(tmp: str) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = {
            name: fit(4, c["strategy"], c["trainer"], count=name == "fsdp2_1f1b_m2", meta=c.get("meta", False), net=c.get("net", "staged"))
            for name, c in CONFIGS.items()
        }
    out["not_called_warnings"] = [str(w.message) for w in caught if "are not called" in str(w.message)]
    # Pipeline 2 x FSDP 2 (steps 1-2) -> FSDP over 4 ranks (steps 3-4) -> the pipeline again (steps 5-6).
    # Two batches per epoch: each save is at an epoch's end, so the resumed run reads the data the
    # straight run reads next, on any number of data-parallel ranks.
    root, pp = Path(tmp), dict(mesh_shape=[2], pipeline_microbatches=2)
    fit(4, pp, {}, steps=2, save_to=root / "pp", samples=RESUME_SAMPLES)
    fsdp4 = dict(mesh_shape=[4])
    out["fsdp4_from_pp"] = fit(
        4, fsdp4, {}, steps=4, pipeline=False, save_to=root / "fsdp4", ckpt_path=root / "pp" / "step=2.ckpt", samples=RESUME_SAMPLES
    )
    out["pp_from_fsdp4"] = fit(4, pp, {}, steps=6, ckpt_path=root / "fsdp4" / "step=4.ckpt", samples=RESUME_SAMPLES)
    # The same pipeline resumes its own checkpoint exactly (steps 3-4 after steps 1-2, against 1-4 straight).
    out["pp_from_pp"] = fit(4, pp, {}, steps=4, ckpt_path=root / "pp" / "step=2.ckpt", samples=RESUME_SAMPLES)
    out["pp_straight"] = fit(4, pp, {}, steps=4, samples=RESUME_SAMPLES)
    # A full checkpoint of a pipeline: rank 0 gathers every stage into one file with the model's own names.
    out["full"] = fit(4, dict(pp, state_dict_type="full"), {}, steps=2, samples=RESUME_SAMPLES, save_to=root / "pp_full")
    out["full"]["path"] = str(root / "pp_full" / "step=2.ckpt")
    out["pp_from_full"] = fit(4, pp, {}, steps=4, ckpt_path=root / "pp_full" / "step=2.ckpt", samples=RESUME_SAMPLES)
    out["leftovers"] = sorted(p.name for p in (root / "pp_full").iterdir())
    out["refused"] = refused_setups()
    out["seed"] = seed_snippet()
    return out


def tiny_qwen2() -> torch.nn.Module:
    """A tiny Hugging Face ``Qwen2ForCausalLM``, 4 layers (biased q/k/v projections, grouped-query attention: one KV head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    return Qwen2ForCausalLM(config)


class HFCausalLM(PipelinedModule):
    """A tiny Hugging Face ``*ForCausalLM`` (``kind``: ``"llama"`` or ``"qwen2"``) in a LightningModule written
    for one process: its forward is ``self.net(input_ids=x).logits``, no stage forward of its own; built in
    ``configure_model`` (on the meta device under HSDPStrategy); next-token data, cross-entropy."""

    def __init__(self, kind: str = "llama", samples: int = 128) -> None:
        super().__init__(samples=samples, build_in_configure_model=True, net="tied")  # "tied": the token data
        self.kind = kind

    def configure_model(self) -> None:
        if self.net is None:
            self.net = tiny_qwen2() if self.kind == "qwen2" else tiny_hf_model(self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x).logits

    def configure_optimizers(self) -> Any:
        """AdamW as for every model here; for Qwen2 with ``eps=1e-5`` instead of ``1e-8``.

        A quarter of the Qwen2 key biases' gradients nearly cancel (RoPE barely turns its
        slowest pairs over 4 positions, so a key bias there shifts every score alike): they are
        rounding-sized, and ``eps=1e-8`` makes AdamW turn their rounding into whole steps.
        Measured after 3 steps against one process: 7.9e-5 under PP 2 x FSDP 2 and 1.4e-4
        under plain FSDP over 4 ranks, no pipeline at all; with ``eps=1e-5``, 2.2e-6 and 7.5e-6.
        """
        config = super().configure_optimizers()
        if self.kind == "qwen2":
            for group in config["optimizer"].param_groups:
                group["eps"] = 1e-5
        return config


class NoLoss(PipelinedModule):
    pipeline_loss = None  # type: ignore[assignment]


class NoForward(PipelinedModule):
    forward = pl.LightningModule.forward  # type: ignore[assignment]


class Manual(PipelinedModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ThreePartBatch(PipelinedModule):
    """Batches of (input, target, mask) and no ``pipeline_batch``: which part is the target is not guessed."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader([(x, y, torch.ones(())) for x, y in loader.dataset], batch_size=loader.batch_size, sampler=loader.sampler)


def refused_setups() -> dict[str, str]:
    """What PP cannot run: each refused at setup (a batch it cannot split: at the first step), the same on every rank, before the stages communicate."""
    import hp_lightning

    cases: dict[str, tuple[type, Any, dict[str, Any]]] = {
        "no_pipeline_loss": (NoLoss, SPLIT, {}),
        "no_forward": (NoForward, SPLIT, {}),
        "manual": (Manual, SPLIT, {}),
        "bad_split": (PipelinedModule, ["net.block.2"], {}),
        # 2 x 3 = 6 stages, one block each at least, from a model of 4 blocks.
        "auto_too_few_blocks": (PipelinedModule, "auto", dict(pipeline_schedule="interleaved_1f1b", pipeline_stages_per_rank=3)),
        "three_part_batch": (ThreePartBatch, SPLIT, {}),
        # Parameter globs and module specs are written against the whole model: each names parameters or
        # modules of one stage only (net.head on stage 1, net.inp on stage 0), and is empty on the other;
        # one that matches nothing anywhere is refused.
        "globs_of_one_stage": (PipelinedModule, SPLIT, dict(
            ignored_params=["net.head.bias"], shard_placement={"net.inp.weight": 1},
            shard_modules=["net.inp", "net.blocks.*"], activation_checkpointing=["net.head"],
        )),
        "glob_of_no_stage": (PipelinedModule, SPLIT, dict(ignored_params=["net.head.bias", "net.tail.*"])),
        "module_spec_of_no_stage": (PipelinedModule, SPLIT, dict(activation_checkpointing=["net.head", "net.tail"])),
    }
    out = {}
    for name, (cls, split, extra) in cases.items():
        strategy = hp_lightning.HSDPStrategy(mesh_shape=[2], pipeline_parallel_size=2, pipeline_split_points=split, fault_watchdog=False, **extra)
        trainer = Trainer(devices=4, strategy=strategy, max_steps=1, **trainer_kwargs(limit_val_batches=0))
        try:
            model = cls()
            trainer.fit(model)
            sharded = strategy.sharded_model
            assert sharded is not None
            placements = {n: str(p.placements) for n, p in model.named_parameters() if n == "net.inp.weight"}
            out[name] = f"no error; ignored={sharded.ignored} placements={placements}"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def seed_snippet() -> dict[str, Any]:
    """The seed's FSDP + PP snippet: a (pp, dp) mesh, fully_shard per stage, PipelineStage, one GPipe step."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe

    import hp_lightning
    from hp_lightning.parallel import split_stage
    from tests.helpers import make_dataset
    from tests.pipeline_models import StagedNet

    mesh = hp_lightning.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = StagedNet()
    stage_index = mesh["pp"].get_local_rank()
    split_stage(model, ["blocks.2"], stage_index)
    for block in model.blocks:
        if any(True for _ in block.parameters()):
            hp_lightning.fully_shard(block, mesh=mesh["dp"])
    hp_lightning.fully_shard(model, mesh=mesh["dp"])
    try:
        hp_lightning.PipelineStage(model, stage_index, stage_num=2)
        missing_group = "no error"
    except ValueError as exc:
        missing_group = str(exc)
    stage = hp_lightning.PipelineStage(model, stage_index, stage_num=2, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    x, y = make_dataset(n=16)[:]
    dp = mesh["dp"].get_local_rank()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if stage_index == 0:
        schedule.step(x[dp::2])
    else:
        schedule.step(target=y[dp::2])
    optimizer.step()
    dist.barrier()
    return {"missing_group": missing_group, "params": full_params(model)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(worker, 4, str(tmp_path_factory.mktemp("pipeline")), timeout=400)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    out = {name: fit(1, None, c["trainer"], net=c.get("net", "staged")) for name, c in CONFIGS.items()}  # always built eagerly
    out["resume4"] = fit(1, None, {}, steps=4, samples=RESUME_SAMPLES)
    out["resume6"] = fit(1, None, {}, steps=6, samples=RESUME_SAMPLES)
    return out


def comparable(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without the key third of attention's ``in_proj_bias``: its gradient is zero up to rounding (softmax
    ignores a shift shared by all keys), and AdamW scales that rounding noise up to full-size steps, which
    differ with the order of any sum (measured: it alone differs, by 7e-4, from FSDP without PP too)."""
    out = dict(params)
    for name, value in params.items():
        if name.endswith("self_attn.in_proj_bias"):
            q, _, v = value.chunk(3)
            out[name] = torch.cat([q, v])
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pipeline_matches_one_process(runs: list[dict[str, Any]], references: dict[str, dict[str, Any]], name: str) -> None:
    ref = references[name]
    whole: dict[str, torch.Tensor] = {}
    for rank in runs:
        whole.update(rank[name]["params"])
    assert sorted(whole) == sorted(ref["params"]), "the stages together hold the whole model, under its own names"
    diff = max_rel_diff(comparable(whole), comparable(ref["params"]))
    print(f"{name}: max relative parameter difference {diff:.2e} after {STEPS} AdamW steps")
    assert diff <= 1e-5, f"{name}: parameters differ from one process by {diff:.2e}"
    stage_params = [set(rank[name]["params"]) for rank in runs]
    assert stage_params[0] == stage_params[1] and stage_params[2] == stage_params[3] and not stage_params[0] & stage_params[2]
    for rank in runs:  # every rank logs the batch's loss, computed on the last stage
        losses = rank[name]["losses"]
        assert len(losses) == len(ref["losses"]) and max(abs(a - b) for a, b in zip(losses, ref["losses"])) <= 1e-6, (losses, ref["losses"])


def test_validation_and_predict_run_forward_only_through_the_pipeline(runs: list[dict[str, Any]], references: dict[str, dict[str, Any]]) -> None:
    # The module's own step methods are not called under PP: said once per setup, on rank 0.
    said = runs[0]["not_called_warnings"]
    assert said and "['training_step', 'validation_step', 'predict_step'] are not called" in said[0], said
    assert not any(run["not_called_warnings"] for run in runs[1:])
    ref = references["fsdp2_1f1b_m2"]
    for rank, run in enumerate(runs):
        run = run["fsdp2_1f1b_m2"]
        assert len(run["val_losses"]) == len(ref["val_losses"]) == 2
        assert run["val_losses"] == pytest.approx(ref["val_losses"], abs=1e-6), (run["val_losses"], ref["val_losses"])
        # Data-parallel rank r (= rank % 2) predicted samples r, r + 2, ...; every stage returns them.
        mine = ref["predictions"][rank % 2 :: 2]
        assert run["predictions"].shape == mine.shape
        assert (run["predictions"] - mine).abs().max() <= 1e-5


def test_stages_only_talk_to_their_neighbour_and_shard_inside_their_stage(runs: list[dict[str, Any]]) -> None:
    # Ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1; each stage shards over its own pair.
    for rank, run in enumerate(runs):
        calls = run["fsdp2_1f1b_m2"]["collectives"]
        stage_ranks = (0, 1) if rank < 2 else (2, 3)
        peer = rank + 2 if rank < 2 else rank - 2
        assert set(calls.get("all_gather", [])) == {stage_ranks}, calls
        assert set(calls.get("reduce_scatter", [])) == {stage_ranks}, calls
        p2p = set(calls.get("send", [])) | set(calls.get("recv", []))
        assert p2p == {tuple(sorted((rank, peer)))}, calls
        # 2 micro-batches: stage 0 sends 2 activations and receives 2 gradients; stage 1 the reverse.
        assert len(calls.get("send", [])) == len(calls.get("recv", [])) == 2, calls


def test_sharding_report_covers_the_ranks_own_stage(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        report = run["fsdp2_1f1b_m2"]["report"]
        title = report.splitlines()[0]
        assert title.startswith(f"Sharding report (pipeline rank {rank // 2} of 2; "), report
        mine, theirs = ("net.blocks.1", "net.blocks.2") if rank < 2 else ("net.blocks.2", "net.blocks.1")
        assert re.search(rf"^{re.escape(mine)}\s", report, re.M) and not re.search(rf"^{re.escape(theirs)}\s", report, re.M), report


def test_pipeline_resumes_its_own_checkpoint_exactly(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        resumed, straight = rank["pp_from_pp"], rank["pp_straight"]
        assert max_rel_diff(resumed["params"], straight["params"]) == 0.0
        assert resumed["losses"] == straight["losses"][2:]


def test_pipeline_checkpoints_resume_as_fsdp_and_back(runs: list[dict[str, Any]], references: dict[str, dict[str, Any]]) -> None:
    fsdp4 = runs[0]["fsdp4_from_pp"]["params"]  # FSDP: every rank gathers the whole model
    diff4 = max_rel_diff(fsdp4, references["resume4"]["params"])
    whole: dict[str, torch.Tensor] = {}
    for rank in runs:
        whole.update(rank["pp_from_fsdp4"]["params"])
    diff6 = max_rel_diff(whole, references["resume6"]["params"])
    print(f"pipeline -> FSDP 4 (step 4): {diff4:.2e}; FSDP 4 -> pipeline (step 6): {diff6:.2e} max relative difference")
    assert diff4 <= 1e-5 and diff6 <= 1e-5, (diff4, diff6)
    # The resumed runs logged the steps they trained, with the reference's losses.
    assert runs[0]["fsdp4_from_pp"]["losses"] == pytest.approx(references["resume4"]["losses"][2:], abs=1e-6)
    assert runs[3]["pp_from_fsdp4"]["losses"] == pytest.approx(references["resume6"]["losses"][4:], abs=1e-6)


def test_what_a_pipeline_cannot_run_is_refused_at_setup(runs: list[dict[str, Any]]) -> None:
    expected = {
        "no_pipeline_loss": r"ValueError: .*pipeline_loss\(output, target\), which NoLoss does not define",
        "no_forward": r"ValueError: .*forward\(x\).*NoForward does not define forward",
        "manual": r"ValueError: .*manual optimization cannot; set automatic_optimization=True",
        "bad_split": r"ValueError: Pipeline split points \['net.block.2'\] are not modules.*net.blocks.2",
        "auto_too_few_blocks": r"ValueError: .*'auto'\): 6 stages .* need at least one block each, but 'net.blocks' holds 4",
        "three_part_batch": r"TypeError: Pipeline: cannot tell input from target in a list of 3 .*define pipeline_batch",
        "glob_of_no_stage": r"ValueError: ignored_params pattern 'net.tail.\*' matches no parameter",
        "module_spec_of_no_stage": r"ValueError: activation_checkpointing entry 'net.tail' matches no submodule",
    }
    for rank in runs:
        for case, pattern in expected.items():
            assert re.search(pattern, rank["refused"][case]), (case, rank["refused"][case])


def test_parameter_globs_of_another_stage_are_empty_on_this_one(runs: list[dict[str, Any]]) -> None:
    # Ranks 0, 1 hold stage 0 (net.inp, blocks 0-1), ranks 2, 3 stage 1 (blocks 2-3, net.head).
    for rank, run in enumerate(runs):
        if rank < 2:
            expected = "no error; ignored=[] placements={'net.inp.weight': '(Shard(dim=1),)'}"
        else:
            expected = "no error; ignored=['net.head.bias'] placements={}"
        assert run["refused"]["globs_of_one_stage"] == expected, run["refused"]["globs_of_one_stage"]


def test_seed_pipeline_stage_call_matches_one_process(runs: list[dict[str, Any]]) -> None:
    from tests.helpers import make_dataset
    from tests.pipeline_models import StagedNet

    torch.manual_seed(0)
    ref = StagedNet()
    x, y = make_dataset(n=16)[:]
    torch.nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    whole: dict[str, torch.Tensor] = {}
    for rank in runs:
        assert "pass group=mesh['pp'].get_group()" in rank["seed"]["missing_group"]
        whole.update(rank["seed"]["params"])
    expected = {k: v.detach() for k, v in ref.state_dict().items()}
    assert sorted(whole) == sorted(expected)
    assert max_rel_diff(whole, expected) <= 1e-5


def test_full_checkpoint_of_a_pipeline_loads_whole_on_one_cpu_process(runs: list[dict[str, Any]]) -> None:
    path = runs[0]["full"]["path"]
    trained: dict[str, torch.Tensor] = {}
    for rank in runs:
        trained.update(rank["full"]["params"])
    raw = torch.load(path, map_location="cpu", weights_only=False)
    assert raw["global_step"] == 2 and raw["hp_lightning"]["format"] == "full"
    optimizer = raw["optimizer_states"][0]
    assert sorted(optimizer["state"]) == sorted(trained) == sorted(optimizer["param_groups"][0]["params"])
    model = PipelinedModule.load_from_checkpoint(path, map_location="cpu")
    loaded = {name: p.detach() for name, p in model.named_parameters()}
    assert sorted(loaded) == sorted(trained) and max_rel_diff(loaded, trained) == 0.0
    # A pipeline resumes from the full file too (each stage reads its part of a temporary sharded copy).
    for rank in runs:
        assert max_rel_diff(rank["pp_from_full"]["params"], rank["pp_straight"]["params"]) == 0.0
        assert rank["pp_from_full"]["losses"] == rank["pp_straight"]["losses"][2:]
    assert not [name for name in runs[0]["leftovers"] if "for-pipeline" in name], runs[0]["leftovers"]
