"""Hugging Face in, Hugging Face out: ``load_weights`` from a sharded HF directory, ``save_hf`` and ``export-hf``.

One 4-rank launch runs every layout in the same processes, one after another (Fabric, the model
built on the meta device, HF weights loaded into the sharded model), for a tiny Llama (untied)
and a tiny GPT-2 (tied ``lm_head``):

* FSDP 4, HSDP 2 x 2 and FSDP 2 x TP 2 (Llama; GPT-2's ``Conv1D`` has no TP style): the loaded
  parameters equal ``from_pretrained`` on one process exactly, two AdamW steps give the losses of
  one process trained from ``from_pretrained`` (<= 1e-5), and ``strategy.save_hf`` writes a
  directory whose ``from_pretrained`` logits equal the trained model's (<= 1e-6), ties kept;
* per rank, the bytes the reader takes from the files (``safe_open(...).get_slice(key)[...]``,
  counted inside the rank) are exactly its own shards' bytes, a quarter of the model under FSDP 4;
* the FSDP 2 x TP 2 run also saves a sharded checkpoint, which ``export-hf`` (the CLI, in the
  parent) turns into a directory ``from_pretrained`` loads with the same logits.

Bad input (single process): a missing shard, an index naming a file outside the directory, a
stray shard, a truncated shard, a key, shape or dtype mismatch, a link, an existing output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 8, 2, 1e-2
LAYOUTS = {
    "fsdp4": dict(mesh_shape=[4]),
    "hsdp2x2": dict(mesh_shape=[2, 2]),
    "fsdp2_tp2": dict(mesh_shape=[2], tensor_parallel_size=2),
    "fsdp4_ep2": dict(mesh_shape=[4], expert_parallel_size=2),
}
CASES = [
    ("llama", "fsdp4"), ("llama", "hsdp2x2"), ("llama", "fsdp2_tp2"), ("gpt2", "fsdp4"), ("gpt2", "hsdp2x2"), ("mixtral", "fsdp4_ep2"),
]


def config(kind: str) -> Any:
    if kind == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0,
        )
    if kind in ("llama", "llama_tied"):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=kind == "llama_tied",
        )
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def model_class(kind: str) -> Any:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM

    return {"llama": LlamaForCausalLM, "llama_tied": LlamaForCausalLM, "gpt2": GPT2LMHeadModel, "mixtral": MixtralForCausalLM}[kind]


def save_pretrained_dirs(root: Path) -> dict[str, Path]:
    """Tiny pretrained directories, several shards each, saved the Hugging Face way.

    Mixtral: ``save_pretrained`` writes the experts one by one under their legacy names
    (``block_sparse_moe.experts.0.w1.weight``), which ``from_pretrained`` merges into the model's
    fused 3-D ``mlp.experts.gate_up_proj``; ``load_weights`` does not convert (it refuses, see
    below), so the Mixtral directory the ranks load is written in the model's own names by
    ``save_hf``, and ``from_pretrained`` reads it as well.
    """
    from hp_lightning.checkpoint.hf import save_hf

    dirs = {}
    for seed, kind in enumerate(("llama", "gpt2", "mixtral", "llama_tied")):
        torch.manual_seed(100 + seed)
        model = model_class(kind)(config(kind))
        dirs[kind] = root / kind
        if kind == "mixtral":
            dirs["mixtral_legacy"] = root / "mixtral_legacy"
            model.save_pretrained(dirs["mixtral_legacy"])
            save_hf(model, dirs[kind], config=dirs["mixtral_legacy"], max_shard_size="8KB")
        else:
            model.save_pretrained(dirs[kind], max_shard_size="8KB")
    return dirs


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(8))


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def local_nbytes(module: torch.nn.Module) -> int:
    """Bytes of this rank's own shards of every tensor the files hold (tied ones once)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in module.state_dict(keep_vars=True).values():  # the file's tensors; keep_vars: tied names share one object
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


