"""Resuming from checkpoints: exact at the same world size, and across world sizes and meshes.

Every run trains the same model on the same data (global batch 16, 4 batches per epoch, AdamW,
fp32). ``N = 3`` steps is mid-epoch, so a resume must continue the epoch, not restart it.

* Same world size (2 ranks): 2N steps straight == N steps, save, resume N steps, for both
  formats, parameters and optimizer state to <= 1e-6 relative, and the same batches in order.
* Across meshes: HSDP 2x2 (4 ranks) -> FSDP 2 -> one plain Lightning process -> FSDP 4, and
  FSDP 2 -> HSDP 2x2, each stage compared with one single-process run at the same step (<= 1e-5).
* ``ModelCheckpoint`` with top-k, ``save_last``, ``every_n_train_steps`` and a monitor.
* ``LightningModule.load_from_checkpoint`` on one process after a 4-rank HSDP run, and the cost
  of the full save (bytes gathered at once per rank).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._python_dispatch import TorchDispatchMode

from hp_lightning.checkpoint.layout import is_complete
from tests.helpers import RegressionModule, full_params, loader, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs

GLOBAL_BATCH = 16
N = 3
FORMATS = ("sharded", "full")


# ---------------------------------------------------------------- shared by the checkpoint tests


class Observer(pl.Callback):
    """Records the step training (re)starts from and each batch's sum (identifies the batch: data order)."""

    def __init__(self) -> None:
        self.start_step: Optional[int] = None
        self.batches: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches.append(float(batch[0].double().sum()))


def optimizer_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Whole optimizer state as ``{"<param>.<entry>": tensor}`` (rank 0; empty elsewhere); collective when sharded."""
    from torch.distributed.tensor import DTensor

    from hp_lightning.checkpoint import optimizer_state_dict

    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        state = optimizer_state_dict(model, optimizer, full=True).get("state", {})
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        state = {names[id(p)]: s for p, s in optimizer.state.items()}
    return {f"{name}.{key}": value.detach().float().cpu().clone() for name, entries in state.items() for key, value in entries.items()}


class GatherRecorder(TorchDispatchMode):
    """Bytes each all-gather returns, recorded at torch's functional collective (what ``full_tensor`` calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered_bytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.gathered_bytes.append(out.numel() * out.element_size())
        return out


def fit_run(
    world: int,
    *,
    mesh_shape: Optional[list[int]] = None,
    state_dict_type: str = "sharded",
    max_steps: int,
    ckpt_path: Optional[str] = None,
    callbacks: tuple[pl.Callback, ...] = (),
    save_to: Optional[str] = None,
    stateful: bool = False,
    async_save: bool = False,
) -> dict[str, Any]:
    """One training run; ``world=0`` is a plain single-process Lightning run (no hp_lightning strategy)."""
    import hp_lightning
    from hp_lightning.checkpoint import ResumableLoader

    seed_everything(0)
    model = RegressionModule()
    observer = Observer()
    kwargs = trainer_kwargs(enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    if world == 0:
        trainer = Trainer(devices=1, max_steps=max_steps, callbacks=[observer, *callbacks], **kwargs)
        data = ResumableLoader(loader(make_dataset(), GLOBAL_BATCH))
    else:
        strategy = hp_lightning.HSDPStrategy(mesh_shape=mesh_shape, state_dict_type=state_dict_type, async_save=async_save)
        trainer = Trainer(devices=world, strategy=strategy, max_steps=max_steps, callbacks=[observer, *callbacks], **kwargs)
        data = ResumableLoader(rank_loader(make_dataset(), GLOBAL_BATCH, world))
        if stateful:  # torchdata's loader: Lightning checkpoints its state, the strategy does not wrap it
            from torchdata.stateful_dataloader import StatefulDataLoader

            from tests.helpers import OrderedRankSampler

            dataset = make_dataset()
            data = StatefulDataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=OrderedRankSampler(dataset, world))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    gathered = None
    if save_to:
        with GatherRecorder() as recorder:
            trainer.save_checkpoint(save_to)
        sizes = recorder.gathered_bytes
        gathered = {"tensors": len(sizes), "largest_bytes": max(sizes, default=0), "total_bytes": sum(sizes)}
    return {
        "params": full_params(model),
        "optim": optimizer_by_name(model, trainer.optimizers[0]),
        "start_step": observer.start_step,
        "batches": observer.batches,
        "global_step": trainer.global_step,
        "gathered": gathered,
        "loader": type(trainer.train_dataloader).__name__,
    }


