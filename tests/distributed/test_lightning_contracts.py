"""Lightning's contracts hold under hp_lightning, checked against Lightning's own ``ModelParallelStrategy``.

One launch of 4 gloo ranks. ``examples/from_model_parallel.py`` (the example of
``docs/migrating.md``), a LightningModule written the way Lightning's docs write one for
``ModelParallelStrategy`` (a feed-forward stack; ``configure_model`` slices
``self.device_mesh["tensor_parallel"]`` / ``["data_parallel"]``, applies torch's
``parallelize_module`` when TP is on and torch's ``fully_shard`` when data parallelism is; a
``training_step(self, batch)`` without ``batch_idx``, under a decorator of the user's; a ``validation_step`` with
``dataloader_idx=0`` over two loaders) trains under ``ModelParallelStrategy`` (the control) and
under ``HSDPStrategy`` with only the strategy line changed, at TP 2 x DP 2 and at DP 4 x TP 1: the
same losses. The same module written with hp_lightning's dim names (``tp``, ``shard``) under
``tensor_parallel_size=2`` is recognized as TP applied by hand. ``self.device_mesh`` is the same
object in every hook. Fabric takes ``parallelize_fn`` as Lightning's Fabric strategy does. An
FSDP1 submodule is refused by the Trainer strategy with the Fabric strategy's message.
"""

from __future__ import annotations

import functools

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from examples.from_model_parallel import FeedForwardStack, LitModel, loader, parallelize, strategy_for
from tests.helpers import run_distributed, trainer_kwargs

WORLD = 4
STEPS = 3


def _passed_through(step):
    """A user's own decorator (``functools.wraps``, ``*args``): Lightning reads the step's signature beneath it."""

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        return step(*args, **kwargs)

    return wrapper


class Recorded(LitModel):
    """The example's module (``examples/from_model_parallel.py``), recording what each hook sees."""

    def __init__(self, names: tuple[str, str] = ("tensor_parallel", "data_parallel")) -> None:
        super().__init__()
        self.names = names
        self.meshes: dict[str, object] = {}
        self.losses: list[float] = []
        self.val_seen: list[int] = []

    def configure_model(self) -> None:
        self.meshes["configure_model"] = self.device_mesh
        if self.names == ("tensor_parallel", "data_parallel"):
            super().configure_model()  # the example as written
        else:  # hp_lightning's own dim names, TP and FSDP by hand
            tp_mesh, dp_mesh = self.device_mesh[self.names[0]], self.device_mesh[self.names[1]]
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
            for layer in self.model.layers:
                parallelize_module(layer, tp_mesh, plan)
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def on_train_start(self) -> None:
        self.meshes["on_train_start"] = self.device_mesh

    @_passed_through
    def training_step(self, batch):
        self.meshes["training_step"] = self.device_mesh
        loss = super().training_step(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.meshes["validation_step"] = self.device_mesh
        self.val_seen.append(dataloader_idx)
        super().validation_step(batch, batch_idx, dataloader_idx)


class WithFSDP1(Recorded):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.model.layers[0] = FullyShardedDataParallel(self.model.layers[0], device_id=torch.device("cpu"), use_orig_params=True)


def _fit(strategy, names: tuple[str, str] = ("tensor_parallel", "data_parallel")) -> dict:
    seed_everything(0)
    model = Recorded(names)
    trainer = Trainer(devices=WORLD, strategy=strategy, max_steps=STEPS, limit_val_batches=1, val_check_interval=STEPS,
                      **trainer_kwargs())
    trainer.fit(model, loader(), [loader(), loader()])
    meshes = model.meshes
    first = meshes["configure_model"]
    return {
        "losses": model.losses,
        "names": tuple(first.mesh_dim_names),
        "shape": tuple(first.shape),
        "same_mesh": {hook: mesh is first for hook, mesh in meshes.items()},
        "val_seen": sorted(set(model.val_seen)),
    }


def _fabric_losses(strategy, *, save: str | None = None, resume: str | None = None) -> list[float]:
    """Losses of a Fabric loop: ``STEPS + 1`` steps, saving ``{"model", "optimizer", "step"}`` after ``STEPS``
    (``save``); or, with ``resume``, the steps after that checkpoint's."""
    from lightning.fabric import Fabric

    seed_everything(0)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=False):
        model = FeedForwardStack()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = fabric.setup_dataloaders(loader(), use_distributed_sampler=True)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(resume, state)
    losses = []
    for step, (x, y) in enumerate(batches):
        if step < state["step"]:
            continue
        if step == STEPS + 1:
            break
        if step == STEPS and save:
            state["step"] = step
            fabric.save(save, state)
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def worker(tmp: str) -> dict:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    import hp_lightning

    def theirs() -> FabricModelParallel:
        return FabricModelParallel(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=2, save_distributed_checkpoint=False)

    def ours() -> hp_lightning.HSDPFabricStrategy:
        return hp_lightning.HSDPFabricStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=2, state_dict_type="full")

    out: dict = {}
    for dp, tp in ((2, 2), (4, 1)):  # the example's one changed line: strategy_for("model_parallel" | "hsdp", ...)
        out[f"lightning_{dp}x{tp}"] = _fit(strategy_for("model_parallel", dp, tp))
        out[f"hp_{dp}x{tp}"] = _fit(strategy_for("hsdp", dp, tp))
    # hp_lightning's own names, TP and FSDP applied by hand under tensor_parallel_size=2.
    out["hp_names"] = _fit(hp_lightning.HSDPStrategy(mesh_shape=[2], tensor_parallel_size=2), names=("tp", "shard"))
    lightning_file, hp_file = f"{tmp}/lightning_fabric.ckpt", f"{tmp}/hp_fabric.ckpt"
    out["fabric_lightning"] = _fabric_losses(theirs(), save=lightning_file)
    out["fabric_hp"] = _fabric_losses(ours(), save=hp_file)
    # Each side resumes the other's single file: Lightning Fabric's layout both ways.
    out["hp_resumes_lightning"] = _fabric_losses(ours(), resume=lightning_file)
    out["lightning_resumes_hp"] = _fabric_losses(theirs(), resume=hp_file)
    try:
        Trainer(devices=WORLD, strategy=hp_lightning.HSDPStrategy(mesh_shape=[WORLD]), max_steps=1, **trainer_kwargs()).fit(
            WithFSDP1(), loader()
        )
        out["fsdp1"] = "trained"
    except TypeError as exc:
        out["fsdp1"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(worker, WORLD, str(tmp_path_factory.mktemp("contracts")), timeout=400)


@pytest.mark.parametrize("shape", ["2x2", "4x1"])
def test_model_parallel_code_trains_unchanged_with_lightnings_numbers(results, shape):
    for rank, res in enumerate(results):
        ours, theirs = res[f"hp_{shape}"], res[f"lightning_{shape}"]
        assert len(ours["losses"]) == STEPS
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6, rel=1e-6), f"rank {rank}"
        # The mesh the user's code sees is Lightning's: the same names, 2-D even at TP 1.
        assert ours["names"] == theirs["names"] == ("data_parallel", "tensor_parallel")
        assert ours["shape"] == theirs["shape"] == tuple(int(s) for s in shape.split("x"))


