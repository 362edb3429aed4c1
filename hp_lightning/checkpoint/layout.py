"""What a checkpoint looks like on disk, how a reader recognizes one, and how a save is published.

A sharded checkpoint is a directory::

    epoch=0-step=40.ckpt/
        .metadata            DCP's index: every tensor, its global shape, which file holds which chunk
        __0_0.distcp ...     DCP's shard files, one or more per rank
        meta.pt              everything else Lightning saves (loops, callbacks, hyper-parameters, ...)
        hp_lightning.json    the manifest: format version, and the size and CRC-32s (SHA-256 too, if
                             asked) of every file: see :mod:`.integrity`

The manifest is written last, so its presence marks a complete save; the other names are Lightning's
``ModelParallelStrategy``'s. A full checkpoint is one ordinary Lightning ``torch.save`` file with an
extra ``"hp_lightning"`` entry holding the format version.

Publishing: a save is written under a staging name (``<name>.hp-partial-<token>``, never ``*.ckpt``,
so nothing picks up an unfinished save), then swapped into place by ``renameat2(RENAME_EXCHANGE)``
where the filesystem has it. Elsewhere the old entry is first renamed to ``<stem>.hp-prev-<token><suffix>``
(still a complete checkpoint ``ckpt_path="last"`` finds), then the staging entry takes its place;
:func:`recover` finishes a swap a kill interrupted.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import functools
import gc
import json
import os
import shutil
import sys
import threading
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch

from hp_lightning._version import __version__
from hp_lightning.checkpoint.integrity import CorruptCheckpointError, check_contained, open_regular, verify_records, verify_zip
from hp_lightning.checkpoint.unpickle import torch_load

#: Version of the layout above. Loaders refuse newer versions instead of misreading them.
FORMAT_VERSION = 1
#: Lightning's name for the non-tensor part of a sharded checkpoint.
META_FILE = "meta.pt"
#: DCP's index file in a checkpoint directory.
DCP_METADATA_FILE = ".metadata"
#: hp_lightning's manifest; written last, so it also marks a finished save.
MANIFEST_FILE = "hp_lightning.json"
#: Key of hp_lightning's record inside a full (single-file) checkpoint.
FULL_INFO_KEY = "hp_lightning"
#: Where the model's state sits in a checkpoint (hp_lightning, Lightning, ModelParallelStrategy).
MODEL_KEY = "state_dict"
#: Where Lightning's FSDPStrategy puts it in its sharded checkpoints.
FSDP_MODEL_KEY = "model"
#: Lightning's list of optimizer states; in a sharded checkpoint they are ``optimizer_0``, ``optimizer_1`` ...
OPTIMIZER_KEY = "optimizer_states"
#: Lightning's list of LR scheduler states.
SCHEDULERS_KEY = "lr_schedulers"
#: The Lightning version that wrote a checkpoint; Lightning's Trainer refuses one without it.
VERSION_KEY = "pytorch-lightning_version"
#: Where a save by hp_lightning's Fabric strategy records the ``state`` keys of its model, optimizers
#: and schedulers, and which layout holds them (``"fabric"``: the keys themselves; ``"trainer"``).
FABRIC_RECORD_KEY = "hp_lightning_fabric"


@dataclass(frozen=True)
class StateKeys:
    """Where a Lightning Fabric single-file checkpoint keeps each part: the ``state`` keys of ``fabric.save``."""

    model: str
    optimizers: tuple[str, ...] = ()
    schedulers: tuple[str, ...] = ()

    @classmethod
    def recorded(cls, checkpoint: Mapping[str, Any]) -> Optional[StateKeys]:
        """The keys a Fabric-layout save of ours recorded (None without such a record, or a malformed one)."""
        record = checkpoint.get(FABRIC_RECORD_KEY)
        if not isinstance(record, Mapping) or record.get("layout") != "fabric":
            return None
        model, optimizers, schedulers = record.get("model"), record.get("optimizers", []), record.get("lr_schedulers", [])
        names = [*optimizers, *schedulers] if isinstance(optimizers, list) and isinstance(schedulers, list) else [None]
        if not isinstance(model, str) or not all(isinstance(n, str) for n in names):
            return None
        return cls(model, tuple(optimizers), tuple(schedulers))


def in_trainer_layout(checkpoint: dict[str, Any], keys: Optional[StateKeys]) -> Optional[dict[str, Any]]:
    """A Lightning Fabric single-file checkpoint (``{"model": ..., "optimizer": ..., "step": ...}``) in the
    Trainer's layout, by ``keys`` or by the keys a save of ours recorded; None when it is neither.

    The result records the keys (:data:`FABRIC_RECORD_KEY`), so the Fabric strategy knows which entries were the user's.
    """
    keys = keys or StateKeys.recorded(checkpoint)
    model = checkpoint.get(keys.model) if keys is not None else None
    if keys is None or not isinstance(model, Mapping) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        return None
    parts = {keys.model, MODEL_KEY, *keys.optimizers, *keys.schedulers}  # our saves hold the model under both keys
    out = {k: v for k, v in checkpoint.items() if k not in parts}
    out[MODEL_KEY] = dict(model)
    out[OPTIMIZER_KEY] = [checkpoint[k] for k in keys.optimizers if k in checkpoint]
    out[SCHEDULERS_KEY] = [checkpoint[k] for k in keys.schedulers if k in checkpoint]
    out.setdefault(VERSION_KEY, "unknown (Lightning Fabric)")  # resumable state, not a bare weights file
    out[FABRIC_RECORD_KEY] = {
        "model": keys.model, "optimizers": list(keys.optimizers), "lr_schedulers": list(keys.schedulers), "layout": "fabric",
    }
    return out
#: Marks a save in progress (or one a kill interrupted); loaders refuse these names.
STAGING_MARKER = ".hp-partial-"
#: Marks an entry being deleted; it disappears from its real name in one rename first.
TRASH_MARKER = ".hp-trash-"
#: Marks the previous checkpoint set aside while its replacement is renamed in (no atomic exchange).
PREVIOUS_MARKER = ".hp-prev-"
#: Inside every staging, set-aside and trash directory we make: the token its name carries. Cleanup removes
#: only entries holding it, so a user's ``model.ckpt.hp-partial-notes`` beside a checkpoint is never touched.
TOKEN_FILE = ".hp-lightning-token"


class CheckpointKind(enum.Enum):
    """The formats :func:`classify` recognizes."""

    HP_SHARDED = "hp_lightning sharded directory"
    LIGHTNING_SHARDED = "Lightning sharded directory (ModelParallelStrategy / FSDPStrategy)"
    FULL_FILE = "single-file checkpoint"


# ---------------------------------------------------------------- recognizing a checkpoint


def classify(path: Path) -> CheckpointKind:
    """Say which format ``path`` holds, or raise (FileNotFoundError, ValueError) saying why it is not a loadable checkpoint."""
    path = Path(path)
    if STAGING_MARKER in path.name:
        target = path.name.split(STAGING_MARKER, 1)[0]
        raise ValueError(
            f"{str(path)!r} is the staging entry of a save that did not finish (a kill or a crash "
            f"interrupted it); it may be incomplete and is never loaded. Load the checkpoint it was "
            f"meant to replace, {str(path.with_name(target))!r}, or an earlier one."
        )
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} is a link to {os.readlink(path)!r}, which does not exist: that save never "
            f"finished (ModelCheckpoint(save_last='link') links before an async_save is published) or it was "
            f"removed. Resume from a complete checkpoint by name.{_nearby_hint(path)}"
        )
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.{_nearby_hint(path)}")
    if path.is_file():
        return CheckpointKind.FULL_FILE
    if not path.is_dir():
        raise ValueError(f"Checkpoint {str(path)!r} is neither a file nor a directory.")
    if (path / MANIFEST_FILE).exists():  # a FIFO in its place too: read_manifest refuses it, not skipped
        check_version(read_manifest(path), path / MANIFEST_FILE)
        return CheckpointKind.HP_SHARDED
    has_index = (path / DCP_METADATA_FILE).is_file()
    if has_index and (path / META_FILE).is_file():
        check_contained(path, [DCP_METADATA_FILE, META_FILE], what="its layout")
        if _written_by_hp_lightning(path / META_FILE):
            raise ValueError(
                f"{str(path)!r} was written by hp_lightning but its completion mark {MANIFEST_FILE!r} is "
                f"missing (deleted, or lost in a partial copy), so nothing vouches that its shards are "
                f"whole; it is refused rather than loaded unverified. Copy the whole checkpoint directory "
                f"again, or resume from another checkpoint."
            )
        return CheckpointKind.LIGHTNING_SHARDED
    entries = sorted(p.name for p in path.iterdir())
    if has_index:
        raise ValueError(
            f"{str(path)!r} holds a DCP index but neither {MANIFEST_FILE!r} (hp_lightning) nor "
            f"{META_FILE!r} (Lightning): the trainer state is missing, so it is an incomplete copy "
            f"or a bare torch.distributed.checkpoint directory. Copy the whole checkpoint directory again."
        )
    raise ValueError(
        f"{str(path)!r} is a directory but not a checkpoint: expected {MANIFEST_FILE!r} (hp_lightning "
        f"sharded) or {DCP_METADATA_FILE!r} + {META_FILE!r} (Lightning sharded); it holds "
        f"{entries[:8]}{' ...' if len(entries) > 8 else ''}. Pass the checkpoint directory itself "
        f"(e.g. '.../checkpoints/epoch=0-step=100.ckpt'), not its parent."
    )


def _written_by_hp_lightning(meta_file: Path) -> bool:
    """Whether a sharded checkpoint's trainer-state file carries hp_lightning's producer record."""
    try:  # safe loading always: this is only a guess at the producer, the load itself decides what to trust
        meta = torch_load(meta_file, weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable or refused: the loader reports it with its own message
        return False
    return isinstance(meta, Mapping) and isinstance(meta.get(FULL_INFO_KEY), Mapping)


def _nearby_hint(path: Path) -> str:
    parent = path.parent
    if not parent.is_dir():
        return f" Its folder {str(parent)!r} does not exist either."
    names = sorted(p.name for p in parent.iterdir() if p.name.endswith(".ckpt") and STAGING_MARKER not in p.name)
    if not names:
        return f" Its folder {str(parent)!r} holds no '*.ckpt' checkpoint."
    return f" Checkpoints in {str(parent)!r}: {names[:10]}{' ...' if len(names) > 10 else ''}."


def check_version(record: Mapping[str, Any], where: Path) -> None:
    """Refuse a missing, malformed or newer ``format_version`` (a newer layout could be misread silently)."""
    version = record.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(
            f"{str(where)!r} has no valid 'format_version' (got {version!r}); the file was altered or not written by hp_lightning."
        )
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{str(where)!r} was written in checkpoint format {version} by hp_lightning "
            f"{record.get('hp_lightning_version', '?')}; this hp_lightning ({__version__}) reads formats up "
            f"to {FORMAT_VERSION}. Upgrade hp_lightning (pip install -U hp-lightning) to load it."
        )


# ---------------------------------------------------------------- writing, and the manifest


def write_error(exc: BaseException, path: Path, *, source: str = "") -> OSError:
    """An ``OSError`` that names the cause (with ``source``, e.g. ``"rank 1: "``) and the path, for a write that failed.

    A full disk says "No space left on device" with the free space left; ``torch.save`` (so every DCP
    shard write) reports one as ``RuntimeError: ... unexpected pos N vs M``.
    """
    target = Path(path)
    folder = next((p for p in (target.parent, *target.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(folder).free
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc) or "unexpected pos" in str(exc) or free < (1 << 20):
        return OSError(
            errno.ENOSPC,
            f"No space left on device while writing checkpoint {str(target)!r} ({free:,} bytes free on "
            f"{str(folder)!r}); nothing was published and the previous checkpoint of that name is untouched. "
            f"Free space or save elsewhere",
        )
    cause = f"{source}{type(exc).__name__}: {exc}" if source else str(exc)
    return OSError(getattr(exc, "errno", None) or errno.EIO, f"Could not write checkpoint {str(target)!r}: {cause}")


def refuse_foreign(path: Path, *, overwrite: bool, what: str) -> None:
    """Refuse to replace ``path`` unless it is a checkpoint and ``overwrite`` is True: no user file is deleted by mistake.

    Raises FileExistsError without ``overwrite``, ValueError when ``path`` is not a checkpoint (naming what is there).
    """
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{what}: {str(path)!r} already exists; choose a new path, or pass --overwrite to replace it.")
    try:
        kind = classify(path)
        problem = verify_zip(path) if kind is CheckpointKind.FULL_FILE else None
    except (ValueError, OSError) as exc:
        problem = str(exc)
    if problem is not None:
        entries = sorted(p.name for p in path.iterdir())[:6] if path.is_dir() else []
        raise ValueError(
            f"{what}: {str(path)!r} exists and is not a checkpoint ({problem}{'; it holds ' + str(entries) if entries else ''}); "
            f"it is never replaced, since that would delete files this program did not write. Choose another path."
        )


def write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    """Write the manifest durably (temp file, fsync, rename): its appearance marks the save complete."""
    tmp = root / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST_FILE)
    fsync_dir(root)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a sharded checkpoint; CorruptCheckpointError when it is not valid JSON or lacks its file records."""
    where = root / MANIFEST_FILE
    check_contained(root, [MANIFEST_FILE], what="its manifest")
    try:
        with open_regular(where) as f:
            manifest = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{str(where)!r} is damaged (not valid JSON: {exc}); restore the checkpoint from a good copy.") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"{str(where)!r} is damaged: it has no 'files' table; restore the checkpoint from a good copy.")
    check_contained(root, list(manifest["files"]), what=f"its manifest {str(where)!r}")
    return manifest


