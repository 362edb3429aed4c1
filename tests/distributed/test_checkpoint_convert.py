"""Moving over from Lightning's own strategies: their sharded checkpoints, consolidated and resumed.

One 2-rank launch trains N steps with Lightning's ``ModelParallelStrategy`` (FSDP2 applied in
``configure_model``) and with Lightning's ``FSDPStrategy`` (FSDP1; Lightning allows it only on
GPUs, so a subclass wraps the model on the CPU, and Lightning's own save code writes the
checkpoint), saving each in Lightning's sharded layout. Then:

* ``python -m hp_lightning.checkpoint consolidate`` turns each into one file whose weights and
  optimizer state match a single-process run at step N;
* ``HSDPStrategy`` resumes each directly and trains N more steps, matching the single-process run
  at step 2N.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from hp_lightning.checkpoint.__main__ import main
from tests.distributed.test_checkpoint_resume import GLOBAL_BATCH, N, fit_run, reference_states
from tests.helpers import RegressionModule, make_dataset, max_rel_diff, rank_loader, run_distributed, trainer_kwargs


class ModelParallelModule(RegressionModule):
    """What ModelParallelStrategy users write: FSDP2 applied by hand in configure_model."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy with the model wrapped for the CPU (everything else, saving included, is Lightning's)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)


def lightning_layouts_worker(tmp: str) -> dict[str, Any]:
    from hp_lightning.checkpoint import ResumableLoader

    root = Path(tmp)
    runs = {
        "model_parallel": (ModelParallelModule, lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)),
        "fsdp": (RegressionModule, lambda: CPUFSDPStrategy(state_dict_type="sharded")),
    }
    out: dict[str, Any] = {}
    for name, (module_class, strategy) in runs.items():
        seed_everything(0)
        model = module_class()
        trainer = Trainer(devices=2, strategy=strategy(), max_steps=N, **trainer_kwargs())
        trainer.fit(model, ResumableLoader(rank_loader(make_dataset(), GLOBAL_BATCH, 2)))
        trainer.save_checkpoint(root / f"{name}.ckpt")
        out[name] = sorted(p.name for p in (root / f"{name}.ckpt").iterdir())
    for name in runs:
        out[f"{name}:resumed"] = fit_run(2, mesh_shape=[2], max_steps=2 * N, ckpt_path=str(root / f"{name}.ckpt"))
    return out


@pytest.fixture(scope="module")
def lightning_layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lightning_layouts")
    results = run_distributed(lightning_layouts_worker, 2, str(tmp), timeout=300)
    return {"tmp": tmp, "ranks": results, "ref": reference_states([N, 2 * N])}


@pytest.mark.parametrize("name", ["model_parallel", "fsdp"])
def test_consolidate_reads_lightning_sharded_checkpoints(lightning_layouts: dict[str, Any], name: str) -> None:
    tmp = lightning_layouts["tmp"]
    assert lightning_layouts["ranks"][0][name] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    out = tmp / f"{name}_full.ckpt"
    assert main(["consolidate", str(tmp / f"{name}.ckpt"), str(out)]) == 0
    checkpoint = torch.load(out, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == N
    ref = lightning_layouts["ref"][N]
    assert max_rel_diff({k: v.float() for k, v in checkpoint["state_dict"].items()}, ref["params"]) <= 1e-5
    optimizer = checkpoint["optimizer_states"][0]["state"]
    flat = {f"{p}.{k}": v.float() for p, entries in optimizer.items() for k, v in entries.items()}
    assert max_rel_diff(flat, ref["optim"]) <= 1e-5
    # The consolidated file is an ordinary Lightning checkpoint.
    model = RegressionModule.load_from_checkpoint(out, map_location="cpu")
    assert torch.equal(model.net.head.weight.detach(), checkpoint["state_dict"]["net.head.weight"])


@pytest.mark.parametrize("name", ["model_parallel", "fsdp"])
def test_hsdp_strategy_resumes_lightning_sharded_checkpoints(lightning_layouts: dict[str, Any], name: str) -> None:
    resumed = lightning_layouts["ranks"][0][f"{name}:resumed"]
    assert resumed["start_step"] == N
    ref = lightning_layouts["ref"][2 * N]
    assert max_rel_diff(resumed["params"], ref["params"]) <= 1e-5
    assert max_rel_diff(resumed["optim"], ref["optim"]) <= 1e-5
