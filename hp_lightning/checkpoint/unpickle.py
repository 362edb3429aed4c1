"""Reading the pickled parts of a checkpoint without running code from them, unless asked.

A pickle can name any importable callable and have the reader call it (``os.system``, through an
object's ``__reduce__``), so unpickling a file runs whatever its writer chose. torch's answer is
``torch.load(weights_only=True)``, its default since 2.6: only tensors, primitive containers and
the types registered with ``torch.serialization.add_safe_globals`` are rebuilt; anything else is
refused. Lightning passes ``weights_only=None`` through to it, so a plain Lightning resume is safe.

A checkpoint has four kinds of pickles, each read safely by default: ``torch.save`` files (a full
checkpoint, ``meta.pt``) by :func:`torch_load`; DCP's index ``.metadata`` (a bare ``pickle.load``
in torch) by :func:`read_dcp_metadata`, which checks every instruction first (:class:`IndexPolicy`:
nothing but DCP's own metadata objects is made or filled) and then rebuilds only DCP's classes; DCP's
non-tensor entries (``torch.load(weights_only=False)`` in torch) by :class:`SafeLoadPlanner` with
torch's safe loader; DCP's tensor archives by torch's own ``FileSystemReader.read_data`` and
``torch.load(weights_only=True)``, unchanged, checked through DCP's public hooks (:class:`SafeReader`,
:class:`SafeLoadPlanner`). Every size a file declares is checked against the bytes present before
anything is allocated for it (:func:`check_index`; :func:`check_archive` with :class:`ArchivePolicy`
for the constructors torch's safe loader allows that allocate a declared size); only regular files
inside the checkpoint directory are opened.

``weights_only=None`` means torch's default: safe, unless the environment sets torch's documented
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` (and ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces safe loading
even where ``False`` was passed). ``weights_only=False`` unpickles anything: only for files you trust.
"""

from __future__ import annotations

import _compat_pickle
import enum
import functools
import importlib
import io
import math
import os
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Optional, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from hp_lightning.checkpoint import opcodes
from hp_lightning.checkpoint.integrity import (
    CorruptCheckpointError,
    FileWindow,
    ReadCheck,
    UnsafeCheckpointError,
    check_contained,
    corruption_message,
    open_regular,
    regular_file_size,
)
from hp_lightning.core import devices

#: DCP's index file in a checkpoint directory (the rest of the layout: :mod:`.layout`).
DCP_METADATA_FILE = ".metadata"
#: How ``torch.save``'s legacy (non-zip) format starts: pickle protocol 2, then its magic number.
LEGACY_TORCH_HEAD = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"

#: How to opt out of safe loading, for a file you trust (named in every refusal).
OPT_IN = (
    "weights_only=False (trainer.fit(..., weights_only=False), fabric.load(..., weights_only=False), "
    "hp_lightning.checkpoint.load_weights / load_checkpoint / read_full_file(..., weights_only=False), "
    "`python -m hp_lightning.checkpoint consolidate|shard --trust-pickle`)"
)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: Optional[bool]) -> bool:
    """Whether to unpickle safely: ``None`` is torch's default (True), with torch's two environment overrides.

    Raises:
        TypeError: for anything but None, True or False (a typo such as ``"False"`` must not decide this).
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
    when the file names globals safe loading does not allow, else damage.

    torch reports both alike; its public ``get_unsafe_globals_in_checkpoint`` tells them apart (it
    lists the globals without running them). Only a refusal is a question of trust, so only a
    refusal names the opt-in: suggesting ``weights_only=False`` for junk would be wrong.
    """
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

    Not memory-mapped: torch's mmap reading trusts each record's declared length and would read past
    a short record into whatever follows; plain ``torch.load`` checks each record (and decodes a
    compressed one), at the price of holding the whole file's tensors in memory. Under safe loading
    the archive's records and pickle are bounded first (:func:`check_archive`), and torch's legacy
    (pre-1.6, non-zip) format is refused: it allocates every storage at the size its pickle declares.

    Raises:
        UnsafeCheckpointError: safe loading refused a type (naming the file, the type and the opt-in).
        CorruptCheckpointError: the file cannot be unpickled at all (damaged, not a checkpoint).
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


