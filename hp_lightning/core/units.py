"""Which submodules become sharding units, and which parameters get special treatment.

A sharding unit is gathered in one all-gather and reduced in one reduce-scatter. Many small
units overlap communication with compute but issue many small collectives; one big unit
gathers the whole model at once. The usual choice, and the automatic one here, is one unit per
transformer block.

Units are named by a class, a dotted class path, a bare class name or a module-name glob
(:func:`select_modules`; only the outermost matches of a glob count). With nothing named:
:func:`auto_units`, then :func:`side_units` for large embeddings and a large output head. A plan
with no unit at all gathers the whole model on every rank: :func:`zero_units_warning` says so.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable, Sequence
from typing import Optional, Union

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


def validate_unit_specs(specs: UnitSpec | Sequence[UnitSpec] | None, option: str = "shard_modules") -> list[UnitSpec]:
    """Check types and that dotted class paths (``pkg.Class``) import, without a model (runs before launch)."""
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
    for spec in out:
        if isinstance(spec, str) and not _is_glob(spec) and "." in spec and spec.rpartition(".")[2][:1].isupper():
            if _import_class(spec) is None:
                raise ValueError(
                    f"{option} entry {spec!r} looks like a dotted class path but does not import to a class. "
                    f"Check the module path and class name (e.g. 'my_pkg.model.Block'), or use a "
                    f"module-name glob like 'model.layers.*'."
                )
    return out


def _matching_names(named: Sequence[tuple[str, type]], spec: UnitSpec) -> list[str]:
    """The module names (of ``(name, class)`` pairs) that one unit spec selects."""
    if isinstance(spec, type):
        return [n for n, cls in named if issubclass(cls, spec)]
    if _is_glob(spec):
        # '*' crosses dots (as in fnmatch), so 'blocks.*' also matches 'blocks.0.fc1'; only the
        # outermost matches become units, the blocks themselves.
        names = [n for n, _ in named if fnmatch.fnmatchcase(n, spec)]
        return [n for n in names if not any(n.startswith(o + ".") for o in names)]
    cls = _import_class(spec) if "." in spec else None
    if cls is not None:
        return [n for n, c in named if issubclass(c, cls)]
    return [n for n, c in named if c.__name__ == spec or n == spec]


def select_modules(
    model: nn.Module, specs: Sequence[UnitSpec], option: str = "shard_modules", whole_model: Optional[Sequence[tuple[str, type]]] = None
) -> list[nn.Module]:
    """Resolve unit specs against ``model``; every spec must match at least one submodule.

    The root itself is never returned. Order: reverse pre-order, i.e. children before their
    parents (the bottom-up order ``fully_shard`` needs).

    Args:
        whole_model: for a pipeline stage, the ``(name, class)`` of every submodule of the model
            before the cut: a spec is written against the whole model, so one that selects only
            other stages' modules selects nothing here, and only a spec that matches nothing in
            the whole model is a mistake.
    """
    named: list[tuple[str, nn.Module]] = [(name, module) for name, module in model.named_modules() if name]
    by_name = dict(named)
    classes = [(name, type(module)) for name, module in named]
    chosen: list[nn.Module] = []
    for spec in validate_unit_specs(specs, option):
        matched = [by_name[n] for n in _matching_names(classes, spec)]
        if not matched and not (whole_model is not None and _matching_names(whole_model, spec)):
            available = sorted({cls.__name__ for _, cls in (whole_model or classes)})
            sample = [n for n, _ in (whole_model or classes)][:8]
            raise ValueError(
                f"{option} entry {spec!r} matches no submodule of {type(model).__name__}. Available "
                f"classes: {available}; module names start with {sample}. Use a class, a dotted class "
                f"path, a class name from that list, or a glob such as 'model.layers.*'."
            )
        chosen += [m for m in matched if not any(m is c for c in chosen)]
    if option == "shard_modules":  # activation checkpointing wraps modules; ties do not matter there
        refuse_split_ties(model, chosen, option)
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


#: Containers whose children may be a model's repeated blocks.
CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_submodules_with_params(module: nn.Module) -> bool:
    return any(_has_params(child) for child in module.children())


def _container_blocks(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks among a container's children.

    In a ``ModuleList`` all children of one type are blocks; elsewhere the children whose type
    repeats and that have layers of their own (so an MLP's ``Linear`` s stay together).
    """
    children = [(name, child) for name, child in container.named_children() if _has_params(child)]
    # Lists and dicts are searched, never chosen (they have no forward); a Sequential is a block.
    blocks = [(n, c) for n, c in children if not isinstance(c, (nn.ModuleList, nn.ModuleDict))]
    by_type: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, child in blocks:
        by_type.setdefault(user_class(child), []).append((name, child))
    if isinstance(container, nn.ModuleList) and len(blocks) == len(children) >= 2 and len(by_type) == 1:
        return blocks  # a list of >= 2 same-typed modules (leaf layers included)
    # A Sequential of blocks between an embedding and a head, a ModuleDict of encoders; not nn.Sequential(Linear, ReLU, Linear).
    return [
        (n, c) for group in by_type.values() if len(group) >= 2 for n, c in group if _has_submodules_with_params(c)
    ]


