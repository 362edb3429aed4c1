"""Which submodules become sharding units, and which parameters get special treatment.

A sharding unit is gathered in one all-gather and reduced in one reduce-scatter. Many small
units overlap communication with compute but issue many small collectives; one big unit
gathers the whole model at once. The usual choice, and the automatic one here, is one unit per
transformer block.

Units are named by:

* a class (``MyBlock``) or a dotted class path as a string (``"my_pkg.model.MyBlock"``);
* a bare class name (``"MyBlock"``) found among the model's submodules;
* a module-name glob (``"model.layers.*"``), matched against ``named_modules()`` names; only
  the outermost matches count, so ``"layers.*"`` selects the layers, not their sublayers.

With nothing named, the units are the classes in HF's ``_no_split_modules`` when the model has
it, else the blocks of the model's repeated ``nn.ModuleList`` s.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable, Sequence
from typing import Union

from torch import nn

UnitSpec = Union[type, str]

_GLOB_CHARS = set("*?[")


def _is_glob(spec: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in spec)


def _import_class(path: str) -> type | None:
    module_path, _, name = path.rpartition(".")
    if not module_path:
        return None
    try:
        module = importlib.import_module(module_path)
    except (ImportError, ValueError):
        return None
    obj = getattr(module, name, None)
    return obj if isinstance(obj, type) else None


def _as_spec_list(specs: UnitSpec | Sequence[UnitSpec] | None, option: str) -> list[UnitSpec]:
    if specs is None:
        return []
    if isinstance(specs, (str, type)):
        specs = [specs]
    if not isinstance(specs, Iterable):
        raise TypeError(
            f"{option} expects a list of classes, dotted class names or module-name globs; got "
            f"{type(specs).__name__} {specs!r}. Example: {option}=['my_pkg.model.Block'] or ['net.layers.*']."
        )
    out = list(specs)
    for spec in out:
        if not isinstance(spec, (str, type)):
            raise TypeError(
                f"{option} items must be classes or strings; got {type(spec).__name__} {spec!r}. "
                f"Example: {option}=['my_pkg.model.Block']."
            )
        if isinstance(spec, type) and not issubclass(spec, nn.Module):
            raise TypeError(f"{option} classes must be nn.Module subclasses; got {spec.__name__}.")
        if isinstance(spec, str) and not spec.strip():
            raise ValueError(f"{option} contains an empty string; remove it or name a class or module.")
    return out


def validate_unit_specs(specs: UnitSpec | Sequence[UnitSpec] | None, option: str = "shard_modules") -> list[UnitSpec]:
    """Check types and that dotted class paths import, without a model (runs before launch).

    Raises:
        TypeError: for items that are neither classes nor strings.
        ValueError: for a dotted path that looks like a class (``pkg.Class``) but does not import.
    """
    out = _as_spec_list(specs, option)
    for spec in out:
        if isinstance(spec, str) and not _is_glob(spec) and "." in spec and spec.rpartition(".")[2][:1].isupper():
            if _import_class(spec) is None:
                raise ValueError(
                    f"{option} entry {spec!r} looks like a dotted class path but does not import to a class. "
                    f"Check the module path and class name (e.g. 'my_pkg.model.Block'), or use a "
                    f"module-name glob like 'model.layers.*'."
                )
    return out


def select_modules(model: nn.Module, specs: Sequence[UnitSpec], option: str = "shard_modules") -> list[nn.Module]:
    """Resolve unit specs against ``model``; every spec must match at least one submodule.

    The root itself is never returned. Order: reverse pre-order, i.e. children before their
    parents (the bottom-up order ``fully_shard`` needs).

    Raises:
        ValueError: for a spec that matches nothing, listing what was available.
    """
    named = [(name, module) for name, module in model.named_modules() if name]
    chosen: list[nn.Module] = []

    def add(module: nn.Module) -> None:
        if not any(module is m for m in chosen):
            chosen.append(module)

    for spec in validate_unit_specs(specs, option):
        matched = []
        if isinstance(spec, type):
            matched = [m for _, m in named if isinstance(m, spec)]
        elif _is_glob(spec):
            # '*' crosses dots (as in fnmatch), so 'blocks.*' also matches 'blocks.0.fc1'; only the
            # outermost matches become units, the blocks themselves.
            names = [n for n, _ in named if fnmatch.fnmatchcase(n, spec)]
            outermost = [n for n in names if not any(n.startswith(o + ".") for o in names)]
            matched = [m for n, m in named if n in outermost]
        else:
            cls = _import_class(spec) if "." in spec else None
            if cls is not None:
                matched = [m for _, m in named if isinstance(m, cls)]
            else:
                matched = [m for n, m in named if type(m).__name__ == spec or n == spec]
        if not matched:
            classes = sorted({type(m).__name__ for _, m in named})
            sample = [n for n, _ in named][:8]
            raise ValueError(
                f"{option} entry {spec!r} matches no submodule of {type(model).__name__}. Available "
                f"classes: {classes}; module names start with {sample}. Use a class, a dotted class "
                f"path, a class name from that list, or a glob such as 'model.layers.*'."
            )
        for m in matched:
            add(m)
    return bottom_up(model, chosen)


def bottom_up(model: nn.Module, modules: Iterable[nn.Module]) -> list[nn.Module]:
    """``modules`` in reverse pre-order: every child before its parent, as ``fully_shard`` needs."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(modules, key=lambda m: -order[id(m)])


