"""Rank-divergent backward passes are named on every rank before any gradient collective.

One 2-rank launch trains four models: a root parameter used on rank 0 only (an auxiliary loss),
a sharding unit whose output is used on rank 0 only, a replicate parameter used on rank 0 only, and
a step that rank 1 skips after its forward (``training_step`` returns None there, as code that
skips NaN losses does).
Each must stop every rank with the same ``RankDivergenceError`` within seconds, naming the unit or
parameter; a model without divergence trains as before.
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn

from tests.helpers import TinyNet, make_dataset, rank_loader, run_distributed, trainer_kwargs


class Divergent(LightningModule):
    """A TinyNet whose loss depends on the rank in one of three ways (``case``)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.net = TinyNet()
        self.aux = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net.inp(x)
        first = self.net.blocks[0](h)
        second = self.net.blocks[1](first)
        rank0 = self.global_rank == 0
        if self.case == "unit":  # blocks.1 runs forward everywhere, but feeds the loss on rank 0 only
            out = self.net.head(second if rank0 else first)
        else:
            out = self.net.head(second)
        loss = nn.functional.mse_loss(out, y)
        if self.case in ("root", "replicate") and rank0:
            loss = loss + self.aux(x).pow(2).mean()
        elif self.case in ("none", "replicate_used"):
            loss = loss + 0.0 * self.aux(x).sum()
        if self.case == "skip" and not rank0:
            return None  # "skip this batch" (say, a NaN loss) on one rank: Lightning skips its backward
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def divergence_worker() -> dict:
    from hp_lightning import HSDPStrategy
    from hp_lightning.fully_shard.divergence import RankDivergenceError

    out: dict = {}
    for case in ("root", "unit", "replicate", "skip", "none"):
        seed_everything(0)
        replicate = ["aux.*"] if case == "replicate" else None
        strategy = HSDPStrategy(mesh_shape=[2], fault_watchdog=False, replicate_params=replicate)
        trainer = Trainer(devices=2, strategy=strategy, max_steps=2, **trainer_kwargs())
        start = time.monotonic()
        try:
            trainer.fit(Divergent(case), rank_loader(make_dataset(), 16, 2))
            out[case] = ("finished", "", time.monotonic() - start)
        except RankDivergenceError as exc:
            out[case] = ("RankDivergenceError", str(exc), time.monotonic() - start)
    return out


def test_rank_divergent_backward_is_named_on_every_rank_within_seconds():
    results = run_distributed(divergence_worker, 2)
    for rank, res in enumerate(results):
        for case, expected in (
            ("root", "'<root>', parameter(s) ['aux.weight', 'aux.bias']"),
            ("unit", "sharding unit 'net.blocks.1'"),
            ("replicate", "replicate parameter(s) ['aux.weight', 'aux.bias']"),
            ("skip", "sharding unit 'net.blocks.0'"),
        ):
            kind, message, seconds = res[case]
            assert kind == "RankDivergenceError", (rank, case, kind)
            assert expected in message, (case, message)
            assert "on ranks [0] but not on ranks [1]" in message, message
            assert "control flow" in message  # the likely cause
            assert seconds < 20, (case, seconds)  # one step: the error comes before any collective can hang
        # The same message on every rank.
        assert res["root"][1] == results[0]["root"][1]
        assert res["none"][0] == "finished"
