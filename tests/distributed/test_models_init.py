"""Models built in ``configure_model`` on the meta device equal their CPU-built twins, or are refused.

Each layout that used to train on uninitialized memory (issue 13) is a tiny model here: an RMSNorm
without ``reset_parameters``, a GPT-2 ``Conv1D`` (initialized in its constructor), tied
embeddings, ``nn.MultiheadAttention``, ``nn.TransformerEncoder``, a rotary embedding with a
non-persistent buffer, blocks in ``nn.Sequential``, a LightningModule ``init_weights`` hook, and,
when ``transformers`` is installed, tiny Hugging Face Llama (tied) and GPT-2 models. Every one is
built in ``configure_model`` under ``HSDPStrategy`` (FSDP over 2 ranks, HSDP 2x2 over 4), trained
one step, and compared with the same module built on the CPU in this process with the same seed:
parameters, buffers and the first loss. A model whose tensor nothing initializes is refused on
every rank at setup. One launch per mesh runs all of them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import rank_loader, run_distributed, trainer_kwargs

try:
    import transformers  # noqa: F401

    HAS_TRANSFORMERS = True
except ImportError:  # pragma: no cover - transformers is in the test extra
    HAS_TRANSFORMERS = False

VOCAB, WIDTH, SEQ, BATCH = 32, 16, 8, 8


# ---------------------------------------------------------------- the layouts


class RMSNorm(nn.Module):
    """No reset_parameters: its value comes from ``torch.ones`` in the constructor."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Conv1D(nn.Module):
    """GPT-2's transposed linear layer: initialized in ``__init__``, no reset_parameters."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).reshape(*x.shape[:-1], self.nf)


class Rotary(nn.Module):
    """A rotary embedding whose ``inv_freq`` is a non-persistent buffer computed in ``__init__``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(x.shape[1], dtype=x.dtype, device=x.device), self.inv_freq)
        return x * torch.cat([angles.cos(), angles.sin()], dim=-1)


class Forgotten(nn.Module):
    """A scale nobody initializes: ``torch.empty`` and no rule (refused)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(WIDTH) if kind in ("rmsnorm", "sequential") else nn.LayerNorm(WIDTH)
        if kind == "mha":
            self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.up = Conv1D(2 * WIDTH, WIDTH) if kind == "conv1d" else nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.forgotten = Forgotten(WIDTH) if kind == "forgotten" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "mha":
            h = h + self.attn(h, h, h, need_weights=False)[0]
        if self.forgotten is not None:
            h = self.forgotten(h)
        return x + self.down(torch.relu(self.up(h)))


class TinyLM(nn.Module):
    """Embedding, a layout-specific trunk, head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.rotary = Rotary(WIDTH) if kind == "rotary" else None
        if kind == "encoder":
            layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        elif kind == "sequential":
            self.blocks = nn.Sequential(*[Block(kind) for _ in range(3)])
        elif kind == "flat":  # one block: nothing repeats, no sharding unit
            self.blocks = nn.ModuleList([Block(kind)])
        else:
            self.blocks = nn.ModuleList(Block(kind) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if kind == "tied":
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if self.rotary is not None:
            x = self.rotary(x)
        if isinstance(self.blocks, nn.ModuleList):
            for block in self.blocks:
                x = block(x)
        else:
            x = self.blocks(x)
        return self.head(x)


def hf_model(kind: str) -> nn.Module:
    if kind == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ, tie_word_embeddings=True,
        )
        return LlamaForCausalLM(config)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class LM(LightningModule):
    """Builds its model in ``configure_model`` (on the meta device under HSDPStrategy)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.kind = kind
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = hf_model(self.kind) if self.kind.startswith("hf_") else TinyLM(self.kind)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.model(idx)
        return out.logits if hasattr(out, "logits") else out

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HookLM(LM):
    """Defines the LightningModule ``init_weights`` hook: it runs after the modules' own rules."""

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.model.head.weight, std=0.5, a=-1.0, b=1.0)
        for block in self.model.blocks:
            block.down.bias.fill_(0.25)


