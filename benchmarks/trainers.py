"""The four ways of training the same GPT: raw FSDP2 loop, hp_lightning, ModelParallelStrategy, DDP.

Every configuration trains :class:`examples.gpt.GPT` on the same windows of text, in the same
order (a non-shuffling ``DistributedSampler`` over the world), with the same global batch,
AdamW settings and learning-rate schedule. The raw loop uses the plan hp_lightning chooses
automatically for the model (:func:`resolve_plan`): each block one unit and, when the embeddings
and head are large next to a block (LLM-shaped), those as units too; else the root keeps them
gathered between forward and backward; one unit of explicit prefetch. So differences between the
raw loop and hp_lightning come from the training loop and strategy around the engine, not from a
different plan. ``ModelParallelStrategy`` shards blocks by hand, as its users write it.

Each run returns a :class:`RunRecord`: its step marks and, after the last step, the model and
optimizers (for model-state bytes). All runs share one process group, created once per rank;
Lightning's strategies find it initialized and only build their meshes on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from benchmarks.measure import StepMarks
from benchmarks.settings import AUTO_PLAN, BLOCKS_PLAN, DDP, HP, LLM_PLAN, MPS, RAW, SKIP, Configuration, ModelShape
from examples.gpt import GPT, VOCAB_SIZE, GPTConfig, GPTLightningModule
from hp_lightning import HSDPStrategy
from hp_lightning.callbacks import GradientAccumulationSync
from hp_lightning.core.mesh import dim_names_for

#: Optimizer hyper-parameters shared by every configuration (GPTLightningModule's defaults).
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.1
WARMUP_STEPS = 20


@dataclass
class RunRecord:
    """What one run leaves behind for measurement."""

    marks: StepMarks
    module: nn.Module
    optimizers: list[torch.optim.Optimizer]


def gpt_config(shape: ModelShape) -> GPTConfig:
    return GPTConfig(
        vocab_size=shape.vocab_size or VOCAB_SIZE, block_size=shape.block_size, n_layer=shape.n_layer,
        n_head=shape.n_head, n_embd=shape.n_embd,
    )


def rank_loader(dataset: Dataset, micro_batch: int, world_size: int, rank: int) -> DataLoader:
    """This rank's micro-batches, in the same order under every configuration."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """GPTLightningModule's loss: cross-entropy of every position's next-token prediction."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---------------------------------------------------------------------------- sharding by hand