def test_device_mesh_is_one_object_in_every_hook(results):
    for res in results:
        for run in ("hp_2x2", "hp_4x1", "hp_names"):
            assert res[run]["same_mesh"] == {
                "configure_model": True, "on_train_start": True, "training_step": True, "validation_step": True,
            }, run


def test_step_signatures_are_called_as_lightning_calls_them(results):
    # training_step(self, batch) got no batch_idx (it would raise TypeError); both val loaders' indices arrive.
    for res in results:
        for run in ("hp_2x2", "hp_4x1", "hp_names", "lightning_2x2"):
            assert res[run]["val_seen"] == [0, 1], run


def test_hand_applied_tp_and_fsdp_are_recognized_under_hp_names(results):
    for res in results:
        assert res["hp_names"]["names"] == ("shard", "tp")
        assert res["hp_names"]["losses"] == pytest.approx(res["lightning_2x2"]["losses"], abs=1e-6, rel=1e-6)


def test_fabric_parallelize_fn_is_lightnings(results):
    for res in results:
        assert len(res["fabric_hp"]) == STEPS + 1
        assert res["fabric_hp"] == pytest.approx(res["fabric_lightning"], abs=1e-6, rel=1e-6)


def test_fabric_checkpoints_are_lightning_fabrics_both_ways(results):
    # The step after the checkpoint, resumed by the other side, equals the uninterrupted run's.
    for res in results:
        for run in ("hp_resumes_lightning", "lightning_resumes_hp"):
            assert res[run] == pytest.approx(res["fabric_lightning"][STEPS:], abs=1e-6, rel=1e-6), run


def test_trainer_refuses_fsdp1_like_fabric(results):
    for res in results:
        assert "contains FullyShardedDataParallel (FSDP1) modules; HSDPStrategy shards with FSDP2" in res["fsdp1"], res["fsdp1"]
