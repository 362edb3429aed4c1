"""Train the character GPT from the command line or a YAML file, with LightningCLI.

    python examples/train.py fit --config examples/configs/hsdp.yaml
    python examples/train.py fit --trainer.strategy=hsdp --trainer.devices=4 --trainer.max_steps=100
    python examples/train.py fit --config examples/configs/fsdp.yaml --print_config   # every option, resolved

``import hp_lightning`` registers the strategy names (``hsdp``, ``hp_fsdp``, ``hsdp_cpu_offload``), so
``--trainer.strategy=hsdp`` works; a config can instead give ``class_path: hp_lightning.HSDPStrategy``
with ``init_args`` for every option (see ``examples/configs/full_options.yaml``). The data's
``block_size`` is linked to the model's, so it is set once, under ``data``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/train.py` from anywhere

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from typing_extensions import override  # noqa: E402

import hp_lightning  # noqa: E402,F401  - registers the "hsdp" strategy names
from examples.gpt import CharDataModule, GPTLightningModule  # noqa: E402


class GPTCLI(LightningCLI):
    """LightningCLI for :class:`GPTLightningModule` on :class:`CharDataModule`."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")


def main(args: Optional[list[str]] = None) -> GPTCLI:
    """Run the CLI (``args`` instead of ``sys.argv[1:]`` when given)."""
    return GPTCLI(
        GPTLightningModule,
        CharDataModule,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
