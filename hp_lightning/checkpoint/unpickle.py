"""What unpickles: the pickled parts of a checkpoint, rebuilt without running code from them unless asked.

A pickle can have the reader call any importable callable, so each kind is unpickled safely by
default: ``torch.save`` files by :func:`torch_load`; DCP's index (a bare ``pickle.load`` in torch) by
:func:`unpickle_index`, which checks every instruction first (:class:`IndexPolicy`) and rebuilds only
DCP's classes; DCP's non-tensor entries by :func:`load_entry` with torch's safe loader; its tensor
archives by torch's own ``torch.load(weights_only=True)``. Declared sizes are checked first (:mod:`.integrity`).

``weights_only=None`` is torch's default: safe, with torch's two environment overrides.
"""

from __future__ import annotations

import enum
import functools
import importlib
import io
import os
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Optional

import torch

from hp_lightning.checkpoint import opcodes
from hp_lightning.checkpoint.integrity import LEGACY_TORCH_HEAD, OPT_IN, CorruptCheckpointError, UnsafeCheckpointError, check_archive, open_regular
from hp_lightning.core import devices


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: Optional[bool]) -> bool:
    """Whether to unpickle safely: ``None`` is torch's default (True), with torch's two environment overrides.

    TypeError for anything but None, True or False (a typo such as ``"False"`` must not decide this).
    """
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"weights_only expects None (safe, torch's default), True or False; got {weights_only!r}.")
    if _env_flag("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if weights_only is None:
        return not _env_flag("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    return weights_only


def refusal(where: str, refused: list[str], *, entry: Optional[str] = None) -> UnsafeCheckpointError:
    """The error for a pickle that safe loading will not rebuild: the file, the types, the opt-in."""
    what = f"entry {entry!r} of {where}" if entry else where
    types = ", ".join(refused[:6]) + (f" and {len(refused) - 6} more" if len(refused) > 6 else "") if refused else "a type it does not allow"
    return UnsafeCheckpointError(
        f"Refused to unpickle {what}: it needs {types}, which safe loading does not rebuild, because "
        f"unpickling it could run code stored in the file. If you trust this file (you or a colleague "
        f"wrote it), load it with {OPT_IN}. If the type is your own plain-data class, allow it once with "
        f"torch.serialization.add_safe_globals([...]) instead. To share weights with others, prefer "
        f".safetensors, which holds no code."
    )


def _refusal_or_damage(source: IO[bytes], where: str, entry: Optional[str] = None) -> ValueError:
    """What an ``UnpicklingError`` from ``torch.load(weights_only=True)`` of ``source`` means: a refusal
    when the file names globals safe loading does not allow, else damage (which must not suggest the opt-in)."""
    try:
        source.seek(0)
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # noqa: BLE001 - not even its globals can be listed: damaged
        refused = []
    if refused:
        return refusal(where, refused, entry=entry)
    what = f"entry {entry!r} of {where}" if entry else where
    return CorruptCheckpointError(
        f"Could not read checkpoint {what}: its pickle does not parse under torch's safe loader, and it names no type "
        f"that safe loading refuses; it is damaged or not a torch checkpoint."
    )


def torch_load(path: Path, *, weights_only: Optional[bool]) -> Any:
    """``torch.load`` a checkpoint file onto the CPU, safely by default, its declared sizes checked first.

    Not memory-mapped: torch's mmap reading trusts each record's declared length and would read past a
    short record. Under safe loading torch's legacy (non-zip) format is refused: it allocates every
    storage at the size its pickle declares.
    """
    safe = resolve_weights_only(weights_only)
    path = Path(path)
    where = repr(str(path))
    with open_regular(path) as stream:
        size = os.fstat(stream.fileno()).st_size
        if safe and not zipfile.is_zipfile(stream):
            legacy = stream.read(len(LEGACY_TORCH_HEAD)) == LEGACY_TORCH_HEAD
            raise CorruptCheckpointError(
                f"Could not read checkpoint {where}: it is in torch's legacy (pre-1.6) format, which allocates whatever sizes its "
                f"pickle declares, so safe loading does not read it. If you trust the file, load it with {OPT_IN}, then save "
                f"it again with a current torch." if legacy else
                f"Could not read checkpoint {where}: it is not a torch.save zip archive ({size:,} bytes); it is damaged or not a checkpoint."
            )
        if safe:
            check_archive(stream, size, where, compressed=True)
        try:
            loaded = torch.load(stream, map_location=devices.cpu_device(), weights_only=safe)
        except Exception as exc:  # noqa: BLE001 - unpickling damaged bytes can raise almost anything (RecursionError too)
            if safe and isinstance(exc, pickle.UnpicklingError):
                raise _refusal_or_damage(stream, where) from None
            raise CorruptCheckpointError(f"Could not read checkpoint {where}: {type(exc).__name__}: {str(exc)[:500]}") from None
    if _depth(loaded) > MAX_DEPTH:
        raise CorruptCheckpointError(
            f"Could not read checkpoint {where}: its containers nest more than {MAX_DEPTH} levels deep, which no checkpoint "
            f"does and every recursive reader after this one (torch.save, Lightning) would fail on; it was crafted or damaged."
        )
    return loaded


#: How deep a checkpoint's dicts, lists and tuples may nest (Python's recursion limit is about 1000).
MAX_DEPTH = 200


def _depth(value: Any) -> int:
    """How deep ``value``'s dicts, lists and tuples nest (walked without recursion, stopping past :data:`MAX_DEPTH`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def load_entry(value: io.BytesIO, source: Path, fqn: str, *, safe: bool) -> Any:
    """DCP's non-tensor entry ``fqn`` of directory ``source`` unpickled with ``torch.load``: with torch's safe
    loader, its archive bounded first, unless ``safe`` is False."""
    if safe:
        check_archive(value, len(value.getbuffer()), f"Entry {fqn!r} of {str(source)!r}")
    try:
        return torch.load(value, weights_only=safe)
    except Exception as exc:  # noqa: BLE001 - named: entry and directory
        if safe and isinstance(exc, pickle.UnpicklingError):
            raise _refusal_or_damage(value, repr(str(source)), entry=fqn) from None
        raise CorruptCheckpointError(
            f"Entry {fqn!r} of {str(source)!r} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged."
        ) from None


# ---------------------------------------------------------------- DCP's index

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: DCP's metadata classes (``NEWOBJ``, then ``BUILD`` of their fields). Two are private to torch (``_StorageInfo``,
#: ``_MEM_FORMAT_ENCODING``) but in every index: :func:`_index_allowlist` resolves each and fails loudly without one.
INDEX_CLASSES: tuple[tuple[str, str], ...] = (
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
#: What else an index calls (``REDUCE``): sizes, an ordered dict, a layout by name, a path, DCP's enum by value.
INDEX_CALLS: tuple[tuple[str, str], ...] = (
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
)
#: DCP's enums: Python 3.11.0-3.11.4 pickle a member as ``getattr(EnumClass, "NAME")``, later versions by value.
INDEX_ENUMS: tuple[tuple[str, str], ...] = ((_DCP_METADATA, "_MEM_FORMAT_ENCODING"),)


class IndexAllowlist:
    """What a DCP index may name, call and fill, resolved against the installed torch (:func:`_index_allowlist`)."""

    def __init__(self, classes: dict[str, type], calls: frozenset[str], enums: dict[str, type[enum.Enum]]) -> None:
        self.classes, self.calls, self.enums = classes, calls, enums
        self.buildable = frozenset(classes) | {"collections.OrderedDict"}
        #: Classes with their own ``__setstate__`` (``TensorProperties``: a tuple state); the rest take a field dict.
        self.setstate = frozenset(name for name, cls in classes.items() if "__setstate__" in vars(cls))
        #: Named but never called: dtypes, memory formats, layouts (torch pickles each as the global itself).
        self.values = frozenset(f"torch.{name}" for name, value in vars(torch).items() if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)))
        self.names = frozenset(self.classes) | self.calls | frozenset(self.enums) | self.values | {"builtins.getattr"}


def resolve_index_names(names: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Each ``(module, name)`` of torch's that a DCP index names, imported for real; ImportError naming any this torch lacks."""
    found: dict[str, Any] = {}
    missing: list[str] = []
    for module, name in names:
        try:
            value: Any = importlib.import_module(module)
            for part in name.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{name}")
            continue
        found[f"{module}.{name}"] = value
    if missing:
        raise ImportError(
            f"hp_lightning's safe reader of DCP checkpoint indexes needs {missing}, which DCP writes into every index "
            f"(private names among them), but torch {torch.__version__} lacks them. Install the torch release hp_lightning "
            f"pins (pyproject.toml), or update the allowlist in hp_lightning/checkpoint/unpickle.py (INDEX_CLASSES, INDEX_CALLS)."
        )
    return found


@functools.lru_cache(maxsize=1)
def _index_allowlist() -> IndexAllowlist:
    """Resolved at the first index read, not at import: ``import hp_lightning`` works on any torch."""
    resolved = resolve_index_names(tuple(dict.fromkeys((*INDEX_CLASSES, *INDEX_CALLS, *INDEX_ENUMS))))
    return IndexAllowlist(
        classes={f"{m}.{n}": resolved[f"{m}.{n}"] for m, n in INDEX_CLASSES},
        calls=frozenset(f"{m}.{n}" for m, n in INDEX_CALLS),
        enums={f"{m}.{n}": resolved[f"{m}.{n}"] for m, n in INDEX_ENUMS},
    )


class IndexPolicy(opcodes.Policy):
    """A DCP index's instructions: ``NEWOBJ`` only of DCP's metadata classes, ``REDUCE`` only of :data:`INDEX_CALLS`
    (and ``getattr`` of a member of DCP's enums), ``BUILD`` only onto a DCP object the index made, with a field dict."""

    def __init__(self, allow: IndexAllowlist) -> None:
        self.allow = allow

    def named(self, module: str, name: str) -> opcodes.Value:
        full = f"{module}.{name}"
        if full in self.allow.names:
            return opcodes.Global(full)
        raise opcodes.PickleRefused(full)

    def call(self, func: opcodes.Value, args: tuple, opcode: str) -> opcodes.Value:
        if isinstance(func, opcodes.Global):
            if opcode != "REDUCE" and func.name in self.allow.classes:
                return opcodes.Made(func.name)
            if opcode == "REDUCE" and func.name in self.allow.calls:
                return opcodes.Made(func.name)
            if opcode == "REDUCE" and func.name == "builtins.getattr":
                owner, member = (args + (None, None))[:2]
                enum_class = self.allow.enums.get(owner.name) if isinstance(owner, opcodes.Global) else None
                if len(args) == 2 and enum_class is not None and isinstance(member, str) and member in enum_class.__members__:
                    return opcodes.OTHER
                raise opcodes.PickleRefused(f"builtins.getattr({owner!r}, {str(member)[:40]!r}) (only a member of DCP's own enums)")
        raise opcodes.PickleRefused(f"{opcode} of {func!r} (an index calls only DCP's metadata classes and {sorted(self.allow.calls)})")

    def build(self, inst: opcodes.Value, state: opcodes.Value) -> None:
        if not isinstance(inst, opcodes.Made) or inst.name not in self.allow.buildable:
            raise opcodes.PickleRefused(f"BUILD on {inst!r}: state set on something other than a DCP metadata object the index made (a class itself?)")
        if state is not opcodes.DICT and inst.name not in self.allow.setstate:
            raise opcodes.PickleRefused(f"BUILD on {inst!r} with {state!r} (only a dict of its fields)")


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds only DCP's metadata types: every other global is refused before it can be called.

    The second line after :class:`IndexPolicy`. ``builtins.getattr`` (an enum member on Python 3.11.0-3.11.4)
    is answered by :meth:`_enum_member`, which returns only a member of one of DCP's enums.
    """

    def __init__(self, file: IO[bytes], allow: IndexAllowlist) -> None:
        super().__init__(file)
        self.allow = allow
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" in self.allow.names and (module, name) != ("builtins", "getattr"):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a DCP index")

    def _enum_member(self, owner: Any, name: Any) -> Any:
        if (isinstance(owner, type) and issubclass(owner, enum.Enum) and f"{owner.__module__}.{owner.__qualname__}" in self.allow.enums
                and isinstance(name, str) and name in owner.__members__):
            return owner.__members__[name]
        self.refused.append(f"builtins.getattr({getattr(owner, '__qualname__', type(owner).__name__)}, {name!r:.40})")
        raise pickle.UnpicklingError("builtins.getattr is allowed in a DCP index only for a member of DCP's own enums")


def index_allowlist(weights_only: Optional[bool]) -> Optional[IndexAllowlist]:
    """What a DCP index may name, call and fill when it is unpickled safely; None when ``weights_only`` trusts it."""
    return _index_allowlist() if resolve_weights_only(weights_only) else None


def unpickle_index(stream: IO[bytes], where: Path, allow: Optional[IndexAllowlist]) -> Any:
    """DCP's index read from ``stream`` (the file ``where``): its instructions checked first (:class:`IndexPolicy`),
    then rebuilt with ``find_class`` restricted to the same names; with ``allow`` None (trusted), ``pickle.load``.

    Whatever else unpickling damaged bytes raises is left to the caller, which names the file.
    """
    if allow is None:
        return pickle.load(stream)  # noqa: S301 - trusted by the caller's explicit weights_only=False
    data = stream.read()
    try:
        opcodes.check_pickle(data, IndexPolicy(allow))
    except opcodes.PickleRefused as exc:
        raise refusal(repr(str(where)), [str(exc)]) from None
    except opcodes.PickleDamaged as exc:
        raise CorruptCheckpointError(f"{str(where)!r} is not a readable pickle ({exc}); the checkpoint is damaged.") from None
    unpickler = _MetadataUnpickler(io.BytesIO(data), allow)
    try:
        return unpickler.load()
    except pickle.UnpicklingError:
        if unpickler.refused:
            raise refusal(repr(str(where)), unpickler.refused) from None
        raise