def data_files(root: Path) -> list[str]:
    """Every file of a sharded checkpoint that the manifest records (all but the manifest itself)."""
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.name not in (MANIFEST_FILE, TOKEN_FILE) and not p.name.endswith(".tmp"))


# ---------------------------------------------------------------- publishing and removing


def staging_path(path: Path, token: str) -> Path:
    return path.with_name(f"{path.name}{STAGING_MARKER}{token}")


def new_staging(path: Path) -> Path:
    """A fresh staging directory for a save of ``path``, marked as ours (a single file goes inside it under its name)."""
    token = new_token()
    staging = staging_path(path, token)
    staging.mkdir()
    _mark(staging, token)
    return staging


def _mark(entry: Path, token: str) -> None:
    with open(entry / TOKEN_FILE, "w") as f:
        f.write(token)


def is_ours(entry: Path, marker: str) -> bool:
    """Whether ``entry`` (a staging, set-aside or trash name) was made by hp_lightning: a real directory whose
    :data:`TOKEN_FILE` holds the token its name carries. Only such entries are ever deleted or moved by name."""
    token = entry.name.split(marker, 1)[-1]
    if marker == PREVIOUS_MARKER and "." in token:
        token = token.split(".", 1)[0]
    if len(token) != 12 or entry.is_symlink() or not entry.is_dir():
        return False
    try:
        with open_regular(entry / TOKEN_FILE) as f:
            return f.read(64).decode("ascii", "replace") == token
    except (OSError, ValueError):
        return False


