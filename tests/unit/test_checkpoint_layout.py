"""Checkpoint layout without a process group: recognizing formats, integrity records, atomic publish.

Sharded checkpoints here are written by ``save_checkpoint`` in one process (DCP without a process
group), the same code path the ranks take, with world size 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hp_lightning.checkpoint import CorruptCheckpointError, classify, layout, recover, save_checkpoint
from hp_lightning.checkpoint.integrity import file_record, verify_file, verify_zip
from hp_lightning.checkpoint.layout import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    PREVIOUS_MARKER,
    STAGING_MARKER,
    CheckpointKind,
    clean_stale,
    exchange,
    publish,
    read_manifest,
    remove,
    staging_path,
    swap_by_renames,
)


def write_sharded(path: Path, step: int = 1, checksums: bool = False) -> dict[str, torch.Tensor]:
    weights = {"net.w": torch.full((4, 3), float(step)), "net.b": torch.arange(3.0) + step}
    save_checkpoint({"state_dict": dict(weights), "global_step": step, "pytorch-lightning_version": "2.6.6"}, path, sharded=True,
                    checksums=checksums)
    return weights


def saved_step(path: Path) -> int:
    return torch.load(path / "meta.pt", weights_only=False)["global_step"]


# ---------------------------------------------------------------- recognizing a checkpoint


def test_sharded_checkpoint_has_a_manifest_covering_every_file(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    write_sharded(path)
    assert classify(path) is CheckpointKind.HP_SHARDED
    manifest = read_manifest(path)
    assert manifest["format_version"] == FORMAT_VERSION and manifest["world_size"] == 1
    on_disk = sorted(p.name for p in path.iterdir() if p.name not in (MANIFEST_FILE, layout.TOKEN_FILE))
    assert sorted(manifest["files"]) == on_disk
    assert {".metadata", "meta.pt"} <= set(on_disk)
    for name, record in manifest["files"].items():
        assert record["size"] == (path / name).stat().st_size and "crc32" in record and "sha256" not in record
        assert verify_file(path / name, record) is None  # the default: size and CRC-32 of every byte
    assert manifest["checksum"] == "crc32"
    write_sharded(tmp_path / "summed.ckpt", checksums=True)
    summed = read_manifest(tmp_path / "summed.ckpt")
    assert summed["checksum"] == "sha256"
    assert all(file_record(tmp_path / "summed.ckpt" / n) == r for n, r in summed["files"].items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "summed.ckpt"]  # nothing staged is left


def test_nonexistent_path_names_the_checkpoints_nearby(tmp_path: Path) -> None:
    write_sharded(tmp_path / "epoch=0-step=5.ckpt")
    with pytest.raises(FileNotFoundError, match=r"step=50\.ckpt' does not exist.*epoch=0-step=5\.ckpt"):
        classify(tmp_path / "epoch=0-step=50.ckpt")
    with pytest.raises(FileNotFoundError, match="folder .* does not exist either"):
        classify(tmp_path / "nowhere" / "x.ckpt")


def test_a_link_to_a_save_that_never_finished_is_named(tmp_path: Path) -> None:
    write_sharded(tmp_path / "step=2.ckpt")
    (tmp_path / "last.ckpt").symlink_to("step=4.ckpt")  # save_last="link" to an unpublished async save
    with pytest.raises(FileNotFoundError, match=r"last\.ckpt' is a link to 'step=4\.ckpt', which does not exist.*step=2\.ckpt"):
        classify(tmp_path / "last.ckpt")


def test_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.out").write_text("x")
    with pytest.raises(ValueError, match=r"'.*logs' is a directory but not a checkpoint.*events\.out"):
        classify(tmp_path / "logs")


def test_dcp_index_without_trainer_state_is_incomplete(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    write_sharded(path)
    (path / MANIFEST_FILE).unlink()
    (path / "meta.pt").unlink()
    with pytest.raises(ValueError, match="incomplete copy"):
        classify(path)


def test_lightning_layout_is_recognized(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    write_sharded(path)
    # What Lightning's ModelParallelStrategy writes: index, shards, and a meta.pt of its own.
    (path / MANIFEST_FILE).unlink()
    meta = torch.load(path / "meta.pt", weights_only=False)
    meta.pop("hp_lightning")
    torch.save(meta, path / "meta.pt")
    assert classify(path) is CheckpointKind.LIGHTNING_SHARDED


def test_staging_entry_is_refused_with_the_name_to_load_instead(tmp_path: Path) -> None:
    staged = staging_path(tmp_path / "last.ckpt", "0123abcd")
    write_sharded(staged)
    with pytest.raises(ValueError, match=r"did not finish.*'.*last\.ckpt'"):
        classify(staged)


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    write_sharded(path)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"format {FORMAT_VERSION + 1}.*reads formats up to {FORMAT_VERSION}.*Upgrade"):
        classify(path)


def test_damaged_manifest_is_named(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    write_sharded(path)
    (path / MANIFEST_FILE).write_text('{"format_version": 1, "files": ')
    with pytest.raises(CorruptCheckpointError, match=r"hp_lightning\.json' is damaged"):
        classify(path)


# ---------------------------------------------------------------- integrity records


def test_verify_file_tells_missing_truncated_grown_and_altered(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 4)
    record = file_record(path)
    assert verify_file(path, record) is None
    path.write_bytes(bytes(range(256)) * 4 + b"!")
    assert "altered (it grew)" in verify_file(path, record)
    path.write_bytes(bytes(range(256)) * 2)
    assert "truncated: 512 bytes on disk, 1024 recorded" in verify_file(path, record)
    data = bytearray(bytes(range(256)) * 4)
    data[700] ^= 1
    path.write_bytes(bytes(data))
    assert "altered after the save: SHA-256" in verify_file(path, record)
    assert "altered or replaced after the save: the CRC-32" in verify_file(path, {"size": 1024, "crc32": record["crc32"]})
    assert verify_file(path, {"size": 1024}) is None  # a manifest of an hp_lightning that recorded sizes only: not seen
    path.unlink()
    assert "'" + str(path) + "' is missing" in verify_file(path, record)


def test_verify_zip_checks_every_entry_crc(tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.arange(4096.0)}}, path)
    assert verify_zip(path) is None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "fails its CRC-32 check" in verify_zip(path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    assert "truncated or damaged" in verify_zip(path)
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert verify_zip(legacy) is None  # no checksums to check in the old format


# ---------------------------------------------------------------- publishing


@pytest.mark.parametrize("swap", ["exchange", "two_renames"])
def test_publish_replaces_a_checkpoint_whole(tmp_path: Path, swap: str) -> None:
    target = tmp_path / "last.ckpt"
    write_sharded(target, step=1)
    staged = staging_path(target, "feed")
    write_sharded(staged, step=2)
    if swap == "exchange":
        publish(staged, target)
    else:
        swap_by_renames(staged, target)
    assert saved_step(target) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_save_replaces_a_full_file_with_a_directory_and_back(tmp_path: Path) -> None:
    target = tmp_path / "x.ckpt"
    save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, target, sharded=False)
    assert classify(target) is CheckpointKind.FULL_FILE
    write_sharded(target, step=2)
    assert classify(target) is CheckpointKind.HP_SHARDED
    save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, target, sharded=False)
    assert torch.load(target, weights_only=False)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


KILLED_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    from hp_lightning.checkpoint import layout, save_checkpoint

    target = Path(sys.argv[1])
    save = lambda step: save_checkpoint({"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step}, target, sharded=True)
    save(1)
    layout.exchange = lambda a, b: False  # a filesystem without atomic exchange
    set_aside = layout.set_aside
    def set_aside_then_die(path):
        moved = set_aside(path)
        os.kill(os.getpid(), signal.SIGKILL)
    layout.set_aside = set_aside_then_die
    save(2)
    """
)