# ---------------------------------------------------------------- DCP's index

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: DCP's metadata classes: an index makes each with ``NEWOBJ`` and fills its fields with ``BUILD``. Two are
#: private to torch (``_StorageInfo``, and ``_MEM_FORMAT_ENCODING`` below): DCP writes their names into every
#: index, so the allowlist must spell them; :func:`_index_allowlist` resolves each and fails loudly without one.
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
    """Each ``(module, name)`` of torch's that a DCP index names, imported for real.

    Raises:
        ImportError: naming every one this torch lacks (a rename would otherwise shrink the allowlist
            silently and refuse every index as one that could run code).
    """
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
    """A DCP index's instructions (:func:`~hp_lightning.checkpoint.opcodes.check_pickle`): ``NEWOBJ`` only of DCP's
    metadata classes, ``REDUCE`` only of :data:`INDEX_CALLS` (and ``getattr`` of a member of DCP's enums),
    ``BUILD`` only onto an object the index made of a DCP class (or ``OrderedDict``), with a field dict.

    The real unpickler then runs with ``find_class`` restricted to the same names (:class:`_MetadataUnpickler`).
    """

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

    Run only on an index :class:`IndexPolicy` passed, which already decided every call and ``BUILD``;
    ``find_class`` refusing the same names is the second line. Python 3.11.0-3.11.4 pickle an enum
    member as ``getattr(EnumClass, "NAME")``: ``builtins.getattr`` is answered by :meth:`_enum_member`,
    which returns a member of one of DCP's enums and refuses anything else.
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


