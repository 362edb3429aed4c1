"""Checkpoint paths that used to be silent or destructive, now refused with the cause and the path.

Each case is a row of the outside fault audit (issue 17): a checkpoint without its completion
mark, ``verify`` on bytes that are no checkpoint, the converter pointed at an existing folder,
``ckpt_path`` naming random bytes or an empty file, and a full disk during a save.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hp_lightning.checkpoint import layout, load_checkpoint, read_full_file, save_checkpoint
from hp_lightning.checkpoint.__main__ import main


def _checkpoint(path: Path, *, sharded: bool) -> Path:
    weights = {"net.w": torch.randn(6, 4), "net.b": torch.randn(6)}
    save_checkpoint({"state_dict": weights, "global_step": 3, "loops": {}}, path, sharded=sharded)
    return path


@pytest.fixture
def junk(tmp_path: Path) -> dict[str, Path]:
    random_bytes = tmp_path / "random.ckpt"
    random_bytes.write_bytes(random.Random(0).randbytes(3000))
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    return {"random": random_bytes, "empty": empty}


def test_sharded_checkpoint_without_its_manifest_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "run.ckpt", sharded=True)
    (path / layout.MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match="completion mark 'hp_lightning.json' is\\s+missing"):
        layout.classify(path)
    with pytest.raises(ValueError, match="refused rather than loaded unverified"):
        load_checkpoint(path, torch.nn.Linear(4, 6), [])


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_verify_never_passes_what_is_not_a_checkpoint(junk: dict[str, Path], kind: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", str(junk[kind])]) == 1
    captured = capsys.readouterr()
    assert "OK" not in captured.out
    assert f"{str(junk[kind])!r} is not a checkpoint" in captured.err


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_loading_junk_names_the_path(junk: dict[str, Path], kind: str) -> None:
    with pytest.raises(ValueError, match="is not a checkpoint") as info:
        read_full_file(junk[kind])
    assert str(junk[kind]) in str(info.value)
    # Unverified, the reader still names the path instead of a bare UnpicklingError / EOFError.
    with pytest.raises(ValueError, match="Could not read checkpoint") as info:
        read_full_file(junk[kind], verify=False)
    assert str(junk[kind]) in str(info.value)


@pytest.mark.parametrize("command", ["consolidate", "shard"])
def test_converter_never_deletes_an_existing_folder(tmp_path: Path, command: str, capsys: pytest.CaptureFixture) -> None:
    source = _checkpoint(tmp_path / ("src.ckpt" if command == "consolidate" else "src_full.ckpt"), sharded=command == "consolidate")
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("user data")
    assert main([command, str(source), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    # Even with --overwrite, something that is not a checkpoint is never replaced.
    assert main([command, str(source), str(out), "--overwrite"]) == 1
    assert "is never replaced" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "user data"


def test_overwrite_replaces_only_a_checkpoint(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "src.ckpt", sharded=True)
    out = _checkpoint(tmp_path / "out.ckpt", sharded=False)
    assert main(["consolidate", str(source), str(out)]) == 1
    assert main(["consolidate", str(source), str(out), "--overwrite"]) == 0
    assert torch.load(out, weights_only=False)["hp_lightning"]["consolidated_from"] == str(source)


def test_training_save_never_replaces_a_user_folder(tmp_path: Path) -> None:
    target = tmp_path / "data"
    target.mkdir()
    (target / "train.csv").write_text("1,2,3")
    with pytest.raises(ValueError, match="is never replaced"):
        _checkpoint(target, sharded=True)
    assert (target / "train.csv").read_text() == "1,2,3"


def test_full_disk_is_named_with_the_path(tmp_path: Path) -> None:
    # /dev/full fails every write with ENOSPC, as a full file system does; torch.save reports it
    # as an 'unexpected pos' RuntimeError from its zip writer.
    if not Path("/dev/full").exists():
        pytest.fail("/dev/full is missing on this Linux machine")
    with pytest.raises(RuntimeError) as raw:
        torch.save({"w": torch.zeros(1 << 16)}, "/dev/full")
    error = layout.write_error(raw.value, tmp_path / "last.ckpt")
    assert "No space left on device while writing checkpoint" in str(error) and "last.ckpt" in str(error)
    assert "previous checkpoint of that name is untouched" in str(error)
