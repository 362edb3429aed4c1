"""The device mapping (hp_lightning.core.devices): one device type in, backend / module / memory calls out.

What runs here is real on the CPU: the mapping itself, the host no-ops, the missing-package error
(``torch_npu`` hidden with ``sys.modules["torch_npu"] = None``), and one HSDP fit on a gloo rank
that checks the CPU device type reached the process group, the mesh, the precision and the shards.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hp_lightning.core import devices
from tests.helpers import run_distributed


@pytest.fixture
def no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torch_npu`` fail as it does where the package is not installed."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)


def test_every_device_type_has_a_backend_and_the_backends_are_the_documented_ones():
    assert set(devices.DEVICE_TYPES) == set(devices.DEFAULT_BACKENDS)
    assert [devices.default_backend(t) for t in (devices.CPU, devices.CUDA, devices.NPU)] == ["gloo", "nccl", "hccl"]
    assert set(devices.VISIBLE_DEVICES_ENV) == {t for t in devices.DEVICE_TYPES if devices.is_accelerator(t)}


def test_accelerator_ranks_can_add_gloo_for_host_tensors():
    assert devices.process_group_backend(devices.CPU) == "gloo"
    assert devices.process_group_backend(devices.CPU, host_collectives=True) == "gloo"
    assert devices.process_group_backend(devices.CUDA) == "nccl"
    assert devices.process_group_backend(devices.CUDA, host_collectives=True) == "cpu:gloo,cuda:nccl"
    assert devices.process_group_backend(devices.NPU, host_collectives=True) == "cpu:gloo,npu:hccl"
    # torch itself parses the device-qualified form into one backend per device type.
    config = torch.distributed.distributed_c10d.BackendConfig(
        torch.distributed.Backend(devices.process_group_backend(devices.CUDA, host_collectives=True))
    )
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def test_unknown_device_type_names_the_choices_and_the_fix():
    with pytest.raises(ValueError, match=r"device type 'xpu'.*\['cpu', 'cuda', 'npu'\].*process_group_backend=") as info:
        devices.default_backend("xpu")
    assert info.value.__cause__ is None


def test_only_the_cpu_is_not_an_accelerator():
    assert not devices.is_accelerator(devices.CPU)
    assert devices.is_accelerator(devices.CUDA) and devices.is_accelerator(devices.NPU)
    assert devices.cpu_device() == torch.device("cpu")


def test_device_modules_are_torch_submodules_and_none_for_the_host():
    assert devices.device_module(devices.CPU) is None
    assert devices.device_module(devices.CUDA) is torch.cuda
    assert devices.install_hint(devices.CUDA) == ""
    assert "pip install 'hp-lightning[npu]'" in devices.install_hint(devices.NPU)


def test_host_calls_are_no_ops_that_report_nothing():
    host = devices.cpu_device()
    devices.set_current_device(host)
    devices.synchronize(host)
    devices.empty_cache(host)
    devices.reset_peak_memory(host)
    assert devices.max_memory_allocated(host) is None
    assert devices.memory_stats(host) == {}
    assert devices.barrier_device_ids(host) is None
    assert devices.device_count(devices.CPU) == 1


def test_barrier_runs_on_the_ranks_own_accelerator():
    # Building torch.device objects needs no hardware.
    assert devices.barrier_device_ids(torch.device("cuda", 3)) == [3]
    assert devices.barrier_device_ids(torch.device("cuda")) is None


def test_cuda_queries_agree_with_torch():
    assert devices.cuda_available() == torch.cuda.is_available()
    assert devices.device_count(devices.CUDA) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_missing_torch_npu_is_reported_with_the_install_command(no_torch_npu):
    with pytest.raises(ModuleNotFoundError, match=r"'npu' needs the 'torch_npu' package.*pip install 'hp-lightning\[npu\]'") as info:
        devices.device_module(devices.NPU)
    assert info.value.name == "torch_npu"
    # The queries that must never raise say "no NPU" instead.
    assert not devices.package_installed(devices.NPU)
    assert devices.device_count(devices.NPU) == 0
    assert devices.npu_available() is False
    assert devices.current_accelerator_type() == (devices.CUDA if torch.cuda.is_available() else devices.CPU)


def test_a_broken_torch_npu_install_is_reported_with_its_cause(tmp_path, monkeypatch):
    # A torch_npu that is installed but cannot load its runtime, as when CANN is not sourced.
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libascendcl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert devices.package_installed(devices.NPU)
    with pytest.raises(ImportError, match=r"installed but failed to import \(OSError: libascendcl.so.*set_env.sh") as info:
        devices.device_module(devices.NPU)
    assert isinstance(info.value.__cause__, OSError)
    assert devices.npu_available() is False
    assert "torch_npu" not in sys.modules


# ------------------------------------------------------------------ the CPU device type, end to end


def _fit_and_report(cpu_offload: bool) -> dict:
    import torch.distributed as dist
    from lightning.pytorch import Trainer, seed_everything
    from torch.distributed.tensor import DTensor

    import hp_lightning
    from hp_lightning.core import devices as dev
    from tests.helpers import RegressionModule, loader, make_dataset, trainer_kwargs

    seed_everything(0)
    model = RegressionModule()
    strategy = hp_lightning.HSDPStrategy(cpu_offload=cpu_offload)
    trainer = Trainer(devices=1, strategy=strategy, max_steps=2, precision="bf16-mixed", **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(n=16), 8))
    return {
        "root": str(strategy.root_device),
        "backend": dist.get_backend(),
        "expected_backend": dev.default_backend(strategy.root_device.type),
        "mesh_device_type": strategy.device_mesh.device_type,
        "autocast_device_type": strategy.precision_plugin.device_type,
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "steps": trainer.global_step,
    }


def test_cpu_device_type_reaches_process_group_mesh_precision_and_shards():
    (report,) = run_distributed(_fit_and_report, 1, False, timeout=120)
    assert report["root"] == "cpu"
    assert report["backend"] == report["expected_backend"] == "gloo"
    assert report["mesh_device_type"] == "cpu"
    assert report["autocast_device_type"] == "cpu"
    assert report["param_devices"] == ["cpu"] and report["all_dtensor"]
    assert report["steps"] == 2


def test_cpu_offload_on_a_cpu_mesh_trains():
    # FSDP2's CPUOffloadPolicy pins host memory by default, which needs an accelerator; on a CPU
    # mesh the strategy must ask for unpinned offload (pinning follows devices.is_accelerator).
    (report,) = run_distributed(_fit_and_report, 1, True, timeout=120)
    assert report["backend"] == "gloo" and report["mesh_device_type"] == "cpu"
    assert report["param_devices"] == ["cpu"] and report["all_dtensor"]
    assert report["steps"] == 2
