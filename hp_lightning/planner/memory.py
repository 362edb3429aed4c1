"""Per-rank memory of a candidate, from the simulated rank's fake tensors after its step.

State is the local shards FSDP2 made; activations and transients are the live storage at the
step's peak (:class:`~hp_lightning.planner.simulate.LiveBytes`) minus what was alive at its start.
Under CPU offload the device peak drops by the sharded state (an estimate). CPU ranks on gloo also
hold its staging buffers (``RankRun.gloo_peak_bytes``, what ``--validate`` compares).
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