class CountingOpen:
    """``safetensors.safe_open`` that counts the bytes each slice read takes from the file (headers are free)."""

    total = 0

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.original(*args, **kwargs)
        counter = self

        class Slice:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getitem__(self, index: Any) -> torch.Tensor:
                tensor = self.inner[index]
                counter.total += tensor.numel() * tensor.element_size()
                return tensor

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        class Handle:
            def __enter__(self) -> Handle:
                handle.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                handle.__exit__(*exc)

            def get_slice(self, key: str) -> Slice:
                return Slice(handle.get_slice(key))

            def get_tensor(self, key: str) -> torch.Tensor:
                tensor = handle.get_tensor(key)
                counter.total += tensor.numel() * tensor.element_size()
                return tensor

            def __getattr__(self, name: str) -> Any:
                return getattr(handle, name)

        return Handle()


class CountRandomInit:
    """Counts random-number operators (``normal_``, ``uniform_``, ...) on real tensors while active: the
    initialization a model built for real runs, and one built on the meta device does not."""

    RANDOM = ("normal", "uniform", "random", "bernoulli", "randn", "rand", "randint", "randperm", "exponential", "cauchy", "geometric", "log_normal")

    def __enter__(self) -> CountRandomInit:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.count = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = func.__name__.split(".")[0].rstrip("_")
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if name in counter.RANDOM and not all(t.is_meta for t in tensors):
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


# ---------------------------------------------------------------- the ranks


