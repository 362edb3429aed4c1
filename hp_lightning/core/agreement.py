"""Settings every rank must share, compared once before they matter.

:func:`check_rank_agreement` is one small all-gather. Settings that must be the same on every
rank are compared at the point they take effect (:func:`setup_settings`, :func:`resume_settings`,
:func:`sharding_settings`). If they differ, every rank raises :class:`RankDisagreementError` naming
each differing setting and the ranks behind each value. Otherwise those ranks would run different
collectives and hang, or train a model that is silently wrong.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist

from hp_lightning._version import __version__
from hp_lightning.core import devices

if TYPE_CHECKING:
    from torch import nn


class ShardingResult(Protocol):
    """What :func:`sharding_settings` reads of the recipe's result (:class:`~hp_lightning.recipe.parallelize.ShardedModel`)."""

    @property
    def units(self) -> Sequence[Any]: ...

    @property
    def ignored(self) -> Sequence[str]: ...

    @property
    def replicated(self) -> Sequence[str]: ...


class RankDisagreementError(ValueError):
    """Ranks that must run the same configuration do not; the message names each setting and its ranks."""


def _plain(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_plain(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, str) else str(value)


def _rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"ranks 0-2, 5"``."""
    runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(sorted(ranks)), lambda ir: ir[1] - ir[0])]
    parts = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def disagreement_message(settings_per_rank: Sequence[Mapping[str, str]], stage: str, ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """The error text for settings that differ between ranks (``ranks``: their global ranks), or None when all agree."""
    names = list(dict.fromkeys(name for settings in settings_per_rank for name in settings))
    lines = []
    differing = []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for index, settings in enumerate(settings_per_rank):
            by_value.setdefault(settings.get(name, "<not set>"), []).append(ranks[index] if ranks else index)
        if len(by_value) < 2:
            continue
        differing.append(name)
        shown = sorted(by_value.items(), key=lambda kv: kv[1][0])
        values = "; ".join(f"{value} on {_rank_ranges(ranks)}" for value, ranks in shown[:4])
        more = f"; and {len(shown) - 4} more values" if len(shown) > 4 else ""
        lines.append(f"  - {name}: {values}{more}")
    if not differing:
        return None
    return (
        f"Ranks disagree about {', '.join(differing)} (checked at {stage}, before training communicates):\n"
        + "\n".join(lines)
        + "\nEvery rank must run the same code with the same configuration: look for values computed per rank or per "
        "node (environment variables, timestamps or host names in paths, config files or installed versions that "
        "differ between nodes, checkpoints only some nodes can see)."
    )


def check_rank_agreement(settings: Mapping[str, Any], *, stage: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise :class:`RankDisagreementError` on every rank if ``settings`` differ between ranks.

    One all-gather of a 16-byte digest per rank; only when the digests differ are the full
    settings gathered to name what differs. Every rank must call it (it is a collective), at
    the same point. Without a process group, or with one rank, it does nothing.

    Args:
        settings: setting name → value; values are compared as their text.
        stage: where the check runs, for the message (``"setup"``, ``"sharding"``).
        group: the ranks that must agree (None: the world; a pipeline stage's ranks under PP).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return
    mine = {str(k): _plain(v) for k, v in settings.items()}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:16]
    size = dist.get_world_size(group)
    digests: list[Any] = [None] * size
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    ranks = None if group is None else [dist.get_global_rank(group, i) for i in range(size)]
    if (message := disagreement_message(everyone, stage, ranks)) is not None:
        raise RankDisagreementError(message)


#: Trainer attributes that change which collectives run when (a difference hangs or desyncs ranks).
TRAINER_LOOP_SETTINGS = (
    "max_epochs", "max_steps", "min_steps", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
    "limit_train_batches", "limit_val_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps",
)


def setup_settings(options: Mapping[str, Any], precision: Optional[str], trainer: Any, mesh_shape: Sequence[int]) -> dict[str, Any]:
    """What must agree before the device mesh is built: versions, mesh, options, precision, paths, loops.

    Args:
        options: the strategy's options (:meth:`hp_lightning.core.options.HSDPOptions.settings`).
        trainer: Lightning's Trainer, for the checkpoint paths and loop lengths (None: Fabric, left
            out); read by attribute (``checkpoint_callbacks``, the loop settings): no Lightning import.
    """
    settings: dict[str, Any] = {
        "hp_lightning version": _package_version(),
        "torch version": str(torch.__version__),
        "lightning version": _installed_version("lightning"),
        "mesh shape": tuple(mesh_shape),
        **options,
        "precision": precision,
    }
    if trainer is not None:
        # (The checkpoint to resume is compared later, when Lightning knows it: resume_settings.)
        dirpaths = [cb.dirpath for cb in getattr(trainer, "checkpoint_callbacks", []) if hasattr(cb, "dirpath")]
        if dirpaths:
            settings["ModelCheckpoint(dirpath=...)"] = dirpaths
        for name in TRAINER_LOOP_SETTINGS:
            settings[f"Trainer({name}=...)"] = getattr(trainer, name, None)
    return settings


def _package_version() -> str:
    """hp_lightning's ``__version__``: the loaded package's when it is loaded (read, not imported), else this checkout's."""
    return getattr(sys.modules.get("hp_lightning"), "__version__", None) or __version__


