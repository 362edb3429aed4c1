"""What checks: every test a checkpoint's bytes pass before a reader trusts them, and the two errors it raises.

In the order a load meets them:

* **Where a file is**: every name stays inside its directory (:func:`check_contained`) and is a
  regular file (:func:`regular_file_size`, :func:`open_regular`; a FIFO or a device could block).
* **What the save recorded**: every file of a sharded checkpoint has a CRC-32 of every byte in the
  manifest (a SHA-256 too with ``checkpoint_checksums=True``). The CRC-32 costs a save almost nothing:
  :func:`shard_record` takes the ones torch's zip writer stored for the large records and reads back
  only the rest. Per shard file::

    {"size": 123456, "crc32": "<CRC-32 of the bytes outside the ranges>",
     "crc32_ranges": [[offset, length, "<CRC-32>"], ...]}

  A resume checks every byte it uses without a second read (:class:`ReadCheck`): the bytes outside
  the ranges first, then each tensor's range as DCP loads it. The ranges are fixed in the manifest,
  so another rank's or save's shard fails even when internally consistent. A single file's record is
  the CRC-32 its zip format keeps for every entry (:func:`verify_zip`).
* **Declared sizes against the bytes present**, before anything is allocated for them
  (:func:`check_index`, :func:`check_archive`).
* **Each tensor DCP loads** is the one the index promised (:class:`TensorCheck`).

zlib's and ISA-L's (``fast-crc`` extra) CRC-32 are the same checksum, so either verifies the other's.
"""

from __future__ import annotations

import _compat_pickle
import bisect
import ctypes
import functools
import hashlib
import io
import math
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import ReadItem

from hp_lightning.checkpoint import opcodes
from hp_lightning.core import devices

#: Read size when checking or hashing files (one buffer, reused).
READ_SIZE = 8 << 20
#: Records at least this long are vouched for by the CRC-32 torch stored for them; shorter ones are read back at save.
TORCH_CRC_MIN = 64 << 10

try:  # ISA-L's CRC-32 (the ``fast-crc`` extra): the same checksum as zlib's, about 3x as fast (11 vs 3.7 GB/s here)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    from zlib import crc32

#: Which implementation computes every CRC-32 this module writes or checks ("isal" or "zlib").
CRC32_IMPLEMENTATION = "isal" if crc32 is not zlib.crc32 else "zlib"

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"

Span = tuple[int, int]


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


# ---------------------------------------------------------------- the errors, and the opt-in every refusal names


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files do not match what was recorded when it was saved."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint that loading would let run code (a pickle safe loading refuses) or read files outside it."""


#: How to opt out of safe loading, for a file you trust (named in every refusal).
OPT_IN = (
    "weights_only=False (trainer.fit(..., weights_only=False), fabric.load(..., weights_only=False), "
    "hp_lightning.checkpoint.load_weights / load_checkpoint / read_full_file(..., weights_only=False), "
    "`python -m hp_lightning.checkpoint consolidate|shard --trust-pickle`)"
)


def _listed(problems: list[str]) -> str:
    return "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")


def corruption_message(problems: list[str], checkpoint: Path) -> str:
    """One error message for every problem found, with what to do next."""
    listed = _listed(problems)
    return (
        f"Checkpoint {str(checkpoint)!r} failed its integrity check: {listed}. It was damaged after it "
        f"was written (partial copy, disk or network fault, manual edit); restore it from a good copy "
        f"or resume from an earlier checkpoint."
    )


# ---------------------------------------------------------------- what every reader checks before it opens a file


