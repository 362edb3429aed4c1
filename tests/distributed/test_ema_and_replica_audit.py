"""ShardedEMA and the replica audit on real gloo ranks, against a single-process reference.

One 4-rank launch runs every scenario in the same processes, one after another:

* **HSDP 2x2, 20 steps of 2 micro-batches**, ``ShardedEMA(decay=0.9)`` and
  ``replica_check_every=5``: the average after 5 and 20 steps equals the EMA one process computes
  (plain tensor arithmetic) over the same global batches (<= 1e-6 after 5, 1e-5 after 20); the
  EMA's hook issues no collective and reads no tensor into Python on any micro-batch, and each step
  only what it issues without the EMA (the step agreement's one control all-reduce); the audit's
  two collectives (an int64 all-gather over the replicate group, an int32 all-reduce over the
  world) and its one host read appear on steps 5, 10, 15, 20 and on no other; no false alarm; the
  replicas' local shards are bitwise equal at the end. Then ``trainer.validate`` (a new Trainer)
  runs on the average: its loss is the EMA model's loss, and the weights are back afterwards. A
  sharded checkpoint is saved at step 3.
* **Resume on other meshes**: FSDP 4 with CPU offload (full checkpoints) resumes the HSDP step-3
  checkpoint and trains to step 5, saving a full checkpoint at step 4; HSDP 2x2 resumes that full
  file to step 5. Both end with the reference's step-5 average. The two checkpoints hold the
  averages of steps 3 and 4 for an offline reader (``averaged_weights_in``).
* **Pipeline**: PP 2 x FSDP 2, each stage's average equals the EMA of its whole weights; its
  sharded checkpoint resumes on FSDP 4 without a pipeline with both stages' averages.
* **Corruption**: one bit of rank 1's shard of ``net.blocks.0`` flipped after step 1; with
  ``replica_check_every=2`` every rank raises ``ReplicaMismatchError`` at step 2, naming the unit,
  replicate ranks 1 and 3 and the step, before ``ModelCheckpoint`` saves at step 2; with
  ``replica_check_action="warn"`` rank 0 warns at steps 2 and 4 and training finishes.
* **Export**: a tiny Llama (Trainer, HSDP 2x2) with ``ShardedEMA``; ``strategy.save_hf(...,
  ema=True)`` writes the average, which ``from_pretrained`` loads exactly, and the weights are back.
  Its sharded checkpoint (step 3) goes through ``export-hf --ema`` offline (the test process: as it
  is, and consolidated into one file): ``from_pretrained`` loads the same average; a weights-only
  copy asked for ``--ema`` is refused, naming what was looked for.
* **replicate_params under accumulation "every"**: HSDP 2x2 with the input and head layers kept
  whole, the net built on the meta device (``configure_model``: ``to_empty`` gives those layers new
  parameter objects), 5 steps of 2 micro-batches each synced: the audit checks every step and finds
  the replicas equal, the local copies are bitwise equal at the end, and the average is one process's.
* **EP**: FSDP 4 with ``expert_parallel_size=2`` (a mixture-of-experts block): each average has its
  parameter's mesh and placements (the experts' on the EP mesh), equals the EMA of the whole
  weights, and the EMA's hook issues no collective and reads nothing into Python.
* **TP**: FSDP 2 x TP 2 (the blocks' MLPs split colwise/rowwise): the same checks, the blocks'
  averages ``(shard, tp)`` DTensors like their parameters.
* **Fabric**: the same callback object drives a Fabric loop (``attach``, ``update``, ``swapped``),
  equal to one process; ``fabric.save``/``fabric.load`` of ``ema.averages`` round-trips it; the
  audit, checking after every ``optimizer.step()``, finds the replicas equal 3 times.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from tests.helpers import RegressionModule, TinyNet, loader, make_dataset, rank_loader, run_distributed, trainer_kwargs

WORLD = 4
GLOBAL_BATCH = 16
N_SAMPLES = 64
DECAY = 0.9
STEPS = 20
CHECK_EVERY = 5
K = 2  # accumulate_grad_batches of the EMA runs: two micro-batches of 8 per global batch of 16
CONTROL = ("all_reduce", "torch.int32", (0, 1, 2, 3))


class QuietModule(RegressionModule):
    """No per-step logging (its ``sync_dist`` all-reduce is the user's choice, not the step's)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


class ReferenceEMA(Callback):
    """The average as one process computes it, with plain tensors: a copy at the start, then lerp after each step."""

    def __init__(self, snapshots: tuple[int, ...]) -> None:
        self.snapshots, self.at = snapshots, {}

    def on_train_start(self, trainer, pl_module):
        self.ema = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for n, p in pl_module.named_parameters():
            self.ema[n] = DECAY * self.ema[n] + (1 - DECAY) * p.detach()
        if trainer.global_step in self.snapshots:
            self.at[trainer.global_step] = {n: t.clone() for n, t in self.ema.items()}


