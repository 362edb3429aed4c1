"""The public surface as tools see it (issue 39, item 1).

* Type checkers read both strategies' constructors: a user script that builds them with several
  options passes mypy (and pyright), a misspelled option and a wrong type are errors with the
  checker's own message.
* The constructors are generated from the option fields (``scripts/gen_signatures.py``) and
  checked in; they are fresh, and they take exactly the fields and Lightning's own arguments.
* ``import hp_lightning`` reads no source code: it works from a compiled-only copy of the package,
  where LightningCLI/jsonargparse still read every option's type, default and help.
"""

from __future__ import annotations

import compileall
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hp_lightning"

USER_SCRIPTS = {
    "builds_both.py": """
        from datetime import timedelta

        from hp_lightning import HSDPFabricStrategy, HSDPStrategy

        trainer_strategy = HSDPStrategy(
            mesh_shape=[2, 2], cpu_offload=True, prefetch=2, reduce_op="sum", timeout=timedelta(minutes=5),
            param_dtype="bf16", ignored_params=["head.*"], fault_tolerance="env", divergence_check=False,
        )
        fabric_strategy = HSDPFabricStrategy(
            mesh_shape=[-1], accumulation_mode="defer_all_reduce", shard_modules=["*.blocks.*"],
            state_dict_type="sharded", train_timeout=60.0, shard_placement={"*.w2.weight": 1},
        )
        mode: str = trainer_strategy.options.accumulation_mode
    """,
    "misspelled.py": """
        from hp_lightning import HSDPStrategy

        strategy = HSDPStrategy(mesh_shape=[2, 2], cpu_ofload=True)
    """,
    "wrong_type.py": """
        from hp_lightning import HSDPFabricStrategy

        strategy = HSDPFabricStrategy(prefetch="2")
    """,
}


def _write_user_scripts(directory: Path) -> list[Path]:
    paths = []
    for name, text in USER_SCRIPTS.items():
        path = directory / name
        path.write_text(textwrap.dedent(text).lstrip())
        paths.append(path)
    return paths


def _errors_by_file(output: str, pattern: str) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {name: [] for name in USER_SCRIPTS}
    for match in re.finditer(pattern, output, re.MULTILINE):
        errors.setdefault(Path(match["file"]).name, []).append(match["message"])
    return errors