def new_token() -> str:
    return uuid.uuid4().hex[:12]


_F = TypeVar("_F", bound=Callable[..., Any])
#: Calls inside :func:`cyclic_gc_paused` now (any thread), and whether the collector ran before the first.
_gc_pause = {"depth": 0, "was_enabled": False}
_gc_pause_lock = threading.Lock()


def cyclic_gc_paused(fn: _F) -> _F:
    """Run ``fn`` with Python's cyclic garbage collector paused (reference counting still frees everything).

    A save or load allocates tens of thousands of short-lived objects, which trigger full collections
    that walk every object of the process (0.3 s measured, in a 0.2 s resume). Calls nest and may
    overlap across threads: the collector resumes, if it ran before, when the last one returns.
    """

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with _gc_pause_lock:
            if _gc_pause["depth"] == 0:
                _gc_pause["was_enabled"] = gc.isenabled()
                gc.disable()
            _gc_pause["depth"] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _gc_pause_lock:
                _gc_pause["depth"] -= 1
                if _gc_pause["depth"] == 0 and _gc_pause["was_enabled"]:
                    gc.enable()

    return paused  # type: ignore[return-value]


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing entries with ``renameat2(RENAME_EXCHANGE)``; False where the platform or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(err)}", str(a), None, str(b))


