"""NPUAccelerator: registration, device parsing, the missing-package error, accelerator="auto".

No NPU and no ``torch_npu`` exist here. What CPU can check runs for real:

* absence: ``torch_npu`` hidden with ``sys.modules["torch_npu"] = None`` (as on any machine without it);
* presence: one subprocess puts a stand-in ``torch_npu`` on ``sys.path``. Like the real package it
  renames PyTorch's PrivateUse1 backend to ``"npu"`` and registers a ``torch.npu`` module with the
  calls hp_lightning uses (``is_available``, ``device_count``, ``set_device``, ``current_device``,
  ``memory_stats``, ``empty_cache``), reporting two NPUs and recording the calls. It checks
  hp_lightning's wiring up to Lightning's Trainer: registry, connector, parsing, device choice,
  backend. It says nothing about torch_npu itself; ``docs/devices.md`` lists what only an Ascend
  machine can verify. No torch.distributed behaviour is replaced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator

from hp_lightning.core import devices
from hp_lightning.accelerators import (
    NPUAccelerator,
    auto_selection_installed,
    choose_auto_accelerator,
    install_auto_selection,
    parse_npu_devices,
    register_accelerators,
    uninstall_auto_selection,
)

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture
def no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)


@pytest.fixture
def auto_selection_restored():
    """Leave Lightning's accelerator="auto" as the test found it."""
    was_installed = auto_selection_installed()
    yield
    if was_installed:
        install_auto_selection()
    else:
        uninstall_auto_selection()


# ------------------------------------------------------------------ registration


def test_npu_is_registered_by_importing_hp_lightning():
    import hp_lightning  # noqa: F401

    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator


def test_registration_is_idempotent_and_names_the_class():
    register_accelerators()
    register_accelerators()
    entry = AcceleratorRegistry["npu"]
    assert entry["accelerator"] is NPUAccelerator and entry["accelerator_name"] == NPUAccelerator.name() == "npu"
    assert "Ascend" in entry["description"]


# ------------------------------------------------------------------ without torch_npu


def test_asking_for_npu_without_torch_npu_says_how_to_install_it(no_torch_npu):
    register_accelerators()
    with pytest.raises(ModuleNotFoundError, match=r"accelerator='npu'.*torch_npu.*not installed.*pip install 'hp-lightning\[npu\]'"):
        Trainer(accelerator="npu", devices=1, **QUIET)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'hp-lightning\[npu\]'"):
        Trainer(accelerator="npu", strategy="hsdp", devices=2, **QUIET)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'hp-lightning\[npu\]'"):
        NPUAccelerator()


def test_without_torch_npu_the_static_queries_report_no_npu(no_torch_npu):
    assert NPUAccelerator.is_available() is False
    assert NPUAccelerator.auto_device_count() == 0
    with pytest.raises(ValueError, match=r"torch_npu reports none.*npu-smi info.*ASCEND_RT_VISIBLE_DEVICES"):
        NPUAccelerator.parse_devices(1)


# ------------------------------------------------------------------ device parsing


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (1, [0]),
        (4, [0, 1, 2, 3]),
        (-1, [0, 1, 2, 3]),
        ([2, 0], [2, 0]),
        ((3,), [3]),
        ("2", [0, 1]),
        (" 4 ", [0, 1, 2, 3]),
        ("-1", [0, 1, 2, 3]),
        ("auto", [0, 1, 2, 3]),
        ("1,", [1]),
        ("0, 3", [0, 3]),
    ],
)
def test_parse_npu_devices_accepts_lightning_forms(flag, expected):
    assert parse_npu_devices(flag, available=4) == expected


BAD_DEVICES = [
    (True, TypeError, r"int, a list of ints or a string; got bool True"),
    (2.0, TypeError, r"got float 2.0.*devices=8"),
    (None, TypeError, r"got NoneType"),
    (["0"], TypeError, r"indices as ints; got str '0'"),
    ([1, False], TypeError, r"indices as ints; got bool False"),
    (0, ValueError, r"count >= 1 or -1.*got 0"),
    (-2, ValueError, r"count >= 1 or -1.*got -2"),
    ([], ValueError, r"selects no NPU.*devices=-1"),
    ([0, 0], ValueError, r"lists an NPU twice: \[0, 0\]"),
    ([-1, 1], ValueError, r"indices must be >= 0; got \[-1, 1\]"),
    (5, ValueError, r"selects NPU indices \[0, 1, 2, 3, 4\].*sees 4 NPU\(s\).*\[4\] do not exist.*ASCEND_RT_VISIBLE_DEVICES"),
    ([1, 7], ValueError, r"\[7\] do not exist"),
    ("0,x", ValueError, r"devices='0,x'\) is not a count or a list of NPU indices.*'0,3'"),
    ("two", ValueError, r"devices='two'\) is not a count"),
]


