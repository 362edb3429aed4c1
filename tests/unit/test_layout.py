"""The folder layout tells the truth: every package has a layer, imports only go down, nothing imports in a circle,
and the map in ``docs/architecture.md`` names every module (and nothing else).

The import checks run in a fresh interpreter, so this test process's imports cannot hide a
cycle; the AST checks read every import statement, inside functions and ``TYPE_CHECKING``
blocks included, so an import that only runs later is held to the same rule.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hp_lightning"
#: Every package (and top-level module) of hp_lightning, bottom layer first. A package may import
#: from its own package and from any lower layer, never from its own layer's other packages or
#: from a layer above: a new package, or an import that goes up, fails this file.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version",),  # a leaf
    ("core",),  # options and their checks, mesh, units, materialize, agreement, watchdog, torch's adapter
    ("parallel",),  # tensor, expert, pipeline (cutting and running stages): torch's pieces, no FSDP
    ("fully_shard",),  # the seed's fully_shard API on FSDP2 (EP-aware: reads parallel.expert)
    ("recipe",),  # TP -> EP -> activation checkpointing -> units -> root -> prefetch; prepare_model
    ("checkpoint",),  # sharded/full/async save and load, the converter
    ("ft",),  # fault tolerance across replica groups (torchft), heals through checkpoint
    ("_lightning_private",),  # every private Lightning name (checked with core._torch_private's resolver)
    ("accelerators",),  # devices Lightning lacks
    ("frontends",),  # the strategy core both adapters share
    ("strategies", "fabric"),  # the Trainer and Fabric adapters (independent of each other)
    ("callbacks",),  # per-step policy through the Trainer strategy's public methods
    ("planner",),  # costs the strategy's plan; --validate trains with the Trainer strategy
    ("__init__", "__main__"),  # the package: registers the strategy names; the command line
)
#: The engine: no Lightning import anywhere (not even inside functions).
ENGINE = ("core", "parallel", "fully_shard", "recipe")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def _modules(folder: Path) -> list[str]:
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent)


#: Run in one fresh interpreter by the fixture below, for the three checks that need a process no
#: test has imported into. torch is imported first (every path imports it), then a child forked
#: from that state checks the engine with Lightning made unimportable. The parent then imports
#: Lightning's accelerator connector, and then ``hp_lightning`` itself, as a user's script would.
#: Python runs ``hp_lightning/__init__`` to its end before any submodule, whichever module is
#: imported first, and that import is the same every time. So the package is imported once, here: a
#: module it loads has then been imported as it would be first; each module it does not load is
#: imported in a child forked from this state, which is the state any fresh process reaches on its
#: way to that module, so no child sees another's imports. (Importing all ~100 modules again from
#: scratch one by one tests the same sequences, in 20 s; three interpreters instead of one, 2x.)
_FRESH_INTERPRETER = """
import importlib, importlib.abc, json, multiprocessing, os, sys, types
import torch

def first(name):
    try:
        importlib.import_module(name)
    except Exception as exc:
        return f"{name}: {type(exc).__name__}: {exc}"
    return ""

class BlockLightning(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):
            raise ImportError(f'{name} imported by the engine')

report = {}
read, write = os.pipe()
if os.fork() == 0:  # the engine without Lightning, hp_lightning's own __init__ (which registers the strategies) bypassed
    os.close(read)
    sys.meta_path.insert(0, BlockLightning())
    pkg = types.ModuleType('hp_lightning'); pkg.__path__ = ['hp_lightning']; sys.modules['hp_lightning'] = pkg
    errors = [e for e in map(first, ENGINE_NAMES) if e]
    os.write(write, json.dumps(errors).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as f:
    report["engine_without_lightning"] = json.loads(f.read() or '["the engine child died"]')

from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as C
before = C.__dict__['_choose_auto_accelerator']
assert not [m for m in sys.modules if m.startswith("hp_lightning")]
bad = [f"hp_lightning, and so every module: {error}"] if (error := first("hp_lightning")) else []
report["patched_auto_accelerator"] = C.__dict__['_choose_auto_accelerator'] is not before
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
report["registered"] = sorted({'hsdp', 'hp_fsdp'} & set(StrategyRegistry) & set(STRATEGY_REGISTRY))
loaded = {m for m in sys.modules if m == "hp_lightning" or m.startswith("hp_lightning.")}
rest = [n for n in NAMES if n not in loaded] if not bad else []
with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0)), maxtasksperchild=1) as workers:
    bad += [e for e in workers.map(first, rest, chunksize=1) if e]