def outside_reason(root: Path, name: Any) -> str | None:
    """Why entry ``name`` of directory ``root`` would lead outside it (by its spelling, POSIX or Windows, or a symlink); None if not."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return "it is not a file name"
    spelled = PureWindowsPath(name)  # parses both '/' and '\\' as separators
    if spelled.anchor or PurePosixPath(name).is_absolute():
        return "it is an absolute path"
    if ".." in spelled.parts:
        return "it climbs out with '..'"
    base = root.resolve()
    target = (root / name).resolve()
    if target != base and base not in target.parents:
        return f"it is a symlink (or lies under one) that leads to {str(target)!r}"
    return None


def check_contained(root: Path, names: Iterable[Any], *, what: str) -> None:
    """Refuse (UnsafeCheckpointError) a checkpoint whose ``names`` (read from ``what``) lead outside directory ``root``."""
    root = Path(root)
    problems = [f"{name!r} ({reason})" for name in names if (reason := outside_reason(root, name))]
    if problems:
        listed = _listed(problems)
        raise UnsafeCheckpointError(
            f"Checkpoint {str(root)!r}: {what} names files outside the checkpoint directory: {listed}. A checkpoint "
            f"reads only its own files, so it is refused before any of them is opened. It was altered or built to "
            f"read other files; restore it from a good copy (if you moved files out on purpose, copy them back in "
            f"instead of linking them)."
        )


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a directory"))
        kind = next((name for test, name in kinds if test(mode)), "not a regular file")
        raise CorruptCheckpointError(
            f"{str(path)!r} is {kind}, not a regular file: a checkpoint reads only regular files (opening anything else can "
            f"block forever or read without end), so it is refused before it is opened. Restore the checkpoint from a good copy."
        )


def regular_file_size(root: Path, name: str) -> int:
    """The size of file ``name`` of directory ``root``, checked to be a regular file before anything opens it."""
    path = Path(root) / name
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CorruptCheckpointError(f"{str(path)!r} is named by the checkpoint but cannot be read ({exc.strerror}); the checkpoint is incomplete.") from None
    _check_regular(path, info.st_mode)
    return info.st_size


def open_regular(path: Path) -> IO[bytes]:
    """Open ``path`` for reading if it is a regular file: checked before the open (a FIFO would block it), then
    on the file opened non-blocking (so it cannot be swapped in between)."""
    _check_regular(Path(path), os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0))
    try:
        _check_regular(Path(path), os.fstat(fd).st_mode)
    except CorruptCheckpointError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


# ---------------------------------------------------------------- records and checksums


class FileWindow(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + length)`` of an open file (for ``zipfile`` and ``torch.load``);
    its position is the file's own minus ``offset``, so nothing else may move the file meanwhile."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length = file, offset, length
        file.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return int(self._file.tell()) - self._offset

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        # torch's zip reader seeks a few dozen times per tensor: kept to plain arithmetic
        if whence == io.SEEK_CUR:
            position += self._file.tell() - self._offset
        elif whence == io.SEEK_END:
            position += self._length
        target = 0 if position < 0 else self._length if position > self._length else position
        self._file.seek(self._offset + target)
        return target

    def readinto(self, buffer: Any) -> int:
        left = self._offset + self._length - self._file.tell()
        if left <= 0:
            return 0
        return int(self._file.readinto(buffer if len(buffer) <= left else memoryview(buffer)[:left]))


def torch_crc_ranges(path: Path, items: Iterable[Span]) -> list[tuple[int, int, int]]:
    """``(offset, length, crc32)`` of the large records torch's zip writer stored CRC-32s for, in the archives at ``items``.

    Only stored records of at least :data:`TORCH_CRC_MIN` bytes with a non-zero CRC are taken; anything
    else stays in the bytes :func:`shard_record` reads itself, so nothing is left unchecked.
    """
    ranges: list[tuple[int, int, int]] = []
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        for offset, length in sorted(items):
            try:
                with zipfile.ZipFile(FileWindow(f, offset, length)) as archive:
                    members = archive.infolist()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError):
                members = []  # not a zip archive: all of it is read by shard_record
            for member in members:
                header_at, stored, size, crc = member.header_offset, member.compress_size, member.file_size, member.CRC
                if member.compress_type != zipfile.ZIP_STORED or size < TORCH_CRC_MIN or crc == 0 or stored != size:
                    continue
                header = os.pread(fd, _LOCAL_HEADER.size, offset + header_at)
                if len(header) != _LOCAL_HEADER.size:
                    continue
                signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
                start = offset + header_at + _LOCAL_HEADER.size + name_length + extra_length
                if signature != _LOCAL_SIGNATURE or start + size > offset + length:
                    continue
                ranges.append((start, size, crc))
    ranges.sort()
    disjoint: list[tuple[int, int, int]] = []
    for entry in ranges:
        if not disjoint or entry[0] >= disjoint[-1][0] + disjoint[-1][1]:
            disjoint.append(entry)
    return disjoint


def _scan(path: Path, spans: Sequence[Span], *, read_spans: bool, sha256: bool) -> tuple[int, list[int], Optional[str], int]:
    """One sequential pass over ``path``: (CRC-32 of the bytes outside ``spans``, CRC-32 of each span,
    SHA-256 of every byte or None, bytes seen). With ``read_spans=False`` the spans are skipped, not read.
    """
    size = os.stat(path).st_size
    if read_spans:
        largest = size
    else:  # only the gaps are read: a buffer their size, not READ_SIZE (a fresh 8 MiB costs its page faults)
        edges = [0, *(e for o, n in spans for e in (o, o + n)), size]
        largest = max((edges[i + 1] - edges[i] for i in range(0, len(edges) - 1, 2)), default=size)
    buffer = memoryview(bytearray(max(1, min(READ_SIZE, largest))))
    digest = hashlib.sha256() if sha256 else None
    rest, span_crcs, seen = 0, [], 0

    def consume(f: Any, count: Optional[int], crc: int) -> int:
        nonlocal seen
        while count is None or count > 0:
            got = f.readinto(buffer if count is None else buffer[: min(count, len(buffer))])
            if not got:
                break
            chunk = buffer[:got]
            crc = crc32(chunk, crc)
            if digest is not None:
                digest.update(chunk)
            seen += got
            if count is not None:
                count -= got
        return crc

    with open(path, "rb", buffering=0) as f:
        position = 0
        for offset, length in spans:
            rest = consume(f, offset - position, rest)
            if read_spans:
                span_crcs.append(consume(f, length, 0))
            else:
                f.seek(offset + length)
                seen += length
            position = offset + length
        rest = consume(f, None, rest)
    return rest, span_crcs, (digest.hexdigest() if digest is not None else None), seen


def file_record(path: Path, *, checksum: bool = True) -> dict[str, Any]:
    """Size and CRC-32 of every byte of one file and, with ``checksum``, its SHA-256 (one read)."""
    path = Path(path)
    crc, _, sha, seen = _scan(path, [], read_spans=True, sha256=checksum)
    record: dict[str, Any] = {"size": seen, "crc32": _hex(crc)}
    if sha is not None:
        record["sha256"] = sha
    return record


def shard_record(path: Path, items: Iterable[Span], *, sha256: bool = False) -> dict[str, Any]:
    """The record of a DCP shard file just written: the large records' CRC-32s from torch's zip directories, the rest
    read back; with ``sha256`` the whole file is read once (:func:`file_record`)."""
    path = Path(path)
    if sha256:
        return file_record(path, checksum=True)
    ranges = torch_crc_ranges(path, items)
    rest, _, _, seen = _scan(path, [(o, n) for o, n, _ in ranges], read_spans=False, sha256=False)
    size = path.stat().st_size
    if seen != size:  # the file changed under us: record it the slow, certain way
        return file_record(path, checksum=False)
    record: dict[str, Any] = {"size": size, "crc32": _hex(rest)}
    if ranges:
        record["crc32_ranges"] = [[o, n, _hex(c)] for o, n, c in ranges]
    return record


def _recorded_ranges(record: Mapping[str, Any], size: int) -> Optional[list[tuple[int, int, str]]]:
    """The record's ranges, checked to be sorted, disjoint and inside the file; None when malformed."""
    ranges = record.get("crc32_ranges", [])
    if not isinstance(ranges, list):
        return None
    parsed: list[tuple[int, int, str]] = []
    end = 0
    for entry in ranges:
        if not (isinstance(entry, list) and len(entry) == 3):
            return None
        offset, length, crc = entry
        if not (isinstance(offset, int) and isinstance(length, int) and isinstance(crc, str)) or offset < end or length < 0:
            return None
        end = offset + length
        parsed.append((offset, length, crc))
    return parsed if end <= size else None


