"""A small GPT-style character model, a corpus that needs no download, and their Lightning wrappers.

Everything here is ordinary PyTorch / Lightning code: nothing knows about sharding. Run it under
``HSDPStrategy`` and

* :class:`GPTLightningModule` builds its :class:`GPT` in ``configure_model``, so the strategy
  creates it on the meta device, shards it, allocates only the local shards and then calls
  :meth:`GPTLightningModule.init_weights` to fill them;
* the blocks live in ``GPT.blocks`` (an ``nn.ModuleList``), so each block becomes one sharding
  unit automatically; embeddings, the final norm and the head belong to the root unit;
* ``generate`` is registered as a forward method, so sampling works on the sharded model too.

The corpus is the Python standard library's own source, read from the running interpreter and
encoded one character per token over a fixed printable-ASCII alphabet, so a checkpoint decodes
identically on any machine.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanMetric
from typing_extensions import override

from examples.moe import GroupedExperts, MoE

# ---------------------------------------------------------------------------------------- text

#: Newline plus the 95 printable ASCII characters. Tabs become four spaces; anything else ``?``.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(ALPHABET)
_CHAR_TO_ID = {ch: i for i, ch in enumerate(ALPHABET)}
_UNKNOWN_ID = _CHAR_TO_ID["?"]


def encode(text: str) -> Tensor:
    """Characters → token ids (int64), over :data:`ALPHABET`."""
    text = text.replace("\t", "    ")
    return torch.tensor([_CHAR_TO_ID.get(ch, _UNKNOWN_ID) for ch in text], dtype=torch.long)


def decode(ids: Tensor | list[int]) -> str:
    """Token ids → text."""
    values = ids.tolist() if isinstance(ids, Tensor) else ids
    return "".join(ALPHABET[i] for i in values)


def stdlib_corpus(max_chars: int = 1_000_000) -> str:
    """Up to ``max_chars`` characters of the standard library's top-level ``.py`` files, in name order.

    The order is fixed, so every rank (and every run on the same interpreter) reads the same text.

    Raises:
        ValueError: for ``max_chars`` below 10,000.
        FileNotFoundError: when the interpreter ships no standard-library sources.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 10_000:
        raise ValueError(f"stdlib_corpus(max_chars=...) expects an int >= 10000; got {max_chars!r}.")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"No standard-library sources (*.py) under {stdlib}; this interpreter ships only bytecode. "
            f"Install the full Python (e.g. the python3.X-dev / python3-full package) or use another interpreter."
        )
    parts: list[str] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