def user_class(module: nn.Module) -> type:
    """The class the user wrote, also for a module ``fully_shard`` has already given a subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def auto_units(model: nn.Module) -> list[nn.Module]:
    """Units chosen without user input: HF ``_no_split_modules`` classes, else repeated ModuleList blocks."""
    named = [(name, module) for name, module in model.named_modules() if name]
    no_split: set[str] = set()
    for _, module in [("", model), *named]:
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    if no_split:
        units = [m for _, m in named if type(m).__name__ in no_split and _has_params(m)]
        if units:
            return bottom_up(model, units)
    # Pre-order walk: an outer ModuleList is seen before any list nested inside its blocks,
    # and lists inside an already chosen block are skipped (a block is one unit).
    block_names: list[str] = []
    blocks: list[nn.Module] = []
    for name, module in named:
        if not isinstance(module, nn.ModuleList) or any(name.startswith(b + ".") for b in block_names):
            continue
        children = [(f"{name}.{i}", c) for i, c in enumerate(module) if _has_params(c)]
        if len(children) >= 2 and len({user_class(c) for _, c in children}) == 1:
            block_names.extend(n for n, _ in children)
            blocks.extend(c for _, c in children)
    return bottom_up(model, blocks)


def select_params(model: nn.Module, patterns: Sequence[str] | None, option: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters whose names match any of the glob ``patterns``; each pattern must match one.

    Raises:
        TypeError: when ``patterns`` is not a list of strings.
        ValueError: for a pattern that matches no parameter.
    """
    if patterns is None:
        return []
    if isinstance(patterns, str) or not isinstance(patterns, Iterable):
        raise TypeError(f"{option} expects a list of parameter-name globs; got {type(patterns).__name__} {patterns!r}. Example: {option}=['head.*'].")
    named = list(model.named_parameters())
    out: list[tuple[str, nn.Parameter]] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{option} items must be strings (parameter-name globs); got {type(pattern).__name__} {pattern!r}.")
        hits = [(n, p) for n, p in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"{option} pattern {pattern!r} matches no parameter of {type(model).__name__}; names look "
                f"like {[n for n, _ in named][:6]}. Use a glob such as 'head.*' or '*.bias'."
            )
        for n, p in hits:
            if not any(p is q for _, q in out):
                out.append((n, p))
    return out
