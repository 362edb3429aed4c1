"""When one rank fails, every rank stops within seconds, and the first cause is reported once.

Without help, a failure on one rank shows up on the others as a gloo ``Connection closed by
peer`` traceback that hides the cause, or as a hang until the collective timeout (30 minutes)
when the failed process lingers, is frozen, deadlocks, or runs on NCCL. :class:`FaultWatchdog`
is one daemon thread per rank that talks through the job's TCPStore on a connection of its own,
never through the process group (which may be what is stuck). A failing rank posts the first
:class:`FailureReport` (compare-and-set); the others read it at their next poll, wait until the
failed rank has printed its traceback, print one line and exit. Ranks that end without a post
are found by their local peers (a dead pid) or by their heartbeat. ``docs/faults.md`` lists the
cases, and which of them torch, torchrun and Lightning's launcher already cover (none of these).

The package by job: :mod:`.fault_watchdog` (:class:`FaultWatchdog`, the coordinator),
:mod:`.polling` (the watchdog thread and what each poll looks at), :mod:`.failure_board` (the
report protocol on the store), :mod:`.liveness` (dead pids, silent heartbeats, a stuck main
thread), :mod:`.causes` (what an error on this rank means), :mod:`.departure` (when and how a
rank leaves), :mod:`.reports` (what a failure is and how it is worded), :mod:`.processes` (pids,
the store connection, stacks), :mod:`.exits` (how a rank leaves and what it prints).
"""

from hp_lightning.core.watchdog.exits import _one_line_if_uncaught, _quiet_signals, _record_for_torchrun, _say, print_once_per_job  # noqa: F401
from hp_lightning.core.watchdog.failure_board import _FINE_POLL  # noqa: F401
from hp_lightning.core.watchdog.fault_watchdog import FaultWatchdog, _generation  # noqa: F401
from hp_lightning.core.watchdog.liveness import waiting_on_purpose
from hp_lightning.core.watchdog.processes import (  # noqa: F401
    _TORCH_DIR,
    _connect_store,
    _describe_stack,
    _inside_torch,
    _is_running,
    _machine_key,
    _start_ticks,
    _StoreUnreachable,
)
from hp_lightning.core.watchdog.reports import (  # noqa: F401
    _COMMUNICATION_MARKERS,
    _GONE,
    _PREFIX,
    FAILED_EXIT_CODE,
    PEER_FAILED_EXIT_CODE,
    FailureReport,
    MainThreadStuck,
    StoppedForPeerFailure,
    _first_line,
    _ProcessInfo,
    _second_after,
    _Wire,
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
