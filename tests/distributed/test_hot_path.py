"""The hot path carries what a raw FSDP2 loop carries, plus at most one control collective per step.

One 4-rank launch trains the same model under FSDP 4 and HSDP 2x2, with ``accumulate_grad_batches``
1 and 4 and each ``accumulation_mode``, recording every collective at the ``torch.distributed``
call, bucketed by micro-batch (a bucket runs from one ``on_train_batch_start`` to the next, so the
loop's own calls between batches are in it), and every read of a tensor's value into Python made
by hp_lightning's code (on an accelerator each is a host-device synchronization). After the first
optimizer step (FSDP's lazy initialization is behind):

* a non-final micro-batch under ``"skip"`` issues only FSDP's floating-point all-gathers;
* under ``"every"`` / ``"defer_all_reduce"`` it also reduce-scatters (and all-reduces, ``"every"``
  on HSDP) and compares the divergence record once, before its backward;
* the final micro-batch issues the gradient collectives and exactly one control collective (an
  int32 all-reduce over the whole world on the host-side gloo group), which also carries the
  preemption decision, also with ``divergence_check="off"``;
* Lightning's per-batch SIGTERM broadcast is gone;
* hp_lightning reads one tensor into Python per control collective (the agreed integers, a host
  tensor of a gloo group: no device synchronization), and nothing else;
* the parameters equal a single-process run with the same accumulation.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from tests.helpers import RegressionModule, full_params, loader, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs

GLOBAL_BATCH = 16
STEPS = 2
WORLD = 4
CONFIGS = [  # (mesh_shape, accumulate_grad_batches, accumulation_mode, divergence_check)
    ([4], 1, "skip", "per_step"),
    ([4], 4, "skip", "per_step"),
    ([4], 4, "every", "per_step"),
    ([4], 4, "defer_all_reduce", "per_step"),
    ([2, 2], 1, "skip", "per_step"),
    ([2, 2], 4, "skip", "per_step"),
    ([2, 2], 4, "every", "per_step"),
    ([2, 2], 4, "defer_all_reduce", "per_step"),
    ([2, 2], 4, "skip", "off"),
]


class QuietRegression(RegressionModule):
    """RegressionModule without the per-step ``sync_dist`` logging (an all-reduce of the user's choosing)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class MicroBatchBuckets(Callback):
    """Opens a collective bucket and a host-read bucket at every training batch."""

    def __init__(self, comms: Any, reads: Any) -> None:
        self.comms, self.reads = comms, reads
        self.read_marks: list[tuple[Any, int]] = []

    def _mark(self, label: Any) -> None:
        self.comms.mark(label)
        self.read_marks.append((label, self.reads.count()))

    def on_train_start(self, trainer, pl_module):
        self._mark("before the first batch")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._mark(batch_idx)

    def on_train_end(self, trainer, pl_module):
        self._mark("end")

    def reads_per_bucket(self) -> dict[Any, list[str]]:
        marks = [*self.read_marks, (None, self.reads.count())]
        return {
            label: [f"{site} {kind}" for kind, site in self.reads.reads[start:end]]
            for (label, start), (_, end) in zip(marks, marks[1:])
        }


def _summary(calls: list) -> dict[str, Any]:
    floating = [c for c in calls if c.floating]
    control = [c for c in calls if not c.floating]
    return {
        "floating": sorted({c.kind for c in floating}),
        "floating_count": {kind: sum(1 for c in floating if c.kind == kind) for kind in {c.kind for c in floating}},
        "control": [(c.kind, str(c.dtype), c.ranks, c.bytes) for c in control],
    }


def hot_path_worker() -> list[dict]:
    from hp_lightning import HSDPStrategy
    from hp_lightning.core.diagnostics import CollectiveCounter, HostReads

    out = []
    for mesh_shape, accumulate, mode, divergence in CONFIGS:
        seed_everything(0)
        model = QuietRegression()
        strategy = HSDPStrategy(mesh_shape=mesh_shape, accumulation_mode=mode, divergence_check=divergence, fault_watchdog=False)
        with CollectiveCounter() as comms, HostReads() as reads:
            buckets = MicroBatchBuckets(comms, reads)
            trainer = Trainer(
                devices=WORLD, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=accumulate,
                callbacks=[buckets], limit_val_batches=0, **trainer_kwargs(),
            )
            trainer.fit(model, rank_loader(make_dataset(), GLOBAL_BATCH // accumulate, WORLD))
        out.append(
            {
                "config": (mesh_shape, accumulate, mode, divergence),
                "buckets": {label: _summary(calls) for label, calls in comms.buckets().items()},
                "reads": buckets.reads_per_bucket(),
                "params": full_params(model),
                "exchanges": strategy._agreement.exchanges,
            }
        )
    return out


def reference(accumulate: int) -> dict[str, torch.Tensor]:
    seed_everything(0)
    model = QuietRegression()
    trainer = Trainer(devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(), GLOBAL_BATCH // accumulate))
    return full_params(model)


def test_hot_path_issues_one_control_collective_per_step_and_no_device_read():
    results = run_distributed(hot_path_worker, WORLD)
    references = {k: reference(k) for k in (1, 4)}
    world = tuple(range(WORLD))
    control_call = ("all_reduce", "torch.int32", world)
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            mesh_shape, k, mode, divergence = config = res["config"]
            hsdp = len(mesh_shape) == 2
            buckets, reads = res["buckets"], res["reads"]
            # No collective of the loop's own before the first batch (Lightning's SIGTERM broadcast is gone).
            assert buckets.get("before the first batch", {"control": []})["control"] == [], (config, buckets)
            for step in range(1, STEPS):  # after the first optimizer step
                for micro in range(k):
                    batch = step * k + micro
                    got = buckets[batch]
                    final = micro == k - 1
                    controls = [c[:3] for c in got["control"]]
                    if final:
                        expected = {"all_gather", "reduce_scatter"} | ({"all_reduce"} if hsdp else set())
                        assert set(got["floating"]) == expected, (config, batch, got)
                        assert controls == [control_call], (config, batch, got)
                    elif mode == "skip":
                        assert got["floating"] == ["all_gather"], (config, batch, got)
                        assert controls == [], (config, batch, got)
                    else:
                        expected = {"all_gather", "reduce_scatter"} | ({"all_reduce"} if hsdp and mode == "every" else set())
                        assert set(got["floating"]) == expected, (config, batch, got)
                        assert controls == ([control_call] if divergence == "per_step" else []), (config, batch, got)
                    # hp_lightning's reads into Python: exactly one per control collective, of its host-side result.
                    assert len(reads[batch]) == len(controls), (config, batch, reads[batch])
                    assert all("hp_lightning/core/agreement.py" in r and r.endswith(" tolist") for r in reads[batch]), reads[batch]
            per_step = 1 if (k == 1 or mode == "skip" or divergence == "off") else k
            assert res["exchanges"] == STEPS * per_step, (config, res["exchanges"])
            diff = max_rel_diff(res["params"], references[k])
            assert diff <= 1e-5, f"rank {rank} {config}: parameters differ from one process by {diff:.3e}"
