"""Write everything derived from the option fields: ``make generate`` (``.venv/bin/python scripts/generate.py``).

An option is written once, as a field of a group in ``hp_lightning/core/options.py`` (its
annotation: the normalized value; ``accepts=``: what a user may pass; its default; its
documentation), and used where it acts. Everything else follows from the fields, written here:

* ``hp_lightning/core/option_inputs.py``: ``OptionInputs``, the ``TypedDict`` of what a user may
  pass, which type checkers read through both constructors' ``**options: Unpack[OptionInputs]``
  (read from ``options.py`` with :mod:`ast`: nothing of hp_lightning is imported for it, so it is
  written even when the package cannot import);
* ``examples/configs/full_options.yaml``: a strategy option the file lacks is added with its
  default (and the first sentence of its documentation as comment); a key that is no field is
  removed. Values set on purpose and their comments stay as written;
* ``docs/configuration.md``: the option reference (one table per group), between its markers;
* ``tests/golden/frontends.json``: what both front ends accept and resolve (signatures; settings,
  sharding plan and mesh for every registered name and every YAML in ``examples/configs/``), for a
  refactor to keep (``tests/unit/test_golden_frontends.py``).

``tests/unit/test_public_surface.py`` fails when any of them is stale and names this command.

    .venv/bin/python scripts/generate.py          # rewrite what is stale
    .venv/bin/python scripts/generate.py --check  # exit 1 when something is stale
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "make generate"
OPTIONS = ROOT / "hp_lightning" / "core" / "options.py"
INPUTS = ROOT / "hp_lightning" / "core" / "option_inputs.py"
FULL_OPTIONS = ROOT / "examples" / "configs" / "full_options.yaml"
DOC = ROOT / "docs" / "configuration.md"
GOLDEN = ROOT / "tests" / "golden" / "frontends.json"
CONFIGS = ROOT / "examples" / "configs"
OPTIONS_MODULE = "hp_lightning.core.options"


# ------------------------------------------------------------------ option_inputs.py (from the source, with ast)


class Field(typing.NamedTuple):
    name: str
    accepts: str  # the type a user may pass, as written in options.py (``accepts=``, else the annotation)


def read_fields(path: Path = OPTIONS) -> tuple[list[Field], dict[str, tuple[str, str]]]:
    """Every field of ``HSDPOptions`` in order (the groups of ``OPTION_GROUPS``), and the names ``options.py`` binds.

    Raises:
        SystemExit: a field not written ``name: T = option(default, doc, [accepts=...])``, or no ``OPTION_GROUPS``.
    """
    source = path.read_text()
    tree = ast.parse(source)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    bound: dict[str, tuple[str, str]] = {}  # local name -> (module, name there)
    order: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (alias.name, "")
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            bound.setdefault(node.name, (OPTIONS_MODULE, node.name))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            if any(isinstance(t, ast.Name) and t.id == "OPTION_GROUPS" for t in node.targets):
                order = [elt.id for elt in node.value.elts if isinstance(elt, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "OPTION_GROUPS":
            if isinstance(node.value, ast.Tuple):
                order = [elt.id for elt in node.value.elts if isinstance(elt, ast.Name)]
    if not order:
        raise SystemExit(f"{path}: no OPTION_GROUPS tuple of group classes")
    out: list[Field] = []
    for group in order:
        for node in classes[group].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name = node.target.id
            call = node.value
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "option"):
                raise SystemExit(f"{path}: {group}.{name} must be written `{name}: T = option(default, doc)` (its default and documentation)")
            keywords = {k.arg: k.value for k in call.keywords}
            if len(call.args) + len(keywords.keys() & {"default", "doc"}) < 2:
                raise SystemExit(f"{path}: {group}.{name} needs its default and its documentation: option(default, doc)")
            written = keywords.get("accepts", node.annotation)
            text = ast.get_source_segment(source, written)
            assert text is not None
            out.append(Field(name, " ".join(text.split())))
    return out, bound


def _names(expression: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(expression, mode="eval")) if isinstance(node, ast.Name)}


def _sort_key(name: str) -> tuple[int, str]:
    """ruff's isort order inside one ``from ... import``: constants, classes, then the rest."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def _imports(fields: list[Field], bound: dict[str, tuple[str, str]]) -> str:
    """The imports the annotations need, from where ``options.py`` imports each name, in ruff's order."""
    from_imports: dict[str, set[str]] = {"typing": {"TypedDict"}}
    plain: set[str] = set()
    for name in sorted(set().union(*(_names(f.accepts) for f in fields))):
        if hasattr(builtins, name) and name not in bound:
            continue
        if name not in bound:
            raise SystemExit(f"{OPTIONS}: the name {name!r} in an option's type is neither imported nor defined there")
        module, original = bound[name]
        if not original:
            plain.add(module)
        elif original != name:
            raise SystemExit(f"{OPTIONS}: {name!r} is imported under another name; import it by its own name")
        else:
            from_imports.setdefault(module, set()).add(name)
    sections: dict[int, list[str]] = {0: [], 1: [], 2: []}

    def section(module: str) -> int:
        top = module.split(".")[0]
        return 2 if top == "hp_lightning" else 0 if top in sys.stdlib_module_names else 1

    for module in sorted(plain):
        sections[section(module)].append(f"import {module}")
    for module in sorted(from_imports):
        sections[section(module)].append(f"from {module} import {', '.join(sorted(from_imports[module], key=_sort_key))}")
    for key in sections:  # "import x" before "from x import y" inside a section, each sorted by module
        sections[key].sort(key=lambda line: (line.startswith("from "), line.split()[1]))
    return "\n\n".join("\n".join(lines) for lines in sections.values() if lines)


