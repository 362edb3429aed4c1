"""hp_lightning.core.watchdog and .agreement without a process group: option checks, reports, messages, what gets compared."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist

from hp_lightning.core.agreement import check_rank_agreement
from hp_lightning.core.watchdog import FailureReport, FaultWatchdog, is_communication_error
from hp_lightning.strategies.hsdp import HSDPStrategy
from tests.faults.guarded import GuardedHSDPStrategy


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"heartbeat_timeout": 0}, ValueError, "FaultWatchdog(heartbeat_timeout=...) must be a finite number of seconds > 0; got 0"),
        ({"exit_grace": float("inf")}, ValueError, "FaultWatchdog(exit_grace=...) must be a finite"),
        ({"heartbeat_timeout": "60"}, TypeError, "FaultWatchdog(heartbeat_timeout=...) expects a number of seconds; got str '60'"),
        ({"poll_interval": True}, TypeError, "expects a number of seconds; got bool"),
    ],
)
def test_watchdog_refuses_bad_seconds(kwargs, error, text):
    with pytest.raises(error) as info:
        FaultWatchdog(**kwargs)
    assert text in str(info.value)


def test_strategy_refuses_bad_watchdog_options():
    with pytest.raises(ValueError, match=r"HSDPStrategy\(heartbeat_timeout=...\) must be a finite number of seconds > 0; got -1"):
        GuardedHSDPStrategy(heartbeat_timeout=-1)
    with pytest.raises(TypeError, match=r"HSDPStrategy\(fault_watchdog=...\) expects True or False"):
        GuardedHSDPStrategy(fault_watchdog="yes")


def test_poll_interval_follows_the_heartbeat():
    assert FaultWatchdog(heartbeat_timeout=120).poll_interval == 1.0
    assert FaultWatchdog(heartbeat_timeout=5).poll_interval == 0.5


def test_without_a_process_group_everything_is_a_no_op():
    assert not dist.is_initialized()
    watchdog = FaultWatchdog()
    watchdog.start(0, 2, range(2))
    assert not watchdog.running
    watchdog.report(ValueError("x"))  # nothing to report to: Lightning raises as usual
    watchdog.stop()
    check_rank_agreement({"anything": 1}, stage="setup")


def test_failure_report_round_trip_and_wording():
    error = FailureReport(1, "error", "ValueError: boom", "node-3", 4242, 1, 1700000000.5)
    assert FailureReport.from_wire(error.to_wire()) == error
    assert error.describe() == "rank 1 failed first with ValueError: boom (its traceback is in rank 1's output)"
    gone = FailureReport(2, "gone", "is gone: its process ended", "node-3", 4242, 0)
    assert gone.describe() == "rank 2 (pid 4242 on node-3) is gone: its process ended"
    silent = FailureReport(5, "silent", "stopped responding", "?", -1, 4)
    assert silent.describe() == "rank 5 stopped responding"


def test_watchdog_summary_reaches_into_dataloader_worker_errors():
    from hp_lightning.core.watchdog import _first_line

    wrapped = "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n  File x\nValueError: bad sample 7\n"
    assert _first_line(wrapped) == "Caught ValueError in DataLoader worker process 0: ValueError: bad sample 7"
    assert _first_line("Ranks disagree about x:\n  - x: 1 on rank 0") == "Ranks disagree about x:"


@pytest.mark.parametrize(
    "exc, expected",
    [
        (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), True),
        (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:9105: Connection reset by peer"), True),
        (dist.DistNetworkError("anything"), True),
        (RuntimeError("The total norm of order 2.0 of the gradients is non-finite"), False),
        (ValueError("Connection closed by peer"), False),
    ],
)
def test_communication_errors_are_told_apart_from_causes(exc, expected):
    assert is_communication_error(exc) is expected


def _raised_from(outer: BaseException, cause: BaseException, explicit: bool) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            if explicit:
                raise outer from inner
            raise outer
    except BaseException as caught:  # noqa: BLE001 - returned to the test
        return caught
    raise AssertionError("unreachable")


def test_a_pipeline_stage_wrapping_a_lost_peer_is_a_consequence_not_a_cause():
    # torch.distributed.pipelining's stage: `raise RuntimeError("[Stage 0] failed to run forward ...") from e`.
    lost = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:9105: Connection reset by peer")
    wrapped = _raised_from(RuntimeError("\n    [Stage 0] failed to run forward:\n    args: ...\n"), lost, explicit=True)
    assert is_communication_error(wrapped) is True
    twice = _raised_from(RuntimeError("schedule step failed"), wrapped, explicit=True)
    assert is_communication_error(twice) is True
    # An error raised while handling one (no `from`) may be a cause of its own: not followed.
    assert is_communication_error(_raised_from(ValueError("bad batch"), lost, explicit=False)) is False
    assert is_communication_error(_raised_from(ValueError("bad batch"), ValueError("other"), explicit=True)) is False


def test_every_strategy_option_is_compared_across_ranks():
    # The agreement check compares HSDPOptions.settings(): every keyword-only constructor option
    # must be a field there, or ranks could disagree about it unnoticed.
    options = GuardedHSDPStrategy().options.settings()
    names = [
        name
        for cls in (HSDPStrategy, GuardedHSDPStrategy)
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    compared = {key.split("(", 1)[1].split("=", 1)[0] for key in options}
    assert set(names) <= compared, set(names) - compared


def test_torchrun_records_come_from_torchs_error_handler_and_never_tie_with_their_cause(tmp_path, monkeypatch):
    """What torchrun's agent reads back (its own ``ProcessFailure``): the message, and a consequence dated after its cause."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from hp_lightning.core.watchdog import StoppedForPeerFailure, _record_for_torchrun, _second_after

    cause_file, consequence_file = tmp_path / "rank1.json", tmp_path / "rank0.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(cause_file))
    try:
        raise ValueError("bad batch 7")
    except ValueError as exc:
        _record_for_torchrun(exc)
    cause = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(cause_file))
    assert cause.message["message"] == "ValueError: bad batch 7"
    assert 'raise ValueError("bad batch 7")' in cause.message["extraInfo"]["py_callstack"]

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(consequence_file))
    report = FailureReport(1, "error", "ValueError: bad batch 7", "node", 1, 1, time.time())
    started = time.time()
    _record_for_torchrun(StoppedForPeerFailure("rank 0: stopped because rank 1 failed first"), _second_after(report))
    assert time.time() - started <= 1.05  # at most a second's wait
    consequence = ProcessFailure(local_rank=0, pid=2, exitcode=3, error_file=str(consequence_file))
    assert consequence.message["message"] == "StoppedForPeerFailure: rank 0: stopped because rank 1 failed first"
    assert consequence.timestamp > int(report.time)  # the agent's root cause is the smaller timestamp: rank 1's

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    _record_for_torchrun(ValueError("outside torchrun"))  # nothing to write, nothing raised