def previous_path(path: Path, token: str) -> Path:
    """Where the previous checkpoint waits while its replacement is renamed in; keeps the ``.ckpt`` suffix."""
    return path.with_name(f"{path.stem}{PREVIOUS_MARKER}{token}{path.suffix}")


def publish(staging: Path, path: Path) -> None:
    """Move a finished save into place; the target name never holds a half-written checkpoint."""
    if not (path.exists() or path.is_symlink()):
        os.rename(staging, path)
    elif path.is_symlink() or not exchange(staging, path):
        swap_by_renames(staging, path)
        return
    else:
        _delete(staging)  # after the exchange it holds the previous checkpoint
    fsync_dir(path.parent)


def _move_apart(path: Path, apart: Callable[[str], Path]) -> Path:
    """Move checkpoint ``path`` to the marked directory ``apart(token)``: a directory is marked and renamed
    there; a file is renamed into a new marked directory, under its own name."""
    token = new_token()
    target = apart(token)
    if path.is_dir() and not path.is_symlink():
        _mark(path, token)
        os.rename(path, target)
    else:
        target.mkdir()
        _mark(target, token)
        os.rename(path, target / path.name)
    return target


def set_aside(path: Path) -> Path:
    """Move the current checkpoint to its ``.hp-prev-`` name (marked as ours); return that name."""
    return _move_apart(path, lambda token: previous_path(path, token))