def render_inputs() -> str:
    fields, bound = read_fields()
    lines = [
        "# GENERATED by `make generate` (scripts/generate.py) from the fields of hp_lightning/core/options.py: do not edit.",
        '"""What a user may pass for each strategy option, as type checkers read it: ``**options: Unpack[OptionInputs]``.',
        "",
        "One key per field of :class:`~hp_lightning.core.options.HSDPOptions`, typed with the field's ``accepts``",
        "(else its annotation); any key may be left out (the field's default). What each means: the field's",
        "documentation (``docs/configuration.md``, ``--help``).",
        '"""',
        "",
        _imports(fields, bound),
        "",
        '__all__ = ["OptionInputs"]',
        "",
        "",
        "class OptionInputs(TypedDict, total=False):",
        '    """Every strategy option, by the type of what a user may pass."""',
        "",
        *(f"    {f.name}: {f.accepts}" for f in fields),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ full_options.yaml: every option a key


_KEY = re.compile(r"^ {6}([A-Za-z_]\w*):")


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _first_sentence(doc: str) -> str:
    text = re.sub(r":(?:class|mod|func|meth|attr):`~?([^`]+)`", r"\1", doc).replace("``", "")
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def render_full_options(text: str) -> str:
    """``text`` with a key (its default) for each strategy option it lacks, and no key that is no option."""
    from hp_lightning.core.options import HSDPOptions, field_docs

    defaults = {f.name: f.default for f in dataclasses.fields(HSDPOptions)}
    lines = text.splitlines(keepends=True)
    strategy = next((i for i, line in enumerate(lines) if line.rstrip() == "  strategy:"), len(lines))
    start = next((i for i in range(strategy, len(lines)) if lines[i].rstrip() == "    init_args:"), None)
    if start is None:
        raise SystemExit(f"{FULL_OPTIONS}: no `trainer: strategy: init_args:` block to keep in step with the options")
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("      ")):
        end += 1
    block = lines[start + 1:end]
    kept: list[str] = []
    dropping = False
    for line in block:
        key = _KEY.match(line)
        if key:
            dropping = key[1] not in defaults
        elif not line.startswith("       "):  # a comment or blank line at the keys' level: a dropped key's value ended
            dropping = False
        if not dropping:
            kept.append(line)
    present = {m[1] for m in map(_KEY.match, kept) if m}
    docs = field_docs()
    for name in (n for n in defaults if n not in present):
        comment = textwrap.wrap(f"{_first_sentence(docs[name])} (added by {COMMAND} with its default)", 94)
        kept += [f"      # {line}\n" for line in comment] + [f"      {name}: {_yaml(defaults[name])}\n"]
    return "".join(lines[:start + 1] + kept + lines[end:])


