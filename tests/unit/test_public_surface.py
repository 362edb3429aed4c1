"""The public surface as tools see it (issue 39, item 1; issue 50, items 1 and 2).

* Type checkers read both strategies' constructors (``**options: Unpack[OptionInputs]``): a user
  script that builds them with every input form the docs show passes mypy and pyright, and reads
  the resolved options with their own types (``options.param_dtype`` is a ``torch.dtype``); a
  misspelled option, a wrong type and each wrong form are errors with the checker's own message.
* Everything derived from the option fields (``make generate``) is fresh, and the constructors
  take exactly Lightning's arguments and the fields, typed with what a user may pass.
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
        from typing import Literal, Optional

        import torch
        from torch import nn
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from hp_lightning import HSDPFabricStrategy, HSDPStrategy
        from hp_lightning.core.options import HSDPOptions
        from hp_lightning.ft import FaultTolerance

        trainer_strategy = HSDPStrategy(
            mesh_shape=[2, 2], cpu_offload=True, prefetch=2, reduce_op="sum", timeout=timedelta(minutes=5),
            param_dtype="bf16", ignored_params=["head.*"], fault_tolerance="env", divergence_check=False,
        )
        fabric_strategy = HSDPFabricStrategy(
            mesh_shape=[-1], accumulation_mode="defer_all_reduce", shard_modules=["*.blocks.*"],
            state_dict_type="sharded", train_timeout=60.0, shard_placement={"*.w2.weight": 1},
        )
        # Every input form docs/configuration.md shows: dtypes as names or torch dtypes, seconds or timedeltas,
        # booleans or names, style names or torch ParallelStyles, dicts, "env" or a FaultTolerance, classes or names.
        HSDPStrategy(param_dtype=torch.bfloat16, reduce_dtype="fp32")
        HSDPFabricStrategy(param_dtype=None, reduce_dtype=torch.float32)
        HSDPStrategy(timeout=1800, train_timeout=timedelta(minutes=10))
        HSDPStrategy(timeout=1800.0, train_timeout=None)
        HSDPStrategy(divergence_check="off")
        HSDPStrategy(divergence_check=True)
        HSDPStrategy(tensor_parallel_size=2, tp_plan={"blocks.*.fc": "colwise", "blocks.*.proj": RowwiseParallel(), "head": ColwiseParallel()})
        HSDPStrategy(fault_tolerance={"replica_group": 0, "num_replica_groups": 2})
        HSDPStrategy(fault_tolerance=FaultTolerance(replica_group=0, num_replica_groups=2))
        HSDPStrategy(compile=True)
        HSDPStrategy(compile={"backend": "inductor", "fullgraph": True})
        HSDPStrategy(shard_modules=[nn.TransformerEncoderLayer, "Block", "model.blocks.*"], activation_checkpointing=["model.blocks.*"])
        HSDPStrategy(mesh_shape=(4, -1), data_parallel_size=None)
        HSDPStrategy(data_parallel_size="auto", tensor_parallel_size=2)
        HSDPStrategy(pipeline_parallel_size=2, pipeline_split_points="auto", pipeline_schedule="gpipe", pipeline_microbatches=4)
        HSDPStrategy(pipeline_parallel_size=2, pipeline_split_points=["net.blocks.2"])
        HSDPStrategy(replica_check_every=100, replica_check_action="warn", gradient_scaling_factor=0.5)
        HSDPStrategy(parallelize_fn=lambda module, mesh: module)
        HSDPOptions(param_dtype=torch.bfloat16, timeout=60, divergence_check=False)

        # What the resolved options hold, each with its own type.
        mode: str = trainer_strategy.options.accumulation_mode
        dtype: Optional[torch.dtype] = trainer_strategy.options.param_dtype
        timeout: timedelta = trainer_strategy.options.timeout
        train_timeout: Optional[timedelta] = fabric_strategy.options.train_timeout
        check: Literal["per_step", "off"] = trainer_strategy.options.divergence_check
        microbatches: int = fabric_strategy.options.pipeline_microbatches
        ft: Optional[FaultTolerance] = trainer_strategy.options.fault_tolerance
        mesh: Optional[tuple[int, ...]] = fabric_strategy.options.mesh_shape
    """,
    "misspelled.py": """
        from hp_lightning import HSDPStrategy

        strategy = HSDPStrategy(mesh_shape=[2, 2], cpu_ofload=True)
    """,
    "wrong_type.py": """
        from hp_lightning import HSDPFabricStrategy

        strategy = HSDPFabricStrategy(prefetch="2")
    """,
    # One error on each line from the third on (WRONG_LINES): wrong inputs, and resolved values read as what they are not.
    "wrong_forms.py": """
        from hp_lightning import HSDPStrategy

        HSDPStrategy(param_dtype=16)
        HSDPStrategy(timeout="30m")
        HSDPStrategy(divergence_check="sometimes")
        HSDPStrategy(tp_plan={"blocks.*.fc": 3})
        HSDPStrategy(fault_tolerance="yes")
        HSDPStrategy(pipeline_schedule="1F2B")
        as_text: str = HSDPStrategy().options.param_dtype
        seconds: float = HSDPStrategy().options.timeout
    """,
}
#: The lines of ``wrong_forms.py`` that must each be an error (1-based).
WRONG_LINES = set(range(3, 11))


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
    """One mypy run over the user scripts: every documented form passes, a misspelling, a wrong type and each wrong form fail."""
    returncode, stdout, stderr = _wait(checks["mypy"])
    output = stdout + stderr
    errors = _errors_by_file(output, r"^(?P<file>[^\s:]+\.py):\d+: error: (?P<message>.*)$")
    assert errors["builds_both.py"] == [], output
    assert errors["misspelled.py"] == [
        'Unexpected keyword argument "cpu_ofload" for "HSDPStrategy"; did you mean "cpu_offload"?  [call-arg]'
    ], output
    assert errors["wrong_type.py"] == ['Argument "prefetch" to "HSDPFabricStrategy" has incompatible type "str"; expected "int"  [arg-type]'], output
    lines = {int(m[1]) for m in re.finditer(r"^[^\s:]*wrong_forms\.py:(\d+): error:", output, re.MULTILINE)}
    assert lines == WRONG_LINES, output
    assert 'expected "str | dtype | None"' in output and 'expected "float | timedelta"' in output, output
    assert returncode == 1, output


