"""Fine-tune a Hugging Face model under FSDP and publish it back in ``from_pretrained`` form.

    python examples/hf_finetune.py --make-pretrained tiny-llama          # stands in for a downloaded model
    python examples/hf_finetune.py --pretrained tiny-llama --out run     # FSDP on 2 CPU processes
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('run/hf')"

The model is built from the checkpoint's ``config.json`` in ``configure_model``, on the meta
device (no memory, no initialization cost), and ``load_weights`` names the Hugging Face directory
right there: the strategy shards the model, allocates its shards without initializing what the
directory holds and fills them from it, each rank reading only the rows of its own shards. After training, ``strategy.save_hf`` writes ``run/hf``: safetensors shards with
``model.safetensors.index.json`` and the config, every rank writing its own part. The sharded
training checkpoint converts the same way offline:
``python -m hp_lightning.checkpoint export-hf run/last.ckpt run/hf-offline --prefix net. --config tiny-llama``.

No download: ``--make-pretrained`` builds a tiny Llama with ``transformers`` and saves it with
``save_pretrained`` in several shards, as the hub would hold a large one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/hf_finetune.py` from anywhere

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from typing_extensions import override  # noqa: E402

import hp_lightning  # noqa: E402
from hp_lightning import HSDPStrategy  # noqa: E402

VOCAB, SEQ = 64, 16


def make_pretrained(path: Path) -> None:
    """A tiny Llama saved the Hugging Face way, in several shards (what a hub download looks like)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="40KB")


def rule_tokens(n: int, seed: int = 0) -> torch.Tensor:
    """Sequences following a fixed rule (next = 3 * token + 1 mod VOCAB): something to fine-tune on."""
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    steps = [start]
    for _ in range(SEQ - 1):
        steps.append((3 * steps[-1] + 1) % VOCAB)
    return torch.cat(steps, dim=1)


class FineTune(pl.LightningModule):
    """A causal LM from a Hugging Face directory, as ``self.net`` (so its keys carry the prefix ``net.``).

    Args:
        pretrained: the Hugging Face directory (config.json + safetensors).
        lr: AdamW's learning rate.
    """

    def __init__(self, pretrained: str, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: Optional[torch.nn.Module] = None
        self.losses: list[float] = []

    @override
    def configure_model(self) -> None:
        if self.net is None:  # under HSDPStrategy this runs on the meta device
            from transformers import AutoConfig, AutoModelForCausalLM

            self.net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.pretrained))
            # Read at setup, after sharding: each rank its own shards' rows; what it holds is never initialized.
            hp_lightning.load_weights(self, self.hparams.pretrained, prefix="net.")

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.net(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    @override
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(rule_tokens(512))
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-pretrained", type=Path, default=None, help="write a tiny Llama Hugging Face directory here and exit")
    parser.add_argument("--pretrained", type=Path, default=None, help="the Hugging Face directory to fine-tune")
    parser.add_argument("--out", type=Path, default=Path("hf_finetune_out"), help="where the Hugging Face export goes (OUT/hf)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.make_pretrained is not None:
        make_pretrained(args.make_pretrained)
        print(f"wrote {args.make_pretrained}")
        return
    if args.pretrained is None:
        parser.error("pass --pretrained DIR (make one with --make-pretrained DIR)")
    seed_everything(0)
    module = FineTune(str(args.pretrained))
    trainer = Trainer(
        accelerator="cpu", devices=args.devices, strategy=HSDPStrategy(mesh_shape=[args.devices]), max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(module)
    # Every rank calls it: each writes its own shards; then the parts are merged into whole-tensor files.
    exported = trainer.strategy.save_hf(args.out / "hf", prefix="net.", config=args.pretrained, max_shard_size="40KB", overwrite=True)
    if trainer.global_rank == 0:
        summary = {"first_loss": module.losses[0], "last_loss": module.losses[-1], "exported": str(exported)}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