def verify_file(path: Path, record: Mapping[str, Any], *, ranges_on_read: bool = False) -> Optional[str]:
    """Check one file against its record (size, then CRC-32s and SHA-256); return a sentence naming the file if it does not match.

    With ``ranges_on_read`` (:class:`ReadCheck` checks each range as it loads it) only the bytes outside
    the ranges are read; a record with a SHA-256 is still read whole.
    """
    path = Path(path)
    if not isinstance(record, Mapping) or isinstance(record.get("size"), bool) or not isinstance(record.get("size"), int):
        return f"the manifest's record of {str(path)!r} is damaged (no valid 'size'): {record!r}"
    if not path.is_file():
        return f"{str(path)!r} is missing (recorded at save: {record['size']} bytes)"
    size = path.stat().st_size
    if size != record["size"]:
        kind = "truncated" if size < record["size"] else "altered (it grew)"
        return f"{str(path)!r} is {kind}: {size} bytes on disk, {record['size']} recorded at save"
    wants_sha = "sha256" in record
    if "crc32" not in record and not wants_sha:
        return None  # written before hp_lightning recorded checksums: the size is all there is
    ranges = _recorded_ranges(record, size)
    if ranges is None:
        return f"the manifest's record of {str(path)!r} is damaged (its 'crc32_ranges' do not describe the file)"
    read_spans = wants_sha or not ranges_on_read
    rest, crcs, sha, _ = _scan(path, [(o, n) for o, n, _ in ranges], read_spans=read_spans, sha256=wants_sha)
    if not read_spans:
        crcs = [int(crc, 16) for _, _, crc in ranges]  # checked by the reader as it loads them
    if wants_sha and sha != record["sha256"]:
        assert sha is not None  # _scan returns a digest whenever sha256=True
        return f"{str(path)!r} was altered after the save: SHA-256 {sha[:16]}... differs from {record['sha256'][:16]}... recorded at save"
    bad = [(o, n) for (o, n, crc), actual in zip(ranges, crcs) if _hex(actual) != crc]
    if "crc32" in record and _hex(rest) != record["crc32"]:
        bad.insert(0, (-1, 0))
    if not bad:
        return None
    where = "its headers and small entries" if bad[0][0] < 0 else f"bytes {bad[0][0]:,}-{bad[0][0] + bad[0][1]:,}"
    more = f" (and {len(bad) - 1} more spans)" if len(bad) > 1 else ""
    return (
        f"{str(path)!r} was altered or replaced after the save: the CRC-32 of {where}{more} differs from the one "
        f"recorded at save (flipped bits, a bad copy, or another rank's or another save's shard in its place)"
    )