def read_dcp_metadata(path: Path, *, weights_only: Optional[bool] = None, rank: Optional[int] = None) -> dcp_metadata.Metadata:
    """DCP's index of the checkpoint directory ``path``, unpickled safely by default and checked to stay inside it.

    Safely: its instructions are checked first (:class:`IndexPolicy`), then the standard unpickler rebuilds it
    with ``find_class`` restricted to the same names.

    Raises:
        UnsafeCheckpointError: the index names or calls something outside DCP's own types, sets state on
            anything but a DCP object it made, or names a storage file outside ``path``.
        CorruptCheckpointError: it cannot be read or is not DCP metadata.
        ImportError: this torch lacks a name DCP writes into its indexes (:func:`resolve_index_names`).
    """
    path = Path(path)
    name = DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}"
    where = path / name
    check_contained(path, [name], what="its DCP index")
    allow = _index_allowlist() if resolve_weights_only(weights_only) else None
    try:
        with open_regular(where) as f:
            if allow is not None:
                data = f.read()
                try:
                    opcodes.check_pickle(data, IndexPolicy(allow))
                except opcodes.PickleRefused as exc:
                    raise refusal(repr(str(where)), [str(exc)]) from None
                except opcodes.PickleDamaged as exc:
                    raise CorruptCheckpointError(f"{str(where)!r} is not a readable pickle ({exc}); the checkpoint is damaged.") from None
                unpickler = _MetadataUnpickler(io.BytesIO(data), allow)
                try:
                    metadata = unpickler.load()
                except pickle.UnpicklingError:
                    if unpickler.refused:
                        raise refusal(repr(str(where)), unpickler.refused) from None
                    raise
            else:
                metadata = pickle.load(f)  # noqa: S301 - trusted by the caller's explicit weights_only=False
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named (a missing file, RecursionError too)
        raise CorruptCheckpointError(f"{str(where)!r} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged.") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{str(where)!r} does not hold DCP metadata (got {type(metadata).__name__}); the checkpoint is damaged.")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    check_contained(path, {getattr(info, "relative_path", None) for info in storage.values()}, what=f"its DCP index {str(where)!r}")
    try:
        check_index(path, metadata)
    except (AttributeError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:  # fields of the wrong types
        raise CorruptCheckpointError(f"{str(where)!r} is not valid DCP metadata ({type(exc).__name__}: {exc}); the checkpoint is damaged.") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


# ---------------------------------------------------------------- torch.save archives, bounded before torch.load

#: A deflate-compressed record of a full file (``torch.save`` writes none, a zip tool may) is decoded when it
#: declares at most this many times its stored size; a zip bomb declares about a thousand times.
MAX_COMPRESSION_RATIO = 32

#: Tensor archives up to this size are read whole before ``torch.load`` parses them (larger ones
#: stream from the file: no second copy of a large shard in memory).
WHOLE_READ_MAX = 1 << 20

#: How many quantized values one storage byte may hold (``torch.quint2x4``: four): ``_rebuild_qtensor`` allocates
#: its declared shape before it points the tensor at the storage, so the shape is bounded by the storage's size.
QUANTIZED_VALUES_PER_BYTE = 4
#: What a pickle torch's safe loader reads must spell, with a literal ``GLOBAL`` (its only way to reach a global;
#: none of the Python 2 name mappings it applies leads to one), to call a constructor that allocates a declared
#: size: the legacy tensor types (``torch.Tensor``, ``torch.FloatTensor``, ...), the storages it allows as
#: classes (``torch.storage.UntypedStorage`` / ``TypedStorage``), ``bytearray`` and ``_rebuild_qtensor``.
#: A pickle holding none of these bytes is not walked.
SIZED_TOKENS = (b"Tensor", b"TypedStorage", b"UntypedStorage", b"bytearray", b"_rebuild_qtensor")


def sized_constructor(name: str) -> bool:
    """Whether calling global ``name`` (``"module.qualname"``) reserves whatever size its arguments declare.

    torch's safe loader allows ``bytearray`` (``bytearray(2**30)`` is 1 GiB of zeros), ``torch.Tensor`` and
    every legacy typed tensor class (``torch.FloatTensor(n)``, also their ``sparse`` / ``cuda`` / other backends'
    namesakes), and the storage classes (``torch.storage.UntypedStorage(n)``); ``torch.save`` calls none of them.
    """
    module, _, qualname = name.rpartition(".")
    parts = module.split(".")
    legacy = parts[0] == "torch" and (len(parts) == 1 or parts[1] not in _MODERN_TENSOR_MODULES)
    return name == "builtins.bytearray" or (legacy and qualname.endswith(("Tensor", "Storage")))


#: Where torch keeps tensor subclasses built from tensors (``DTensor(local, spec)``, nested tensors), not from a size:
#: a user who registers one with ``add_safe_globals`` may load it.
_MODERN_TENSOR_MODULES = frozenset({"distributed", "nested"})


class ArchivePolicy(opcodes.Policy):
    """A ``torch.save`` pickle's instructions, checked for calls that allocate a declared size.

    torch's safe loader decides which globals may be named and what ``BUILD`` may touch; this adds what it
    does not bound: a :func:`sized_constructor` is never called (``bytearray`` only of a string or bytes,
    as ``torch.save`` writes one), also not through ``_rebuild_from_type_v2(func, type, args, state)``,
    which calls ``func(*args)``; ``_rebuild_qtensor`` allocates the shape it declares only up to
    :data:`QUANTIZED_VALUES_PER_BYTE` values per byte of the storage it is given. A storage itself is
    safe: torch checks its record's size before it allocates one.
    """

    mappings = frozenset({"collections.OrderedDict", "collections.Counter"})

    def named(self, module: str, name: str) -> opcodes.Value:
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name))
        return opcodes.Global(f"{module}.{name}")  # which names may be called at all is torch's loader's decision

    def call(self, func: opcodes.Value, args: tuple, opcode: str) -> opcodes.Value:
        if not isinstance(func, opcodes.Global):
            return opcodes.OTHER  # torch's loader calls nothing but allowed globals
        name = func.name
        if sized_constructor(name):
            first = args[0] if args else None
            from_data = isinstance(first, (str, tuple)) or first in (opcodes.BYTES, opcodes.LIST)
            if name == "builtins.bytearray" and (first is None or from_data or (isinstance(first, opcodes.Made) and first.name == "_codecs.encode")):
                return opcodes.Made(name)
            raise opcodes.PickleRefused(f"{name}{_shown(args)}")
        if name == "torch._tensor._rebuild_from_type_v2" and len(args) >= 3:
            # It calls args[0](*args[2]); arguments that are not a literal tuple (a list, say) are judged unknown.
            self.call(args[0], args[2] if isinstance(args[2], tuple) else (opcodes.OTHER,), opcode)
        elif name == "torch._utils._rebuild_qtensor":
            storage = args[0] if args else None
            count = opcodes.size_of(args[2]) if len(args) > 2 else None
            held = storage.detail if isinstance(storage, opcodes.Made) and storage.name == "storage" else None
            if count is None or type(held) is not int or count > QUANTIZED_VALUES_PER_BYTE * held + 64:
                raise opcodes.PickleRefused(f"{name} of shape {_shown(args[2:3])} over a storage of {held!r} bytes")
        elif name == "torch.Size" and args:
            return opcodes.Made(name, args[0])
        return opcodes.Made(name)

    def persistent(self, pid: opcodes.Value) -> opcodes.Value:
        # ("storage", storage type, key, location, element count): torch reads the record after checking its size.
        numel = pid[4] if isinstance(pid, tuple) and len(pid) == 5 and type(pid[4]) is int else None
        return opcodes.Made("storage", numel)

    def build(self, inst: opcodes.Value, state: opcodes.Value) -> None:
        return None  # torch's loader builds only tensors, Parameters, OrderedDicts and registered types


