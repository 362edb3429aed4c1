"""Ranks agreeing on the outcome of a step, so that a failure on one rank never leaves the others waiting.

Each check runs where it can (rank 0, or every rank) and its outcome goes through one collective:
every rank then raises the same error, or none does.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from hp_lightning.checkpoint.integrity import CorruptCheckpointError, UnsafeCheckpointError

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


_ERROR_TYPES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (FileNotFoundError, CorruptCheckpointError, UnsafeCheckpointError, ValueError, TypeError, KeyError, FileExistsError, OSError)
}


def _as_wire(error: Optional[BaseException]) -> Optional[tuple[str, str, Optional[int], Optional[str]]]:
    """(type name, message, errno, strerror): what another rank needs to raise the same error (``errno`` included)."""
    if error is None:
        return None
    name = type(error).__name__ if type(error).__name__ in _ERROR_TYPES else "RuntimeError"
    text = str(error) if name != "RuntimeError" else f"{type(error).__name__}: {error}"
    if isinstance(error, OSError) and isinstance(error.errno, int) and isinstance(error.strerror, str) and error.filename is None:
        return name, text, error.errno, error.strerror
    return name, text, None, None


def _raise_first(errors: Sequence[Optional[tuple[Any, ...]]], mine: Optional[BaseException]) -> None:
    for source, wire in enumerate(errors):
        if wire is None:
            continue
        if source == rank() and mine is not None:
            raise mine
        cls = _ERROR_TYPES.get(wire[0], RuntimeError)
        # The same message on every rank (so the job prints it once); where it arose goes in a note.
        code, strerror = (wire[2], wire[3]) if len(wire) == 4 else (None, None)
        error = cls(code, strerror) if code is not None and issubclass(cls, OSError) else cls(wire[1])
        if hasattr(error, "add_note"):
            error.add_note(f"(raised on rank {source}; this rank {rank()} reports it too)")
        raise error


def agree(error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank failed (the lowest rank's error), else return everywhere.

    A collective: callers catch their own failures and pass them here instead of raising on the spot.
    """
    errors: list[Any] = [_as_wire(error)]
    if dist.is_initialized():
        errors = [None] * world_size()
        dist.all_gather_object(errors, _as_wire(error))
    _raise_first(errors, error)


def on_rank0(fn: Callable[..., T]) -> T:
    """Run ``fn`` (no arguments) on rank 0 only and hand its result (or its error) to every rank."""
    result: Any = None
    error: Optional[BaseException] = None
    if rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - shared with every rank, then re-raised
            error = exc
    box = [(_as_wire(error), result)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    wire, result = box[0]
    _raise_first([wire], error)
    return result


def on_every_rank(fn: Callable[..., T]) -> T:
    """Run ``fn`` (no arguments) on every rank; if it fails anywhere, raise everywhere."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then re-raised
        result, error = None, exc
    agree(error)
    return result  # type: ignore[return-value]


def warn_rank0(message: str) -> None:
    """A warning printed once (by rank 0), not once per rank."""
    if rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)
