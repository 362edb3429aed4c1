"""Every private torch and Lightning name hp_lightning uses exists, and fails honestly where it does not.

When an upgrade removes or renames one, this fails first, naming it and the adapter to update,
instead of a training run failing somewhere deep. The checks resolve each name for real (attribute
by attribute, per-instance attributes on real instances), check in a real two-rank ``fit`` that
Lightning still calls every method hp_lightning replaces, and check that on a version missing a
name ``import hp_lightning`` still works and the feature that needs it says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning
import pytest
import tomllib
import torch

from hp_lightning import _lightning_private
from hp_lightning.core import _torch_private
from hp_lightning.core._torch_private import MissingPrivateNameError, PrivateName
from tests.helpers import RegressionModule, loader, make_dataset, run_distributed, trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hp_lightning"
ADAPTERS = {PACKAGE / "_lightning_private.py", PACKAGE / "core" / "_torch_private.py"}


def test_private_torch_names_exist():
    missing = _torch_private.missing_private_names()
    assert not missing, (
        f"torch {torch.__version__} lacks {missing}; hp_lightning was checked against torch "
        f"{_torch_private.CHECKED_TORCH_VERSIONS}. Update hp_lightning/core/_torch_private.py."
    )


def test_private_lightning_names_exist():
    missing = _lightning_private.missing_private_names()
    assert not missing, (
        f"lightning {lightning.__version__} lacks {missing}; hp_lightning was checked against lightning "
        f"{_lightning_private.CHECKED_LIGHTNING_VERSIONS}. Update hp_lightning/_lightning_private.py."
    )


def test_the_checker_notices_a_misspelled_name():
    fsdp = "torch.distributed.fsdp._fully_shard"
    injected = [
        PrivateName(f"{fsdp}._fsdp_param_group", "FSDPParamGroup.zip", "x"),  # `zip` is in __init__'s code names: no longer enough
        PrivateName(f"{fsdp}._fsdp_param", "FSDPParam._unsharded_paramm", "x", per_instance=True),  # looked up on a real instance
        PrivateName(f"{fsdp}._fsdp_param", "FSDPParam._unsharded_param", "x", per_instance=True),  # the real one
        PrivateName("torch.distributed.fsdp", "FSDPModule._no_such_method_here", "x"),
    ]
    assert _torch_private.missing_private_names(injected) == [injected[0].name, injected[1].name, injected[3].name]
    wrong = [PrivateName("lightning.fabric.utilities.distributed", "_no_such_function", "x"),
             PrivateName("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulatee", "x")]
    assert _lightning_private.missing_private_names(wrong) == [entry.name for entry in wrong]


def test_tested_ranges_are_the_pins():
    """The tested ranges are stated once per library, and pyproject.toml pins exactly them."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch{_torch_private.TESTED_TORCH}" in dependencies
    assert f"lightning{_lightning_private.TESTED_LIGHTNING}" in dependencies
    devices_doc = (ROOT / "docs" / "devices.md").read_text()
    assert f"torch{_torch_private.TESTED_TORCH}" in devices_doc and f"lightning{_lightning_private.TESTED_LIGHTNING}" in devices_doc
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert major_minor in _torch_private.CHECKED_TORCH_VERSIONS
    assert ".".join(lightning.__version__.split(".")[:2]) in _lightning_private.CHECKED_LIGHTNING_VERSIONS


# On a version missing a name, `import hp_lightning` works and the feature that needs it says so at its first
# use: tests/unit/test_public_surface.py::test_import_from_a_compiled_only_copy (one child process for both).


def test_a_missing_name_at_use_is_the_one_clear_error():
    with pytest.raises(MissingPrivateNameError, match=r"needs torch's private torch\.distributed\.fsdp\.FSDPModule\._get_fsdp_state.*torch>=2\.13,<2\.14"):
        _torch_private.fsdp_state(torch.nn.Linear(2, 2))  # not sharded: the attribute is not there


def _hooks_worker(deaf: bool) -> list[str]:
    """A plain Lightning DDP fit on two ranks with accumulation: which patched hooks did Lightning not call?"""
    import lightning.pytorch as pl

    def make_trainer() -> pl.Trainer:
        kwargs = trainer_kwargs(accelerator="auto", devices=2, strategy="ddp", max_steps=2, accumulate_grad_batches=2)
        trainer = pl.Trainer(**kwargs)
        if deaf:  # a Lightning whose loop no longer calls the SIGTERM broadcast before each batch
            loop = trainer.fit_loop.epoch_loop
            advance = loop.advance

            def advance_without_broadcast(*args, **kwargs):
                counted = loop.__dict__["_broadcast_sigterm_tensor"]
                loop._broadcast_sigterm_tensor = lambda: None
                try:
                    return advance(*args, **kwargs)
                finally:
                    loop._broadcast_sigterm_tensor = counted

            loop.advance = advance_without_broadcast
        return trainer

    def fit(trainer: pl.Trainer) -> None:
        trainer.fit(RegressionModule(width=8), loader(make_dataset(32), batch_size=4))

    return _lightning_private.hooks_not_called(make_trainer, fit)


def _both_hook_checks() -> tuple[list[str], list[str]]:
    return _hooks_worker(deaf=False), _hooks_worker(deaf=True)


def test_lightning_still_calls_every_patched_hook():
    """A real two-rank fit counts each hook at Lightning's call; a loop that stops calling one is caught."""
    for normal, deaf in run_distributed(_both_hook_checks, 2, timeout=240):
        assert normal == [], f"Lightning {lightning.__version__} no longer calls {normal}: hp_lightning's replacement would do nothing"
        assert deaf == ["_TrainingEpochLoop._broadcast_sigterm_tensor"]


def test_no_private_import_outside_the_adapters():
    # `from torch... import _x` / `from lightning... import _x` only in the two adapter modules.
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path in ADAPTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
                private = [a.name for a in node.names if a.name.startswith("_")] or (
                    [node.module] if any(p.startswith("_") for p in node.module.split(".")) else []
                )
                offenders += [f"{path.relative_to(PACKAGE)}: from {node.module} import {n}" for n in private]
    assert not offenders, offenders


#: Private torch attributes that only the adapter may spell (each has a function there), and torch's
#: error text, which nothing may match (checkpoint/ asks torch.serialization.get_unsafe_globals_in_checkpoint).
_ADAPTER_ONLY = {"_local_tensor": "local_tensor()", "_opname": "op_name()", "Weights only load failed": "nothing: no code may match torch's error text"}


def test_private_torch_attributes_only_in_the_adapter():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path in ADAPTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            spelled = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) else None
            for name in _ADAPTER_ONLY:
                if isinstance(spelled, str) and (spelled == name or (name.startswith("W") and name in spelled)):
                    found.add((str(path.relative_to(PACKAGE)), name))
    assert not found, [f"{path}: {name} (use hp_lightning.core._torch_private.{_ADAPTER_ONLY[name]})" for path, name in sorted(found)]


def test_checkpoint_io_uses_public_torch_only():
    # checkpoint/ reads and writes through torch.distributed.checkpoint's public API: no private
    # name, not even through the adapter.
    offenders = []
    for path in (PACKAGE / "checkpoint").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "_torch_private" in node.module:
                offenders.append(f"{path.relative_to(PACKAGE)}: from {node.module} import ...")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in ("torch", "dcp", "dist"):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
