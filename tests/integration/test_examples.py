"""The examples: the GPT and its data (in process), sharded init (gloo ranks), and the scripts end to end.

The scripts' ranks start as torchrun would start them (warm, :func:`tests.helpers.run_script_in_ranks`);
``python script`` under Lightning's own launcher is ``tests/integration/test_launchers.py``'s subject.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from examples.gpt import (
    ALPHABET,
    GPT,
    VOCAB_SIZE,
    CharDataModule,
    GPTConfig,
    GPTLightningModule,
    decode,
    encode,
    stdlib_corpus,
)
from tests.helpers import full_params, run_distributed, run_script_in_ranks
from tests.integration.test_cli import REPO

EXAMPLES = REPO / "examples"
UNIFORM_LOSS = math.log(VOCAB_SIZE)  # cross-entropy of a model that predicts every character equally


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, **overrides})


# ------------------------------------------------------------------ model and data (one process)


def test_init_weights_after_meta_device_overwrites_everything():
    config = tiny_config(n_layer=4)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # whatever to_empty left behind must not survive
    model.init_weights()
    params = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    for name, p in params.items():
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            assert p.std().item() == pytest.approx(residual_std, rel=0.15), name
        elif name.endswith("weight") and p.dim() == 2:
            assert p.std().item() == pytest.approx(0.02, rel=0.15), name
        elif ".ln" in name or name.startswith("ln_f"):
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        else:
            assert torch.all(p == 0), name  # biases


def test_untrained_model_predicts_near_uniformly():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = encode(stdlib_corpus(20_000)[:33 * 8]).view(8, 33)
    logits = model(idx[:, :-1])
    assert logits.shape == (8, 32, VOCAB_SIZE)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), idx[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(UNIFORM_LOSS, abs=0.1)


def test_model_rejects_bad_input():
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match="block_size is 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 3, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 3, top_k=0)
    with pytest.raises(ValueError, match="divisible by n_head"):
        tiny_config(n_embd=30, n_head=4)


def test_generate_extends_past_the_context():
    torch.manual_seed(0)
    model = GPT(tiny_config(block_size=8)).eval()
    out = model.generate(encode("def ").unsqueeze(0), max_new_tokens=20, temperature=0.9, top_k=5)
    assert out.shape == (1, 24) and decode(out[0]).startswith("def ")


def test_corpus_is_deterministic_and_encodes_losslessly():
    text = stdlib_corpus(50_000)
    assert len(text) == 50_000 and text == stdlib_corpus(50_000)
    assert "def " in text and "import " in text  # it is Python source
    printable = "".join(ch if ch in ALPHABET else "?" for ch in text.replace("\t", "    "))
    assert decode(encode(text)) == printable


def test_data_module_windows():
    data = CharDataModule(block_size=32, batch_size=4, max_chars=20_000, val_windows=8)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert len(data.val_set) == 8
    with pytest.raises(ValueError, match="val_fraction"):
        CharDataModule(val_fraction=1.5)


# ------------------------------------------------------------------ sharded init (real gloo ranks)


def validate_worker() -> dict:
    from lightning.pytorch import Trainer, seed_everything
    from torch.distributed.tensor import DTensor

    from hp_lightning import HSDPStrategy

    seed_everything(7)
    model = GPTLightningModule(block_size=32, n_layer=2, n_head=2, n_embd=32)
    data = CharDataModule(block_size=32, batch_size=8, max_chars=20_000, val_windows=32)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=HSDPStrategy(mesh_shape=[2]), logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    (metrics,) = trainer.validate(model, data, verbose=False)
    return {
        "val_loss": metrics["val_loss"],
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "params": full_params(model),
    }


def test_meta_device_init_under_fsdp_gives_a_sane_model():
    """configure_model runs on the meta device; the strategy shards, allocates and calls init_weights."""
    results = run_distributed(validate_worker, 2)
    for res in results:
        assert res["sharded"]
        assert res["val_loss"] == pytest.approx(UNIFORM_LOSS, abs=0.15)  # the MeanMetric, over both ranks
        assert res["val_loss"] == results[0]["val_loss"]
        params = res["params"]
        assert all(torch.isfinite(p).all() for p in params.values())
        assert params["model.blocks.0.mlp.fc.weight"].std().item() == pytest.approx(0.02, rel=0.15)
        assert torch.all(params["model.ln_f.weight"] == 1)
    for name in results[0]["params"]:
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name


# ------------------------------------------------------------------ scripts (as a user runs them)


def test_sample_refuses_a_sharded_directory(tmp_path):
    from examples.sample import load_model

    with pytest.raises(ValueError, match="consolidate"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.ckpt")


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    """HSDP 2x2 on 4 processes, sharded save, consolidation, sampling in one process."""
    output = run_script_in_ranks(EXAMPLES / "demo.py", ["--steps", "18", "--out", "out", "--max-new-tokens", "40"], tmp_path, 4)
    out = tmp_path / "out"
    sharded = out / "sharded.ckpt"
    assert len(list(sharded.glob("*.distcp"))) == 4
    summary = json.loads((out / "demo_summary.json").read_text())
    curve = [loss for _, loss in summary["val_loss"]]
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.3, curve
    full = torch.load(out / "gpt.ckpt", map_location="cpu", weights_only=False)
    assert not any(hasattr(t, "placements") for t in full["state_dict"].values())  # whole tensors
    assert full["state_dict"]["model.head.weight"].shape == (VOCAB_SIZE, 128)
    assert full["hyper_parameters"]["n_layer"] == 4
    # The samples were printed, each continuing its prompt.
    for prompt in ("def ", "class ", "import "):
        assert f"\n{prompt}" in output


@pytest.mark.slow
def test_resume_on_a_different_mesh(tmp_path):
    """FSDP on 2 ranks to step 8, then HSDP 2x2 on 4 ranks from its sharded checkpoint to step 14."""
    script = EXAMPLES / "resume.py"
    run_script_in_ranks(script, ["--devices", "2", "--mesh-shape", "2", "--max-steps", "8", "--save-every", "4"], tmp_path, 2)
    last = tmp_path / "runs/resume/checkpoints/last.ckpt"
    assert len(list(last.glob("*.distcp"))) == 2
    run_script_in_ranks(script, ["--devices", "4", "--mesh-shape", "2", "2", "--max-steps", "14", "--resume", str(last)], tmp_path, 4)
    first = json.loads((tmp_path / "runs/resume/report_first.json").read_text())
    resumed = json.loads((tmp_path / "runs/resume/report_resumed.json").read_text())
    assert (first["start_step"], first["end_step"], first["mesh"]) == (0, 8, [2])
    assert (resumed["start_step"], resumed["end_step"], resumed["mesh"]) == (8, 14, [2, 2])
    # Training continued from the trained model (and optimizer), not from a fresh one.
    first_loss, last_loss_before = first["losses"][0][1], first["losses"][-1][1]
    assert last_loss_before < first_loss - 0.3
    assert abs(resumed["losses"][0][1] - last_loss_before) < 0.3
    assert len(list(last.glob("*.distcp"))) == 4  # last.ckpt rewritten by the 4-rank run


@pytest.mark.slow
def test_custom_callback_holds_only_the_last_unit(tmp_path):
    report = tmp_path / "probe.json"
    run_script_in_ranks(EXAMPLES / "custom_callback.py", ["--max-steps", "4", "--report", str(report)], tmp_path, 2)
    counts = json.loads(report.read_text())
    # 4 blocks; training: only the last stays gathered after forward; validation: none does.
    assert counts["train"] == ["0/4", "0/4", "0/4", "4/4"]
    assert all(cell.startswith("0/") for cell in counts["validate"])


@pytest.mark.slow
def test_hf_finetune_loads_trains_and_publishes_a_from_pretrained_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from examples.hf_finetune import make_pretrained, rule_tokens

    make_pretrained(tmp_path / "tiny")
    run_script_in_ranks(EXAMPLES / "hf_finetune.py", ["--pretrained", "tiny", "--out", "run", "--steps", "6"], tmp_path, 2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["last_loss"] < summary["first_loss"] - 0.2, summary
    tokens = rule_tokens(16, seed=1)
    before, after = (AutoModelForCausalLM.from_pretrained(tmp_path / d) for d in ("tiny", "run/hf"))
    with torch.no_grad():
        losses = [m(input_ids=tokens, labels=tokens).loss.item() for m in (before, after)]
    assert losses[1] < losses[0] - 0.2, losses  # the fine-tuned weights came back, every tensor loaded
