"""Fabric's ``state`` dicts and the two checkpoint layouts, so either front end (and Lightning's own Fabric) reads the other's.

A full (single-file) save is in Lightning Fabric's own layout (the ``state`` keys as given, full
state dicts). A sharded save writes what ``Trainer.save_checkpoint`` writes:

=====================================  =====================================================
Fabric ``state`` entry                 checkpoint entry (the Trainer's names)
=====================================  =====================================================
the sharded model (exactly one)        ``"state_dict"``: parameter name -> tensor
optimizers, in ``state`` order         ``"optimizer_states"``: a list, keyed by parameter name
LR schedulers, in ``state`` order      ``"lr_schedulers"``: a list of their ``state_dict()``
anything else                          stored under its own key (``state_dict()`` of objects
                                       that have one, the value itself otherwise)
=====================================  =====================================================

Both carry ``"pytorch-lightning_version"`` and a record of the ``state`` keys (:data:`RECORD_KEY`),
so a load with several optimizers matches them by name and the Trainer reads a Fabric-layout file
(:func:`hp_lightning.checkpoint.layout.in_trainer_layout`). Without a record (a Trainer checkpoint)
optimizers and schedulers are matched in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hp_lightning import checkpoint as checkpoint_io
from hp_lightning.checkpoint.integrity import check_contained
from hp_lightning.checkpoint.layout import FABRIC_RECORD_KEY, FULL_INFO_KEY, META_FILE, MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, VERSION_KEY
from hp_lightning.checkpoint.unpickle import torch_load

#: Where a Fabric-written checkpoint records the ``state`` keys of its model, optimizers and schedulers.
RECORD_KEY = FABRIC_RECORD_KEY
#: Keys the mapping itself writes: a ``state`` entry of another kind may not use them.
RESERVED_KEYS = (MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, VERSION_KEY, RECORD_KEY, FULL_INFO_KEY)


def is_sharded_module(obj: Any) -> bool:
    """Whether ``obj`` is a module sharded with FSDP2 (by this strategy or by the user's ``fully_shard``)."""
    if not isinstance(obj, nn.Module):
        return False
    return isinstance(obj, FSDPModule) or any(isinstance(p, DTensor) for p in obj.parameters())


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass
class StateParts:
    """A Fabric ``state`` dict sorted by what each entry becomes in the checkpoint."""

    model_key: str
    model: nn.Module
    optimizers: list[tuple[str, Optimizer]] = field(default_factory=list)
    schedulers: list[tuple[str, LRScheduler]] = field(default_factory=list)
    others: dict[str, Any] = field(default_factory=dict)


def split_state(state: Mapping[str, Any], call: str) -> StateParts:
    """Sort ``state`` into the sharded model, optimizers, schedulers and everything else (``call``: for the messages).

    Raises:
        TypeError: when ``state`` is not a dict with string keys.
        ValueError: with no sharded model or several in ``state`` (one model per checkpoint), or
            when a plain entry uses a key the checkpoint layout reserves.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"{call}(path, state) expects a dict such as {{'model': model, 'optimizer': optimizer}}; got {type(state).__name__}.")
    models = [(k, v) for k, v in state.items() if is_sharded_module(v)]
    if not models:
        raise ValueError(
            f"{call}(path, state) found no sharded model in state (keys {sorted(map(str, state))}). Pass the "
            f"model returned by fabric.setup(...) / fabric.setup_module(...): state={{'model': model, 'optimizer': optimizer}}."
        )
    if len(models) > 1:
        raise ValueError(
            f"{call}(path, state) found {len(models)} sharded models ({[k for k, _ in models]}); a checkpoint holds one "
            f"model, as the Trainer's does. Save each model to its own path."
        )
    parts = StateParts(model_key=models[0][0], model=models[0][1])
    for key, value in state.items():
        if key == parts.model_key:
            continue
        if not isinstance(key, str):
            raise TypeError(f"{call}(path, state) expects string keys; got {key!r}.")
        if isinstance(value, Optimizer):
            parts.optimizers.append((key, value))
        elif isinstance(value, LRScheduler):
            parts.schedulers.append((key, value))
        elif key in RESERVED_KEYS:
            raise ValueError(
                f"{call}(path, state) cannot store {key!r}: the checkpoint layout shared with the Trainer uses that key "
                f"itself. Rename the entry, e.g. to {'my_' + key!r}."
            )
        else:
            parts.others[key] = value
    return parts


def to_checkpoint(parts: StateParts, *, full: bool) -> dict[str, Any]:
    """The checkpoint dict for ``parts`` (a collective), in Fabric's full layout or the Trainer's sharded one."""
    model = parts.model
    record = {
        "model": parts.model_key,
        "optimizers": [k for k, _ in parts.optimizers],
        "lr_schedulers": [k for k, _ in parts.schedulers],
        "layout": "fabric" if full else "trainer",
    }
    checkpoint: dict[str, Any]
    if full:
        weights = checkpoint_io.model_state_dict(model, full=True)
        checkpoint = {
            parts.model_key: weights,
            # The same tensors under Lightning's key too (torch.save writes each storage once): the file
            # also loads with plain LightningModule.load_from_checkpoint.
            MODEL_KEY: weights,
            **{key: checkpoint_io.optimizer_state_dict(model, opt, full=True) for key, opt in parts.optimizers},
            **{key: scheduler.state_dict() for key, scheduler in parts.schedulers},
        }
    else:
        checkpoint = {
            MODEL_KEY: checkpoint_io.model_state_dict(model, full=False),
            OPTIMIZER_KEY: [checkpoint_io.optimizer_state_dict(model, opt, full=False) for _, opt in parts.optimizers],
            SCHEDULERS_KEY: [scheduler.state_dict() for _, scheduler in parts.schedulers],
        }
    checkpoint.update({VERSION_KEY: lightning.__version__, RECORD_KEY: record})
    for key, value in parts.others.items():
        checkpoint[key] = value.state_dict() if _is_stateful(value) else value
    return checkpoint


def read_record(path: Path, weights_only: Optional[bool]) -> Optional[dict[str, Any]]:
    """The ``state`` keys a Fabric save recorded at ``path`` (None for a Trainer checkpoint or an unreadable one).

    Reads only ``meta.pt`` of a directory; a single file is memory-mapped. Errors are left to the load.
    """
    try:
        if path.is_dir():
            check_contained(path, [META_FILE], what="its trainer state")
            meta = torch_load(path / META_FILE, weights_only=weights_only)  # safe unless weights_only=False
        else:
            meta = checkpoint_io.read_full_file(path, weights_only=weights_only, verify=False)
    except Exception:  # noqa: BLE001 - the load that follows raises the right error
        return None
    record = meta.get(RECORD_KEY) if isinstance(meta, Mapping) else None
    return dict(record) if isinstance(record, Mapping) else None


def in_stored_order(entries: list[tuple[str, Any]], stored: Optional[list[str]], kind: str, source: str) -> list[tuple[str, Any]]:
    """``entries`` (``state`` key, object) in the order the checkpoint recorded them, else in ``state`` order.

    Raises:
        ValueError: when a Fabric checkpoint recorded other keys for several entries of ``kind``.
    """
    if stored is None or len(entries) < 2 or len(stored) != len(entries):
        return entries  # a count mismatch is reported by the load, which knows the stored count
    by_key = dict(entries)
    if set(by_key) != set(stored):
        raise ValueError(
            f"Checkpoint {source} stores {kind} under the state keys {stored}; this load passes {sorted(by_key)}. "
            f"Use the keys of the save, so each state goes to the right object."
        )
    return [(key, by_key[key]) for key in stored]


def restore_rest(
    parts: StateParts, rest: dict[str, Any], state: dict[str, Any], *, strict: bool, source: str,
    scheduler_order: list[tuple[str, LRScheduler]],
) -> dict[str, Any]:
    """Restore schedulers and plain entries of ``state`` from ``rest`` (what the load returned); return the remainder.

    Objects with ``load_state_dict`` are restored in place; other entries are replaced in ``state``.

    Raises:
        KeyError: with ``strict``, for a requested entry or scheduler the checkpoint does not hold.
    """
    rest = dict(rest)
    record = rest.pop(RECORD_KEY, None)
    rest.pop(FULL_INFO_KEY, None)
    schedulers = rest.get(SCHEDULERS_KEY) or []
    if record is not None or scheduler_order:
        rest.pop(SCHEDULERS_KEY, None)  # consumed here (a Trainer checkpoint's stay when nobody asks for them)
    if record is not None:
        rest.pop(VERSION_KEY, None)  # written by fabric.save itself, not by the user
    for index, (key, scheduler) in enumerate(scheduler_order):
        if index < len(schedulers):
            scheduler.load_state_dict(schedulers[index])
        elif strict:
            raise KeyError(
                f"Checkpoint {source} holds {len(schedulers)} LR scheduler state(s); state asks for {key!r} as number "
                f"{index + 1}. Pass strict=False to start it fresh."
            )
    missing = [k for k in parts.others if k not in rest]
    if missing and strict:
        raise KeyError(
            f"The requested state contains the key {missing[0]!r}, which checkpoint {source} does not hold. "
            f"Pass strict=False to leave missing entries as they are."
        )
    for key, value in parts.others.items():
        if key not in rest:
            continue
        stored = rest.pop(key)
        if _is_stateful(value):
            value.load_state_dict(stored)
        else:
            state[key] = stored
    return rest
