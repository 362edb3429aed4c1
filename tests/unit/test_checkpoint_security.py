"""No checkpoint runs code by default, and no checkpoint entry leads outside its directory (issue 33).

A pickle that rebuilds an object through ``__reduce__`` runs any callable its writer chose. The
payload here writes a marker file, so "the payload never ran" is checked on disk, not assumed. It
is planted as an attacker would: in a full checkpoint, in a weights file, in a real sharded
directory's ``meta.pt``, its DCP index ``.metadata`` and a non-tensor DCP entry, each time with the
manifest re-recorded to match (so only safe loading stands in the way). Each entry point is called
with its default arguments (refused, naming the file, the type and the opt-in), then with the
documented trusted opt-in (it loads, and the payload runs, as it would for torch). The 2-rank cases
(the sharded ``meta.pt`` on every rank, ``Trainer.fit(ckpt_path=...)``) are in
tests/distributed/test_checkpoint_security.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from hp_lightning.checkpoint import (
    UnsafeCheckpointError,
    layout,
    load_checkpoint,
    load_from_checkpoint,
    load_weights,
    optimizer_state_dict,
    read_full_file,
    save_checkpoint,
)
from hp_lightning.checkpoint.__main__ import main
from hp_lightning.checkpoint.convert import consolidate, read_sharded, shard, verify
from hp_lightning.checkpoint.integrity import file_record
from hp_lightning.checkpoint.load import dcp_index
from hp_lightning.checkpoint.unpickle import resolve_weights_only

OPT_IN = "weights_only=False"


def leave_mark(marker: str) -> str:
    """What the payload runs when unpickled: it leaves a file behind."""
    Path(marker).write_text("the payload ran")
    return "payload"


class Payload:
    """An object whose unpickling calls :func:`leave_mark` (a stand-in for ``os.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return leave_mark, (self.marker,)


REFUSED_TYPE = f"{__name__}.leave_mark"


class Tiny(LightningModule):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, width)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in nn.Linear(4, 6).state_dict().items()}


def _lightning_checkpoint(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "state_dict": {f"net.{k}": v for k, v in weights.items()},
        "pytorch-lightning_version": "2.6.6",
        "hyper_parameters": {"width": 6},
        "global_step": 3,
        "loops": {"fit_loop": {}},
    }


def _rerecord(root: Path) -> None:
    """What an attacker does after editing a file: record its new size and checksum in the manifest."""
    manifest = json.loads((root / layout.MANIFEST_FILE).read_text())
    checksums = manifest.get("checksum") == "sha256"
    manifest["files"] = {n: file_record(root / n, checksum=checksums) for n in layout.data_files(root)}
    layout.write_manifest(root, manifest)


def _plant_in_meta(root: Path, marker: Path) -> None:
    meta = torch.load(root / layout.META_FILE, weights_only=False)  # the test's own file
    meta["callbacks"] = {"Evil": Payload(marker)}
    torch.save(meta, root / layout.META_FILE)
    _rerecord(root)


def _assert_refused(info: pytest.ExceptionInfo, named: Path | str, marker: Path) -> None:
    message = str(info.value)
    assert str(named) in message, message
    assert REFUSED_TYPE in message, message
    assert OPT_IN in message and "If you trust this file" in message, message
    assert not marker.exists(), "the payload ran"


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PAYLOAD_RAN"


# ---------------------------------------------------------------- single files