def state_diff(run: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """Max relative difference of (parameters, optimizer state) between two runs."""
    return max_rel_diff(run["params"], ref["params"]), max_rel_diff(run["optim"], ref["optim"])


def reference_states(steps: list[int]) -> dict[int, dict[str, Any]]:
    """One single-process run; parameters, optimizer state and batch sums at each step in ``steps``."""

    class Snapshot(pl.Callback):
        def __init__(self) -> None:
            self.at: dict[int, dict[str, Any]] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in steps:
                self.at[trainer.global_step] = {
                    "params": full_params(pl_module),
                    "optim": optimizer_by_name(pl_module, trainer.optimizers[0]),
                }

    seed_everything(0)
    model = RegressionModule()
    snapshot, observer = Snapshot(), Observer()
    trainer = Trainer(devices=1, max_steps=max(steps), callbacks=[snapshot, observer], **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(), GLOBAL_BATCH))
    for step, state in snapshot.at.items():
        state["batches"] = observer.batches[:step]
    return snapshot.at


def global_batches(results: list[dict[str, Any]]) -> list[float]:
    """Each step's global batch sum: the ranks' per-batch sums added up."""
    return [sum(r["batches"][i] for r in results) for i in range(len(results[0]["batches"]))]


# ---------------------------------------------------------------- same world size


