"""Hugging Face directories built to mislead, in one process: tied copies that differ, and export records that lie.

* A module that ties two weights (one parameter) loads a directory holding both names only when the two
  copies are equal bit for bit; different copies are refused naming both keys and the largest difference
  (once the first was taken and the second dropped, silently).
* ``export_hf(..., overwrite=True)`` replaces an earlier export only through its own record: a record
  naming an absolute path, a ``../`` path or a link, or one whose token the directory does not carry, is
  refused before anything is written, and the file outside survives. An honest overwrite swaps the whole
  directory in one step and carries the user's own files (a README) over.

The strict read (a key DCP's reader does not find on some rank) is checked on two real ranks in
tests/distributed/test_checkpoint_security.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hp_lightning.checkpoint import CorruptCheckpointError, UnsafeCheckpointError, export_hf, layout, load_weights, save_checkpoint
from hp_lightning.checkpoint.hf import EXPORT_RECORD, HF_INDEX_FILE


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, as a causal LM with ``tie_word_embeddings``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def _hf_dir(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_tied_copies_load_only_when_they_are_equal(tmp_path: Path) -> None:
    embed = torch.arange(32.0).reshape(8, 4) / 10
    equal = _hf_dir(tmp_path / "equal", {"embed.weight": embed, "head.weight": embed.clone()})
    model = Tied()
    load_weights(model, equal)
    assert torch.equal(model.head.weight.detach(), embed) and model.head.weight is model.embed.weight

    changed = embed.clone()
    changed[5, 2] += 0.5
    differ = _hf_dir(tmp_path / "differ", {"embed.weight": embed, "head.weight": changed})
    model = Tied()
    before = model.embed.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=r"'embed\.weight' \(in 'model\.safetensors'\) and 'head\.weight'.*largest difference 0\.5") as info:
        load_weights(model, differ)
    assert str(differ) in str(info.value)
    assert torch.equal(model.embed.weight.detach(), before), "nothing is loaded before the refusal"

    # A NaN that is the same in both copies is equal bit for bit; one in only one copy is a difference.
    with_nan = embed.clone()
    with_nan[0, 0] = float("nan")
    same_nan = _hf_dir(tmp_path / "same_nan", {"embed.weight": with_nan, "head.weight": with_nan.clone()})
    load_weights(Tied(), same_nan)
    one_nan = _hf_dir(tmp_path / "one_nan", {"embed.weight": embed, "head.weight": with_nan})
    with pytest.raises(CorruptCheckpointError, match="largest difference nan"):
        load_weights(Tied(), one_nan)
    # Copies of different shapes: refused too (the module's shape check saw only the first).
    shapes = _hf_dir(tmp_path / "shapes", {"embed.weight": embed, "head.weight": torch.zeros(8, 5)})
    with pytest.raises(CorruptCheckpointError, match=r"\[8, 4\] float32 and \[8, 5\] float32"):
        load_weights(Tied(), shapes)


# ---------------------------------------------------------------- export-hf --overwrite


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model.ckpt"
    save_checkpoint({"state_dict": {"weight": torch.randn(4, 4), "bias": torch.randn(4)}}, path, sharded=False)
    return path


def _export(source: Path, out: Path, **kwargs: object) -> str:
    return export_hf(source, out, prefix="", **kwargs)  # type: ignore[arg-type]


def _edit_record(out: Path, **changes: object) -> None:
    record = json.loads((out / EXPORT_RECORD).read_text())
    record.update(changes)
    (out / EXPORT_RECORD).write_text(json.dumps(record))


def test_an_overwrite_swaps_the_whole_export_and_keeps_the_users_files(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(source, out)
    first = json.loads((out / EXPORT_RECORD).read_text())
    assert (out / layout.TOKEN_FILE).read_text() == first["token"]
    (out / "README.md").write_text("mine")
    inode = (out / "README.md").stat().st_ino
    _export(source, out, overwrite=True, dtype="bf16")
    second = json.loads((out / EXPORT_RECORD).read_text())
    assert second["token"] != first["token"] and (out / layout.TOKEN_FILE).read_text() == second["token"]
    assert (out / "README.md").read_text() == "mine" and (out / "README.md").stat().st_ino == inode  # the same file, linked over
    assert "README.md" not in second["files"] and HF_INDEX_FILE in second["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.ckpt"], "the old export's directory is gone, nothing staged is left"


def test_an_overwrite_without_atomic_exchange_renames_aside_then_in(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "hf"
    _export(source, out)
    (out / "notes.txt").write_text("keep")
    monkeypatch.setattr(layout, "exchange", lambda a, b: False)  # a filesystem without renameat2(RENAME_EXCHANGE)
    _export(source, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.ckpt"]


@pytest.mark.parametrize("entry", ["absolute", "dotdot", "link", "directory"])
def test_an_export_record_naming_anything_but_its_own_files_is_refused(source: Path, tmp_path: Path, entry: str) -> None:
    out = tmp_path / "hf"
    _export(source, out)
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    names = {"absolute": str(outside), "dotdot": "../outside.txt", "link": "link.txt", "directory": "folder"}
    if entry == "link":
        os.symlink(outside, out / "link.txt")
    if entry == "directory":
        (out / "folder").mkdir()
        (out / "folder" / "inside.txt").write_text("not yours either")
    record = json.loads((out / EXPORT_RECORD).read_text())
    _edit_record(out, files=[*record["files"], names[entry]])
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UnsafeCheckpointError, match=f"entry {names[entry]!r} of its {EXPORT_RECORD} is refused") as info:
        _export(source, out, overwrite=True)
    assert str(out) in str(info.value)
    assert outside.read_text() == "not yours" and sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.ckpt", "outside.txt"], "nothing staged is left"


def test_a_record_the_directory_does_not_vouch_for_is_refused(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _export(source, out)
    _edit_record(out, token="0123456789ab")  # a record copied from another export, or edited
    with pytest.raises(UnsafeCheckpointError, match="names token '0123456789ab', which the directory's"):
        _export(source, out, overwrite=True)
    (out / layout.TOKEN_FILE).unlink()
    with pytest.raises(UnsafeCheckpointError, match="holds no export record of ours"):
        _export(source, out, overwrite=True)
    (out / layout.TOKEN_FILE).write_text("0123456789ab")
    _edit_record(out, writer="someone else")
    with pytest.raises(CorruptCheckpointError, match="not a record this program writes"):
        _export(source, out, overwrite=True)
    # Weights beside the export that its record does not list: never replaced.
    _edit_record(out, writer="hp_lightning")
    (out / "model-00009-of-00009.safetensors").write_bytes(b"theirs")
    with pytest.raises(UnsafeCheckpointError, match="weights this program did not write"):
        _export(source, out, overwrite=True)
    assert (out / "model-00009-of-00009.safetensors").read_bytes() == b"theirs"
