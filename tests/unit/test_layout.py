"""The folder layout tells the truth: the engine needs no Lightning, nothing imports in a circle.

The import checks run in a fresh interpreter, so this test process's imports cannot hide a
cycle; the AST checks read every import statement, inside functions and ``TYPE_CHECKING``
blocks included, so an import that only runs later is held to the same rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hp_lightning"
#: The engine: no Lightning import anywhere, and nothing from the layers above it.
ENGINE = ("core", "fully_shard", "parallel")
UPPER = (
    "hp_lightning.strategies", "hp_lightning.fabric", "hp_lightning.frontends", "hp_lightning.callbacks",
    "hp_lightning.checkpoint", "hp_lightning.accelerators", "hp_lightning.planner",
)
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def _modules(folder: Path) -> list[str]:
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent)


#: Run in a fresh interpreter by the test below. Python runs ``hp_lightning/__init__`` to its end
#: before any submodule, whichever module is imported first, and that import is the same every time.
#: So the package is imported once, here: a module it loads has then been imported as it would be
#: first; each module it does not load is imported in a child forked from this state, which is the
#: state any fresh process reaches on its way to that module, so no child sees another's imports.
#: (Importing all ~100 modules again from scratch one by one tests the same sequences, in 20 s.)
_EACH_MODULE_FIRST = """
import importlib, multiprocessing, os, sys

def first(name):
    try:
        importlib.import_module(name)
    except Exception as exc:
        return f"{name}: {type(exc).__name__}: {exc}"
    return ""

names = NAMES
assert not [m for m in sys.modules if m.startswith("hp_lightning")]
bad = [f"hp_lightning, and so every module: {error}"] if (error := first("hp_lightning")) else []
loaded = {m for m in sys.modules if m == "hp_lightning" or m.startswith("hp_lightning.")}
rest = [n for n in names if n not in loaded] if not bad else []
with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0)), maxtasksperchild=1) as workers:
    bad += [e for e in workers.map(first, rest, chunksize=1) if e]
print(len(loaded), len(rest))
print(bad, flush=True)
os._exit(0)  # skips the second of tearing torch down at exit
"""


def test_every_module_imports_on_its_own():
    # A cycle that only bites when a module is the entry point shows up as an ImportError here.
    names = _modules(PACKAGE)
    result = _python(_EACH_MODULE_FIRST.replace("NAMES", repr(names)))
    assert result.returncode == 0, result.stderr
    counts, bad = result.stdout.strip().splitlines()[-2:]
    assert bad == "[]", f"modules that fail as the first import: {bad}"
    loaded, rest = map(int, counts.split())
    assert loaded + rest == len(names) and loaded > 1 and rest > 1, f"{loaded} modules loaded by the package, {rest} on their own, of {len(names)}"


def test_engine_runs_without_lightning():
    # Lightning made unimportable, hp_lightning's own __init__ (which registers the strategies)
    # bypassed: every engine module must still import.
    names = [n for folder in ENGINE for n in _modules(PACKAGE / folder)]
    code = (
        "import sys, types, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n"
        "            raise ImportError(f'{name} imported by the engine')\n"
        "sys.meta_path.insert(0, Block())\n"
        "pkg = types.ModuleType('hp_lightning'); pkg.__path__ = ['hp_lightning']; sys.modules['hp_lightning'] = pkg\n"
        f"for n in {names!r}: __import__(n)\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_imports_flow_from_the_front_ends_down_to_the_engine():
    offenders = []
    for folder in ENGINE:
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(PACKAGE)} imports {m}" for m in modules if m.startswith(UPPER)]
                offenders += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] in LIGHTNING
                ]
                if isinstance(node, ast.ImportFrom) and node.module == "hp_lightning":  # the package: every front end
                    offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports hp_lightning.{a.name}" for a in node.names]
                if isinstance(node, ast.Import):
                    offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports hp_lightning" for a in node.names if a.name == "hp_lightning"]
    assert not offenders, offenders


# ------------------------------------------------------------------ import cycles (AST)

_MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, *, deferred: bool) -> set[str]:
    """The hp_lightning modules ``name`` imports: at import time, or also in functions (``TYPE_CHECKING`` blocks left out).

    ``from pkg import sub`` names the submodule ``pkg.sub`` (the package itself is imported on the
    way to any of its modules, so parent packages are not edges); ``from pkg import attr`` names ``pkg``.
    """
    path = _MODULES[name]
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
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in _MODULES}
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(base)

    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    everywhere = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in type_only]
    visit(everywhere if deferred else tree.body)
    return {m for m in found if m in _MODULES and m != name}


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
    assert ["hp_lightning.checkpoint.load", "hp_lightning.checkpoint.read"] in _cycles(graph)


def test_the_two_front_ends_have_distinct_names_and_the_old_ones_still_work():
    import hp_lightning
    import hp_lightning.fabric
    from hp_lightning.fabric.strategy import HSDPFabricStrategy
    from hp_lightning.strategies.hsdp import HSDPStrategy
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

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
    from hp_lightning.frontends.core import StrategyCore

    assert issubclass(HSDPStrategy, StrategyCore) and issubclass(HSDPFabricStrategy, StrategyCore)
    assert HSDPStrategy.__init__ is not HSDPFabricStrategy.__init__  # each gets Lightning's own arguments
    assert repr(HSDPFabricStrategy(mesh_shape=[2])) == "HSDPFabricStrategy(mesh_shape=(2,))"


def test_import_patches_nothing_in_lightning():
    code = (
        "from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as C\n"
        "before = C.__dict__['_choose_auto_accelerator']\n"
        "import hp_lightning\n"
        "assert C.__dict__['_choose_auto_accelerator'] is before, 'import hp_lightning patched accelerator=auto'\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "assert {'hsdp', 'hp_fsdp'} <= set(StrategyRegistry) and {'hsdp', 'hp_fsdp'} <= set(STRATEGY_REGISTRY)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
