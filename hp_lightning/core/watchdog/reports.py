"""What a failure is and how it is told: exit codes, the report ranks exchange, which errors are a lost peer's consequence."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

#: Exit code of a rank the watchdog stops because another rank failed first.
PEER_FAILED_EXIT_CODE = 3

#: Exit code of a failed rank whose process was still alive ``exit_grace`` seconds after its failure.
FAILED_EXIT_CODE = 1

_PREFIX = "[hp_lightning]"

#: Messages that mark an error as a consequence of losing a peer rather than a cause of its own.
_COMMUNICATION_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Read error",
    "Write error",
    "NCCL communicator was aborted",
    "Timed out waiting",
    "timed out",
)

_GONE = "is gone: its process ended without reporting an error (killed by a signal such as SIGKILL, or by the OOM killer)"


def _first_line(text: str, limit: int = 300) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if "Original Traceback" in text and len(lines) > 1:
        # Re-raised from another process (a DataLoader worker): its own last line is the cause.
        line = f"{line.rstrip('.')}: {lines[-1].strip()}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a lost peer (a gloo/NCCL/store error) rather than a cause of its own.

    Errors raised *from* one (``raise ... from e``) count too: torch's pipeline stages wrap a lost
    peer's gloo error in ``RuntimeError("[Stage 0] failed to run forward ...")``. Only explicit
    causes are followed, not an error raised while another was being handled, which may be a
    cause of its own.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError) or isinstance(current, RuntimeError) and any(m in str(current) for m in _COMMUNICATION_MARKERS):
            return True
        current = current.__cause__
    return False


class _Wire:
    """JSON text for the store, and back (dataclasses of plain fields)."""

    def to_wire(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_wire(cls, data: bytes | str) -> Any:
        return cls(**json.loads(data))


@dataclass(frozen=True)
class FailureReport(_Wire):
    """The first failure of the job, as every rank reads it from the store.

    ``kind``: ``"error"`` (it raised), ``"gone"`` (its process ended without a report),
    ``"silent"`` (its heartbeat stopped) or ``"stuck"`` (its main thread stopped moving).
    ``summary`` is one line; ``reporter`` the rank that posted it; ``time`` seconds since the epoch.
    """

    rank: int
    kind: str
    summary: str
    host: str
    pid: int
    reporter: int
    time: float = 0.0

    def describe(self) -> str:
        """``rank 1 failed: ValueError: ...`` as printed by the ranks it stops."""
        if self.kind == "error":
            return f"rank {self.rank} failed first with {self.summary} (its traceback is in rank {self.rank}'s output)"
        where = f" (pid {self.pid} on {self.host})" if self.pid > 0 else ""
        return f"rank {self.rank}{where} {self.summary}"


@dataclass(frozen=True)
class _ProcessInfo(_Wire):
    """Where a rank runs: enough to check on it locally when it shares our host and pid namespace."""

    host: str
    machine: str
    pid: int
    start_ticks: int


def _second_after(failure: FailureReport) -> float:
    """The earliest time a consequence of ``failure`` may be recorded for torchrun.

    The agent names the record with the smallest whole-second timestamp as the root cause, so a
    consequence's record must not share its cause's second.
    """
    return math.floor(failure.time) + 1.0


class StoppedForPeerFailure(RuntimeError):
    """Recorded for torchrun by a rank the watchdog stops because another rank failed first."""


class MainThreadStuck(RuntimeError):
    """Recorded for torchrun by a rank whose main thread stopped moving outside torch (a deadlock)."""


def check_seconds(value: Any, name: str, owner: str = "FaultWatchdog") -> float:
    """``value`` as a positive, finite number of seconds, or a TypeError/ValueError naming ``owner(name=...)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{owner}({name}=...) expects a number of seconds; got {type(value).__name__} {value!r}. Example: {owner}({name}=60)."
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}({name}=...) must be a finite number of seconds > 0; got {value!r}. Example: {owner}({name}=60).")
    return float(value)
