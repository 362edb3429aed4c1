"""A LightningModule written for Lightning's ``ModelParallelStrategy``, run under hp_lightning by changing one line.

``docs/migrating.md`` walks through it. The module is written the way Lightning's tensor-parallel
docs write one: ``configure_model`` slices ``self.device_mesh["tensor_parallel"]`` and
``["data_parallel"]``, applies torch's ``parallelize_module`` when TP is on and torch's
``fully_shard`` when data parallelism is, and ``training_step`` takes no ``batch_idx``::

    python examples/from_model_parallel.py --strategy model_parallel   # Lightning's strategy
    python examples/from_model_parallel.py --strategy hsdp             # the same module under hp_lightning

Both print the same losses (4 CPU processes, TP 2 x data parallel 2).
``tests/distributed/test_lightning_contracts.py`` runs this module under both and compares them.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DIM = 16


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class FeedForwardStack(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([FeedForward(dim, 2 * dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def parallelize(model: FeedForwardStack, device_mesh: DeviceMesh) -> FeedForwardStack:
    """TP inside each layer, then FSDP over the data-parallel ranks (Lightning's 2-D recipe)."""
    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp_mesh.size() > 1:
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, plan)
    if dp_mesh.size() > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


class LitModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FeedForwardStack()

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)

    def training_step(self, batch):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


def dataset(n: int = 64) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, DIM, generator=generator)
    return torch.utils.data.TensorDataset(x, torch.tanh(x.flip(-1)))


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=False)


def strategy_for(name: str, data_parallel_size: int, tensor_parallel_size: int) -> pl.strategies.Strategy:
    """The one line that changes."""
    if name == "model_parallel":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size)
    import hp_lightning

    return hp_lightning.HSDPStrategy(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["model_parallel", "hsdp"], default="hsdp")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=5)
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.data_parallel_size * args.tensor_parallel_size,
        strategy=strategy_for(args.strategy, args.data_parallel_size, args.tensor_parallel_size),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LitModel(), loader(), loader())


if __name__ == "__main__":
    main()
