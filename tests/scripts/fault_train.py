"""Train the test model on 2 ranks and inject one fault; the fault matrix launches this script.

Run as ``python fault_train.py OUT --fault KIND --rank R --step S`` (Lightning's subprocess
launcher starts the other rank) or under ``torchrun --nproc-per-node 2 fault_train.py ...``.
Each rank writes ``OUT/pid.<rank>`` first thing; the faulty rank writes
``OUT/fault.json`` (its rank and the wall time) just before the fault, so the test can measure
how long every rank takes to exit after it.

Faults (on rank R at global step S):

* ``training_step`` / ``callback`` / ``data``: an exception in ``training_step``, in a
  callback's ``on_train_batch_end``, or in the dataset, read by a DataLoader worker process;
* ``sigkill`` / ``sigstop``: the process kills (or freezes) itself;
* ``stuck``: an exception, with a non-daemon thread that keeps the process alive afterwards;
* ``nan`` / ``nan_clip``: a NaN written into rank R's gradient shard of ``--param``, caught by
  ``NonFiniteGradients`` or by clipping with ``error_if_nonfinite=True``;
* ``save_kill``: SIGKILL right after rank R wrote its shards of the step-S checkpoint (with
  ``--async-save``: in the background writer thread, while the main thread trains on);
* ``disagree``: rank R runs with a different ``--mesh`` (the others use ``[2]``);
* ``deadlock``: rank R's main thread blocks on a lock it already holds (its watchdog thread
  still beats);
* ``caught``: an exception in rank R's ``training_step`` that the script catches, carrying on
  with other work afterwards;
* ``sleepy``: rank R's main thread sleeps 8 s (run with ``--no-watchdog --train-timeout T``);
* ``junk_ckpt``: every rank resumes from a file of random bytes (a checkpoint error on every rank);
* ``bad_mesh`` / ``bad_backend``: every rank asks for a mesh of 3 ranks, or for NCCL on CPUs
  (configuration errors raised before the process group exists);
* ``sigusr1_job``: SLURM's requeue signal to the whole job (run under the ``slurm`` launcher);
* ``sigterm_rank`` / ``sigterm_job``: SIGTERM (preemption) to rank R alone, or to the whole job
  (its process group: under torchrun the agent too), as a scheduler sends it;
* ``none``: a clean run, then ``validate`` in the same processes (exit code 0 expected).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import hp_lightning  # noqa: F401 - registers the strategy names
from hp_lightning.callbacks.nonfinite import NonFiniteGradients
from hp_lightning.core.gradients import clip_grad_norm_
from tests.faults.guarded import GuardedHSDPStrategy
from tests.helpers import RegressionModule, make_dataset, rank_loader, trainer_kwargs

FAULTS = (
    "none", "training_step", "callback", "data", "sigkill", "sigstop", "stuck", "nan", "nan_clip", "save_kill", "disagree",
    "sigterm_rank", "sigterm_job", "deadlock", "caught", "bad_mesh", "bad_backend", "junk_ckpt", "sleepy", "sigusr1_job",
)
GLOBAL_BATCH = 16


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else _launch_rank()


def _launch_rank() -> int:
    """This process's rank as its launcher set it: torchrun RANK, srun SLURM_PROCID, Lightning LOCAL_RANK."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", 0))))


def mark_fault(out: Path, kind: str) -> None:
    """Record who fails and when, just before failing."""
    record = {"rank": _rank(), "kind": kind, "time": time.time(), "thread": threading.current_thread().name}
    (out / "fault.json").write_text(json.dumps(record))


