"""LoRA fine-tuning through peft, the documented way: meta-device build, per-rank load, train, export both ways.

One launch of 2 gloo ranks. A tiny Hugging Face Llama is saved by ``save_pretrained``; the
LightningModule builds ``get_peft_model(LlamaForCausalLM(config), LoraConfig(...))`` in
``configure_model`` (meta device) and names the directory with ``load_weights(self, dir,
prefix="net.")`` there: each rank reads its own slices into the adapted layers' ``base_layer``,
the adapters keep their initialization. After training, the frozen base weights are the file's
and got no gradient; ``save_hf(peft="merged")`` loads with ``from_pretrained`` and
``save_hf(peft="adapter")`` with ``PeftModel.from_pretrained``, both giving the trained model's
logits. A plain ``save_hf`` of the adapted model is refused (its keys are not the base model's),
and a ``strict=False`` load that fills no tensor is an error.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything

from tests.helpers import run_distributed, trainer_kwargs

WORLD = 2
VOCAB = 64


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=None, use_cache=False,
    )


class LitLoRA(LightningModule):
    def __init__(self, base: str) -> None:
        super().__init__()
        self.base = base

    def configure_model(self) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        import hp_lightning

        self.net = get_peft_model(LlamaForCausalLM(config()), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        hp_lightning.load_weights(self, self.base, prefix="net.")  # loaded while the strategy materializes

    def training_step(self, batch, batch_idx):
        ids, target = batch
        logits = self.net(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=5e-2)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def worker(tmp: str) -> dict:
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    import hp_lightning
    from hp_lightning.callbacks import ShardingReport

    base, merged, adapter = Path(tmp) / "base", Path(tmp) / "merged", Path(tmp) / "adapter"
    seed_everything(0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (16, 8), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, (7 * ids + 1) % VOCAB), batch_size=4)
    module = LitLoRA(str(base))
    strategy = hp_lightning.HSDPStrategy(mesh_shape=[WORLD])
    report = ShardingReport(log_table=False)
    trainer = Trainer(devices=WORLD, strategy=strategy, max_steps=3, limit_val_batches=0, callbacks=[report], **trainer_kwargs())
    # The base model's files, written once before the ranks build anything (rank 0; the others wait for it).
    marker = Path(tmp) / "written"
    if int(os.environ.get("RANK", "0")) == 0:
        torch.manual_seed(1)
        LlamaForCausalLM(config()).save_pretrained(base)
        marker.touch()
    while not marker.exists():
        time.sleep(0.05)
    trainer.fit(module, data)

    out: dict = {}
    q_base = dict(module.named_parameters())["net.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    lora_b = dict(module.named_parameters())["net.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    out["q_base"] = _full(q_base)
    out["q_base_grad"] = q_base.grad is None and not q_base.requires_grad
    out["lora_b_abs"] = float(_full(lora_b).abs().sum())
    out["report"] = [(row.name, row.frozen, row.trainable) for row in report.summary.units]
    out["warnings"] = list(report.summary.warnings)
    with torch.no_grad():
        out["logits"] = module.net(input_ids=ids[:2]).logits.detach().clone()
    try:
        strategy.save_hf(Path(tmp) / "plain", prefix="net.", config=base)
        out["plain"] = "written"
    except ValueError as exc:
        out["plain"] = str(exc)
    strategy.save_hf(merged, prefix="net.", config=base, peft="merged")
    strategy.save_hf(adapter, peft="adapter")
    try:
        hp_lightning.load_weights(module, base, strict=False)  # no prefix: the module's keys are all under "net."
        out["nothing_loaded"] = "loaded"
    except ValueError as exc:
        out["nothing_loaded"] = str(exc)
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        out["file_q"] = load_file(str(base / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
        with torch.no_grad():
            out["merged_logits"] = LlamaForCausalLM.from_pretrained(merged).eval()(input_ids=ids[:2]).logits
            reloaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter).eval()
            out["adapter_logits"] = reloaded(input_ids=ids[:2]).logits
        out["adapter_files"] = sorted(p.name for p in adapter.iterdir() if not p.name.startswith("."))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(worker, WORLD, str(tmp_path_factory.mktemp("lora")), timeout=400)


def test_base_weights_load_per_rank_into_base_layer_and_stay_frozen(results):
    file_q = results[0]["file_q"]
    for res in results:
        assert torch.equal(res["q_base"], file_q)  # loaded from the file, never trained
        assert res["q_base_grad"]
        assert res["lora_b_abs"] > 0  # the adapter trained (peft starts B at zero)
        # Each block unit mixes frozen base weights with trainable adapters, as LoRA does: the
        # report lists them and gives no advice to split them apart (it would not help here).
        assert any(frozen and trainable for _, frozen, trainable in res["report"]), res["report"]
        assert not [w for w in res["warnings"] if "frozen" in w], res["warnings"]


def test_merged_and_adapter_exports_reload_as_the_trained_model(results):
    trained = results[0]["logits"]
    assert torch.allclose(results[0]["merged_logits"], trained, rtol=1e-5, atol=1e-5)
    assert torch.allclose(results[0]["adapter_logits"], trained, rtol=1e-5, atol=1e-5)
    assert "adapter_model.safetensors" in results[0]["adapter_files"] and "adapter_config.json" in results[0]["adapter_files"]


def test_a_plain_export_and_an_empty_load_are_refused(results):
    for res in results:
        assert "holds peft adapters" in res["plain"] and "peft='merged'" in res["plain"], res["plain"]
        assert "fill no tensor of the module, even with strict=False" in res["nothing_loaded"], res["nothing_loaded"]
