"""A Fabric training loop on 2 ranks with one fault; ``tests/faults/test_fabric_faults.py`` launches it.

Run as ``python fabric_fault.py OUT --fault KIND --rank R --step S`` (Fabric's launcher starts the
other rank), under ``torchrun --nproc-per-node 2``, or on warm ranks (``tests/faults/harness.py``).
Each rank writes ``OUT/pid.<rank>``; the faulty rank writes ``OUT/fault.json`` just before the fault.

Faults: ``error`` (an exception in the loop on rank R at step S), ``sigkill`` (rank R kills itself),
``none`` (a clean run).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

from hp_lightning.fabric import HSDPStrategy
from tests.helpers import TinyNet, make_dataset
from tests.scripts.fault_train import mark_fault


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault", choices=("none", "error", "sigkill"), default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    launch_rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    (args.out / f"pid.{launch_rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=HSDPStrategy(mesh_shape=[2]))
    fabric.launch()
    fabric.seed_everything(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    data = make_dataset(n=16 * args.steps)
    for step in range(args.steps):
        x, y = data[step * 16 : (step + 1) * 16]
        x, y = x[fabric.global_rank :: 2], y[fabric.global_rank :: 2]
        if fabric.global_rank == args.rank and step == args.step and args.fault != "none":
            mark_fault(args.out, args.fault)
            if args.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"injected fault in the Fabric loop on rank {args.rank} at step {step}")
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.all_reduce(loss.detach())  # a collective of the loop's own, where the peer waits
    (args.out / f"finished.{fabric.global_rank}").write_text(str(args.steps))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