def run_case(kind: str, layout: str, dirs: dict[str, str], root: str) -> dict[str, Any]:
    import safetensors
    from lightning.fabric import Fabric

    import hp_lightning
    from hp_lightning.fabric import HSDPStrategy

    fabric = Fabric(strategy=HSDPStrategy(**LAYOUTS[layout]), devices=4, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = model_class(kind)(config(kind))
    on_meta = all(p.is_meta for p in model.parameters())
    counting = CountingOpen(safetensors.safe_open)
    safetensors.safe_open = counting
    try:
        # Named before setup: the strategy loads it while materializing, without initializing what it loads.
        hp_lightning.load_weights(model, dirs[kind])
        with CountRandomInit() as random_init:
            model = fabric.setup_module(model)
    finally:
        safetensors.safe_open = counting.original
    inner = model.module
    out: dict[str, Any] = {
        "on_meta": on_meta,
        "random_init_ops": random_init.count,
        "read_bytes": counting.total,
        "own_bytes": local_nbytes(inner),
        "loaded": {n: full(p) for n, p in inner.state_dict().items()},
    }
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    sampler = fabric.strategy.distributed_sampler_kwargs
    dp, dp_size = sampler["rank"], sampler["num_replicas"]
    losses = []
    for batch in tokens():
        x = batch[dp::dp_size]
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out.update(dp=dp, dp_size=dp_size, losses=losses)
    with torch.no_grad():
        out["logits"] = model(input_ids=probe()).logits.detach().clone()
    out["tied"] = kind != "gpt2" or inner.lm_head.weight is inner.transformer.wte.weight
    saved = Path(root) / f"save_hf_{kind}_{layout}"
    fabric.strategy.save_hf(saved, config=dirs[kind], max_shard_size="8KB")
    if layout == "fsdp2_tp2":
        fabric.save(Path(root) / f"ckpt_{kind}_{layout}", {"model": model, "optimizer": optimizer})
    out["trained"] = {n: full(p) for n, p in inner.state_dict().items()}
    return out


class PipelinedLM(pl.LightningModule):
    """The Trainer way: built in ``configure_model`` (meta device); HF weights named right there (the strategy
    loads them while materializing) or loaded in ``on_fit_start`` into the materialized model."""

    def __init__(self, kind: str, hf_dir: str, load_in_configure_model: bool) -> None:
        super().__init__()
        self.kind, self.hf_dir, self.load_in_configure_model = kind, hf_dir, load_in_configure_model
        self.net: Optional[torch.nn.Module] = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        import hp_lightning

        if self.net is None:
            self.net = model_class(self.kind)(config(self.kind))
            if self.load_in_configure_model:
                hp_lightning.load_weights(self, self.hf_dir, prefix="net.")

    def on_fit_start(self) -> None:
        import hp_lightning

        if not self.load_in_configure_model:
            hp_lightning.load_weights(self, self.hf_dir, prefix="net.")  # this stage's keys; the others' are elsewhere
        self.loaded = {n: full(p) for n, p in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x).logits

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(*next_tokens())
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False, **kwargs)
        return torch.utils.data.DataLoader(data, batch_size=BATCH // kwargs["num_replicas"], sampler=sampler)


def next_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    rows = tokens().flatten(0, 1)
    return rows[:, :-1], rows[:, 1:]




def run_pipeline(kind: str, dirs: dict[str, str], root: str) -> dict[str, Any]:
    """PP 2 x FSDP 2 under the Trainer: each stage loads its own layers' slices (tied Llama: ``lm_head`` on the
    last stage from the embedding's tensor, which the first holds), trains, and writes its part of ``save_hf``."""
    from lightning.pytorch import Trainer

    from hp_lightning import HSDPStrategy

    module = PipelinedLM(kind, dirs[kind], load_in_configure_model=kind == "llama_tied")
    strategy = HSDPStrategy(mesh_shape=[2], pipeline_parallel_size=2, pipeline_split_points=["net.model.layers.1"], pipeline_microbatches=2)
    trainer = Trainer(devices=4, strategy=strategy, max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    trainer.strategy.save_hf(Path(root) / f"save_hf_{kind}_pp2_fsdp2", prefix="net.", config=dirs[kind], max_shard_size="8KB")
    trained = {n.removeprefix("net."): full(p) for n, p in module.named_parameters()}
    return {"loaded": {k.removeprefix("net."): v for k, v in module.loaded.items()}, "losses": module.losses, "trained": trained}


def refusals(dirs: dict[str, str], root: str) -> dict[str, str]:
    """Bad input with 4 ranks: the same error on every rank (none left waiting in a collective)."""
    import hp_lightning

    broken = Path(root) / "llama_missing_shard"
    if not broken.exists() and int(os.environ["RANK"]) == 0:
        copy_dir(Path(dirs["llama"]), broken)
        sorted(broken.glob("model-*.safetensors"))[1].unlink()
    torch.distributed.barrier()
    errors = {}
    wider = model_class("llama")(config("llama").__class__(**{**config("llama").to_dict(), "vocab_size": VOCAB + 1}))
    for name, model, path in (("missing shard", model_class("llama")(config("llama")), broken), ("shape", wider, dirs["llama"])):
        try:
            hp_lightning.load_weights(model, path)
            errors[name] = "no error"
        except (ValueError, OSError) as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return errors


def worker(dirs: dict[str, str], root: str) -> dict[str, Any]:
    out: dict[str, Any] = {f"{kind}/{layout}": run_case(kind, layout, dirs, root) for kind, layout in CASES}
    out["refusals"] = refusals(dirs, root)
    for kind in ("llama", "llama_tied"):
        out[f"{kind}/pp2_fsdp2"] = run_pipeline(kind, dirs, root)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    dirs = save_pretrained_dirs(root)
    ranks = run_distributed(worker, 4, {k: str(v) for k, v in dirs.items()}, str(root), timeout=300)
    return {"root": root, "dirs": dirs, "ranks": ranks}


def reference(kind: str, path: Path) -> dict[str, Any]:
    """One process from ``from_pretrained``: the same steps on the whole batches."""
    model = model_class(kind).from_pretrained(path)
    loaded = {n: t.detach().clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x in tokens():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"loaded": loaded, "losses": losses}


@pytest.mark.parametrize("case", [f"{k}/{layout}" for k, layout in CASES])
def test_load_equals_from_pretrained_and_trains_like_one_process(launch: dict[str, Any], case: str) -> None:
    kind = case.split("/")[0]
    expected = reference(kind, launch["dirs"][kind])
    ranks = [r[case] for r in launch["ranks"]]
    for rank, res in enumerate(ranks):
        assert res["on_meta"], "the model was not built on the meta device"
        # load_weights before setup: nothing the files hold was initialized first (a real build draws
        # random numbers for every weight: see test_random_init_counter_sees_a_real_build).
        assert res["random_init_ops"] == 0, (rank, res["random_init_ops"])
        assert res["loaded"].keys() == expected["loaded"].keys()
        for name, value in expected["loaded"].items():
            assert torch.equal(res["loaded"][name], value), f"rank {rank}: {name} differs from from_pretrained"
    for step in range(STEPS):
        per_dp = {r["dp"]: r["losses"][step] for r in ranks}
        assert len(per_dp) == ranks[0]["dp_size"]
        mean = sum(per_dp.values()) / len(per_dp)
        assert mean == pytest.approx(expected["losses"][step], rel=1e-5, abs=1e-6), (case, step)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_random_init_counter_sees_a_real_build(kind: str) -> None:
    """The counter behind ``random_init_ops == 0`` above counts a real build's initialization."""
    with CountRandomInit() as random_init:
        model_class(kind)(config(kind))
    assert random_init.count >= 4, random_init.count


@pytest.mark.parametrize("case", [f"{k}/{layout}" for k, layout in CASES])
def test_each_rank_reads_only_its_own_shards(launch: dict[str, Any], case: str) -> None:
    ranks = [r[case] for r in launch["ranks"]]
    whole = sum(t.numel() * t.element_size() for t in {id(t): t for t in ranks[0]["loaded"].values()}.values())
    for rank, res in enumerate(ranks):
        assert res["read_bytes"] == res["own_bytes"], (case, rank, res["read_bytes"], res["own_bytes"])
        if case.endswith("fsdp4"):
            assert res["read_bytes"] <= whole / 4 * 1.3, (case, rank, res["read_bytes"], whole)


def check_hf_dir(path: Path, kind: str, trained: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards and len(shards) > 1, shards
    assert (path / "config.json").is_file()
    if kind == "gpt2":
        assert "lm_head.weight" not in index["weight_map"]
    model = model_class(kind).from_pretrained(path)
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=probe()).logits, logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [f"{k}/{layout}" for k, layout in CASES])
def test_save_hf_from_the_running_job_loads_with_from_pretrained(launch: dict[str, Any], case: str) -> None:
    kind, layout = case.split("/")
    res = launch["ranks"][0][case]
    path = launch["root"] / f"save_hf_{kind}_{layout}"
    check_hf_dir(path, kind, res["trained"], res["logits"])
    assert not (path / "sharded").exists()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(path.name + ".")], "a staging directory was left"