# ---------------------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        vocab_size: number of token ids.
        block_size: longest context the model sees (position embeddings).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream.
        dropout: dropout probability on attention weights and residual branches.
        n_experts: 0 for dense feed-forward blocks; otherwise each block's feed-forward is a
            mixture of ``n_experts`` experts (:class:`examples.moe.MoE`) with ``top_k`` routing.
        top_k: experts per token in MoE blocks.
    """

    vocab_size: int = VOCAB_SIZE
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    n_experts: int = 0
    top_k: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig({name}=...) expects a positive int; got {value!r}.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig needs n_embd divisible by n_head; got n_embd={self.n_embd}, n_head={self.n_head}. "
                f"Pick e.g. n_head={math.gcd(self.n_embd, 8)}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig(dropout=...) expects 0 <= dropout < 1; got {self.dropout!r}.")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position attends only to itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.qkv_heads = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, _ = x.shape
        # (B, T, heads * 3 * head_dim) → three (B, heads, T, head_dim) tensors. The features are
        # laid out head by head, so a column split (tensor parallelism) hands each rank whole heads.
        # (Named qkv_heads: a checkpoint of the earlier [q; k; v] layout, saved as "qkv", then fails
        # to load by name instead of loading into the wrong layout.)
        q, k, v = self.qkv_heads(x).view(batch, time, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        merged = attended.transpose(1, 2).reshape(batch, time, -1)
        return self.resid_dropout(self.proj(merged))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config) if not config.n_experts else MoE(config.n_embd, 4 * config.n_embd, config.n_experts, config.top_k)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer language model: embeddings, ``n_layer`` blocks, final norm, LM head.

    The head is not tied to the token embedding, so every parameter has exactly one owner
    (simpler to shard, checkpoint and consolidate).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style initialization; valid on fresh tensors and after ``to_empty`` (meta-device init).

        Every parameter is written, none is read, so uninitialized memory is fully overwritten.
        Linear and embedding weights ~ N(0, 0.02); the projections that write into the residual
        stream ~ N(0, 0.02 / sqrt(2 * n_layer)), so the stream's variance does not grow with depth;
        biases 0; LayerNorm weight 1, bias 0. No-op on the meta device.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters()

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(batch, time)`` → next-token logits ``(batch, time, vocab_size)``.

        Under pipeline parallelism a stage holds only some of the pieces (the others are ``None``,
        torchtitan's convention): a later stage takes hidden states ``(batch, time, n_embd)``
        instead of token ids, and an earlier one returns hidden states instead of logits.

        Raises:
            ValueError: for a sequence longer than ``block_size``.
        """
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"GPT.forward got a sequence of {time} tokens; this model's block_size is "
                f"{self.config.block_size}. Crop the input to the last {self.config.block_size} tokens."
            )
        x = idx
        if self.tok_emb is not None:  # the first stage
            positions = torch.arange(time, device=idx.device)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:  # the last stage
            x = self.head(self.ln_f(x))
        return x

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None) -> Tensor:
        """Extend ``idx`` ``(batch, time)`` by ``max_new_tokens`` sampled tokens.

        Args:
            idx: prompt token ids.
            max_new_tokens: how many tokens to append.
            temperature: divides the logits; below 1 is more conservative, above 1 more random.
            top_k: sample only among the ``top_k`` most likely tokens (None: all).

        Raises:
            ValueError: for a negative ``max_new_tokens``, a non-positive ``temperature`` or ``top_k``.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate(max_new_tokens=...) expects an int >= 0; got {max_new_tokens!r}.")
        if not temperature > 0:
            raise ValueError(f"generate(temperature=...) expects a number > 0; got {temperature!r}. Use e.g. 0.8.")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"generate(top_k=...) expects None or an int >= 1; got {top_k!r}.")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :] / temperature
            if top_k is not None:
                kth_best = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth_best, float("-inf"))
            next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


# ---------------------------------------------------------------------------------------- data


class CharWindows(Dataset):
    """``(input, target)`` pairs of ``block_size`` tokens, the target shifted by one.

    Args:
        tokens: the encoded text.
        block_size: window length.
        stride: distance between window starts.
        limit: keep at most this many windows, evenly spread over the text (None: all).
    """

    def __init__(self, tokens: Tensor, block_size: int, stride: int, limit: Optional[int] = None) -> None:
        count = (len(tokens) - block_size - 1) // stride + 1
        if count < 1:
            raise ValueError(f"CharWindows needs more than block_size + 1 = {block_size + 1} tokens; got {len(tokens)}.")
        starts = torch.arange(count) * stride
        if limit is not None and limit < count:
            starts = starts[torch.linspace(0, count - 1, limit).round().long()]
        self.tokens = tokens
        self.block_size = block_size
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(pl.LightningDataModule):
    """Character-level windows of the standard library's source: the first 90 % trains, the rest validates.

    Args:
        block_size: tokens per window (must equal the model's ``block_size``).
        batch_size: windows per batch and per rank.
        max_chars: size of the corpus in characters.
        val_fraction: share of the corpus (its end) held out for validation.
        val_windows: validation windows, evenly spread over the held-out text (keeps validation cheap).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 16,
        max_chars: int = 1_000_000,
        val_fraction: float = 0.1,
        val_windows: int = 256,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"CharDataModule(val_fraction=...) expects a number in (0, 1); got {val_fraction!r}.")
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("val_windows", val_windows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CharDataModule({name}=...) expects a positive int; got {value!r}.")
        self.save_hyperparameters()
        self.train_set: Optional[CharWindows] = None
        self.val_set: Optional[CharWindows] = None

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        tokens = encode(stdlib_corpus(self.hparams.max_chars))
        split = int(len(tokens) * (1.0 - self.hparams.val_fraction))
        block = self.hparams.block_size
        # Training windows do not overlap; the Trainer's DistributedSampler shuffles and splits them.
        self.train_set = CharWindows(tokens[:split], block, stride=block)
        self.val_set = CharWindows(tokens[split:], block, stride=block, limit=self.hparams.val_windows)

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


# ---------------------------------------------------------------------------------------- Lightning


class GPTLightningModule(pl.LightningModule):
    """Trains a :class:`GPT` on next-character prediction.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, n_experts, top_k: the :class:`GPTConfig`.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not biases, norms).
        warmup_steps: linear warm-up before a cosine decay to 10 % of the peak.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        n_experts: int = 0,
        top_k: int = 2,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Validate now (cheaply, before any process starts); the model itself is built in configure_model.
        self.config = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, n_experts, top_k)
        self.model: Optional[GPT] = None
        self.val_loss = MeanMetric()

    @override
    def configure_model(self) -> None:
        # Runs inside the strategy's init context: under HSDPStrategy on the meta device.
        if self.model is None:
            self.model = GPT(self.config)

    def init_weights(self) -> None:
        """Called by hp_lightning after meta-device parameters are allocated (local shards only)."""
        assert self.model is not None
        self.model.init_weights()

    @override
    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "call configure_model() first (Trainer and load_from_checkpoint do)."
        return self.model(idx)

    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None) -> Tensor:
        """See :meth:`GPT.generate`."""
        assert self.model is not None, "call configure_model() first (Trainer and load_from_checkpoint do)."
        return self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)

    def sample_text(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: Optional[int] = 20) -> str:
        """Continue ``prompt`` (a string) and return prompt + continuation."""
        idx = encode(prompt or "\n").unsqueeze(0).to(self.device)
        return decode(self.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)[0])

    def pipeline_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Next-token cross-entropy; also what the last pipeline stage computes per micro-batch."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        return self.pipeline_loss(self(inputs), targets)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        # MeanMetric averages over every batch of every rank when the epoch's value is computed.
        self.val_loss.update(self._loss(batch), weight=batch[0].shape[0])
        self.log("val_loss", self.val_loss, prog_bar=True, on_step=False, on_epoch=True)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(self.hparams.warmup_steps, total)

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def describe(self) -> str:
        """One line: the model's shape and parameter count."""
        with torch.device("meta"):  # counts without allocating (works before configure_model too)
            count = sum(p.numel() for p in GPT(self.config).parameters())
        return f"GPT {asdict(self.config)} — {count / 1e6:.2f}M parameters"
