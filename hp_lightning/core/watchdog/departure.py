"""When and how this rank leaves after a failure: stopped for a peer's, failed on its own, stuck, or lingering.

The timing is the point. A stopped rank waits for the failed rank's exit marker before it leaves:
leaving earlier would give the shell its prompt back before the cause is printed, or have
torchrun's agent SIGTERM the failed rank mid-report; leaving later, its own collective fails
first. A failed rank that outlives its failure (a caught error, a non-daemon thread) is ended, so
that no rank is left behind.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Callable, NoReturn, Optional

from hp_lightning.core.watchdog.exits import _record_for_torchrun, _say
from hp_lightning.core.watchdog.failure_board import _FINE_POLL, FailureBoard
from hp_lightning.core.watchdog.liveness import PeerLiveness
from hp_lightning.core.watchdog.processes import _is_running, _StoreUnreachable
from hp_lightning.core.watchdog.reports import FAILED_EXIT_CODE, PEER_FAILED_EXIT_CODE, FailureReport, MainThreadStuck, StoppedForPeerFailure, _ProcessInfo, _second_after


class Departure:
    """The exit decisions of one rank in one watchdog session; every exit goes through ``exit_lock`` (one per process).

    ``exit_grace`` and ``poll_interval`` are :class:`~.fault_watchdog.FaultWatchdog`'s; ``at_exit`` runs at
    interpreter exit once this rank failed (it calls :meth:`leave_exit_marker`).
    """

    def __init__(
        self, board: FailureBoard, peers: PeerLiveness, me: _ProcessInfo, *, exit_grace: float, poll_interval: float,
        exit_lock: threading.RLock, at_exit: Callable[[], None],
    ) -> None:
        self._board, self._peers, self._me = board, peers, me
        self.rank, self.world_size = board.rank, board.world_size
        self._exit_grace = exit_grace
        self._poll_interval = poll_interval
        self._exit_lock = exit_lock
        self._at_exit = at_exit
        #: When this rank raised an error of its own (None: it has not).
        self.failed_at: Optional[float] = None
        #: When the main thread was first seen finished after that failure.
        self._main_done_at: Optional[float] = None

    def mark_failed(self, error: BaseException, not_before: float = 0.0) -> None:
        """This rank failed: leave a record for torchrun's summary and, at exit, a marker for the waiting ranks."""
        if self.failed_at is not None:
            return
        self.failed_at = time.monotonic()
        _record_for_torchrun(error, not_before)
        atexit.register(self._at_exit)

    def leave_exit_marker(self) -> None:
        """At exit, after the traceback: tell the waiting ranks (and hold the store for them if it is this process's)."""
        try:
            self._board.mark_exited()
            self._hold_store_if_mine()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass

    def _hold_store_if_mine(self) -> None:
        """Let the others finish with the store first where this rank's exit would cut them off (each then says why it stops).

        Leaving takes the store down when it lives in this process; under torchrun's agent store the
        agent stops every other rank as soon as this one exits.
        """
        if self._board.store_host_rank in (self.rank, None):
            self._board.hold_until_left(min(self._exit_grace, 3 * self._poll_interval + 1))

    def end_if_lingering(self) -> None:
        """End a failed process that outlives its failure by ``exit_grace``.

        Either other threads keep it alive after its main thread finished, or the user caught
        the error and carries on although the other ranks were stopped for it.
        """
        now = time.monotonic()
        if threading.main_thread().is_alive():
            assert self.failed_at is not None
            if now - self.failed_at < self._exit_grace or not self._board.any_stopped():
                return  # still reporting, or the user caught an error every rank raised together
            if now - self.failed_at < 2 * self._exit_grace and not self._board.all_left_for_failure():
                return  # the stopped ranks go first: their one line is printed before this process ends
            why = (
                f"this rank failed and the other ranks were stopped for it, but its main thread was still running "
                f"{self._exit_grace:g} s later (the error was caught?)"
            )
        else:
            self._main_done_at = self._main_done_at or now
            if now - self._main_done_at < self._exit_grace:
                return
            others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
            alive = f" (threads still running: {others})" if others else ""
            why = f"this rank failed, and its process was still running {self._exit_grace:g} s after its main thread ended{alive}"
        _say(f"rank {self.rank}: {why}; ending it (exit code {FAILED_EXIT_CODE}) so that no rank is left behind.")
        os._exit(FAILED_EXIT_CODE)

    def fail_stuck(self, stack: str, seconds: float) -> NoReturn:
        """Post this rank as the failure (its main thread cannot), print where it is stuck, end it."""
        summary = f"deadlocked: its main thread has not moved for {seconds:.0f} s, at {stack.splitlines()[-1].strip()}"
        report = FailureReport(self.rank, "stuck", summary, self._me.host, self._me.pid, self.rank, time.time())
        try:
            self._board.post(report)
        except _StoreUnreachable:
            pass
        _say(f"rank {self.rank} is {summary}; ending it (exit code {FAILED_EXIT_CODE}). Main thread:\n{stack}")
        _record_for_torchrun(MainThreadStuck(f"rank {self.rank}: {summary}"))
        os._exit(FAILED_EXIT_CODE)

    def stop_for(self, failure: FailureReport) -> None:
        """Leave with one line naming ``failure`` (returns only if this rank fails on its own meanwhile).

        First wait, at most ``exit_grace`` seconds, for the failed rank's exit marker (set from
        ``atexit``: after its traceback, before its sockets close).
        """
        with self._exit_lock:
            # A failed parent process (rank 0 under Lightning's launcher) is waited for by its pid, with
            # no store call after the next ones: say so now, or it would hold its store for this rank in vain.
            waits_for_parent = failure.kind == "error" and self._is_parent(failure.rank)
            # Tell a failed rank that lingers (its error caught) that the others are leaving for it;
            # now, while the store is surely up (it may live in the failed rank's process).
            try:
                self._board.note_stopping()
                if waits_for_parent:
                    self._board.note_left_for_failure()
            except _StoreUnreachable:
                pass
            if failure.kind == "error" and not self._wait_for_end_of(failure.rank):
                # This rank raised its own error meanwhile (raised on every rank together): it is not
                # leaving for the other's failure after all. Left counted, the failed rank's session,
                # lingering where the user caught the error, would end its process.
                try:
                    self._board.withdraw_stopping(left=waits_for_parent)
                except _StoreUnreachable:
                    pass
                return
            cause = failure.describe()
            _record_for_torchrun(StoppedForPeerFailure(f"rank {self.rank}: stopped because {cause}"), _second_after(failure))
            if not waits_for_parent and not self._board.lost and self._peers.store_host_gone() is None:  # (a call to a gone store prints a warning)
                try:
                    self._board.note_left_for_failure()
                    self._hold_store_if_mine()  # else a rank still reading the failure could only name this one as gone
                except _StoreUnreachable:
                    pass
            self.exit_peer_failed(cause)

    def _wait_for_end_of(self, rank: int) -> bool:
        """Until ``rank`` has printed its report (its exit marker), at most ``exit_grace`` seconds.

        If ``rank`` is this process's parent (rank 0 under Lightning's launcher), wait until its
        process has ended instead. That parent's child observer SIGKILLs every process, itself
        included, as soon as a child exits with an error. Returns False if this rank raised an
        error of its own meanwhile (errors raised on every rank together), so that its own
        exception runs its course instead.
        """
        deadline = time.monotonic() + self._exit_grace
        info = self._peers.local.get(rank)
        parent = self._is_parent(rank)
        while time.monotonic() < deadline:
            if self.failed_at is not None:
                return False
            if info is not None and not _is_running(info):
                return True
            if not parent:
                try:
                    if self._board.has_exited(rank):
                        return True
                except _StoreUnreachable:
                    self._board.lost = True
                    return True
            time.sleep(_FINE_POLL)
        return self.failed_at is None

    def _is_parent(self, rank: int) -> bool:
        """Whether ``rank`` runs in this process's parent (rank 0 under Lightning's launcher)."""
        info = self._peers.local.get(rank)
        return info is not None and info.pid == os.getppid()

    def exit_peer_failed(self, cause: str) -> NoReturn:
        """Print one line naming ``cause`` and exit with :data:`PEER_FAILED_EXIT_CODE`."""
        with self._exit_lock:  # one exit per process: the watchdog thread or the main thread
            _say(f"rank {self.rank}: stopping (exit code {PEER_FAILED_EXIT_CODE}) because {cause}.")
            os._exit(PEER_FAILED_EXIT_CODE)
