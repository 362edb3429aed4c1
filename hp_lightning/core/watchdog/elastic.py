"""torchrun's in-place restarts (``--max-restarts``): a fresh rendezvous for every attempt.

Under torchrun with the c10d rendezvous (``--standalone`` or ``--rdzv-backend=c10d``), the
workers' ``MASTER_ADDR:MASTER_PORT`` is the *agent's* TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``),
and that store outlives the workers: when torchrun restarts the worker group, the new attempt's
ranks meet in the same store, under the same keys, as the dead attempt's. torch's ``env://``
rendezvous does not prefix those keys by attempt, so a fast rank of the new attempt reads the
addresses the *old* rank 0 published (gloo: ``connectFullMesh failed ... Connection refused``, or
a hang) before the new rank 0 overwrites them. Whether a restart survives is then a race between
the ranks' start-up times; Lightning's own ``"ddp"`` strategy loses it most of the time too.

The cure here is a key prefix per attempt (``TORCHELASTIC_RESTART_COUNT``): the default process
group, and with it every group split from it (the mesh, the host-side agreement group), keeps its
keys under ``hp_lightning/attempt_<n>/`` of the agent's store. Other keys in the same store are
attempt-keyed where they are written (the fault watchdog's board) or cleared before use (torchft's
manager address, :func:`clear_stale_keys`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = [
    "attempt_prefix", "attempt_store", "clear_stale_keys", "end_job_without_restart", "init_process_group", "restart_count",
    "uses_agent_store",
]


def uses_agent_store() -> bool:
    """Whether this worker's ``MASTER_ADDR:MASTER_PORT`` is torchrun's agent store (which outlives an attempt)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_count() -> int:
    """torchrun's restart count of this worker group (0 for the first attempt and outside torchrun)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return int(raw) if raw.isdigit() else 0


def attempt_prefix() -> str:
    """The key prefix of this attempt's rendezvous: the same on every rank of one attempt, new on a restart."""
    return f"hp_lightning/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt_{restart_count()}/"


def attempt_store(host: str, port: int, timeout: float | timedelta) -> Optional[dist.Store]:
    """The store to build the default process group on, or None where torch's own ``env://`` is fresh.

    Under torchrun's shared agent store: a client of that store whose keys carry
    :func:`attempt_prefix`, so a restarted attempt never reads the dead attempt's addresses.
    Elsewhere (Lightning's launcher, SLURM, torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)
    rank 0 serves a new store per launch, and None keeps torch's default path.

    Args:
        host: the store's address (the cluster environment's ``main_address``).
        port: its port (``main_port``).
        timeout: how long a key may be waited for (the process-group timeout; seconds or a timedelta).
    """
    if not uses_agent_store():
        return None
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    client = dist.TCPStore(host, port, is_master=False, timeout=wait, wait_for_workers=False)
    return dist.PrefixStore(attempt_prefix(), client)


def clear_stale_keys(keys: Iterable[str], *, group_rank: int) -> None:
    """Rank 0 deletes ``keys`` from the agent store, then every rank waits for it (a barrier on the default group).

    For libraries that exchange addresses through unprefixed keys of ``MASTER_ADDR:MASTER_PORT``
    (torchft's manager address): after a restart their readers would otherwise race the new
    writer and may read the dead attempt's value. A no-op outside torchrun's agent store or in the
    first attempt (no earlier attempt wrote anything). Call it on every rank of the group, after
    the default process group exists and before the library reads the keys.
    """
    if not uses_agent_store() or restart_count() == 0:
        return
    if group_rank == 0:
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
        for key in keys:
            client.delete_key(key)
    dist.barrier()


def end_job_without_restart(reason: str, *, grace: float = 30.0) -> bool:
    """Ask torchrun's agent to end the whole job now, instead of restarting it for an error no restart can fix.

    torchrun restarts a failed worker group up to ``--max-restarts`` times whatever the error; for
    a configuration error (a wrong lighthouse address) every attempt fails the same way, and with
    ``--max-restarts=100`` the job would retry for a long time. Local rank 0 sends SIGTERM to its
    parent, torchrun's agent, which then stops its workers and exits with a failure (no further
    attempt). The other local ranks wait up to ``grace`` seconds to be stopped by the agent before
    their error ends them: a rank that exited first could make the agent restart before the signal
    arrives. Outside torchrun (no ``TORCHELASTIC_RUN_ID``, or a parent that is not torchrun's agent)
    nothing is sent or waited for, and the caller's error ends the rank as usual.

    Args:
        reason: printed with the request, on local rank 0.
        grace: the longest wait of the other local ranks, in seconds.

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
    import signal
    import sys
    import time

    if os.environ.get("LOCAL_RANK", "0") != "0":
        import threading

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
    ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ... as for torch.
        timeout: the process group's timeout, in seconds or as a ``timedelta``.
        kwargs: passed on to ``torch.distributed.init_process_group`` (e.g. ``device_id``).

    Raises:
        ValueError: a launcher variable is missing or not an integer (under the agent store).
    """
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if not uses_agent_store():
        dist.init_process_group(backend, timeout=wait, **kwargs)
        return
    values = {name: os.environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    if not values["MASTER_ADDR"] or not all(values[n].isdigit() for n in ("MASTER_PORT", "RANK", "WORLD_SIZE")):
        raise ValueError(
            f"init_process_group reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the launcher; got {values}. "
            f"Launch with torchrun (which sets them)."
        )
    store = attempt_store(values["MASTER_ADDR"], int(values["MASTER_PORT"]), wait)
    dist.init_process_group(backend, store=store, rank=int(values["RANK"]), world_size=int(values["WORLD_SIZE"]), timeout=wait, **kwargs)