report.update(loaded=len(loaded), rest=len(rest), first_import_failures=bad)
print("REPORT" + json.dumps(report), flush=True)
os._exit(0)  # skips the second of tearing torch down at exit
"""


@pytest.fixture(scope="module")
def fresh_interpreter() -> dict:
    """What one fresh interpreter found (see :data:`_FRESH_INTERPRETER`)."""
    engine = [n for folder in ENGINE for n in _modules(PACKAGE / folder)]
    code = _FRESH_INTERPRETER.replace("ENGINE_NAMES", repr(engine)).replace("NAMES", repr(_modules(PACKAGE)))
    result = _python(code)
    assert result.returncode == 0, result.stderr
    line = next((l for l in result.stdout.splitlines() if l.startswith("REPORT")), None)
    assert line is not None, result.stdout + result.stderr
    return json.loads(line[len("REPORT"):])


def test_every_module_imports_on_its_own(fresh_interpreter):
    # A cycle that only bites when a module is the entry point shows up as an ImportError here.
    names = _modules(PACKAGE)
    assert fresh_interpreter["first_import_failures"] == [], "modules that fail as the first import"
    loaded, rest = fresh_interpreter["loaded"], fresh_interpreter["rest"]
    assert loaded + rest == len(names) and loaded > 1 and rest > 1, f"{loaded} modules loaded by the package, {rest} on their own, of {len(names)}"


def test_engine_runs_without_lightning(fresh_interpreter):
    # Lightning made unimportable, hp_lightning's own __init__ bypassed: every engine module must still import.
    assert fresh_interpreter["engine_without_lightning"] == []


def test_the_engine_never_imports_lightning_even_inside_functions():
    offenders = []
    for folder in ENGINE:
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] in LIGHTNING
                ]
    assert not offenders, offenders


def deferred_imports(path: Path) -> list[str]:
    """hp_lightning imports inside functions in the file at ``path`` with no comment on the line or the one above (why it waits)."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            names = [a.name for a in inner.names] if isinstance(inner, ast.Import) else [inner.module or ""] if isinstance(inner, ast.ImportFrom) and not inner.level else []
            said = "#" in lines[inner.lineno - 1] or lines[inner.lineno - 2].strip().startswith("#") if names else True
            found += [f"{path.name}:{inner.lineno} imports {n}" for n in names if n.split(".")[0] == "hp_lightning" and not said]
    return found


def test_the_engine_and_the_planner_import_their_own_package_at_the_top(tmp_path):
    # An import inside a function hides an edge from a reader (and once hid the core <-> fully_shard cycle):
    # in these packages each one waits for a stated reason, in a comment, or is at the top.
    offenders = [f"{folder}/{hit}" for folder in (*ENGINE, "planner") for path in sorted((PACKAGE / folder).rglob("*.py")) for hit in deferred_imports(path)]
    assert offenders == []
    sample = "def f():\n    from hp_lightning.core import devices\n\n\ndef g():\n    # torchft is optional\n    from hp_lightning.ft import engine\n"
    (tmp_path / "sample.py").write_text(sample)
    assert deferred_imports(tmp_path / "sample.py") == ["sample.py:2 imports hp_lightning.core"]


# ------------------------------------------------------------------ import cycles (AST)

def _modules_of(package: Path) -> dict[str, Path]:
    """Every module of the package at ``package`` (the real one, or a copy), by dotted name."""
    return {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in package.rglob("*.py")}


_MODULES = _modules_of(PACKAGE)


def _imports(name: str, *, deferred: bool, type_checking: bool = False, modules: dict[str, Path] = _MODULES) -> set[str]:
    """The hp_lightning modules ``name`` imports: at import time, or also in functions (and in ``TYPE_CHECKING`` blocks when asked).

    ``from pkg import sub`` names the submodule ``pkg.sub`` (the package itself is imported on the
    way to any of its modules, so parent packages are not edges); ``from pkg import attr`` names ``pkg``.
    """
    path = modules[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []), *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(base)

    type_only = set() if type_checking else {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    everywhere = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in type_only]
    visit(everywhere if deferred else tree.body)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def test_no_module_imports_itself_in_a_circle():
    graph = {name: _imports(name, deferred=False) for name in _MODULES}
    assert _cycles(graph) == [], "import cycles (module-level imports; each list is one cycle's modules)"
    # The check sees a cycle when there is one: a two-module loop added by hand.
    graph["hp_lightning.core.devices"] = {*graph["hp_lightning.core.devices"], "hp_lightning.core.options"}
    assert any("hp_lightning.core.devices" in c for c in _cycles(graph))


