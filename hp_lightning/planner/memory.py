"""Per-rank memory of a candidate, from the simulated rank's tensors.

* parameters, gradients and optimizer state: the local shards FSDP2 made (DTensor ``to_local``),
  the sharded gradients (the sharded parameters' shape and dtype) and the optimizer's moments,
  read from the fake tensors after the simulated step;
* the largest gathered unit: the largest all-gather output of the step (FSDP2's flat buffer of
  the unit's unsharded parameters in the compute dtype); with prefetch, one more unit is gathered
  while the current one computes;
* activations and transients: the live storage at the step's peak (:class:`~hp_lightning.planner.simulate.LiveBytes`
  over the fake forward/backward/optimizer step, FSDP2's all-gather and reduce-scatter buffers
  included) minus what was alive at the step's start;
* the predicted peak: the live storage at that peak. Under CPU offload the sharded parameters,
  gradients and optimizer state live on the host: the device peak drops by them (an estimate:
  FSDP2 then copies each unit's shards to the device for its all-gather).

The peak is the device's. CPU ranks on gloo also hold the buffers gloo stages collectives
through (:func:`~hp_lightning.planner.simulate.gloo_staging_bytes`); that peak is
``RankRun.gloo_peak_bytes``, the one ``--validate`` compares on this machine's CPU.

A candidate *fits* when its peak is at most ``usable`` (90 %) of the device memory: the
caching allocator's fragmentation and the runtime's own buffers take the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_lightning.planner.candidates import Candidate, Cluster
from hp_lightning.planner.simulate import RankRun

#: Share of device memory a plan may use (allocator fragmentation and runtime buffers take the rest).
USABLE = 0.9


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the worst simulated rank of a candidate)."""

    params: int
    grads: int
    optimizer: int
    largest_gather: int
    activations: int
    peak: int
    host: int
    fits: bool
    reason: str


def estimate(run: RankRun, candidate: Candidate, cluster: Cluster) -> MemoryEstimate:
    """The memory estimate of one simulated rank."""
    gathers = [c.bytes for c in run.calls if c.kind == "all_gather" and c.floating]
    state = run.params_bytes + run.optimizer_bytes + run.grads_bytes
    peak = run.peak_bytes
    host = 0
    if candidate.cpu_offload:
        host = state
        peak = max(peak - state, 0)
    capacity = USABLE * cluster.device_memory
    fits = peak <= capacity
    reason = "fits" if fits else f"needs {_gib(peak)} of {_gib(capacity)} usable ({_gib(cluster.device_memory)} x {USABLE:.0%})"
    return MemoryEstimate(
        params=run.params_bytes, grads=run.grads_bytes, optimizer=run.optimizer_bytes, largest_gather=max(gathers, default=0),
        activations=max(run.peak_bytes - run.start_bytes, 0), peak=peak, host=host, fits=fits, reason=reason,
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"