def shard_by_hand(gpt: GPT, mesh: DeviceMesh) -> None:
    """FSDP2 written by hand, blocks-only: each block a unit, the root keeps the rest (hp_lightning's plan when embeddings and head are small)."""
    blocks = list(gpt.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(gpt, mesh=mesh, reshard_after_forward=False)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def shard_llm_aware(gpt: GPT, mesh: DeviceMesh) -> None:
    """The LLM-aware plan by hand: what hp_lightning's automatic units are for an LLM-shaped GPT.

    Units in forward order: the embeddings (token + position, one unit), each block, then the
    final norm with the head (one unit). The root keeps no parameters, so nothing stays gathered
    for the whole step. The last unit is not resharded after forward: backward needs it first,
    so resharding it would only gather it again at once. Each unit prefetches the next in
    forward and the previous in backward. With a large vocabulary this trades the root's
    gathered embeddings + head (held from the first forward to the last backward, together
    with their full-size gradients) for one of them at a time.
    """
    fully_shard([gpt.tok_emb, gpt.pos_emb], mesh=mesh, reshard_after_forward=True)
    blocks = list(gpt.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard([gpt.ln_f, gpt.head], mesh=mesh, reshard_after_forward=False)
    fully_shard(gpt, mesh=mesh, reshard_after_forward=False)
    # A list unit's modules share one FSDP state: its first module stands for it in prefetch lists.
    order = [gpt.tok_emb, *blocks, gpt.ln_f]
    for i, unit in enumerate(order):
        if i + 1 < len(order):
            unit.set_modules_to_forward_prefetch([order[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([order[i - 1]])


_MESHES: dict[tuple[str, tuple[int, ...]], DeviceMesh] = {}


def data_parallel_mesh(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    """A 1-D (FSDP) or 2-D (HSDP) mesh, built once per shape and reused across rounds."""
    key = (device_type, shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=dim_names_for(shape))
    return _MESHES[key]


def hand_written_optimizer(model: nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW and warm-up + cosine schedule with GPTLightningModule's settings, as a user would write them."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
        betas=(0.9, 0.95),
    )
    warmup = min(WARMUP_STEPS, total_steps)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def run_raw_loop(
    config: Configuration, shape: ModelShape, loader: DataLoader, steps: int, device: torch.device, marks: StepMarks
) -> RunRecord:
    """(a) A training loop on ``torch.distributed.fsdp.fully_shard`` alone: the engine's limit.

    With accumulation, non-final micro-batches run under ``set_requires_gradient_sync(False)``
    (no reduce-scatter until the last one), as hp_lightning does; in ``defer_all_reduce`` mode
    under ``set_requires_all_reduce(False)`` instead (reduce-scatter every micro-batch, all-reduce
    across replicas once), as hp_lightning's ``GradientAccumulationSync("defer_all_reduce")``.
    """
    seed_everything(0, verbose=False)
    with torch.device("meta"):
        model = GPT(gpt_config(shape))
    shard = shard_llm_aware if resolve_plan(shape, config.plan) == LLM_PLAN else shard_by_hand
    shard(model, data_parallel_mesh(device.type, config.mesh_shape))
    model.to_empty(device=device)
    model.init_weights()
    model.train()
    optimizer, scheduler = hand_written_optimizer(model, steps)
    batches = iter(loader)
    k = config.accumulate
    marks.mark()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        marks.note("forward")
        for micro in range(k):
            inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
            if k > 1 and config.accumulation_mode == SKIP:
                model.set_requires_gradient_sync(micro == k - 1)
            elif k > 1:
                model.set_requires_all_reduce(micro == k - 1)
            loss = next_token_loss(model(inputs), targets) / k
            marks.note("backward")
            loss.backward()
        marks.note("optimizer")
        optimizer.step()
        scheduler.step()
        marks.mark()
    return RunRecord(marks, model, [optimizer])


# ---------------------------------------------------------------------------- Lightning


class ManualFSDP2GPT(GPTLightningModule):
    """(c) The GPT module for ``ModelParallelStrategy``: ``fully_shard`` written by hand in ``configure_model``."""

    @override
    def configure_model(self) -> None:
        super().configure_model()
        assert self.model is not None
        if not isinstance(self.model, FSDPModule):
            shard_by_hand(self.model, self.device_mesh["data_parallel"])


class MarkSteps(Callback):
    """Marks the start of training, the phases of each step and the end of every optimizer step."""

    def __init__(self, marks: StepMarks, comm_hook: bool = False) -> None:
        self.marks = marks
        self.comm_hook = comm_hook

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.comm_hook:
            # DDP all-reduces from C++; routing its buckets through the default Python hook makes
            # them visible to CollectiveCounter (measurement pass only, never timed).
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            trainer.strategy.model.register_comm_hook(state=None, hook=allreduce_hook)
        self.marks.mark()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.marks.note("forward")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        self.marks.note("backward")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.marks.note("optimizer")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.marks.mark()


def lightning_strategy(config: Configuration) -> Any:
    """The strategy object of a Lightning configuration."""
    if config.family == HP:
        return HSDPStrategy(mesh_shape=list(config.mesh_shape), divergence_check=config.divergence_check)
    if config.family == MPS:
        return ModelParallelStrategy(data_parallel_size=config.world_size, tensor_parallel_size=1)
    if config.family == DDP:
        return DDPStrategy()
    raise ValueError(f"{config.family!r} is not a Lightning configuration; expected one of {[HP, MPS, DDP]}.")


def run_lightning(
    config: Configuration,
    shape: ModelShape,
    loader: DataLoader,
    steps: int,
    device: torch.device,
    marks: StepMarks,
    extra_callbacks: Optional[Sequence[Callback]] = None,
    num_nodes: int = 1,
) -> RunRecord:
    """(b), (c), (d): ``Trainer.fit`` with the configuration's strategy for ``steps`` optimizer steps.

    ``num_nodes`` > 1: the ranks are spread over that many nodes (``devices`` = world / nodes per
    node), as the launcher's ``NODE_RANK`` / ``LOCAL_RANK`` say. A non-default accumulation mode
    adds ``GradientAccumulationSync(mode)`` (hp_lightning only).
    """
    seed_everything(0, verbose=False)
    module_class = ManualFSDP2GPT if config.family == MPS else GPTLightningModule
    callbacks = list(extra_callbacks or [])
    if config.accumulation_mode != SKIP:
        if config.family != HP:
            raise ValueError(f"accumulation_mode={config.accumulation_mode!r} needs the hp_lightning family; got {config.family!r}.")
        callbacks.append(GradientAccumulationSync(config.accumulation_mode))
    module = module_class(
        vocab_size=shape.vocab_size or VOCAB_SIZE,
        block_size=shape.block_size, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
        learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, warmup_steps=WARMUP_STEPS,
    )
    trainer = Trainer(
        accelerator=device.type,
        devices=config.world_size // num_nodes,
        num_nodes=num_nodes,
        strategy=lightning_strategy(config),
        precision="32-true",
        max_steps=steps,
        accumulate_grad_batches=config.accumulate,
        callbacks=[MarkSteps(marks, comm_hook=config.family == DDP and marks.counter is not None), *callbacks],
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    return RunRecord(marks, module, list(trainer.optimizers))


def run_configuration(
    config: Configuration, shape: ModelShape, loader: DataLoader, steps: int, device: torch.device, marks: StepMarks,
    num_nodes: int = 1,
) -> RunRecord:
    """Train ``config`` for ``steps`` optimizer steps, marking each step's end in ``marks``."""
    if config.family == RAW:
        return run_raw_loop(config, shape, loader, steps, device, marks)
    return run_lightning(config, shape, loader, steps, device, marks, num_nodes=num_nodes)


def largest_unit_bytes(shape: ModelShape) -> dict[str, int]:
    """Unsharded parameter bytes of the model, of its largest sharding unit, and its parameter count.

    Units are the plan's: each block, and the root's own parameters (embeddings, final norm, head).
    """
    with torch.device("meta"):
        model = GPT(gpt_config(shape))
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    block_bytes = [nbytes(block.parameters()) for block in model.blocks]
    in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
    root_bytes = nbytes(p for p in model.parameters() if id(p) not in in_blocks)
    return {
        "model_bytes": nbytes(model.parameters()),
        "largest_unit_bytes": max([root_bytes, *block_bytes]),
        "params": sum(p.numel() for p in model.parameters()),
    }


def resolve_plan(shape: ModelShape, plan: str) -> str:
    """:data:`AUTO_PLAN` as hp_lightning resolves it for this model (its ``side_units`` rule); other plans as given."""
    if plan != AUTO_PLAN:
        return plan
    from hp_lightning.core.units import auto_units, side_units

    with torch.device("meta"):
        model = GPT(gpt_config(shape))
    return LLM_PLAN if side_units(model, auto_units(model)) else BLOCKS_PLAN


def plan_units(shape: ModelShape, plan: str) -> dict[str, object]:
    """Unsharded parameter bytes of each unit of a plan, in forward order, and what stays gathered.

    Returns ``units`` (list of ``(name, bytes)`` in forward order, root excluded), ``root_bytes``
    (the root's own parameters, gathered from the first forward to the end of backward under
    the blocks plan) and ``gathered_bytes``: the most parameter bytes gathered at once with one
    unit of prefetch, i.e. the root's plus the largest pair of consecutive units (the current
    one and the one prefetched). Under the LLM plan the last unit (final norm + head) stays
    gathered from its forward into backward, where backward prefetches the block before it.
    """
    with torch.device("meta"):
        model = GPT(gpt_config(shape))
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    blocks = [(f"blocks.{i}", nbytes(b.parameters())) for i, b in enumerate(model.blocks)]
    if resolve_plan(shape, plan) == LLM_PLAN:
        units = [("tok_emb+pos_emb", nbytes([*model.tok_emb.parameters(), *model.pos_emb.parameters()])), *blocks,
                 ("ln_f+head", nbytes([*model.ln_f.parameters(), *model.head.parameters()]))]
        root = 0
    else:
        units = blocks
        in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
        root = nbytes(p for p in model.parameters() if id(p) not in in_blocks)
    sizes = [b for _, b in units]
    pairs = [a + b for a, b in zip(sizes, sizes[1:])] or sizes
    return {"units": units, "root_bytes": root, "gathered_bytes": root + max(pairs)}
