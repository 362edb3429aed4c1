"""Fault-tolerant HSDP across replica groups on torchft (``pip install 'hp-lightning[ft]'``).

The engine (no Lightning): :class:`FaultTolerance` (the option), :class:`FaultTolerantHSDP`
(Manager, replicate all-reduce hooks, quorum and commit), :class:`TrainingState` (what heals),
:class:`ParticipantBatches` (each step's data share), :func:`start_lighthouse` and the
``python -m hp_lightning.ft lighthouse`` command, and :func:`init_process_group` (a replica group's
process group, fresh per ``torchrun --max-restarts`` attempt). torchft itself is imported only when used.

:class:`FaultTolerance` and its checks live in :mod:`hp_lightning.core.fault_tolerance`: validating
the option must not import this package.
"""

from hp_lightning.core.fault_tolerance import LIGHTHOUSE_ENV, FaultTolerance, check_lighthouse_reachable, require_torchft
from hp_lightning.core.watchdog.elastic import init_process_group
from hp_lightning.ft.data import ParticipantBatches
from hp_lightning.ft.engine import FaultTolerantHSDP, Participation
from hp_lightning.ft.lighthouse import start_lighthouse
from hp_lightning.ft.state import Stateful, TrainingState

__all__ = [
    "LIGHTHOUSE_ENV",
    "FaultTolerance",
    "FaultTolerantHSDP",
    "ParticipantBatches",
    "Participation",
    "Stateful",
    "TrainingState",
    "check_lighthouse_reachable",
    "init_process_group",
    "require_torchft",
    "start_lighthouse",
]