def full_average(ema: Any) -> dict[str, torch.Tensor]:
    """The average, whole, by parameter name (a collective: every rank gathers)."""
    from torch.distributed.tensor import DTensor

    averages = ema.averages
    out = {}
    for name, p in zip(averages.names, averages.param_groups[0]["params"]):
        t = averages.state[p]["average"]
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


# ---------------------------------------------------------------- what runs on the ranks


class Marks(Callback):
    """Opens a collective bucket and a host-read bucket ``(name, step)`` at the hook it sits in (``step``: the
    optimizer step the batch makes); ``log`` is shared by every ``Marks`` of a run, in the order they fire."""

    def __init__(self, comms: Any, reads: Any, name: str, log: list[tuple[Any, int]]) -> None:
        self.comms, self.reads, self.name, self.journal = comms, reads, name, log

    def _mark(self, label: Any) -> None:
        self.comms.mark(label)
        self.journal.append((label, self.reads.count()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.name == "train":
            self._mark(("train", trainer.global_step + 1))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.name != "train":
            self._mark((self.name, trainer.global_step))

    def on_train_end(self, trainer, pl_module):
        if self.name == "train":
            self._mark(("end", -1))


class Snapshots(Callback):
    def __init__(self, ema: Any, steps: tuple[int, ...]) -> None:
        self.ema, self.steps, self.at = ema, steps, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            self.at[trainer.global_step] = full_average(self.ema)


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` right after optimizer step ``step`` (after the EMA's update), at the window's end."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.saved = step, path, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.saved:  # once: not again after the next window's first micro-batch
            self.saved = True
            trainer.save_checkpoint(self.path)


class FlipBit(Callback):
    """After optimizer step ``step``, flip one bit of ``param``'s local shard on global rank ``rank`` only."""

    def __init__(self, step: int, rank: int, param: str = "net.blocks.0.fc1.weight", bit: int = 12) -> None:
        self.step, self.rank, self.param, self.bit = step, rank, param, bit

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                local = dict(pl_module.named_parameters())[self.param].to_local()
                local.view(torch.int32).view(-1)[0] ^= 1 << self.bit


def _strategy(**kwargs: Any) -> Any:
    from hp_lightning import HSDPStrategy

    return HSDPStrategy(fault_watchdog=False, **kwargs)


def _data(k: int = 1) -> Any:
    from hp_lightning.checkpoint import ResumableLoader

    return ResumableLoader(rank_loader(make_dataset(N_SAMPLES), GLOBAL_BATCH // k, WORLD))


def _summary(calls: list) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(c.kind, str(c.dtype), c.ranks) for c in calls if not c.floating]


def _replicas_bitwise_equal(module: nn.Module) -> bool:
    """Every local shard (and whole replicate parameter) equals its replica's, bit for bit (an all-gather over the replicate group)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    group = module.trainer.strategy.device_mesh["replicate"].get_group()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    mine = torch.cat([t.detach().reshape(-1).view(torch.int32) for t in local])
    copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, mine, group=group)
    return all(torch.equal(c, mine) for c in copies)


def hsdp_ema_and_audit(tmp: Path) -> dict[str, Any]:
    """HSDP 2x2, 20 steps: EMA, audit every 5 steps, a sharded checkpoint at step 3, counted per hook; then validate."""
    from hp_lightning.callbacks import ShardedEMA
    from hp_lightning.core.diagnostics import CollectiveCounter, HostReads

    seed_everything(0)
    model = QuietModule()
    ema = ShardedEMA(decay=DECAY)
    with CollectiveCounter() as comms, HostReads() as reads:
        log: list[tuple[Any, int]] = []
        marks = [Marks(comms, reads, name, log) for name in ("train", "ema", "after")]
        snapshots = Snapshots(ema, (5, STEPS))
        trainer = Trainer(
            devices=WORLD, strategy=_strategy(mesh_shape=[2, 2], replica_check_every=CHECK_EVERY), max_steps=STEPS,
            accumulate_grad_batches=K, callbacks=[marks[0], marks[1], ema, marks[2], snapshots, SaveAt(3, tmp / "hsdp" / "step3.ckpt")],
            limit_val_batches=0, **trainer_kwargs(),
        )
        trainer.fit(model, _data(K))
    buckets = comms.buckets()
    reads_by: dict[Any, list[str]] = {}
    for (label, start), (_, end) in zip(log, [*log[1:], (None, reads.count())]):
        reads_by.setdefault(label, []).extend(f"{site} {kind}" for kind, site in reads.reads[start:end])
    per_step = {
        step: {
            "train": _summary(buckets.get(("train", step), [])),
            "ema": [(c.kind, str(c.dtype)) for c in buckets.get(("ema", step), [])],
            "train_reads": reads_by.get(("train", step), []),
            "ema_reads": reads_by.get(("ema", step), []),
        }
        for step in range(1, STEPS + 1)
    }
    weights = [p.to_local().detach().clone() for p in model.parameters()]
    evaluator = Trainer(devices=WORLD, strategy=_strategy(mesh_shape=[2, 2]), callbacks=[ema], **trainer_kwargs())
    val = evaluator.validate(model, rank_loader(make_dataset(N_SAMPLES), GLOBAL_BATCH, WORLD), verbose=False)
    return {
        "per_step": per_step,
        "snapshots": snapshots.at,
        "audit_reports": list(trainer.strategy._replica_audit.reports),
        "audit_last_good": trainer.strategy._replica_audit.last_good,
        "replicas_equal": _replicas_bitwise_equal(model),
        "val_loss": float(val[0]["val_loss"]),
        "weights_back": all(torch.equal(w, p.to_local()) for w, p in zip(weights, model.parameters())),
        "replicate_ranks": tuple(trainer.strategy._replica_audit.replicate_ranks),
    }


def resume_elsewhere(tmp: Path) -> dict[str, Any]:
    """FSDP 4 with CPU offload resumes the HSDP step-3 sharded checkpoint (full saves); HSDP 2x2 resumes its step-4 full file."""
    from hp_lightning.callbacks import ShardedEMA

    out = {}
    seed_everything(0)
    ema = ShardedEMA(decay=DECAY)
    snapshots = Snapshots(ema, (5,))
    trainer = Trainer(
        devices=WORLD, strategy=_strategy(mesh_shape=[4], state_dict_type="full", cpu_offload=True), max_steps=5,
        accumulate_grad_batches=K, callbacks=[ema, snapshots, SaveAt(4, tmp / "fsdp" / "step4.ckpt")], limit_val_batches=0, **trainer_kwargs(),
    )
    trainer.fit(QuietModule(), _data(K), ckpt_path=str(tmp / "hsdp" / "step3.ckpt"))
    out["fsdp4_from_hsdp_sharded"] = snapshots.at[5]
    seed_everything(0)
    ema = ShardedEMA(decay=DECAY)
    snapshots = Snapshots(ema, (5,))
    trainer = Trainer(devices=WORLD, strategy=_strategy(mesh_shape=[2, 2]), max_steps=5, accumulate_grad_batches=K,
                      callbacks=[ema, snapshots], limit_val_batches=0, **trainer_kwargs())
    trainer.fit(QuietModule(), _data(K), ckpt_path=str(tmp / "fsdp" / "step4.ckpt"))
    out["hsdp_from_fsdp4_full"] = snapshots.at[5]
    out["updates"] = ema.averages.updates
    return out


class InRankEMA(Callback):
    """The average from this rank's whole weights (``full_tensor``: a collective), for layouts one process cannot mirror."""

    @staticmethod
    def _whole(p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()

    def on_train_start(self, trainer, pl_module):
        self.ema = {n: self._whole(p) for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ema = {n: DECAY * self.ema[n] + (1 - DECAY) * self._whole(p) for n, p in pl_module.named_parameters()}


def pipeline(tmp: Path) -> dict[str, Any]:
    """PP 2 x FSDP 2: each stage averages its own parameters; its sharded checkpoint resumes on FSDP 4 (no pipeline)."""
    from hp_lightning.callbacks import ShardedEMA
    from tests.pipeline_models import PipelinedModule

    seed_everything(0)
    ema, mirror = ShardedEMA(decay=DECAY), InRankEMA()
    snapshots = Snapshots(ema, (2,))
    trainer = Trainer(devices=WORLD, strategy=_strategy(mesh_shape=[2], pipeline_parallel_size=2), max_steps=3,
                      callbacks=[ema, mirror, snapshots, SaveAt(2, tmp / "pp" / "step2.ckpt")], limit_val_batches=0, **trainer_kwargs())
    trainer.fit(PipelinedModule(samples=N_SAMPLES))
    out = {"stage": full_average(ema), "mirror": mirror.ema, "step2": snapshots.at[2]}
    seed_everything(0)
    ema = ShardedEMA(decay=DECAY)
    restored = Snapshots(ema, ())
    restored.on_train_start = lambda trainer, pl_module: restored.at.update({"start": full_average(ema)})  # type: ignore[method-assign]
    trainer = Trainer(devices=WORLD, strategy=_strategy(mesh_shape=[4]), max_steps=3, callbacks=[ema, restored],
                      limit_val_batches=0, **trainer_kwargs())
    trainer.fit(PipelinedModule(samples=N_SAMPLES), ckpt_path=str(tmp / "pp" / "step2.ckpt"))
    out["resumed_without_pipeline"] = restored.at["start"]
    return out


def corrupted(tmp: Path) -> dict[str, Any]:
    """A bit flipped in one replica's shard after step 1: raise at the step-2 check (before the step-2 save), or warn and go on."""
    from hp_lightning.core.replica_audit import ReplicaMismatchError

    out: dict[str, Any] = {}
    seed_everything(0)
    trainer = Trainer(
        devices=WORLD, strategy=_strategy(mesh_shape=[2, 2], replica_check_every=2), max_steps=4,
        callbacks=[FlipBit(step=1, rank=1), ModelCheckpoint(dirpath=tmp / "raise", every_n_train_steps=2, save_top_k=-1)],
        limit_val_batches=0, **trainer_kwargs(enable_checkpointing=True),
    )
    try:
        trainer.fit(QuietModule(), _data())
        out["raised"] = None
    except ReplicaMismatchError as exc:
        out["raised"] = str(exc)
    out["saved_after_raise"] = sorted(p.name for p in (tmp / "raise").glob("*")) if (tmp / "raise").exists() else []
    seed_everything(0)
    trainer = Trainer(
        devices=WORLD, strategy=_strategy(mesh_shape=[2, 2], replica_check_every=2, replica_check_action="warn"), max_steps=4,
        callbacks=[FlipBit(step=1, rank=1)], limit_val_batches=0, **trainer_kwargs(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(QuietModule(), _data())
    out["warned"] = [str(w.message) for w in caught if "Replica audit" in str(w.message)]
    out["warn_global_step"] = trainer.global_step
    return out


class LlamaModule(LightningModule):
    """A tiny Hugging Face causal LM under ``self.net`` (exported with ``prefix="net."``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.net = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=0)


def export(tmp: Path) -> dict[str, Any]:
    """A tiny Llama trained 3 steps with ShardedEMA on HSDP 2x2; save_hf(ema=True)."""
    from hp_lightning.callbacks import ShardedEMA

    config_dir = tmp / "llama_config"
    if int(os.environ["RANK"]) == 0:
        llama_config().save_pretrained(config_dir)
    seed_everything(0)
    model = LlamaModule(llama_config())
    ema = ShardedEMA(decay=0.5)
    tokens = torch.randint(0, 64, (3 * 8, 8), generator=torch.Generator().manual_seed(3))
    trainer = Trainer(devices=WORLD, strategy=_strategy(mesh_shape=[2, 2]), max_steps=3, callbacks=[ema, SaveAt(3, tmp / "llama" / "step3.ckpt")],
                      limit_val_batches=0, **trainer_kwargs())
    trainer.fit(model, rank_loader(tokens, 8, WORLD))
    before = [p.to_local().detach().clone() for p in model.parameters()]
    trainer.strategy.save_hf(tmp / "exported", prefix="net.", config=config_dir, ema=True)
    back = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    average = full_average(ema)
    return {"average": average if int(os.environ["RANK"]) == 0 else None, "weights_back": back}


class BuiltOnMeta(QuietModule):
    """QuietModule's net built in ``configure_model`` (on the meta device, materialized after sharding: ``meta_init``),
    from the random state right after ``seed_everything``, as QuietModule builds it."""

    def __init__(self) -> None:
        state = torch.get_rng_state()
        super().__init__()
        del self.net
        self.state = state

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            torch.set_rng_state(self.state)
            self.net = TinyNet(width=16, depth=2)


def replicate_every(tmp: Path) -> dict[str, Any]:
    """HSDP 2x2, replicate_params, accumulation_mode="every", the audit after every step (warn: the run goes on to count).

    The net is built on the meta device: ``to_empty`` hands the replicate parameters new objects, which the
    gradient sync must follow."""
    from torch.distributed.tensor import DTensor

    from hp_lightning.callbacks import ShardedEMA

    seed_everything(0)
    model = BuiltOnMeta()
    ema = ShardedEMA(decay=DECAY)
    snapshots = Snapshots(ema, (5,))
    strategy = _strategy(mesh_shape=[2, 2], replicate_params=["net.inp.*", "net.head.*"], accumulation_mode="every",
                         replica_check_every=1, replica_check_action="warn")
    trainer = Trainer(devices=WORLD, strategy=strategy, max_steps=5, accumulate_grad_batches=K, callbacks=[ema, snapshots],
                      limit_val_batches=0, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a mismatch is read from the audit's reports below
        trainer.fit(model, _data(K))
    return {
        "ema5": snapshots.at[5],
        "whole": sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor)),
        "audit": (strategy._replica_audit.last_good, list(strategy._replica_audit.reports)),
        "replicas_equal": _replicas_bitwise_equal(model),
    }


class MoEBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        from examples.moe import MoE

        self.norm = nn.LayerNorm(width)
        self.moe = MoE(width, 2 * width, 4, top_k=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEModule(QuietModule):
    """TinyNet's input and head around two mixture-of-experts blocks (4 experts each)."""

    def __init__(self) -> None:
        super().__init__()
        self.net.blocks = nn.ModuleList(MoEBlock(16) for _ in range(2))


#: FSDP 2 x TP 2 on TinyNet: each block's MLP split Megatron-style.
TP_PLAN = {"net.blocks.*.fc1": "colwise", "net.blocks.*.fc2": "rowwise"}


def expert_parallel(tmp: Path) -> dict[str, Any]:
    """FSDP 4 with EP 2: the average keeps each parameter's mesh and placements; no collective, no host read in its hook."""
    return _layouts_kept(MoEModule(), mesh_shape=[4], expert_parallel_size=2)


def tensor_parallel(tmp: Path) -> dict[str, Any]:
    """FSDP 2 x TP 2: the same as :func:`expert_parallel`, the blocks' averages 2-D ``(shard, tp)`` DTensors."""
    return _layouts_kept(QuietModule(), mesh_shape=[2], tensor_parallel_size=2, tp_plan=TP_PLAN)


def _layouts_kept(model: nn.Module, **options: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from hp_lightning.callbacks import ShardedEMA
    from hp_lightning.core.diagnostics import CollectiveCounter, HostReads

    seed_everything(0)
    ema, mirror = ShardedEMA(decay=DECAY), InRankEMA()
    with CollectiveCounter() as comms, HostReads() as reads:
        log: list[tuple[Any, int]] = []
        marks = [Marks(comms, reads, name, log) for name in ("train", "ema", "after")]
        trainer = Trainer(devices=WORLD, strategy=_strategy(**options), max_steps=3,
                          callbacks=[marks[0], marks[1], ema, marks[2], mirror], limit_val_batches=0, **trainer_kwargs())
        trainer.fit(model, _data())
    buckets = comms.buckets()
    ema_reads = [label for (label, start), (_, end) in zip(log, [*log[1:], (None, reads.count())]) if label[0] == "ema" and end > start]
    averages = ema.averages
    layouts = {}
    for name, p in zip(averages.names, averages.param_groups[0]["params"]):
        average = averages.state[p]["average"]
        assert isinstance(p, DTensor) and isinstance(average, DTensor), name
        layouts[name] = (
            average.placements == p.placements and average.device_mesh == p.device_mesh and average.to_local().shape == p.to_local().shape,
            tuple(p.device_mesh.mesh_dim_names or ()),
        )
    return {
        "average": full_average(ema),
        "mirror": mirror.ema,
        "layouts": layouts,
        "ema_collectives": [c.kind for label, calls in buckets.items() if isinstance(label, tuple) and label[0] == "ema" for c in calls],
        "ema_reads": ema_reads,
    }


def fabric_loop(tmp: Path) -> dict[str, Any]:
    """Fabric HSDP 2x2: attach, update after each step, evaluate swapped; save and load ``ema.averages``."""
    from lightning.fabric import Fabric

    from hp_lightning.callbacks import ShardedEMA
    from hp_lightning.fabric import HSDPFabricStrategy

    strategy = HSDPFabricStrategy(mesh_shape=[2, 2], fault_watchdog=False, replica_check_every=1)  # the audit after every step
    fabric = Fabric(strategy=strategy, devices=WORLD, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyNet())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema = ShardedEMA(decay=DECAY)
    ema.attach(model)
    x, y = make_dataset(N_SAMPLES).tensors
    rank = fabric.global_rank
    for step in range(3):
        rows = slice(GLOBAL_BATCH * step + 4 * rank, GLOBAL_BATCH * step + 4 * rank + 4)
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    average = full_average(ema)
    probe = x[:8]
    with torch.no_grad():
        with ema.swapped():
            on_average = model(probe).detach().clone()
        on_weights = model(probe).detach().clone()
    fabric.save(tmp / "fabric.ckpt", {"model": model, "optimizer": optimizer, "ema": ema.averages})
    again = ShardedEMA(decay=DECAY)
    again.attach(model)
    fabric.load(tmp / "fabric.ckpt", {"model": model, "optimizer": optimizer, "ema": again.averages})
    out = {
        "average": average,
        "reloaded": full_average(again),
        "reloaded_counters": dict(again.averages.counters, params=None),
        "on_average": on_average,
        "on_weights": on_weights,
        "refused_state_dict": _raises(ema.state_dict),
        "audit": (strategy._replica_audit.last_good, list(strategy._replica_audit.reports)),
    }
    fabric.strategy.teardown()
    return out


def _raises(fn: Any) -> str:
    try:
        fn()
    except TypeError as exc:
        return str(exc)
    return ""


def worker(tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    return {
        "hsdp": hsdp_ema_and_audit(root),
        "resume": resume_elsewhere(root),
        "pipeline": pipeline(root),
        "corrupted": corrupted(root),
        "export": export(root),
        "replicate_every": replicate_every(root),
        "expert_parallel": expert_parallel(root),
        "tensor_parallel": tensor_parallel(root),
        "fabric": fabric_loop(root),
    }


# ---------------------------------------------------------------- the launch and the single-process references


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ema_audit")
    ranks = run_distributed(worker, WORLD, str(tmp), timeout=420)
    return {"ranks": ranks, "tmp": tmp}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One process, the same global batches: the EMA after steps 3, 4, 5, 20 and the step-20 average's validation loss."""
    seed_everything(0)
    model = QuietModule()
    ema = ReferenceEMA((3, 4, 5, STEPS))
    trainer = Trainer(devices=1, max_steps=STEPS, callbacks=[ema], limit_val_batches=0, **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(N_SAMPLES), GLOBAL_BATCH))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ema.at[STEPS][name])
        x, y = make_dataset(N_SAMPLES).tensors
        val_loss = float(nn.functional.mse_loss(model.net(x), y))
    return {"ema": ema.at, "val_loss": val_loss}


@pytest.fixture(scope="module")
def fabric_reference() -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = make_dataset(N_SAMPLES).tensors
    for step in range(3):
        rows = slice(GLOBAL_BATCH * step, GLOBAL_BATCH * (step + 1))
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema = {n: DECAY * ema[n] + (1 - DECAY) * p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        on_weights = model(x[:8]).clone()
        for n, p in model.named_parameters():
            p.copy_(ema[n])
        on_average = model(x[:8]).clone()
    return {"average": ema, "on_average": on_average, "on_weights": on_weights}


# ---------------------------------------------------------------- ShardedEMA


def test_ema_on_hsdp_equals_one_process_after_5_and_20_steps(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        snapshots = result["hsdp"]["snapshots"]
        assert max_diff(snapshots[5], reference["ema"][5]) <= 1e-6, f"rank {rank}: step 5"
        assert max_diff(snapshots[STEPS], reference["ema"][STEPS]) <= 1e-5, f"rank {rank}: step {STEPS}"


def test_ema_update_adds_no_collective_and_no_host_read_to_any_step(launch: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        for step, seen in result["hsdp"]["per_step"].items():
            assert seen["ema"] == [] and seen["ema_reads"] == [], (rank, step, seen)
            if step == 1:
                continue  # FSDP's lazy initialization
            audit = step % CHECK_EVERY == 0
            # The step carries what it carries without the EMA: one control all-reduce (plus the audit on its steps).
            assert seen["train"][0] == CONTROL, (rank, step, seen["train"])
            reads = seen["train_reads"]
            assert len(reads) == 1 + audit and "hp_lightning/core/agreement.py" in reads[0], (rank, step, reads)


def test_validation_runs_on_the_average_and_puts_the_weights_back(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    for result in launch["ranks"]:
        hsdp = result["hsdp"]
        assert abs(hsdp["val_loss"] - reference["val_loss"]) <= 1e-5 * reference["val_loss"], (hsdp["val_loss"], reference["val_loss"])
        assert hsdp["weights_back"]


def test_each_pipeline_stage_averages_its_own_parameters_and_resumes_without_a_pipeline(launch: dict[str, Any]) -> None:
    stages: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(launch["ranks"]):
        pp = result["pipeline"]
        assert pp["stage"].keys() == pp["mirror"].keys() and 0 < len(pp["stage"]), rank
        assert max_diff(pp["stage"], pp["mirror"]) <= 1e-6, rank
        stages.update(pp["step2"])
    for rank, result in enumerate(launch["ranks"]):
        assert max_diff(result["pipeline"]["resumed_without_pipeline"], stages) == 0.0, rank  # both stages' shards, whole


def test_resume_on_another_mesh_continues_the_same_average(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        resumed = result["resume"]
        assert max_diff(resumed["fsdp4_from_hsdp_sharded"], reference["ema"][5]) <= 1e-6, f"rank {rank}: HSDP sharded -> FSDP 4"
        assert max_diff(resumed["hsdp_from_fsdp4_full"], reference["ema"][5]) <= 1e-6, f"rank {rank}: FSDP 4 full -> HSDP"
        assert resumed["updates"] == 5


def test_checkpoints_hold_the_average_for_an_offline_export(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    """What ``export-hf --ema`` would read: the average inside the sharded (step 3) and the full (step 4) checkpoint."""
    from hp_lightning.checkpoint import read_full_file
    from hp_lightning.checkpoint.read import read_sharded
    from hp_lightning.core.ema import averaged_weights_in

    tmp = launch["tmp"]
    sharded = averaged_weights_in(read_sharded(tmp / "hsdp" / "step3.ckpt"))
    full = averaged_weights_in(read_full_file(tmp / "fsdp" / "step4.ckpt"))
    assert max_diff({k: v.float() for k, v in sharded.items()}, reference["ema"][3]) <= 1e-6
    assert max_diff({k: v.float() for k, v in full.items()}, reference["ema"][4]) <= 1e-6
    with pytest.raises(KeyError, match="no ShardedEMA average"):
        averaged_weights_in({"state_dict": {}, "optimizer_states": [{"state": {}}], "callbacks": {}})


def test_save_hf_with_ema_writes_the_average_that_from_pretrained_loads(launch: dict[str, Any]) -> None:
    from transformers import LlamaForCausalLM

    average = launch["ranks"][0]["export"]["average"]
    loaded = LlamaForCausalLM.from_pretrained(launch["tmp"] / "exported")
    params = dict(loaded.named_parameters())
    assert {f"net.{k}" for k in params} == set(average)
    for name, value in params.items():
        assert torch.equal(value.detach(), average[f"net.{name}"]), name
    assert all(result["export"]["weights_back"] for result in launch["ranks"])


def test_export_hf_ema_writes_the_average_of_a_sharded_or_full_checkpoint(launch: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    """``export-hf --ema`` offline (this process, no process group), from the Llama's step-3 checkpoint: sharded and consolidated."""
    from transformers import LlamaForCausalLM

    from hp_lightning.checkpoint import convert
    from hp_lightning.checkpoint.__main__ import main

    tmp = launch["tmp"]
    average = launch["ranks"][0]["export"]["average"]  # trained 3 steps: the step-3 checkpoint's average
    sharded = tmp / "llama" / "step3.ckpt"
    convert.consolidate(sharded, tmp_path / "full.ckpt")
    convert.consolidate(sharded, tmp_path / "weights.ckpt", weights_only=True)
    for source in (sharded, tmp_path / "full.ckpt"):
        out = tmp_path / f"hf_{source.name}"
        assert main(["export-hf", str(source), str(out), "--prefix", "net.", "--config", str(tmp / "llama_config"), "--ema"]) == 0
        assert "the ShardedEMA average of" in capsys.readouterr().out
        params = dict(LlamaForCausalLM.from_pretrained(out).named_parameters())
        assert {f"net.{k}" for k in params} == set(average), source
        for name, value in params.items():
            assert torch.equal(value.detach(), average[f"net.{name}"]), (source, name)
    # The same checkpoint without --ema: the weights, which differ from the average.
    assert main(["export-hf", str(sharded), str(tmp_path / "weights"), "--prefix", "net.", "--config", str(tmp / "llama_config")]) == 0
    weights = dict(LlamaForCausalLM.from_pretrained(tmp_path / "weights").named_parameters())
    assert not all(torch.equal(v.detach(), average[f"net.{k}"]) for k, v in weights.items())
    # No average in it: refused, naming where it was looked for and the fix.
    assert main(["export-hf", str(tmp_path / "weights.ckpt"), str(tmp_path / "refused"), "--prefix", "net.", "--ema"]) == 1
    error = capsys.readouterr().err
    assert "holds no ShardedEMA average" in error and "'hp_lightning_ema'" in error and "drop --ema" in error, error
    assert not (tmp_path / "refused").exists()


def test_replicate_params_stay_bitwise_equal_under_accumulation_every(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    """The replicate parameters' gradient, reduced on each micro-batch, is the sum of reductions only: no rank's own rounding."""
    for rank, result in enumerate(launch["ranks"]):
        run = result["replicate_every"]
        assert run["whole"] == ["net.head.bias", "net.head.weight", "net.inp.bias", "net.inp.weight"], run["whole"]
        assert run["audit"] == (5, []), (rank, run["audit"])
        assert run["replicas_equal"], rank
        assert max_diff(run["ema5"], reference["ema"][5]) <= 1e-6, rank


def test_ema_under_expert_parallelism_keeps_the_layouts_and_adds_no_collective(launch: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        ep = result["expert_parallel"]
        assert all(same for same, _ in ep["layouts"].values()), (rank, ep["layouts"])
        expert_meshes = {mesh for name, (_, mesh) in ep["layouts"].items() if ".experts." in name}
        assert len([n for n in ep["layouts"] if ".experts." in n]) == 4 and all("ep" in mesh for mesh in expert_meshes), ep["layouts"]
        assert max_diff(ep["average"], ep["mirror"]) <= 1e-6, rank
        assert ep["ema_collectives"] == [] and ep["ema_reads"] == [], (rank, ep["ema_collectives"], ep["ema_reads"])


def test_ema_under_tensor_parallelism_keeps_the_2d_layouts_and_adds_no_collective(launch: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        tp = result["tensor_parallel"]
        assert all(same for same, _ in tp["layouts"].values()), (rank, tp["layouts"])
        split = [name for name, (_, mesh) in tp["layouts"].items() if "tp" in mesh]
        assert {f"net.blocks.{i}.{fc}.weight" for i in range(2) for fc in ("fc1", "fc2")} <= set(split), split
        assert not any(name.startswith(("net.inp.", "net.head.")) for name in split), split
        assert max_diff(tp["average"], tp["mirror"]) <= 1e-6, rank
        assert tp["ema_collectives"] == [] and tp["ema_reads"] == [], (rank, tp["ema_collectives"], tp["ema_reads"])


def test_fabric_drives_the_same_callback(launch: dict[str, Any], fabric_reference: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        fabric = result["fabric"]
        assert max_diff(fabric["average"], fabric_reference["average"]) <= 1e-6, rank
        assert max_diff(fabric["reloaded"], fabric["average"]) == 0.0, rank
        assert fabric["reloaded_counters"]["updates"] == 3 and fabric["reloaded_counters"]["steps"] == 3
        assert torch.allclose(fabric["on_average"], fabric_reference["on_average"], rtol=1e-5, atol=1e-6)
        assert torch.allclose(fabric["on_weights"], fabric_reference["on_weights"], rtol=1e-5, atol=1e-6)
        assert "ema.averages" in fabric["refused_state_dict"]
        assert fabric["audit"] == (3, []), fabric["audit"]  # Fabric's optimizer.step() runs the audit too: 3 checks, all equal


# ---------------------------------------------------------------- the replica audit


def test_audit_collectives_and_host_read_only_on_check_steps(launch: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        replicate = result["hsdp"]["replicate_ranks"]
        assert replicate == (rank % 2, rank % 2 + 2)
        for step, seen in result["hsdp"]["per_step"].items():
            if step == 1:
                continue
            audit = [("all_gather", "torch.int64", replicate), CONTROL] if step % CHECK_EVERY == 0 else []
            assert seen["train"] == [CONTROL, *audit], (rank, step, seen["train"])
            if audit:
                assert "hp_lightning/core/replica_audit.py" in seen["train_reads"][1] and seen["train_reads"][1].endswith(" item")


def test_healthy_hsdp_replicas_are_bitwise_equal_and_raise_no_alarm(launch: dict[str, Any]) -> None:
    for result in launch["ranks"]:
        hsdp = result["hsdp"]
        assert hsdp["audit_reports"] == [] and hsdp["audit_last_good"] == STEPS
        assert hsdp["replicas_equal"]


def test_a_flipped_bit_stops_every_rank_at_the_next_check_naming_unit_and_ranks(launch: dict[str, Any]) -> None:
    messages = {result["corrupted"]["raised"] for result in launch["ranks"]}
    assert len(messages) == 1 and None not in messages, messages  # the same error on every rank
    message = messages.pop()
    assert "optimizer step 2" in message and "unit 'net.blocks.0'" in message, message
    assert "replicate ranks 1, 3" in message and "1 sharding unit(s)" in message, message
    assert "no earlier check of this run vouches for any" in message, message
    # ModelCheckpoint would have saved at step 2, right after the optimizer step the check follows.
    assert all(result["corrupted"]["saved_after_raise"] == [] for result in launch["ranks"])


def test_warn_reports_each_check_and_training_goes_on(launch: dict[str, Any]) -> None:
    zero = launch["ranks"][0]["corrupted"]
    assert len(zero["warned"]) == 2 and "step 2" in zero["warned"][0] and "step 4" in zero["warned"][1], zero["warned"]
    assert all(result["corrupted"]["warn_global_step"] == 4 for result in launch["ranks"])
    assert all(result["corrupted"]["warned"] == [] for result in launch["ranks"][1:])  # rank 0 warns, once per check


# ---------------------------------------------------------------- refusals (one process, nothing launched)


def test_audit_without_replicas_is_refused_before_any_process_starts() -> None:
    from hp_lightning import HSDPStrategy

    with pytest.raises(ValueError, match="replicate dim"):
        Trainer(devices=4, accelerator="cpu", strategy=HSDPStrategy(mesh_shape=[4], replica_check_every=10))
    with pytest.raises(ValueError, match="one replica only"):
        Trainer(devices=4, accelerator="cpu", strategy=HSDPStrategy(mesh_shape=[1, 4], replica_check_every=10))
    for bad in ({"replica_check_every": 0}, {"replica_check_every": True}, {"replica_check_action": "ignore"}):
        with pytest.raises(ValueError, match="replica_check"):
            HSDPStrategy(**bad)


def test_sharded_ema_refuses_bad_arguments_and_other_strategies() -> None:
    from hp_lightning.callbacks import ShardedEMA

    for bad in ({"decay": 1.0}, {"decay": -0.1}, {"every_n_steps": 0}, {"start_step": -1}, {"swap_in": ["train"]}, {"dtype": "int8"}):
        with pytest.raises((ValueError, TypeError)):
            ShardedEMA(**bad)
    trainer = Trainer(devices=1, max_steps=1, callbacks=[ShardedEMA()], **trainer_kwargs())
    with pytest.raises(TypeError, match="HSDPStrategy"):
        trainer.fit(QuietModule(), loader(make_dataset(16), 8))
