"""``AsyncSaves`` in one process (DCP without a process group): publish, held-back removals, failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hp_lightning.checkpoint import AsyncSaves, load_checkpoint
from hp_lightning.checkpoint import layout as checkpoint_layout
from hp_lightning.checkpoint.layout import is_complete
from tests.helpers import RegressionModule


def lightning_checkpoint(model: torch.nn.Module, step: int) -> dict:
    return {"state_dict": {k: v.detach() for k, v in model.state_dict().items()}, "global_step": step, "pytorch-lightning_version": "2"}


def test_a_save_is_published_whole_and_removals_wait_for_it(tmp_path: Path) -> None:
    model = RegressionModule()
    saves = AsyncSaves()
    saves.save(lightning_checkpoint(model, 1), tmp_path / "a.ckpt")
    saves.wait()
    assert is_complete(tmp_path / "a.ckpt") and not saves.in_flight
    saves.save(lightning_checkpoint(model, 2), tmp_path / "b.ckpt")
    assert saves.in_flight
    saves.remove(tmp_path / "a.ckpt")  # ModelCheckpoint dropping the older save: held until b is published
    saves.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.ckpt"] and is_complete(tmp_path / "b.ckpt")
    fresh = RegressionModule()
    rest = load_checkpoint(tmp_path / "b.ckpt", fresh, [])
    assert rest["global_step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_the_state_is_copied_when_the_save_starts(tmp_path: Path) -> None:
    model = RegressionModule()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saves = AsyncSaves()
    saves.save(lightning_checkpoint(model, 1), tmp_path / "a.ckpt")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the files are written
    saves.wait()
    fresh = RegressionModule()
    load_checkpoint(tmp_path / "a.ckpt", fresh, [])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def test_the_kept_host_copy_is_refreshed_at_every_save(tmp_path: Path) -> None:
    # The host buffers are reused between saves: each save must still write the state of its own step.
    model = RegressionModule()
    saves = AsyncSaves()
    expected = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step)
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        saves.save(lightning_checkpoint(model, step), tmp_path / f"s{step}.ckpt")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)  # changed in place while that save writes
    saves.wait()
    saves.close()
    for step, state in expected.items():
        fresh = RegressionModule()
        assert load_checkpoint(tmp_path / f"s{step}.ckpt", fresh, [])["global_step"] == step
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items()), step


def test_a_failed_publish_is_raised_at_the_next_wait_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = RegressionModule()
    saves = AsyncSaves()
    saves.save(lightning_checkpoint(model, 1), tmp_path / "a.ckpt")
    saves.wait()

    def full_disk(root: Path, manifest: dict) -> None:
        raise OSError(28, "No space left on device", str(root))

    monkeypatch.setattr(checkpoint_layout, "write_manifest", full_disk)
    saves.save(lightning_checkpoint(model, 2), tmp_path / "a.ckpt")
    with pytest.raises(OSError, match="No space left on device"):
        saves.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]  # the previous save, untouched
    assert load_checkpoint(tmp_path / "a.ckpt", RegressionModule(), [])["global_step"] == 1