def test_export_hf_of_the_sharded_checkpoint_loads_with_from_pretrained(launch: dict[str, Any]) -> None:
    from hp_lightning.checkpoint.__main__ import main

    res = launch["ranks"][0]["llama/fsdp2_tp2"]
    out = launch["root"] / "exported_llama"
    ckpt = launch["root"] / "ckpt_llama_fsdp2_tp2"
    assert main(["export-hf", str(ckpt), str(out), "--config", str(launch["dirs"]["llama"]), "--max-shard-size", "8KB"]) == 0
    check_hf_dir(out, "llama", res["trained"], res["logits"])
    # Never over an existing export unless told; then only the files it recorded are replaced.
    (out / "README.md").write_text("mine")
    assert main(["export-hf", str(ckpt), str(out), "--config", str(launch["dirs"]["llama"])]) == 1
    assert main(["export-hf", str(ckpt), str(out), "--config", str(launch["dirs"]["llama"]), "--overwrite", "--dtype", "bf16"]) == 0
    assert (out / "README.md").read_text() == "mine"
    assert [p.name for p in out.iterdir() if p.name.endswith(".safetensors")] == ["model-00001-of-00001.safetensors"]
    model = model_class("llama").from_pretrained(out)  # built in the dtype config.json now names
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.lm_head.weight, res["trained"]["lm_head.weight"].to(torch.bfloat16), rtol=0, atol=0)


