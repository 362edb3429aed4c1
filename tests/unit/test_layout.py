"""The folder layout tells the truth: the engine needs no Lightning, every module imports alone.

Both checks run in a fresh interpreter, so this test process's imports cannot hide a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hp_lightning"
#: The engine: no Lightning import, and nothing from the layers above it.
ENGINE = ("core", "fully_shard")
UPPER = ("hp_lightning.strategies", "hp_lightning.fabric", "hp_lightning.callbacks", "hp_lightning.checkpoint", "hp_lightning.accelerators")


def _modules(folder: Path) -> list[str]:
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent)


def test_every_module_imports_on_its_own():
    # Each module is imported first, with every hp_lightning module forgotten before it (torch and
    # Lightning stay loaded, which keeps this fast): a cycle that only bites when that module is
    # the entry point shows up as an ImportError here.
    code = (
        "import sys, importlib, traceback\n"
        "import torch, lightning.pytorch\n"
        f"names = {_modules(PACKAGE)!r}\n"
        "bad = []\n"
        "for n in names:\n"
        "    for m in [m for m in sys.modules if m == 'hp_lightning' or m.startswith('hp_lightning.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{n}: {type(exc).__name__}: {exc}')\n"
        "print(bad)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", f"modules that fail as the first import: {result.stdout}"


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
    assert not offenders, offenders


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
