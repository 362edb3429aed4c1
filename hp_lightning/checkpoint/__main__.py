"""``python -m hp_lightning.checkpoint`` (also ``hp-lightning-checkpoint``): convert and check checkpoints offline.

Subcommands::

    consolidate SRC_DIR OUT.ckpt [--weights-only] [--format torch|safetensors] [--overwrite] [--trust-pickle]
        sharded directory (hp_lightning, Lightning ModelParallelStrategy or FSDPStrategy) -> one file
    shard SRC.ckpt OUT_DIR [--overwrite] [--trust-pickle]
        one file -> hp_lightning sharded directory (loads into any world size)
    verify PATH
        check sizes and checksums recorded at save; exit status 1 on any problem
    export-hf CKPT OUT_DIR [--prefix net.] [--config HF_DIR] [--max-shard-size 5GB] [--dtype bf16] [--ema] [--overwrite] [--trust-pickle]
        sharded directory or full file -> Hugging Face directory (safetensors shards + index, config
        copied from --config) that ``from_pretrained`` loads; --ema writes the ShardedEMA average the
        checkpoint holds instead of the weights; see hp_lightning.checkpoint.hf

An existing output is replaced only with --overwrite, and only if it is a checkpoint. Sources are
unpickled safely unless --trust-pickle. Exit status: 0 done, 1 bad checkpoint or path, 2 bad command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from hp_lightning.checkpoint import convert
from hp_lightning.checkpoint.hf import export_hf

PROG = "hp-lightning-checkpoint"
TRUST_HELP = "unpickle SRC without safe loading (torch weights_only=False); runs code it carries: only for files you trust"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Convert and check hp_lightning / Lightning checkpoints offline.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{consolidate,shard,verify,export-hf}")

    merge = commands.add_parser("consolidate", help="sharded directory -> one checkpoint file")
    merge.add_argument("src", type=Path, metavar="SRC_DIR", help="sharded checkpoint directory")
    merge.add_argument("out", type=Path, metavar="OUT", help="output file (.ckpt, or .safetensors with --format safetensors)")
    merge.add_argument("--weights-only", action="store_true", help="model weights and hyper-parameters only (no optimizer or trainer state)")
    merge.add_argument("--format", dest="fmt", choices=("torch", "safetensors"), default="torch", help="output format (default: torch)")
    merge.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint (never anything else)")
    merge.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)

    split = commands.add_parser("shard", help="one checkpoint file -> sharded directory")
    split.add_argument("src", type=Path, metavar="SRC", help="single-file checkpoint (.ckpt)")
    split.add_argument("out", type=Path, metavar="OUT_DIR", help="output directory")
    split.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is a checkpoint (never anything else)")
    split.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)

    check = commands.add_parser("verify", help="check a checkpoint against the sizes and checksums recorded at save")
    check.add_argument("path", type=Path, metavar="PATH", help="checkpoint directory or file")

    hf = commands.add_parser("export-hf", help="checkpoint -> Hugging Face directory (from_pretrained loads it)")
    hf.add_argument("src", type=Path, metavar="CKPT", help="sharded checkpoint directory or full checkpoint file")
    hf.add_argument("out", type=Path, metavar="OUT_DIR", help="output directory (absent or empty)")
    hf.add_argument("--prefix", default=None, help="the LightningModule attribute holding the model, e.g. 'net.' (stripped from the keys)")
    hf.add_argument("--config", type=Path, default=None, help="Hugging Face model directory whose config.json / generation_config.json are copied")
    hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    hf.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bf16 (default: keep)")
    hf.add_argument("--ema", action="store_true", help="write the ShardedEMA average the checkpoint holds instead of the weights")
    hf.add_argument("--overwrite", action="store_true", help="replace an earlier export of ours in OUT_DIR (only the files it recorded)")
    hf.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "consolidate":
            summary = convert.consolidate(
                args.src, args.out, weights_only=args.weights_only, fmt=args.fmt, overwrite=args.overwrite, trust_pickle=args.trust_pickle
            )
        elif args.command == "shard":
            summary = convert.shard(args.src, args.out, overwrite=args.overwrite, weights_only=False if args.trust_pickle else None)
        elif args.command == "export-hf":
            summary = export_hf(
                args.src, args.out, prefix=args.prefix, config=args.config, max_shard_size=args.max_shard_size, dtype=args.dtype,
                overwrite=args.overwrite, trust_pickle=args.trust_pickle, ema=args.ema,
            )
        else:
            summary = convert.verify(args.path)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:  # RecursionError too: one line, no traceback
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