def test_no_import_cycles_even_through_imports_inside_functions():
    graph = {name: _imports(name, deferred=True) for name in _MODULES}
    assert _cycles(graph) == [], "import cycles through imports inside functions (each list is one cycle's modules)"
    # The check sees a cycle closed by any edge: one from the shared reader back up to its loader, added by hand.
    graph["hp_lightning.checkpoint.read"] = {*graph["hp_lightning.checkpoint.read"], "hp_lightning.checkpoint.load"}
    assert any({"hp_lightning.checkpoint.load", "hp_lightning.checkpoint.read"} <= set(c) for c in _cycles(graph))


def test_fully_shard_is_called_in_one_place_with_the_whole_plan():
    # The recipe's units and root and the pipeline's stage roots all shard through recipe.parallelize.shard_module,
    # which passes every plan-wide option: a new sharding option is read there once and reaches every sharded module.
    # (fully_shard/ is the API itself; core/_torch_private.py probes torch's own fully_shard at import.)
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("fully_shard/") or relative == "core/_torch_private.py":
            continue
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for call in ast.walk(function):
                if isinstance(call, ast.Call) and "fully_shard" in (getattr(call.func, "id", None), getattr(call.func, "attr", None)):
                    calls.append(f"{relative}:{function.name}")
    assert sorted(set(calls)) == ["recipe/parallelize.py:shard_module"], calls


def test_a_sharding_plan_is_the_options_and_refuses_policies_that_contradict_them():
    import pytest
    import torch

    from hp_lightning.core.options import HSDPOptions
    from hp_lightning.recipe.parallelize import ShardingPlan

    options = HSDPOptions(param_dtype="bf16", cpu_offload=True, comm_fusion=True)
    plan = ShardingPlan.of(options, derived_reduce_dtype=torch.float32)
    assert plan.options is options  # no second field list: the recipe reads the options themselves
    assert (plan.mp_policy.param_dtype, plan.mp_policy.reduce_dtype, type(plan.offload_policy).__name__) == (torch.bfloat16, torch.float32, "CPUOffloadPolicy")
    with pytest.raises(ValueError, match=r"param_dtype=torch.bfloat16 but mp_policy.param_dtype=None; cpu_offload=True but offload_policy=OffloadPolicy"):
        ShardingPlan(options)


# ------------------------------------------------------------------ layers (packages)


def _package(module: str) -> str:
    """The package (first name below ``hp_lightning``) a module belongs to; the top-level modules are their own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which packages each package imports: every import statement counted, in functions and ``TYPE_CHECKING`` blocks too."""
    graph: dict[str, set[str]] = {_package(name): set() for name in modules}
    for name in modules:
        graph[_package(name)] |= {_package(m) for m in _imports(name, deferred=True, type_checking=True, modules=modules)}
    for package, targets in graph.items():
        targets.discard(package)
    return graph


def layer_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """What breaks the layering: a package without a layer, and each import of a package at or above the importer's layer."""
    layer = {package: index for index, group in enumerate(layers) for package in group}
    problems = [f"{package} has no layer in LAYERS: add it where it belongs" for package in sorted(graph) if package not in layer]
    for package in sorted(graph):
        for target in sorted(graph[package]):
            if package in layer and target in layer and layer[target] >= layer[package]:
                where = "its own layer" if layer[target] == layer[package] else "a layer above it"
                problems.append(f"{package} imports {target}, which is in {where}")
    return problems


def test_every_package_has_a_layer_and_imports_only_go_down():
    graph = package_graph(_MODULES)
    assert set(graph) == {p for group in LAYERS for p in group}, "LAYERS must name exactly the packages that exist"
    assert layer_violations(graph) == []
    assert _cycles(graph) == [], "import cycles between packages"


def test_the_layer_check_fails_on_an_upward_import_from_core_and_on_a_package_cycle(tmp_path):
    # The same checks on a copy of the package with one import added inside a function of core/
    # (the kind a lazy import would hide): core -> ft is upward, and closes core -> ft -> core.
    copy = tmp_path / "hp_lightning"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    devices = copy / "core" / "devices.py"
    devices.write_text(devices.read_text() + "\n\ndef _later():\n    from hp_lightning.ft import engine\n\n    return engine\n")
    graph = package_graph(_modules_of(copy))
    assert "core imports ft, which is in a layer above it" in layer_violations(graph)
    assert any({"core", "ft"} <= set(cycle) for cycle in _cycles(graph))
    # A cycle between two packages of one layer, and a package nobody classified, on synthetic graphs.
    assert layer_violations({"strategies": {"fabric"}, "fabric": {"strategies"}}) == [
        "fabric imports strategies, which is in its own layer",
        "strategies imports fabric, which is in its own layer",
    ]
    assert _cycles({"strategies": {"fabric"}, "fabric": {"strategies"}}) == [["fabric", "strategies"]]
    assert layer_violations({"newpkg": {"core"}, "core": set()}) == ["newpkg has no layer in LAYERS: add it where it belongs"]