def _local_peer_watch(monkeypatch, *, pidfds: bool):
    """A rank-0 watch over one real local peer process (a sleeping child), on an in-memory store."""
    import os
    import socket
    import subprocess
    import sys

    from hp_lightning.core.watchdog import liveness
    from hp_lightning.core.watchdog.failure_board import FailureBoard
    from hp_lightning.core.watchdog.liveness import MainThreadMonitor, PeerLiveness
    from hp_lightning.core.watchdog.polling import Poller
    from hp_lightning.core.watchdog.processes import StopSignal, _machine_key, _start_ticks
    from hp_lightning.core.watchdog.reports import _ProcessInfo

    if not pidfds:
        monkeypatch.setattr(liveness, "_open_exit_fd", lambda info: None)
    pid_reads = []
    real_is_running = liveness._is_running
    monkeypatch.setattr(liveness, "_is_running", lambda info: pid_reads.append(info.pid) or real_is_running(info))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    board = FailureBoard(dist.HashStore(), rank=0, world_size=2, deadline=5.0, store_host_rank=None)
    machine = _machine_key()
    board.store.set("proc/1", _ProcessInfo(socket.gethostname(), machine, child.pid, _start_ticks(child.pid)).to_wire())
    me = _ProcessInfo(socket.gethostname(), machine, os.getpid(), _start_ticks(os.getpid()))
    peers = PeerLiveness(board, me, local_ranks=[0, 1], heartbeat_timeout=60.0)
    peers.learn_local_peers()
    assert list(peers.local) == [1]
    stopping = StopSignal()
    poller = Poller(board, peers, MainThreadMonitor(60.0), None, poll_interval=30.0, stopping=stopping)  # type: ignore[arg-type]
    return child, peers, poller, stopping, pid_reads


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "proc-polling"])
def test_a_local_peers_exit_or_a_stop_ends_the_wait_at_once_and_pidfds_need_no_clock(monkeypatch, pidfds):
    """The watchdog's wait between polls: with pidfds it sleeps on them (no /proc read in between)."""
    import threading
    import time

    child, peers, poller, stopping, pid_reads = _local_peer_watch(monkeypatch, pidfds=pidfds)
    try:
        assert peers.exits_signalled() is pidfds
        # A stop wakes the wait (its poll interval is 30 s) at once.
        threading.Timer(1.0, stopping.set).start()
        start = time.monotonic()
        assert poller._wait_for_next_poll() is True
        assert 0.9 < time.monotonic() - start < 2.0
        # With pidfds, nothing read /proc during that second; the fallback reads it every 0.1 s.
        assert len(pid_reads) <= 1 if pidfds else len(pid_reads) >= 5
        stopping.clear()
        # The peer's death (a zombie: not reaped yet) ends the wait at once, for a poll to name it.
        threading.Timer(0.5, child.kill).start()
        start = time.monotonic()
        assert poller._wait_for_next_poll() is False
        assert time.monotonic() - start < 2.0
        with open(f"/proc/{child.pid}/stat") as stat:
            assert stat.read().rsplit(") ", 1)[1].startswith("Z")  # ended, not reaped: the launcher's case
        assert peers.first_dead_local_peer() is not None
        # The ended peer's pidfd is closed (it would stay readable); the next waits poll /proc.
        assert not peers.exits_signalled()
        assert poller._wait_for_next_poll() is False
    finally:
        child.kill()
        child.wait()
        peers.close()


