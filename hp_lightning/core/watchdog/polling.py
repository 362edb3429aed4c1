"""The watchdog thread: once a poll, a heartbeat, a look at the posted failure and at the peers, and a decision.

One daemon thread per rank, on a store connection of its own, so it keeps polling while the main
thread waits in a collective (or is the thing that hangs). It never touches the process group.
"""

from __future__ import annotations

import threading
import time

from hp_lightning.core.watchdog.departure import Departure
from hp_lightning.core.watchdog.exits import _say
from hp_lightning.core.watchdog.failure_board import _FINE_POLL, FailureBoard
from hp_lightning.core.watchdog.liveness import MainThreadMonitor, PeerLiveness
from hp_lightning.core.watchdog.processes import StopSignal, _StoreUnreachable


class Poller:
    """Runs the polls of one watchdog session on its own thread until ``stopping`` is set or a poll ends it."""

    def __init__(
        self, board: FailureBoard, peers: PeerLiveness, main_thread: MainThreadMonitor, departure: Departure, *,
        poll_interval: float, stopping: StopSignal,
    ) -> None:
        self._board, self._peers, self._main_thread, self._departure = board, peers, main_thread, departure
        self.rank = board.rank
        self._poll_interval = poll_interval
        self._stopping = stopping
        self._thread = threading.Thread(target=self._run, name="hp_lightning-fault-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the thread to end (a no-op when called from the thread itself)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _wait_for_next_poll(self) -> bool:
        """Wait one poll interval, cut short when a local peer's process has ended; True once ``stopping`` is set.

        A dead local process is named at once, not at the next poll: under Lightning's launcher,
        rank 0's parent process SIGKILLs every rank on its own 5 s poll once a child dies, and the
        watchdog's report should come first. Where every local peer has a pidfd the wait sleeps on
        them (an exit or a stop wakes it, nothing else); otherwise, and once a peer has ended, its
        pid is read in ``/proc`` every :data:`_FINE_POLL` seconds (no store call either way). An
        exit seen on a pidfd is acted on a fine poll later: a script that ends in ``os._exit``
        without stopping the watchdog (no ``fabric.teardown()``) looks like a killed rank, and this
        rank, finishing a moment after it, would otherwise be stopped for it.
        """
        deadline = time.monotonic() + self._poll_interval
        while (left := deadline - time.monotonic()) > 0:
            if self._peers.exits_signalled():
                ended = self._stopping.wait(left, self._peers.exit_fds())
                self._peers.forget_exit_fds(ended)
                if ended:  # seen a fine poll later, as the /proc poll saw it at the latest (see below)
                    self._stopping.wait(min(_FINE_POLL, max(0.0, deadline - time.monotonic())))
            else:
                self._stopping.wait(min(_FINE_POLL, left))
            if self._stopping.is_set():
                return True
            if self._peers.first_dead_local_peer() is not None:
                return False
        return self._stopping.is_set()

    def _run(self) -> None:
        try:
            self._poll_until_stopped()
        finally:
            self._peers.close()

    def _poll_until_stopped(self) -> None:
        while not self._wait_for_next_poll():
            try:
                self._tick()
            except _StoreUnreachable as unreachable:
                if unreachable.timed_out and self._departure.failed_at is None:
                    ended = self._peers.end_frozen_store_host()
                    self._departure.exit_peer_failed(
                        f"the job's store at {self._board.address()} stopped answering for "
                        f"{self._board.deadline:g} s: the process hosting it (rank 0's launcher or torchrun's agent) "
                        f"is frozen or its host is down{ended}"
                    )
                # Refused or dropped: the store's process has ended (at a normal finish too; only the
                # main thread, when it fails, can tell which: see CauseFinder.report); stop polling.
                self._board.lost = True
                if self._departure.failed_at is None:
                    return
            except Exception as unexpected:  # noqa: BLE001 - a watchdog bug must never end training
                _say(f"rank {self.rank}: fault watchdog stopped after an internal error: {unexpected!r}")
                return

    def _tick(self) -> None:
        """One poll, in order: this rank's own failure first, then its main thread, the posted failure, the peers."""
        if self._departure.failed_at is not None:
            self._departure.end_if_lingering()
            return
        stuck = self._main_thread.stuck()
        if stuck is not None:
            self._departure.fail_stuck(stuck, self._main_thread.seconds_still())
        known = self._board.known
        if known is not None and known.rank != self.rank:
            self._departure.stop_for(known)  # known already (the main thread may be waiting): no more store calls
        if self._peers.store_host_gone() is not None:  # handled as a refused store call (see _run)
            raise _StoreUnreachable(RuntimeError("the store's process has ended"))
        self._board.beat()
        posted = self._board.read()
        if posted is not None and posted.rank != self.rank:
            self._departure.stop_for(posted)
            return
        self._peers.learn_local_peers()
        lost = self._peers.find_dead_local_peer() or self._peers.find_silent_neighbour()
        if lost is not None:
            self._departure.stop_for(self._board.post(lost))