class FaultyModule(RegressionModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        # The script's options are not hyperparameters: a Namespace (holding a Path) is not among
        # the types torch's safe loading accepts, so a resume would refuse the checkpoint, as
        # plain Lightning would too.
        self.save_hyperparameters(ignore=["args"])
        self.args = args

    def training_step(self, batch, batch_idx):
        a = self.args
        if self.global_rank == a.rank and self.global_step == a.step and a.fault in ("training_step", "stuck", "caught"):
            mark_fault(a.out, a.fault)
            if a.fault == "stuck":
                # Like a metrics uploader or profiler thread: keeps the failed process alive.
                threading.Thread(target=time.sleep, args=(3600,), name="uploader", daemon=False).start()
            raise ValueError(f"injected fault in training_step on rank {a.rank} at step {a.step}")
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        a = self.args
        if a.fault in ("nan", "nan_clip") and self.global_rank == a.rank and self.global_step == a.step:
            grad = dict(self.named_parameters())[a.param].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            mark_fault(a.out, a.fault)
            local.view(-1)[0] = float("nan")  # only this rank's shard

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.args.fault == "nan_clip":
            clip_grad_norm_(self.parameters(), 1.0, error_if_nonfinite=True)


class Injector(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        a = self.args
        if trainer.global_rank != a.rank or trainer.global_step != a.step:
            return
        if a.fault == "sleepy":
            mark_fault(a.out, a.fault)
            time.sleep(8)
        if a.fault == "deadlock":
            mark_fault(a.out, a.fault)
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns: a lock two code paths take in the wrong order
        if a.fault in ("sigkill", "sigstop"):
            mark_fault(a.out, a.fault)
            os.kill(os.getpid(), signal.SIGKILL if a.fault == "sigkill" else signal.SIGSTOP)
        if a.fault == "sigterm_rank":
            mark_fault(a.out, a.fault)
            os.kill(os.getpid(), signal.SIGTERM)
        if a.fault == "sigterm_job":
            mark_fault(a.out, a.fault)
            os.killpg(os.getpgid(0), signal.SIGTERM)
        if a.fault == "sigusr1_job":  # SLURM's requeue warning (#SBATCH --signal=USR1@90)
            mark_fault(a.out, a.fault)
            os.killpg(os.getpgid(0), signal.SIGUSR1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        a = self.args
        if a.fault == "callback" and trainer.global_rank == a.rank and trainer.global_step == a.step:
            mark_fault(a.out, a.fault)
            raise RuntimeError(f"injected fault in a callback on rank {a.rank} at step {a.step}")

    def on_train_end(self, trainer, pl_module):
        self.args.out.joinpath(f"finished.{trainer.global_rank}").write_text(str(trainer.global_step))


class FaultyData(torch.utils.data.Dataset):
    """The test data set; raises when rank R's loader reads a sample of global batch S."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.data = make_dataset(n=128)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        a = self.args
        if a.fault == "data" and index // GLOBAL_BATCH == a.step and _rank() == a.rank:
            mark_fault(a.out, a.fault)
            raise ValueError(f"injected fault in data loading on rank {a.rank}: sample {index} of step {a.step}")
        return self.data[index]


def kill_after_shards_written(args: argparse.Namespace) -> None:
    """Rank R dies right after DCP wrote its shards of the step-S save: no manifest, nothing published."""
    from torch.distributed.checkpoint import filesystem

    def then_die(original):
        def wrapped(*pos, **kw):
            result = original(*pos, **kw)
            if _rank() == args.rank and args.saves_seen == args.step_save_index:
                mark_fault(args.out, "save_kill")
                os.kill(os.getpid(), signal.SIGKILL)
            args.saves_seen += 1
            return result

        return wrapped

    # DCP's shard writer: after this rank's files are on disk, before its write results reach the
    # coordinator (on DCP's background thread under async_save, on the main thread otherwise).
    writer = filesystem._FileSystemWriter
    writer.write_data = then_die(writer.write_data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--param", default="net.blocks.1.fc2.weight")
    parser.add_argument("--mesh", type=int, nargs="+", default=[2], help="mesh shape of the faulty rank (disagree)")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--heartbeat-timeout", type=float, default=120.0)
    parser.add_argument("--exit-grace", type=float, default=30.0)
    parser.add_argument("--no-watchdog", action="store_true")
    parser.add_argument("--save-on-preemption", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--train-timeout", type=float, default=None)
    parser.add_argument("--resume", action="store_true", help="fit(ckpt_path='last') from OUT/ckpts")
    parser.add_argument("--dump", action="store_true", help="rank 0 writes the final parameters to OUT/params.pt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Lightning's launcher sets LOCAL_RANK in the ranks it starts; torchrun sets RANK (one node: the same).
    launch_rank = _launch_rank()
    (args.out / f"pid.{launch_rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    seed_everything(0)

    mesh = [2]
    disagreeing = args.fault == "disagree" and launch_rank == args.rank
    if disagreeing:
        mesh = args.mesh
    if args.fault in ("bad_mesh", "bad_backend"):
        mark_fault(args.out, args.fault)
    strategy = GuardedHSDPStrategy(
        mesh_shape=[3] if args.fault == "bad_mesh" else mesh,
        process_group_backend="nccl" if args.fault == "bad_backend" else None,
        fault_watchdog=not args.no_watchdog,
        heartbeat_timeout=args.heartbeat_timeout,
        failure_exit_grace=args.exit_grace,
        save_on_preemption=args.save_on_preemption,
        async_save=args.async_save,
        resumable_dataloaders=True,  # a resume continues the epoch: compared with a straight run
        train_timeout=args.train_timeout,
    )
    callbacks: list[Callback] = [Injector(args)]
    checkpointing = args.fault == "save_kill" or args.save_on_preemption or args.resume
    if checkpointing and args.fault != "save_kill":
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpts", save_top_k=0))
    if args.fault == "save_kill":
        # Saves at steps 2, 4, ...: kill during the save of step S (the (S/2)-th, counting from 0).
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpts", every_n_train_steps=2, save_top_k=-1))
        args.saves_seen, args.step_save_index = 0, args.step // 2 - 1
        kill_after_shards_written(args)
    if args.fault == "nan":
        callbacks.append(NonFiniteGradients())
    trainer = Trainer(
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        gradient_clip_val=1.0 if args.fault == "nan_clip" else None,
        **trainer_kwargs(enable_checkpointing=checkpointing),
    )
    print(f"rank {launch_rank}: cluster environment {type(trainer.strategy.cluster_environment).__name__}", flush=True)
    # Only the faulty rank reads through a worker process (a spawned worker is a fresh interpreter, seconds of imports).
    workers = 1 if args.fault == "data" and launch_rank == args.rank else 0
    if disagreeing:
        mark_fault(args.out, "disagree")  # the mismatch exists from here on; setup must catch it
    model = FaultyModule(args)
    ckpt_path = "last" if args.resume else None
    if args.fault == "junk_ckpt":
        ckpt_path = args.out / "junk.ckpt"
        if launch_rank == 0:
            ckpt_path.write_bytes(bytes(range(256)) * 12)  # no checkpoint format starts like this
        mark_fault(args.out, args.fault)
    try:
        # A spawned worker: forking a process that runs threads (gloo's, the watchdog's) can deadlock
        # the child on a lock another thread held; this test is about the worker's error, not fork.
        context = {"multiprocessing_context": "spawn"} if workers else {}
        trainer.fit(model, rank_loader(FaultyData(args), GLOBAL_BATCH, 2, num_workers=workers, **context), ckpt_path=ckpt_path)
    except ValueError:
        if args.fault != "caught":
            raise
        print(f"rank {launch_rank}: caught the error, carrying on", flush=True)
        time.sleep(120)  # other work of the script; the others were stopped, so this rank must end too
    if args.dump:
        from tests.helpers import full_params

        params = full_params(model)  # a collective: every rank
        if trainer.global_rank == 0:
            torch.save({"params": params, "global_step": trainer.global_step}, args.out / "params.pt")
    if args.fault == "none":
        # A second Trainer call in the same processes: a second watchdog session.
        trainer.validate(model, rank_loader(make_dataset(n=32), GLOBAL_BATCH, 2), verbose=False)
        (args.out / f"validated.{trainer.global_rank}").write_text("ok")
    # Leave without interpreter finalization, as tests/helpers.py does: under torchrun, gloo's
    # worker threads sometimes abort it (SIGABRT, "terminate called without an active exception",
    # with or without hp_lightning's watchdog), which is not what the fault matrix measures.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