def test_a_full_checkpoint_with_a_payload_is_refused_by_every_reader(tmp_path: Path, marker: Path) -> None:
    weights = _weights()
    path = tmp_path / "full.ckpt"
    torch.save({**_lightning_checkpoint(weights), "callbacks": {"Evil": Payload(marker)}}, path)

    with pytest.raises(UnsafeCheckpointError) as info:
        read_full_file(path)
    _assert_refused(info, path, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(path, Tiny(), [])
    _assert_refused(info, path, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_weights(Tiny(), path)
    _assert_refused(info, path, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        shard(path, tmp_path / "out.ckpt")
    _assert_refused(info, path, marker)
    assert main(["shard", str(path), str(tmp_path / "out.ckpt")]) == 1 and not marker.exists()
    assert not (tmp_path / "out.ckpt").exists()
    with pytest.raises(pickle.UnpicklingError):  # Lightning's own loader refuses it too (a file goes to Lightning)
        load_from_checkpoint(Tiny, path)
    assert not marker.exists()

    # Trusted, explicitly: the documented path loads it (and, as torch would, runs what it carries).
    assert read_full_file(path, weights_only=False)["callbacks"]["Evil"] == "payload"
    assert marker.read_text() == "the payload ran"
    marker.unlink()
    model = Tiny()
    load_weights(model, path, weights_only=False)
    assert torch.equal(model.net.weight.detach(), weights["weight"]) and marker.exists()
    marker.unlink()
    assert main(["shard", str(path), str(tmp_path / "out.ckpt"), "--trust-pickle"]) == 0 and marker.exists()


def test_a_weights_file_with_a_payload_is_refused_and_plain_weights_load(tmp_path: Path, marker: Path) -> None:
    weights = _weights()
    planted = tmp_path / "pretrained.pt"
    torch.save({**weights, "extra": Payload(marker)}, planted)
    model = nn.Linear(4, 6)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_weights(model, planted)
    _assert_refused(info, planted, marker)

    plain = tmp_path / "plain.pt"
    torch.save(weights, plain)
    load_weights(model, plain)  # a bare state dict of tensors is what safe loading is for
    assert torch.equal(model.weight.detach(), weights["weight"])


def test_damaged_bytes_are_not_mistaken_for_a_question_of_trust(tmp_path: Path) -> None:
    path = tmp_path / "junk.ckpt"
    path.write_bytes(b"\x80\x04\xcd" + os.urandom(200))
    with pytest.raises(ValueError, match="Could not read checkpoint") as info:
        read_full_file(path, verify=False)
    assert not isinstance(info.value, UnsafeCheckpointError) and OPT_IN not in str(info.value)


def test_weights_only_takes_only_none_or_a_bool(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="weights_only expects None"):
        resolve_weights_only("False")  # type: ignore[arg-type]
    assert resolve_weights_only(None) is True and resolve_weights_only(False) is False
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch's own switch, honoured the way torch does
    assert resolve_weights_only(None) is False and resolve_weights_only(True) is True
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert resolve_weights_only(False) is True


# ---------------------------------------------------------------- sharded directories


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    path = tmp_path / "run.ckpt"
    save_checkpoint(_lightning_checkpoint(_weights()), path, sharded=True, checksums=True)
    return path


def test_what_hp_lightning_writes_loads_safely(sharded: Path, tmp_path: Path) -> None:
    """meta.pt, the DCP index and a full file of hp_lightning's own making need no opt-in."""
    model = Tiny()
    rest = load_checkpoint(sharded, model, [])
    assert rest["hp_lightning"]["format"] == "sharded" and rest["global_step"] == 3
    assert torch.equal(model.net.weight.detach(), _weights()["weight"])
    full = tmp_path / "full.ckpt"
    assert "wrote" in consolidate(sharded, full)
    assert read_full_file(full)["hp_lightning"]["consolidated_from"] == str(sharded)
    assert torch.equal(load_from_checkpoint(Tiny, sharded).net.weight.detach(), _weights()["weight"])
    assert torch.equal(load_from_checkpoint(Tiny, full).net.weight.detach(), _weights()["weight"])


def test_a_payload_in_meta_pt_is_refused_by_every_reader(sharded: Path, tmp_path: Path, marker: Path) -> None:
    _plant_in_meta(sharded, marker)
    meta = sharded / layout.META_FILE
    assert "OK" in verify(sharded)  # the manifest matches: integrity checks cannot catch this
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(sharded, Tiny(), [])
    _assert_refused(info, meta, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_from_checkpoint(Tiny, sharded)
    _assert_refused(info, meta, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        read_sharded(sharded)
    _assert_refused(info, meta, marker)
    out = tmp_path / "out.ckpt"
    assert main(["consolidate", str(sharded), str(out)]) == 1 and not out.exists() and not marker.exists()
    # Weights need nothing from meta.pt, so load_weights never opens it.
    model = Tiny()
    load_weights(model, sharded)
    assert torch.equal(model.net.weight.detach(), _weights()["weight"]) and not marker.exists()

    # Trusted, explicitly.
    rest = load_checkpoint(sharded, Tiny(), [], weights_only=False)
    assert rest["callbacks"]["Evil"] == "payload" and marker.exists()
    marker.unlink()
    assert torch.equal(load_from_checkpoint(Tiny, sharded, weights_only=False).net.weight.detach(), _weights()["weight"])
    assert marker.exists()
    marker.unlink()
    assert main(["consolidate", str(sharded), str(out), "--trust-pickle"]) == 0 and marker.exists()


def test_a_payload_in_the_dcp_index_is_refused(sharded: Path, marker: Path) -> None:
    """DCP's ``.metadata`` is a bare pickle that torch's own reader unpickles without restriction."""
    index = sharded / layout.DCP_METADATA_FILE
    with open(index, "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    metadata.storage_meta.modules = [Payload(marker)]
    with open(index, "wb") as f:
        pickle.dump(metadata, f)
    _rerecord(sharded)
    for read in (lambda: load_checkpoint(sharded, Tiny(), []), lambda: read_sharded(sharded), lambda: verify(sharded)):
        with pytest.raises(UnsafeCheckpointError) as info:
            read()
        _assert_refused(info, index, marker)
    assert main(["verify", str(sharded)]) == 1 and not marker.exists()

    model = Tiny()
    load_checkpoint(sharded, model, [], weights_only=False)
    assert torch.equal(model.net.weight.detach(), _weights()["weight"]) and marker.exists()


def test_a_payload_in_a_non_tensor_dcp_entry_is_refused(tmp_path: Path, marker: Path) -> None:
    """torch's DefaultLoadPlanner unpickles DCP's non-tensor entries with weights_only=False."""
    model = nn.Linear(4, 6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = optimizer_state_dict(model, optimizer, full=False)
    state["param_groups"][0]["lr"] = Payload(marker)
    path = tmp_path / "run.ckpt"
    save_checkpoint({"state_dict": model.state_dict(), "optimizer_states": [state], "pytorch-lightning_version": "2.6.6"}, path, sharded=True)

    fresh = nn.Linear(4, 6)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(path, fresh, [fresh_optimizer])
    _assert_refused(info, path, marker)
    assert "optimizer_0.param_groups.0.lr" in str(info.value)
    with pytest.raises(UnsafeCheckpointError) as info:
        consolidate(path, tmp_path / "out.ckpt")
    _assert_refused(info, path, marker)

    load_checkpoint(path, fresh, [fresh_optimizer], weights_only=False)
    assert fresh_optimizer.param_groups[0]["lr"] == "payload" and marker.exists()


# ---------------------------------------------------------------- paths stay inside


def _refused_everywhere(root: Path, entry: str, capsys: pytest.CaptureFixture) -> None:
    """load, verify (function and command line) and the converter refuse ``root``, naming ``entry``."""
    for read in (
        lambda: load_checkpoint(root, Tiny(), []),
        lambda: load_checkpoint(root, Tiny(), [], verify=False),
        lambda: load_weights(Tiny(), root),
        lambda: verify(root),
        lambda: read_sharded(root),
        lambda: load_from_checkpoint(Tiny, root),
    ):
        with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory") as info:
            read()
        assert repr(entry) in str(info.value), str(info.value)
    capsys.readouterr()
    assert main(["verify", str(root)]) == 1
    assert main(["consolidate", str(root), str(root.parent / "out.ckpt")]) == 1
    assert repr(entry) in capsys.readouterr().err
    assert not (root.parent / "out.ckpt").exists()


@pytest.mark.parametrize("entry", ["../outside", "/etc/hostname", "..\\outside"])
def test_a_manifest_naming_a_file_outside_is_refused(sharded: Path, entry: str, capsys: pytest.CaptureFixture) -> None:
    (sharded.parent / "outside").write_bytes(b"secret")
    manifest = json.loads((sharded / layout.MANIFEST_FILE).read_text())
    manifest["files"][entry] = {"size": 6}
    (sharded / layout.MANIFEST_FILE).write_text(json.dumps(manifest))
    _refused_everywhere(sharded, entry, capsys)


def test_a_symlinked_shard_is_refused(sharded: Path, capsys: pytest.CaptureFixture) -> None:
    shard_file = next(p for p in sharded.iterdir() if p.suffix == ".distcp")
    outside = sharded.parent / "elsewhere.distcp"
    shutil.move(shard_file, outside)  # the same bytes, so every size and checksum still matches
    shard_file.symlink_to(outside)
    _refused_everywhere(sharded, shard_file.name, capsys)


def test_a_dcp_index_naming_a_file_outside_is_refused(sharded: Path, capsys: pytest.CaptureFixture) -> None:
    index = sharded / layout.DCP_METADATA_FILE
    with open(index, "rb") as f:
        metadata = pickle.load(f)
    shard_file = next(p for p in sharded.iterdir() if p.suffix == ".distcp")
    shutil.copy(shard_file, sharded.parent / "stolen.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../stolen.distcp"
    with open(index, "wb") as f:
        pickle.dump(metadata, f)
    _rerecord(sharded)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory") as info:
        dcp_index(sharded)
    assert "'../stolen.distcp'" in str(info.value)
    _refused_everywhere(sharded, "../stolen.distcp", capsys)


def test_links_inside_a_checkpoint_or_to_it_still_load(sharded: Path, tmp_path: Path) -> None:
    """Lightning's save_last='link' points at a checkpoint directory; a link between its own files stays inside."""
    link = tmp_path / "last.ckpt"
    link.symlink_to(sharded.name)
    model = Tiny()
    load_checkpoint(link, model, [])
    assert torch.equal(model.net.weight.detach(), _weights()["weight"])
    assert "OK" in verify(link)


def test_saves_never_write_through_a_symlink(tmp_path: Path) -> None:
    """A save to a name that is a symlink replaces the link; what it pointed to is untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    weights = _weights()
    victim_file = elsewhere / "victim.ckpt"
    save_checkpoint(_lightning_checkpoint(weights), victim_file, sharded=False)
    victim_dir = elsewhere / "victim_dir.ckpt"
    save_checkpoint(_lightning_checkpoint(weights), victim_dir, sharded=True)
    before = {p: p.read_bytes() for p in [victim_file, *victim_dir.iterdir()]}

    target = tmp_path / "checkpoints"
    target.mkdir()
    newer = {k: v + 1 for k, v in weights.items()}
    for name, victim, sharded_save in (("full.ckpt", victim_file, False), ("dir.ckpt", victim_dir, True), ("cross.ckpt", victim_file, True)):
        (target / name).symlink_to(victim)
        save_checkpoint(_lightning_checkpoint(newer), target / name, sharded=sharded_save)
        assert not (target / name).is_symlink()
        model = Tiny()
        load_checkpoint(target / name, model, [])
        assert torch.equal(model.net.weight.detach(), newer["weight"])
    assert {p: p.read_bytes() for p in [victim_file, *victim_dir.iterdir()]} == before
    assert sorted(p.name for p in elsewhere.iterdir()) == ["victim.ckpt", "victim_dir.ckpt"]
