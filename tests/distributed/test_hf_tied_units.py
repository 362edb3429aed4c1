"""Automatic units keep tied parameters in one unit: Hugging Face ``BertForMaskedLM`` on FSDP 2.

``BertEmbeddings`` is in BERT's ``_no_split_modules``, and its ``word_embeddings`` is tied to
``cls.predictions.decoder`` (in the root). Made a unit, it would put one parameter in two units,
which torch's FSDP2 refuses at the first forward. The automatic plan gives that unit up (its
modules go to the root, with the decoder); training then equals one process.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything

from tests.helpers import LossRecorder, full_params, loader, rank_loader, run_distributed, trainer_kwargs

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 12, 4, 3


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


class MaskedLM(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_bert()

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss  # every position counts: equal per rank
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tokens() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=generator))


def reference() -> dict:
    seed_everything(0)
    module = MaskedLM()
    recorder = LossRecorder()
    trainer = Trainer(devices=1, max_steps=STEPS, callbacks=[recorder], **trainer_kwargs())
    trainer.fit(module, loader(tokens(), GLOBAL_BATCH))
    return {"params": full_params(module), "losses": recorder.losses}


def fsdp_worker() -> dict:
    import hp_lightning
    from hp_lightning.core.units import user_class

    seed_everything(0)
    module = MaskedLM()
    recorder = LossRecorder()
    trainer = Trainer(
        devices=2, strategy=hp_lightning.HSDPStrategy(mesh_shape=[2]), max_steps=STEPS, callbacks=[recorder],
        **trainer_kwargs(),
    )
    trainer.fit(module, rank_loader(tokens(), GLOBAL_BATCH, 2))
    bert = module.model
    return {
        "params": full_params(module),
        "losses": recorder.losses,
        "units": sorted(user_class(u).__name__ for u in trainer.strategy.sharded_model.units),
        "still_tied": bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight,
    }


def test_bert_masked_lm_trains_on_fsdp2_with_automatic_units_like_one_process():
    expected = reference()
    for rank, res in enumerate(run_distributed(fsdp_worker, 2)):
        # The blocks are units; BertEmbeddings (tied to the decoder) is left to the root.
        assert res["units"] == ["BertLayer", "BertLayer"], res["units"]
        assert res["still_tied"]
        assert len(res["losses"]) == STEPS
        assert res["losses"] == pytest.approx(expected["losses"], rel=1e-5), rank
        assert res["params"].keys() == expected["params"].keys()
        for name, value in expected["params"].items():
            # Absolute tolerance: the attention key biases get no gradient (softmax ignores a shift),
            # so they stay at rounding noise (~1e-7) in both runs, where a relative test is meaningless.
            torch.testing.assert_close(res["params"][name], value, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
