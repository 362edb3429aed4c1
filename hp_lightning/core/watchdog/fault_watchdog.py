"""The watchdog thread of one rank and its decisions: report, detect, stop (see the package docstring).

A failing rank posts the first report (compare-and-set on the job's store); the others read it
at their next poll, wait for the failed rank's traceback, print one line and exit. A rank that
ends without posting is found by its local peers (a dead pid) or by its heartbeat.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from hp_lightning.core.watchdog.exits import _one_line_if_uncaught, _quiet_signals, _record_for_torchrun, _say
from hp_lightning.core.watchdog.processes import _connect_store, _describe_stack, _inside_torch, _is_running, _machine_key, _start_ticks, _StoreUnreachable
from hp_lightning.core.watchdog.reports import (
    _GONE,
    FAILED_EXIT_CODE,
    PEER_FAILED_EXIT_CODE,
    FailureReport,
    MainThreadStuck,
    StoppedForPeerFailure,
    _first_line,
    _ProcessInfo,
    _second_after,
    check_seconds,
    is_communication_error,
)

#: How often a rank checks on a peer it is waiting for (seconds).
_FINE_POLL = 0.1


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
            outside torch) before a rank is declared lost. The heartbeat has its own thread, so
            long steps do not trip it; dead processes on the same host are found at once.
        exit_grace: seconds the other ranks wait, at most, for the failed rank's traceback; and
            how long a failed process may linger before it is ended (:data:`FAILED_EXIT_CODE`).
        poll_interval: seconds between checks. None → ``min(1, heartbeat_timeout / 10)``.

    Raises:
        TypeError / ValueError: for a setting that is not a positive, finite number of seconds.
    """

    def __init__(
        self, *, heartbeat_timeout: float = 120.0, exit_grace: float = 30.0, poll_interval: Optional[float] = None
    ) -> None:
        self.heartbeat_timeout = check_seconds(heartbeat_timeout, "heartbeat_timeout")
        self.exit_grace = check_seconds(exit_grace, "exit_grace")
        self.poll_interval = (
            min(1.0, self.heartbeat_timeout / 10) if poll_interval is None else check_seconds(poll_interval, "poll_interval")
        )
        self.rank = 0
        self.world_size = 1
        self._store: Optional[dist.Store] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._exit_lock = threading.RLock()
        self._me: Optional[_ProcessInfo] = None
        self._local_candidates: list[int] = []
        self._local: dict[int, _ProcessInfo] = {}
        self._watched: Optional[int] = None
        self._watched_beat = (-1, 0.0)
        #: When this rank raised an error of its own (None: it has not).
        self._failed_at: Optional[float] = None
        #: When the main thread was first seen finished after that failure.
        self._main_done_at: Optional[float] = None
        #: The posted failure, once this rank has read it (kept for when the store is gone).
        self._known: Optional[FailureReport] = None
        self._store_lost = False
        self._store_host_rank: Optional[int] = 0
        self._active = False
        #: Where the main thread was at the last poll, and since when (see _main_thread_stuck).
        self._main_where: tuple[int, int, int] = (0, -1, 0)
        self._main_since = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

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
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        ticks = _start_ticks(os.getpid())
        self._me = _ProcessInfo(socket.gethostname(), _machine_key(), os.getpid(), ticks if ticks is not None else -1)
        self._local_candidates = [r for r in local_ranks if r != rank and 0 <= r < world_size]
        self._local.clear()
        self._watched, self._watched_beat = (rank + 1) % world_size, (-1, time.monotonic())
        self._failed_at = self._main_done_at = None
        self._known = None
        self._store_lost = False
        self._stopping.clear()
        # Under torchrun the store lives in the agent; otherwise rank 0's process serves it.
        self._store_host_rank = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        try:
            store = dist.PrefixStore(f"hp_lightning/watchdog/{run}/{_generation}", _connect_store(self.heartbeat_timeout))
            store.set(f"proc/{rank}", self._me.to_wire())
            store.add(f"hb/{rank}", 1)
            self._store = store
            if self._local_candidates and self._me.machine:
                # Every rank gets here right after the process group's rendezvous: a short wait.
                # A rank not here by then is learned at a later poll.
                try:
                    store.wait([f"proc/{r}" for r in self._local_candidates], timedelta(seconds=10))
                except dist.DistStoreError:
                    pass
            self._learn_local_peers()
        except Exception as exc:  # noqa: BLE001 - training goes on without the watchdog, loudly
            self._store = None
            _say(f"rank {rank}: fault watchdog not started ({type(exc).__name__}: {exc}); a failed rank may leave the others waiting.")
            return
        self._active = True
        self._thread = threading.Thread(target=self._run, name="hp_lightning-fault-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End watching after a normal finish (after a failure the thread stays, to end a lingering process)."""
        if not self._active or self._failed_at is not None:
            return
        try:
            assert self._store is not None
            self._store.set(f"left/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store may be gone at the very end of a job
            pass
        self._end_session()

    def _end_session(self) -> None:
        self._active = False
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_interval + 1)
        self._thread = None

    # ------------------------------------------------------------------ reporting (main thread)

    def report(self, exc: BaseException) -> None:
        """From ``Strategy.on_exception``: post this rank's own error, or find the cause of a lost-peer one.

        The cause of a communication error is a failure another rank posted, a dead peer on this
        host or, after a few polls, the error itself; a rank stopped for another's failure prints
        one line and exits. SIGTERM is ignored from here on: torchrun sends it to every worker once
        one has exited, and Lightning's handler would answer it with a collective.
        """
        if not self._active:
            return
        try:
            self._report(exc)
        except Exception as internal:  # noqa: BLE001 - never hide the user's exception behind ours
            _say(f"rank {self.rank}: fault watchdog could not report the failure ({internal!r}).")

    def report_uncaught_errors(self) -> None:
        """Report an error that ends the main thread uncaught *before* its traceback is printed.

        For loops with no exception hook of their own (Fabric): the rank's own error is posted at
        once, so a peer waiting in a collective is stopped with one line naming it, and the peer's
        "Connection closed by peer" error is answered by that line instead of a traceback of its
        own. Reporting at interpreter exit instead (after the traceback, after non-daemon threads)
        would leave the peers to race the failed rank's sockets closing. Installed once.
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

    def _report(self, exc: BaseException) -> None:
        _quiet_signals()
        if not is_communication_error(exc):
            self._fail_on_own_error(exc)
            return
        # A peer killed a moment ago closes its sockets before its process shows as ended: look
        # again before asking a store that may have died with it.
        self._await_local_death(0.5)
        try:
            if self._store_lost or self._store_host_gone() is not None:
                raise _StoreUnreachable(RuntimeError("the store's process has ended"))
            posted = self._read_failure()
            if posted is None:
                lost = self._find_dead_local_peer()
                posted = self._post(lost) if lost is not None else self._wait_for_post(max(3 * self.poll_interval, 2.0))
            if posted is None:
                posted = self._post(self._report_for(exc))
        except _StoreUnreachable:
            self._on_store_lost_in_report(exc)
            return
        if posted.rank == self.rank:
            self._mark_failed(exc)  # the best cause known
        elif isinstance(exc, Exception):
            self._stop_for(posted)

    def _fail_on_own_error(self, exc: BaseException) -> None:
        mine = self._report_for(exc)
        try:
            standing = mine if self._store_lost else self._post(mine)
        except _StoreUnreachable:
            standing = mine
        if standing.rank != self.rank and standing.summary == mine.summary:
            # The same error, raised on every rank together: rank `standing.rank` speaks for all.
            _one_line_if_uncaught(
                exc,
                f"rank {self.rank}: exiting with the same error as rank {standing.rank}, which reported it first: "
                f"{standing.summary} (traceback in rank {standing.rank}'s output).",
            )
            self._mark_failed(exc, not_before=_second_after(standing))
        else:
            self._mark_failed(exc)

    def _report_for(self, exc: BaseException) -> FailureReport:
        assert self._me is not None
        summary = f"{type(exc).__name__}: {_first_line(str(exc))}".rstrip(": ")
        return FailureReport(self.rank, "error", summary, self._me.host, self._me.pid, self.rank, time.time())

    def _mark_failed(self, error: BaseException, not_before: float = 0.0) -> None:
        """This rank failed: leave a record for torchrun's summary and an exit marker for the waiting ranks."""
        if self._failed_at is not None:
            return
        self._failed_at = time.monotonic()
        _record_for_torchrun(error, not_before)
        atexit.register(self._mark_exited)

    def _mark_exited(self) -> None:
        """At exit, after the traceback: tell the waiting ranks, ignore SIGTERM again, stop polling."""
        _quiet_signals()
        self._stopping.set()
        try:
            assert self._store is not None
            self._store.set(f"exited/{self.rank}", "1")
            if self._store_host_rank == self.rank:
                self._hold_store_until_read()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass

    def _hold_store_until_read(self) -> None:
        """The job's store lives in this process: keep it up until every other rank has read the failure.

        A rank that fails within a poll interval of the start would otherwise take the store down
        before the others looked, and they could only say that it is gone, not why. They read it
        at their next poll, so the wait is bounded by a few polls (a frozen peer does not hold it).
        """
        assert self._store is not None
        deadline = time.monotonic() + min(self.exit_grace, 3 * self.poll_interval + 1)
        while time.monotonic() < deadline and int(self._store.add("read the failure", 0)) < self.world_size - 1:
            time.sleep(_FINE_POLL)

    def _on_store_lost_in_report(self, exc: BaseException) -> None:
        """No store: the failure read before it went, else a dead peer on this host, else the store's host."""
        if self._known is not None and self._known.rank != self.rank:
            self._stop_for(self._known)
        for rank, info in sorted(self._local.items()):
            if not _is_running(info):
                self._exit_peer_failed(f"rank {rank} (pid {info.pid} on {info.host}) {_GONE}")
        self._exit_peer_failed(
            "the job's store stopped answering (it lives in rank 0's launcher or torchrun's agent), "
            f"so that process has probably failed; this rank's last error was {type(exc).__name__}: {_first_line(str(exc))}"
        )

    # ------------------------------------------------------------------ the watchdog thread

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_interval):
            try:
                self._tick()
            except _StoreUnreachable as unreachable:
                if unreachable.timed_out and self._failed_at is None:
                    ended = self._end_frozen_store_host()
                    self._exit_peer_failed(
                        f"the job's store at {self._store_address()} stopped answering for "
                        f"{self.heartbeat_timeout:g} s: the process hosting it (rank 0's launcher or torchrun's agent) "
                        f"is frozen or its host is down{ended}"
                    )
                # Refused or dropped: the store's process has ended, at a normal finish too. Only the
                # main thread, when it fails, can tell which (see report()); stop polling.
                self._store_lost = True
                if self._failed_at is None:
                    return
            except Exception as unexpected:  # noqa: BLE001 - a watchdog bug must never end training
                _say(f"rank {self.rank}: fault watchdog stopped after an internal error: {unexpected!r}")
                return

    def _store_host(self) -> Optional[_ProcessInfo]:
        """The process serving the job's store, when it runs on this host."""
        return self._local.get(self._store_host_rank) if self._store_host_rank is not None else None

    def _end_frozen_store_host(self) -> str:
        """SIGKILL the store's process when it runs on this host: a stopped process would outlive the job."""
        info = self._store_host()
        if info is None or not _is_running(info):
            return ""
        try:
            os.kill(info.pid, signal.SIGKILL)
        except OSError:
            return ""
        return f" (rank {self._store_host_rank}, pid {info.pid} on this host: hp_lightning ended it with SIGKILL)"

    def _store_host_gone(self) -> Optional[_ProcessInfo]:
        """The store's process, if it runs on this host and has ended (then every store call would fail)."""
        info = self._store_host()
        return info if info is not None and not _is_running(info) else None

    def _tick(self) -> None:
        if self._failed_at is not None:
            self._end_if_lingering()
            return
        stuck = self._main_thread_stuck()
        if stuck is not None:
            self._fail_stuck(stuck)
            return
        if self._known is not None and self._known.rank != self.rank:
            self._stop_for(self._known)  # known already (the main thread may be waiting): no more store calls
        if self._store_host_gone() is not None:
            # At a normal finish too: only the main thread, if it fails, can tell (see report()).
            raise _StoreUnreachable(RuntimeError("the store's process has ended"))
        self._store_op(lambda s: s.add(f"hb/{self.rank}", 1))
        posted = self._read_failure()
        if posted is not None and posted.rank != self.rank:
            self._stop_for(posted)
            return
        self._learn_local_peers()
        lost = self._find_dead_local_peer() or self._find_silent_neighbour()
        if lost is not None:
            self._stop_for(self._post(lost))

    def _end_if_lingering(self) -> None:
        """End a failed process that outlives its failure by ``exit_grace``.

        Either other threads keep it alive after its main thread finished, or the user caught
        the error and carries on although the other ranks were stopped for it.
        """
        now = time.monotonic()
        if threading.main_thread().is_alive():
            assert self._failed_at is not None
            if now - self._failed_at < self.exit_grace or not self._peers_stopped():
                return  # still reporting, or the user caught an error every rank raised together
            if now - self._failed_at < 2 * self.exit_grace and not self._peers_left():
                return  # the stopped ranks go first: their one line is printed before this process ends
            why = (
                f"this rank failed and the other ranks were stopped for it, but its main thread was still running "
                f"{self.exit_grace:g} s later (the error was caught?)"
            )
        else:
            self._main_done_at = self._main_done_at or now
            if now - self._main_done_at < self.exit_grace:
                return
            others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
            alive = f" (threads still running: {others})" if others else ""
            why = f"this rank failed, and its process was still running {self.exit_grace:g} s after its main thread ended{alive}"
        _say(f"rank {self.rank}: {why}; ending it (exit code {FAILED_EXIT_CODE}) so that no rank is left behind.")
        os._exit(FAILED_EXIT_CODE)

    # ------------------------------------------------------------------ detection

    def _learn_local_peers(self) -> None:
        if not self._local_candidates or self._me is None or not self._me.machine:
            return
        for rank in list(self._local_candidates):
            key = f"proc/{rank}"
            if self._store_op(lambda s, key=key: s.check([key])):
                info = _ProcessInfo.from_wire(self._store_op(lambda s, key=key: s.get(key)))
                self._local_candidates.remove(rank)
                if info.machine == self._me.machine:
                    self._local[rank] = info

    def _has_left(self, rank: int) -> bool:
        return bool(self._store_op(lambda s: s.check([f"left/{rank}"])))

    def _find_dead_local_peer(self) -> Optional[FailureReport]:
        for rank, info in sorted(self._local.items()):
            if _is_running(info):
                continue
            if self._has_left(rank):
                del self._local[rank]  # finished normally
                continue
            return FailureReport(rank, "gone", _GONE, info.host, info.pid, self.rank, time.time())
        return None

    def _find_silent_neighbour(self) -> Optional[FailureReport]:
        """The next rank in the ring (skipping ranks that finished) if its heartbeat stopped."""
        watched, now = self._watched, time.monotonic()
        if watched is None:
            return None  # every other rank has finished
        if self._has_left(watched):
            following = (watched + 1) % self.world_size
            self._watched = None if following == self.rank else following
            self._watched_beat = (-1, now)
            return None
        beat = int(self._store_op(lambda s: s.add(f"hb/{watched}", 0)))
        last_beat, since = self._watched_beat
        if beat != last_beat:
            self._watched_beat = (beat, now)
            return None
        if now - since < self.heartbeat_timeout:
            return None
        info = self._local.get(watched)
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

    # ------------------------------------------------------------------ store

    def _store_address(self) -> str:
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"

    def _store_op(self, op: Any) -> Any:
        """Run ``op(store)`` with a deadline of ``heartbeat_timeout``.

        A TCPStore client waits without end for a server process that is frozen (SIGSTOP, a
        hung host) while its socket stays open; so each call runs on a short-lived daemon thread
        and a call past the deadline counts as the store having stopped answering.
        """
        store = self._store
        if store is None:
            raise _StoreUnreachable(RuntimeError("the watchdog has no store connection"))
        outcome: list[Any] = []
        done = threading.Event()

        def call() -> None:
            try:
                outcome.append(("ok", op(store)))
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                outcome.append(("error", exc))
            done.set()

        threading.Thread(target=call, name="hp_lightning-store-call", daemon=True).start()
        if not done.wait(self.heartbeat_timeout):
            raise _StoreUnreachable(TimeoutError(f"the store call timed out after {self.heartbeat_timeout:g} s"))
        kind, value = outcome[0]
        if kind == "error":
            if isinstance(value, (RuntimeError, OSError, ValueError)):
                raise _StoreUnreachable(value) from value
            raise value
        return value

    def _read_failure(self) -> Optional[FailureReport]:
        if self._known is not None:
            return self._known
        if self._store_lost or not self._store_op(lambda s: s.check(["failure"])):
            return None
        return self._learn(FailureReport.from_wire(self._store_op(lambda s: s.get("failure"))))

    def _post(self, report: FailureReport) -> FailureReport:
        """Post ``report`` unless a failure is already posted; return the one that stands."""
        wire = report.to_wire()
        return self._learn(FailureReport.from_wire(self._store_op(lambda s: s.compare_set("failure", "", wire))))

    def _learn(self, standing: FailureReport) -> FailureReport:
        """Keep the failure that stands; tell the failed rank that this rank knows of it (see :meth:`_mark_exited`)."""
        if self._known is None and standing.rank != self.rank:
            self._store_op(lambda s: s.add("read the failure", 1))
        self._known = standing
        return standing

    def _await_local_death(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and all(_is_running(info) for info in self._local.values()):
            time.sleep(_FINE_POLL / 2)

    def _wait_for_post(self, seconds: float) -> Optional[FailureReport]:
        """Up to ``seconds``: a failure another rank posts, or a peer on this host found dead (then posted)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            posted = self._read_failure()
            if posted is not None:
                return posted
            lost = self._find_dead_local_peer()
            if lost is not None:
                return self._post(lost)
            time.sleep(_FINE_POLL)
        return None

    # ------------------------------------------------------------------ exiting

    def _stop_for(self, failure: FailureReport) -> None:
        """Leave with one line naming ``failure`` (returns only if this rank fails on its own meanwhile).

        First wait, at most ``exit_grace`` seconds, for the failed rank's exit marker (set from
        ``atexit``: after its traceback, before its sockets close). Leaving earlier would give the
        shell its prompt back before the cause is printed, or have torchrun's agent SIGTERM the
        failed rank mid-report; leaving later, this rank's own collective fails first.
        """
        with self._exit_lock:
            # Tell a failed rank that lingers (its error caught) that the others are leaving for it;
            # now, while the store is surely up (it may live in the failed rank's process).
            try:
                self._store_op(lambda s: s.add("stopped", 1))
            except _StoreUnreachable:
                pass
            if failure.kind == "error" and not self._wait_for_end_of(failure.rank):
                return
            cause = failure.describe()
            _record_for_torchrun(StoppedForPeerFailure(f"rank {self.rank}: stopped because {cause}"), _second_after(failure))
            if not self._store_lost and self._store_host_gone() is None:  # (a call to a gone store prints a warning)
                try:
                    self._store_op(lambda s: s.add("left for the failure", 1))
                    if self._store_host_rank == self.rank:
                        # The store lives in this process: leaving takes it down, and a rank that has
                        # not read the failure yet could only name this (stopped) rank as gone.
                        self._hold_store_until_read()
                except _StoreUnreachable:
                    pass
            self._exit_peer_failed(cause)

    def _wait_for_end_of(self, rank: int) -> bool:
        """Until ``rank`` has printed its report (its exit marker), at most ``exit_grace`` seconds.

        If ``rank`` is this process's parent (rank 0 under Lightning's launcher), wait until its
        process has ended instead. That parent's child observer SIGKILLs every process, itself
        included, as soon as a child exits with an error. Returns False if this rank raised an
        error of its own meanwhile (errors raised on every rank together), so that its own
        exception runs its course instead.
        """
        deadline = time.monotonic() + self.exit_grace
        info = self._local.get(rank)
        parent = info is not None and info.pid == os.getppid()
        while time.monotonic() < deadline:
            if self._failed_at is not None:
                return False
            if info is not None and not _is_running(info):
                return True
            if not parent:
                try:
                    if self._store_op(lambda s: s.check([f"exited/{rank}"])):
                        return True
                except _StoreUnreachable:
                    self._store_lost = True
                    return True
            time.sleep(_FINE_POLL)
        return self._failed_at is None

    def _exit_peer_failed(self, cause: str) -> None:
        with self._exit_lock:  # one exit per process: the watchdog thread or the main thread
            _say(f"rank {self.rank}: stopping (exit code {PEER_FAILED_EXIT_CODE}) because {cause}.")
            os._exit(PEER_FAILED_EXIT_CODE)

    def _peers_left(self) -> bool:
        """Every other rank has left for this rank's failure (or the store went with them)."""
        try:
            return int(self._store_op(lambda s: s.add("left for the failure", 0))) >= self.world_size - 1
        except _StoreUnreachable:
            return True

    def _peers_stopped(self) -> bool:
        try:
            return int(self._store_op(lambda s: s.add("stopped", 0))) > 0
        except _StoreUnreachable:
            return True  # the store went with the other ranks

    # ------------------------------------------------------------------ a main thread that stopped moving

    def _main_thread_stuck(self) -> Optional[str]:
        """Where the main thread has been for ``heartbeat_timeout`` s without moving, outside torch (else None).

        A rank blocked in a collective waits inside torch (``torch/distributed``, the autograd
        engine) for a peer: that is the peer's problem, and the peer reports itself. A main
        thread that sits on one bytecode of code outside torch for that long (a lock two
        threads take in opposite order, a ``queue.get`` nobody feeds) is this rank's own hang.
        """
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if frame is None:
            return None
        where = (id(frame.f_code), frame.f_lasti, id(frame))
        now = time.monotonic()
        if where != self._main_where:
            self._main_where, self._main_since = where, now
            return None
        if now - self._main_since < self.heartbeat_timeout or _inside_torch(frame):
            return None
        return _describe_stack(frame)

    def _fail_stuck(self, stack: str) -> None:
        """Post this rank as the failure (its main thread cannot), print where it is stuck, end it."""
        assert self._me is not None
        seconds = time.monotonic() - self._main_since
        summary = f"deadlocked: its main thread has not moved for {seconds:.0f} s, at {stack.splitlines()[-1].strip()}"
        report = FailureReport(self.rank, "stuck", summary, self._me.host, self._me.pid, self.rank, time.time())
        try:
            self._post(report)
        except _StoreUnreachable:
            pass
        _say(f"rank {self.rank} is {summary}; ending it (exit code {FAILED_EXIT_CODE}). Main thread:\n{stack}")
        _record_for_torchrun(MainThreadStuck(f"rank {self.rank}: {summary}"))
        os._exit(FAILED_EXIT_CODE)