def test_store_calls_share_one_thread_that_a_hung_call_retires():
    """FailureBoard.op: calls run on one daemon thread; a call past the deadline is the store unreachable,
    callers queued behind it are answered at once, the next call gets a fresh thread, close() ends it."""
    import threading
    import time

    from hp_lightning.core.watchdog.failure_board import FailureBoard
    from hp_lightning.core.watchdog.processes import _StoreUnreachable

    def store_threads() -> int:
        return sum(t.name == "hp_lightning-store-calls" for t in threading.enumerate())

    before = store_threads()
    board = FailureBoard(dist.HashStore(), rank=0, world_size=2, deadline=0.5, store_host_rank=None)
    assert [board.op(lambda s: s.add("n", 1)) for _ in range(5)] == [1, 2, 3, 4, 5]
    assert store_threads() == before + 1  # one thread for every call, not one per call
    release = threading.Event()
    queued: list[float] = []

    def behind() -> None:
        time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(_StoreUnreachable):
            board.op(lambda s: s.add("n", 1))
        queued.append(time.monotonic() - start)

    waiter = threading.Thread(target=behind)
    waiter.start()
    start = time.monotonic()
    with pytest.raises(_StoreUnreachable) as hung:
        board.op(lambda s: release.wait(5))  # a frozen store server
    assert 0.45 < time.monotonic() - start < 1.5 and hung.value.timed_out
    waiter.join()
    assert queued and queued[0] < 0.8  # answered when the hung call was declared, not a deadline later
    assert board.op(lambda s: s.add("n", 1)) == 6  # a fresh thread
    release.set()
    board.close()
    deadline = time.monotonic() + 5
    while store_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store_threads() == before


def test_a_rank_that_raises_the_same_error_while_leaving_for_a_peers_takes_its_leaving_back(monkeypatch):
    """An error every rank raises together, caught by the user: a rank whose watchdog read the peer's report
    first notes it is leaving, then fails on its own. The note is taken back, so the failed peer's session,
    lingering past ``exit_grace`` (its error caught), does not end that process for a stop that never came."""
    import os
    import socket
    import threading
    import time

    from hp_lightning.core.watchdog import departure as departure_module
    from hp_lightning.core.watchdog.departure import Departure
    from hp_lightning.core.watchdog.failure_board import FailureBoard
    from hp_lightning.core.watchdog.liveness import PeerLiveness
    from hp_lightning.core.watchdog.reports import _ProcessInfo

    def exit_called(code: int) -> None:
        raise AssertionError(f"os._exit({code}) called")

    monkeypatch.setattr(departure_module.os, "_exit", exit_called)
    store = dist.HashStore()
    me = _ProcessInfo(socket.gethostname(), "machine", os.getpid(), 0)

    def departure_of(rank: int) -> tuple[FailureBoard, Departure]:
        board = FailureBoard(store, rank=rank, world_size=2, deadline=5.0, store_host_rank=0)
        peers = PeerLiveness(board, me, local_ranks=[], heartbeat_timeout=60.0)
        return board, Departure(board, peers, me, exit_grace=5.0, poll_interval=1.0, exit_lock=threading.RLock(), at_exit=lambda: None)

    board0, first = departure_of(0)
    board1, second = departure_of(1)
    error = FailureReport(0, "error", "UnsafeCheckpointError: refused", me.host, me.pid, 0, time.time())
    first.mark_failed(RuntimeError("refused"))  # rank 0 posted first
    leaving = threading.Thread(target=second.stop_for, args=(error,))  # rank 1's watchdog read rank 0's report
    leaving.start()
    deadline = time.monotonic() + 5
    while not board0.any_stopped() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert board0.any_stopped()  # told while the store is surely up
    second.mark_failed(RuntimeError("refused"))  # then rank 1 raised the same error itself
    leaving.join(timeout=5)
    assert not leaving.is_alive()
    assert not board0.any_stopped() and not board1.all_left_for_failure()
    # Rank 0's session, past its grace with its error caught and the user carrying on, leaves it running.
    first.failed_at = time.monotonic() - 3 * 5.0
    first.end_if_lingering()