def auto_units(model: nn.Module) -> list[nn.Module]:
    """Units chosen without user input: HF ``_no_split_modules`` classes, else repeated blocks.

    Repeated blocks (:func:`_container_blocks`) are found in every container, at any depth. The
    walk is pre-order, and the inside of a chosen block is not searched again: a block is one unit.
    """
    named = [(name, module) for name, module in model.named_modules() if name]
    no_split: set[str] = set()
    for _, module in [("", model), *named]:
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    if no_split:
        units = keep_ties_together(model, [m for _, m in named if user_class(m).__name__ in no_split and _has_params(m)])
        if units:
            return bottom_up(model, units)
    block_names: list[str] = []
    blocks: list[nn.Module] = []
    for name, module in [("", model), *named]:
        if not isinstance(module, CONTAINERS) or any(name.startswith(b + ".") for b in block_names):
            continue
        for child_name, child in _container_blocks(module):
            if any(child is b for b in blocks):
                continue
            block_names.append(f"{name}.{child_name}" if name else child_name)
            blocks.append(child)
    return bottom_up(model, keep_ties_together(model, [b for b in blocks if b is not model]))


def _split_ties(model: nn.Module, units: Sequence[nn.Module]) -> list[tuple[list[tuple[str, str]], str]]:
    """Tied parameters that ``units`` (plus the root) would put in more than one sharding unit.

    ``fully_shard`` on a unit manages the parameters of every module below it that no inner
    unit holds; the root manages the rest. A parameter reached under names managed by two
    different units would be sharded twice, which torch's FSDP2 refuses at the first forward.

    Returns:
        For each such parameter: its ``(name, managing unit's name)`` pairs (``""`` is the root),
        and the name of the innermost of those units (the one to give up).
    """
    unit_ids = {id(u) for u in units}
    unit_names = sorted({n for n, m in model.named_modules(remove_duplicate=False) if n and id(m) in unit_ids}, key=len)

    def manager(param_name: str) -> str:
        return max((u for u in unit_names if param_name.startswith(u + ".")), key=len, default="")

    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    split = []
    for names in names_of.values():
        pairs = [(name, manager(name)) for name in names]
        managers = {unit for _, unit in pairs}
        if len(managers) > 1:
            split.append((pairs, max(managers, key=len)))
    return split


def keep_ties_together(model: nn.Module, units: Sequence[nn.Module]) -> list[nn.Module]:
    """``units`` without those that would split a tied parameter across units (automatic plans).

    One parameter cannot belong to two sharding units: Hugging Face's ``BertForMaskedLM`` ties
    ``BertEmbeddings.word_embeddings`` (a ``_no_split_modules`` unit) to ``cls.predictions.decoder``
    (in the root). The innermost unit involved is given up, so its modules are sharded with the
    enclosing unit (the root, here) together with the other side of the tie; repeated until no
    tie is split. The cost is that unit's parameters staying gathered with the root's.
    """
    kept = list(units)
    lookup = dict(model.named_modules(remove_duplicate=False))
    while split := _split_ties(model, kept):
        kept = [u for u in kept if u is not lookup[split[0][1]]]
    return kept


def refuse_split_ties(model: nn.Module, units: Sequence[nn.Module], option: str = "shard_modules") -> None:
    """Refuse user-named units that split a tied parameter (before any collective runs), naming both modules and the fix."""
    split = _split_ties(model, units)
    if not split:
        return
    pairs, innermost = split[0]
    (first, first_unit), (second, second_unit) = next(
        (a, b) for i, a in enumerate(pairs) for b in pairs[i + 1 :] if a[1] != b[1]
    )

    def where(unit: str) -> str:
        return "the root" if not unit else f"unit {unit!r}"

    def module_of(name: str) -> str:
        return name.rpartition(".")[0] or "<root>"

    lookup = dict(model.named_modules(remove_duplicate=False))
    raise ValueError(
        f"{option} splits a tied parameter across sharding units: {module_of(first)!r} "
        f"({type(lookup.get(module_of(first), model)).__name__}, in {where(first_unit)}) and {module_of(second)!r} "
        f"({type(lookup.get(module_of(second), model)).__name__}, in {where(second_unit)}) share {first!r} "
        f"(= {second!r}). One parameter cannot belong to two units (torch's FSDP2 fails at the first forward). "
        f"Fix: drop {innermost!r} ({type(lookup[innermost]).__name__}) from {option}, so the tied parameter is "
        f"sharded with the unit that encloses both; or name a module that contains both; or untie the weights."
        + (f" {len(split) - 1} more tied parameter(s) are split the same way." if len(split) > 1 else "")
    )