def verify_records(root: Path, records: Mapping[str, Mapping[str, Any]], names: Iterable[str], *, ranges_on_read: bool = False) -> list[str]:
    """Check the named files of a sharded checkpoint; return one sentence per problem (empty: all good)."""
    return [problem for name in names if (problem := verify_file(Path(root) / name, records[name], ranges_on_read=ranges_on_read))]


def share_by_size(records: Mapping[str, Mapping[str, Any]], parts: int) -> list[list[str]]:
    """The record names split into ``parts`` lists of about equal bytes; deterministic, so every rank computes the same split."""
    def size(name: str) -> int:
        record = records[name]
        value = record.get("size") if isinstance(record, Mapping) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    shares: list[list[str]] = [[] for _ in range(max(parts, 1))]
    loads = [0] * len(shares)
    for name in sorted(records, key=lambda n: (-size(n), n)):
        lightest = min(range(len(shares)), key=lambda i: (loads[i], i))
        shares[lightest].append(name)
        loads[lightest] += size(name)
    return shares


def _storage_crc(storage: Any) -> Optional[int]:
    """CRC-32 of a CPU storage's bytes, read in place (no copy); None for any other storage.

    A meta storage has a size but a null address (ISA-L would read address 0 and kill the process).
    """
    size = storage.nbytes()
    if storage.device.type != devices.CPU:
        return None
    if size == 0:
        return crc32(b"")
    address = storage.data_ptr()
    return crc32((ctypes.c_char * size).from_address(address)) if address else None


