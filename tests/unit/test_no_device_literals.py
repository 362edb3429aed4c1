"""No path in hp_lightning assumes a device: device names live in hp_lightning/core/devices.py only.

The scan parses every module of the package (outside ``devices.py`` and ``accelerators/``) and
reports, with file and line:

* string literals that are a device type or a collective backend (``"cuda"``, ``"npu:0"``,
  ``"cpu"``, ``"nccl"``, ``"hccl"``, ``"gloo"``, ...); prose that merely mentions one is fine;
* device modules reached by name (``torch.cuda``, ``torch.npu``, ``x.cuda()``, ``x.npu()``);
* imports of ``torch_npu`` or ``torch.cuda``.

``x.cpu()`` is allowed: the host exists on every machine. The scanner is itself tested on planted
code, so a clean package means clean, not a scanner that finds nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hp_lightning"
ALLOWED = {PACKAGE / "core" / "devices.py", PACKAGE / "accelerators"}

DEVICE_NAMES = ("cpu", "cuda", "npu", "mps", "xpu", "hpu", "mtia")
BACKEND_NAMES = ("gloo", "nccl", "hccl", "xccl", "mpi", "ucc")
_LITERAL = re.compile(rf"(?:{'|'.join(DEVICE_NAMES + BACKEND_NAMES)})(?::\d+)?", re.IGNORECASE)
#: Attributes that name an accelerator's module or move a tensor to one.
_DEVICE_ATTRIBUTES = {"cuda", "npu", "mps", "xpu", "hpu", "mtia"}
_DEVICE_PACKAGES = ("torch_npu", "torch.cuda", "torch.npu")


def find_device_literals(source: str) -> list[tuple[int, str]]:
    """(line, what) for each device-specific literal, module access or import in ``source``."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _LITERAL.fullmatch(node.value.strip()):
                found.append((node.lineno, f"string {node.value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr in _DEVICE_ATTRIBUTES:
            found.append((node.lineno, f"attribute .{node.attr}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith(_DEVICE_PACKAGES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(name.startswith(_DEVICE_PACKAGES) for name in imported):
                found.append((node.lineno, f"from {node.module} import ..."))
    return sorted(found)


def _package_files() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if not any(p == a or a in p.parents for a in ALLOWED)
    )


def test_scanner_finds_every_kind_of_device_assumption():
    planted = '''
"""Docstring that mentions cuda and nccl is fine."""
import torch_npu
from torch import cuda
from torch.cuda import amp
import torch.distributed as dist

def f(t, backend):
    """cpu"""
    if dist.get_backend() == "nccl":
        pass
    torch.load("x", map_location="cpu")
    torch.device("cuda:1")
    torch.cuda.synchronize()
    t = t.npu()
    x = {"gloo": 1}
    message = "runs on nccl or gloo"
    return t.cpu(), torch.device("meta"), f"{backend} on cuda"
'''
    found = find_device_literals(planted)
    assert found == [
        (3, "import torch_npu"),
        (4, "from torch import ..."),
        (5, "from torch.cuda import ..."),
        (10, "string 'nccl'"),
        (12, "string 'cpu'"),
        (13, "string 'cuda:1'"),
        (14, "attribute .cuda"),
        (15, "attribute .npu"),
        (16, "string 'gloo'"),
    ]


def test_scanner_covers_the_whole_package():
    files = _package_files()
    names = {p.relative_to(PACKAGE).as_posix() for p in files}
    assert "strategies/hsdp.py" in names and "core/mesh.py" in names
    assert not any(n.startswith("accelerators/") or n == "core/devices.py" for n in names)


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_device_literals_outside_the_device_mapping(path: Path):
    found = find_device_literals(path.read_text())
    assert not found, (
        f"{path.relative_to(PACKAGE.parent)} names devices directly; use hp_lightning.core.devices "
        f"(CPU/CUDA/NPU, default_backend, cpu_device, device_module, barrier_device_ids, ...): "
        + "; ".join(f"line {line}: {what}" for line, what in found)
    )