KINDS = ["rmsnorm", "conv1d", "tied", "mha", "encoder", "rotary", "sequential", "hook"] + (
    ["hf_llama", "hf_gpt2"] if HAS_TRANSFORMERS else []
)
#: What the 4-rank (HSDP 2x2) launch re-checks: the layouts whose init crosses modules.
HSDP_KINDS = ["tied", "mha", "encoder", "rotary", "hook"] + (["hf_llama"] if HAS_TRANSFORMERS else [])


def make_module(kind: str) -> LM:
    return HookLM(kind) if kind == "hook" else LM(kind)


def token_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=generator))


def twin(kind: str) -> tuple[dict[str, torch.Tensor], float, torch.Tensor]:
    """The same module built on the CPU in one process with the same seed; its first loss."""
    seed_everything(0)
    module = make_module(kind)
    module.configure_model()
    if callable(getattr(module, "init_weights", None)):
        module.init_weights()
    rng = torch.get_rng_state()
    state = {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    (idx,) = token_data()[:BATCH]
    with torch.no_grad():
        logits = module(idx[:, :-1])
        loss = float(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)))
    return state, loss, rng


# ---------------------------------------------------------------- memory during setup


class PeakTracker(TorchDispatchMode):
    """Peak bytes of plain tensor storages alive at once while active (freed ones subtracted)."""

    def __init__(self) -> None:
        super().__init__()
        import weakref

        self._weakref = weakref
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live and storage.nbytes() > 0:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    self._weakref.finalize(storage, self._freed, key)
        return out


# ---------------------------------------------------------------- the launches


def init_worker(mesh_shape: list[int], kinds: list[str], checkpoint_dir: str | None) -> dict:
    from hp_lightning import HSDPStrategy
    from hp_lightning.checkpoint import load_weights

    world = math.prod(mesh_shape)
    out: dict = {"models": {}}
    for kind in kinds:
        seed_everything(0)

        class Measured(HSDPStrategy):
            def setup(self, trainer):
                with PeakTracker() as tracker:
                    super().setup(trainer)
                self.setup_peak = tracker.peak
                self.rng_after_setup = torch.get_rng_state()

        strategy = Measured(mesh_shape=mesh_shape)
        trainer = Trainer(devices=world, strategy=strategy, max_steps=1, **trainer_kwargs())
        module = make_module(kind)

        class FirstState(pl_callback()):
            def on_train_start(self, trainer, pl_module):
                self.state = gather_state(pl_module)

        first = FirstState()
        trainer.callbacks.append(first)
        trainer.fit(module, rank_loader(token_data(), BATCH, world))
        units = strategy.sharded_model.units
        params = [p for p in module.parameters()]
        out["models"][kind] = {
            "state": first.state,  # every rank's: HSDP replicas gather their own shard group
            "rng": strategy.rng_after_setup,
            "loss": float(trainer.callback_metrics["train_loss"]),
            "units": len(units),
            "all_sharded": all(isinstance(p, DTensor) for p in params),
            "setup_peak": strategy.setup_peak,
            "local_bytes": sum(p.to_local().numel() * p.element_size() for p in params),
            "largest_full_bytes": max(p.numel() * p.element_size() for p in params),
            "model_bytes": sum(p.numel() * p.element_size() for p in params),
        }
        if checkpoint_dir is not None and kind == "tied":
            trainer.save_checkpoint(Path(checkpoint_dir) / "last.ckpt")
            saved = gather_state(module)  # a collective: every rank gathers, rank 0 reports
            out["saved"] = saved if trainer.global_rank == 0 else None

    # No repeated block: setup warns (rank 0) what that costs and how to name the blocks.
    import warnings

    seed_everything(0)
    trainer = Trainer(devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape), max_steps=1, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LM("flat"), rank_loader(token_data(), BATCH, world))
    out["flat_warnings"] = [str(w.message) for w in caught if "no sharding units" in str(w.message)]

    # HSDPStrategy(meta_init=False): configure_model builds on the host; nothing is left to initialize.
    seed_everything(0)
    trainer = Trainer(devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape, meta_init=False), max_steps=1,
                      **trainer_kwargs())
    host = type("H", (pl_callback(),), {"on_train_start": lambda self, t, m: setattr(self, "state", gather_state(m))})()
    trainer.callbacks.append(host)
    trainer.fit(LM("mha"), rank_loader(token_data(), BATCH, world))
    out["meta_init_false"] = host.state

    # Built on the meta device by hand, outside the strategy's recording: the modules' rules alone
    # (reset_parameters, MultiheadAttention._reset_parameters) initialize it, in constructor order.
    seed_everything(0)
    trainer = Trainer(devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape), max_steps=1, **trainer_kwargs())
    module = LM("mha")
    with torch.device("meta"):
        module.configure_model()
    rules = type("R", (pl_callback(),), {"on_train_start": lambda self, t, m: setattr(self, "state", gather_state(m))})()
    trainer.callbacks.append(rules)
    trainer.fit(module, rank_loader(token_data(), BATCH, world))
    out["rules_only"] = rules.state

    # A tensor that nothing initializes: refused at setup, on every rank, naming it.
    seed_everything(0)
    trainer = Trainer(devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape, fault_watchdog=False), max_steps=1,
                      **trainer_kwargs())
    start = time.monotonic()
    try:
        trainer.fit(LM("forgotten"), rank_loader(token_data(), BATCH, world))
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = (str(exc), time.monotonic() - start)

    if checkpoint_dir is not None:
        # trainer.init_module() builds on meta too; load_weights then overwrites the initialized values.
        seed_everything(0)
        trainer = Trainer(devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape), max_steps=1, **trainer_kwargs())
        with trainer.init_module():
            module = LM("mha")
            module.configure_model()
        recorder = type("R", (pl_callback(),), {"on_train_start": lambda self, t, m: setattr(self, "state", gather_state(m))})()
        trainer.callbacks.append(recorder)
        trainer.fit(module, rank_loader(token_data(), BATCH, world))
        out["init_module"] = recorder.state if trainer.global_rank == 0 else None

        seed_everything(0)
        trainer = Trainer(devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape), max_steps=1, **trainer_kwargs())
        module = LM("tied")

        class Loads(pl_callback()):
            def on_train_start(self, trainer, pl_module):
                load_weights(pl_module, Path(checkpoint_dir) / "last.ckpt")
                self.state = gather_state(pl_module)

        loads = Loads()
        trainer.callbacks.append(loads)
        trainer.fit(module, rank_loader(token_data(), BATCH, world))
        out["load_weights"] = loads.state if trainer.global_rank == 0 else None
    return out


