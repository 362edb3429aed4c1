"""Integrity by default, in one process: a flipped, swapped or truncated shard is named; a full disk says so.

Sharded checkpoints are written by ``save_checkpoint`` / ``AsyncSaves`` without a process group
(DCP's single-process path, the code the ranks run). The full-disk cases write onto a real, small
tmpfs the test mounts and unmounts (root is needed to mount; the test says so and skips otherwise).
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hp_lightning.checkpoint import AsyncSaves, CorruptCheckpointError, load_checkpoint, save_checkpoint
from hp_lightning.checkpoint import convert
from hp_lightning.checkpoint.integrity import TORCH_CRC_MIN
from hp_lightning.checkpoint.layout import MANIFEST_FILE, STAGING_MARKER

SHARD = "__0_0.distcp"


class Weights(torch.nn.Module):
    """Two large tensors (their CRC-32s come from torch's writer) and a small one (read back at save)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.big = torch.nn.Parameter(torch.randn(128, 256))  # 128 KiB
        self.other = torch.nn.Parameter(torch.randn(64, 512))  # 128 KiB
        self.small = torch.nn.Parameter(torch.randn(7))


def _checkpoint(module: torch.nn.Module, step: int) -> dict:
    return {"state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()}, "global_step": step, "epoch": 0,
            "pytorch-lightning_version": "2.6.6"}


def _save(path: Path, seed: int = 0, step: int = 1, checksums: bool = False) -> Weights:
    module = Weights(seed)
    save_checkpoint(_checkpoint(module, step), path, sharded=True, checksums=checksums)
    return module


def _load_error(path: Path) -> str:
    with pytest.raises(CorruptCheckpointError) as info:
        load_checkpoint(path, Weights(99), [])
    with pytest.raises(CorruptCheckpointError):
        convert.verify(path)  # the command line's check says the same
    return str(info.value)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _shard_record(path: Path) -> dict:
    return json.loads((path / MANIFEST_FILE).read_text())["files"][SHARD]


# ---------------------------------------------------------------- item: caught by default, naming the file


def test_the_default_records_torchs_crcs_for_the_tensor_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    _save(path)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["checksum"] == "crc32"
    record = manifest["files"][SHARD]
    data = (path / SHARD).read_bytes()
    ranges = record["crc32_ranges"]
    assert len(ranges) == 2 and all(length >= TORCH_CRC_MIN for _, length, _ in ranges)  # the two large tensors
    # What torch's writer stored is the CRC-32 of exactly those bytes (nothing of them was read at save) ...
    for offset, length, crc in ranges:
        assert f"{zlib.crc32(data[offset:offset + length]):08x}" == crc
    # ... and the manifest's own CRC covers every other byte of the file.
    rest = bytearray()
    position = 0
    for offset, length, _ in ranges:
        rest += data[position:offset]
        position = offset + length
    rest += data[position:]
    assert f"{zlib.crc32(bytes(rest)):08x}" == record["crc32"]
    assert "CRC-32" in convert.verify(path)


@pytest.mark.parametrize("writer", ["isal", "zlib"])
def test_either_crc_implementation_verifies_what_the_other_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """The ``fast-crc`` extra (ISA-L, installed by the test extra) and zlib compute the same CRC-32: a checkpoint
    saved with one loads exactly under the other, and a flipped bit is still named."""
    from isal.isal_zlib import crc32 as isal_crc32

    from hp_lightning.checkpoint import integrity

    assert integrity.CRC32_IMPLEMENTATION == "isal" and integrity.crc32 is isal_crc32
    implementations = {"isal": isal_crc32, "zlib": zlib.crc32}
    monkeypatch.setattr(integrity, "crc32", implementations[writer])
    saved = _save(tmp_path / "a.ckpt")
    monkeypatch.setattr(integrity, "crc32", implementations["zlib" if writer == "isal" else "isal"])
    loaded = Weights(99)
    load_checkpoint(tmp_path / "a.ckpt", loaded, [])
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))
    offset, length, _ = _shard_record(tmp_path / "a.ckpt")["crc32_ranges"][0]
    _flip(tmp_path / "a.ckpt" / SHARD, offset + length // 2)
    assert "was altered or replaced after the save" in _load_error(tmp_path / "a.ckpt")


@pytest.mark.parametrize("where", ["tensor bytes", "zip header", "small tensor"])
def test_a_flipped_bit_anywhere_is_named(tmp_path: Path, where: str) -> None:
    path = tmp_path / "a.ckpt"
    _save(path)
    record = _shard_record(path)
    first_offset, first_length, _ = record["crc32_ranges"][0]
    at = {"tensor bytes": first_offset + first_length // 2, "zip header": 10, "small tensor": (path / SHARD).stat().st_size - 700}[where]
    assert (first_offset <= at < first_offset + first_length) == (where == "tensor bytes")
    _flip(path / SHARD, at)
    message = _load_error(path)
    assert f"{SHARD}' was altered or replaced after the save" in message and "CRC-32" in message, message


def test_a_shard_swapped_in_from_another_save_of_the_same_size_is_named(tmp_path: Path) -> None:
    _save(tmp_path / "a.ckpt", seed=0)
    _save(tmp_path / "b.ckpt", seed=1)
    assert (tmp_path / "a.ckpt" / SHARD).stat().st_size == (tmp_path / "b.ckpt" / SHARD).stat().st_size
    shutil.copy(tmp_path / "b.ckpt" / SHARD, tmp_path / "a.ckpt" / SHARD)  # internally consistent, but not a's
    message = _load_error(tmp_path / "a.ckpt")
    assert f"{SHARD}' was altered or replaced" in message and "another rank's or another save's shard" in message, message


def test_a_truncated_shard_is_named_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    _save(path)
    data = (path / SHARD).read_bytes()
    (path / SHARD).write_bytes(data[: len(data) // 2])
    assert f"{SHARD}' is truncated" in _load_error(path)


def test_without_torchs_crcs_every_byte_is_read_back_and_still_checked(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    torch.serialization.set_crc32_options(False)
    try:
        _save(path)
    finally:
        torch.serialization.set_crc32_options(True)
    record = _shard_record(path)
    assert "crc32_ranges" not in record  # torch wrote zeros: nothing to take from it
    _flip(path / SHARD, (path / SHARD).stat().st_size // 2)
    assert f"{SHARD}' was altered or replaced" in _load_error(path)


def test_checksums_true_adds_sha256(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    _save(path, checksums=True)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["checksum"] == "sha256"
    assert all("sha256" in r and "crc32" in r for r in manifest["files"].values())
    assert "SHA-256" in convert.verify(path)
    _flip(path / SHARD, (path / SHARD).stat().st_size // 2)
    assert f"{SHARD}' was altered after the save: SHA-256" in _load_error(path)


def test_an_intact_checkpoint_loads_exactly(tmp_path: Path) -> None:
    saved = _save(tmp_path / "a.ckpt", step=5)
    fresh = Weights(99)
    assert load_checkpoint(tmp_path / "a.ckpt", fresh, [])["global_step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))


# ---------------------------------------------------------------- item: a full disk during a sharded save


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs that holds one checkpoint of :class:`Weights` and not two, mounted for this test only."""
    probe = tmp_path / "probe.ckpt"
    _save(probe)
    size = sum(p.stat().st_size for p in probe.iterdir())
    mount = tmp_path / "small"
    mount.mkdir()
    pages = (size + size // 2) // 4096 + 1
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * 4096}", "tmpfs", str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root (mount said: {done.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _assert_full_disk(error: BaseException, target: Path) -> None:
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    assert f"No space left on device while writing checkpoint '{target}' (" in str(error) and " bytes free on " in str(error), str(error)


def _assert_previous_intact(target: Path, saved: Weights) -> None:
    assert not [p.name for p in target.parent.iterdir() if STAGING_MARKER in p.name]  # nothing half-written left behind
    fresh = Weights(99)
    assert load_checkpoint(target, fresh, [])["global_step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))


def test_a_full_disk_during_a_sharded_save_is_named_and_the_previous_checkpoint_stays(small_disk: Path) -> None:
    target = small_disk / "last.ckpt"
    saved = _save(target, seed=0, step=1)
    with pytest.raises(OSError) as info:
        _save(target, seed=1, step=2)  # its shard does not fit beside the previous checkpoint
    _assert_full_disk(info.value, target)
    _assert_previous_intact(target, saved)


def test_a_full_disk_during_an_async_save_names_the_save(small_disk: Path) -> None:
    target = small_disk / "last.ckpt"
    saved = _save(target, seed=0, step=1)
    saves = AsyncSaves()
    try:
        saves.save(_checkpoint(Weights(1), 7), target)
        with pytest.raises(OSError) as info:
            saves.wait()
    finally:
        saves.close()
    _assert_full_disk(info.value, target)
    assert f"The async save 1 of this run (to '{target}', started at global step 7, epoch 0) failed in the background" in str(info.value)
    _assert_previous_intact(target, saved)
