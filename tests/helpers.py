"""Test helpers: real multi-process runs on gloo, and the small models the tests train.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` real processes, gives each the
environment a launcher would (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK), runs
``fn(*args)`` in each and returns the per-rank results. A failure on any rank kills the rest and
raises with that rank's traceback; a run past ``timeout`` is killed too, so a hang fails the test
instead of stalling the suite.

Ranks are *warm*: they are forked from one forkserver per test session that has already imported
torch, Lightning and hp_lightning (``multiprocessing``'s forkserver with a preload list), so a
rank starts in tens of milliseconds instead of re-importing for seconds. Isolation is the same as
a fresh spawn: every rank is a new process with its own process group, the parent's current
environment and working directory, and nothing it does reaches the next test.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Imported once by the forkserver, so every rank forked from it starts with them loaded. Modules
#: that are not installed are skipped by multiprocessing itself.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "torch.distributed.pipelining", "lightning.pytorch", "lightning.fabric", "torchmetrics", "hp_lightning",
    "hp_lightning.checkpoint", "tests.helpers", "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
]
_context: Any = None


def rank_context() -> Any:
    """The multiprocessing context ranks start from: a forkserver that preloaded :data:`PRELOAD`."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _child(fn: Callable[..., Any], rank: int, world: int, env: dict[str, str], out: str, args: tuple) -> None:
    # The forkserver's own environment and directory are those of the moment it started; a rank
    # gets the test's current ones, as a freshly spawned process would.
    cwd = env.pop("_HP_TEST_CWD", None)
    os.environ.clear()
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    os.environ.setdefault("LOCAL_RANK", str(rank % local_world))
    os.environ["LOCAL_RANK"] = str(rank % local_world)
    os.environ["NODE_RANK"] = str(rank // local_world)
    torch.set_num_threads(1)
    # A rank killed by a signal (a gloo abort, a segfault) leaves every thread's Python stack here for the parent.
    stacks = open(out + ".stacks", "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=stacks, all_threads=True)
    try:
        result = ("ok", fn(*args))
    except BaseException as exc:  # noqa: BLE001 - forwarded to the parent
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception still reports
        payload = pickle.dumps(("error", f"rank {rank}: result not picklable ({exc!r}): {result[1]!r:.2000}"))
    # Written whole or not at all, and before the last barrier: once a peer passes it and leaves,
    # this rank may be ended by a peer's failure or by a fault watchdog still running (os._exit
    # below skips the atexit hook that stops Fabric's), but its result is already on disk.
    with open(out + ".part", "wb") as f:
        f.write(payload)
    os.replace(out + ".part", out)
    if result[0] == "ok":
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                # Leave together: a rank tearing down gloo while a peer still talks aborts the peer.
                dist.barrier()
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the test's own work is done and checked by its result
            print(f"rank {rank}: process-group teardown after a finished test failed: {exc!r}", file=sys.stderr)
    # Leave without interpreter finalization: gloo worker threads can abort it (SIGABRT, "terminate
    # called without an active exception") after the result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if result[0] == "error" else 0)


def _finished(out: str) -> bool:
    """Whether a rank wrote a successful result (it may still be ended afterwards, when a peer leaves first)."""
    try:
        with open(out, "rb") as f:
            return pickle.load(f)[0] == "ok"
    except (OSError, EOFError, pickle.UnpicklingError):
        return False


def _signal_stacks(exitcode: int | None, out: str) -> str:
    """What faulthandler wrote when a rank was ended by a signal other than the harness's own SIGKILL."""
    if exitcode is None or exitcode >= 0 or exitcode == -9:
        return ""
    try:
        with open(out + ".stacks") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\n  its threads when the signal came (faulthandler):\n{text[-6000:]}" if text else ""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240, local_world_size: int | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the list of per-rank results."""
    ctx = rank_context()
    base_env = {
        **os.environ,
        "_HP_TEST_CWD": os.getcwd(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "LOCAL_WORLD_SIZE": str(local_world_size or world_size),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world_size)]
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, base_env, outs[r], args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed: str | None = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                stuck = [r for r, p in enumerate(procs) if p.is_alive()]
                failed = f"timed out after {timeout}s (ranks {stuck} still running; killed)"
                break
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode != 0 and not _finished(outs[r]):
                    failed = f"rank {r} exited with {p.exitcode}"
            if failed:
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, errors = [], []
        for r, path in enumerate(outs):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
                (results if status == "ok" else errors).append(value)
            else:
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}; killed after a peer failed or timed out)"
                              if failed else f"rank {r}: no result (exit code {procs[r].exitcode})")
                errors[-1] += _signal_stacks(procs[r].exitcode, path)
        if failed or errors:
            raise RuntimeError(f"distributed run failed ({failed or 'error'}):\n" + "\n".join(map(str, errors)))
        return results