def _pyright_runs() -> bool:
    return importlib.util.find_spec("pyright") is not None and shutil.which("node") is not None


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The module's slow subprocesses, started together so they overlap on the cores; each test waits for its own.

    ``mypy`` and ``pyright`` over the user scripts, and ``compiled``: the child of
    :func:`test_import_from_a_compiled_only_copy`.
    """
    tmp = tmp_path_factory.mktemp("public_surface")
    scripts = [str(path) for path in _write_user_scripts(tmp)]
    launched: dict[str, subprocess.Popen[str]] = {}

    def start(name: str, command: list[str], **kwargs: Any) -> None:
        launched[name] = subprocess.Popen(command, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)

    # The project's settings (and its cache, warmed by `make lint`): hp_lightning found as a source tree.
    start(
        "mypy",
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), "--cache-dir", str(ROOT / ".mypy_cache"),
         "--no-error-summary", "--show-error-codes", "--hide-error-context", *scripts],
        env={**os.environ, "MYPYPATH": str(ROOT)},
    )
    if _pyright_runs():
        (tmp / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [str(ROOT)], "pythonVersion": "3.11"}))
        start("pyright", [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, "--outputjson", *scripts])
    copy = tmp / "site" / "hp_lightning"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert compileall.compile_dir(copy, quiet=1, legacy=True)
    for source in copy.rglob("*.py"):
        source.unlink()
    env = {**os.environ, "PYTHONPATH": str(copy.parent), "PYTHONDONTWRITEBYTECODE": "1"}
    start("compiled", [sys.executable, "-c", _COMPILED_CHILD, str(copy)], env=env)
    yield launched
    for process in launched.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def _wait(process: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr


# ------------------------------------------------------------------ type checkers


def test_mypy_reads_both_constructors(checks):
    """One mypy run over three user scripts: the good one passes, a misspelling and a wrong type fail by name."""
    returncode, stdout, stderr = _wait(checks["mypy"])
    output = stdout + stderr
    errors = _errors_by_file(output, r"^(?P<file>[^\s:]+\.py):\d+: error: (?P<message>.*)$")
    assert errors["builds_both.py"] == [], output
    assert errors["misspelled.py"] == [
        'Unexpected keyword argument "cpu_ofload" for "HSDPStrategy"; did you mean "cpu_offload"?  [call-arg]'
    ], output
    assert errors["wrong_type.py"] == ['Argument "prefetch" to "HSDPFabricStrategy" has incompatible type "str"; expected "int"  [arg-type]'], output
    assert returncode == 1, output


def test_pyright_reads_both_constructors(checks):
    """The same three scripts under pyright (the checker behind VS Code's Pylance), in one run."""
    if "pyright" not in checks:
        pytest.skip("pyright (pip install pyright, in the [test] extra) needs a Node.js runtime on PATH; mypy's test covers the same scripts")
    _, stdout, stderr = _wait(checks["pyright"])
    report = json.loads(stdout or "{}") if stdout.strip().startswith("{") else pytest.fail(stdout + stderr)
    errors: dict[str, list[str]] = {name: [] for name in USER_SCRIPTS}
    for diagnostic in report["generalDiagnostics"]:
        if diagnostic["severity"] == "error":
            errors[Path(diagnostic["file"]).name].append(diagnostic["message"])
    assert errors["builds_both.py"] == [], errors
    assert errors["misspelled.py"] == ['No parameter named "cpu_ofload"'], errors
    assert len(errors["wrong_type.py"]) == 1 and errors["wrong_type.py"][0].startswith(
        'Argument of type "Literal[\'2\']" cannot be assigned to parameter "prefetch" of type "int"'
    ), errors


def test_the_package_is_typed():
    """``py.typed`` ships (PEP 561): without it, an installed copy is not type-checked at all."""
    assert (PACKAGE / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["hp_lightning"]


# ------------------------------------------------------------------ generated, fresh, exact


def _generator():
    spec = importlib.util.spec_from_file_location("gen_signatures", ROOT / "scripts" / "gen_signatures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_generated_constructors_and_docs_are_fresh():
    for path, text in _generator().generated().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run .venv/bin/python scripts/gen_signatures.py"


def test_constructors_take_lightnings_arguments_then_exactly_the_fields():
    from lightning.fabric.strategies import ParallelStrategy as FabricParallel
    from lightning.pytorch.strategies import ParallelStrategy as TrainerParallel

    from hp_lightning import HSDPFabricStrategy, HSDPStrategy
    from hp_lightning.core.options import HSDPOptions, field_types

    types = field_types()
    for cls, parent in ((HSDPStrategy, TrainerParallel), (HSDPFabricStrategy, FabricParallel)):
        params = list(inspect.signature(cls).parameters.values())
        hints = typing.get_type_hints(cls.__init__)
        lightning = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        expected = list(inspect.signature(parent.__init__).parameters.values())[1:]
        parent_hints = typing.get_type_hints(parent.__init__)
        assert [(p.name, p.default, hints[p.name]) for p in lightning] == [(p.name, p.default, parent_hints[p.name]) for p in expected]
        options = [p for p in params if p.kind is p.KEYWORD_ONLY]
        assert [(p.name, p.default, p.annotation) for p in options] == [(f.name, f.default, types[f.name]) for f in dataclasses.fields(HSDPOptions)]


# ------------------------------------------------------------------ no source read at import


_COMPILED_CHILD = """
import inspect, sys

# As a release outside the tested range may: a Lightning and a torch without two private names hp_lightning uses.
import lightning.fabric.strategies.strategy as fabric_strategy
import torch.utils._python_dispatch as dispatch

del fabric_strategy._BackwardSyncControl, dispatch.TorchDispatchMode

import hp_lightning
from hp_lightning import HSDPFabricStrategy, HSDPStrategy
from hp_lightning.core._torch_private import MissingPrivateNameError
from hp_lightning.core.diagnostics import CollectiveCounter
from hp_lightning.core.options import field_docs

assert hp_lightning.__file__.startswith(sys.argv[1]) and hp_lightning.__file__.endswith(".pyc"), hp_lightning.__file__
try:
    inspect.getsource(HSDPStrategy)
except OSError:
    pass
else:
    raise AssertionError("the source of HSDPStrategy is readable: the copy is not compiled-only")
trainer = HSDPStrategy(mesh_shape=[2, 2], cpu_offload=True, prefetch=2, state_dict_type="full", timeout=60)
assert tuple(trainer.options.mesh_shape) == (2, 2) and trainer.options.cpu_offload and trainer.options.prefetch == 2
assert trainer.options.state_dict_type == "full" and trainer.options.timeout.total_seconds() == 60
docs = field_docs()

from jsonargparse import ArgumentParser
from jsonargparse._parameter_resolvers import get_signature_parameters

for cls in (HSDPStrategy, HSDPFabricStrategy):
    params = {p.name: p for p in get_signature_parameters(cls)}
    assert all(params[name].doc and " ".join(params[name].doc.split()) == docs[name] for name in docs), cls
parser = ArgumentParser()
parser.add_class_arguments(HSDPFabricStrategy, "strategy")
config = parser.parse_args(["--strategy.prefetch=3", "--strategy.reduce_op=sum"])
assert config.strategy.prefetch == 3 and config.strategy.reduce_op == "sum"
print("ok", len(docs))

# The features that need the deleted names fail at their first use, each with the one clear error.
for feature in (lambda: HSDPFabricStrategy(prefetch=2), lambda: CollectiveCounter().__enter__()):
    try:
        feature()
    except MissingPrivateNameError as exc:
        print(" ".join(str(exc).split()))
    else:
        raise AssertionError("no MissingPrivateNameError")
"""


def test_import_from_a_compiled_only_copy(checks):
    """``.pyc`` files where the sources were (``compileall -b``), sources deleted: import, build, parse options.

    In the same child, torch and Lightning lack one private name each (as a release outside the
    tested range may): ``import hp_lightning`` still works, and the two features that need them
    (Fabric's ``no_backward_sync`` control, collective counting) raise one clear error naming the
    name, the feature and the tested versions, at their first use.
    """
    import lightning

    from hp_lightning import _lightning_private
    from hp_lightning.core import _torch_private

    returncode, stdout, stderr = _wait(checks["compiled"])
    assert returncode == 0, stdout + stderr
    ok, fabric, counter = stdout.strip().splitlines()
    from hp_lightning.core.options import HSDPOptions

    assert ok == f"ok {len(dataclasses.fields(HSDPOptions))}", ok
    assert "lightning.fabric.strategies.strategy._BackwardSyncControl" in fabric and "fabric.no_backward_sync" in fabric, fabric
    assert f"lightning {lightning.__version__} lacks" in fabric and f"lightning{_lightning_private.TESTED_LIGHTNING}" in fabric, fabric
    assert "torch.utils._python_dispatch.TorchDispatchMode" in counter and "collective counting" in counter, counter
    assert f"torch{_torch_private.TESTED_TORCH}" in counter, counter
