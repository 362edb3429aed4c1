"""A model written for pipeline parallelism the torchtitan way, and its single-process reference."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn

from tests.helpers import Block, make_dataset

GLOBAL_BATCH = 16
VOCAB = 32


class StagedNet(nn.Module):
    """Input projection, blocks, head; a stage that lacks a piece skips it (``None``)."""

    def __init__(self, width: int = 16, depth: int = 4, d_in: int = 8, d_out: int = 4) -> None:
        super().__init__()
        self.inp: Optional[nn.Module] = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head: Optional[nn.Module] = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


class EncoderNet(nn.Module):
    """torch's own ``nn.TransformerEncoder`` between an input projection and a head (sequences of 2 tokens)."""

    def __init__(self, width: int = 16, depth: int = 4, d_in: int = 8, d_out: int = 4) -> None:
        super().__init__()
        self.inp: Optional[nn.Module] = nn.Linear(d_in, 2 * width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False)
        self.head: Optional[nn.Module] = nn.Linear(2 * width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).unflatten(-1, (2, -1)) if self.inp is not None else x
        h = self.encoder(h)  # a later stage's encoder holds its own layers only, under their own names
        return self.head(h.flatten(-2)) if self.head is not None else h


class TiedLM(nn.Module):
    """A language model whose head is tied to its embedding (``head.weight = tok.weight``), as GPT-2's is.

    Cut into stages, the embedding lands on the first and the head on the last: two copies of one
    parameter, which the pipeline keeps equal (Megatron-LM's rule).
    """

    def __init__(self, vocab: int = VOCAB, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.tok: Optional[nn.Module] = nn.Embedding(vocab, width)
        nn.init.normal_(self.tok.weight, std=0.2)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head: Optional[nn.Module] = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


def make_token_dataset(n: int = 64, seq: int = 4, vocab: int = VOCAB, seed: int = 1234) -> torch.utils.data.TensorDataset:
    """Token sequences and their next tokens under a fixed rule (something to learn)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return torch.utils.data.TensorDataset(x, (3 * x + 1) % vocab)


NETS = {"staged": StagedNet, "encoder": EncoderNet, "tied": TiedLM}


class PipelinedModule(pl.LightningModule):
    """Trains the same way with or without a pipeline: ``training_step`` one process, ``pipeline_loss`` per stage."""

    def __init__(self, lr: float = 1e-2, samples: int = 128, build_in_configure_model: bool = False, net: str = "staged") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: Optional[nn.Module] = None if build_in_configure_model else NETS[net]()

    def configure_model(self) -> None:
        # On the meta device under HSDPStrategy: each rank then materializes only its stage's shards.
        if self.net is None:
            self.net = NETS[self.hparams.net]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not target.is_floating_point():  # next tokens: the language model's cross-entropy
            return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())
        return nn.functional.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def _loader(self, samples: int) -> torch.utils.data.DataLoader:
        """Each data-parallel rank's slice of every global batch, in order (the stages of a pipeline read the same)."""
        data = make_token_dataset(n=samples) if self.hparams.net == "tied" else make_dataset(n=samples)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer.world_size > 1 else {"num_replicas": 1, "rank": 0}
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False, **kwargs)
        return torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.hparams.samples)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(2 * GLOBAL_BATCH)

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(2 * GLOBAL_BATCH)


def tiny_hf_model(kind: str) -> nn.Module:
    """A tiny Hugging Face causal LM, GPT-2 (head tied to the embedding) or Llama, 4 layers."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        config = GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    return LlamaForCausalLM(config)


#: Where a stage starts in each tiny HF model held as ``self.model``.
HF_SPLIT = {"gpt2": "model.transformer.h.2", "llama": "model.model.layers.2"}


class HFOnMeta(pl.LightningModule):
    """A tiny HF model built in ``configure_model`` (on the meta device under HSDPStrategy); only set up here."""

    def __init__(self, kind: str = "gpt2") -> None:
        super().__init__()
        self.kind = kind
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_hf_model(self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a stage's forward (not run: these runs only set up)
        raise NotImplementedError

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise NotImplementedError

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(make_token_dataset(n=GLOBAL_BATCH), batch_size=GLOBAL_BATCH // 2)


class LossLog(pl.Callback):
    """Every logged ``train_loss`` and, at the end of each validation, ``val_loss``."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module):
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))