def _script_main(script: str, args: list[str], log_dir: str) -> int:
    """One rank of :func:`run_script_in_ranks`: ``python script args`` as torchrun would start it, minus the imports."""
    import runpy

    log = os.open(str(Path(log_dir) / f"rank{os.environ['RANK']}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"{Path(script).name} exited with {exc.code!r}") from exc
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def run_script_in_ranks(script: Path, args: list[str], cwd: Path, world: int, timeout: float = 300) -> str:
    """Run an example script on ``world`` warm ranks, launched as torchrun would (``RANK``, ``WORLD_SIZE``, ...).

    The script body is the user's, unchanged; only the start-up differs from ``python script``
    under Lightning's launcher (which ``tests/integration/test_launchers.py`` covers): each rank
    is forked from the session's forkserver with torch and Lightning already imported. Returns
    rank 0's output (stdout and stderr); a failing rank raises with every rank's output tail.
    """
    with tempfile.TemporaryDirectory() as logs:
        try:
            run_distributed(_script_main, world, str(script), list(args), logs, timeout=timeout,
                            env={"_HP_TEST_CWD": str(cwd), "PYTHONUNBUFFERED": "1"})
        except RuntimeError as exc:
            tails = "\n".join(f"--- rank {r}:\n{(Path(logs) / f'rank{r}.log').read_text(errors='replace')[-3000:]}"
                              for r in range(world) if (Path(logs) / f"rank{r}.log").exists())
            raise AssertionError(f"{script.name} {' '.join(args)} failed: {exc}\n{tails}") from None
        return (Path(logs) / "rank0.log").read_text(errors="replace")


# ---------------------------------------------------------------- models used across tests


class Block(nn.Module):
    """A residual MLP block: the repeated unit the strategy shards automatically."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    """Embedding-free regression net: input projection, repeated blocks, head (root params)."""

    def __init__(self, width: int = 16, depth: int = 2, d_in: int = 8, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_dataset(n: int = 64, d_in: int = 8, d_out: int = 4, seed: int = 1234) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole CPU tensor (gathering DTensor shards: a collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().to("cpu", torch.float32).clone()
    return out


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        denom = b[k].abs().max().clamp_min(1e-12)
        worst = max(worst, float((a[k] - b[k]).abs().max() / denom))
    return worst


import lightning.pytorch as pl  # noqa: E402


class RegressionModule(pl.LightningModule):
    """Calls ``self.net(x)`` directly in every step (never ``self.forward``), as user code often does."""

    def __init__(self, width: int = 16, depth: int = 2, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyNet(width=width, depth=depth)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class LossRecorder(pl.Callback):
    """Keeps the (rank-synchronized) logged training loss of every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "train_loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    base = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=False,
    )
    base.update(overrides)
    return base


def loader(dataset, batch_size: int, **kwargs: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, **kwargs)


class OrderedRankSampler(torch.utils.data.DistributedSampler):
    """``DistributedSampler(shuffle=False)`` that reads its rank when iterated, not when built.

    A script's loader is built before Lightning's launcher has started the other ranks; the rank
    is only known once the process group exists. Rank r reads samples r, r+W, r+2W, ...; the
    union of the ranks' b-th batches is samples [b*G, (b+1)*G), the single-process b-th batch.
    """

    def __init__(self, dataset, world: int) -> None:
        super().__init__(dataset, num_replicas=world, rank=0, shuffle=False)

    def __iter__(self):
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        return super().__iter__()


def rank_loader(dataset, global_batch: int, world: int, **kwargs: Any) -> torch.utils.data.DataLoader:
    """This rank's slice of every global batch, in order (Lightning would shuffle a training loader)."""
    sampler = OrderedRankSampler(dataset, world)
    return torch.utils.data.DataLoader(dataset, batch_size=global_batch // world, sampler=sampler, **kwargs)