@pytest.mark.parametrize(("flag", "error", "pattern"), BAD_DEVICES)
def test_parse_npu_devices_rejects_bad_values_with_the_fix(flag, error, pattern):
    with pytest.raises(error, match=pattern):
        parse_npu_devices(flag, available=4)


def test_torchrun_with_one_visible_npu_per_process_keeps_the_indices():
    assert parse_npu_devices([0, 1, 2, 3], available=1, elastic=True) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="do not exist"):
        parse_npu_devices([0, 1, 2, 3], available=1, elastic=False)


# ------------------------------------------------------------------ accelerator="auto"


def test_auto_keeps_lightnings_choice_except_a_cpu_fallback_on_npu_machines(no_torch_npu):
    for choice in ("cuda", "mps", "tpu", "cpu"):
        assert choose_auto_accelerator(choice) == choice  # no NPU here


def test_auto_selection_installs_once_and_changes_nothing_without_npus(no_torch_npu, auto_selection_restored):
    uninstall_auto_selection()
    assert install_auto_selection() is True
    assert install_auto_selection() is False and auto_selection_installed()
    trainer = Trainer(accelerator="auto", devices=1, **QUIET)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert trainer.strategy.root_device.type == expected
    assert uninstall_auto_selection() is True and not auto_selection_installed()
    assert uninstall_auto_selection() is False


# ------------------------------------------------------------------ with a stand-in torch_npu

FAKE_TORCH_NPU = '''
"""Stand-in for torch_npu: the device-module surface hp_lightning calls, two NPUs, calls recorded."""
import os
import types

import torch

torch.utils.rename_privateuse1_backend("npu")
COUNT = int(os.environ.get("FAKE_NPU_COUNT", "2"))
calls = []
_current = [0]
npu = types.ModuleType("torch.npu")
npu.is_available = lambda: COUNT > 0
npu.device_count = lambda: COUNT


def set_device(device):
    calls.append(("set_device", str(device)))
    _current[0] = torch.device(device).index


npu.set_device = set_device
npu.current_device = lambda: _current[0]
npu.memory_stats = lambda device=None: {"allocated_bytes.all.current": 1024, "num_alloc_retries": 0}
npu.empty_cache = lambda: calls.append(("empty_cache", _current[0]))
npu.synchronize = lambda device=None: calls.append(("synchronize", str(device)))
npu.max_memory_allocated = lambda device=None: 4096
torch._register_device_module("npu", npu)
'''

PRESENT_SCENARIO = '''
import json, sys
import torch
import hp_lightning.accelerators as acc
from hp_lightning.core import devices

out = {"imported_by_import": "torch_npu" in sys.modules}
acc.register_accelerators()
out["imported_by_register"] = "torch_npu" in sys.modules

from lightning.pytorch import Trainer
import hp_lightning

quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

def describe(trainer):
    return {
        "accelerator": type(trainer.accelerator).__name__,
        "devices": [str(d) for d in trainer.strategy.parallel_devices],
        "root": str(trainer.strategy.root_device),
        "strategy": type(trainer.strategy).__name__,
    }

trainer = Trainer(accelerator="npu", devices=-1, strategy="hsdp", precision="bf16-mixed", **quiet)
out["all"] = describe(trainer)
out["backend"] = devices.default_backend(trainer.strategy.root_device.type)
out["forms"] = {repr(flag): describe(Trainer(accelerator="npu", devices=flag, strategy="hsdp", **quiet))["devices"]
                for flag in (1, "1,", [1], "2", "auto")}
try:
    Trainer(accelerator="npu", devices=3, strategy="hsdp", **quiet)
except ValueError as exc:
    out["too_many"] = str(exc)

acc.uninstall_auto_selection()
out["auto_lightning"] = describe(Trainer(accelerator="auto", strategy="hsdp", **quiet))
acc.install_auto_selection()
out["auto_installed"] = describe(Trainer(accelerator="auto", strategy="hsdp", **quiet))

npu_module = sys.modules["torch_npu"]
accelerator = acc.NPUAccelerator()
accelerator.setup_device(torch.device("npu", 1))
out["stats"] = [accelerator.get_device_stats(d) for d in (torch.device("npu", 1), "npu:1", 1)]
accelerator.teardown()
try:
    accelerator.setup_device(torch.device("cpu"))
except ValueError as exc:
    out["wrong_device"] = str(exc)
try:
    accelerator.get_device_stats("cpu")
except ValueError as exc:
    out["wrong_stats_device"] = str(exc)
devices.synchronize(torch.device("npu", 1))
out["peak"] = devices.max_memory_allocated(torch.device("npu", 1))
out["barrier_ids"] = devices.barrier_device_ids(torch.device("npu", 1))
out["current_type"] = devices.current_accelerator_type()
from hp_lightning.core.mesh import default_device_type
out["mesh_default"] = default_device_type()
out["calls"] = npu_module.calls
print("RESULT" + json.dumps(out))
'''


