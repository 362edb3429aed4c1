"""torchrun's in-place restarts (``--max-restarts``): a fresh rendezvous for every attempt.

torchrun's agent store outlives an attempt and torch's ``env://`` rendezvous does not key it by
attempt, so a restarted rank could read the dead attempt's addresses (``docs/fault-tolerance.md``,
"Under torchrun"). The default process group, and every group split from it, therefore keeps its
keys under ``hp_lightning/<run>/attempt_<n>/``, with ``n`` agreed through the agents' store
(:func:`agree_attempt`: ``TORCHELASTIC_RESTART_COUNT`` may differ between the nodes of one attempt).
Other keys in that store are keyed by the agreed attempt where they are written (the fault
watchdog's board) or cleared before use (:func:`clear_stale_keys`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = [
    "Attempt", "agree_attempt", "agreed_attempt", "attempt_key", "attempt_prefix", "attempt_store", "clear_stale_keys",
    "end_job_without_restart", "init_process_group", "restart_count", "run_note", "set_run_note", "uses_agent_store",
]

#: Seconds between two looks at the agreement's keys (each one store call).
_AGREE_POLL = 0.02


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of a torchrun job, as its ranks agreed it (:func:`agree_attempt`); ``number`` is unique within
    the run and larger for every later attempt (not consecutive)."""

    number: int


#: This process's attempt, once agreed (a process belongs to exactly one attempt).
_agreed: Optional[Attempt] = None


def uses_agent_store() -> bool:
    """Whether this worker's ``MASTER_ADDR:MASTER_PORT`` is torchrun's agent store (which outlives an attempt)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_count() -> int:
    """torchrun's restart count of this worker group (0 for the first attempt and outside torchrun)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return int(raw) if raw.isdigit() else 0


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "run")


def agreed_attempt() -> Optional[Attempt]:
    """This process's attempt once :func:`agree_attempt` ran (None before, and outside torchrun's agent store)."""
    return _agreed


def agree_attempt(store: dist.Store, *, rank: int, world_size: int, timeout: float | timedelta) -> Attempt:
    """Agree with every rank of this attempt on its :class:`Attempt`, through the agents' store (once per process).

    What makes it possible: torchrun stops every worker of an attempt before any agent joins the
    next rendezvous round, and a round completes only when every agent joined it, so no two
    attempts' workers are ever alive together. Every rank takes a ticket from one counter
    (``store.add``): a later attempt's tickets are all larger. Rank 0's first ticket names the
    attempt; it republishes the name beside a fresh ticket until every other rank has taken it.
    A rank accepts a name only when it comes with a ticket larger than its own: that ticket was
    drawn after this rank started, hence by this attempt's rank 0, never by a dead one. The cost:
    a few store calls per rank and rank 0 polling every 20 ms, once per process. ``store`` is an
    unprefixed client of the agents' store; ``timeout`` the process-group timeout.

    Raises:
        TimeoutError: the other ranks did not all arrive within ``timeout`` (torchrun restarts an
            attempt whose worker died long before that).
    """
    global _agreed
    if _agreed is None:
        _agreed = _agree(store, rank, world_size, timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout))
    return _agreed


def _agree(store: dist.Store, rank: int, world_size: int, seconds: float) -> Attempt:
    """:func:`agree_attempt`'s protocol, without the per-process memory."""
    deadline = time.monotonic() + seconds
    base = f"hp_lightning/{_run_id()}/attempts/"
    tickets, named = base + "tickets", base + "named"

    def wait(what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hp_lightning: rank {rank} waited {seconds:g} s for {what} to agree on this torchrun attempt's "
                f"rendezvous (store {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}); a rank "
                f"of this attempt did not start."
            )
        time.sleep(_AGREE_POLL)

    if rank == 0:
        number = store.add(tickets, 1)
        joined = f"{base}joined/{number}"
        while True:
            store.set(named, f"{number}:{store.add(tickets, 1)}")
            missing = world_size - 1 - store.add(joined, 0)
            if missing <= 0:
                break
            wait(f"{missing} other rank(s)")
    else:
        mine = store.add(tickets, 1)
        while True:
            if store.check([named]):
                fields = store.get(named).decode().split(":")  # "<attempt>:<ticket>"
                number, ticket = int(fields[0]), int(fields[-1])
                if ticket > mine:  # published after this rank started: this attempt's rank 0
                    store.add(f"{base}joined/{number}", 1)
                    break
            wait("rank 0")
    return Attempt(number)


def _attempt_number() -> int:
    return _agreed.number if _agreed is not None else restart_count()


def attempt_key() -> str:
    """This attempt's name within the run: the agreed :class:`Attempt` (else torchrun's restart count) after the run id.

    The fault watchdog keys its board by it; :func:`attempt_prefix` the process group's keys.
    """
    return f"{_run_id()}.{_attempt_number()}"


def attempt_prefix() -> str:
    """The key prefix of this attempt's rendezvous: the same on every rank of one attempt, new on a restart."""
    return f"hp_lightning/{_run_id()}/attempt_{_attempt_number()}/"


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def _agent_client(timeout: float | timedelta, host: Optional[str] = None, port: Optional[int] = None) -> dist.TCPStore:
    return dist.TCPStore(
        host or os.environ["MASTER_ADDR"], int(port if port is not None else os.environ["MASTER_PORT"]), is_master=False,
        timeout=_as_timedelta(timeout), wait_for_workers=False,
    )