def _installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (from its metadata: nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def resume_settings(checkpoint_path: Any) -> dict[str, Any]:
    """What must agree before a checkpoint is read: the path each rank resumes from (None: none)."""
    return {"checkpoint to resume (ckpt_path)": None if not checkpoint_path else str(checkpoint_path)}


def sharding_settings(model: nn.Module, sharded: Optional[ShardingResult]) -> dict[str, Any]:
    """What must agree before sharded parameters are materialized: the model's parameters and the units.

    Parameter names, shapes and dtypes are summarized as a count, an element total and a digest;
    the units as their qualified names.
    """
    params = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(repr(params).encode()).hexdigest()[:12]
    settings: dict[str, Any] = {
        "model parameters": f"{len(params)} tensors, {sum(math.prod(s) for _, s, _ in params):,} elements (digest {digest})"
    }
    if sharded is not None:
        names = {id(m): (n or "<root>") for n, m in model.named_modules()}
        units = [names.get(id(u), "?") for u in sharded.units]
        settings["sharding units"] = _short_list(units)
        settings["ignored parameters"] = _short_list(sharded.ignored)
        settings["replicated parameters"] = _short_list(sharded.replicated)
    return settings


def _short_list(items: Sequence[str], limit: int = 8) -> str:
    if len(items) <= limit:
        return f"{len(items)}: [{', '.join(items)}]"
    digest = hashlib.sha256(repr(list(items)).encode()).hexdigest()[:8]
    return f"{len(items)}: [{', '.join(items[:limit])}, ...] (digest {digest})"


# ---------------------------------------------------------------------------- per optimizer step


def host_group(timeout: Optional[Any] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group over the world, for control collectives on host tensors (None with one process).

    A collective: every rank calls it, at the same point (the front ends do, at setup). Its own
    group, even when the default one is gloo too: a control all-reduce then never queues behind
    the gradient collectives of the default group, and with NCCL it never touches the device.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    backend = devices.default_backend(devices.CPU)  # host tensors: gloo
    return dist.new_group(backend=backend, timeout=timeout) if timeout is not None else dist.new_group(backend=backend)


class StepAgreement:
    """The one control collective of an optimizer step: one small integer all-reduce on the host.

    What the ranks must decide together during training (was any of them told to stop? will
    every rank's coming backward reach the same parameters?) is folded into a single all-reduce
    (MAX) of one int32 CPU tensor, ``[signal, flags...]``, over a host-side gloo group: reading the
    result is a host read of a host tensor, never a host-device synchronization, so the CPU keeps
    running ahead of the accelerator as in a raw FSDP2 loop. The divergence check exchanges its
    flags through :meth:`exchange`; the preemption decision (:meth:`step_signal`) reuses the signal
    agreed there, and only communicates itself when no exchange happened in the step. Every rank
    must make the same calls in the same order (the front ends do).

    Args:
        group: a host-side group over every training rank (:func:`host_group`); None: the default group.
        device: where the exchanged tensor lives: the CPU (default); the accelerator only for a
            default group that cannot carry host tensors.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None) -> None:
        self.group = group
        self.device = device if device is not None else devices.cpu_device()
        #: This rank's preemption signal (0: none): the front end points it at its signal record.
        self.local_signal: Any = lambda: 0
        #: Collectives issued so far (for tests and reports).
        self.exchanges = 0
        self._agreed_signal: Optional[int] = None

    @classmethod
    def for_default_group(cls, device_type: str) -> StepAgreement:
        """The fallback without a front end: the default group, on host tensors when its backend takes them."""
        host_backend = devices.default_backend(devices.CPU)
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else host_backend
        host = host_backend in str(backend)
        return cls(None, devices.cpu_device() if host else torch.device(device_type))

    def _peers(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def exchange(self, flags: Sequence[int] = ()) -> list[int]:
        """All-reduce (MAX) this rank's signal and ``flags`` (small non-negative integers, as many on every rank).

        Returns the reduced flags (a collective); records the agreed signal for this step's :meth:`step_signal`.
        """
        values = [int(self.local_signal()), *flags]
        if self._peers():
            tensor = torch.tensor(values, dtype=torch.int32, device=self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
            values = tensor.tolist()  # a host tensor on a gloo group: no device synchronization
            self.exchanges += 1
        self._agreed_signal = values[0]
        return values[1:]

    def step_signal(self) -> int:
        """The largest signal any rank received, agreed for this optimizer step (0: none).

        Takes the signal agreed by this step's :meth:`exchange`, or exchanges it now when there
        was none (a collective then).
        """
        if self._agreed_signal is None:
            self.exchange()
        signal, self._agreed_signal = self._agreed_signal, None
        return int(signal or 0)

    def reset(self) -> None:
        """Forget an agreed signal not taken yet (a new ``fit``)."""
        self._agreed_signal = None
