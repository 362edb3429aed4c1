"""Preemption (SIGTERM from SLURM, Kubernetes, torchrun's agent) ends every rank together, in seconds.

A signal handler runs on the main thread between two bytecodes, wherever that thread is. Any
collective started from it (Lightning's own SIGTERM handler broadcasts a flag) pairs with
whatever the other ranks happen to be doing, and the job hangs. So here the handler only
records the signal. The ranks agree once per optimizer step, in the step's one control
collective (:class:`~hp_lightning.core.agreement.StepAgreement`), so it costs no collective of its
own and no host-device synchronization. A signal that reached one rank only (torchrun forwarding
to one worker, a SIGTERM to the launcher alone) so stops every rank at the same batch, where a
checkpoint can be saved collectively before leaving.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional

#: Exit status of a preempted rank: 128 + SIGTERM, what a shell reports for a process it terminated.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(SystemExit):
    """Raised on every rank, at the same batch, once the ranks agreed that the job was told to stop."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum = signum
        self.detail = detail

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name if self.signum in signal.Signals._value2member_map_ else str(self.signum)
        return f"preempted by {name}{': ' + self.detail if self.detail else ''} (exit code {PREEMPTED_EXIT_CODE})"


class PreemptionWatch:
    """Records preemption signals without acting on them; the step's agreement reads :attr:`received`."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        #: The signals that mean "the job must stop", which :meth:`install` takes over (SIGTERM; a
        #: front end may add a scheduler's warning or requeue signal).
        self.signals = signals
        #: The last preemption signal received by this process (0: none).
        self.received = 0
        self._previous: dict[int, Any] = {}

    def install(self, on_signal: Optional[Callable[[int], None]] = None) -> bool:
        """Make this the handler of :attr:`signals` (main thread only); True when installed.

        ``on_signal`` is called after recording, from the handler (it must not communicate).
        """
        if threading.current_thread() is not threading.main_thread():
            return False

        def handler(signum: int, frame: Optional[FrameType]) -> None:
            self.received = signum
            if on_signal is not None:
                on_signal(signum)

        for signum in self.signals:
            current = signal.getsignal(signum)
            if getattr(current, "__hp_lightning_watch__", None) is self:
                continue
            self._previous.setdefault(signum, current)
            handler.__hp_lightning_watch__ = self  # type: ignore[attr-defined]
            signal.signal(signum, handler)
        return True

    def restore(self) -> None:
        """Put back the handlers found at :meth:`install` (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if getattr(signal.getsignal(signum), "__hp_lightning_watch__", None) is self and previous is not None:
                signal.signal(signum, previous)
        self._previous.clear()
