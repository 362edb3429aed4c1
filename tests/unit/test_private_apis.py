"""Every private torch and Lightning name hp_lightning uses exists in the installed versions.

When an upgrade removes one, this fails first, naming it and the adapter to update, instead of a
training run failing somewhere deep.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning
import torch

from hp_lightning import _lightning_private
from hp_lightning.core import _torch_private

PACKAGE = Path(__file__).resolve().parents[2] / "hp_lightning"
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


def test_the_checker_notices_a_missing_name():
    assert not _torch_private._resolve("torch.distributed.fsdp", "FSDPModule._no_such_method_here")
    assert not _lightning_private._resolve("lightning.fabric.utilities.distributed", "_no_such_function")


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