class ReadCheck:
    """A resume's check of each tensor DCP loads, against the CRC-32 ranges of the file it came from.

    The range inside an item is its archive's data record, exactly the loaded storage: its CRC-32 is
    computed in place (no second read); any other range inside the item is read back.
    """

    def __init__(self, root: Path, records: Mapping[str, Mapping[str, Any]]) -> None:
        self.root = Path(root)
        self.recorded = frozenset(records)  #: every file the manifest vouches for; any other is refused
        self._ranges: dict[str, list[tuple[int, int, str]]] = {}
        self._starts: dict[str, list[int]] = {}  # each file's range offsets, for the bisection
        for name, record in records.items():
            size = record.get("size") if isinstance(record, Mapping) else None
            if not isinstance(size, int) or "sha256" in record:
                continue  # SHA-256 records are read whole before DCP starts
            self._ranges[name] = _recorded_ranges(record, size) or []
            self._starts[name] = [start for start, _, _ in self._ranges[name]]

    def verify_item(self, name: str, offset: int, length: int, tensor: Any) -> None:
        """Raise :class:`CorruptCheckpointError` unless every range inside item ``[offset, offset + length)`` of file ``name`` matches."""
        ranges = self._ranges.get(name)
        if not ranges:
            return
        first = max(bisect.bisect_right(self._starts[name], offset) - 1, 0)  # a range may begin before the item and reach into it
        inside = []
        for position in range(first, len(ranges)):
            start, size, crc = ranges[position]
            if start >= offset + length:
                break
            if start + size > offset:
                inside.append((start, size, crc))
        if not inside:
            return
        storage = tensor.untyped_storage() if tensor is not None else None
        path = self.root / name
        for start, size, crc in inside:
            if len(inside) == 1 and start >= offset and start + size <= offset + length and storage is not None and storage.nbytes() == size:
                computed = _storage_crc(storage)
                if computed is None:
                    problem = (
                        f"{str(path)!r}: the tensor read from bytes {start:,}-{start + size:,} is on the {storage.device} device "
                        f"with no memory of its own, where the save recorded {size:,} bytes of data; the item was crafted"
                    )
                    raise CorruptCheckpointError(corruption_message([problem], self.root))
                actual = computed
            else:  # not one data record we can vouch for in memory: read those bytes back
                with open(path, "rb", buffering=0) as f:
                    actual = crc32(os.pread(f.fileno(), size, start))
            if _hex(actual) != crc:
                problem = (
                    f"{str(path)!r} was altered or replaced after the save: the CRC-32 of bytes {start:,}-{start + size:,} "
                    f"differs from the one recorded at save (flipped bits, a bad copy, or another rank's or another save's "
                    f"shard in its place)"
                )
                raise CorruptCheckpointError(corruption_message([problem], self.root))


# ---------------------------------------------------------------- declared sizes against the bytes present

