"""What an error raised on this rank means: a cause of its own (posted), or the consequence of a peer's failure.

A rank that loses a peer sees only ``Connection closed by peer``; printing that traceback would
hide the cause. So a communication error is answered with the cause: a failure another rank
posted, a dead peer on this host, a failure posted within a few polls, or, when nothing else
turns up, the error itself.
"""

from __future__ import annotations

import time
from typing import Optional

from hp_lightning.core.watchdog.departure import Departure
from hp_lightning.core.watchdog.exits import _one_line_if_uncaught, _quiet_signals
from hp_lightning.core.watchdog.failure_board import _FINE_POLL, FailureBoard
from hp_lightning.core.watchdog.liveness import PeerLiveness
from hp_lightning.core.watchdog.processes import _StoreUnreachable
from hp_lightning.core.watchdog.reports import _GONE, FailureReport, _first_line, _ProcessInfo, _second_after, is_communication_error


class CauseFinder:
    """The main thread's side of the watchdog: report this rank's error, or find and name its cause.

    ``poll_interval`` is the watchdog's poll: a consequence waits a few polls for a peer's post.
    """

    def __init__(self, board: FailureBoard, peers: PeerLiveness, departure: Departure, me: _ProcessInfo, *, poll_interval: float) -> None:
        self._board, self._peers, self._departure, self._me = board, peers, departure, me
        self.rank = board.rank
        self._poll_interval = poll_interval

    def report(self, exc: BaseException) -> None:
        """Post ``exc`` if it is this rank's own; else stop this rank with one line naming the cause (does not return)."""
        _quiet_signals()
        if not is_communication_error(exc):
            self._fail_on_own_error(exc)
            return
        # A peer killed a moment ago closes its sockets before its process shows as ended: look
        # again before asking a store that may have died with it.
        self._peers.await_local_death(0.5)
        try:
            if self._board.lost or self._peers.store_host_gone() is not None:
                raise _StoreUnreachable(RuntimeError("the store's process has ended"))
            posted = self._wait_for_post(max(3 * self._poll_interval, 2.0))
            if posted is None:
                posted = self._board.post(self._report_for(exc))
        except _StoreUnreachable:
            self._on_store_lost(exc)
            return
        if posted.rank == self.rank:
            self._departure.mark_failed(exc)  # the best cause known
        elif isinstance(exc, Exception):
            self._departure.stop_for(posted)

    def _fail_on_own_error(self, exc: BaseException) -> None:
        mine = self._report_for(exc)
        try:
            standing = mine if self._board.lost else self._board.post(mine)
        except _StoreUnreachable:
            standing = mine
        if standing.rank != self.rank and standing.summary == mine.summary:
            # The same error, raised on every rank together: rank `standing.rank` speaks for all.
            _one_line_if_uncaught(
                exc,
                f"rank {self.rank}: exiting with the same error as rank {standing.rank}, which reported it first: "
                f"{standing.summary} (traceback in rank {standing.rank}'s output).",
            )
            self._departure.mark_failed(exc, not_before=_second_after(standing))
        else:
            self._departure.mark_failed(exc)

    def _report_for(self, exc: BaseException) -> FailureReport:
        summary = f"{type(exc).__name__}: {_first_line(str(exc))}".rstrip(": ")
        return FailureReport(self.rank, "error", summary, self._me.host, self._me.pid, self.rank, time.time())

    def _wait_for_post(self, seconds: float) -> Optional[FailureReport]:
        """Up to ``seconds``: a failure another rank posts, or a peer on this host found dead (then posted)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            posted = self._board.read()
            if posted is not None:
                return posted
            lost = self._peers.find_dead_local_peer()
            if lost is not None:
                return self._board.post(lost)
            time.sleep(_FINE_POLL)
        return None

    def _on_store_lost(self, exc: BaseException) -> None:
        """No store: the failure read before it went, else a dead peer on this host, else the store's host."""
        known = self._board.known
        if known is not None and known.rank != self.rank:
            self._departure.stop_for(known)
        dead = self._peers.first_dead_local_peer()
        if dead is not None:
            rank, info = dead
            self._departure.exit_peer_failed(f"rank {rank} (pid {info.pid} on {info.host}) {_GONE}")
        self._departure.exit_peer_failed(
            "the job's store stopped answering (it lives in rank 0's launcher or torchrun's agent), "
            f"so that process has probably failed; this rank's last error was {type(exc).__name__}: {_first_line(str(exc))}"
        )
