"""How a rank leaves: what it prints once, what torchrun's agent records, which signals it ignores on the way out."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from hp_lightning.core.watchdog.reports import _PREFIX, _first_line


def _one_line_if_uncaught(exc: BaseException, line: str) -> None:
    """If ``exc`` ends the process uncaught, print ``line`` instead of its traceback (a caught ``exc`` is unaffected)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is exc:
            _say(line)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def print_once_per_job(exc: BaseException) -> None:
    """Before a process group exists: rank 0 prints ``exc``'s traceback, every other rank one line.

    A configuration error (a mesh that does not fit the world size, a backend that cannot start)
    is raised by every rank at once. The rank comes from the launcher's environment (``RANK``).
    """
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank != 0:
        _one_line_if_uncaught(exc, f"rank {rank}: exiting with {type(exc).__name__}: {_first_line(str(exc))} (traceback in rank 0's output).")


def _say(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"{_PREFIX} {message}\n")
    sys.stderr.flush()


def _quiet_signals() -> None:
    """Ignore SIGTERM and drop Python-level SIGCHLD handlers: this process is ending.

    SIGCHLD: torchrun's SIGTERM also reaches this rank's DataLoader workers, and the
    DataLoader's handler would raise about their deaths in the middle of the traceback. Only
    the main thread may change handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sigchld = getattr(signal, "SIGCHLD", None)
    if sigchld is not None and callable(signal.getsignal(sigchld)):
        signal.signal(sigchld, signal.SIG_DFL)


def _record_for_torchrun(error: BaseException, not_before: float = 0.0) -> None:
    """Under torchrun, show ``error`` in the agent's summary: torch's ``ErrorHandler``, as ``@record`` does.

    The record is written no earlier than ``not_before`` (at most a second's wait, for a
    consequence), so the agent never names a consequence as the root cause. Outside torchrun
    (no ``TORCHELASTIC_ERROR_FILE``) nothing is written.
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    time.sleep(max(0.0, not_before - time.time()))
    try:
        if sys.exc_info()[1] is error:
            get_error_handler().record_exception(error)
            return
        try:
            raise error from None  # the record's traceback is this frame, not the peer error being handled
        except BaseException as raised:  # noqa: BLE001 - recorded, not handled
            get_error_handler().record_exception(raised)
    except OSError:
        pass
