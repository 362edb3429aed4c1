"""Reads of tensor values into Python (host-device synchronizations on an accelerator), counted on CPU.

:class:`~hp_lightning.core.diagnostics.HostReads` attributes each ``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``.to("cpu")`` to the first frame
outside torch that caused it. A one-process Trainer run pins hp_lightning's own reads per training
step at zero (with peers, the only read is the step agreement's host-side result:
``tests/distributed/test_hot_path.py`` pins that, per micro-batch, on 4 ranks).
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from hp_lightning.core.agreement import StepAgreement
from hp_lightning.core.diagnostics import HostReads
from tests.helpers import RegressionModule, loader, make_dataset, trainer_kwargs

HERE = str(Path(__file__).resolve().parent)


def _reads_here() -> list[tuple[str, str]]:
    t = torch.arange(3.0)
    with HostReads(package=HERE) as reads:
        t.sum().item()
        t.tolist()
        bool(t[0])
        int(t[1])
        float(t[2])
        t.to("cpu")
        t.to(torch.float64)  # a dtype change, not a read
        torch.testing.assert_close(t, t)  # torch reads inside its own code: attributed to this line
    return reads.reads


def test_host_reads_are_attributed_to_the_line_that_caused_them():
    reads = _reads_here()
    kinds = [kind for kind, _ in reads]
    assert kinds[:6] == ["item", "tolist", "bool", "int", "float", "to(cpu)"], reads
    assert all(site.startswith("unit/test_host_sync.py:") for _, site in reads), reads
    # assert_close reads values inside torch: those reads count for the line here that called it.
    last_line = reads[-1][1]
    assert len(reads) > 6 and all(site == last_line for _, site in reads[6:]), reads


def test_reads_outside_the_package_are_not_counted():
    with HostReads() as reads:  # hp_lightning's folder: this test file is outside it
        torch.ones(2).sum().item()
    assert reads.count() == 0


class _StepReads(Callback):
    def __init__(self, reads: HostReads) -> None:
        self.reads, self.per_batch = reads, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self.reads.count()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_batch.append(self.reads.reads[self._start :])


def test_one_process_training_step_reads_nothing_from_hp_lightning():
    from hp_lightning import HSDPStrategy

    seed_everything(0)
    with HostReads() as reads:
        steps = _StepReads(reads)
        trainer = Trainer(
            devices=1, strategy=HSDPStrategy(mesh_shape=[1], fault_watchdog=False), max_steps=4, accumulate_grad_batches=2,
            callbacks=[steps], limit_val_batches=0, **trainer_kwargs(),
        )
        trainer.fit(RegressionModule(), loader(make_dataset(), 8))
    assert len(steps.per_batch) == 8
    assert steps.per_batch == [[]] * 8, steps.per_batch


def test_step_agreement_without_peers_takes_the_local_signal_once_per_step():
    agreement = StepAgreement()
    received = {"signal": 0}
    agreement.local_signal = lambda: received["signal"]
    assert agreement.exchange([1, 0, 1]) == [1, 0, 1]
    received["signal"] = signal.SIGTERM
    assert agreement.step_signal() == 0  # agreed at the exchange, before the signal
    assert agreement.step_signal() == signal.SIGTERM  # no exchange this step: agreed now
    assert agreement.exchanges == 0  # one process: nothing communicated


def test_throughput_measures_one_steps_flops_and_reads_nothing_between_logs():
    """``Throughput``'s FLOPs equal ``FlopCounterMode``'s count of one step (2 micro-batches); no read in any step."""
    from torch.utils.flop_counter import FlopCounterMode

    from hp_lightning import HSDPStrategy
    from hp_lightning.callbacks import Throughput

    seed_everything(0)
    reference = RegressionModule()
    x, y = make_dataset().tensors
    with FlopCounterMode(display=False) as counter:
        for micro_batch in range(2):
            batch = slice(8 * micro_batch, 8 * micro_batch + 8)
            torch.nn.functional.mse_loss(reference.net(x[batch]), y[batch]).backward()

    seed_everything(0)
    throughput = Throughput(log_every_n_steps=2, measure_flops_at_step=1)
    with HostReads() as reads:
        steps = _StepReads(reads)
        trainer = Trainer(
            devices=1, strategy=HSDPStrategy(mesh_shape=[1], fault_watchdog=False), max_steps=6, accumulate_grad_batches=2,
            callbacks=[steps, throughput], limit_val_batches=0, **trainer_kwargs(),
        )
        trainer.fit(RegressionModule(), loader(make_dataset(), 8))
    assert steps.per_batch == [[]] * 12, steps.per_batch
    assert throughput.flops_per_step == counter.get_total_flops() > 0
    logged = [(int(h["step"]), sorted(h)) for h in throughput.history]
    assert [step for step, _ in logged] == [2, 4, 6]
    assert logged[0][1] == ["step", "throughput/flops_per_step"]
    assert "throughput/tflops_per_sec" in logged[1][1] and "throughput/samples_per_sec" in logged[1][1]
    assert "throughput/mfu" not in logged[1][1]  # no peak known for the CPU
    rates = throughput.history[1]
    assert rates["throughput/job_samples_per_sec"] == rates["throughput/samples_per_sec"] > 0
    assert rates["throughput/peak_memory_gib"] > 0