def _shown(args: tuple) -> str:
    return "(" + ", ".join(repr(a)[:40] for a in args[:4]) + (", ..." if len(args) > 4 else "") + ")"


def _check_pickle_record(data: bytes, where: str, record: str) -> None:
    """Refuse a ``torch.save`` pickle that calls a constructor allocating a declared size (:class:`ArchivePolicy`)."""
    if not any(token in data for token in SIZED_TOKENS):
        return
    try:
        opcodes.check_pickle(data, ArchivePolicy())
    except opcodes.PickleRefused as exc:
        raise UnsafeCheckpointError(
            f"{where}: its pickle {record!r} calls {exc}, which reserves whatever size the file declares before anything "
            f"checks it against the bytes present; torch.save never writes that for a tensor, so it was crafted. "
            f"If you trust this file, load it with {OPT_IN}."
        ) from None
    except opcodes.PickleDamaged as exc:
        raise CorruptCheckpointError(f"{where}: its pickle {record!r} does not parse ({exc}); it is damaged.") from None


def check_archive(stream: IO[bytes], length: int, where: str, *, compressed: bool = False, whole: Optional[bytes] = None) -> None:
    """Refuse a ``torch.save`` zip archive (``length`` bytes, at the start of ``stream``) whose declared sizes
    are not backed by its bytes, before ``torch.load`` allocates anything for it.

    :mod:`zipfile` reads the archive's directory (torch's reader trusts it): every record must lie
    inside the archive, stored uncompressed (or, with ``compressed``, deflated at most
    :data:`MAX_COMPRESSION_RATIO` times), and no pickle may call a :func:`sized_constructor` (:class:`ArchivePolicy`).

    ``whole``, the archive's bytes when the caller holds them, and loaded by ``torch.load(weights_only=True)``
    (DCP's tensor items): a stored record's bytes are a slice of ``whole``, so when none of
    :data:`SIZED_TOKENS` occurs anywhere in it no pickle can call one, and the pickles are not read one
    by one (~25 us an archive).

    Raises:
        CorruptCheckpointError: naming ``where`` and the record.
        UnsafeCheckpointError: a pickle calls a constructor that allocates what it declares.
    """
    try:
        with zipfile.ZipFile(stream) as archive:
            records = archive.infolist()
            for record in records:
                stored = record.compress_type == zipfile.ZIP_STORED and record.file_size == record.compress_size
                bounded = compressed and record.file_size <= MAX_COMPRESSION_RATIO * record.compress_size + 4096
                if not stored and not bounded:
                    raise CorruptCheckpointError(
                        f"{where}: record {record.filename!r} is compressed ({record.compress_size:,} bytes stored, "
                        f"{record.file_size:,} declared); torch.save writes none, so it was altered (a zip bomb?) and is refused."
                    )
                if record.header_offset + record.compress_size > length:
                    raise CorruptCheckpointError(f"{where}: record {record.filename!r} reaches past the end of its {length:,} bytes; it is truncated or altered.")
            if whole is not None and not compressed and not any(token in whole for token in SIZED_TOKENS):
                return  # every record stored (checked above): no pickle's bytes name one
            for record in records:
                if record.filename.endswith(".pkl"):
                    _check_pickle_record(archive.read(record), where, record.filename)
    except (CorruptCheckpointError, UnsafeCheckpointError):
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError, RecursionError, KeyError) as exc:
        raise CorruptCheckpointError(f"{where} is not a readable torch.save archive ({type(exc).__name__}: {exc}); it is damaged.") from None
    finally:
        stream.seek(0)


