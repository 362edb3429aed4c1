"""Finding a lost rank that cannot report itself: a dead pid, a silent heartbeat, a main thread that stopped moving.

Two ways to see a peer, with different reach: a rank on this host and in this pid namespace is
checked directly (``/proc``: found dead within a poll, even before its sockets close); any other
rank only by its heartbeat, so a frozen or unreachable one takes ``heartbeat_timeout`` to find.
Each rank watches one neighbour's heartbeat (the ring skips ranks that finished), which keeps the
store load at one read per rank per poll however large the job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Optional

from hp_lightning.core.watchdog.failure_board import _FINE_POLL, FailureBoard
from hp_lightning.core.watchdog.processes import _describe_stack, _inside_torch, _is_running, _open_exit_fd
from hp_lightning.core.watchdog.reports import _GONE, FailureReport, _ProcessInfo


class PeerLiveness:
    """Which peers are still alive: local ones by their pid, the ring neighbour by its heartbeat.

    ``local_ranks``: ranks expected on this host; a rank's pid is checked only once its record
    shows the same host, boot and pid namespace as ``me``.
    """

    def __init__(self, board: FailureBoard, me: _ProcessInfo, *, local_ranks: Iterable[int], heartbeat_timeout: float) -> None:
        self._board = board
        self._me = me
        self.rank, self.world_size = board.rank, board.world_size
        self._heartbeat_timeout = heartbeat_timeout
        self._candidates = [r for r in local_ranks if r != self.rank and 0 <= r < self.world_size]
        #: Ranks confirmed on this host and pid namespace, with their process.
        self.local: dict[int, _ProcessInfo] = {}
        #: A pidfd per local rank still running (see :meth:`exits_signalled`).
        self._exit_fds: dict[int, int] = {}
        self._watched: Optional[int] = (self.rank + 1) % self.world_size
        self._watched_beat = (-1, time.monotonic())

    def meet_local_peers(self) -> None:
        """At the start: a short wait for the local ranks' records (every rank is right after the rendezvous), then learn them."""
        if self._candidates and self._me.machine:
            self._board.wait_for_processes(self._candidates, seconds=10)
        self.learn_local_peers()

    def learn_local_peers(self) -> None:
        """Read the records of local candidates that have posted theirs since the last poll."""
        if not self._candidates or not self._me.machine:
            return
        for rank in list(self._candidates):
            info = self._board.process_of(rank)
            if info is not None:
                self._candidates.remove(rank)
                if info.machine == self._me.machine:
                    self.local[rank] = info
                    fd = _open_exit_fd(info)
                    if fd is not None:
                        self._exit_fds[rank] = fd

    def exits_signalled(self) -> bool:
        """Whether every local peer's end wakes a wait on :meth:`exit_fds` (else its pid is polled)."""
        return len(self._exit_fds) == len(self.local)

    def exit_fds(self) -> list[int]:
        return list(self._exit_fds.values())

    def forget_exit_fds(self, fds: Iterable[int]) -> None:
        """Close pidfds that turned readable: their processes ended, and they would stay readable."""
        ended = set(fds)
        for rank, fd in list(self._exit_fds.items()):
            if fd in ended:
                self._close_exit_fd(rank)

    def _close_exit_fd(self, rank: int) -> None:
        # The poller and the main thread (a failure's cause search) may both get here for one rank.
        fd = self._exit_fds.pop(rank, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every pidfd (the session ended)."""
        for rank in list(self._exit_fds):
            self._close_exit_fd(rank)

    def find_dead_local_peer(self) -> Optional[FailureReport]:
        """A local peer whose process ended without finishing normally, as a ``"gone"`` report."""
        for rank, info in sorted(self.local.items()):
            if _is_running(info):
                continue
            if self._board.has_left(rank):
                self.local.pop(rank, None)  # finished normally
                self._close_exit_fd(rank)
                continue
            return FailureReport(rank, "gone", _GONE, info.host, info.pid, self.rank, time.time())
        return None

    def first_dead_local_peer(self) -> Optional[tuple[int, _ProcessInfo]]:
        """A local peer whose process has ended, asking nothing of the store (which may be gone)."""
        return next(((rank, info) for rank, info in sorted(self.local.items()) if not _is_running(info)), None)

    def await_local_death(self, seconds: float) -> None:
        """Up to ``seconds`` for a local peer to show as ended (a killed process closes its sockets first)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and all(_is_running(info) for info in self.local.values()):
            time.sleep(_FINE_POLL / 2)

    def find_silent_neighbour(self) -> Optional[FailureReport]:
        """The next rank in the ring (skipping ranks that finished) if its heartbeat stopped."""
        watched, now = self._watched, time.monotonic()
        if watched is None:
            return None  # every other rank has finished
        if self._board.has_left(watched):
            following = (watched + 1) % self.world_size
            self._watched = None if following == self.rank else following
            self._watched_beat = (-1, now)
            return None
        beat = self._board.beats_of(watched)
        last_beat, since = self._watched_beat
        if beat != last_beat:
            self._watched_beat = (beat, now)
            return None
        if now - since < self._heartbeat_timeout:
            return None
        info = self.local.get(watched)
        summary = f"stopped responding: no heartbeat for {now - since:.0f} s (frozen, deadlocked, or its host is down)"
        if info is not None and _is_running(info):
            # A frozen process on this host would outlive the job (a SIGTERM waits while it is stopped).
            try:
                os.kill(info.pid, signal.SIGKILL)
                summary += "; hp_lightning ended it with SIGKILL"
            except OSError:
                pass
        host, pid = (info.host, info.pid) if info is not None else ("?", -1)
        return FailureReport(watched, "silent", summary, host, pid, self.rank, time.time())

    def store_host(self) -> Optional[_ProcessInfo]:
        """The process serving the job's store, when it runs on this host."""
        host_rank = self._board.store_host_rank
        return self.local.get(host_rank) if host_rank is not None else None

    def store_host_gone(self) -> Optional[_ProcessInfo]:
        """The store's process, if it runs on this host and has ended (then every store call would fail)."""
        info = self.store_host()
        return info if info is not None and not _is_running(info) else None

    def end_frozen_store_host(self) -> str:
        """SIGKILL the store's process when it runs on this host: a stopped process would outlive the job."""
        info = self.store_host()
        if info is None or not _is_running(info):
            return ""
        try:
            os.kill(info.pid, signal.SIGKILL)
        except OSError:
            return ""
        return f" (rank {self._board.store_host_rank}, pid {info.pid} on this host: hp_lightning ended it with SIGKILL)"


#: How many :func:`waiting_on_purpose` blocks the main thread is in (their waits are not hangs).
_waits_on_purpose = 0


@contextmanager
def waiting_on_purpose() -> Iterator[None]:
    """Mark a long wait of the main thread that has its own deadline (a lighthouse restarting, say) as no hang.

    :class:`MainThreadMonitor` takes a main thread that sits on one line outside torch for
    ``heartbeat_timeout`` for a deadlock; a polling wait with a deadline of its own may sit there
    longer, and its own timeout, with a message naming what it waited for, is the better report.
    """
    global _waits_on_purpose
    _waits_on_purpose += 1
    try:
        yield
    finally:
        _waits_on_purpose -= 1


class MainThreadMonitor:
    """Whether this rank's own main thread has stopped moving, outside torch (a deadlock of its own).

    A rank blocked in a collective waits inside torch (``torch/distributed``, the autograd engine)
    for a peer: that is the peer's problem, and the peer reports itself. A main thread that sits on
    one bytecode of code outside torch for ``heartbeat_timeout`` seconds (a lock two threads take
    in opposite order, a ``queue.get`` nobody feeds) is this rank's own hang. Sampled once a poll,
    so a main thread that moves between polls is never mistaken for a stuck one.
    """

    def __init__(self, heartbeat_timeout: float) -> None:
        self._heartbeat_timeout = heartbeat_timeout
        #: Where the main thread was at the last poll, and since when.
        self._where: tuple[int, int, int] = (0, -1, 0)
        self._since = time.monotonic()

    def stuck(self) -> Optional[str]:
        """The main thread's stack if it has not moved for ``heartbeat_timeout`` s, outside torch (else None)."""
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if frame is None:
            return None
        where = (id(frame.f_code), frame.f_lasti, id(frame))
        now = time.monotonic()
        if where != self._where or _waits_on_purpose:
            self._where, self._since = where, now
            return None
        if now - self._since < self._heartbeat_timeout or _inside_torch(frame):
            return None
        return _describe_stack(frame)

    def seconds_still(self) -> float:
        """How long the main thread has been where it was last seen."""
        return time.monotonic() - self._since
