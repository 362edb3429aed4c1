"""Checkpoints under faults: killed saves, damaged files and bad input, on real gloo ranks.

* A real training run (2 ranks, ``ModelCheckpoint(save_last=True)`` every step) is SIGKILLed in
  the middle of its third save: a rank dies after writing its shards (sharded), rank 0 dies
  between the two renames of a filesystem without atomic exchange (sharded), rank 0 dies halfway
  through writing the file (full). Afterwards every ``*.ckpt`` entry is a complete checkpoint,
  unfinished saves are refused by name, and ``ckpt_path="last"`` resumes from step 2.
* Each bad input raises the same clear error on every rank (naming the file or key), within the
  launch's time limit: a hang would fail the launch instead.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.distributed.test_checkpoint_resume import fit_run
from tests.helpers import RegressionModule, full_params, run_distributed

# ---------------------------------------------------------------- killed saves

KILLED_AT_SAVE = 3


def _last_saves(root: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=root, save_top_k=0, save_last=True, every_n_train_steps=1)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _on_nth_call(original: Callable[..., Any], n: int, before: bool, rank: int) -> Callable[..., Any]:
    """Wrap ``original`` so that on this rank its n-th call SIGKILLs the process (before or after running)."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        doomed = calls[0] == n and int(os.environ["RANK"]) == rank
        if doomed and before:
            _kill_self()
        result = original(*args, **kwargs)
        if doomed:
            _kill_self()
        return result

    return wrapped