def pl_callback() -> type:
    from lightning.pytorch import Callback

    return Callback


def gather_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (a collective)."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
    return out


def max_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert state.keys() == reference.keys(), sorted(set(state) ^ set(reference))
    return max(float((state[k].double() - reference[k].double()).abs().max()) for k in reference)


def check_against_twins(results: list[dict], kinds: list[str]) -> dict[str, float]:
    diffs = {}
    for kind in kinds:
        state, loss, rng = twin(kind)
        diffs[kind] = max(max_diff(res["models"][kind]["state"], state) for res in results)
        assert diffs[kind] == 0.0, (kind, diffs[kind])
        for rank, res in enumerate(results):
            got = res["models"][kind]
            assert got["all_sharded"], (kind, rank)
            assert math.isfinite(got["loss"]) and got["loss"] == pytest.approx(loss, rel=1e-5), (kind, got["loss"], loss)
            # The generator is left where building the model for real leaves it (dropout, shuffling agree).
            assert torch.equal(got["rng"], rng), (kind, rank)
            # Never the whole model at once: shards, plus full-size temporaries of one or two tensors.
            bound = got["local_bytes"] + 3 * got["largest_full_bytes"] + 64 * 1024
            assert got["setup_peak"] <= bound, (kind, got["setup_peak"], bound, got["model_bytes"])
    return diffs


def check_refused(results: list[dict]) -> None:
    for res in results:
        message, seconds = res["refused"]
        assert "model.blocks.0.forgotten.scale (Forgotten parameter)" in message, message
        assert "reset_parameters()" in message and "init_weights()" in message and "meta_init=False" in message
        assert seconds < 30
    assert all(res["refused"][0] == results[0]["refused"][0] for res in results)