def _entry(root: Any, fqn: str, name: str) -> str:
    return f"Entry {fqn!r} of {str(root)!r} (in {name!r})"


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` reading the index with :func:`read_dcp_metadata` (safe, contained, bounded by
    :func:`check_index`); before its own ``read_data`` opens a file, the file must be regular (and, given
    ``recorded``, in the manifest); being its own ``transforms``, it checks each tensor archive with
    :func:`check_archive` as DCP opens it, then hands it to DCP's ``torch.load``."""

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        weights_only: Optional[bool] = None,
        metadata: Optional[dcp_metadata.Metadata] = None,
        recorded: Optional[frozenset[str]] = None,
    ) -> None:
        super().__init__(path)
        self.weights_only = weights_only
        self.recorded = recorded  # the files a manifest vouches for (hp_lightning's layout); any other is refused
        self.reading = ""  # the tensor item DCP is reading, named in an error torch raises about it
        self._metadata = metadata  # the index already read (safely) by the caller: not unpickled twice
        self.transforms = cast(Any, self)  # DCP calls transform_load_stream (below) on each item it opens

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        root = Path(self.path)
        for name in {self.storage_data[item.storage_index].relative_path for item in plan.items}:  # check_index vouched for the keys
            if self.recorded is not None and name not in self.recorded:
                problem = f"{str(root / name)!r} is read by DCP's index but not recorded in the manifest (added after the save)"
                raise CorruptCheckpointError(corruption_message([problem], root))
            regular_file_size(root, name)  # still a regular file (check_index checked every item's bytes lie inside it)
        return super().read_data(plan, planner)

    def transform_load_stream(self, read_item: ReadItem, transform_descriptors: Sequence[str], raw_stream: IO[bytes]) -> IO[bytes]:
        info = self.storage_data[read_item.storage_index]
        self.reading = _entry(self.path, read_item.storage_index.fqn, info.relative_path)
        if transform_descriptors:
            raise CorruptCheckpointError(
                f"{self.reading}: stored through DCP's stream transforms {list(transform_descriptors)}, which decompress "
                f"with no bound on the size they produce; hp_lightning and DCP's defaults write none, so it is refused."
            )
        if read_item.type == LoadItemType.BYTE_IO:
            return raw_stream  # read whole by DCP (its item length bounds it), checked by SafeLoadPlanner.load_bytes
        window = cast(IO[bytes], FileWindow(raw_stream, 0, info.length))  # DCP's view of the item, seeking from its end right
        if info.length <= WHOLE_READ_MAX:
            # A small archive is read in one call and parsed from memory: torch's zip reader and
            # zipfile then seek and read a few dozen times per archive in C, not through Python streams.
            data = window.read(info.length)
            if len(data) != info.length:
                raise CorruptCheckpointError(f"{self.reading}: {len(data):,} of its {info.length:,} bytes are there; it is truncated.")
            window = io.BytesIO(data)
            check_archive(window, info.length, self.reading, whole=data)  # DCP loads it with weights_only=True
        else:
            check_archive(window, info.length, self.reading)
        return window

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is not None and kwargs.get("rank") is None:
            metadata = self._metadata
        else:
            metadata = read_dcp_metadata(Path(self.path), weights_only=self.weights_only, rank=kwargs.get("rank"))
        assert metadata.storage_meta is not None  # read_dcp_metadata always fills it in
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_index(root: Path, metadata: dcp_metadata.Metadata) -> None:
    """Every size DCP's index declares is backed by bytes present, before anything is allocated from it.

    Each tensor entry's chunks lie inside it, do not overlap and cover all of it (an entry with
    missing chunks would leave memory nothing fills); each chunk has a storage record whose item
    holds at least the chunk's bytes, inside a regular file of the directory.

    Raises:
        CorruptCheckpointError: naming the entry and the file.
    """
    where = str(root / DCP_METADATA_FILE)
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        name = info.relative_path  # a string: read_dcp_metadata checked it names a file inside root
        if name not in sizes:
            sizes[name] = regular_file_size(root, name)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > sizes[name]:
            raise CorruptCheckpointError(
                f"{_entry(root, index.fqn, name)}: DCP's index places it at bytes {offset!r}+{length!r}, outside the "
                f"file's {sizes[name]:,} bytes; the checkpoint is truncated or altered."
            )
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            continue
        problem = _coverage_problem(entry)
        if problem is None:
            itemsize = entry.properties.dtype.itemsize
            for chunk in entry.chunks:
                info = storage.get(dcp_metadata.MetadataIndex(fqn, chunk.offsets))
                if info is None:
                    problem = f"its chunk at {tuple(chunk.offsets)} has no storage record"
                    break
                needed = math.prod(chunk.sizes) * itemsize
                if info.length < needed:
                    problem = f"its chunk at {tuple(chunk.offsets)} declares {needed:,} bytes but its item in {info.relative_path!r} holds {info.length:,}"
                    break
        if problem is not None:
            raise CorruptCheckpointError(f"{where!r}: entry {fqn!r} ({problem}); the checkpoint is damaged or was altered.")


def _coverage_problem(entry: dcp_metadata.TensorStorageMetadata) -> Optional[str]:
    """Why the chunks of one tensor entry do not tile it exactly (None when they do)."""
    size = tuple(entry.size)
    if not isinstance(entry.properties.dtype, torch.dtype) or not all(type(n) is int and n >= 0 for n in size):
        return f"size {size!r} / dtype {entry.properties.dtype!r} is not a tensor's"
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in entry.chunks:
        start, extent = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(start) != len(size) or len(extent) != len(size) or not all(type(v) is int and v >= 0 for v in (*start, *extent)):
            return f"a chunk {start!r}+{extent!r} does not fit its {len(size)} dimensions"
        if any(o + n > s for o, n, s in zip(start, extent, size)):
            return f"its chunk at {start} of size {extent} reaches outside its size {size}"
        boxes.append((start, extent))
    covered = sum(math.prod(extent) for _, extent in boxes)
    if covered != math.prod(size):
        return f"its chunks cover {covered:,} of its {math.prod(size):,} elements (missing or overlapping chunks)"
    ordered = sorted(box for box in boxes if 0 not in box[1])  # empty chunks hold nothing to overlap
    for i, (start, extent) in enumerate(ordered):
        for other, other_extent in ordered[i + 1 :]:
            if other[0] >= start[0] + extent[0]:
                break  # sorted by the first dimension: no later chunk can overlap this one
            if all(o < s + n and s < o + m for s, n, o, m in zip(start, extent, other, other_extent)):
                return f"its chunks at {start} and {other} overlap"
    return None


class _CheckedTarget(torch.Tensor):
    """What :class:`SafeLoadPlanner` hands DCP to copy a loaded tensor into: the model's own memory, whose
    ``copy_`` first checks that the source is the tensor the index promised (torch's public subclassing)."""

    check: Any
    plain: torch.Tensor  # the same memory as a plain tensor: DCP's three calls on the target go straight to it

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.detach:
            return args[0]  # DCP detaches the target: keep this object (and what it checks)
        if args and type(args[0]) is cls:
            if func is torch.Tensor.copy_:
                args[0].check(args[1])
                return args[0].plain.copy_(*args[1:], **(kwargs or {}))
            if func is torch.Tensor.size:
                return args[0].plain.size(*args[1:], **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs or {})


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` that reads DCP's non-tensor entries safely and checks every tensor DCP loads.

    Between DCP's ``torch.load`` of an item and its copy into the model (``resolve_tensor`` hands DCP
    a target whose ``copy_`` checks its source first), the loaded tensor must be the one the index
    promised: its dtype, a dense layout of the chunk's shape filling exactly the chunk's bytes (an
    8x8 archive read for a 4x4 chunk, float64 for float32 and int64 cast to float are refused, never
    narrowed or cast); and, given a :class:`~hp_lightning.checkpoint.integrity.ReadCheck`, its bytes'
    CRC-32 against the manifest, computed on the loaded storage in place (no second read).
    """

    def __init__(self, source: Path, *, weights_only: Optional[bool] = None, allow_partial_load: bool = False, check: Optional[ReadCheck] = None) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.source = Path(source)
        self.safe = resolve_weights_only(weights_only)
        self.check = check
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if self.check is not None:
            info = self.metadata.storage_data[read_item.storage_index]  # type: ignore[union-attr]
            self.check.verify_item(info.relative_path, info.offset, info.length, None)
        if self.safe:
            check_archive(value, len(value.getbuffer()), f"Entry {fqn!r} of {str(self.source)!r}")
        try:
            loaded = torch.load(value, weights_only=self.safe)
        except Exception as exc:  # noqa: BLE001 - named: entry and directory
            if self.safe and isinstance(exc, pickle.UnpicklingError):
                raise _refusal_or_damage(value, repr(str(self.source)), entry=fqn) from None
            raise CorruptCheckpointError(
                f"Entry {fqn!r} of {str(self.source)!r} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged."
            ) from None
        if self.flatten_state_dict:
            put_route(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        plain = super().resolve_tensor(read_item).detach()
        target = plain.as_subclass(_CheckedTarget)
        target.plain = plain
        target.check = functools.partial(self._check_loaded, read_item)
        return target

    def _check_loaded(self, item: ReadItem, loaded: torch.Tensor) -> None:
        """Refuse ``loaded`` (DCP's narrowed view of the tensor it read for ``item``) unless it is what the index promised."""
        assert self.metadata is not None  # set by DCP before any read
        fqn = item.storage_index.fqn
        info = self.metadata.storage_data[item.storage_index]
        entry = self.metadata.state_dict_metadata[fqn]
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata) or not isinstance(loaded, torch.Tensor):
            where = _entry(self.source, fqn, info.relative_path)
            raise CorruptCheckpointError(f"{where}: the index and the item disagree on whether it is a tensor; the checkpoint is damaged.")
        dtype = entry.properties.dtype
        storage = loaded.untyped_storage()
        if loaded.device != devices.cpu_device() or (storage.nbytes() and not storage.data_ptr()):
            where = _entry(self.source, fqn, info.relative_path)
            raise CorruptCheckpointError(
                f"{where}: the archive holds a tensor on the {loaded.device} device, with no bytes of its own in memory "
                f"(DCP reads every item onto the CPU); it was crafted and is refused."
            )
        if not self._chunks:  # each chunk's shape by (entry, offsets), built once per load
            self._chunks = {
                (name, tuple(c.offsets)): tuple(c.sizes)
                for name, e in self.metadata.state_dict_metadata.items()
                if isinstance(e, dcp_metadata.TensorStorageMetadata)
                for c in e.chunks
            }
        sizes = self._chunks.get((fqn, tuple(item.storage_index.offset or ())))
        if loaded.dtype != dtype:
            where = _entry(self.source, fqn, info.relative_path)
            raise CorruptCheckpointError(f"{where}: the archive holds a {loaded.dtype} tensor where the index declares {dtype}; it is refused, not cast.")
        nbytes = storage.nbytes()
        if sizes is None or nbytes != math.prod(sizes) * loaded.element_size() or not _dense_from_start(loaded, sizes, item.storage_offsets):
            where = _entry(self.source, fqn, info.relative_path)
            raise CorruptCheckpointError(
                f"{where}: the archive's tensor ({nbytes:,} bytes, strides {tuple(loaded.stride())}) is not the {sizes} {dtype} "
                f"chunk the index declares ({math.prod(sizes or ()) * loaded.element_size():,} bytes); it is refused, not narrowed."
            )
        if self.check is not None:
            self.check.verify_item(info.relative_path, info.offset, info.length, loaded)


