"""Automatic split points (``pipeline_split_points="auto"``): the model's list of blocks cut into stages of balanced parameter bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

from torch import nn

from hp_lightning.core.checks import AUTO
from hp_lightning.parallel.pipeline.cut import CONTAINERS, enclosing_block, stage_units
from hp_lightning.parallel.pipeline.plan import param_bytes


def find_block_list(model: nn.Module) -> str:
    """The name of the model's list of blocks, where automatic split points may cut.

    The containers of modules with parameters that lie inside no block (never a MoE layer's
    experts); the one holding the most parameter bytes wins (the first on a tie).

    Raises:
        ValueError: a model without such a list (naming the fix: explicit split points).
    """
    no_split = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    best: Optional[tuple[int, str]] = None
    for name, module in model.named_modules():
        if not isinstance(module, CONTAINERS) or len(module._modules) < 2:
            continue
        entries = [child for child in module._modules.values() if child is not None]
        if any(isinstance(child, CONTAINERS) for child in entries) or not any(param_bytes([c]) for c in entries):
            continue
        first = f"{name}.{next(iter(module._modules))}" if name else next(iter(module._modules))
        if enclosing_block(model, first, no_split) is not None:
            continue  # a list inside a block (experts, a block's own sub-layers): not where stages start
        size = param_bytes(entries)
        if best is None or size > best[0]:
            best = (size, name)
    if best is None:
        raise ValueError(
            f"HSDPStrategy(pipeline_split_points='auto') balances stages over the entries of a list of blocks "
            f"(an nn.ModuleList / nn.Sequential / nn.ModuleDict of modules with parameters); {type(model).__name__} has none. "
            f"Name the split points yourself: pipeline_split_points=['<module where stage 1 starts>', ...]."
        )
    return best[1]


def _balanced_bounds(costs: Sequence[int], first: int, last: int, stages: int) -> list[int]:
    """Where stages 1.. start among ``costs`` (one per block): the smallest largest stage, then the evenest.

    Stage 0 also carries ``first`` (what runs before the blocks), the last stage ``last``; every
    stage holds at least one block. Exact (dynamic programming over contiguous cuts): first the
    minimal largest stage ``M``, then, among the cuts whose every stage is at most ``M``, the one
    with the smallest sum of squared stage costs (ties: the earliest cuts). Deterministic.
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (first if stage == 0 else 0) + (last if stage == stages - 1 else 0)

    inf = float("inf")
    # best_max[s][j]: the smallest largest stage putting blocks [0, j) on stages 0..s.
    best_max = [[inf] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best_max[0][j] = cost(0, 0, j)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            best_max[s][j] = min(max(best_max[s - 1][i], cost(s, i, j)) for i in range(s, j))
    limit = best_max[stages - 1][n]
    squares = [[inf] * (n + 1) for _ in range(stages)]
    start: list[list[int]] = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        if cost(0, 0, j) <= limit:
            squares[0][j] = cost(0, 0, j) ** 2
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = cost(s, i, j)
                if c <= limit and squares[s - 1][i] + c * c < squares[s][j]:
                    squares[s][j], start[s][j] = squares[s - 1][i] + c * c, i
    bounds, j = [], n
    for s in range(stages - 1, 0, -1):
        j = start[s][j]
        bounds.append(j)
    return bounds[::-1]


def auto_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points that balance ``num_stages`` stages by parameter bytes (``pipeline_split_points='auto'``).

    Stages start at entries of :func:`find_block_list`; what runs before the list counts on the
    first stage, what runs after it on the last, every stage holds a block. Parameter bytes are
    what memory and all-gathers scale with (compute too, for alike blocks). Reads sizes only, so
    it runs on the meta device and gives the same points on every rank.

    Raises:
        ValueError: a model without a list of blocks, or with fewer blocks than stages, or a cut :func:`stage_units` refuses.
    """
    blocks = find_block_list(model)
    container = model.get_submodule(blocks)
    keys = list(container._modules)
    entries = [f"{blocks}.{key}" if blocks else key for key in keys]
    if len(entries) < num_stages:
        raise ValueError(
            f"HSDPStrategy(pipeline_split_points='auto'): {num_stages} stages (pipeline_parallel_size x pipeline_stages_per_rank) "
            f"need at least one block each, but {blocks or 'the model'!r} holds {len(entries)}. Use fewer stages "
            f"(a smaller pipeline_parallel_size or pipeline_stages_per_rank), or a model with at least {num_stages} blocks."
        )
    if num_stages == 1:
        return []
    units = stage_units(model, entries[1:])  # every entry a cut point: also checks nothing sits on the way
    first_block, last_block = units.index(entries[0]), units.index(entries[-1])
    before = param_bytes([model.get_submodule(u) for u in units[:first_block]])
    after = param_bytes([model.get_submodule(u) for u in units[last_block + 1 :]])
    costs = [param_bytes([model.get_submodule(e)]) for e in entries]
    points = [entries[i] for i in _balanced_bounds(costs, before, after, num_stages)]
    stage_units(model, points)
    return points


def resolve_split_points(model: nn.Module, split_points: Union[str, Sequence[str]], num_stages: int) -> list[str]:
    """The split points to cut at: ``split_points`` as given, or computed for ``"auto"`` (:func:`auto_split_points`)."""
    if split_points == AUTO:
        return auto_split_points(model, num_stages)
    return list(split_points)
