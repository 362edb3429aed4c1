"""Every private torch and Lightning name hp_lightning uses exists, and fails honestly where it does not.

When an upgrade removes or renames one, this fails first, naming it and the adapter to update,
instead of a training run failing somewhere deep. The checks resolve each name for real (attribute
by attribute, per-instance attributes on real instances), check in a real two-rank ``fit`` that
Lightning still calls every method hp_lightning replaces, and check that on a version missing a
name ``import hp_lightning`` still works and the feature that needs it says so. CI runs this file
on every release of the tested window (``make test``, and ``make test-compat`` through
``tests/compat_slice.txt``), and the window itself is held to one statement: the releases the
adapters were verified on, which pyproject.toml's ranges, the Makefile's pins and the docs follow.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import lightning
import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from hp_lightning import _lightning_private
from hp_lightning.core import _torch_private
from hp_lightning.core._torch_private import MissingPrivateNameError, PrivateName
from tests.helpers import RegressionModule, loader, make_dataset, run_distributed, trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hp_lightning"
ADAPTERS = {PACKAGE / "_lightning_private.py", PACKAGE / "core" / "_torch_private.py"}


def _installed(version: str) -> str:
    """A release without its local build tag (``2.14.1+cu130`` -> ``2.14.1``)."""
    return version.split("+")[0]


def _verified_here(entries, installed: str) -> tuple[list, list]:
    """The entries verified on the installed release, and those recorded as absent from it."""
    return [e for e in entries if installed in e.verified], [e for e in entries if installed not in e.verified]


def test_private_torch_names_exist():
    here, elsewhere = _verified_here(_torch_private._PRIVATE_NAMES, _installed(torch.__version__))
    missing = _torch_private.missing_private_names(here)
    assert not missing, (
        f"torch {torch.__version__} lacks {missing}; hp_lightning was verified on torch "
        f"{_torch_private.VERIFIED_TORCH}. Update hp_lightning/core/_torch_private.py."
    )
    # A name recorded as absent from this release must be absent (else the record is stale).
    present = set(e.name for e in elsewhere) - set(_torch_private.missing_private_names(elsewhere))
    assert not present, f"torch {torch.__version__} has {sorted(present)}: add it to their `verified`"


def test_private_lightning_names_exist():
    here, elsewhere = _verified_here(_lightning_private._PRIVATE_NAMES, lightning.__version__)
    missing = _lightning_private.missing_private_names(here)
    assert not missing, (
        f"lightning {lightning.__version__} lacks {missing}; hp_lightning was verified on lightning "
        f"{_lightning_private.VERIFIED_LIGHTNING}. Update hp_lightning/_lightning_private.py."
    )
    present = set(e.name for e in elsewhere) - set(_lightning_private.missing_private_names(elsewhere))
    assert not present, f"lightning {lightning.__version__} has {sorted(present)}: add it to their `verified`"


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


def _tested_pins() -> dict[str, dict[str, str]]:
    """``make tested-pins``: each venv of the window and the release it pins of each package."""
    out = subprocess.run(["make", "--no-print-directory", "-s", "-C", str(ROOT), "tested-pins"], capture_output=True, text=True, check=True).stdout
    venvs: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        venv, _, pins = line.partition(": ")
        requirements = [Requirement(pin) for pin in pins.split()]
        assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in requirements), line
        venvs[venv] = {r.name: next(iter(r.specifier)).version for r in requirements}
    return venvs


def test_tested_ranges_are_the_pins():
    """The window is stated once per library (the releases verified), and everything else follows it.

    pyproject.toml pins exactly the range the verified releases span; the Makefile's venvs (the whole
    suite on the first, the compat slice on the others) install exactly the verified releases, each
    once; this run is on one of them; the docs name the ranges and every release.
    """
    windows = {"torch": _torch_private.VERIFIED_TORCH, "lightning": _lightning_private.VERIFIED_LIGHTNING}
    ranges = {"torch": _torch_private.TESTED_TORCH, "lightning": _lightning_private.TESTED_LIGHTNING}
    for library, verified in windows.items():
        assert list(verified) == sorted(verified, key=Version) and len(set(verified)) == len(verified), verified
        assert ranges[library] == _torch_private.tested_range(verified)
        assert all(Version(v) in Requirement(f"{library}{ranges[library]}").specifier for v in verified)
    majors_minors = [Version(v).release[:2] for v in _torch_private.VERIFIED_TORCH]
    assert len(set(majors_minors)) == len(majors_minors), "one torch release per minor"

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for library, tested in ranges.items():
        assert f"{library}{tested}" in dependencies, (library, tested, dependencies)

    venvs = _tested_pins()
    assert list(venvs)[0] == ".venv" and all(re.fullmatch(r"\.venv-torch\d+\.\d+", v) for v in list(venvs)[1:]), venvs
    assert [pins["torch"] for pins in venvs.values()] == list(_torch_private.VERIFIED_TORCH), venvs
    for venv, pins in list(venvs.items())[1:]:
        assert venv == f".venv-torch{'.'.join(pins['torch'].split('.')[:2])}", (venv, pins)
    for venv, pins in venvs.items():  # Lightning's two packages move together
        assert pins["lightning"] == pins["pytorch-lightning"], (venv, pins)
    assert {pins["lightning"] for pins in venvs.values()} == set(_lightning_private.VERIFIED_LIGHTNING), venvs
    assert venvs[".venv"]["lightning"] == _lightning_private.VERIFIED_LIGHTNING[-1], "the whole suite runs on the newest Lightning"

    assert (_installed(torch.__version__), lightning.__version__) in {(p["torch"], p["lightning"]) for p in venvs.values()}, (
        f"this run (torch {torch.__version__}, lightning {lightning.__version__}) is on none of the tested venvs {venvs}"
    )

    devices_doc = (ROOT / "docs" / "devices.md").read_text()
    readme = (ROOT / "README.md").read_text()
    supported = readme[readme.index("## Supported versions"):].split("\n## ")[0]
    for library, tested in ranges.items():
        assert f"{library}{tested}" in devices_doc and f"{library}{tested}" in supported, library
        assert all(v in supported for v in windows[library]), (library, windows[library])


# On a version missing a name, `import hp_lightning` works and the feature that needs it says so at its first
# use: tests/unit/test_public_surface.py::test_import_from_a_compiled_only_copy (one child process for both).


def test_a_missing_name_at_use_is_the_one_clear_error():
    """The name, the feature, the releases it was verified on and the tested range, in one error at the call."""
    verified = r" and ".join(v.replace(".", r"\.") for v in _torch_private.VERIFIED_TORCH[-2:])
    tested = re.escape(f"torch{_torch_private.TESTED_TORCH}")
    with pytest.raises(MissingPrivateNameError, match=(
        rf"sharding introspection and prefetch wiring needs torch's private torch\.distributed\.fsdp\.FSDPModule\._get_fsdp_state"
        rf", which torch .* lacks\. It was verified on torch .*{verified}; hp_lightning is tested with {tested}"
    )):
        _torch_private.fsdp_state(torch.nn.Linear(2, 2))  # not sharded: the attribute is not there
    with pytest.raises(MissingPrivateNameError, match=re.escape(f"lightning{_lightning_private.TESTED_LIGHTNING}")):
        _lightning_private.should_accumulate(object())  # no fit loop: what a Lightning without it would raise


def test_an_attribute_set_later_is_not_yet_only_while_torch_declares_it(monkeypatch):
    """held_gradients reads FSDPParam._unsharded_param only once set; a torch that renamed it is an error, not "no gradients"."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    _torch_private._declared.cache_clear()
    _torch_private._declared(_torch_private._PARAM, "_unsharded_param")  # declared on every verified torch
    annotations = {k: v for k, v in FSDPParam.__annotations__.items() if k != "_unsharded_param"}
    monkeypatch.setattr(FSDPParam, "__annotations__", annotations)
    _torch_private._declared.cache_clear()
    try:
        with pytest.raises(MissingPrivateNameError, match=r"gradient accumulation checks needs .*FSDPParam\._unsharded_param, which"):
            _torch_private._declared(_torch_private._PARAM, "_unsharded_param")
    finally:
        _torch_private._declared.cache_clear()


