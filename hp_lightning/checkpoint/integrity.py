"""What a sharded checkpoint's manifest records about each file, and how a load checks it.

Every file gets a **CRC-32 of every byte** by default, and with ``checkpoint_checksums=True`` a
SHA-256 as well. Both catch the accidents that matter (flipped bits, a partial or bad copy, a
shard replaced by another rank's file of the same size, a truncated file) and name the file;
SHA-256 adds cryptographic strength, at the price of a read-back at save and a slower hash at load.

CRC-32 costs a save almost nothing, because torch already computes it: DCP writes each tensor as a
small ``torch.save`` zip archive inside the shard file, and torch's zip writer stores the CRC-32
of every record it writes (torch never checks them on load). :func:`shard_record` takes those
values from the archives' directories for the large records (the tensor bytes) and reads only the
rest of the file (zip headers, pickles, small tensors: a few kilobytes per tensor) to compute its
own CRC-32 of it. The manifest then holds, per shard file::

    {"size": 123456, "crc32": "<CRC-32 of the bytes outside the ranges>",
     "crc32_ranges": [[offset, length, "<CRC-32>"], ...]}

A resume checks every byte it uses without a second read (:class:`ReadCheck`): before DCP reads
anything, the size and the bytes outside the ranges (a few kilobytes per tensor) are read and
checked; then, as DCP reads each tensor, the bytes it loaded are checked against their range's
CRC-32 before they are copied into the model. ``verify`` and conversion read every byte once
(:func:`verify_file`). Which bytes a range covers and what their CRC is are fixed in the manifest,
so a shard from another rank or another save fails even when it is internally consistent. A
record with neither CRC nor SHA-256 (manifests of hp_lightning before this check) is checked by
its size only.

zlib's CRC-32 releases the GIL and runs at several GB/s per core, about twice SHA-256's speed.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

#: Read size when checking or hashing files (one buffer, reused).
READ_SIZE = 8 << 20
#: Records at least this long are vouched for by the CRC-32 torch stored for them; shorter ones are
#: read back at save (reading a few kilobytes costs less than a seek through the archive).
TORCH_CRC_MIN = 64 << 10

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"

Span = tuple[int, int]


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


class FileWindow(io.RawIOBase):
    """A read-only window ``[offset, offset + length)`` of an open file, seekable (for ``zipfile`` and ``torch.load``).

    The window's position is the file's own (minus ``offset``): a read moves the file, and only a
    seek seeks it, so reading a window front to back costs what reading the file there would
    (no seek per read, a buffered file's buffer kept). Nothing else may move the file meanwhile.
    """

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

    def read(self, size: Optional[int] = -1) -> bytes:
        left = max(self._offset + self._length - self._file.tell(), 0)
        return bytes(self._file.read(left if size is None or size < 0 or size > left else size))


_EOCD = struct.Struct("<4s4xHHIIH")  # end of central directory: signature, entries here, entries, size, offset, comment length
_ZIP64_LOCATOR = struct.Struct("<4sIQI")  # signature, disk, offset of the zip64 end record, disks
_ZIP64_EOCD = struct.Struct("<4sQHHII8xQQQ")  # signature, record size, versions, disks, (entries here), entries, size, offset
_CENTRAL = struct.Struct("<4s4xHH4xIIIHHH8xI")  # signature, flags, method, CRC, sizes, name/extra/comment lengths, header offset
_TAIL = 4096
_FULL32 = 0xFFFFFFFF

#: One record of an archive: (local header offset, stored size, uncompressed size, CRC-32, compression method).
Member = tuple[int, int, int, int, int]


def _zip64_values(extra: bytes, wanted: int) -> Optional[list[int]]:
    """The first ``wanted`` 8-byte values of a zip64 extra field (id 1), or None."""
    position = 0
    while position + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, position)
        if tag == 1 and size >= 8 * wanted:
            return list(struct.unpack_from(f"<{wanted}Q", extra, position + 4))
        position += 4 + size
    return None


def _members(fd: int, offset: int, length: int) -> Optional[list[Member]]:
    """The records of the zip archive at ``[offset, offset + length)`` of ``fd``, from its central
    directory (two or three small reads); None for anything this short path does not read (then
    :mod:`zipfile` is asked)."""
    named = _named_members(fd, offset, length)
    return None if named is None else [member for _, member in named]


def _named_members(fd: int, offset: int, length: int) -> Optional[list[tuple[str, Member]]]:
    """:func:`_members` with each record's name."""
    tail = os.pread(fd, min(length, _TAIL), offset + length - min(length, _TAIL))
    if len(tail) < _EOCD.size or tail[-_EOCD.size : -_EOCD.size + 4] != b"PK\x05\x06":
        return None
    _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack(tail[-_EOCD.size :])
    if comment:
        return None
    if _FULL32 in (cd_size, cd_offset) or entries == 0xFFFF:
        locator = tail[-_EOCD.size - _ZIP64_LOCATOR.size : -_EOCD.size]
        if len(locator) != _ZIP64_LOCATOR.size:
            return None
        signature, _, record_at, _ = _ZIP64_LOCATOR.unpack(locator)
        record = os.pread(fd, _ZIP64_EOCD.size, offset + record_at) if signature == b"PK\x06\x07" else b""
        if len(record) != _ZIP64_EOCD.size or record[:4] != b"PK\x06\x06":
            return None
        _, _, _, _, _, _, entries, cd_size, cd_offset = _ZIP64_EOCD.unpack(record)
    if cd_offset + cd_size > length:
        return None
    tail_start = length - len(tail)
    if cd_offset >= tail_start:
        directory = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        directory = os.pread(fd, cd_size, offset + cd_offset)
    members: list[tuple[str, Member]] = []
    position = 0
    for _ in range(entries):
        if position + _CENTRAL.size > len(directory):
            return None
        signature, flags, method, crc, stored, size, name_length, extra_length, comment_length, header_at = _CENTRAL.unpack_from(directory, position)
        if signature != b"PK\x01\x02" or flags & 1:  # an encrypted record: not torch's; zipfile (or torch) decides
            return None
        if _FULL32 in (stored, size, header_at):
            extra_at = position + _CENTRAL.size + name_length
            wide = _zip64_values(directory[extra_at : extra_at + extra_length], [size, stored, header_at].count(_FULL32))
            if wide is None:
                return None
            values = iter(wide)  # zip64 order: uncompressed size, compressed size, header offset
            size = next(values) if size == _FULL32 else size
            stored = next(values) if stored == _FULL32 else stored
            header_at = next(values) if header_at == _FULL32 else header_at
        name = directory[position + _CENTRAL.size : position + _CENTRAL.size + name_length].decode("utf-8", "replace")
        members.append((name, (header_at, stored, size, crc, method)))
        position += _CENTRAL.size + name_length + extra_length + comment_length
    return members


def archive_records(
    fd: int, offset: int, length: int, wanted: Callable[[str], bool] = lambda name: True
) -> Optional[dict[str, tuple[int, int, int]]]:
    """The ``wanted`` records of the zip archive at ``[offset, offset + length)`` of ``fd``:
    name -> (absolute offset of its bytes, length, CRC-32); None for an archive this short path does
    not read, or one with a compressed record (the caller then lets ``torch.load`` read it).

    A few small reads: the archive's tail and central directory, and each wanted record's local header.
    """
    members = _named_members(fd, offset, length)
    if members is None:
        return None
    records = {}
    for name, (header_at, stored, size, crc, method) in members:
        if method != zipfile.ZIP_STORED or stored != size:
            return None
        if not wanted(name):
            continue
        header = os.pread(fd, _LOCAL_HEADER.size, offset + header_at)
        if len(header) != _LOCAL_HEADER.size:
            return None
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        start = offset + header_at + _LOCAL_HEADER.size + name_length + extra_length
        if signature != _LOCAL_SIGNATURE or start + size > offset + length or name in records:
            return None
        records[name] = (start, size, crc)
    return records


def _members_by_zipfile(file: Any, offset: int, length: int) -> list[Member]:
    try:
        with zipfile.ZipFile(FileWindow(file, offset, length)) as archive:
            return [(i.header_offset, i.compress_size, i.file_size, i.CRC, i.compress_type) for i in archive.infolist()]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return []  # not a zip archive: all of it is read by shard_record


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
                members = _members(fd, offset, length)
            except (struct.error, ValueError):  # unreadable here: its bytes are read and CRC-32'd like any others
                members = None
            if members is None:
                members = _members_by_zipfile(f, offset, length)
            for header_at, stored, size, crc, method in members:
                if method != zipfile.ZIP_STORED or size < TORCH_CRC_MIN or crc == 0 or stored != size:
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
            crc = zlib.crc32(chunk, crc)
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
    problems = []
    for name in names:
        problem = verify_file(Path(root) / name, records[name], ranges_on_read=ranges_on_read)
        if problem:
            problems.append(problem)
    return problems


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


def _storage_crc(storage: Any) -> int:
    """CRC-32 of a CPU storage's bytes, read in place (no copy)."""
    size = storage.nbytes()
    if size == 0:
        return zlib.crc32(b"")
    return zlib.crc32((ctypes.c_char * size).from_address(storage.data_ptr()))


class ReadCheck:
    """A resume's check of each tensor DCP loads, against the CRC-32 ranges of the file it came from.

    DCP reads a tensor by loading one whole ``torch.save`` archive (an item of the shard file) and
    then copying from it; :meth:`problem` is called in between, with the item's span and the
    loaded tensor. The range the manifest recorded inside that span is the archive's data record,
    whose bytes are exactly the loaded storage: their CRC-32 is computed in place (~4 GB/s, no
    second read) and compared. Any other range inside the span is read back from the file.
    The bytes outside the ranges were checked before DCP started (:func:`verify_file` with
    ``ranges_on_read``). So no tensor reaches the model unchecked; a mismatch fails the load on
    every rank (DCP gathers every rank's read failure), with the tensors before it already copied.
    """

    def __init__(self, root: Path, records: Mapping[str, Mapping[str, Any]]) -> None:
        self.root = Path(root)
        self.recorded = frozenset(records)  #: every file the manifest vouches for; any other is refused
        self._ranges: dict[str, list[tuple[int, int, str]]] = {}
        self._starts: dict[str, list[int]] = {}
        for name, record in records.items():
            size = record.get("size") if isinstance(record, Mapping) else None
            if not isinstance(size, int) or "sha256" in record:
                continue  # SHA-256 records are read whole before DCP starts
            ranges = _recorded_ranges(record, size) or []
            self._ranges[name] = ranges
            self._starts[name] = [o for o, _, _ in ranges]

    def covers(self, name: str) -> bool:
        return name in self._ranges

    def problem(self, name: str, offset: int, length: int, tensor: Any) -> Optional[str]:
        """None when every range inside item ``[offset, offset + length)`` of file ``name`` matches."""
        ranges, starts = self._ranges.get(name), self._starts.get(name)
        if not ranges or starts is None:
            return None
        first = max(bisect.bisect_right(starts, offset) - 1, 0)  # a range may begin before the item and reach into it
        inside = []
        for position in range(first, len(ranges)):
            start, size, crc = ranges[position]
            if start >= offset + length:
                break
            if start + size > offset:
                inside.append((start, size, crc))
        if not inside:
            return None
        storage = tensor.untyped_storage() if tensor is not None else None
        path = self.root / name
        for start, size, crc in inside:
            if len(inside) == 1 and start >= offset and start + size <= offset + length and storage is not None and storage.nbytes() == size:
                actual = _storage_crc(storage)
            else:  # not one data record we can vouch for in memory: read those bytes back
                with open(path, "rb", buffering=0) as f:
                    actual = zlib.crc32(os.pread(f.fileno(), size, start))
            if _hex(actual) != crc:
                return (
                    f"{str(path)!r} was altered or replaced after the save: the CRC-32 of bytes {start:,}-{start + size:,} "
                    f"differs from the one recorded at save (flipped bits, a bad copy, or another rank's or another save's "
                    f"shard in its place)"
                )
        return None