# ------------------------------------------------------------------ docs/configuration.md: the option reference


BEGIN = "<!-- BEGIN GENERATED: strategy options (make generate; edit the fields in hp_lightning/core/options.py) -->"
END = "<!-- END GENERATED: strategy options -->"


def _type(annotation: Any) -> str:
    text = re.sub(r"\b(typing|collections\.abc|datetime|torch\.distributed\.tensor\.parallel\.style)\.", "",
                  annotation.__name__ if isinstance(annotation, type) else repr(annotation))
    return text.replace("NoneType", "None").replace("|", "\\|")


def _cell(text: str) -> str:
    text = re.sub(r":(?:class|mod|func|meth|attr):`~?([^`]+)`", r"`\1`", text)  # Sphinx roles read as code here
    return text.replace("``", "`").replace("|", "\\|")


def render_configuration(text: str) -> str:
    from hp_lightning.core.options import OPTION_GROUPS, field_docs, input_types

    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the {BEGIN!r} / {END!r} markers are missing")
    docs, types = field_docs(), input_types()
    lines = [BEGIN, ""]
    for group in OPTION_GROUPS:
        summary = (group.__doc__ or "").strip().splitlines()[0].rstrip(".")
        lines += [f"### {summary}", "", f"`{group.__name__}` in `hp_lightning.core.options`.", ""]
        lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(typing.cast(Any, group)):
            lines.append(f"| `{f.name}` | `{_type(types[f.name])}` | `{_yaml(f.default)}` | {_cell(docs[f.name])} |")
        lines.append("")
    lines.append(END)
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + "\n".join(lines) + tail


# ------------------------------------------------------------------ tests/golden/frontends.json


#: The world for registered names (no YAML to say it): 2 nodes of 4 devices.
REGISTRY_WORLD = {"num_nodes": 2, "devices": 4}


