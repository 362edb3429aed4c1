"""Throughput: samples/s, tokens/s, TFLOP/s, MFU and peak memory, measured and logged every N steps.

Lightning's ``ThroughputMonitor`` needs the FLOPs of a batch supplied by hand; here torch's
``FlopCounterMode`` measures them once, on the real step (every micro-batch of the window), as
this rank computes them (FSDP: whole gathered parameters; TP: this rank's slices). Between logging
steps nothing is read from a tensor; the clock is read only on logging steps, after a device
synchronize. The measured step is left out of the timing (counting slows it).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from hp_lightning.core import devices

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: Dense bf16 peak FLOP/s per device, from the vendors' data sheets, by a substring of the device's
#: name (the first that matches). Pass ``peak_flops`` for any other device (and on CPU).
KNOWN_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


def known_peak_flops(device: torch.device) -> Optional[float]:
    """The table's peak for ``device`` (None for the CPU and for devices it does not list)."""
    module = devices.device_module(device.type)
    if module is None or not hasattr(module, "get_device_name"):
        return None
    name = str(module.get_device_name(device))
    return next((peak for key, peak in KNOWN_PEAK_FLOPS if key in name), None)


def _first_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of ``batch`` in order (tuples, lists, dicts; nested)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in _first_tensors(value)]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [t for value in batch for t in _first_tensors(value)]
    return []


def default_samples(batch: Any) -> int:
    """The first tensor's leading dim."""
    tensors = _first_tensors(batch)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 0


def default_tokens(batch: Any) -> Optional[int]:
    """Elements of the first integer tensor (token ids ``[batch, sequence]``); None when there is none."""
    ids = next((t for t in _first_tensors(batch) if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool), None)
    return None if ids is None else int(ids.numel())


