"""Train the test model with HSDPStrategy as a user script would; rank 0 writes the final params.

Run as ``python launch_train.py OUT.pt 2`` (Lightning's subprocess launcher starts the other
ranks) or under ``torchrun --nproc-per-node 2 launch_train.py OUT.pt 2``.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import hp_lightning  # noqa: F401 - registers "hsdp"
from tests.helpers import RegressionModule, TinyNet, full_params, make_dataset, rank_loader, trainer_kwargs


class SubmoduleAfterFit(Callback):
    """Calls a submodule of the LightningModule outside the loop, ``pl_module.net(x)`` in ``on_train_end``."""

    def on_train_end(self, trainer, pl_module):
        with torch.no_grad():
            self.output = pl_module.net(make_dataset().tensors[0][:4]).detach().clone()


def main(out: str, devices: int) -> None:
    torch.set_num_threads(1)
    seed_everything(0)
    model = RegressionModule()
    submodule = SubmoduleAfterFit()
    trainer = Trainer(devices=devices, strategy="hp_fsdp", max_steps=3, callbacks=[submodule], **trainer_kwargs())
    trainer.fit(model, rank_loader(make_dataset(), 16, devices))
    params = full_params(model)
    # What pl_module.net(x) must have returned: the same net, unsharded, with the trained weights.
    net = TinyNet()
    net.load_state_dict({name.removeprefix("net."): value for name, value in params.items()})
    with torch.no_grad():
        expected = net(make_dataset().tensors[0][:4])
    if trainer.is_global_zero:
        torch.save({"params": params, "world": trainer.world_size, "mesh": tuple(model.device_mesh.shape),
                    "submodule_output": submodule.output, "submodule_expected": expected}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # Leave without interpreter finalization: gloo worker threads can abort it (SIGABRT) after
    # the work is done and the result written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