def swap_by_renames(staging: Path, path: Path) -> None:
    """Replace ``path`` without atomic exchange: set the old entry aside, rename the new one in, delete the old.

    A kill between the two renames leaves no ``path`` but two complete entries; :func:`recover` handles it.
    """
    previous = set_aside(path)
    os.rename(staging, path)
    fsync_dir(path.parent)
    _delete(previous)


def remove(path: Path) -> None:
    """Delete a checkpoint of either format; it leaves its real name in one rename before deletion."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        _delete(_move_apart(path, lambda token: path.with_name(f"{path.name}{TRASH_MARKER}{token}")))


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _siblings(path: Path, marker: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    if marker == PREVIOUS_MARKER and path.suffix:
        prefix, suffix = f"{path.stem}{marker}", path.suffix
    else:
        prefix, suffix = f"{path.name}{marker}", ""
    return [p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(suffix) and is_ours(p, marker)]


def is_complete(entry: Path) -> bool:
    """Whether a staging entry holds a whole save (used only to finish an interrupted swap)."""
    try:
        if entry.is_dir():
            manifest = read_manifest(entry)
            return not verify_records(entry, manifest["files"], manifest["files"])
        return entry.is_file() and zipfile.is_zipfile(entry) and verify_zip(entry) is None
    except (OSError, ValueError):
        return False


def recover(path: Path) -> Path | None:
    """Finish a swap a kill interrupted: if ``path`` is gone, move the newest complete save of it there; return that entry."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        return None
    # The newest complete save first: it finished writing and only its publish was cut short.
    for marker in (STAGING_MARKER, PREVIOUS_MARKER):
        complete = [p for p in _siblings(path, marker) if is_complete(_payload(p, path))]
        if complete:
            newest = max(complete, key=lambda p: _payload(p, path).stat().st_mtime)
            os.rename(_payload(newest, path), path)
            if newest.exists():
                _delete(newest)  # the marked directory a single file was kept in
            fsync_dir(path.parent)
            return newest
    return None


def _payload(entry: Path, path: Path) -> Path:
    """What a marked entry holds for ``path``: a single file under ``path``'s name inside it, or the directory itself."""
    inner = entry / path.name
    return inner if inner.is_file() and not inner.is_symlink() else entry


def clean_stale(path: Path) -> list[Path]:
    """Delete the staging, set-aside and trash entries of ``path`` killed saves left, only those marked as ours
    (:func:`is_ours`). Run :func:`recover` first: one of them may be the only complete copy."""
    stale = _siblings(path, STAGING_MARKER) + _siblings(path, PREVIOUS_MARKER) + _siblings(path, TRASH_MARKER)
    for entry in stale:
        _delete(entry)
    return stale