def test_kill_between_renames_is_recovered(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    run = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(target)], capture_output=True, timeout=120)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    previous = [n for n in names if PREVIOUS_MARKER in n]
    staged = [n for n in names if STAGING_MARKER in n]
    assert "last.ckpt" not in names and len(previous) == 1 and len(staged) == 1, names
    # The set-aside copy keeps the ".ckpt" suffix and the "last" stem: ckpt_path="last" still finds it.
    assert previous[0].startswith("last") and previous[0].endswith(".ckpt")
    assert saved_step(tmp_path / previous[0]) == 1
    # The next load or save of last.ckpt finishes the swap with the complete new save.
    assert recover(target) == tmp_path / staged[0]
    assert saved_step(target) == 2
    clean_stale(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_exchange_swaps_whole_directories_or_reports_it_cannot(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_sharded(a, step=1)
    write_sharded(b, step=2)
    if exchange(a, b):
        assert (saved_step(a), saved_step(b)) == (2, 1)
    else:  # a filesystem without RENAME_EXCHANGE: nothing moved, publish() falls back to two renames
        assert (saved_step(a), saved_step(b)) == (1, 2)


def test_remove_takes_the_whole_directory(tmp_path: Path) -> None:
    target = tmp_path / "a.ckpt"
    write_sharded(target)
    remove(target)
    assert list(tmp_path.iterdir()) == []
    remove(target)  # already gone: nothing to do


def test_the_collector_pause_nests_overlaps_across_threads_and_restores_what_was_there() -> None:
    import gc
    import threading

    from hp_lightning.checkpoint.layout import cyclic_gc_paused

    seen: list[bool] = []
    inside, release = threading.Event(), threading.Event()

    @cyclic_gc_paused
    def held() -> None:  # another thread's save, still running when this thread's ends
        inside.set()
        release.wait(5)

    @cyclic_gc_paused
    def inner() -> bool:
        return gc.isenabled()

    @cyclic_gc_paused
    def fails() -> None:
        raise OSError("disk")

    assert gc.isenabled()
    seen.append(inner())
    other = threading.Thread(target=held)
    other.start()
    inside.wait(5)
    seen.append(inner())
    seen.append(gc.isenabled())  # the other thread's call still holds the pause
    release.set()
    other.join()
    with pytest.raises(OSError):
        fails()
    assert seen == [False, False, False] and gc.isenabled()
    gc.disable()  # a program that runs without the collector keeps it off
    try:
        inner()
        assert not gc.isenabled()
    finally:
        gc.enable()