SLICE = ROOT / "tests" / "compat_slice.txt"


def _slice() -> list[tuple[str, set[str]]]:
    """``tests/compat_slice.txt``: each node id with the adapter functions its ``uses:`` comment names."""
    entries = []
    for line in SLICE.read_text().splitlines():
        node, _, comment = line.partition("#")
        if node.strip():
            uses = comment.partition("uses:")[2].split() if "uses:" in comment else []
            entries.append((node.strip(), set(uses)))
    return entries


def test_compat_slice_uses_every_adapter_function():
    """The compat slice (make test-compat) reaches every adapter function hp_lightning imports, and lists only real tests.

    A new private name comes with a function in an adapter and its use elsewhere: this fails until a
    test in the slice that exercises it says so (`uses:`), so every release of the window runs it.
    """
    adapters = {"hp_lightning.core._torch_private": _torch_private, "hp_lightning._lightning_private": _lightning_private}
    imported: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path not in ADAPTERS:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module in adapters:
                    imported |= {alias.name for alias in node.names}
    imported -= {"MissingPrivateNameError", "PrivateName"}  # the error and the record, not features
    entries = _slice()
    named = set().union(*(uses for _, uses in entries))
    assert not imported - named, f"no test in tests/compat_slice.txt says it uses {sorted(imported - named)}"
    assert all(any(hasattr(m, name) for m in adapters.values()) for name in named), sorted(
        name for name in named if not any(hasattr(m, name) for m in adapters.values())
    )
    for node, _ in entries:
        file, _, test = node.partition("::")
        assert (ROOT / file).is_file(), node
        if test:
            defined = {n.name for n in ast.parse((ROOT / file).read_text()).body if isinstance(n, ast.FunctionDef)}
            assert test.split("[")[0] in defined, node
    assert len({node for node, _ in entries}) == len(entries), "a node id listed twice"


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
_ADAPTER_ONLY = {"_local_tensor": "local_tensor()", "Weights only load failed": "nothing: no code may match torch's error text"}


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