def _plain(value: Any) -> Any:
    """A JSON value that changes exactly when ``value`` does (repr for anything but containers and scalars)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return repr(value)


def signature(cls: Any) -> list[dict[str, Any]]:
    """Positional parameters in order, then the keyword-only ones by name (their order means nothing to a call)."""
    hints = typing.get_type_hints(cls.__init__)
    out = []
    params = list(inspect.signature(cls.__init__).parameters.items())
    keyword_only = sorted((item for item in params if item[1].kind is inspect.Parameter.KEYWORD_ONLY), key=lambda item: item[0])
    for name, p in [item for item in params if item[1].kind is not inspect.Parameter.KEYWORD_ONLY] + keyword_only:
        out.append(
            {
                "name": name,
                "kind": p.kind.name,
                "default": None if p.default is inspect.Parameter.empty else _plain(p.default),
                "annotation": repr(hints.get(name)) if name in hints else None,
            }
        )
    return out


def front_ends() -> dict[str, type]:
    import hp_lightning  # noqa: F401  (registers the names)
    from hp_lightning.fabric import HSDPStrategy as FabricStrategy
    from hp_lightning.strategies import HSDPStrategy as TrainerStrategy

    return {"trainer": TrainerStrategy, "fabric": FabricStrategy}


def resolved(front_end: str, cls: type, init_args: dict[str, Any], precision: Any, world: dict[str, int]) -> dict[str, Any]:
    """What ``cls(**init_args)`` resolves to: settings, sharding plan, mesh layout (or the error)."""
    import torch

    from hp_lightning.core.mesh import resolve_layout

    try:
        strategy = cls(**init_args)
    except (TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    options = strategy.options
    out: dict[str, Any] = {"settings": _plain(options.settings())}
    if front_end == "trainer":
        from hp_lightning.strategies.precision import HSDPPrecision

        strategy.precision_plugin = HSDPPrecision(precision)
    else:
        from hp_lightning.fabric.precision import HSDPPrecision as FabricPrecision

        strategy.precision = FabricPrecision(precision)
    strategy.parallel_devices = [torch.device("cpu")] * world["devices"]
    plan = strategy.sharding_plan()
    # The plan is the options (in "settings" above) and the two policies they resolve to for this run.
    out["sharding_plan"] = {"mp_policy": _plain(plan.mp_policy), "offload_policy": _plain(plan.offload_policy)}
    try:
        layout = resolve_layout(
            options.mesh_shape,
            world_size=world["num_nodes"] * world["devices"],
            num_nodes=world["num_nodes"],
            devices_per_node=world["devices"],
            tensor_parallel_size=options.tensor_parallel_size,
            expert_parallel_size=options.expert_parallel_size,
            pipeline_parallel_size=options.pipeline_parallel_size,
        )
        out["layout"] = {"names": list(layout.names), "shape": list(layout.shape), "dp": list(layout.dp)}
    except ValueError as exc:
        out["layout"] = {"error": str(exc)}
    return out


def golden() -> dict[str, Any]:
    """Both front ends' signatures, and what every registered name and every YAML resolves to."""
    import yaml
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    classes = front_ends()
    registries = {"trainer": StrategyRegistry, "fabric": FABRIC_REGISTRY}
    out: dict[str, Any] = {"signatures": {fe: signature(cls) for fe, cls in classes.items()}, "registered": {}, "configs": {}}
    for fe, registry in registries.items():
        for name in ("hsdp", "hp_fsdp", "hsdp_cpu_offload"):
            entry = registry[name]
            init_args = dict(entry["init_params"])
            out["registered"][f"{fe}:{name}"] = {
                "init_params": _plain(init_args),
                "class_is_front_end": entry["strategy"] is classes[fe],
                **resolved(fe, classes[fe], init_args, "32-true", REGISTRY_WORLD),
            }
    for path in sorted(CONFIGS.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        trainer = config["trainer"]
        init_args = trainer["strategy"].get("init_args", {})
        world = {"num_nodes": trainer.get("num_nodes", 1), "devices": trainer["devices"]}
        for fe, cls in classes.items():
            out["configs"][f"{fe}:{path.name}"] = resolved(fe, cls, dict(init_args), trainer.get("precision", "32-true"), world)
    return out


def render_golden(_: str) -> str:
    return json.dumps(golden(), indent=1, sort_keys=True) + "\n"


# ------------------------------------------------------------------ all of them


#: In the order they are written: the type checkers' view first (from the source alone), the YAML before the golden
#: file that reads it. Each renderer takes the file's current text (empty when missing) and returns what it must be.
RENDERERS: dict[Path, Callable[[str], str]] = {
    INPUTS: lambda _: render_inputs(),
    FULL_OPTIONS: render_full_options,
    DOC: render_configuration,
    GOLDEN: render_golden,
}


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def stale() -> list[Path]:
    """The derived files that differ from what the fields give (nothing written)."""
    sys.path.insert(0, str(ROOT))
    return [path for path, render in RENDERERS.items() if render(_read(path)) != _read(path)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a derived file is stale (nothing written)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.check:
        paths = stale()
        for path in paths:
            print(f"{path.relative_to(ROOT)} is stale: run `{COMMAND}`")
        return 1 if paths else 0
    for path, render in RENDERERS.items():
        text = render(_read(path))
        if text != _read(path):
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
