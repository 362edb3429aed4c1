"""The failure-report protocol on the job's store: one rank's connection, the first report, the markers ranks leave.

Keys, under a prefix of the run and the watchdog session: ``proc/<rank>`` (where a rank runs),
``hb/<rank>`` (its heartbeat counter), ``failure`` (the first :class:`FailureReport`, set once by
compare-and-set), ``stopped`` and ``left for the failure`` (ranks leaving for it; the second
counts a rank once it needs the store no more), ``exited/<rank>`` (a failed rank has printed its
traceback) and ``left/<rank>`` (a rank finished normally).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from hp_lightning.core.watchdog.processes import _connect_store, _StoreUnreachable
from hp_lightning.core.watchdog.reports import FailureReport, _ProcessInfo

#: How often a rank checks on a peer it is waiting for (seconds).
_FINE_POLL = 0.1


class _CallThread:
    """A daemon thread that runs store calls one at a time, for callers that wait with a deadline.

    A call gets its whole deadline once it runs (a slow but answering store is no failure). After a
    call overruns it the thread counts as stuck: callers waiting behind it get None as soon as it
    is declared, and the board starts a new thread for later calls.
    """

    _STOP = object()

    def __init__(self, store: dist.Store) -> None:
        self._store: Optional[dist.Store] = store
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # one call in flight: a caller's deadline covers its own call only
        self.stuck = False
        threading.Thread(target=self._serve, name="hp_lightning-store-calls", daemon=True).start()

    def run(self, call: Callable[[dist.Store], Any], deadline: float) -> Optional[tuple[str, Any]]:
        """``("ok", result)`` or ``("error", exception)``; None when no answer came within ``deadline`` s."""
        if not self._lock.acquire(timeout=deadline):
            return None
        try:
            if self.stuck:
                return None
            outcome: list[Any] = []
            done = threading.Event()
            self._calls.put((call, outcome, done))
            if done.wait(deadline):
                return outcome[0]
            self.stuck = True
            self.close()  # it ends if the hung call ever returns
            return None
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the thread once the calls queued before have run (it drops the store client)."""
        self._calls.put(self._STOP)

    def _serve(self) -> None:
        while (request := self._calls.get()) is not self._STOP:
            call, outcome, done = request
            try:
                outcome.append(("ok", call(self._store)))
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                outcome.append(("error", exc))
            done.set()
        self._store = None