def test_fsdp_meta_init_equals_cpu_twins_and_loads_the_lightning_way(tmp_path):
    results = run_distributed(init_worker, 2, [2], KINDS, str(tmp_path), timeout=400)
    diffs = check_against_twins(results, KINDS)
    check_refused(results)
    diffs["mha, rules only"] = max_diff(results[0]["rules_only"], twin("mha")[0])
    assert max_diff(results[0]["meta_init_false"], twin("mha")[0]) == 0.0
    (flat,) = results[0]["flat_warnings"]
    assert "whole model is one unit" in flat and "shard_modules=['Block']" in flat, flat
    assert results[1]["flat_warnings"] == []  # rank 0 only
    assert diffs["mha, rules only"] == 0.0
    print("max |meta-built - CPU twin| (FSDP 2):", diffs)
    units = {kind: results[0]["models"][kind]["units"] for kind in KINDS}
    assert units["sequential"] == 3 and units["encoder"] == 2 and units["mha"] == 2, units

    # trainer.init_module() on meta equals the twin too; load_weights overwrites the initialized values.
    state, _, _ = twin("mha")
    assert max_diff(results[0]["init_module"], state) == 0.0
    saved = results[0]["saved"]
    assert max_diff(results[0]["load_weights"], saved) == 0.0

    # The sharded checkpoint, in one plain CPU process, the Lightning way.
    from hp_lightning.checkpoint.load import LoadsShardedCheckpoints, load_from_checkpoint

    directory = tmp_path / "last.ckpt"
    assert directory.is_dir()
    with pytest.raises(IsADirectoryError):
        LM.load_from_checkpoint(directory)  # Lightning opens it as a file; no hook runs before that
    loaded = load_from_checkpoint(LM, directory)
    assert loaded.kind == "tied" and loaded.model.head.weight is loaded.model.emb.weight
    assert max_diff(gather_state(loaded), saved) == 0.0

    class MixedLM(LoadsShardedCheckpoints, LM):
        pass

    mixed = MixedLM.load_from_checkpoint(directory)
    assert max_diff(gather_state(mixed), saved) == 0.0

    from hp_lightning.checkpoint import read_full_file

    with pytest.raises(ValueError, match="python -m hp_lightning.checkpoint consolidate") as info:
        read_full_file(directory)
    assert "load_from_checkpoint(MyModule" in str(info.value)


def test_hsdp_meta_init_equals_cpu_twins():
    results = run_distributed(init_worker, 4, [2, 2], HSDP_KINDS, None, timeout=400)
    diffs = check_against_twins(results, HSDP_KINDS)
    check_refused(results)
    print("max |meta-built - CPU twin| (HSDP 2x2):", diffs)


def test_units_for_every_container_layout():
    from hp_lightning.core.units import auto_units, zero_units_warning

    def unit_names(model: nn.Module) -> list[str]:
        chosen = {id(u) for u in auto_units(model)}
        return sorted(name for name, m in model.named_modules() if id(m) in chosen)

    mlp = lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # noqa: E731
    # Blocks in a Sequential between an embedding and a head; an MLP's Linears stay together.
    assert unit_names(nn.Sequential(nn.Embedding(8, 4), mlp(), mlp(), mlp(), nn.Linear(4, 8))) == ["1", "2", "3"]
    assert unit_names(mlp()) == []
    # ModuleDict of ModuleLists and of blocks: searched, the blocks chosen.
    nested = nn.ModuleDict({"enc": nn.ModuleList([Block("mha"), Block("mha")]), "dec": nn.ModuleDict({"a": mlp(), "b": mlp()})})
    assert unit_names(nested) == ["dec.a", "dec.b", "enc.0", "enc.1"]
    # ModuleList of leaves keeps its historical rule; the TransformerEncoder's layers are found.
    assert unit_names(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])) == ["0", "1"]
    assert unit_names(TinyLM("encoder")) == ["blocks.layers.0", "blocks.layers.1"]
    message = zero_units_warning(TinyLM("flat"), world_size=8)
    assert "no sharding units" in message and "8 ranks" in message and "KiB" in message
    assert "HSDPStrategy(shard_modules=" in message


def test_meta_init_option_is_validated():
    from hp_lightning import HSDPStrategy

    assert HSDPStrategy(meta_init=False).options.meta_init is False
    with pytest.raises(TypeError, match=r"meta_init=.*True or False; got str"):
        HSDPStrategy(meta_init="no")