def attempt_store(
    host: str, port: int, timeout: float | timedelta, *, rank: Optional[int] = None, world_size: Optional[int] = None
) -> Optional[dist.Store]:
    """The store to build the default process group on, or None where torch's own ``env://`` is fresh.

    Under torchrun's shared agent store: a client of that store whose keys carry
    :func:`attempt_prefix` of the attempt every rank agreed on (:func:`agree_attempt`), so a
    restarted attempt never reads a dead attempt's addresses, whichever node restarted why.
    Elsewhere (Lightning's launcher, SLURM, torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)
    rank 0 serves a new store per launch, and None keeps torch's default path. ``timeout`` is the
    process-group timeout; ``rank``, ``world_size`` None read torchrun's ``RANK`` and ``WORLD_SIZE``.
    """
    if not uses_agent_store():
        return None
    client = _agent_client(timeout, host, port)
    agree_attempt(
        client, rank=int(os.environ["RANK"]) if rank is None else rank,
        world_size=int(os.environ["WORLD_SIZE"]) if world_size is None else world_size, timeout=timeout,
    )
    return dist.PrefixStore(attempt_prefix(), client)


def clear_stale_keys(keys: Iterable[str], *, group_rank: int) -> None:
    """Rank 0 deletes ``keys`` from the agent store, then every rank waits for it (a barrier on the default group).

    For libraries that exchange addresses through unprefixed keys of ``MASTER_ADDR:MASTER_PORT``
    (torchft's manager address): after a restart their readers would otherwise race the new
    writer and may read the dead attempt's value. Done in every attempt, the first included: no
    rank can tell a first attempt from a re-formed one by its own restart count. A no-op outside
    torchrun's agent store. Call it on every rank of the group, after the default process group
    exists and before the library reads the keys.
    """
    if not uses_agent_store():
        return
    if group_rank == 0:
        client = _agent_client(60.0)
        for key in keys:
            client.delete_key(key)
    dist.barrier()


def _note_key(name: str) -> str:
    return f"hp_lightning/{_run_id()}/notes/{name}"


def run_note(name: str) -> Optional[str]:
    """What an earlier attempt of this torchrun run noted under ``name`` (:func:`set_run_note`), or None.

    Notes live in the agents' store, which outlives every attempt: a restarted attempt reads what
    the ones before it learnt (that a lighthouse address answered, say). None outside torchrun's
    agent store, where each launch has a fresh store.
    """
    if not uses_agent_store():
        return None
    client = _agent_client(30.0)
    key = _note_key(name)
    return client.get(key).decode() if client.check([key]) else None


def set_run_note(name: str, value: str) -> None:
    """Note ``value`` under ``name`` for later attempts of this torchrun run (a no-op outside its agent store)."""
    if uses_agent_store():
        _agent_client(30.0).set(_note_key(name), value)


def end_job_without_restart(reason: str, *, grace: float = 30.0) -> bool:
    """Ask torchrun's agent to end the whole job now, instead of restarting it for an error no restart can fix.

    torchrun restarts a failed worker group up to ``--max-restarts`` times whatever the error, though
    a configuration error (a wrong lighthouse address) fails every attempt the same way. Local rank 0
    sends SIGTERM to its parent, torchrun's agent, which then stops its workers and exits with a
    failure (no further attempt). The other local ranks wait up to ``grace`` seconds to be stopped by the agent before
    their error ends them: a rank that exited first could make the agent restart before the signal
    arrives. Outside torchrun (no ``TORCHELASTIC_RUN_ID``, or a parent that is not torchrun's agent)
    nothing is sent or waited for, and the caller's error ends the rank as usual. ``reason`` is
    printed with the request, on local rank 0.

    Returns:
        Whether this rank asked (local rank 0) or waited for (the others) the agent to end the job.
    """
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    if not any(name in command for name in ("torchrun", "torch.distributed.run", "torch.distributed.launch")):
        return False
    if os.environ.get("LOCAL_RANK", "0") != "0":
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's SIGTERM ends this rank (not Lightning's note of it)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.1)
        return True
    sys.stderr.write(
        f"[hp_lightning] {reason} No restart can fix this: asking torchrun (pid {parent}) to end the job instead of "
        f"restarting it (--max-restarts).\n"
    )
    sys.stderr.flush()
    os.kill(parent, signal.SIGTERM)
    return True


def init_process_group(backend: str, *, timeout: float | timedelta = 1800.0, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend)`` from the launcher's environment, fresh per torchrun attempt.

    For scripts that create the process group themselves (the fault-tolerance engine loop) and may
    be restarted in place by ``torchrun --max-restarts``: under torchrun's shared agent store it
    builds the group on :func:`attempt_store`; elsewhere it is torch's own ``env://``. Reads
    ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``; ``kwargs`` go to torch's
    ``init_process_group`` (e.g. ``device_id``).

    Raises:
        ValueError: a launcher variable is missing or not an integer (under the agent store).
    """
    wait = _as_timedelta(timeout)
    if not uses_agent_store():
        dist.init_process_group(backend, timeout=wait, **kwargs)
        return
    values = {name: os.environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    if not values["MASTER_ADDR"] or not all(values[n].isdigit() for n in ("MASTER_PORT", "RANK", "WORLD_SIZE")):
        raise ValueError(
            f"init_process_group reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the launcher; got {values}. "
            f"Launch with torchrun (which sets them)."
        )
    rank, world_size = int(values["RANK"]), int(values["WORLD_SIZE"])
    store = attempt_store(values["MASTER_ADDR"], int(values["MASTER_PORT"]), wait, rank=rank, world_size=world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait, **kwargs)
