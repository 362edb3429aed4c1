"""What the benchmark runs: model shapes, batches, step counts, configurations, targets.

Everything a run measures is fixed here, in two presets: ``FULL`` (``make bench``, sized to
finish in well under 15 minutes on 2 CPU cores) and ``SMOKE`` (about a minute; the smoke test and
``--quick``). A configuration is one way of training the same model on the same data with the
same global batch; :func:`configurations` lists them for a world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

#: Accumulation modes (:mod:`hp_lightning.core.accumulation`); "skip" is every family's default.
SKIP = "skip"
DEFER_ALL_REDUCE = "defer_all_reduce"
#: Sharding plans of the raw FSDP2 loop: hp_lightning's automatic choice for the model (the LLM
#: plan when its embeddings / head are large next to a block, else the blocks plan), the blocks
#: plan (each block a unit, the root keeps embeddings, final norm and head: hp_lightning's
#: default before issue 18 item 3) and the LLM plan (embeddings, each block, final norm + head:
#: units of their own; see benchmarks.trainers).
AUTO_PLAN = "auto"
BLOCKS_PLAN = "blocks"
LLM_PLAN = "llm_units"

#: Configuration families, in the order each round runs them.
RAW = "raw_fsdp2"
HP = "hp_lightning"
MPS = "lightning_mps"
DDP = "lightning_ddp"
FAMILIES = (RAW, HP, MPS, DDP)

FAMILY_LABELS = {
    RAW: "raw FSDP2 loop",
    HP: "hp_lightning",
    MPS: "Lightning ModelParallelStrategy + fully_shard",
    DDP: "Lightning DDPStrategy",
}

#: Target thresholds (printed as PASS/FAIL, never asserted).
MAX_STEP_RATIO_TO_RAW = 1.03
MAX_STATE_RATIO_TO_FORMULA = 1.10
#: "Clearly lower" than ModelParallelStrategy with accumulation: at least this much faster.
MIN_ACCUMULATION_SPEEDUP_OVER_MPS = 1.10


@dataclass(frozen=True)
class ModelShape:
    """A :class:`examples.gpt.GPTConfig`.

    ``vocab_size`` None is the corpus alphabet (96 characters). A larger one gives the model an
    LLM's large embedding and output head; the data still only uses the first 96 ids, which
    changes nothing about the cost of a step (every logit is computed and every row of the
    embedding gets its gradient slot).
    """

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    vocab_size: Optional[int] = None

    @property
    def label(self) -> str:
        return f"L{self.n_layer}-E{self.n_embd}" + (f"-V{self.vocab_size}" if self.vocab_size else "")


@dataclass(frozen=True)
class Configuration:
    """One way of training: a family, its data-parallel mesh and the accumulation window.

    Attributes:
        family: one of :data:`FAMILIES`.
        mesh_shape: ``(W,)`` for FSDP (and for DDP / ModelParallelStrategy), ``(R, S)`` for HSDP.
        accumulate: micro-batches per optimizer step (``accumulate_grad_batches``).
        accumulation_mode: what non-final micro-batches communicate (:data:`SKIP` or
            :data:`DEFER_ALL_REDUCE`); hp_lightning sets it with ``GradientAccumulationSync``, the
            raw loop with ``set_requires_gradient_sync`` / ``set_requires_all_reduce``.
        plan: :data:`AUTO_PLAN` (hp_lightning's choice), :data:`BLOCKS_PLAN` or :data:`LLM_PLAN` (raw loop only).
        divergence_check: hp_lightning's ``divergence_check`` option (``"per_step"``, its default, or
            ``"off"``): what the safety check costs is the ratio of the two.
    """

    family: str
    mesh_shape: tuple[int, ...]
    accumulate: int = 1
    accumulation_mode: str = SKIP
    plan: str = AUTO_PLAN
    divergence_check: str = "per_step"

    @property
    def world_size(self) -> int:
        size = 1
        for dim in self.mesh_shape:
            size *= dim
        return size

    @property
    def is_hsdp(self) -> bool:
        return len(self.mesh_shape) == 2

    @property
    def sharding(self) -> str:
        if self.family == DDP:
            return "DDP"
        return f"HSDP {self.mesh_shape[0]}x{self.mesh_shape[1]}" if self.is_hsdp else f"FSDP {self.mesh_shape[0]}"

    @property
    def name(self) -> str:
        extra = "".join(f", {v}" for v, default in ((self.accumulation_mode, SKIP), (self.plan, AUTO_PLAN)) if v != default)
        if self.divergence_check != "per_step":
            extra += f", divergence_check={self.divergence_check}"
        return f"{self.family}[{self.sharding}, k={self.accumulate}{extra}]"

    def reference(self) -> Configuration:
        """The raw FSDP2 loop every figure of this configuration is divided by (same mesh, k and mode, default plan)."""
        mesh = self.mesh_shape if (self.family in (RAW, HP) and self.is_hsdp) else (self.world_size,)
        return Configuration(RAW, mesh, self.accumulate, self.accumulation_mode)


@dataclass(frozen=True)
class Settings:
    """Sizes and counts of one benchmark run.

    Attributes:
        world_sizes: one multi-process launch per world size.
        model: the GPT timed in every configuration.
        global_batch: sequences per optimizer step, summed over ranks and micro-batches.
        accumulations: accumulation windows to run (1 and 4).
        rounds: interleaved rounds (every configuration once per round, A B C D A B C D ...).
        warmup_steps: optimizer steps per round not timed (first-step allocation, lazy init).
        timed_steps: optimizer steps timed per round.
        measure_steps: optimizer steps of the (untimed) memory and collective measurement pass.
        sweep_shapes: models of the memory sweep (at least 4 sizes; short sequences, so model
            state dominates).
        budget_gib: per-rank memory budget for "the largest model that fits".
        formula_world_sizes: world sizes the memory formula extrapolates to.
        hsdp_shard_size: S of the HSDP mesh (R = world // S); HSDP runs where R >= 2.
        corpus_chars: characters of text to tokenize.
        families: which configuration families run (all four by default).
    """

    world_sizes: tuple[int, ...] = (2, 4)
    model: ModelShape = ModelShape(n_layer=4, n_embd=128, n_head=4, block_size=64)
    global_batch: int = 32
    accumulations: tuple[int, ...] = (1, 4)
    rounds: int = 5
    warmup_steps: int = 2
    timed_steps: int = 8
    measure_steps: int = 3
    sweep_shapes: tuple[ModelShape, ...] = (
        ModelShape(n_layer=4, n_embd=192, n_head=4, block_size=8),
        ModelShape(n_layer=6, n_embd=256, n_head=4, block_size=8),
        ModelShape(n_layer=6, n_embd=384, n_head=6, block_size=8),
        ModelShape(n_layer=8, n_embd=448, n_head=7, block_size=8),
    )
    budget_gib: float = 80.0
    formula_world_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    hsdp_shard_size: int = 2
    corpus_chars: int = 200_000
    families: tuple[str, ...] = field(default=FAMILIES)

    def configurations(self, world_size: int) -> list[Configuration]:
        """Every configuration timed at ``world_size``, in round order."""
        meshes: list[tuple[int, ...]] = [(world_size,)]
        if world_size // self.hsdp_shard_size >= 2 and world_size % self.hsdp_shard_size == 0:
            meshes.append((world_size // self.hsdp_shard_size, self.hsdp_shard_size))
        out = []
        for k in self.accumulations:
            for family in self.families:
                for mesh in meshes if family in (RAW, HP) else meshes[:1]:
                    out.append(Configuration(family, mesh, k))
        return out

    def micro_batch(self, world_size: int, accumulate: int) -> int:
        """Sequences per rank and micro-batch.

        Raises:
            ValueError: when the global batch does not split evenly.
        """
        per_rank, rest = divmod(self.global_batch, world_size * accumulate)
        if rest or per_rank < 1:
            raise ValueError(
                f"global_batch={self.global_batch} must split into world size {world_size} x accumulate "
                f"{accumulate} micro-batches of >= 1 sequence; choose a multiple of {world_size * accumulate}."
            )
        return per_rank


FULL = Settings()

SMOKE = replace(
    FULL,
    model=ModelShape(n_layer=2, n_embd=32, n_head=2, block_size=16),
    world_sizes=(2,),
    global_batch=8,
    rounds=1,
    warmup_steps=1,
    timed_steps=2,
    measure_steps=2,
    sweep_shapes=(
        ModelShape(n_layer=2, n_embd=32, n_head=2, block_size=8),
        ModelShape(n_layer=2, n_embd=48, n_head=2, block_size=8),
        ModelShape(n_layer=3, n_embd=64, n_head=2, block_size=8),
        ModelShape(n_layer=4, n_embd=64, n_head=2, block_size=8),
    ),
    corpus_chars=20_000,
)


def settings_from_dict(data: dict[str, Any]) -> Settings:
    """Rebuild :class:`Settings` from ``dataclasses.asdict`` output (as saved in results.json)."""
    fields = dict(data)
    fields["model"] = ModelShape(**fields["model"])
    fields["sweep_shapes"] = tuple(ModelShape(**shape) for shape in fields["sweep_shapes"])
    for name in ("world_sizes", "accumulations", "formula_world_sizes", "families"):
        fields[name] = tuple(fields[name])
    return Settings(**fields)
