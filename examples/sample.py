"""Sample text from a trained GPT checkpoint, in one CPU process.

    python examples/sample.py runs/demo/gpt.ckpt --prompt "def " --max-new-tokens 300

The checkpoint is a full (consolidated) Lightning checkpoint: what ``HSDPStrategy(state_dict_type=
"full")`` writes, or what ``python -m hp_lightning.checkpoint consolidate SHARDED_DIR OUT.ckpt``
makes of a sharded one. It loads with the ordinary ``GPTLightningModule.load_from_checkpoint``:
no process group, no hp_lightning needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/sample.py` from anywhere

from examples.gpt import GPTLightningModule  # noqa: E402

DEFAULT_PROMPTS = ("def ", "class ", "import ")


def load_model(checkpoint: str | Path) -> GPTLightningModule:
    """A full checkpoint → an eval-mode :class:`GPTLightningModule` on the CPU.

    Raises:
        FileNotFoundError: when ``checkpoint`` does not exist.
        ValueError: when ``checkpoint`` is a sharded directory (consolidate it first).
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if path.is_dir():
        raise ValueError(
            f"{str(path)!r} is a sharded checkpoint directory; sampling reads one full file. Consolidate it "
            f"first: python -m hp_lightning.checkpoint consolidate {path} {path.with_suffix('')}.full.ckpt"
        )
    model = GPTLightningModule.load_from_checkpoint(path, map_location="cpu")
    return model.eval()


def sample(
    model: GPTLightningModule,
    prompts: tuple[str, ...] | list[str] = DEFAULT_PROMPTS,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: Optional[int] = 20,
    seed: int = 0,
) -> list[str]:
    """One continuation per prompt (seeded, so the same checkpoint gives the same text)."""
    torch.manual_seed(seed)
    return [model.sample_text(p, max_new_tokens, temperature=temperature, top_k=top_k) for p in prompts]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a full .ckpt file (consolidate sharded directories first)")
    parser.add_argument("--prompt", action="append", help="text to continue (repeatable; default: def / class / import)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20, help="0 samples from the whole vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = load_model(args.checkpoint)
    print(model.describe())
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    texts = sample(model, prompts, args.max_new_tokens, args.temperature, args.top_k or None, args.seed)
    for prompt, text in zip(prompts, texts):
        print(f"\n----- prompt {prompt!r} -----\n{text}")


if __name__ == "__main__":
    main()
