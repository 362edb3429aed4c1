"""Finding out about processes: is a pid still the same process, on this machine; the job's store; where a thread is."""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from hp_lightning.core._torch_private import default_store
from hp_lightning.core.watchdog.reports import _ProcessInfo


def _machine_key() -> str:
    """Host, boot and pid namespace: two ranks with the same key can see each other's pids.

    Empty where ``/proc`` is missing (not Linux): pids are then never checked, heartbeats only.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{socket.gethostname()}|{boot}|{namespace}"


def _start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks (tells a recycled pid apart), or None when it is gone.

    A zombie (ended, not yet reaped by its parent, as Lightning's launcher leaves its children for
    a while) counts as gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _is_running(info: _ProcessInfo) -> bool:
    return _start_ticks(info.pid) == info.start_ticks


def _open_exit_fd(info: _ProcessInfo) -> Optional[int]:
    """A pidfd of ``info``'s process: readable once it ends (as a zombie too), so a wait needs no clock.

    None where there are no pidfds (not Linux, a kernel before 5.3) or the process is already gone
    (checked after opening, so the fd cannot belong to a recycled pid): the caller polls ``/proc``.
    """
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(info.pid)
    except OSError:
        return None
    if not _is_running(info):
        os.close(fd)
        return None
    return fd


def _connect_store(timeout: float) -> dist.Store:
    """A store client of our own, so the watchdog never waits behind the main thread's store calls.

    The default process group's store is a chain of prefix stores over a TCPStore (Lightning's
    launcher, torchrun's agent store, ``env://``); a new client connects to the same server. Any
    other store (``file://``) is used directly.
    """
    store = default_store()
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return store


class _StoreUnreachable(Exception):
    """The store refused or dropped the connection; ``timed_out`` when it stopped answering instead."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        message = str(cause).lower()
        self.timed_out = "timeout" in message or "timed out" in message


_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(dist.__file__)))


def _inside_torch(frame: Any) -> bool:
    """Whether the innermost Python frame is torch's own code (a collective or kernel in progress)."""
    return os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIR + os.sep)


def _describe_stack(frame: Any, limit: int = 8) -> str:
    return "".join(traceback.format_stack(frame, limit=limit)).rstrip()


class StopSignal:
    """A :class:`threading.Event` whose waiter may also wake on file descriptors turning readable.

    :meth:`set` writes to a pipe the waiter polls with the descriptors, so a stop ends a wait on
    pidfds at once instead of at its timeout. The pipe is made by the first such wait.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._pipe: Optional[tuple[int, int]] = None  # (read end, write end)

    def set(self) -> None:
        self._event.set()
        if self._pipe is not None:
            try:
                os.write(self._pipe[1], b"x")
            except BlockingIOError:  # the pipe is full of earlier wake-ups: the waiter wakes anyway
                pass

    def clear(self) -> None:
        self._event.clear()
        if self._pipe is not None:
            try:
                while os.read(self._pipe[0], 4096):
                    pass
            except BlockingIOError:
                pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float, fds: Sequence[int] = ()) -> list[int]:
        """Sleep up to ``seconds``, until :meth:`set` or until one of ``fds`` is readable; return the readable ones."""
        if not fds:
            self._event.wait(seconds)
            return []
        if self._pipe is None:
            self._pipe = os.pipe()
            for end in self._pipe:
                os.set_blocking(end, False)
        if self._event.is_set():  # checked after the pipe exists: a set() from now on writes to it
            return []
        poller = select.poll()
        for fd in (self._pipe[0], *fds):
            poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, math.ceil(seconds * 1000)))
        return [fd for fd, _ in ready if fd != self._pipe[0]]
