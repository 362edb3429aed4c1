"""Lightning Fabric under HSDPStrategy on real gloo ranks, against a single-process loop and the Trainer.

One model (TinyNet, under the key ``net`` as in ``RegressionModule``, so Fabric and Trainer
checkpoints share their keys), one data order, global batch 16, AdamW, fp32.

* Parity: FSDP 2, FSDP 4 and HSDP (2, 2) loops with ``accumulation k = 1`` and ``k = 4`` (under
  ``fabric.no_backward_sync``) and ``fabric.clip_gradients`` equal a plain single-process loop,
  parameters and pre-clip norms to <= 1e-5 relative. Both ``fabric.setup(model, optimizer)`` (the
  optimizer is pointed at the sharded parameters) and ``setup_module`` + ``setup_optimizers``.
* Traffic: collectives counted at the ``torch.distributed`` call per micro-batch: none that reduces
  gradients on non-final micro-batches, and the same per-micro-batch counts as the Trainer with
  ``accumulate_grad_batches=4`` for the same plan. ``accumulation_mode="defer_all_reduce"`` keeps
  the reduce-scatters and defers only the replicate all-reduce.
* Checkpoints, both formats: Fabric saves after N steps -> the Trainer resumes and trains N steps
  and saves -> Fabric loads and trains N steps; equal to 3N straight Fabric steps (<= 1e-6).
  Fabric -> Fabric: two optimizers matched by key, a scheduler, plain entries, weights only.
* Meta-device init, the stale-optimizer error, ``all_reduce`` / ``broadcast`` / ``barrier``,
  ``Fabric(precision="bf16-mixed")`` (fp32 shards and gradients, bf16 compute).

Two process launches (2 and 4 ranks) run every scenario; the tests below read their results.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch import nn
from torch.distributed.tensor import DTensor

from tests.helpers import RegressionModule, TinyNet, full_params, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs

GLOBAL_BATCH = 16
N_SAMPLES = 64  # 4 global batches per epoch; later steps start the data over (as a second epoch would)
STEPS = 3
CLIP = 0.05
LR, WEIGHT_DECAY = 1e-2, 0.01  # RegressionModule's AdamW
N = 2
SHARD_GROUPS_4 = {(0, 1), (2, 3)}
REPLICATE_GROUPS_4 = {(0, 2), (1, 3)}
GRADIENT_KINDS = ("reduce_scatter", "all_reduce")


class FabricNet(nn.Module):
    """TinyNet under ``net``: the same parameter names as ``RegressionModule``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class QuietModule(RegressionModule):
    """RegressionModule without logging: its steps issue only the training collectives."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def micro_batch(step: int, index: int, k: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of micro-batch ``index`` of global batch ``step`` (``rank_loader``'s order)."""
    x, y = make_dataset(N_SAMPLES)[:]
    size = GLOBAL_BATCH // k
    start = (step % (N_SAMPLES // GLOBAL_BATCH)) * GLOBAL_BATCH + index * size
    rows = torch.arange(start + rank, start + size, world)
    return x[rows], y[rows]


def reference(steps: int = STEPS, k: int = 1, clip: Optional[float] = CLIP) -> dict[str, Any]:
    """The plain single-process loop: the same steps on the whole global batch."""
    torch.manual_seed(0)
    model = FabricNet()
    optimizer = adamw(model.parameters())
    norms = []
    for step in range(steps):
        for i in range(k):
            x, y = micro_batch(step, i, k, 0, 1)
            (nn.functional.mse_loss(model(x), y) / k).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return {"params": full_params(model), "norms": norms}


def optimizer_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Whole optimizer state as ``{"<param>.<entry>": tensor}`` (rank 0; empty elsewhere); a collective."""
    from hp_lightning.checkpoint import optimizer_state_dict

    state = optimizer_state_dict(model, getattr(optimizer, "_optimizer", optimizer), full=True).get("state", {})
    return {f"{name}.{key}": value.detach().float().clone() for name, entries in state.items() for key, value in entries.items()}


# ---------------------------------------------------------------- what runs on the ranks


def make_fabric(world: int, precision: str = "32-true", **strategy_args: Any):
    from lightning.fabric import Fabric

    from hp_lightning.fabric import HSDPStrategy

    fabric = Fabric(strategy=HSDPStrategy(**strategy_args), devices=world, accelerator="cpu", precision=precision)
    fabric.launch()
    return fabric


def fabric_loop(
    world: int, k: int, *, mesh_shape: list[int], joint_setup: bool, steps: int = STEPS, clip: Optional[float] = CLIP,
    **strategy_args: Any,
) -> dict[str, Any]:
    """One Fabric training run; collectives counted per micro-batch (forward, backward, clip, step)."""
    from hp_lightning.core.diagnostics import CollectiveCounter

    fabric = make_fabric(world, mesh_shape=mesh_shape, **strategy_args)
    torch.manual_seed(0)
    model = FabricNet()
    if joint_setup:
        model, optimizer = fabric.setup(model, adamw(model.parameters()))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(adamw(model.parameters()))
    norms, per_micro_batch = [], []
    with CollectiveCounter() as comms:
        for step in range(steps):
            for i in range(k):
                start = len(comms.calls)
                x, y = micro_batch(step, i, k, fabric.global_rank, world)
                with fabric.no_backward_sync(model, enabled=i < k - 1):
                    fabric.backward(nn.functional.mse_loss(model(x), y) / k)
                if i == k - 1:
                    if clip is not None:
                        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))
                    optimizer.step()
                    optimizer.zero_grad()
                per_micro_batch.append(Counter((c.kind, c.ranks) for c in comms.calls[start:] if c.dtype is None or c.dtype.is_floating_point))
    out = {
        "params": full_params(model.module),
        "norms": norms,
        "per_micro_batch": per_micro_batch,
        "optimizer_holds_dtensors": all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]),
        "optimizer_is_models": {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()},
        "mesh": tuple(fabric.strategy.device_mesh.shape),
    }
    fabric.strategy.teardown()
    return out


def trainer_counts(world: int, k: int, mesh_shape: list[int]) -> list[Counter]:
    """The Trainer's collectives per micro-batch for the same plan, data and clipping."""
    from hp_lightning import HSDPStrategy
    from hp_lightning.core.diagnostics import CollectiveCounter

    per_micro_batch: list[Counter] = []

    class PerBatch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = len(comms.calls)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            per_micro_batch.append(Counter((c.kind, c.ranks) for c in comms.calls[self.start :] if c.dtype is None or c.dtype.is_floating_point))

    seed_everything(0)
    trainer = Trainer(
        devices=world, strategy=HSDPStrategy(mesh_shape=mesh_shape), max_steps=STEPS, accumulate_grad_batches=k,
        gradient_clip_val=CLIP, callbacks=[PerBatch()], **trainer_kwargs(),
    )
    with CollectiveCounter() as comms:
        trainer.fit(QuietModule(), rank_loader(make_dataset(N_SAMPLES), GLOBAL_BATCH // k, world))
    return per_micro_batch


def four_ranks_worker() -> dict[str, Any]:
    return {
        ("fsdp4", 1): fabric_loop(4, 1, mesh_shape=[4], joint_setup=True),
        ("fsdp4", 4): fabric_loop(4, 4, mesh_shape=[4], joint_setup=False),
        ("hsdp2x2", 1): fabric_loop(4, 1, mesh_shape=[2, 2], joint_setup=False),
        ("hsdp2x2", 4): fabric_loop(4, 4, mesh_shape=[2, 2], joint_setup=True),
        "defer": fabric_loop(4, 4, mesh_shape=[2, 2], joint_setup=True, accumulation_mode="defer_all_reduce", train_timeout=120),
        "trainer_hsdp2x2_k4": trainer_counts(4, 4, [2, 2]),
    }


def chain_worker(tmp: str, fmt: str) -> dict[str, Any]:
    """Fabric N steps + save -> Trainer resumes N steps + save -> Fabric loads + N steps (steps 0..3N-1)."""
    import hp_lightning

    root = Path(tmp) / fmt

    def train(fabric, model, optimizer, first: int, last: int) -> None:
        for step in range(first, last):
            x, y = micro_batch(step, 0, 1, fabric.global_rank, 2)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    # 1. Fabric, steps 0 .. N-1, saved in `fmt` (sharded: with async_save; teardown waits for the write).
    fabric = make_fabric(2, mesh_shape=[2], state_dict_type=fmt, async_save=fmt == "sharded")
    torch.manual_seed(0)
    model = FabricNet()
    model, optimizer = fabric.setup(model, adamw(model.parameters()))
    train(fabric, model, optimizer, 0, N)
    fabric.save(root / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": N})
    fabric.strategy.teardown()  # with async_save: waits until the save is published
    saved_kind = "dir" if (root / "fabric.ckpt").is_dir() else "file"

    # 2. The Trainer resumes it (its loops start at 0: Fabric has none) on batches N .. 2N-1, saves in `fmt`.
    seed_everything(0)
    module = RegressionModule()
    trainer = Trainer(
        devices=2, strategy=hp_lightning.HSDPStrategy(mesh_shape=[2], state_dict_type=fmt), max_steps=N, **trainer_kwargs()
    )
    rest = torch.utils.data.Subset(make_dataset(N_SAMPLES), range(N * GLOBAL_BATCH, N_SAMPLES))
    trainer.fit(module, rank_loader(rest, GLOBAL_BATCH, 2), ckpt_path=str(root / "fabric.ckpt"))
    trainer_optimizer_state = optimizer_by_name(module, trainer.optimizers[0])
    trainer.save_checkpoint(root / "trainer.ckpt")

    # 3. Fabric loads the Trainer's checkpoint into a fresh model and trains steps 2N .. 3N-1.
    fabric = make_fabric(2, mesh_shape=[2])
    torch.manual_seed(1)  # a different init: everything must come from the checkpoint
    model = fabric.setup_module(FabricNet())
    optimizer = fabric.setup_optimizers(adamw(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "global_step": -1}
    remainder = fabric.load(root / "trainer.ckpt", state)
    loaded_optimizer_state = optimizer_by_name(model.module, optimizer)
    train(fabric, model, optimizer, 2 * N, 3 * N)
    out = {
        "saved_kind": saved_kind,
        "global_step": state["global_step"],
        "remainder_keys": sorted(remainder),
        "trainer_optimizer_state": trainer_optimizer_state,
        "loaded_optimizer_state": loaded_optimizer_state,
        "params": full_params(model.module),
    }
    fabric.strategy.teardown()
    return out


def round_trip_worker(tmp: str) -> dict[str, Any]:
    """Fabric -> Fabric (full file): two optimizers loaded in the other order, a scheduler, plain entries, errors."""
    path = Path(tmp) / "round_trip.ckpt"

    def build(seed: int):
        torch.manual_seed(seed)
        model = fabric.setup_module(FabricNet())
        blocks = [p for n, p in model.named_parameters() if ".blocks." in n]
        others = [p for n, p in model.named_parameters() if ".blocks." not in n]
        adam, sgd = adamw(blocks), torch.optim.SGD(others, lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
        return model, fabric.setup_optimizers(adam), fabric.setup_optimizers(sgd), scheduler

    fabric = make_fabric(2, mesh_shape=[2], state_dict_type="full")
    model, adam, sgd, scheduler = build(0)
    x, y = micro_batch(0, 0, 1, fabric.global_rank, 2)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    adam.step(), sgd.step(), scheduler.step()
    fabric.save(path, {"model": model, "adam": adam, "sgd": sgd, "scheduler": scheduler, "note": "hello"})

    fresh, adam2, sgd2, scheduler2 = build(1)
    state = {"sgd": sgd2, "model": fresh, "scheduler": scheduler2, "adam": adam2, "note": None}
    remainder = fabric.load(path, state)
    weights_only = fabric.setup_module(FabricNet())
    fabric.load_raw(path, weights_only)
    errors = {}
    for name, call in {
        "reserved": lambda: fabric.save(path, {"model": model, "state_dict": 1}),
        "filter": lambda: fabric.save(path, {"model": model}, filter={"model": lambda k, v: True}),
        "no_model": lambda: fabric.load(path, {"adam": adam2}),
        "renamed": lambda: fabric.load(path, {"model": fresh, "first": adam2, "second": sgd2}),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, KeyError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    out = {
        "params": (full_params(model.module), full_params(fresh.module), full_params(weights_only.module)),
        "adam": (optimizer_by_name(model.module, adam), optimizer_by_name(fresh.module, adam2)),
        "sgd": (optimizer_by_name(model.module, sgd), optimizer_by_name(fresh.module, sgd2)),
        "scheduler": (scheduler.state_dict(), scheduler2.state_dict()),
        "note": state["note"],
        "remainder": remainder,
        "whole_file_keys": sorted(fabric.load(path)),
        "errors": errors,
    }
    fabric.strategy.teardown()
    return out


def two_ranks_worker(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        ("fsdp2", 1): fabric_loop(2, 1, mesh_shape=[2], joint_setup=True),
        ("fsdp2", 4): fabric_loop(2, 4, mesh_shape=[2], joint_setup=False),
        "trainer_fsdp2_k4": trainer_counts(2, 4, [2]),
        "straight": fabric_loop(2, 1, mesh_shape=[2], joint_setup=True, steps=3 * N, clip=None),
    }
    for fmt in ("sharded", "full"):
        out[f"chain_{fmt}"] = chain_worker(tmp, fmt)

    out["round_trip"] = round_trip_worker(tmp)

    # Meta-device init: nothing allocated before setup, nothing left on meta after, and it trains.
    fabric = make_fabric(2, mesh_shape=[2])
    with fabric.init_module(empty_init=True):
        model = FabricNet()
    built_on_meta = all(p.is_meta for p in model.parameters())
    model, optimizer = fabric.setup(model, adamw(model.parameters()))  # the optimizer was built on meta parameters
    x, y = micro_batch(0, 0, 1, fabric.global_rank, 2)
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    params = full_params(model.module)
    out["meta"] = {
        "built_on_meta": built_on_meta,
        "left_on_meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "finite": all(torch.isfinite(p).all() for p in params.values()) and bool(torch.isfinite(loss)),
        "weights_initialized": all(p.abs().sum() > 0 for n, p in params.items() if n.endswith("weight")),
    }

    # load_weights on the wrapper fabric.setup returns (as docs/fabric.md shows): every rank's shards filled.
    torch.manual_seed(3)
    pretrained = FabricNet()
    weights_file = Path(tmp) / "pretrained.pt"
    if fabric.global_rank == 0:
        torch.save(pretrained.state_dict(), weights_file)
    fabric.barrier()
    from hp_lightning.checkpoint import load_weights

    load_weights(model, weights_file)
    out["load_weights_into_wrapper"] = max_rel_diff(full_params(model.module), dict(pretrained.named_parameters()))

    # An optimizer built before setup_module holds parameters sharding replaced: a clear error.
    stale_model = FabricNet()
    stale_params = list(stale_model.parameters())
    fabric.setup_module(stale_model)
    try:
        fabric.setup_optimizers(adamw(stale_params))
        out["stale_error"] = None
    except ValueError as exc:
        out["stale_error"] = str(exc)

    # Collectives.
    rank = fabric.global_rank
    out["all_reduce_sum"] = float(fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum"))
    out["all_reduce_mean"] = float(fabric.all_reduce(torch.tensor(rank + 1.0)))
    out["broadcast"] = fabric.broadcast({"from": rank}, src=1)
    out["all_gather"] = fabric.all_gather(torch.tensor([rank])).flatten().tolist()
    fabric.barrier()
    fabric.strategy.teardown()

    # bf16-mixed: fp32 shards and gradients, bf16 compute inside the units, fp32 out of the model.
    fabric = make_fabric(2, precision="bf16-mixed", mesh_shape=[2])
    torch.manual_seed(0)
    model = fabric.setup_module(FabricNet())
    seen: dict[str, torch.dtype] = {}

    def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen["block"] = output.dtype

    model.module.net.blocks[0].register_forward_hook(record)
    x, y = micro_batch(0, 0, 1, fabric.global_rank, 2)
    prediction = model(x)
    fabric.backward(nn.functional.mse_loss(prediction, y))
    weight = model.module.net.blocks[0].fc1.weight
    out["bf16_mixed"] = {
        "shard": (type(weight).__name__, weight.dtype),
        "grad": weight.grad.dtype,
        "compute": seen["block"],
        "output": prediction.dtype,
    }
    fabric.strategy.teardown()
    return out


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(four_ranks_worker, 4, timeout=300)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(two_ranks_worker, 2, str(tmp_path_factory.mktemp("fabric")), timeout=300)


@pytest.fixture(scope="module")
def refs() -> dict[int, dict[str, Any]]:
    return {k: reference(k=k) for k in (1, 4)}


# ---------------------------------------------------------------- parity and traffic


@pytest.mark.parametrize(
    ("launch", "plan", "mesh"),
    [("two", "fsdp2", (2,)), ("four", "fsdp4", (4,)), ("four", "hsdp2x2", (2, 2))],
    ids=["fsdp2", "fsdp4", "hsdp2x2"],
)
@pytest.mark.parametrize("k", [1, 4])
def test_fabric_loop_matches_single_process(request, refs, launch: str, plan: str, mesh: tuple[int, ...], k: int) -> None:
    results = request.getfixturevalue(launch)
    ref = refs[k]
    assert all(n > CLIP for n in ref["norms"]), "the clip value must actually clip"
    for rank, res in enumerate(results):
        run = res[(plan, k)]
        assert run["mesh"] == mesh
        assert run["optimizer_holds_dtensors"] and run["optimizer_is_models"], "the optimizer must update the sharded parameters"
        diff = max_rel_diff(run["params"], ref["params"])
        print(f"Fabric {plan} k={k}, rank {rank}: max relative parameter difference {diff:.2e}")
        assert diff <= 1e-5, f"{plan} k={k} rank {rank}: parameters differ by {diff:.2e} relative"
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5)


def _gradient_collectives(counts: Counter) -> int:
    return sum(n for (kind, _), n in counts.items() if kind in GRADIENT_KINDS)


@pytest.mark.parametrize(("launch", "plan", "trainer_key"), [("two", "fsdp2", "trainer_fsdp2_k4"), ("four", "hsdp2x2", "trainer_hsdp2x2_k4")])
def test_no_backward_sync_defers_gradient_traffic_as_the_trainer_does(request, launch: str, plan: str, trainer_key: str) -> None:
    results = request.getfixturevalue(launch)
    for rank, res in enumerate(results):
        fabric, trainer = res[(plan, 4)]["per_micro_batch"], res[trainer_key]
        assert len(fabric) == len(trainer) == 4 * STEPS
        for i, counts in enumerate(fabric):
            if i % 4 < 3:
                assert _gradient_collectives(counts) == 0, f"rank {rank}, micro-batch {i}: {dict(counts)}"
            else:
                # Final micro-batch: one reduce-scatter per unit (2 blocks + root) in the shard group.
                assert sum(n for (kind, _), n in counts.items() if kind == "reduce_scatter") == 3
        assert fabric == trainer, f"rank {rank}: Fabric {fabric} != Trainer {trainer}"
    for i, counts in enumerate(results[0][(plan, 4)]["per_micro_batch"][:4]):
        print(f"{plan}, k=4, step 1, micro-batch {i + 1}, rank 0: {dict(counts)}")
    if launch == "four":
        final = results[0][(plan, 4)]["per_micro_batch"][3]
        assert {ranks for (kind, ranks) in final if kind == "reduce_scatter"} <= SHARD_GROUPS_4
        assert sum(n for (kind, ranks), n in final.items() if kind == "all_reduce" and ranks in REPLICATE_GROUPS_4) == 3


def test_defer_all_reduce_keeps_reduce_scatters_and_defers_the_replicate_all_reduce(four, refs) -> None:
    for rank, res in enumerate(four):
        run = res["defer"]
        for i, counts in enumerate(run["per_micro_batch"]):
            scatters = sum(n for (kind, _), n in counts.items() if kind == "reduce_scatter")
            replicate = sum(n for (kind, ranks), n in counts.items() if kind == "all_reduce" and ranks in REPLICATE_GROUPS_4)
            assert scatters == 3, (rank, i, dict(counts))
            assert replicate == (3 if i % 4 == 3 else 0), (rank, i, dict(counts))
        assert max_rel_diff(run["params"], refs[4]["params"]) <= 1e-5


# ---------------------------------------------------------------- checkpoints across front ends


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_fabric_and_trainer_resume_each_others_checkpoints_exactly(two, fmt: str) -> None:
    straight = two[0]["straight"]
    chain = two[0][f"chain_{fmt}"]
    assert chain["saved_kind"] == ("dir" if fmt == "sharded" else "file")
    # The Trainer's optimizer state after its N steps arrived whole in Fabric.
    assert max_rel_diff(chain["loaded_optimizer_state"], chain["trainer_optimizer_state"]) == 0.0
    assert len(chain["loaded_optimizer_state"]) == 3 * len(chain["params"])  # step, exp_avg, exp_avg_sq
    assert chain["global_step"] == N  # a plain entry of `state`, replaced from the Trainer's checkpoint
    assert {"epoch", "loops", "pytorch-lightning_version"} <= set(chain["remainder_keys"])
    for res in two:
        diff = max_rel_diff(res[f"chain_{fmt}"]["params"], straight["params"])
        print(f"{fmt}: Fabric {N} steps -> Trainer {N} steps -> Fabric {N} steps vs {3 * N} straight Fabric steps: {diff:.2e}")
        assert diff <= 1e-6, f"{fmt}: the chain differs from the straight run by {diff:.2e} relative"
    assert max_rel_diff(straight["params"], reference(steps=3 * N, clip=None)["params"]) <= 1e-5


def test_fabric_round_trip_matches_optimizers_by_key_and_restores_every_entry(two) -> None:
    run = two[0]["round_trip"]
    saved, loaded, weights_only = run["params"]
    assert max_rel_diff(loaded, saved) == 0.0 and max_rel_diff(weights_only, saved) == 0.0
    for kind in ("adam", "sgd"):
        before, after = run[kind]
        assert before and max_rel_diff(after, before) == 0.0, kind  # loaded into the right optimizer
    assert run["scheduler"][1] == run["scheduler"][0] and run["scheduler"][1]["last_epoch"] == 1
    assert run["note"] == "hello" and run["remainder"] == {}
    assert {"state_dict", "optimizer_states", "lr_schedulers", "note", "pytorch-lightning_version"} <= set(run["whole_file_keys"])
    errors = run["errors"]
    assert "cannot store 'state_dict'" in errors["reserved"]
    assert "filter=" in errors["filter"]
    assert "found no sharded model" in errors["no_model"]
    assert "stores optimizers under the state keys ['adam', 'sgd']" in errors["renamed"]


# ---------------------------------------------------------------- setup paths and collectives


def test_meta_init_stale_optimizer_collectives_and_bf16_mixed(two) -> None:
    for rank, res in enumerate(two):
        meta = res["meta"]
        assert meta["built_on_meta"] and meta["left_on_meta"] == []
        assert meta["sharded"] and meta["finite"] and meta["weights_initialized"]
        assert res["load_weights_into_wrapper"] == 0.0, res["load_weights_into_wrapper"]
        assert res["stale_error"] is not None and "before sharding" in res["stale_error"] and "setup_module" in res["stale_error"]
        assert res["all_reduce_sum"] == 3.0 and res["all_reduce_mean"] == 1.5
        assert res["broadcast"] == {"from": 1}
        assert res["all_gather"] == [0, 1]
        bf16 = res["bf16_mixed"]
        assert bf16["shard"] == ("DTensor", torch.float32) and bf16["grad"] == torch.float32
        assert bf16["compute"] == torch.bfloat16 and bf16["output"] == torch.float32


# ---------------------------------------------------------------- in this process (no ranks)


def test_fabric_strategy_takes_the_trainer_strategys_options() -> None:
    from hp_lightning import HSDPStrategy as TrainerStrategy
    from hp_lightning.core.options import HSDPOptions
    from hp_lightning.fabric import HSDPStrategy

    def options(cls: type) -> dict[str, Any]:
        return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}

    assert options(HSDPStrategy) == options(TrainerStrategy)
    assert set(options(HSDPStrategy)) == {f.name for f in fields(HSDPOptions)}


def test_registry_names_construction_errors_and_accumulation_mode() -> None:
    import hp_lightning
    from lightning.fabric import Fabric
    from lightning.fabric.plugins import TorchCheckpointIO

    from hp_lightning.fabric import HSDPPrecision, HSDPStrategy

    fsdp = Fabric(strategy="hp_fsdp", devices=2, accelerator="cpu", precision="bf16-mixed")
    assert isinstance(fsdp.strategy, HSDPStrategy) and fsdp.strategy.options.mesh_shape == (-1,)
    assert isinstance(fsdp.strategy.precision, HSDPPrecision) and fsdp.strategy.precision.derived_param_dtype == torch.bfloat16
    assert Fabric(strategy="hsdp_cpu_offload", devices=2, accelerator="cpu").strategy.cpu_offload
    assert hp_lightning.FabricHSDPStrategy is HSDPStrategy
    with pytest.raises(ValueError, match=r"supports precision .*got '16-true'.*Fabric\(precision='bf16-mixed'\)"):
        Fabric(strategy="hsdp", devices=2, accelerator="cpu", precision="16-true")
    with pytest.raises(ValueError, match=r"mesh_shape \[3\] needs shard == world size 2"):
        Fabric(strategy=HSDPStrategy(mesh_shape=[3]), devices=2, accelerator="cpu")
    with pytest.raises(ValueError, match=r"accumulation_mode"):
        HSDPStrategy(accumulation_mode="sometimes")
    with pytest.raises(TypeError, match=r"CheckpointIO plugin would never be called"):
        Fabric(strategy="hsdp", devices=2, accelerator="cpu", plugins=[TorchCheckpointIO()])
    with pytest.raises(ValueError, match=r"save_on_preemption=True\) is a Trainer option"):
        HSDPStrategy(save_on_preemption=True)
    strategy = HSDPStrategy(accumulation_mode="every")
    assert strategy.set_accumulation_mode("DEFER_ALL_REDUCE") == "every" and strategy.accumulation_mode == "defer_all_reduce"
    with pytest.raises(TypeError, match=r"set_accumulation_mode"):
        strategy.set_accumulation_mode(None)  # type: ignore[arg-type]
