"""The watchdog of one rank: a short coordinator of the collaborators that do its jobs (see the package docstring).

They are built fresh per session (each :meth:`FaultWatchdog.start`), so they carry nothing from a previous Trainer call.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterable
from typing import Any, Optional

import torch.distributed as dist

from hp_lightning.core.watchdog import elastic
from hp_lightning.core.watchdog.causes import CauseFinder
from hp_lightning.core.watchdog.departure import Departure
from hp_lightning.core.watchdog.exits import _quiet_signals, _say
from hp_lightning.core.watchdog.failure_board import FailureBoard
from hp_lightning.core.watchdog.liveness import MainThreadMonitor, PeerLiveness
from hp_lightning.core.watchdog.polling import Poller
from hp_lightning.core.watchdog.processes import StopSignal, _machine_key, _start_ticks
from hp_lightning.core.watchdog.reports import _ProcessInfo, check_seconds

#: Sequence number of watchdog sessions in this process (fit, then test, ...).
_generation = 0


class FaultWatchdog:
    """Stops every rank promptly when one fails, and names the first failure once.

    The strategy calls :meth:`start` once the process group exists, :meth:`report` from
    ``on_exception`` and :meth:`stop` from ``teardown``. A rank that raises an error of its own
    is *failed*: its exception goes on as usual (an uncaught duplicate of an error another rank
    posted first prints one line). A rank whose error is a consequence (``Connection closed by
    peer``), or that was still working when the failure was posted, is *stopped*: one line,
    exit :data:`PEER_FAILED_EXIT_CODE`. A rank found gone or silent is reported by a peer.

    Args:
        heartbeat_timeout: seconds without a heartbeat (or without the main thread moving,
            outside torch) before a rank is declared lost (the option of the same name).
        exit_grace: the option ``failure_exit_grace`` (a lingering failed process ends with :data:`FAILED_EXIT_CODE`).
        poll_interval: seconds between checks. None → ``min(1, heartbeat_timeout / 10)``.

    Raises:
        TypeError / ValueError: for a setting that is not a positive, finite number of seconds.
    """

    def __init__(self, *, heartbeat_timeout: float = 120.0, exit_grace: float = 30.0, poll_interval: Optional[float] = None) -> None:
        self.heartbeat_timeout = check_seconds(heartbeat_timeout, "heartbeat_timeout")
        self.exit_grace = check_seconds(exit_grace, "exit_grace")
        self.poll_interval = (
            min(1.0, self.heartbeat_timeout / 10) if poll_interval is None else check_seconds(poll_interval, "poll_interval")
        )
        self.rank = 0
        self.world_size = 1
        self._stopping = StopSignal()
        self._exit_lock = threading.RLock()
        self._main_thread = MainThreadMonitor(self.heartbeat_timeout)
        self._active = False
        # The session's collaborators; set together by start().
        self._board: Optional[FailureBoard] = None
        self._departure: Optional[Departure] = None
        self._causes: Optional[CauseFinder] = None
        self._poller: Optional[Poller] = None

    @property
    def running(self) -> bool:
        """Started and not stopped (after a failure it keeps running until the process ends)."""
        return self._active

    def start(self, rank: int, world_size: int, local_ranks: Iterable[int] = ()) -> None:
        """Begin watching (every rank, once the default process group exists).

        ``local_ranks``: ranks expected on this host, whose pids are checked directly once they
        are confirmed to share this host and pid namespace.
        """
        global _generation
        if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        if self._active:
            self._end_session()  # a failure the user caught: this is a new Trainer call
        _generation += 1
        self.rank, self.world_size = rank, world_size
        # The attempt every rank agreed on (torchrun: nodes may hold different restart counts in one attempt).
        run = elastic.attempt_key()
        ticks = _start_ticks(os.getpid())
        me = _ProcessInfo(socket.gethostname(), _machine_key(), os.getpid(), ticks if ticks is not None else -1)
        self._stopping.clear()
        # Under torchrun the store lives in the agent; otherwise rank 0's process serves it.
        store_host_rank = None if elastic.uses_agent_store() else 0
        board: Optional[FailureBoard] = None
        peers: Optional[PeerLiveness] = None
        try:
            board = FailureBoard.connect(
                f"hp_lightning/watchdog/{run}/{_generation}", me, rank=rank, world_size=world_size,
                deadline=self.heartbeat_timeout, store_host_rank=store_host_rank,
            )
            peers = PeerLiveness(board, me, local_ranks=local_ranks, heartbeat_timeout=self.heartbeat_timeout)
            peers.meet_local_peers()
        except Exception as exc:  # noqa: BLE001 - training goes on without the watchdog, loudly
            if peers is not None:
                peers.close()
            if board is not None:
                board.close()
            self._board = self._departure = self._causes = self._poller = None
            _say(f"rank {rank}: fault watchdog not started ({type(exc).__name__}: {exc}); a failed rank may leave the others waiting.")
            return
        departure = Departure(
            board, peers, me, exit_grace=self.exit_grace, poll_interval=self.poll_interval, exit_lock=self._exit_lock,
            at_exit=self._mark_exited,
        )
        self._board, self._departure = board, departure
        self._causes = CauseFinder(board, peers, departure, me, poll_interval=self.poll_interval)
        self._poller = Poller(board, peers, self._main_thread, departure, poll_interval=self.poll_interval, stopping=self._stopping)
        self._active = True
        self._poller.start()

    def stop(self) -> None:
        """End watching after a normal finish (after a failure the thread stays, to end a lingering process)."""
        if not self._active or (self._departure is not None and self._departure.failed_at is not None):
            return
        try:
            assert self._board is not None
            self._board.leave()
        except Exception:  # noqa: BLE001 - the store may be gone at the very end of a job
            pass
        self._end_session()

    def _end_session(self) -> None:
        self._active = False
        self._stopping.set()
        if self._poller is not None:
            self._poller.join(timeout=5 * self.poll_interval + 1)
        if self._board is not None:
            self._board.close()
        self._poller = None

    def _mark_exited(self) -> None:
        """At interpreter exit, once this rank failed: ignore SIGTERM again, stop polling, leave the exit marker.

        Registered with ``atexit`` by the failing session; the marker goes to the session running at exit.
        """
        _quiet_signals()
        self._stopping.set()
        if self._departure is not None:
            self._departure.leave_exit_marker()

    def report(self, exc: BaseException) -> None:
        """From ``Strategy.on_exception``: post this rank's own error, or find the cause of a lost-peer one (:class:`~.causes.CauseFinder`).

        SIGTERM is ignored from here on: torchrun sends it to every worker once one has exited, and
        Lightning's handler would answer it with a collective.
        """
        if not self._active:
            return
        try:
            assert self._causes is not None
            self._causes.report(exc)
        except Exception as internal:  # noqa: BLE001 - never hide the user's exception behind ours
            _say(f"rank {self.rank}: fault watchdog could not report the failure ({internal!r}).")

    def report_uncaught_errors(self) -> None:
        """Report an error that ends the main thread uncaught *before* its traceback is printed.

        For loops with no exception hook of their own (Fabric): the rank's own error is posted at
        once, so a peer waiting in a collective is stopped with one line naming it instead of a
        traceback of its own. Reporting at interpreter exit instead (after the traceback, after
        non-daemon threads) would leave the peers to race the failed rank's sockets closing. Installed once.
        """
        if getattr(sys.excepthook, "__hp_lightning_watchdog__", None) is self:
            return
        previous = sys.excepthook
        reporting = False

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            nonlocal reporting
            if reporting or not isinstance(value, Exception):
                previous(kind, value, tb)
                return
            reporting = True
            try:
                self.report(value)  # a consequence of a peer's failure does not return (one line, exit 3)
                current = sys.excepthook  # report may have put a one-line hook for a duplicate error first
                (current if current is not hook else previous)(kind, value, tb)
            finally:
                reporting = False

        hook.__hp_lightning_watchdog__ = self  # type: ignore[attr-defined]
        sys.excepthook = hook