class FailureBoard:
    """This rank's side of the store protocol: every store call has a deadline, the first failure stands.

    The board keeps the failure once read (:attr:`known`), so a rank that knows it needs the store
    no more, and :attr:`lost` records that the store stopped answering: from then on nothing is
    read from it, and the ranks decide from what they saw last.

    Args:
        store: a store client of the watchdog's own (see :meth:`connect`).
        deadline: seconds a store call may take before the store counts as unreachable.
        store_host_rank: the rank whose process serves the store (None: torchrun's agent does).
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, deadline: float, store_host_rank: Optional[int]) -> None:
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.deadline = deadline
        self.store_host_rank = store_host_rank
        #: The posted failure, once this rank has read it (kept for when the store is gone).
        self.known: Optional[FailureReport] = None
        #: The store refused, dropped or stopped answering a call.
        self.lost = False
        self._caller: Optional[_CallThread] = None
        self._caller_lock = threading.Lock()

    @classmethod
    def connect(
        cls, prefix: str, me: _ProcessInfo, *, rank: int, world_size: int, deadline: float, store_host_rank: Optional[int]
    ) -> FailureBoard:
        """Connect, say where this rank runs and give its first heartbeat (errors are the caller's to report)."""
        store = dist.PrefixStore(prefix, _connect_store(deadline))
        store.set(f"proc/{rank}", me.to_wire())
        store.add(f"hb/{rank}", 1)
        return cls(store, rank=rank, world_size=world_size, deadline=deadline, store_host_rank=store_host_rank)

    def address(self) -> str:
        """``host:port`` of the store, as the launcher named it."""
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"

    def op(self, call: Callable[[dist.Store], Any]) -> Any:
        """Run ``call(store)`` with a deadline of :attr:`deadline` seconds.

        A TCPStore client waits without end for a server process that is frozen (SIGSTOP, a
        hung host) while its socket stays open; so calls run on a daemon thread of their own, and a
        call past the deadline counts as the store having stopped answering (that thread is then
        abandoned to its wait, and the next call gets a new one).

        Raises:
            _StoreUnreachable: the store refused, dropped or did not answer the call in time.
        """
        with self._caller_lock:
            if self._caller is None or self._caller.stuck:
                self._caller = _CallThread(self.store)
            caller = self._caller
        outcome = caller.run(call, self.deadline)
        if outcome is None:
            raise _StoreUnreachable(TimeoutError(f"the store call timed out after {self.deadline:g} s"))
        kind, value = outcome
        if kind == "error":
            if isinstance(value, (RuntimeError, OSError, ValueError)):
                raise _StoreUnreachable(value) from value
            raise value
        return value

    def close(self) -> None:
        """End this board's store-call thread (the session is over; a later call starts another)."""
        with self._caller_lock:
            if self._caller is not None:
                self._caller.close()
            self._caller = None

    def read(self) -> Optional[FailureReport]:
        """The failure that stands, if one is posted (no store call once it is known or the store is lost)."""
        if self.known is not None:
            return self.known
        if self.lost or not self.op(lambda s: s.check(["failure"])):
            return None
        return self._learn(FailureReport.from_wire(self.op(lambda s: s.get("failure"))))

    def post(self, report: FailureReport) -> FailureReport:
        """Post ``report`` unless a failure is already posted; return the one that stands."""
        wire = report.to_wire()
        return self._learn(FailureReport.from_wire(self.op(lambda s: s.compare_set("failure", "", wire))))

    def _learn(self, standing: FailureReport) -> FailureReport:
        """Keep the failure that stands (for when the store is gone)."""
        self.known = standing
        return standing

    def hold_until_left(self, seconds: float) -> None:
        """Keep the store up, at most ``seconds``, until every other rank is done with it for the failure.

        Done is :meth:`note_left_for_failure`, each rank's last store call: waiting only until the
        others had *read* the failure let a rank's last calls meet a closed store (a C++ warning
        "Connection reset by peer" in its output). The others get there within a few polls once the
        failed rank's report is out, so the wait is short (a frozen peer holds it ``seconds`` at
        most); see :meth:`~.departure.Departure._hold_store_if_mine` for why it is held at all.
        """
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and int(self.store.add("left for the failure", 0)) < self.world_size - 1:
            time.sleep(_FINE_POLL)

    def wait_for_processes(self, ranks: list[int], seconds: float) -> None:
        """Up to ``seconds`` for ``ranks`` to say where they run (a rank not there by then is learned later)."""
        try:
            self.store.wait([f"proc/{r}" for r in ranks], timedelta(seconds=seconds))
        except dist.DistStoreError:
            pass

    def process_of(self, rank: int) -> Optional[_ProcessInfo]:
        """Where ``rank`` runs, once it has said so."""
        key = f"proc/{rank}"
        if not self.op(lambda s: s.check([key])):
            return None
        return _ProcessInfo.from_wire(self.op(lambda s: s.get(key)))

    def beat(self) -> None:
        """One heartbeat of this rank."""
        self.op(lambda s: s.add(f"hb/{self.rank}", 1))

    def beats_of(self, rank: int) -> int:
        """How many heartbeats ``rank`` has given."""
        return int(self.op(lambda s: s.add(f"hb/{rank}", 0)))

    def leave(self) -> None:
        """This rank finished normally (a direct call: the watchdog thread is being stopped)."""
        self.store.set(f"left/{self.rank}", "1")

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` finished normally."""
        return bool(self.op(lambda s: s.check([f"left/{rank}"])))

    def mark_exited(self) -> None:
        """This failed rank has printed its traceback (a direct call: at interpreter exit)."""
        self.store.set(f"exited/{self.rank}", "1")

    def has_exited(self, rank: int) -> bool:
        """Whether failed ``rank`` has printed its traceback."""
        return bool(self.op(lambda s: s.check([f"exited/{rank}"])))

    def note_stopping(self) -> None:
        """This rank is leaving for another's failure (told first, while the store is surely up)."""
        self.op(lambda s: s.add("stopped", 1))

    def withdraw_stopping(self, *, left: bool) -> None:
        """Take back :meth:`note_stopping` (and :meth:`note_left_for_failure` with ``left``): this rank failed on its own."""
        self.op(lambda s: s.add("stopped", -1))
        if left:
            self.op(lambda s: s.add("left for the failure", -1))

    def any_stopped(self) -> bool:
        """Whether any rank is leaving for this rank's failure (or the store went with the others)."""
        try:
            return int(self.op(lambda s: s.add("stopped", 0))) > 0
        except _StoreUnreachable:
            return True

    def note_left_for_failure(self) -> None:
        """This rank is about to exit for another's failure and makes no more store calls."""
        self.op(lambda s: s.add("left for the failure", 1))

    def all_left_for_failure(self) -> bool:
        """Every other rank has left for this rank's failure (or the store went with them)."""
        try:
            return int(self.op(lambda s: s.add("left for the failure", 0))) >= self.world_size - 1
        except _StoreUnreachable:
            return True
