"""Checkpoints with a pickle payload, read by real 2-rank gloo jobs: refused on every rank by default (issue 33).

One launch, after 2 real training steps saved both ways (a sharded directory, and the full file
the converter makes of it), with a ``__reduce__`` payload planted by rank 0 as an attacker would
(the sharded ``meta.pt`` re-recorded in the manifest, so integrity checks pass):

* ``Trainer.fit(ckpt_path=...)`` on the full file and on the sharded directory, and a direct
  ``load_checkpoint`` (every rank reads ``meta.pt`` itself), and Fabric's ``load`` of both: each raises
  ``UnsafeCheckpointError`` naming the file and the opt-in on every rank, the payload never runs,
  and the model is untouched (the refusal comes before any tensor moves);
* trusted (``load_checkpoint(weights_only=False)``; for ``fit``, torch's
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, see below), the payload runs and ``fit`` resumes from
  either file exactly as from the clean checkpoint: the same parameters and optimizer state, bit
  for bit;
* Hugging Face weights from a per-rank copy of the directory, rank 1's lacking a key: DCP's read is
  strict, so every rank refuses it (issue 49) instead of rank 1 keeping that tensor as initialized.

The single-process cases of every entry point are in tests/unit/test_checkpoint_security.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

from tests.distributed.test_checkpoint_resume import GLOBAL_BATCH, Observer, optimizer_by_name
from tests.helpers import RegressionModule, full_params, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs
from tests.unit.test_checkpoint_security import REFUSED_TYPE, Payload, _rerecord

WORLD = 2
SAVED_AT = 2
MAX_STEPS = 4


def _fit(ckpt_path: Optional[Path] = None, save_to: Optional[Path] = None, **fit_kwargs: Any) -> dict[str, Any]:
    import hp_lightning
    from hp_lightning.checkpoint import ResumableLoader

    seed_everything(0)
    model = RegressionModule()
    observer = Observer()
    strategy = hp_lightning.HSDPStrategy(mesh_shape=[WORLD], state_dict_type="sharded")
    trainer = Trainer(
        devices=WORLD, strategy=strategy, max_steps=SAVED_AT if save_to else MAX_STEPS, callbacks=[observer], **trainer_kwargs(enable_checkpointing=False)
    )
    trainer.fit(model, ResumableLoader(rank_loader(make_dataset(), GLOBAL_BATCH, WORLD)), ckpt_path=ckpt_path, **fit_kwargs)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"params": full_params(model), "optim": optimizer_by_name(model, trainer.optimizers[0]), "start_step": observer.start_step}


def _outcome(action: Callable[[], Any]) -> tuple[str, str]:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
        return type(exc).__name__, str(exc)
    return "ok", ""


def _plant(tmp: Path, marker: Path) -> tuple[Path, Path]:
    """Rank 0: copies of the clean checkpoints with the payload planted; the manifest re-recorded."""
    from hp_lightning.checkpoint import layout
    from hp_lightning.checkpoint.convert import consolidate

    consolidate(tmp / "clean_dir.ckpt", tmp / "clean_full.ckpt")
    bad_dir, bad_full = tmp / "bad_dir.ckpt", tmp / "bad_full.ckpt"
    shutil.copytree(tmp / "clean_dir.ckpt", bad_dir)
    meta = torch.load(bad_dir / layout.META_FILE, weights_only=False)  # the test's own file
    meta.setdefault("callbacks", {})["Evil"] = Payload(marker)
    torch.save(meta, bad_dir / layout.META_FILE)
    _rerecord(bad_dir)
    full = torch.load(tmp / "clean_full.ckpt", weights_only=False)
    full.setdefault("callbacks", {})["Evil"] = Payload(marker)
    torch.save(full, bad_full)
    return bad_dir, bad_full


def _hf_copy_lacking_a_key(tmp: Path) -> tuple[tuple[str, str], bool]:
    """Each rank loads Hugging Face weights from its own copy of the directory (one per node, as on a cluster); rank 1's
    copy lacks ``bias``. Rank 0 checked the headers of its complete copy, so only DCP's reader on rank 1 can notice:
    its read is strict, and every rank refuses (a partial read once left ``bias`` as initialized on rank 1)."""
    from safetensors.torch import save_file

    from hp_lightning.checkpoint import load_weights

    rank = dist.get_rank()
    copy = tmp / f"hf_copy_on_rank{rank}"
    copy.mkdir()
    weights = {"weight": torch.full((4, 4), 2.0), "bias": torch.full((4,), 3.0)}
    save_file({k: v for k, v in weights.items() if rank == 0 or k != "bias"}, str(copy / "model.safetensors"))
    dist.barrier()
    model = torch.nn.Linear(4, 4)
    before = model.bias.detach().clone()
    outcome = _outcome(lambda: load_weights(model, copy))
    return outcome, torch.equal(model.bias.detach(), before)


def security_run(tmp_dir: str) -> dict[str, Any]:
    from hp_lightning.checkpoint import load_checkpoint

    tmp = Path(tmp_dir)
    marker = tmp / "PAYLOAD_RAN"
    _fit(save_to=tmp / "clean_dir.ckpt")
    if dist.get_rank() == 0:
        _plant(tmp, marker)
    dist.barrier()
    bad_dir, bad_full = tmp / "bad_dir.ckpt", tmp / "bad_full.ckpt"

    refused: dict[str, tuple[str, str]] = {
        "fit_full": _outcome(lambda: _fit(bad_full)),
        "fit_sharded": _outcome(lambda: _fit(bad_dir)),
    }
    # Directly, on an unsharded copy on every rank: each rank reads meta.pt, and nothing is loaded.
    plain = RegressionModule()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    refused["load_checkpoint_sharded"] = _outcome(lambda: load_checkpoint(bad_dir, plain, []))
    untouched = all(torch.equal(before[k], v) for k, v in plain.state_dict().items())
    # Fabric's load: a training state from the directory, a whole file without state.
    from tests.distributed.test_fabric import FabricNet, make_fabric

    fabric = make_fabric(WORLD, mesh_shape=[WORLD])
    fabric_model = fabric.setup_module(FabricNet())
    fabric_state = {"model": fabric_model, "optimizer": fabric.setup_optimizers(torch.optim.AdamW(fabric_model.parameters(), lr=1e-2))}
    refused["fabric_load_sharded"] = _outcome(lambda: fabric.load(bad_dir, fabric_state))
    refused["fabric_load_full"] = _outcome(lambda: fabric.load(bad_full))
    dist.barrier()
    ran_before_trust = marker.exists()
    dist.barrier()

    clean = _fit(tmp / "clean_dir.ckpt")
    # Trusted. Lightning 2.6 drops fit(..., weights_only=False) for strategies that restore after
    # setup (Trainer._run calls _restore_modules_and_callbacks(ckpt_path) without it), so the fit
    # opt-in is torch's own switch, which hp_lightning honours the way torch.load does.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        trusted_dir = _fit(bad_dir)
        trusted_full = _fit(bad_full)
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
    marker_when_trusted = marker.exists()
    dist.barrier()
    if dist.get_rank() == 0:
        marker.unlink()
    dist.barrier()
    # The function-level opt-in, on every rank.
    trusted_load = _outcome(lambda: load_checkpoint(bad_dir, RegressionModule(), [], weights_only=False))
    trusted_fabric = _outcome(lambda: fabric.load(bad_dir, fabric_state, weights_only=False))
    return {
        "hf_strict": _hf_copy_lacking_a_key(tmp),
        "refused": refused,
        "untouched": untouched,
        "ran_before_trust": ran_before_trust,
        "ran_when_trusted": marker_when_trusted,
        "trusted_load": (trusted_load, trusted_fabric, marker.exists()),
        "clean": clean,
        "trusted_dir": trusted_dir,
        "trusted_full": trusted_full,
        "files": {"bad_dir_meta": str(bad_dir / "meta.pt"), "bad_full": str(bad_full)},
    }


def test_a_planted_payload_is_refused_on_every_rank_and_runs_only_when_trusted(tmp_path: Path) -> None:
    runs = run_distributed(security_run, WORLD, str(tmp_path), timeout=400)
    files = runs[0]["files"]
    named = {
        "fit_full": files["bad_full"],
        "fit_sharded": files["bad_dir_meta"],
        "load_checkpoint_sharded": files["bad_dir_meta"],
        "fabric_load_sharded": files["bad_dir_meta"],
        "fabric_load_full": files["bad_full"],
    }
    for rank, run in enumerate(runs):
        for case, (kind, message) in run["refused"].items():
            assert kind == "UnsafeCheckpointError", (rank, case, kind, message)
            assert named[case] in message and REFUSED_TYPE in message and "weights_only=False" in message, (rank, case, message)
        # The same error on every rank (rank 0 read the full file; the others were told).
        assert run["refused"] == runs[0]["refused"]
        assert run["untouched"] and not run["ran_before_trust"], rank
        assert run["ran_when_trusted"] and run["trusted_load"] == (("ok", ""), ("ok", ""), True), (rank, run["trusted_load"])
        # Hugging Face weights read strictly: a key DCP's reader does not find on one rank is refused on every rank.
        (kind, message), untouched_bias = run["hf_strict"]
        assert kind == "CorruptCheckpointError" and "finds no tensor ['bias']" in message and "on rank 1" in message, (rank, kind, message)
        assert untouched_bias, rank  # refused before any tensor was read, on every rank
        # Trusted, either file resumes exactly as the clean checkpoint does.
        for trusted in ("trusted_dir", "trusted_full"):
            assert run[trusted]["start_step"] == run["clean"]["start_step"] == SAVED_AT, (rank, trusted)
            assert max_rel_diff(run[trusted]["params"], run["clean"]["params"]) == 0.0, (rank, trusted)
            assert max_rel_diff(run[trusted]["optim"], run["clean"]["optim"]) == 0.0, (rank, trusted)