#: How ``torch.save``'s legacy (non-zip) format starts: pickle protocol 2, then its magic number.
LEGACY_TORCH_HEAD = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
#: A deflate-compressed record of a full file (``torch.save`` writes none, a zip tool may) is decoded when it
#: declares at most this many times its stored size; a zip bomb declares about a thousand times.
MAX_COMPRESSION_RATIO = 32

#: How many quantized values one storage byte may hold (``torch.quint2x4``: four): ``_rebuild_qtensor`` allocates
#: its declared shape before it points the tensor at the storage.
QUANTIZED_VALUES_PER_BYTE = 4
#: What a pickle torch's safe loader reads must spell (a literal ``GLOBAL``, its only way to a global) to call a
#: constructor that allocates a declared size; a pickle holding none of these bytes is not walked.
SIZED_TOKENS = (b"Tensor", b"TypedStorage", b"UntypedStorage", b"bytearray", b"_rebuild_qtensor")


def sized_constructor(name: str) -> bool:
    """Whether calling global ``name`` (``"module.qualname"``) reserves whatever size its arguments declare.

    torch's safe loader allows ``bytearray(2**30)``, ``torch.FloatTensor(n)`` (any backend's legacy class)
    and ``torch.storage.UntypedStorage(n)``; ``torch.save`` calls none of them.
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

    torch's safe loader decides which globals may be named; this bounds what it does not: no
    :func:`sized_constructor` call (``bytearray`` only of data), also not through
    ``_rebuild_from_type_v2``, and ``_rebuild_qtensor`` within :data:`QUANTIZED_VALUES_PER_BYTE`.
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

    Every record must lie inside the archive, stored (or, with ``compressed``, deflated at most
    :data:`MAX_COMPRESSION_RATIO` times), and no pickle may call a :func:`sized_constructor`. With
    ``whole`` (the archive's bytes, every record stored) free of :data:`SIZED_TOKENS`, no pickle is walked.
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


def verify_zip(path: Path) -> str | None:
    """Check every entry of a ``torch.save`` archive against its CRC-32 (bounded first); return a problem or None.

    A legacy (non-zip) file has no checksums: it passes when it starts with that format's magic number.
    Anything that is no checkpoint at all is a ValueError.
    """
    regular_file_size(path.parent, path.name)
    if path.suffix == ".safetensors":
        return _check_safetensors_header(path)
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(len(LEGACY_TORCH_HEAD))
        if head[:2] == b"PK":
            return f"{str(path)!r} is truncated or damaged: its zip directory is missing or unreadable"
        if head == LEGACY_TORCH_HEAD:
            return None
        what = "an empty file" if not head else f"a file of {path.stat().st_size:,} bytes that starts with {head[:8]!r}"
        raise ValueError(
            f"{str(path)!r} is not a checkpoint: {what}, neither a torch.save archive (zip or legacy format) "
            f"nor a .safetensors file. Check the path."
        )
    with open_regular(path) as f:  # bounded before testzip inflates anything: a zip bomb is refused, not decompressed
        check_archive(f, os.fstat(f.fileno()).st_size, repr(str(path)), compressed=True)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"{str(path)!r} is truncated or damaged: {exc}"
    if bad is not None:
        return f"{str(path)!r} was altered or damaged after the save: entry {bad!r} fails its CRC-32 check"
    return None


def _check_safetensors_header(path: Path) -> str | None:
    """A .safetensors file whose header, read by the safetensors library, describes every byte of it."""
    try:
        from safetensors import safe_open  # safetensors is optional (hp-lightning[safetensors])

        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except ImportError:
        return None  # reading it needs the package anyway, and says so
    except Exception as exc:  # noqa: BLE001 - the library's own account of what is wrong
        return f"{str(path)!r} is truncated or damaged: its safetensors header does not describe its bytes ({exc})"
    return None


def check_index(root: Path, metadata: dcp_metadata.Metadata, where: str) -> None:
    """Every size DCP's index (file ``where``) declares is backed by bytes present, before anything is allocated from it.

    Each tensor entry's chunks tile it exactly (missing chunks would leave memory nothing fills); each
    chunk's storage item holds at least its bytes, inside a regular file of the directory.
    """
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        name = info.relative_path  # a string: read_dcp_metadata checked it names a file inside root
        if name not in sizes:
            sizes[name] = regular_file_size(root, name)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > sizes[name]:
            raise CorruptCheckpointError(
                f"{describe_entry(root, index.fqn, name)}: DCP's index places it at bytes {offset!r}+{length!r}, outside the "
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


# ---------------------------------------------------------------- each tensor DCP loads, against its index entry


def describe_entry(root: Any, fqn: str, name: str) -> str:
    """How an error names DCP entry ``fqn`` of checkpoint ``root``, stored in file ``name``."""
    return f"Entry {fqn!r} of {str(root)!r} (in {name!r})"


class _CheckedTarget(torch.Tensor):
    """The model's memory as DCP's copy target, whose ``copy_`` first checks its source (:meth:`TensorCheck.target`)."""

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


class TensorCheck:
    """Each tensor DCP loads from directory ``source``, checked before it is copied into the model.

    The loaded tensor must be the one the index promised: its dtype, a dense layout of the chunk's shape
    filling exactly the chunk's bytes (never narrowed or cast); and, given a :class:`ReadCheck`, its CRC-32.
    """

    def __init__(self, source: Path, check: Optional[ReadCheck] = None) -> None:
        self.source = Path(source)
        self.check = check
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}

    def target(self, plain: torch.Tensor, metadata: Optional[dcp_metadata.Metadata], item: ReadItem) -> torch.Tensor:
        """``plain`` (the model's memory DCP copies ``item`` into) as a tensor that checks what is copied into it."""
        target = plain.as_subclass(_CheckedTarget)
        target.plain = plain
        target.check = functools.partial(self.verify, metadata, item)
        return target

    def verify(self, metadata: Optional[dcp_metadata.Metadata], item: ReadItem, loaded: torch.Tensor) -> None:
        """Refuse ``loaded`` (DCP's narrowed view of the tensor it read for ``item``) unless it is what the index promised."""
        assert metadata is not None  # set by DCP before any read
        fqn = item.storage_index.fqn
        info = metadata.storage_data[item.storage_index]
        entry = metadata.state_dict_metadata[fqn]
        where = describe_entry(self.source, fqn, info.relative_path)
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata) or not isinstance(loaded, torch.Tensor):
            raise CorruptCheckpointError(f"{where}: the index and the item disagree on whether it is a tensor; the checkpoint is damaged.")
        dtype = entry.properties.dtype
        storage = loaded.untyped_storage()
        if loaded.device != devices.cpu_device() or (storage.nbytes() and not storage.data_ptr()):
            raise CorruptCheckpointError(
                f"{where}: the archive holds a tensor on the {loaded.device} device, with no bytes of its own in memory "
                f"(DCP reads every item onto the CPU); it was crafted and is refused."
            )
        if not self._chunks:  # each chunk's shape by (entry, offsets), built once per load
            self._chunks = {
                (name, tuple(c.offsets)): tuple(c.sizes)
                for name, e in metadata.state_dict_metadata.items()
                if isinstance(e, dcp_metadata.TensorStorageMetadata)
                for c in e.chunks
            }
        sizes = self._chunks.get((fqn, tuple(item.storage_index.offset or ())))
        if loaded.dtype != dtype:
            raise CorruptCheckpointError(f"{where}: the archive holds a {loaded.dtype} tensor where the index declares {dtype}; it is refused, not cast.")
        nbytes = storage.nbytes()
        if sizes is None or nbytes != math.prod(sizes) * loaded.element_size() or not _dense_from_start(loaded, sizes, item.storage_offsets):
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