def _run_with_fake_torch_npu(tmp_path: Path, code: str) -> dict:
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_TORCH_NPU))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), FAKE_NPU_COUNT="2")
    env.pop("LOCAL_RANK", None)  # a fresh process, not a rank
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def npu_report(tmp_path_factory) -> dict:
    return _run_with_fake_torch_npu(tmp_path_factory.mktemp("fake_npu"), PRESENT_SCENARIO)


def test_registration_does_not_import_torch_npu(npu_report):
    assert npu_report["imported_by_import"] is False
    assert npu_report["imported_by_register"] is False


def test_trainer_accelerator_npu_takes_every_visible_npu_under_hsdp(npu_report):
    assert npu_report["all"] == {
        "accelerator": "NPUAccelerator",
        "devices": ["npu:0", "npu:1"],
        "root": "npu:0",
        "strategy": "HSDPStrategy",
    }
    assert npu_report["backend"] == "hccl"


def test_trainer_devices_forms_select_the_npus_asked_for(npu_report):
    assert npu_report["forms"] == {
        "1": ["npu:0"],
        "'1,'": ["npu:1"],
        "[1]": ["npu:1"],
        "'2'": ["npu:0", "npu:1"],
        "'auto'": ["npu:0", "npu:1"],
    }
    assert "sees 2 NPU(s)" in npu_report["too_many"] and "[2] do not exist" in npu_report["too_many"]


def test_auto_picks_npus_only_with_the_selection_installed(npu_report):
    # Lightning alone resolves "auto" by a fixed TPU/MPS/CUDA/CPU chain that ignores the registry.
    assert npu_report["auto_lightning"]["accelerator"] == "CPUAccelerator"
    assert npu_report["auto_installed"] == {
        "accelerator": "NPUAccelerator",
        "devices": ["npu:0", "npu:1"],
        "root": "npu:0",
        "strategy": "HSDPStrategy",
    }


def test_accelerator_sets_the_device_reports_stats_and_frees_the_cache(npu_report):
    assert npu_report["stats"] == [{"allocated_bytes.all.current": 1024, "num_alloc_retries": 0}] * 3
    calls = [tuple(c) for c in npu_report["calls"]]
    assert ("set_device", "npu:1") in calls
    assert ("empty_cache", 1) in calls  # teardown frees the cache of the device setup_device chose
    assert ("synchronize", "npu:1") in calls
    assert npu_report["peak"] == 4096
    assert npu_report["barrier_ids"] == [1]
    assert "expects an NPU device" in npu_report["wrong_device"] and "accelerator='cpu'" in npu_report["wrong_device"]
    assert "expects an NPU device; got cpu" in npu_report["wrong_stats_device"]


def test_npus_become_the_default_device_type_when_no_cuda_is_present(npu_report):
    expected = "cuda" if torch.cuda.is_available() else "npu"
    assert npu_report["current_type"] == npu_report["mesh_default"] == expected


def test_cpu_accelerator_is_untouched_by_registration():
    register_accelerators()
    trainer = Trainer(accelerator="cpu", devices=1, **QUIET)
    assert isinstance(trainer.accelerator, CPUAccelerator)
    assert devices.default_backend(trainer.strategy.root_device.type) == "gloo"
