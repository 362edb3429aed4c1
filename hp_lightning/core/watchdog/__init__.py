"""When one rank fails, every rank stops within seconds, and the first cause is reported once.

Without help, a failure on one rank shows up on the others as a gloo ``Connection closed by
peer`` traceback that hides the cause, or as a hang until the collective timeout (30 minutes)
when the failed process lingers, is frozen, deadlocks, or runs on NCCL. :class:`FaultWatchdog`
is one daemon thread per rank that talks through the job's TCPStore on a connection of its own,
never through the process group (which may be what is stuck). A failing rank posts the first
:class:`FailureReport` (compare-and-set); the others read it at their next poll, wait until the
failed rank has printed its traceback, print one line and exit. Ranks that end without a post
are found by their local peers (a dead pid) or by their heartbeat. ``docs/faults.md`` lists the
cases, and which of them torch, torchrun and Lightning's launcher already cover (none of these);
``docs/architecture.md`` maps the package's modules.
"""

from hp_lightning.core.watchdog.exits import _record_for_torchrun, print_once_per_job  # noqa: F401
from hp_lightning.core.watchdog.fault_watchdog import FaultWatchdog
from hp_lightning.core.watchdog.liveness import waiting_on_purpose
from hp_lightning.core.watchdog.reports import (  # noqa: F401
    FAILED_EXIT_CODE,
    PEER_FAILED_EXIT_CODE,
    FailureReport,
    MainThreadStuck,
    StoppedForPeerFailure,
    _first_line,
    _second_after,
    check_seconds,
    is_communication_error,
)

__all__ = [
    "FAILED_EXIT_CODE",
    "PEER_FAILED_EXIT_CODE",
    "FailureReport",
    "FaultWatchdog",
    "MainThreadStuck",
    "StoppedForPeerFailure",
    "check_seconds",
    "is_communication_error",
    "print_once_per_job",
    "waiting_on_purpose",
]