def _half_written_save(original: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``torch.save`` whose n-th write of a staged checkpoint on rank 0 stops halfway: what a kill mid-write leaves."""
    from hp_lightning.checkpoint.layout import STAGING_MARKER

    calls = [0]

    def wrapped(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and STAGING_MARKER in str(f) and int(os.environ["RANK"]) == 0:
            calls[0] += 1
            if calls[0] == n:
                buffer = io.BytesIO()
                original(obj, buffer, *args, **kwargs)
                with open(f, "wb") as out:
                    out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                    out.flush()
                    os.fsync(out.fileno())
                _kill_self()
        return original(obj, f, *args, **kwargs)

    return wrapped


def killed_run(tmp: str, fault: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from hp_lightning.checkpoint import layout

    fmt = "full" if fault == "full_mid_write" else "sharded"
    if fault == "rank1_after_its_shards":
        FileSystemWriter.write_data = _on_nth_call(FileSystemWriter.write_data, KILLED_AT_SAVE, before=False, rank=1)
    elif fault == "rank0_between_renames":
        layout.exchange = lambda a, b: False  # a filesystem without renameat2(RENAME_EXCHANGE)
        # Saves 2 and 3 replace last.ckpt by two renames; die after the first rename of save 3.
        layout.set_aside = _on_nth_call(layout.set_aside, KILLED_AT_SAVE - 1, before=False, rank=0)
    else:
        torch.save = _half_written_save(torch.save, KILLED_AT_SAVE)
    fit_run(2, mesh_shape=[2], state_dict_type=fmt, max_steps=5, callbacks=(_last_saves(Path(tmp)),))


def resume_after_kills(dirs: dict[str, str]) -> dict[str, Any]:
    out = {}
    for fault, tmp in dirs.items():
        fmt = "full" if fault == "full_mid_write" else "sharded"
        run = fit_run(2, mesh_shape=[2], state_dict_type=fmt, max_steps=5, ckpt_path="last", callbacks=(_last_saves(Path(tmp)),))
        out[fault] = {"start_step": run["start_step"], "global_step": run["global_step"], "listing": sorted(os.listdir(tmp))}
    return out


FAULTS = ("rank1_after_its_shards", "rank0_between_renames", "full_mid_write")


def _saved_step(path: Path) -> int:
    from hp_lightning.checkpoint import CheckpointKind, classify
    from hp_lightning.checkpoint.convert import verify

    verify(path)  # raises on anything incomplete or damaged
    if classify(path) is CheckpointKind.FULL_FILE:
        return torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    return torch.load(path / "meta.pt", weights_only=False)["global_step"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dirs, after_kill = {}, {}
    for fault in FAULTS:
        tmp = tmp_path_factory.mktemp(fault)
        with pytest.raises(RuntimeError, match="distributed run failed"):
            run_distributed(killed_run, 2, str(tmp), fault, timeout=240)
        dirs[fault] = str(tmp)
        after_kill[fault] = sorted(os.listdir(tmp))
        # What the directory holds right after the kill, before anything touches it.
        after_kill[fault + ":steps"] = {name: _saved_step(tmp / name) for name in after_kill[fault] if name.endswith(".ckpt")}
    resumed = run_distributed(resume_after_kills, 2, dirs, timeout=240)[0]
    return {"dirs": dirs, "after_kill": after_kill, "resumed": resumed}


@pytest.mark.parametrize("fault", FAULTS)
def test_killed_save_leaves_the_previous_checkpoint_loadable(killed: dict[str, Any], fault: str) -> None:
    from hp_lightning.checkpoint.layout import PREVIOUS_MARKER, STAGING_MARKER

    listing = killed["after_kill"][fault]
    steps = killed["after_kill"][fault + ":steps"]
    # Every entry a "*.ckpt" scan (or ckpt_path="last") can find is complete, and it is save 2.
    assert steps and set(steps.values()) == {KILLED_AT_SAVE - 1}, (listing, steps)
    staged = [name for name in listing if STAGING_MARKER in name]
    assert len(staged) == 1, listing  # the interrupted save 3, under a name no loader accepts
    if fault == "rank0_between_renames":
        assert "last.ckpt" not in listing and any(PREVIOUS_MARKER in name for name in listing), listing
    else:
        assert "last.ckpt" in listing


@pytest.mark.parametrize("fault", FAULTS)
def test_unfinished_save_is_refused_by_name(killed: dict[str, Any], fault: str) -> None:
    from hp_lightning.checkpoint import classify
    from hp_lightning.checkpoint.layout import STAGING_MARKER

    root = Path(killed["dirs"][fault])
    staged = [name for name in killed["after_kill"][fault] if STAGING_MARKER in name]
    with pytest.raises(ValueError, match="did not finish") as info:
        classify(root / staged[0])
    assert "last.ckpt" in str(info.value)


@pytest.mark.parametrize("fault", FAULTS)
def test_resume_after_kill_picks_the_last_complete_checkpoint(killed: dict[str, Any], fault: str) -> None:
    resumed = killed["resumed"][fault]
    assert resumed["start_step"] == KILLED_AT_SAVE - 1
    assert resumed["global_step"] == 5
    # The next saves finished the interrupted swap or swept the leftovers: only last.ckpt remains.
    assert resumed["listing"] == ["last.ckpt"]
    assert _saved_step(Path(killed["dirs"][fault]) / "last.ckpt") == 5


# ---------------------------------------------------------------- bad input


def _sharded_model(depth: int = 2, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A RegressionModule sharded over the world (FSDP) and stepped once, so the optimizer has state."""
    from hp_lightning import fully_shard, init_device_mesh

    torch.manual_seed(depth * 100 + width)
    model = RegressionModule(width=width, depth=depth)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for block in model.net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.net, mesh=mesh)  # the root unit: tests call model.net(x) directly
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.net(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, *, sharded: bool, checksums: bool = False) -> None:
    import lightning

    from hp_lightning.checkpoint import model_state_dict, optimizer_state_dict, save_checkpoint

    checkpoint = {
        "state_dict": model_state_dict(model, full=not sharded),
        "optimizer_states": [optimizer_state_dict(model, optimizer, full=not sharded)],
        "pytorch-lightning_version": lightning.__version__,
        "global_step": 1,
    }
    save_checkpoint(checkpoint, path, sharded=sharded, checksums=checksums)


def _outcome(action: Callable[[], Any]) -> tuple[str, str]:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
        return type(exc).__name__, str(exc)
    return "ok", ""


