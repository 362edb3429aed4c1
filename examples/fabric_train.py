"""Train the GPT of ``examples/gpt.py`` with Lightning Fabric and HSDP: your loop, hp_lightning's sharding.

    # FSDP over 2 CPU processes, 40 steps (Fabric launches the second process)
    python examples/fabric_train.py --devices 2 --steps 40
    # HSDP 2x2 on 4 processes, resuming that run's sharded checkpoint (it reshards on load)
    python examples/fabric_train.py --devices 4 --mesh-shape 2 2 --steps 80 --resume runs/fabric/fabric.ckpt

What the script shows, in order: ``Fabric(strategy=HSDPStrategy(...))`` and ``fabric.launch()``;
the model built on the meta device under ``fabric.init_module(empty_init=True)`` (nothing is
allocated until it is sharded); ``fabric.setup(model, optimizer, scheduler=...)`` with an
optimizer created on the meta parameters (setup points it at the sharded ones); gradient
accumulation under ``fabric.no_backward_sync`` (no gradient traffic on non-final micro-batches);
``fabric.clip_gradients`` over the sharded gradients; ``fabric.all_reduce`` for the logged loss;
``fabric.save`` / ``fabric.load`` of model, optimizer, scheduler and step.

The module is ``GPTLightningModule``, the same one ``examples/train.py`` trains with the Trainer,
and the state holds its ``hyper_parameters``: a ``--state-dict-type full`` checkpoint of this
script loads with ``GPTLightningModule.load_from_checkpoint`` (``examples/sample.py``), and a
sharded one resumes under ``Trainer(strategy="hsdp")`` too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/fabric_train.py` from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from examples.gpt import CharDataModule, GPTLightningModule, decode, encode  # noqa: E402
from hp_lightning.fabric import HSDPStrategy  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=40, help="train until this optimizer step (default 40)")
    run.add_argument("--devices", type=int, default=2, help="processes (devices) per node (default 2)")
    run.add_argument("--num-nodes", type=int, default=1)
    run.add_argument("--accelerator", default="auto", help="cpu, cuda, npu or auto (default)")
    run.add_argument("--precision", default="32-true", help="32-true (default), bf16-mixed or bf16-true")
    run.add_argument("--mesh-shape", type=int, nargs="+", default=None, help="[N] FSDP or [R S] HSDP (default: nodes x devices)")
    run.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    run.add_argument("--accumulation-mode", default="skip", choices=["skip", "every", "defer_all_reduce"])
    run.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    run.add_argument("--eval-every", type=int, default=20, help="validate every N steps and at the end (0: never)")
    run.add_argument("--out", type=Path, default=Path("runs/fabric"), help="output folder (default runs/fabric)")
    run.add_argument("--state-dict-type", default="sharded", choices=["sharded", "full"])
    run.add_argument("--resume", type=Path, default=None, help="a checkpoint of this script (or of the Trainer) to continue")
    run.add_argument("--seed", type=int, default=1234)
    model = parser.add_argument_group("model and data (small defaults: seconds per step on a CPU)")
    model.add_argument("--block-size", type=int, default=64)
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument("--batch-size", type=int, default=8, help="windows per micro-batch and rank")
    model.add_argument("--lr", type=float, default=3e-3)
    model.add_argument("--warmup-steps", type=int, default=10)
    model.add_argument("--max-chars", type=int, default=300_000)
    model.add_argument("--val-windows", type=int, default=64)
    return parser.parse_args(argv)


def make_optimizer(module: GPTLightningModule) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (built on the meta parameters: setup rebinds them)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": module.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=module.hparams.learning_rate,
        betas=(0.9, 0.95),
    )


def make_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then a cosine decay to 10 % of the peak at ``total`` steps."""
    warmup = max(min(warmup, total), 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def batches(loader: DataLoader) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless batches, epoch after epoch (Fabric's loader reshuffles its DistributedSampler each epoch)."""
    while True:
        yield from loader


@torch.no_grad()
def evaluate(fabric: Fabric, model: torch.nn.Module, loader: DataLoader) -> float:
    """Mean validation loss over every window of every rank."""
    model.eval()
    total, count = torch.zeros((), device=fabric.device), torch.zeros((), device=fabric.device)
    for x, y in loader:
        total += next_token_loss(model(x), y) * x.shape[0]
        count += x.shape[0]
    model.train()
    # A forward without backward leaves the root's parameters gathered: free them for training.
    fabric.strategy.reshard_all()
    return float(fabric.all_reduce(total, reduce_op="sum") / fabric.all_reduce(count, reduce_op="sum"))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    strategy = HSDPStrategy(
        mesh_shape=args.mesh_shape, accumulation_mode=args.accumulation_mode, state_dict_type=args.state_dict_type
    )
    fabric = Fabric(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, precision=args.precision
    )
    fabric.launch()  # with --devices > 1 this starts the other processes, which run this script too
    fabric.seed_everything(args.seed)

    data = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, max_chars=args.max_chars, val_windows=args.val_windows)
    data.setup("fit")
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(data.train_set, batch_size=args.batch_size, shuffle=True, drop_last=True),
        DataLoader(data.val_set, batch_size=args.batch_size),
    )

    module = GPTLightningModule(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
        learning_rate=args.lr, warmup_steps=args.warmup_steps,
    )
    # The GPT itself on the meta device (as the Trainer builds it: in configure_model): no rank
    # allocates the whole model; fabric.setup allocates and initializes only the local shards.
    with fabric.init_module(empty_init=True):
        module.configure_model()
    optimizer = make_optimizer(module)
    scheduler = make_scheduler(optimizer, args.warmup_steps, args.steps)
    model, optimizer = fabric.setup(module, optimizer)
    fabric.print(f"{module.describe()}\n{fabric.strategy!r} on {fabric.world_size} processes, precision {args.precision}")

    state: dict[str, Any] = {
        "model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0,
        "hyper_parameters": dict(module.hparams),  # lets GPTLightningModule.load_from_checkpoint rebuild it
    }
    if args.resume is not None:
        fabric.load(args.resume, state)
        fabric.print(f"Resumed {args.resume} at step {state['step']}")
    start_step = state["step"]

    losses: list[tuple[int, float]] = []
    val_losses: list[tuple[int, float]] = []
    stream = batches(train_loader)
    # A resumed run continues the data where the saved run stopped: skip the micro-batches it
    # consumed (the loader's epochs, and so its shuffles, come in the same order again).
    for _ in range(start_step * args.accumulate):
        next(stream)
    while state["step"] < args.steps:
        step_loss = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            x, y = next(stream)
            # Non-final micro-batches: gradients stay local (accumulation_mode decides what is sent).
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = next_token_loss(model(x), y) / args.accumulate
                fabric.backward(loss)
            step_loss += loss.detach()
        if args.clip > 0:
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        step, last = state["step"], state["step"] == args.steps
        mean_loss = float(fabric.all_reduce(step_loss, reduce_op="mean"))
        losses.append((step, mean_loss))
        if step % 10 == 0 or last or step == start_step + 1:
            fabric.print(f"step {step:4d}   train_loss {mean_loss:.3f}   lr {scheduler.get_last_lr()[0]:.2e}")
        if args.eval_every and (step % args.eval_every == 0 or last):
            val_losses.append((step, evaluate(fabric, model, val_loader)))
            fabric.print(f"step {step:4d}   val_loss {val_losses[-1][1]:.3f}")

    out: Path = args.out.resolve()
    checkpoint = out / "fabric.ckpt"
    fabric.save(checkpoint, state)  # every rank: a directory of shards, or one file rank 0 writes
    # generate() runs the sharded model, so every rank takes part; rank 0 prints.
    torch.manual_seed(0)
    prompt = encode("def ").unsqueeze(0).to(fabric.device)
    text = decode(model.generate(prompt, max_new_tokens=60, temperature=0.8, top_k=20)[0])
    fabric.strategy.reshard_all()
    summary: dict[str, Any] = {
        "start_step": start_step,
        "end_step": state["step"],
        "mesh": list(fabric.strategy.device_mesh.shape),
        "world_size": fabric.world_size,
        "losses": losses,
        "val_loss": val_losses,
        "checkpoint": str(checkpoint),
        "sample": text,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    if fabric.is_global_zero:
        (out / "fabric_summary.json").write_text(json.dumps(summary, indent=2))
        print(f"Saved {checkpoint} ({args.state_dict_type}). Sample:\n{text}\nDone in {summary['wall_seconds']:.0f} s.")
    fabric.barrier()
    return summary


if __name__ == "__main__":
    main()
