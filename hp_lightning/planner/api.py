"""``hp_lightning.planner.plan``: every candidate simulated, measured against the cluster, ranked."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hp_lightning.core.diagnostics import CollectiveCall
from hp_lightning.planner.candidates import Candidate, Cluster, ModelFacts, Search, Workload, enumerate_candidates, model_facts
from hp_lightning.planner.comms import link_of, step_calls
from hp_lightning.planner.cost import StepTime, step_time
from hp_lightning.planner.memory import USABLE, MemoryEstimate, estimate
from hp_lightning.planner.model import ModelBuildError, ModelSpec, resolve_model
from hp_lightning.planner.report import strategy_yaml
from hp_lightning.planner.simulate import RankRun, simulate_rank, strategy_args_for


class ClusterTooSmall(ValueError):
    """No candidate fits the devices' memory; the message names the smallest cluster that could hold the model.

    ``result`` is the plan that found nothing; ``smallest`` the plan of that cluster (None: none found).
    """

    def __init__(self, message: str, result: PlanResult, smallest: PlanResult | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.smallest = smallest


@dataclass
class Evaluated:
    """One candidate with its simulated ranks, memory, collectives and modelled step time."""

    candidate: Candidate
    runs: list[RankRun] = field(default_factory=list)
    calls: list[CollectiveCall] = field(default_factory=list)  # the worst rank's, one optimizer step
    memory: MemoryEstimate | None = None
    time: StepTime | None = None
    error: str | None = None

    @property
    def worst(self) -> RankRun:
        return max(self.runs, key=lambda r: r.peak_bytes)

    @property
    def tokens_per_second(self) -> float:
        """Global training throughput: tokens of all data-parallel ranks per modelled step second."""
        if self.time is None or not self.runs or self.time.total <= 0:
            return 0.0
        return self.runs[0].tokens * math.prod(self.candidate.mesh_shape) / self.time.total

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.memory.fits

    def link_bytes(self, link: str, cluster: Cluster | None = None) -> int:
        cluster = cluster or self._cluster
        return sum(c.bytes for c in self.calls if link_of(c.ranks, cluster) == link)

    _cluster: Any = None


@dataclass
class PlanResult:
    """The ranked candidates (fitting ones first, highest throughput first) and what the search dropped."""

    spec: ModelSpec
    cluster: Cluster
    workload: Workload
    facts: ModelFacts
    ranked: list[Evaluated]
    pruned: list[str]
    _planned: list[Candidate] = field(default_factory=list, repr=False)  # the candidates in the order plan() took them

    @property
    def best(self) -> Evaluated | None:
        return next((e for e in self.ranked if e.fits), None)

    def with_cluster(self, cluster: Cluster) -> PlanResult:
        """The same candidates ranked, without simulating them again, for a ``cluster`` of the same shape whose links, memory or FLOP rate differ.

        Raises:
            ValueError: ``cluster`` has another number of nodes or devices per node (call :func:`plan` for it).
        """
        if (cluster.nodes, cluster.devices) != (self.cluster.nodes, self.cluster.devices):
            raise ValueError(
                f"with_cluster() re-ranks the same simulation, which was for {self.cluster.nodes} node(s) x {self.cluster.devices} "
                f"device(s); got {cluster.nodes} x {cluster.devices}. Plan that cluster with plan(..., cluster=...)."
            )
        simulated = {_sim_key(e.candidate): e.runs if e.error is None else e.error for e in self.ranked}
        return _ranked(self.spec, cluster, self.workload, self.facts, self._planned or [e.candidate for e in self.ranked], simulated, self.pruned)

    def strategy_args(self, entry: Evaluated | None = None) -> dict[str, Any]:
        """``HSDPStrategy`` init args of ``entry`` (default: the best candidate)."""
        entry = entry or self.best
        if entry is None:
            raise ValueError("No candidate fits; there is no strategy to write. See the ClusterTooSmall message.")
        return strategy_args_for(entry.candidate, self.workload, self.facts, self.spec)

    def strategy_yaml(self, entry: Evaluated | None = None) -> str:
        return strategy_yaml(self.strategy_args(entry), devices=self.cluster.devices, nodes=self.cluster.nodes)

    def find(self, name: str) -> Evaluated:
        """The candidate named ``name`` (as in the table, e.g. ``"HSDP 2x2"``)."""
        for entry in self.ranked:
            if entry.candidate.name == name:
                return entry
        raise KeyError(f"No candidate named {name!r}; names: {[e.candidate.name for e in self.ranked][:12]}")


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with Lightning
        return None
    return tqdm(total=total, desc="simulating plans", unit="plan", file=sys.stderr, leave=False)


def _sim_key(candidate: Candidate) -> Candidate:
    """Candidates that differ only in CPU offload share one simulation (same collectives and shapes)."""
    return Candidate(candidate.mesh_shape, candidate.tp, candidate.pp, candidate.reshard_after_forward, False,
                     candidate.activation_checkpointing, candidate.pipeline_split_points)


def simulate_candidate(spec: ModelSpec, candidate: Candidate, cluster: Cluster, workload: Workload, facts: ModelFacts) -> list[RankRun]:
    """The simulated ranks of one candidate: the first rank of every pipeline stage (rank 0 without PP)."""
    stride = cluster.world_size // candidate.pp
    runs, meta = [], None
    for stage in range(candidate.pp):
        run, meta = simulate_rank(spec, candidate, cluster, workload, facts, stage * stride, stage_input=meta)
        runs.append(run)
    return runs


def facts_of(spec: ModelSpec, cluster: Cluster, tp_plan: Mapping[str, Any] | None = None) -> ModelFacts:
    """What the search needs to know of the model (blocks, TP plan, whether it can be cut into stages), built on meta.

    Raises:
        ModelBuildError: the model cannot be built on the meta device, or has no token vocabulary.
    """
    module = spec.build()
    spec.vocab_size(module)  # refuse a model without token ids before any simulation
    plan_of_tp = dict(tp_plan) if tp_plan else spec.strategy_args.get("tp_plan")
    hf = "hf_config" in spec.init_args or "class_path" in spec.init_args
    pipeline_ok = not hf and callable(getattr(module, "pipeline_loss", None))
    return model_facts(module, plan_of_tp, pipeline_ok=pipeline_ok, max_tp=cluster.devices)


def plan(
    model: Any,
    init_args: Mapping[str, Any] | None = None,
    *,
    cluster: Cluster,
    workload: Workload | None = None,
    search: Search | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    model_class: str | None = None,
    candidates: list[Candidate] | None = None,
    progress: bool = True,
    require_fit: bool = True,
) -> PlanResult:
    """Plan ``model`` on ``cluster``: simulate every candidate, rank them, and say which fits.

    Args:
        model: a class path, class, LightningCLI YAML, Hugging Face config (object, dict or JSON path).
        init_args: the class's arguments.
        cluster / workload / search: the machines, the step (default ``Workload()``), the knobs to vary (default ``Search()``).
        tp_plan: TP plan for models without one (``{"model.blocks.*.attn.qkv_heads": "colwise", ...}``).
        model_class: the model class of a YAML whose ``model:`` has no ``class_path``.
        candidates: plan exactly these (skips the enumeration).
        progress: a progress bar on stderr.
        require_fit: raise :class:`ClusterTooSmall` when nothing fits.

    Raises:
        ModelBuildError: the model cannot be built on the meta device.
        ClusterTooSmall: no candidate fits (with ``require_fit``), naming the smallest cluster that could.
    """
    workload = workload or Workload()
    search = search or Search()
    spec = resolve_model(model, init_args, model_class=model_class)
    facts = facts_of(spec, cluster, tp_plan)
    candidates, pruned = enumerate_candidates(cluster, facts, search) if candidates is None else (candidates, [])
    cache: dict[Candidate, list[RankRun] | str] = {}
    keys = list(dict.fromkeys(_sim_key(c) for c in candidates))
    bar = _progress(len(keys), progress)
    for key in keys:
        try:
            cache[key] = simulate_candidate(spec, key, cluster, workload, facts)
        except ModelBuildError as exc:
            cache[key] = str(exc)
        except RuntimeError as exc:  # torch refused the plan at run time: report it for this candidate, loudly
            cache[key] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:300]}"
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    result = _ranked(spec, cluster, workload, facts, candidates, cache, pruned)
    if require_fit and result.best is None:
        message, smallest = smallest_cluster(result)
        raise ClusterTooSmall(message, result, smallest)
    return result


def _ranked(
    spec: ModelSpec, cluster: Cluster, workload: Workload, facts: ModelFacts, candidates: list[Candidate],
    simulated: Mapping[Candidate, list[RankRun] | str], pruned: list[str],
) -> PlanResult:
    """Each candidate's simulated ranks (or the reason it could not be simulated) scored on ``cluster`` and ranked."""
    evaluated = []
    for candidate in candidates:
        runs = simulated[_sim_key(candidate)]
        entry = Evaluated(candidate, _cluster=cluster)
        if isinstance(runs, str):
            entry.error = runs
        else:
            entry.runs = runs
            run_calls = [(run, step_calls(run, candidate, cluster)) for run in runs]
            scored = [(estimate(run, candidate, cluster), step_time(run, calls, candidate, cluster, workload), calls) for run, calls in run_calls]
            memory, _, _ = max(scored, key=lambda s: s[0].peak)
            _, time, calls = max(scored, key=lambda s: s[1].total)
            entry.memory, entry.time, entry.calls = memory, time, calls
        evaluated.append(entry)
    # Fitting candidates by throughput (TP and PP shrink the data-parallel batch: step time alone would flatter them).
    evaluated.sort(key=lambda e: (e.error is not None, not e.fits, -e.tokens_per_second if e.fits else 0.0, e.memory.peak if e.memory else 0))
    return PlanResult(spec, cluster, workload, facts, evaluated, pruned, list(candidates))