def _on_rank0(action: Callable[[], Any]) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def bad_input_worker(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.pytorch import Trainer

    import hp_lightning
    from hp_lightning.checkpoint import load_checkpoint, load_weights, model_state_dict, save_checkpoint

    dist.init_process_group("gloo")
    root = Path(tmp)
    model, optimizer = _sharded_model()
    for fmt, name in (("sharded", "good"), ("full", "good.ckpt")):
        _save(model, optimizer, root / name, sharded=fmt == "sharded", checksums=True)
    _save(model, optimizer, root / "good_sizes_only", sharded=True)  # the default: sizes and CRC-32s, no SHA-256
    save_checkpoint({"state_dict": model_state_dict(model, full=False), "global_step": 1}, root / "weights_only", sharded=True)
    for depth, width, tag in ((3, 16, "deeper"), (1, 16, "shallower"), (2, 24, "wider")):
        other, other_optimizer = _sharded_model(depth=depth, width=width)
        _save(other, other_optimizer, root / tag, sharded=True)
        _save(other, other_optimizer, root / f"{tag}.ckpt", sharded=False)
    sgd_model, _ = _sharded_model()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    sgd_model.net(torch.randn(4, 8)).sum().backward()
    sgd.step()
    _save(sgd_model, sgd, root / "sgd", sharded=True)

    def damage() -> None:
        for case, edit in (("missing_shard", lambda d: (d / "__1_0.distcp").unlink()),
                           ("truncated_shard", lambda d: _truncate(d / "__0_0.distcp")),
                           ("altered_shard", lambda d: _flip_byte(d / "__1_0.distcp")),
                           ("newer_format", lambda d: _bump_version(d / "hp_lightning.json"))):
            shutil.copytree(root / "good", root / case)
            edit(root / case)
        for case, edit in (("truncated_unsummed", lambda d: _truncate(d / "__0_0.distcp")),
                           ("altered_unsummed", lambda d: _flip_byte(d / "__1_0.distcp")),
                           ("crafted_dtype", _point_at_float64),
                           ("fifo_shard", _fifo_in_lightning_layout)):
            shutil.copytree(root / "good_sizes_only", root / case)
            edit(root / case)
        shutil.copy(root / "good.ckpt", root / "truncated.ckpt")
        _truncate(root / "truncated.ckpt")
        shutil.copy(root / "good.ckpt", root / "altered.ckpt")
        _flip_byte(root / "altered.ckpt", at=0.3)
        full = torch.load(root / "good.ckpt", weights_only=False)
        full["hp_lightning"]["format_version"] = 99
        torch.save(full, root / "newer.ckpt")
        (root / "notes").mkdir()
        (root / "notes" / "README.txt").write_text("not a checkpoint")
        torch.save({"0.weight": torch.zeros(3, 3), "0.bias": torch.zeros(3)}, root / "other_model.pt")
        torch.save(RegressionModule().net.state_dict(), root / "pretrained_net.pt")
        torch.save(RegressionModule().state_dict(), root / "pretrained_module.pt")
        from safetensors.torch import save_file

        save_file(RegressionModule().net.state_dict(), str(root / "pretrained_net.safetensors"))

    _on_rank0(damage)
    load = lambda name, strict=True, into=model, optimizers=(optimizer,): lambda: load_checkpoint(root / name, into, list(optimizers), strict=strict)  # noqa: E731
    shallow, _ = _sharded_model(depth=1)
    out: dict[str, Any] = {
        "nonexistent": _outcome(load("no_such.ckpt")),
        "not_a_checkpoint": _outcome(load("notes")),
        "unfinished_save": _outcome(load("good.ckpt.hp-partial-0123456789ab")),
        "missing_shard": _outcome(load("missing_shard")),
        "truncated_shard": _outcome(load("truncated_shard")),
        "altered_shard": _outcome(load("altered_shard")),
        # Saved with the defaults (no SHA-256): the size names a truncated shard without reading it,
        # and the CRC-32s recorded at save name a same-size alteration.
        "truncated_unsummed": _outcome(load("truncated_unsummed")),
        "altered_unsummed": _outcome(load("altered_unsummed")),
        # Crafted, not damaged (the manifest signed again): refused by the readers themselves, on both ranks, no hang.
        "crafted_dtype": _outcome(load("crafted_dtype")),
        "fifo_shard": _outcome(load("fifo_shard")),
        "newer_format": _outcome(load("newer_format")),
        "truncated_full": _outcome(load("truncated.ckpt")),
        "altered_full": _outcome(load("altered.ckpt")),
        "newer_full": _outcome(load("newer.ckpt")),
        "other_model": _outcome(load("other_model.pt")),
        "other_optimizer": _outcome(load("sgd")),
        "weights_only_into_training": _outcome(load("weights_only")),
    }
    for fmt, suffix in (("sharded", ""), ("full", ".ckpt")):
        out[f"unexpected_strict_{fmt}"] = _outcome(load("deeper" + suffix))
        out[f"missing_strict_{fmt}"] = _outcome(load("shallower" + suffix))
        out[f"shape_strict_{fmt}"] = _outcome(load("wider" + suffix))
        out[f"shape_nonstrict_{fmt}"] = _outcome(load("wider" + suffix, strict=False))
        # Non-strict: the common keys load, the rest stays as it was.
        deeper, _ = _sharded_model(depth=3)
        reference = full_params(deeper)
        out[f"unexpected_nonstrict_{fmt}"] = _outcome(load("deeper" + suffix, strict=False))
        out[f"unexpected_nonstrict_{fmt}:match"] = max(float((full_params(model)[k] - reference[k]).abs().max()) for k in full_params(model))
        before = full_params(model)
        out[f"missing_nonstrict_{fmt}"] = _outcome(load("shallower" + suffix, strict=False, into=model, optimizers=()))
        after, shallow_params = full_params(model), full_params(_sharded_model(depth=1)[0])
        out[f"missing_nonstrict_{fmt}:loaded"] = max(float((after[k] - shallow_params[k]).abs().max()) for k in shallow_params)
        out[f"missing_nonstrict_{fmt}:kept"] = max(float((after[k] - before[k]).abs().max()) for k in after if k not in shallow_params)
    # Fine-tuning: a bare state dict of the inner network, loaded into the sharded submodule.
    out["pretrained"] = _outcome(lambda: load_weights(model.net, root / "pretrained_net.pt"))
    out["pretrained:match"] = max(
        float((full_params(model.net)[k] - v).abs().max()) for k, v in torch.load(root / "pretrained_net.pt").items()
    )
    out["pretrained_prefix"] = _outcome(lambda: load_weights(model.net, root / "good.ckpt", prefix="net."))
    out["pretrained_safetensors"] = _outcome(lambda: load_weights(model.net, root / "pretrained_net.safetensors"))
    from safetensors.torch import load_file

    out["pretrained_safetensors:match"] = max(
        float((full_params(model.net)[k] - v).abs().max()) for k, v in load_file(str(root / "pretrained_net.safetensors")).items()
    )
    # Through the Trainer: the strategy's load raises on every rank instead of hanging.
    trainer = Trainer(devices=2, accelerator="cpu", strategy=hp_lightning.HSDPStrategy(mesh_shape=[2]), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    from tests.helpers import make_dataset, rank_loader

    out["trainer_altered"] = _outcome(lambda: trainer.fit(RegressionModule(), rank_loader(make_dataset(), 16, 2), ckpt_path=str(root / "altered_shard")))
    # A bare state dict through ckpt_path: the weights load (validate shows them), training starts at step 0.
    pretrained = torch.load(root / "pretrained_module.pt")
    module = RegressionModule()
    trainer = Trainer(devices=2, accelerator="cpu", strategy=hp_lightning.HSDPStrategy(mesh_shape=[2]), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    out["trainer_bare_weights_validate"] = _outcome(lambda: trainer.validate(module, rank_loader(make_dataset(), 16, 2), ckpt_path=str(root / "pretrained_module.pt")))
    out["trainer_bare_weights_validate:match"] = max(float((full_params(module)[k] - v).abs().max()) for k, v in pretrained.items())
    trainer = Trainer(devices=2, accelerator="cpu", strategy=hp_lightning.HSDPStrategy(mesh_shape=[2]), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    out["trainer_bare_weights_fit"] = _outcome(lambda: trainer.fit(RegressionModule(), rank_loader(make_dataset(), 16, 2), ckpt_path=str(root / "pretrained_module.pt")))
    out["trainer_bare_weights_fit:step"] = trainer.global_step
    return out


def _point_at_float64(root: Path) -> None:
    """One chunk of DCP's index pointed at an appended archive of its shape in float64, the manifest signed again."""
    import dataclasses
    import pickle

    from hp_lightning.checkpoint.integrity import file_record
    from hp_lightning.checkpoint.layout import DCP_METADATA_FILE, MANIFEST_FILE

    with open(root / DCP_METADATA_FILE, "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - the test's own file
    key = next(k for k in metadata.storage_data if k.fqn.endswith("blocks.0.fc1.weight"))
    chunk = next(c for c in metadata.state_dict_metadata[key.fqn].chunks if tuple(c.offsets) == tuple(key.offset))
    buffer = io.BytesIO()
    torch.save(torch.zeros(tuple(chunk.sizes), dtype=torch.float64), buffer)
    shard = root / metadata.storage_data[key].relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=offset, length=len(buffer.getvalue()))
    with open(root / DCP_METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    manifest["files"] = {name: file_record(root / name, checksum=False) for name in manifest["files"]}
    (root / MANIFEST_FILE).write_text(json.dumps(manifest))


def _fifo_in_lightning_layout(root: Path) -> None:
    """Lightning's layout (no manifest, a meta.pt without hp_lightning's record) whose second shard file is a FIFO."""
    (root / "hp_lightning.json").unlink()
    meta = torch.load(root / "meta.pt", weights_only=False)
    meta.pop("hp_lightning")
    torch.save(meta, root / "meta.pt")
    (root / "__1_0.distcp").unlink()
    os.mkfifo(root / "__1_0.distcp")


def _bump_version(manifest: Path) -> None:
    record = json.loads(manifest.read_text())
    record["format_version"] = 99
    manifest.write_text(json.dumps(record))


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(bad_input_worker, 2, str(tmp_path_factory.mktemp("bad_input")), timeout=240)


EXPECTED_ERRORS = {
    # case: (error type, what the message must name)
    "nonexistent": ("FileNotFoundError", ["no_such.ckpt", "does not exist", "good.ckpt"]),
    "not_a_checkpoint": ("ValueError", ["notes", "not a checkpoint", "README.txt"]),
    "unfinished_save": ("ValueError", ["hp-partial", "did not finish", "good.ckpt'"]),
    "missing_shard": ("CorruptCheckpointError", ["__1_0.distcp", "is missing"]),
    "truncated_shard": ("CorruptCheckpointError", ["__0_0.distcp", "truncated"]),
    "altered_shard": ("CorruptCheckpointError", ["__1_0.distcp", "altered", "SHA-256"]),
    "truncated_unsummed": ("CorruptCheckpointError", ["__0_0.distcp", "truncated"]),
    # The default's CRC-32s catch a same-size alteration too (before, only checkpoint_checksums=True did).
    "altered_unsummed": ("CorruptCheckpointError", ["__1_0.distcp", "altered or replaced", "CRC-32"]),
    "crafted_dtype": ("CorruptCheckpointError", ["crafted_dtype", "blocks.0.fc1.weight", "torch.float64 tensor where the index declares torch.float32"]),
    "fifo_shard": ("CorruptCheckpointError", ["fifo_shard", "__1_0.distcp", "is a FIFO, not a regular file"]),
    "newer_format": ("ValueError", ["hp_lightning.json", "format 99", "Upgrade"]),
    "truncated_full": ("CorruptCheckpointError", ["truncated.ckpt", "truncated"]),
    "altered_full": ("CorruptCheckpointError", ["altered.ckpt", "CRC-32"]),
    "newer_full": ("ValueError", ["newer.ckpt", "format 99"]),
    "other_model": ("ValueError", ["other_model.pt", "shares no key", "0.weight"]),
    "other_optimizer": ("ValueError", ["sgd", "optimizer 0", "exp_avg"]),
    "weights_only_into_training": ("KeyError", ["weights_only", "holds no optimizer state", "load_weights"]),
    "unexpected_strict_sharded": ("ValueError", ["deeper", "unexpected keys", "net.blocks.2."]),
    "missing_strict_sharded": ("ValueError", ["shallower", "missing keys", "net.blocks.1."]),
    "shape_strict_sharded": ("ValueError", ["wider'", "'net.blocks.0.fc1.weight': (48, 24) in the checkpoint, (32, 16) in the model", "and 9 more"]),
    "shape_nonstrict_sharded": ("ValueError", ["wider'", "'net.blocks.0.fc1.weight': (48, 24) in the checkpoint, (32, 16) in the model", "and 9 more"]),
    "unexpected_strict_full": ("ValueError", ["deeper.ckpt", "unexpected keys", "net.blocks.2."]),
    "missing_strict_full": ("ValueError", ["shallower.ckpt", "missing keys", "net.blocks.1."]),
    "shape_strict_full": ("ValueError", ["wider.ckpt", "'net.blocks.0.fc1.weight': (48, 24) in the checkpoint, (32, 16) in the model", "and 9 more"]),
    "shape_nonstrict_full": ("ValueError", ["wider.ckpt", "'net.blocks.0.fc1.weight': (48, 24) in the checkpoint, (32, 16) in the model", "and 9 more"]),
    "trainer_altered": ("CorruptCheckpointError", ["altered_shard", "__1_0.distcp", "altered"]),
}


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_bad_input_raises_a_clear_error_on_every_rank(bad_inputs: list[dict[str, Any]], case: str) -> None:
    kind, fragments = EXPECTED_ERRORS[case]
    for rank, results in enumerate(bad_inputs):
        raised, message = results[case]
        assert raised == kind, f"rank {rank}: {case} raised {raised}: {message}"
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {case}: {fragment!r} not in {message!r}"


@pytest.mark.parametrize("fmt", ("sharded", "full"))
def test_non_strict_loads_the_common_keys_and_keeps_the_rest(bad_inputs: list[dict[str, Any]], fmt: str) -> None:
    for results in bad_inputs:
        assert results[f"unexpected_nonstrict_{fmt}"] == ("ok", "")
        assert results[f"unexpected_nonstrict_{fmt}:match"] == 0.0
        assert results[f"missing_nonstrict_{fmt}"] == ("ok", "")
        assert results[f"missing_nonstrict_{fmt}:loaded"] == 0.0
        assert results[f"missing_nonstrict_{fmt}:kept"] == 0.0


def test_pretrained_weights_load_into_a_sharded_submodule(bad_inputs: list[dict[str, Any]]) -> None:
    for results in bad_inputs:
        assert results["pretrained"] == ("ok", "")
        assert results["pretrained:match"] == 0.0
        assert results["pretrained_prefix"] == ("ok", "")
        assert results["pretrained_safetensors"] == ("ok", "")
        assert results["pretrained_safetensors:match"] == 0.0


def test_bare_weights_through_ckpt_path_start_training_fresh(bad_inputs: list[dict[str, Any]]) -> None:
    for results in bad_inputs:
        assert results["trainer_bare_weights_validate"] == ("ok", "")
        assert results["trainer_bare_weights_validate:match"] == 0.0
        assert results["trainer_bare_weights_fit"] == ("ok", "")
        assert results["trainer_bare_weights_fit:step"] == 1