def test_the_two_front_ends_have_distinct_names_and_the_old_ones_still_work():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import hp_lightning
    import hp_lightning.fabric
    from hp_lightning.fabric.strategy import HSDPFabricStrategy
    from hp_lightning.strategies.hsdp import HSDPStrategy

    assert HSDPStrategy.__name__ == "HSDPStrategy" and HSDPFabricStrategy.__name__ == "HSDPFabricStrategy"
    assert hp_lightning.HSDPStrategy is HSDPStrategy and hp_lightning.HSDPFabricStrategy is HSDPFabricStrategy
    # Old import paths: hp_lightning.fabric.HSDPStrategy and hp_lightning.FabricHSDPStrategy.
    assert hp_lightning.fabric.HSDPStrategy is HSDPFabricStrategy and hp_lightning.FabricHSDPStrategy is HSDPFabricStrategy
    from hp_lightning.fabric.strategy import HSDPStrategy as old_module_path

    assert old_module_path is HSDPFabricStrategy
    for name in ("hsdp", "hp_fsdp", "hsdp_cpu_offload"):
        assert StrategyRegistry[name]["strategy"] is HSDPStrategy
        assert STRATEGY_REGISTRY[name]["strategy"] is HSDPFabricStrategy
    # One shared core; each front end keeps only its own hooks.
    from hp_lightning.frontends.base import StrategyBase

    assert issubclass(HSDPStrategy, StrategyBase) and issubclass(HSDPFabricStrategy, StrategyBase)
    assert HSDPStrategy.__init__ is not HSDPFabricStrategy.__init__  # each gets Lightning's own arguments
    assert repr(HSDPFabricStrategy(mesh_shape=[2])) == "HSDPFabricStrategy(mesh_shape=(2,))"


def test_import_patches_nothing_in_lightning(fresh_interpreter):
    assert fresh_interpreter["patched_auto_accelerator"] is False, "import hp_lightning patched accelerator=auto"
    assert fresh_interpreter["registered"] == ["hp_fsdp", "hsdp"]


# ------------------------------------------------------------------ the map in docs/architecture.md

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
#: A path in backticks in the prose: folders and names, ending in ``.py`` (a module) or ``/`` (a package).
_PATH_IN_PROSE = re.compile(r"`((?:[A-Za-z0-9_]+/)*(?:[A-Za-z0-9_]+\.py|[A-Za-z0-9_]+/))`")


def architecture_map(text: str) -> list[str]:
    """The paths the tree under "## The map" names (``hp_lightning/core/mesh.py``; a package ends in ``/``), from its indentation."""
    block = text.split("\n## The map\n", 1)[1].split("```\n", 2)[1]
    named: list[str] = []
    folders: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        depth, name = indent // 2, line.split()[0]
        assert indent % 2 == 0 and depth <= len(folders) and (depth == 0) == (name == "hp_lightning/"), f"the map's tree is malformed at {line!r}"
        folders[depth:] = [name] if name.endswith("/") else []
        named.append("".join(folders[:depth]) + name)
    return named


def package_paths(package: Path) -> set[str]:
    """Every module of ``package`` as the map names it: a package by its folder (``hp_lightning/core/``), a module by its file."""
    found = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package.parent)
        found.add(f"{relative.parent.as_posix()}/" if path.name == "__init__.py" else relative.as_posix())
    return found


def test_the_architecture_map_names_every_module_and_only_modules_that_exist():
    text = ARCHITECTURE.read_text()
    named = architecture_map(text)
    assert len(named) == len(set(named)), "a module named twice in docs/architecture.md's map"
    actual = package_paths(PACKAGE)
    assert sorted(actual - set(named)) == [], "modules missing from the map in docs/architecture.md (add a line each)"
    assert sorted(set(named) - actual) == [], "the map in docs/architecture.md names modules that do not exist"
    # Paths in the prose exist too (relative to hp_lightning/, or to the repository for tests/ and docs/).
    prose = {p for p in _PATH_IN_PROSE.findall(text) if not (PACKAGE / p).exists() and not (PACKAGE.parent / p).exists()}
    assert prose == set(), "docs/architecture.md names paths that do not exist"
    # The check sees a module added without a line, and a line left for a module that is gone.
    lines = text.replace("    mesh.py ", "    meshes.py ", 1)
    assert {"hp_lightning/core/mesh.py"} <= actual - set(architecture_map(lines))
    assert "hp_lightning/core/meshes.py" in set(architecture_map(lines)) - actual
