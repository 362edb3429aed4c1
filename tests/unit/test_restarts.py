"""torchrun restarts, the parts that need no launcher: the attempt agreement and the wait for a restarting lighthouse.

Real TCPStores on 127.0.0.1 (the agents' store is one), ranks as threads of this process: the
protocol is store calls only. The launches themselves are ``tests/integration/test_launchers.py``'s.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from hp_lightning.core.watchdog import elastic
from tests.helpers import free_port


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))


def _ranks(server: dist.TCPStore, ranks: list[int], world_size: int, results: dict[int, Any]) -> list[threading.Thread]:
    def run(rank: int) -> None:
        try:
            results[rank] = elastic._agree(_client(server), rank, world_size, 20.0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    return threads


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"


def test_every_rank_of_an_attempt_agrees_and_a_dead_attempts_name_is_never_taken() -> None:
    server = _server()
    first: dict[int, Any] = {}
    _join(_ranks(server, [0, 1, 2], 3, first))
    assert len(set(first.values())) == 1, first
    # A dead attempt: its rank 0 named it and died before its other ranks took the name.
    dead: dict[int, Any] = {}
    _join(_ranks(server, [0], 1, dead))
    # The next attempt's other ranks start first: the name in the store is the dead attempt's, they must wait.
    second: dict[int, Any] = {}
    followers = _ranks(server, [1, 2], 3, second)
    time.sleep(0.3)
    assert all(t.is_alive() for t in followers) and not second, second
    _join(followers + _ranks(server, [0], 3, second))
    assert len(set(second.values())) == 1, second
    assert second[0].number > dead[0].number > first[0].number, (first, dead, second)


def test_a_rank_that_never_comes_is_a_timeout_naming_the_wait() -> None:
    server = _server()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 waited 0.3 s for 1 other rank\(s\)"):
        elastic._agree(_client(server), 0, 2, 0.3)
    assert time.monotonic() - start < 5


def test_a_restarted_group_waits_for_a_lighthouse_it_reached_before_and_only_for_that(monkeypatch: pytest.MonkeyPatch) -> None:
    """An address noted by an earlier attempt is waited for (up to join_timeout); any other fails at connect_timeout."""
    pytest.importorskip("torchft", reason="fault tolerance needs the 'ft' extra (torchft)")
    from hp_lightning.ft import FaultTolerance, start_lighthouse
    from hp_lightning.ft.engine import LIGHTHOUSE_NOTE, _reach_lighthouse

    server = _server()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-restarts")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    port = free_port()  # nothing listens there yet
    address = f"http://127.0.0.1:{port}"
    config = FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse=address, connect_timeout=0.3, join_timeout=1.0)

    start = time.monotonic()  # never reached in this run: a wrong address, no wait
    with pytest.raises(ConnectionError, match=rf"no lighthouse reachable at {address} within connect_timeout=0.3s"):
        _reach_lighthouse(config, address, 0)
    assert time.monotonic() - start < 30 and elastic.run_note(LIGHTHOUSE_NOTE) is None  # no wait (generous bound: noisy machines)

    elastic.set_run_note(LIGHTHOUSE_NOTE, address)  # what an earlier attempt that reached it left
    start = time.monotonic()  # reached before and still down after join_timeout: one error naming it
    with pytest.raises(ConnectionError, match=rf"the lighthouse at {address} answered earlier in this run, but not within join_timeout=1s"):
        _reach_lighthouse(config, address, 0)
    assert 1.0 <= time.monotonic() - start < 30  # waited join_timeout, then gave up (upper bound generous: noisy machines)

    started: list[Any] = []  # reached before, back within join_timeout: the group goes on
    timer = threading.Timer(0.5, lambda: started.append(start_lighthouse(f"127.0.0.1:{port}", min_replicas=1)))
    timer.start()
    try:
        _reach_lighthouse(FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse=address, connect_timeout=0.3,
                                         join_timeout=30.0), address, 0)
    finally:
        timer.join()
        for lighthouse in started:
            lighthouse.shutdown()
    assert started and elastic.run_note(LIGHTHOUSE_NOTE) == address


def test_a_wait_on_purpose_is_not_taken_for_a_stuck_main_thread() -> None:
    """The fault watchdog's main-thread check (a rank's own hang) leaves a marked wait alone, and only it."""
    from hp_lightning.core.watchdog import waiting_on_purpose
    from hp_lightning.core.watchdog.liveness import MainThreadMonitor

    def samples(seconds: float) -> list:
        monitor, seen = MainThreadMonitor(heartbeat_timeout=0.2), []

        def sample() -> None:
            for _ in range(int(seconds / 0.05)):
                seen.append(monitor.stuck())
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(seconds + 0.2)  # the main thread on one line, outside torch
        sampler.join(5)
        return seen

    with waiting_on_purpose():
        assert not any(samples(0.6))
    assert any(stack and "test_restarts.py" in stack for stack in samples(0.6))