def _peak_memory_bytes(device: torch.device) -> int:
    """The device allocator's peak, or this process's peak resident memory on the CPU."""
    allocated = devices.max_memory_allocated(device)
    return allocated if allocated is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Throughput(Callback):
    """Log ``throughput/*`` every ``log_every_n_steps`` optimizer steps through the Trainer's loggers.

    Per rank: ``samples_per_sec``, ``tokens_per_sec``, ``tflops_per_sec``, ``mfu``,
    ``peak_memory_gib``; for the job: ``job_samples_per_sec`` and ``job_tokens_per_sec`` (per rank x
    data-parallel ranks). ``flops_per_step`` is logged once, when measured.

    Args:
        peak_flops: this device's peak FLOP/s for MFU; None: :data:`KNOWN_PEAK_FLOPS` (else no MFU, said once).
        measure_flops_at_step: the optimizer step whose FLOPs are counted (0-based; the default skips
            the first, which pays lazy initialization and compilation). None: no FLOPs.
        samples_per_batch / tokens_per_batch: count a batch's samples / tokens; default: the first
            tensor's leading dim / the first integer tensor's elements (token ids).

    Attributes:
        flops_per_step: what one optimizer step computes on this rank (None before it is measured).
        history: every logged dict of this rank, with its ``step``.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        peak_flops: Optional[float] = None,
        measure_flops_at_step: Optional[int] = 1,
        samples_per_batch: Callable[[Any], int] = default_samples,
        tokens_per_batch: Callable[[Any], Optional[int]] = default_tokens,
    ) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"Throughput(log_every_n_steps=...) expects an int >= 1; got {log_every_n_steps!r}.")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or peak_flops <= 0):
            raise ValueError(f"Throughput(peak_flops=...) expects FLOP/s > 0 (e.g. 989e12) or None; got {peak_flops!r}.")
        if measure_flops_at_step is not None and (not isinstance(measure_flops_at_step, int) or measure_flops_at_step < 0):
            raise ValueError(f"Throughput(measure_flops_at_step=...) expects an int >= 0 or None; got {measure_flops_at_step!r}.")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops = peak_flops
        self.measure_flops_at_step = measure_flops_at_step
        self.samples_per_batch = samples_per_batch
        self.tokens_per_batch = tokens_per_batch
        self.flops_per_step: Optional[int] = None
        self.history: list[dict[str, float]] = []
        self._counter: Optional[FlopCounterMode] = None
        self._reset(None)

    def _reset(self, step: Optional[int]) -> None:
        self._started: Optional[float] = None if step is None else time.perf_counter()
        self._since_step = step
        self._samples = 0
        self._tokens: Optional[int] = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.history = []
        self._step_seen = trainer.global_step
        self._synchronize(trainer)
        self._reset(trainer.global_step)
        peak = self.peak_flops or known_peak_flops(trainer.strategy.root_device)
        self._peak = peak
        if peak is None and self.measure_flops_at_step is not None:
            rank_zero_info(
                f"Throughput: no peak FLOP/s known for {trainer.strategy.root_device.type}; MFU is not logged. Pass "
                f"Throughput(peak_flops=...) (this device's dense peak, e.g. 989e12 for an H100 in bf16) to log it."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._counter is None and self.flops_per_step is None and trainer.global_step == self.measure_flops_at_step:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._counter is not None:  # the window's last micro-batch has run its backward
            self._counter.__exit__(None, None, None)
            self.flops_per_step = int(self._counter.get_total_flops()) or None
            self._counter = None
            if self.flops_per_step is None:
                rank_zero_info(
                    "Throughput: FlopCounterMode counted no FLOPs in the measured step (a compiled forward runs its "
                    "kernels outside torch's dispatcher); TFLOP/s and MFU are not logged."
                )

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._samples += self.samples_per_batch(batch)
        tokens = self.tokens_per_batch(batch)
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        step = trainer.global_step
        if step == self._step_seen:  # inside an accumulation window
            return
        self._step_seen = step
        if self.measure_flops_at_step is not None and step == self.measure_flops_at_step + 1 and self.flops_per_step is not None:
            self._synchronize(trainer)
            self._reset(step)  # the counted step ran slower: time from here
            self._log(trainer, {"throughput/flops_per_step": float(self.flops_per_step)})
            return
        if step % self.log_every_n_steps == 0 and self._started is not None and self._since_step is not None:
            self._synchronize(trainer)
            elapsed = time.perf_counter() - self._started
            self._log(trainer, self._metrics(trainer, step - self._since_step, elapsed))
            self._reset(step)

    def _metrics(self, trainer: pl.Trainer, steps: int, elapsed: float) -> dict[str, float]:
        data_parallel = self._data_parallel_size(trainer)
        metrics = {
            "throughput/samples_per_sec": self._samples / elapsed,
            "throughput/job_samples_per_sec": self._samples / elapsed * data_parallel,
            "throughput/peak_memory_gib": _peak_memory_bytes(trainer.strategy.root_device) / 2**30,
        }
        if self._tokens is not None:
            metrics["throughput/tokens_per_sec"] = self._tokens / elapsed
            metrics["throughput/job_tokens_per_sec"] = self._tokens / elapsed * data_parallel
        if self.flops_per_step is not None:
            flops_per_sec = self.flops_per_step * steps / elapsed
            metrics["throughput/tflops_per_sec"] = flops_per_sec / 1e12
            if self._peak is not None:
                metrics["throughput/mfu"] = flops_per_sec / self._peak
        return metrics

    @staticmethod
    def _data_parallel_size(trainer: pl.Trainer) -> int:
        """Ranks that read different samples: the strategy's data-parallel size where it has one."""
        mesh = getattr(trainer.strategy, "parallel_mesh", None)
        return int(getattr(mesh, "dp_size", trainer.world_size))

    @staticmethod
    def _synchronize(trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        if devices.is_accelerator(device.type):
            devices.synchronize(device)

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        self.history.append({**metrics, "step": float(trainer.global_step)})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._counter is not None:  # fit ended inside the measured window
            self._counter.__exit__(None, None, None)
            self._counter = None