def smallest_cluster(result: PlanResult, max_tries: int = 8) -> tuple[str, PlanResult | None]:
    """Why nothing fits, and the plan of the smallest number of such nodes that holds the model (None: none found).

    Starts from the FSDP scaling of the sharded state (``state / N + transients <= usable``) and
    grows the node count until a simulated FSDP rank (activation checkpointing on) fits.
    """
    cluster = result.cluster
    capacity = USABLE * cluster.device_memory
    runnable = [e for e in result.ranked if e.memory is not None]
    if not runnable:
        errors = "; ".join(sorted({e.error or "" for e in result.ranked})[:3])
        return f"No candidate could be simulated on {cluster.nodes} x {cluster.devices} devices: {errors}", None
    best = min(runnable, key=lambda e: e.memory.peak)  # type: ignore[union-attr]
    mem = best.memory
    assert mem is not None
    state = mem.params + mem.grads + mem.optimizer
    transient = mem.peak - (0 if best.candidate.cpu_offload else state)
    head = (
        f"No candidate fits {cluster.nodes} node(s) x {cluster.devices} device(s) of {cluster.device_memory / 2**30:.1f} GiB: "
        f"the smallest peak is {mem.peak / 2**30:.2f} GiB per rank ({best.candidate.name}), {capacity / 2**30:.2f} GiB usable."
    )
    if transient >= capacity:
        return head + (
            f" Activations and gathered units alone take {transient / 2**30:.2f} GiB per rank, so more devices do not help: "
            f"lower the micro-batch size or sequence length, checkpoint activations, or add tensor parallelism."
        ), None
    sharing = best.candidate.mesh_shape[-1] * best.candidate.tp * best.candidate.pp
    ranks = math.ceil(state * sharing / max(capacity - transient, 1))
    nodes = max(math.ceil(ranks / cluster.devices), cluster.nodes + 1)
    search = Search(reshard_after_forward=(True,), cpu_offload=(False,), activation_checkpointing=(bool(result.facts.block_names),),
                    tp_sizes=(1,), pp_sizes=(1,), hsdp=False)
    for _ in range(max_tries):
        bigger = dataclasses.replace(cluster, nodes=nodes)
        try:
            trial = plan(result.spec, cluster=bigger, workload=result.workload, search=search, progress=False, require_fit=False)
        except ModelBuildError:
            break
        if trial.best is not None:
            return head + (
                f" The smallest cluster of this kind that could hold it is {nodes} node(s) x {cluster.devices} device(s): "
                f"{trial.best.candidate.name} peaks at {trial.best.memory.peak / 2**30:.2f} GiB per rank there (simulated)."  # type: ignore[union-attr]
            ), trial
        nodes = math.ceil(nodes * 1.5)
    return head + f" Even {nodes} node(s) x {cluster.devices} device(s) did not fit in the simulation; lower the batch or add TP.", None