# ---------------------------------------------------------------- single process: refusals


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_pretrained_dirs(tmp_path_factory.mktemp("pretrained"))


def copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def fresh(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_class(kind)(config(kind))


def test_one_process_loads_into_a_lightning_module_prefix_and_ties(pretrained: dict[str, Path]) -> None:
    from hp_lightning.checkpoint import load_weights

    holder = torch.nn.Module()
    holder.net = fresh("gpt2")
    with pytest.raises(ValueError, match=r"pass prefix='net\.'"):
        load_weights(holder, pretrained["gpt2"])
    load_weights(holder, pretrained["gpt2"], prefix="net.")
    expected = model_class("gpt2").from_pretrained(pretrained["gpt2"]).state_dict()
    assert all(torch.equal(holder.net.state_dict()[k], v) for k, v in expected.items())
    assert holder.net.lm_head.weight is holder.net.transformer.wte.weight


def test_bad_directories_are_refused_naming_the_file_or_key(pretrained: dict[str, Path], tmp_path: Path) -> None:
    from hp_lightning.checkpoint import CorruptCheckpointError, UnsafeCheckpointError, load_weights

    src = pretrained["llama"]
    shards = sorted(p.name for p in src.iterdir() if p.name.endswith(".safetensors"))

    missing = copy_dir(src, tmp_path / "missing")
    (missing / shards[1]).unlink()
    with pytest.raises(CorruptCheckpointError, match=shards[1]):
        load_weights(fresh("llama"), missing)

    outside = copy_dir(src, tmp_path / "outside")
    index = json.loads((outside / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere.safetensors"
    (outside / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeCheckpointError, match=r"\.\./elsewhere\.safetensors"):
        load_weights(fresh("llama"), outside)

    stray = copy_dir(src, tmp_path / "stray")
    (stray / "old.safetensors").write_bytes((stray / shards[0]).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="old.safetensors"):
        load_weights(fresh("llama"), stray)

    truncated = copy_dir(src, tmp_path / "truncated")
    data = (truncated / shards[0]).read_bytes()
    (truncated / shards[0]).write_bytes(data[:-16])
    with pytest.raises(CorruptCheckpointError, match=shards[0]):
        load_weights(fresh("llama"), truncated)

    linked = copy_dir(src, tmp_path / "linked")
    (linked / shards[0]).unlink()
    os.symlink(src / shards[0], linked / shards[0])
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        load_weights(fresh("llama"), linked)

    renamed = fresh("llama")
    renamed.model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"model\.extra\.weight"):
        load_weights(renamed, src)
    load_weights(renamed, src, strict=False)  # the rest loads; the extra layer keeps its initialization

    from transformers import LlamaForCausalLM

    wider = LlamaForCausalLM(config("llama").__class__(**{**config("llama").to_dict(), "vocab_size": VOCAB + 1}))
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight'.*\[64, 16\] vs module \[65, 16\]"):
        load_weights(wider, src)

    # Checkpoints whose tensors Hugging Face converts on load (per-expert MoE weights merged into one) are refused.
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.0"):
        load_weights(fresh("mixtral"), pretrained["mixtral_legacy"])

    half = fresh("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="allow_cast=True"):
        load_weights(half, src)
    load_weights(half, src, allow_cast=True)
    expected = model_class("llama").from_pretrained(src).state_dict()
    assert torch.equal(half.lm_head.weight, expected["lm_head.weight"].to(torch.bfloat16))


def test_outputs_never_replace_what_we_did_not_write(pretrained: dict[str, Path], tmp_path: Path) -> None:
    from hp_lightning.checkpoint.hf import save_hf

    model = fresh("llama")
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(model, target, config=pretrained["llama"])
    with pytest.raises(ValueError, match="did not write"):
        save_hf(model, pretrained["llama"], config=pretrained["llama"], overwrite=True)
    save_hf(model, tmp_path / "new", config=pretrained["llama"], max_shard_size="8KB")
    save_hf(model, tmp_path / "new", config=pretrained["llama"], overwrite=True, dtype="bf16")
    names = sorted(p.name for p in (tmp_path / "new").iterdir())
    again = model_class("llama").from_pretrained(tmp_path / "new")  # config.json names bf16 now
    assert again.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(again.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    assert names == [".hp-lightning-token", ".hp_lightning_export.json", "config.json", "generation_config.json",
                     "model-00001-of-00001.safetensors", "model.safetensors.index.json"], names
    assert (target / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_pipeline_stages_load_their_own_layers_train_like_one_process_and_save_hf(launch: dict[str, Any], kind: str) -> None:
    """PP 2 x FSDP 2 (Trainer, meta device, ``load_weights(self, dir, prefix="net.")`` in ``on_fit_start`` (Llama) or
    in ``configure_model``, before the strategy materializes the stage (tied Llama))."""
    model = model_class(kind).from_pretrained(launch["dirs"][kind])
    expected = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}  # tied: both names
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = next_tokens()
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = torch.nn.functional.cross_entropy(model(input_ids=x[rows]).logits.flatten(0, -2), y[rows].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    ranks = [r[f"{kind}/pp2_fsdp2"] for r in launch["ranks"]]
    covered: set[str] = set()
    for rank, res in enumerate(ranks):
        assert res["loaded"] and set(res["loaded"]) < set(expected), (rank, sorted(res["loaded"]))
        for name, value in res["loaded"].items():
            assert torch.equal(value, expected[name]), f"rank {rank}: {name}"
        covered |= set(res["loaded"])
        assert res["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), rank
    assert covered == set(expected)
    # save_hf: every stage wrote its part; the directory is one model again, tied weights once.
    trained = {name: value for res in ranks for name, value in res["trained"].items()}
    saved = model_class(kind).from_pretrained(launch["root"] / f"save_hf_{kind}_pp2_fsdp2")
    index = json.loads((launch["root"] / f"save_hf_{kind}_pp2_fsdp2" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (kind == "llama")
    for name, value in saved.named_parameters(remove_duplicate=False):
        assert torch.equal(value, trained[name]), name
    if kind == "llama_tied":
        assert saved.lm_head.weight is saved.model.embed_tokens.weight


def test_export_hf_of_a_full_lightning_file_drops_the_tied_copy(pretrained: dict[str, Path], tmp_path: Path) -> None:
    """A full ``.ckpt`` (``state_dict`` with the LightningModule's ``net.`` prefix, both tied names) -> HF directory."""
    from hp_lightning.checkpoint.__main__ import main

    model = model_class("gpt2").from_pretrained(pretrained["gpt2"])
    ckpt = tmp_path / "full.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in model.state_dict().items()}, "pytorch-lightning_version": "2.5.0"}, ckpt)
    args = ["export-hf", str(ckpt), str(tmp_path / "out"), "--config", str(pretrained["gpt2"]), "--max-shard-size", "8KB"]
    assert main([*args[:3], "--config", str(pretrained["gpt2"])]) == 1  # no key without the prefix: refused, nothing written
    assert not (tmp_path / "out").exists()
    assert main([*args, "--prefix", "net."]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    again = model_class("gpt2").from_pretrained(tmp_path / "out")
    assert again.lm_head.weight is again.transformer.wte.weight
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    from hp_lightning.checkpoint import load_weights

    reloaded = fresh("gpt2")
    load_weights(reloaded, tmp_path / "out")  # our own output passes our own checks (index sizes included)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_bad_input_is_refused_on_every_rank_alike(launch: dict[str, Any]) -> None:
    errors = [r["refusals"] for r in launch["ranks"]]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0]["missing shard"].startswith("CorruptCheckpointError") and "model-00002-of-" in errors[0]["missing shard"], errors[0]
    assert errors[0]["shape"].startswith("ValueError") and "model.embed_tokens.weight" in errors[0]["shape"], errors[0]