#: Embeddings / the output head become units of their own when they hold at least this share of
#: a block's parameter bytes (the median block); below it they stay in the root, where they cost little.
SIDE_UNIT_RATIO = 0.5


def _bytes(modules: Iterable[nn.Module]) -> int:
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def side_units(model: nn.Module, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The embeddings and the output head (with the final norms) as units, when they are large.

    The root of a model whose blocks are units keeps every other parameter gathered from the
    first forward to the end of backward, with full-size gradients: for an LLM's embedding and
    head (vocabulary x width each) that is most of the memory a rank holds. So, as torchtitan
    does, outside the blocks:

    * every ``nn.Embedding`` forms one *embeddings unit*, when together they hold at least
      :data:`SIDE_UNIT_RATIO` of the median block's bytes;
    * the ``nn.Linear`` modules and the norms (classes named ``*Norm``) outside the blocks and
      after the last block form one *head unit*, under the same rule for the Linears' bytes.

    Modules sharing a parameter with anything outside their group (tied embeddings and head)
    stay in the root: one parameter cannot belong to two units. Groups are returned in forward
    (registration) order; the head unit is last and is not resharded after forward (backward
    needs it first). Returns [] when the model has no blocks.
    """
    if not blocks:
        return []
    inside = {id(m) for b in blocks for m in b.modules()}
    order = {id(m): i for i, m in enumerate(model.modules())}
    last_block = max(order[id(b)] for b in blocks)
    outside = [m for m in model.modules() if m is not model and id(m) not in inside and not isinstance(m, CONTAINERS)]
    block_bytes = sorted(_bytes([b]) for b in blocks)[len(blocks) // 2]
    embeddings = [m for m in outside if isinstance(m, nn.Embedding)]
    head = [m for m in outside if order[id(m)] > last_block and isinstance(m, nn.Linear)]
    norms = [m for m in outside if order[id(m)] > last_block and type(m).__name__.endswith("Norm") and _has_params(m)]
    owners: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))

    def shares_outside(group: Sequence[nn.Module]) -> bool:
        members = {id(m) for m in group}
        return any(owners[id(p)] - members for m in group for p in m.parameters(recurse=False))

    groups = []
    for group, sized in ((embeddings, embeddings), ([*norms, *head], head)):
        if sized and _bytes(sized) >= SIDE_UNIT_RATIO * block_bytes and not shares_outside(group):
            groups.append(sorted(group, key=lambda m: order[id(m)]))
    return groups


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"


def zero_units_warning(model: nn.Module, world_size: int) -> str:
    """What a plan without sharding units costs, and how to name the blocks (the setup warning)."""
    total = _bytes([model])
    candidates: dict[str, list[int]] = {}  # class -> [count, parameters]
    for module in model.modules():
        if module is model or isinstance(module, CONTAINERS) or not _has_submodules_with_params(module):
            continue
        entry = candidates.setdefault(user_class(module).__name__, [0, 0])
        entry[0] += 1
        entry[1] += sum(p.numel() for p in module.parameters())
    # Blocks are parts of the model: classes holding well under all of it, the most numerous first.
    total_numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    parts = [c for c in candidates if candidates[c][1] < 0.9 * total_numel * candidates[c][0]]
    ranked = sorted(parts, key=lambda c: (-candidates[c][0], -candidates[c][1]))[:3]
    example = ranked[0] if ranked else "MyBlock"
    return (
        f"{user_class(model).__name__} has no sharding units: found no repeated blocks (in nn.ModuleList, nn.Sequential "
        f"or nn.ModuleDict) and no Hugging Face _no_split_modules, so the whole model is one unit. Every rank then "
        f"all-gathers all parameters ({_size(total)}) for the entire forward and backward, so sharding over "
        f"{world_size} ranks saves optimizer and gradient memory only, not parameter memory. Name the blocks: "
        f"HSDPStrategy(shard_modules=[{example!r}]) (a class name, a dotted class path or a module-name glob such "
        f"as 'model.layers.*')" + (f"; submodule classes with layers here: {ranked}." if ranked else ".")
    )


def select_params(model: nn.Module, patterns: Sequence[str] | None, option: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters whose names match any of the glob ``patterns`` (a list of strings); each pattern must match one."""
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
        out += [(n, p) for n, p in hits if not any(p is q for _, q in out)]
    return out
