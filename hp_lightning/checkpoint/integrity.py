"""What a sharded checkpoint's manifest records about each file, and how a load checks it.

Every file gets a **CRC-32 of every byte** by default, and with ``checkpoint_checksums=True`` a
SHA-256 as well. Both catch the accidents that matter (flipped bits, a partial or bad copy, a
shard replaced by another rank's file of the same size, a truncated file) and name the file;
SHA-256 adds cryptographic strength, at the price of a read-back at save and a slower hash at load.

CRC-32 costs a save almost nothing: torch's zip writer already stores the CRC-32 of every record
of the ``torch.save`` archive DCP writes per tensor; :func:`shard_record` takes those of the large
records (the tensor bytes) and reads back only the rest. The manifest then holds, per shard file::

    {"size": 123456, "crc32": "<CRC-32 of the bytes outside the ranges>",
     "crc32_ranges": [[offset, length, "<CRC-32>"], ...]}

A resume checks every byte it uses without a second read (:class:`ReadCheck`): the size and the
bytes outside the ranges before DCP reads anything, then each tensor's range as DCP loads it.
``verify`` and conversion read every byte once (:func:`verify_file`). The ranges and their CRCs are
fixed in the manifest, so another rank's or save's shard fails even when internally consistent. A
record with neither CRC nor SHA-256 (older manifests) is checked by its size only.

The CRC-32 releases the GIL and runs at several GB/s per core: zlib's at ~3.7 GB/s (about twice
SHA-256's speed), ISA-L's at ~11 GB/s when the ``fast-crc`` extra (``isal``) is installed. Both
compute the same checksum, so a checkpoint written with one is verified by the other.

Every reader also checks a file here before it opens it: named inside the checkpoint directory
(:func:`check_contained`) and a regular file (:func:`open_regular`; a FIFO or a device could block
or never end). What fails is one of the two errors every loader raises for a bad checkpoint,
:class:`CorruptCheckpointError` or :class:`UnsafeCheckpointError`.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import io
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, Optional

#: Read size when checking or hashing files (one buffer, reused).
READ_SIZE = 8 << 20
#: Records at least this long are vouched for by the CRC-32 torch stored for them; shorter ones are
#: read back at save (reading a few kilobytes costs less than a seek through the archive).
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


# ---------------------------------------------------------------- what every reader checks before it opens a file


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files do not match what was recorded when it was saved."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint that loading would let run code (a pickle safe loading refuses) or read files outside it.

    Raised before the refused object is built or the outside file is opened, naming the file or
    entry; a pickle refusal also names the opt-in for trusted files (``weights_only=False``).
    """



def corruption_message(problems: list[str], checkpoint: Path) -> str:
    """One error message for every problem found, with what to do next."""
    listed = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
    return (
        f"Checkpoint {str(checkpoint)!r} failed its integrity check: {listed}. It was damaged after it "
        f"was written (partial copy, disk or network fault, manual edit); restore it from a good copy "
        f"or resume from an earlier checkpoint."
    )



def outside_reason(root: Path, name: Any) -> str | None:
    """Why entry ``name`` of checkpoint directory ``root`` would lead outside it; None when it stays inside.

    Two checks: the name itself (no absolute path, drive or ``..`` part, in POSIX or Windows
    spelling: DCP and the manifest name files relative to the directory), then where it resolves
    to (a symlink, of the file or of a folder on the way, that leads out of ``root``).
    """
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
    """Refuse a checkpoint whose ``names`` (read from ``what``) lead outside directory ``root``.

    Raises:
        UnsafeCheckpointError: naming each such entry and where it leads.
    """
    root = Path(root)
    problems = [f"{name!r} ({reason})" for name in names if (reason := outside_reason(root, name))]
    if problems:
        listed = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
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
    """The size of file ``name`` of checkpoint directory ``root``, checked to be a regular file before anything opens it.

    Raises:
        CorruptCheckpointError: it is missing, or a FIFO, device, socket or directory.
    """
    path = Path(root) / name
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CorruptCheckpointError(f"{str(path)!r} is named by the checkpoint but cannot be read ({exc.strerror}); the checkpoint is incomplete.") from None
    _check_regular(path, info.st_mode)
    return info.st_size


def open_regular(path: Path) -> IO[bytes]:
    """Open ``path`` for reading if it is a regular file: checked before the open (a FIFO would block it), then
    on the file opened non-blocking (so it cannot be swapped in between).

    Raises:
        CorruptCheckpointError: a FIFO, device, socket or directory. OSError: it cannot be opened.
    """
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
    """``(offset, length, crc32)`` of the large records torch's zip writer stored CRC-32s for.

    ``items`` are the byte spans of the ``torch.save`` archives DCP wrote into ``path`` (its
    ``WriteResult`` offsets and lengths). Only stored (uncompressed) records of at least
    :data:`TORCH_CRC_MIN` bytes with a non-zero CRC are taken (``torch.serialization.set_crc32_options
    (False)`` writes zeros); anything else, or an item that is not a zip archive, stays in the bytes
    :func:`shard_record` reads itself, so nothing is ever left unchecked. A few small reads per
    tensor: each archive's central directory, and the local header of each large record.
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
    """The record of a DCP shard file just written, from the spans of the archives in it.

    By default the large records' CRC-32s come from torch's zip directories (nothing of them is
    read) and only the other bytes are read back; with ``sha256`` the whole file is read once for
    its SHA-256 and CRC-32 (:func:`file_record`).
    """
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
    """Check one file against its record; return a sentence naming the file if it does not match.

    The size first (a truncated file is named without reading it), then every byte against the
    CRC-32s and the SHA-256 the save recorded (one read). With ``ranges_on_read`` (a resume whose
    reader checks each range as it loads it, :class:`ReadCheck`) only the bytes outside the
    ranges are read here; a record with a SHA-256 is still read whole.
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
    """The record names split into ``parts`` lists of about equal bytes (largest first, to the lightest part).

    Deterministic, so every rank computes the same split from the same manifest.
    """
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

    Only a CPU storage with memory of its own may be read at its address: a meta storage reports its
    size but a null address (ISA-L's CRC-32 then reads address 0 and the process dies), another
    device's address is not host memory.
    """
    size = storage.nbytes()
    from hp_lightning.core.devices import CPU  # torch is loaded already: a storage exists

    if storage.device.type != CPU:
        return None
    if size == 0:
        return crc32(b"")
    address = storage.data_ptr()
    return crc32((ctypes.c_char * size).from_address(address)) if address else None


class ReadCheck:
    """A resume's check of each tensor DCP loads, against the CRC-32 ranges of the file it came from.

    :meth:`verify_item` is called between DCP's ``torch.load`` of an item and its copy into the model
    (by :class:`~hp_lightning.checkpoint.unpickle.SafeLoadPlanner`). The range recorded inside the
    item is the archive's data record, whose bytes are exactly the loaded storage: its CRC-32 is
    computed in place (~4 GB/s, no second read); any other range inside the item is read back.
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