def test_pyright_reads_both_constructors(checks):
    """The same scripts under pyright (the checker behind VS Code's Pylance), in one run."""
    if "pyright" not in checks:
        pytest.skip("pyright (pip install pyright, in the [test] extra) needs a Node.js runtime on PATH; mypy's test covers the same scripts")
    _, stdout, stderr = _wait(checks["pyright"])
    report = json.loads(stdout or "{}") if stdout.strip().startswith("{") else pytest.fail(stdout + stderr)
    errors: dict[str, list[str]] = {name: [] for name in USER_SCRIPTS}
    wrong_lines = set()
    for diagnostic in report["generalDiagnostics"]:
        if diagnostic["severity"] == "error":
            errors[Path(diagnostic["file"]).name].append(diagnostic["message"])
            if Path(diagnostic["file"]).name == "wrong_forms.py":
                wrong_lines.add(diagnostic["range"]["start"]["line"] + 1)
    assert errors["builds_both.py"] == [], errors
    assert errors["misspelled.py"] == ['No parameter named "cpu_ofload"'], errors
    assert len(errors["wrong_type.py"]) == 1 and errors["wrong_type.py"][0].startswith(
        'Argument of type "Literal[\'2\']" cannot be assigned to parameter "prefetch" of type "int"'
    ), errors
    assert wrong_lines == WRONG_LINES, errors["wrong_forms.py"]


def test_the_package_is_typed():
    """``py.typed`` ships (PEP 561): without it, an installed copy is not type-checked at all."""
    assert (PACKAGE / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["hp_lightning"]


# ------------------------------------------------------------------ generated, fresh, exact


def test_everything_derived_from_the_fields_is_fresh():
    """One command writes what derives from the option fields (scripts/generate.py); this names it while anything is stale."""
    spec = importlib.util.spec_from_file_location("generate", ROOT / "scripts" / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    stale = [str(path.relative_to(ROOT)) for path in generate.stale()]
    assert not stale, f"stale: {stale}; run `{generate.COMMAND}` (.venv/bin/python scripts/generate.py)"


def test_constructors_take_lightnings_arguments_then_exactly_the_fields():
    from lightning.fabric.strategies import ParallelStrategy as FabricParallel
    from lightning.pytorch.strategies import ParallelStrategy as TrainerParallel

    from hp_lightning import HSDPFabricStrategy, HSDPStrategy
    from hp_lightning.core.options import HSDPOptions, input_types

    types = input_types()
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
import torch.distributed.tensor.debug  # torch's own users of the name stay whole: hp_lightning's use is what is tested
import torch.utils._python_dispatch as dispatch

del fabric_strategy._BackwardSyncControl, dispatch.TorchDispatchMode

import hp_lightning
from hp_lightning import HSDPFabricStrategy, HSDPStrategy
from hp_lightning.core._torch_private import MissingPrivateNameError
from hp_lightning.planner.simulate import LiveBytes
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
for feature in (lambda: HSDPFabricStrategy(prefetch=2), lambda: LiveBytes()):
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
    (Fabric's ``no_backward_sync`` control, the planner's memory tracking) raise one clear error naming the
    name, the feature and the tested versions, at their first use.
    """
    import lightning

    from hp_lightning import _lightning_private
    from hp_lightning.core import _torch_private

    returncode, stdout, stderr = _wait(checks["compiled"])
    assert returncode == 0, stdout + stderr
    ok, fabric, planner = stdout.strip().splitlines()
    from hp_lightning.core.options import HSDPOptions

    assert ok == f"ok {len(dataclasses.fields(HSDPOptions))}", ok
    assert "lightning.fabric.strategies.strategy._BackwardSyncControl" in fabric and "fabric.no_backward_sync" in fabric, fabric
    assert f"lightning {lightning.__version__} lacks" in fabric and f"lightning{_lightning_private.TESTED_LIGHTNING}" in fabric, fabric
    assert "torch.utils._python_dispatch.TorchDispatchMode" in planner and "the planner" in planner, planner
    assert f"torch{_torch_private.TESTED_TORCH}" in planner, planner