def same_world_worker(tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    out: dict[str, Any] = {"straight": fit_run(2, mesh_shape=[2], max_steps=2 * N)}
    for fmt in FORMATS:
        every_n = ModelCheckpoint(dirpath=root / fmt, every_n_train_steps=N, save_top_k=-1, filename="{step}")
        first = fit_run(2, mesh_shape=[2], state_dict_type=fmt, max_steps=N, callbacks=(every_n,))
        resumed = fit_run(2, mesh_shape=[2], state_dict_type=fmt, max_steps=2 * N, ckpt_path=str(root / fmt / f"step={N}.ckpt"))
        out[fmt] = {"first": first, "resumed": resumed}
    every_n = ModelCheckpoint(dirpath=root / "stateful", every_n_train_steps=N, save_top_k=-1, filename="{step}")
    first = fit_run(2, mesh_shape=[2], max_steps=N, callbacks=(every_n,), stateful=True)
    resumed = fit_run(2, mesh_shape=[2], max_steps=2 * N, ckpt_path=str(root / "stateful" / f"step={N}.ckpt"), stateful=True)
    out["stateful"] = {"first": first, "resumed": resumed}
    # async_save: top-2 by loss every step plus an every-N save (two saves due at step N: the
    # second waits for the first), then an async run resumes from the step-N save.
    in_flight: list[bool] = []

    class InFlight(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            in_flight.append(trainer.strategy.checkpoint_in_flight)

    top_2 = ModelCheckpoint(
        dirpath=root / "async_top2", monitor="train_loss", save_top_k=2, every_n_train_steps=1, filename="{step}", save_last="link"
    )
    every_n = ModelCheckpoint(dirpath=root / "async", every_n_train_steps=N, save_top_k=-1, filename="{step}")
    first = fit_run(2, mesh_shape=[2], max_steps=N, callbacks=(InFlight(), top_2, every_n), async_save=True)
    after_fit: dict[str, Any] = {"listing": sorted(os.listdir(root / "async_top2"))}
    after_fit["kept"] = sorted(Path(p).name for p in top_2.best_k_models)
    after_fit["complete"] = [is_complete((root / "async_top2" / name).resolve()) for name in after_fit["listing"]]
    after_fit["last"] = os.readlink(root / "async_top2" / "last.ckpt")
    resumed = fit_run(2, mesh_shape=[2], max_steps=2 * N, ckpt_path=str(root / "async" / f"step={N}.ckpt"), async_save=True)
    out["async"] = {"first": first, "resumed": resumed, "in_flight": in_flight, **after_fit}
    # save_last="link" (Lightning's symlink to the newest top-k save) with sharded directories, then resume from it.
    linked = lambda: ModelCheckpoint(  # noqa: E731
        dirpath=root / "link", save_last="link", save_top_k=2, monitor="train_loss", every_n_train_steps=1, filename="{step}"
    )
    fit_run(2, mesh_shape=[2], max_steps=N, callbacks=(linked(),))
    listing = sorted((p.name, os.readlink(p) if p.is_symlink() else None) for p in (root / "link").iterdir())
    again = fit_run(2, mesh_shape=[2], max_steps=2 * N, ckpt_path="last", callbacks=(linked(),))
    out["link"] = {"listing": listing, "start_step": again["start_step"], "global_step": again["global_step"]}
    top_k = ModelCheckpoint(
        dirpath=root / "top_k", monitor="train_loss", mode="min", save_top_k=2, every_n_train_steps=1, save_last=True, filename="{step}"
    )
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train_loss"]))

    fit_run(2, mesh_shape=[2], max_steps=2 * N, callbacks=(Losses(), top_k))
    out["mid_window_warnings"] = mid_window_save_warnings(root / "mid_window.ckpt")
    out["top_k"] = {
        "losses": losses,
        "best": Path(top_k.best_model_path).name,
        "kept": sorted(Path(p).name for p in top_k.best_k_models),
        "last": Path(top_k.last_model_path).name,
        "listing": sorted(os.listdir(root / "top_k")),
    }
    return out


def mid_window_save_warnings(path: Path) -> list[str]:
    """Warnings of a save after the first of two micro-batches (its window's gradients are not saved)."""
    import warnings

    import hp_lightning

    class SaveMidWindow(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                trainer.save_checkpoint(path)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seed_everything(0)
        trainer = Trainer(
            devices=2, strategy=hp_lightning.HSDPStrategy(mesh_shape=[2]), max_steps=1, accumulate_grad_batches=2,
            callbacks=[SaveMidWindow()], **trainer_kwargs(),
        )
        trainer.fit(RegressionModule(), rank_loader(make_dataset(), GLOBAL_BATCH, 2))
    return [str(w.message) for w in caught if "inside a gradient-accumulation window" in str(w.message)]


@pytest.fixture(scope="module")
def same_world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(same_world_worker, 2, str(tmp_path_factory.mktemp("same_world")), timeout=300)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_at_same_world_size_is_exact(same_world: list[dict[str, Any]], fmt: str) -> None:
    straight = same_world[0]["straight"]
    run = same_world[0][fmt]
    assert run["first"]["global_step"] == N
    assert run["resumed"]["start_step"] == N, "training restarted instead of resuming"
    assert run["resumed"]["global_step"] == 2 * N
    params, optim = state_diff(run["resumed"], straight)
    print(f"{fmt}, 2 ranks, N + save + N vs 2N straight: parameters {params:.2e}, optimizer state {optim:.2e}")
    assert params <= 1e-6, f"{fmt}: parameters differ by {params:.2e} relative after N + save + N steps"
    assert optim <= 1e-6, f"{fmt}: optimizer state differs by {optim:.2e} relative"
    assert len(straight["optim"]) == 3 * len(straight["params"])  # step, exp_avg, exp_avg_sq per parameter


def test_save_last_link_points_at_the_newest_sharded_save_and_resumes(same_world: list[dict[str, Any]]) -> None:
    link = same_world[0]["link"]
    names = [name for name, _ in link["listing"]]
    assert len(names) == 3 and ("last.ckpt", f"step={N}.ckpt") in link["listing"], link["listing"]  # top 2 + the link
    assert link["start_step"] == N and link["global_step"] == 2 * N


def test_stateful_dataloader_resumes_mid_epoch_exactly_without_a_wrapper(same_world: list[dict[str, Any]]) -> None:
    for rank in same_world:
        run, straight = rank["stateful"], rank["straight"]
        assert run["first"]["loader"] == run["resumed"]["loader"] == "StatefulDataLoader"  # not wrapped
        assert run["resumed"]["start_step"] == N
        assert run["first"]["batches"] + run["resumed"]["batches"] == straight["batches"]  # the epoch continued
        params, optim = state_diff(run["resumed"], straight)
        assert params <= 1e-6 and optim <= 1e-6, (params, optim)


def test_async_save_resumes_exactly_and_keeps_exactly_top_k(same_world: list[dict[str, Any]]) -> None:
    run, straight = same_world[0]["async"], same_world[0]["straight"]
    # Saves at steps 1..N-1 were still in flight when the next batch started: training went on.
    assert run["in_flight"][1:N] == [True] * (N - 1), run["in_flight"]
    assert run["resumed"]["start_step"] == N and run["resumed"]["global_step"] == 2 * N
    params, optim = state_diff(run["resumed"], straight)
    print(f"async_save, 2 ranks, N + save + N vs 2N straight: parameters {params:.2e}, optimizer state {optim:.2e}")
    assert params <= 1e-6 and optim <= 1e-6, (params, optim)
    # N saves, N - 2 removals held back until the next publish: exactly the two best, both complete,
    # and Lightning's `last` link to the newest save (made before its publish) resolves to it.
    assert run["listing"] == sorted(run["kept"] + ["last.ckpt"]) and len(run["kept"]) == 2, run
    assert all(run["complete"]), run
    assert run["last"] in run["kept"], run


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_continues_the_data_order(same_world: list[dict[str, Any]], fmt: str) -> None:
    for rank in same_world:
        straight = rank["straight"]["batches"]
        assert rank[fmt]["first"]["batches"] + rank[fmt]["resumed"]["batches"] == straight
        # The epoch is 4 batches: a restart would have repeated batch 0 at step N + 1.
        assert rank[fmt]["resumed"]["batches"][0] == straight[N] != straight[0]


def test_model_checkpoint_top_k_last_and_removal(same_world: list[dict[str, Any]]) -> None:
    top_k = same_world[0]["top_k"]
    losses = top_k["losses"]
    assert len(losses) == 2 * N
    best_two = sorted(range(len(losses)), key=losses.__getitem__)[:2]
    expected = sorted(f"step={i + 1}.ckpt" for i in best_two)
    assert top_k["kept"] == expected
    assert top_k["best"] == f"step={best_two[0] + 1}.ckpt"
    assert top_k["last"] == "last.ckpt"
    # Six saves, four removed: each removal took its whole directory, and no staging entry is left.
    assert top_k["listing"] == sorted(expected + ["last.ckpt"])


# ---------------------------------------------------------------- across world sizes and meshes


def stage_hsdp4(tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    every_n = ModelCheckpoint(dirpath=root / "hsdp4", every_n_train_steps=N, save_top_k=-1, filename="{step}")
    trained = fit_run(4, mesh_shape=[2, 2], max_steps=N, callbacks=(every_n,))
    # A full-format strategy resuming at its final step trains nothing and writes the full file.
    full = fit_run(4, mesh_shape=[2, 2], state_dict_type="full", max_steps=N, ckpt_path=str(root / "hsdp4" / f"step={N}.ckpt"), save_to=str(root / "hsdp4_full.ckpt"))
    return {"trained": trained, "full": full}


def stage_fsdp2(tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    every_n = ModelCheckpoint(dirpath=root / "fsdp2", every_n_train_steps=N, save_top_k=-1, filename="{step}")
    trained = fit_run(2, mesh_shape=[2], max_steps=2 * N, ckpt_path=str(root / "hsdp4" / f"step={N}.ckpt"), callbacks=(every_n,))
    full = fit_run(2, mesh_shape=[2], state_dict_type="full", max_steps=2 * N, ckpt_path=str(root / "fsdp2" / f"step={2 * N}.ckpt"), save_to=str(root / "fsdp2_full.ckpt"))
    return {"trained": trained, "full": full}


def stage_four_ranks_again(tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    hsdp = fit_run(4, mesh_shape=[2, 2], max_steps=3 * N, ckpt_path=str(root / "fsdp2" / f"step={2 * N}.ckpt"))
    fsdp = fit_run(4, mesh_shape=[4], max_steps=4 * N, ckpt_path=str(root / "plain" / f"step={3 * N}.ckpt"))
    return {"hsdp_from_fsdp2_sharded": hsdp, "fsdp4_from_plain": fsdp}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("chain")
    out: dict[str, Any] = {"tmp": tmp, "ref": reference_states([N, 2 * N, 3 * N, 4 * N])}
    out["hsdp4"] = run_distributed(stage_hsdp4, 4, str(tmp), timeout=300)
    out["fsdp2"] = run_distributed(stage_fsdp2, 2, str(tmp), timeout=300)
    every_n = ModelCheckpoint(dirpath=tmp / "plain", every_n_train_steps=N, save_top_k=-1, filename="{step}")
    out["plain"] = fit_run(0, max_steps=3 * N, ckpt_path=str(tmp / "fsdp2_full.ckpt"), callbacks=(every_n,))
    out["again"] = run_distributed(stage_four_ranks_again, 4, str(tmp), timeout=300)
    return out


def _assert_matches(run: dict[str, Any], ref: dict[str, Any], label: str, tol: float = 1e-5) -> None:
    params, optim = state_diff(run, ref)
    print(f"{label}: max relative difference parameters {params:.2e}, optimizer state {optim:.2e}")
    assert params <= tol, f"{label}: parameters differ from the single-process run by {params:.2e} relative"
    assert optim <= tol, f"{label}: optimizer state differs from the single-process run by {optim:.2e} relative"


def test_hsdp_4_ranks_to_fsdp_2_ranks_sharded(chain: dict[str, Any]) -> None:
    ref = chain["ref"]
    _assert_matches(chain["hsdp4"][0]["trained"], ref[N], "HSDP 2x2, N steps")
    trained = chain["fsdp2"][0]["trained"]
    assert trained["start_step"] == N
    _assert_matches(trained, ref[2 * N], "HSDP 2x2 sharded -> FSDP 2")
    assert global_batches([r["trained"] for r in chain["fsdp2"]]) == pytest.approx(ref[2 * N]["batches"][N:], rel=1e-6)


def test_full_file_into_single_process_lightning(chain: dict[str, Any]) -> None:
    plain = chain["plain"]
    assert plain["start_step"] == 2 * N
    _assert_matches(plain, chain["ref"][3 * N], "FSDP 2 full file -> plain single-process Lightning")
    assert plain["batches"] == pytest.approx(chain["ref"][3 * N]["batches"][2 * N :], rel=1e-6)


def test_plain_lightning_checkpoint_into_fsdp_4_ranks(chain: dict[str, Any]) -> None:
    run = chain["again"][0]["fsdp4_from_plain"]
    assert run["start_step"] == 3 * N
    _assert_matches(run, chain["ref"][4 * N], "plain Lightning .ckpt -> FSDP 4")
    assert global_batches([r["fsdp4_from_plain"] for r in chain["again"]]) == pytest.approx(chain["ref"][4 * N]["batches"][3 * N :], rel=1e-6)


def test_fsdp_2_ranks_sharded_into_hsdp_4_ranks(chain: dict[str, Any]) -> None:
    run = chain["again"][0]["hsdp_from_fsdp2_sharded"]
    assert run["start_step"] == 2 * N
    _assert_matches(run, chain["ref"][3 * N], "FSDP 2 sharded -> HSDP 2x2")


def test_strategy_converts_sharded_to_full_exactly(chain: dict[str, Any]) -> None:
    for stage in ("hsdp4", "fsdp2"):
        full = chain[stage][0]["full"]
        trained = chain[stage][0]["trained"]
        assert full["global_step"] == trained["global_step"]
        assert state_diff(full, trained) == (0.0, 0.0), f"{stage}: the full-format resume changed the state"


def test_load_from_checkpoint_on_one_process_after_hsdp_4_ranks(chain: dict[str, Any]) -> None:
    path = chain["tmp"] / "hsdp4_full.ckpt"
    raw = torch.load(path, map_location="cpu", weights_only=False)
    assert raw["global_step"] == N and raw["hp_lightning"]["world_size"] == 4
    model = RegressionModule.load_from_checkpoint(path, map_location="cpu")
    assert model.hparams.width == 16
    loaded = full_params(model)
    assert max_rel_diff(loaded, chain["hsdp4"][0]["trained"]["params"]) == 0.0
    assert max_rel_diff(loaded, chain["ref"][N]["params"]) <= 1e-5


def test_full_save_gathers_one_tensor_at_a_time(chain: dict[str, Any]) -> None:
    """No rank ever holds more than one whole tensor of gathered state on its device."""
    params = chain["hsdp4"][0]["trained"]["params"]
    optim = chain["hsdp4"][0]["trained"]["optim"]
    largest_tensor = max(t.numel() * 4 for t in params.values())
    sharded_tensors = len(params) + sum(1 for k in optim if not k.endswith(".step"))  # "step" is not sharded
    whole_state = sum(t.numel() * 4 for t in params.values()) + sum(t.numel() * 4 for k, t in optim.items() if not k.endswith(".step"))
    for rank, result in enumerate(chain["hsdp4"]):
        gathered = result["full"]["gathered"]
        print(f"full save, rank {rank}: {gathered['tensors']} gathers, peak {gathered['largest_bytes']} B at once, "
              f"{gathered['total_bytes']} B in all (whole model + optimizer state: {whole_state} B)")
        assert gathered["tensors"] == sharded_tensors
        assert gathered["total_bytes"] == whole_state
        assert gathered["largest_bytes"] == largest_tensor < whole_state / 10


def _all_tensors(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"state_dict/{k}": v for k, v in checkpoint["state_dict"].items()}
    for i, optimizer in enumerate(checkpoint["optimizer_states"]):
        out.update({f"optimizer_{i}/{p}/{k}": v for p, entries in optimizer["state"].items() for k, v in entries.items()})
    return out


def test_cli_round_trip_of_a_4_rank_hsdp_checkpoint(chain: dict[str, Any]) -> None:
    """sharded (HSDP 2x2) -> full -> sharded -> full: identical tensors, equal to the strategy's own full save."""
    from hp_lightning.checkpoint.__main__ import main

    tmp = chain["tmp"]
    sharded = tmp / "hsdp4" / f"step={N}.ckpt"
    assert main(["consolidate", str(sharded), str(tmp / "cli_full.ckpt")]) == 0
    assert main(["shard", str(tmp / "cli_full.ckpt"), str(tmp / "cli_sharded")]) == 0
    assert main(["consolidate", str(tmp / "cli_sharded"), str(tmp / "cli_full_again.ckpt")]) == 0
    first = torch.load(tmp / "cli_full.ckpt", weights_only=False)
    again = torch.load(tmp / "cli_full_again.ckpt", weights_only=False)
    strategy_full = torch.load(tmp / "hsdp4_full.ckpt", weights_only=False)
    a, b, c = _all_tensors(first), _all_tensors(again), _all_tensors(strategy_full)
    assert a.keys() == b.keys() == c.keys() and len(a) == 16 * 4
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert first["global_step"] == again["global_step"] == strategy_full["global_step"] == N


def test_a_save_inside_an_accumulation_window_is_warned_about(same_world: list[dict[str, Any]]) -> None:
    said = same_world[0]["mid_window_warnings"]
    assert len(said) == 1 and "accumulate_grad_batches=2" in said[0], said
    assert same_world[1]["mid_window_warnings"] == []  # rank 0 speaks for the job