def _dense_from_start(view: torch.Tensor, sizes: tuple[int, ...], starts: Sequence[int]) -> bool:
    """Whether ``view`` (DCP's narrowing at ``starts``) comes from a tensor of shape ``sizes`` laid densely over its
    whole storage from offset 0: then every element copied is the one stored at that position."""
    strides = tuple(view.stride())
    if len(strides) != len(sizes) or not math.prod(sizes):
        return len(strides) == len(sizes)
    if view.storage_offset() != sum(s * st for s, st in zip(starts, strides)):
        return False
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(sizes, strides) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def put_route(root: Any, route: Sequence[Any], value: Any) -> None:
    """Set ``value`` at ``route`` (keys and list positions: DCP's routes spell dict keys as strings, so an
    integer is a list position) inside ``root``, making the containers it lacks."""
    node = root
    for key, following in zip(route[:-1], route[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
        else:
            node.setdefault(key, empty)
        node = node[key]
    last = route[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def dcp_load(
    state: dict[str, Any],
    path: Path,
    *,
    weights_only: Optional[bool],
    no_dist: bool,
    allow_partial_load: bool = False,
    check: Optional[ReadCheck] = None,
    metadata: Optional[dcp_metadata.Metadata] = None,
) -> None:
    """``dcp.load(state, ...)`` from directory ``path`` with :class:`SafeReader` and :class:`SafeLoadPlanner`.

    DCP gathers every rank's failure and raises the same ``CheckpointException`` everywhere; a
    refusal inside it comes back out as the :class:`UnsafeCheckpointError` it was, on every rank.

    Args:
        check: verify each tensor against the manifest's CRC-32s as it is read (:class:`SafeLoadPlanner`),
            and read only files the manifest records.
        metadata: DCP's index, when the caller already read it with :func:`read_dcp_metadata`.

    Raises:
        UnsafeCheckpointError: a non-tensor entry or the index needs more than safe loading allows.
        CorruptCheckpointError: any damage DCP or torch meets (their exceptions unwrapped into it), a
            tensor that is not what the index promised or, with ``check``, whose bytes differ from the save's.
    """
    reader = SafeReader(str(path), weights_only=weights_only, metadata=metadata, recorded=check.recorded if check is not None else None)
    planner = SafeLoadPlanner(path, weights_only=weights_only, allow_partial_load=allow_partial_load, check=check)
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader, planner=planner, no_dist=no_dist)
    except (dcp.CheckpointException, RuntimeError, ValueError, IndexError, KeyError, AssertionError, EOFError, OSError, RecursionError, pickle.UnpicklingError) as exc:
        causes = [failure[0] if isinstance(failure, tuple) else failure for _, failure in sorted(getattr(exc, "failures", {}).items())] or [exc]
        ours = [cause for cause in causes if isinstance(cause, (UnsafeCheckpointError, CorruptCheckpointError))]
        if ours:  # a reader's own refusal, on whichever rank: raised as it was, on every rank
            raise type(ours[0])(str(ours[0])) from None
        where = reader.reading or f"Checkpoint {str(path)!r}"
        raise CorruptCheckpointError(f"{where} cannot be read: {type(causes[0]).__name__}: {str(causes[0])[:300]}; it is damaged or was altered.") from None
