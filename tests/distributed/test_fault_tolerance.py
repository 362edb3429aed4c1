"""Fault-tolerant HSDP on torchft: real replica groups, a real lighthouse, a real SIGKILL.

Each replica group is its own "job": its own ranks (warm processes from the test forkserver), its
own MASTER_PORT rendezvous and gloo process group, FSDP2 over its own 1-D mesh. The lighthouse runs
in the test process (torchft's LighthouseServer, bound to 127.0.0.1). Everything is loopback and
every wait is bounded: a hang fails the test, it never stalls the suite.

Engine (no Lightning): no-fault parity with plain HSDP 2x2. Lightning (each group a Trainer job with
HSDPStrategy + FaultToleranceCallback): parity with Lightning HSDP 2x2, SIGKILL + heal with
global_step, the LR schedulers (a plateau one included) and the loggers' step agreeing with
torchft's step, and the same with the killed group restarted in place by torchrun.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust core logs every quorum at info level
pytest.importorskip("torchft", reason="fault tolerance needs the 'ft' extra (torchft)")

from tests.helpers import TinyNet, full_params, make_dataset, max_rel_diff, rank_context, run_distributed

GROUP_WORLD = 2
GLOBAL_BATCH = 8  # splits evenly over 1 or 2 participating groups x 2 ranks
LR = 1e-2
FT_TIMEOUT = 30.0  # collectives, commit vote, state transfer (seconds): generous, the machine may be loaded


# ---------------------------------------------------------------- shared model/data recipe


def _build(mesh):
    from hp_lightning import fully_shard

    torch.manual_seed(0)
    model = TinyNet(width=16, depth=2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, optimizer


def _loss(model, indices: list[int]) -> torch.Tensor:
    x, y = make_dataset()[indices]
    return torch.nn.functional.mse_loss(model(x), y)


def _local_state(model, optimizer) -> dict[str, Any]:
    """This rank's shards (params and AdamW moments) as plain tensors, for exact comparison."""
    from hp_lightning.ft import TrainingState

    state = TrainingState(model, [optimizer]).state_dict()
    return pickle.loads(pickle.dumps(state))


# ---------------------------------------------------------------- plain HSDP 2x2 reference


def _hsdp_reference(steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hp_lightning.ft import ParticipantBatches

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, GROUP_WORLD), mesh_dim_names=("replicate", "shard"))
    model, optimizer = _build(mesh)
    batches = ParticipantBatches(len(make_dataset()), GLOBAL_BATCH)
    for step in range(steps):
        optimizer.zero_grad()
        idx = batches.indices(step, participant_rank=rank // GROUP_WORLD, participants=2,
                              group_rank=rank % GROUP_WORLD, group_world_size=GROUP_WORLD)
        _loss(model, idx).backward()
        optimizer.step()
    return {"params": full_params(model)}


# ---------------------------------------------------------------- one rank of one replica group


def _train_until_stopped(ft: Any, step: Any, group_rank: int, out_dir: str, max_steps: int | None,
                         progress_path: Path) -> list[tuple[int, int, bool]]:
    """Steps until ``max_steps`` or the harness's ``stop_at`` file: quorum, this rank's share by participants, ``step(idx)``."""
    from hp_lightning.ft import ParticipantBatches

    batches = ParticipantBatches(len(make_dataset()), GLOBAL_BATCH)
    stop_file = Path(out_dir) / "stop_at"
    history = []
    while True:
        stop_at = max_steps if max_steps is not None else (int(stop_file.read_text()) if stop_file.exists() else None)
        if stop_at is not None and ft.step >= stop_at:
            return history
        p = ft.begin_step()
        idx = batches.indices(p.step, participant_rank=p.rank, participants=p.count, group_rank=group_rank,
                              group_world_size=GROUP_WORLD)
        committed = step(idx)
        history.append((p.step, p.count, committed))
        with open(progress_path, "a") as f:
            f.write(json.dumps({"step": ft.step, "participants": p.count, "committed": committed, "t": time.time()}) + "\n")


def _run_group_rank(body: Any, group: int, group_rank: int, master_port: int, lighthouse: str, out_dir: str,
                    max_steps: int | None, min_replicas: int) -> None:
    """One rank of replica group ``group`` as its own job would start it; ``body``'s result (or error) goes to a file."""
    result_path = Path(out_dir) / f"result_g{group}_r{group_rank}.pkl"
    progress_path = Path(out_dir) / f"progress_g{group}_r{group_rank}.jsonl"
    os.environ.setdefault("RUST_LOG", "warn")
    # The group's store is served by the harness (as torchrun's agent serves it): every rank is a client.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(group_rank), NODE_RANK="0",
                      WORLD_SIZE=str(GROUP_WORLD), LOCAL_RANK=str(group_rank), LOCAL_WORLD_SIZE=str(GROUP_WORLD),
                      OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    try:
        status = ("ok", body(group, group_rank, lighthouse, out_dir, max_steps, min_replicas, progress_path))
    except BaseException as exc:  # noqa: BLE001 - forwarded to the test
        status = ("error", f"group {group} rank {group_rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result_path, "wb") as f:
        pickle.dump(status, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status[0] == "ok" else 1)


def _engine_rank(group: int, group_rank: int, lighthouse: str, out_dir: str, max_steps: int | None,
                min_replicas: int, progress_path: Path) -> dict:
    """One rank of replica group ``group``: train until ``max_steps`` or the harness's stop file."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hp_lightning.ft import FaultTolerance, FaultTolerantHSDP

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (GROUP_WORLD,))
    model, optimizer = _build(mesh)
    config = FaultTolerance(replica_group=group, num_replica_groups=2, min_replicas=min_replicas, lighthouse=lighthouse,
                            quorum_timeout=30.0, timeout=FT_TIMEOUT, connect_timeout=10.0)
    ft = FaultTolerantHSDP(config, model, optimizer)

    def step(idx: list[int]) -> bool:
        _loss(model, idx).backward()
        return ft.commit()

    history = _train_until_stopped(ft, step, group_rank, out_dir, max_steps, progress_path)
    out = {"state": _local_state(model, optimizer), "step": ft.step,
           "batches_committed": ft.manager.batches_committed(), "history": history,
           "full": full_params(model)}
    ft.shutdown()
    dist.barrier()
    return out


def _lightning_rank(group: int, group_rank: int, lighthouse: str, out_dir: str, max_steps: int | None,
                   min_replicas: int, progress_path: Path, kill_after_together: int | None = None) -> dict:
    """One rank of a replica group that is a Lightning job: ``Trainer(strategy=HSDPStrategy(fault_tolerance=...))``.

    Plain ``DataLoader`` (Lightning injects the replica-aware sampler). ``max_steps`` given: a
    ``ModelCheckpoint`` every 2 steps into the shared ``ckpt`` folder. ``max_steps=None``: LR
    schedulers too (``StepLR`` and ``ReduceLROnPlateau``, both per step), a ``CSVLogger`` logging
    every step, progress lines for the harness, and stop at the step the harness writes into
    ``stop_at``. ``accumulate_grad_batches`` is the number in the ``accumulate`` file (default 1);
    progress lines are written at each window's end. ``kill_after_together``: group 1's rank 1
    SIGKILLs itself in the backward of its first step after that many steps committed with group 0
    (torchrun's first attempt, ``tests/scripts/ft_torchrun_group.py``).
    """
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import hp_lightning
    from tests.distributed.test_parity import GLOBAL_BATCH as PARITY_BATCH  # the reference's global batch
    from tests.helpers import RegressionModule, loader, trainer_kwargs

    class ScheduledModule(RegressionModule):
        """StepLR, and ReduceLROnPlateau on a metric that never improves (the same in every group and rank):
        its lr drops every second committed step, its ``last_epoch`` counts the steps it was given."""

        def training_step(self, batch, batch_idx):
            self.log("plateau_metric", 1.0)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.97)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.9, patience=1, min_lr=1e-5)
            return [optimizer], [{"scheduler": step, "interval": "step"},
                                 {"scheduler": plateau, "interval": "step", "monitor": "plateau_metric"}]

    class HarnessLink(Callback):
        """Writes a progress line per step; checks ``global_step`` == torchft's step in every training hook."""

        def __init__(self) -> None:
            self.steps_off: list[tuple[str, int, int, int]] = []  # (hook, global_step, torchft's step, logger's step)
            self.healed_at: list[int] = []
            self.together = 0  # steps committed with the other group

        def _check(self, trainer, hook: str) -> None:
            engine = trainer.strategy.fault_tolerance.ft
            # The step loggers are given: counted after on_train_batch_end, so read at a step's start.
            logger_step = trainer.fit_loop.epoch_loop._batches_that_stepped if hook == "on_train_batch_start" else engine.step
            if not trainer.global_step == engine.step == logger_step:
                self.steps_off.append((hook, trainer.global_step, engine.step, logger_step))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._check(trainer, "on_train_batch_start")
            if trainer.strategy.fault_tolerance.participation.healed:
                self.healed_at.append(trainer.global_step)

        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            self._check(trainer, "on_before_zero_grad")

        def on_before_backward(self, trainer, pl_module, loss):
            self._check(trainer, "on_before_backward")
            kill = (Path(out_dir) / "kill_in_backward").exists() or (
                kill_after_together is not None and self.together >= kill_after_together)
            if (group, group_rank) == (1, 1) and kill and trainer.strategy.fault_tolerance.micro_batch == 0:
                # Mid-step (with accumulation: mid-window), before this group's gradients reach the
                # cross-group all-reduce: the survivor's step cannot commit (certain, not luck).
                os.kill(os.getpid(), signal.SIGKILL)

        def on_after_backward(self, trainer, pl_module):
            self._check(trainer, "on_after_backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._check(trainer, "on_before_optimizer_step")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._check(trainer, "on_train_batch_end")
            ft = trainer.strategy.fault_tolerance
            if ft.micro_batch != accumulate - 1:
                return  # inside the window
            self.together += bool(ft.last_committed) and ft.participation.count == 2
            with open(progress_path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "participants": ft.participation.count,
                                    "committed": ft.last_committed, "position": ft.positions[-1],
                                    "steps_off": self.steps_off[-3:],
                                    "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                                    # the samples this rank trained on (its share of the global batch)
                                    "x0": batch[0][0, 0].item(), "t": time.time()}) + "\n")
            stop_file = Path(out_dir) / "stop_at"
            if stop_file.exists() and trainer.global_step >= int(stop_file.read_text()):
                trainer.should_stop = True

    class CountCrossGroupAllReduces(Callback):
        """Counts torchft's ``Manager.allreduce`` calls (the cross-group average) from the first step on."""

        calls = 0

        def on_train_start(self, trainer, pl_module):
            manager = trainer.strategy.fault_tolerance.ft.manager
            allreduce = manager.allreduce

            def counted(*args, **kwargs):
                CountCrossGroupAllReduces.calls += 1
                return allreduce(*args, **kwargs)

            manager.allreduce = counted

    accumulate_file = Path(out_dir) / "accumulate"
    accumulate = int(accumulate_file.read_text()) if accumulate_file.exists() else 1
    config = {"replica_group": group, "num_replica_groups": 2, "min_replicas": min_replicas, "lighthouse": lighthouse,
              "quorum_timeout": 30.0, "timeout": FT_TIMEOUT, "connect_timeout": 10.0}
    seed_everything(0)
    scheduled = max_steps is None
    model = ScheduledModule() if scheduled else RegressionModule()
    data = loader(make_dataset(), PARITY_BATCH // (2 * GROUP_WORLD))
    resume_file = Path(out_dir) / "resume_from"  # a full restart of every group from one checkpoint
    ckpt_path = resume_file.read_text() if resume_file.exists() else None
    folder = Path(out_dir) / ("ckpt" if ckpt_path is None else "ckpt_resumed")
    link = HarnessLink()
    callbacks = [link] if scheduled else [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1),
                                          CountCrossGroupAllReduces()]
    logging = {"logger": CSVLogger(out_dir, name=f"logs_g{group}"), "log_every_n_steps": 1} if scheduled else {}
    trainer = Trainer(devices=GROUP_WORLD, strategy=hp_lightning.HSDPStrategy(fault_tolerance=config),
                      max_steps=max_steps or 10_000, callbacks=callbacks, accumulate_grad_batches=accumulate,
                      **trainer_kwargs(enable_checkpointing=not scheduled, **logging))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    ft = trainer.strategy.fault_tolerance
    out = {"full": full_params(model), "global_step": trainer.global_step, "ft_step": ft.final_step,
           "state": _local_state(model, trainer.optimizers[0]), "positions": ft.positions,
           "epoch": trainer.current_epoch, "lr": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
           "steps_off": link.steps_off, "healed_at": link.healed_at, "logger_step": trainer.fit_loop.epoch_loop._batches_that_stepped,
           "cross_group_allreduces": CountCrossGroupAllReduces.calls, "units_with_params": _units_with_params(model)}
    return out


def _units_with_params(model: torch.nn.Module) -> int:
    """FSDP2 units that own parameters (each reduce-scatters, then runs its all-reduce hook, once per sync)."""
    from torch.distributed.fsdp import FSDPModule

    owned = 0
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        nested = {id(p) for inner in unit.modules() if inner is not unit and isinstance(inner, FSDPModule) for p in inner.parameters()}
        owned += any(id(p) not in nested for p in unit.parameters())
    return owned


def _fabric_rank(group: int, group_rank: int, lighthouse: str, out_dir: str, max_steps: int | None,
                min_replicas: int, progress_path: Path) -> dict:
    """One rank of a replica group that is a Fabric job: ``HSDPFabricStrategy(fault_tolerance=...)``.

    Each step reads its share by the quorum (``ParticipantBatches``) in two micro-batches, the first
    under ``fabric.no_backward_sync``; ``optimizer.step()`` is the commit vote. ``max_steps`` given:
    ``fabric.save`` at the end into the shared folder (the writing group only), then ``fabric.load``.
    """
    from lightning.fabric import Fabric

    from hp_lightning.fabric import HSDPFabricStrategy

    config = {"replica_group": group, "num_replica_groups": 2, "min_replicas": min_replicas, "lighthouse": lighthouse,
              "quorum_timeout": 30.0, "timeout": FT_TIMEOUT, "connect_timeout": 10.0}
    fabric = Fabric(accelerator="cpu", devices=GROUP_WORLD, strategy=HSDPFabricStrategy(fault_tolerance=config))
    fabric.launch()
    torch.manual_seed(0)
    model = TinyNet(width=16, depth=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    ft = fabric.strategy.fault_tolerance

    def step(idx: list[int]) -> bool:
        half = len(idx) // 2
        with fabric.no_backward_sync(model, enabled=True):
            fabric.backward(_loss(model, idx[:half]) / 2)
        fabric.backward(_loss(model, idx[half:]) / 2)
        return optimizer.step()

    history = _train_until_stopped(ft, step, group_rank, out_dir, max_steps, progress_path)
    out = {"state": _local_state(model.module, optimizer.optimizer), "step": ft.step, "history": history,
           "full": full_params(model.module)}
    if max_steps is not None:
        path = Path(out_dir) / "fabric.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "ft_step": ft.step})
        deadline = time.monotonic() + 60  # the other group writes it (published whole, or not at all)
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rest = fabric.load(path, {"model": model, "optimizer": optimizer})
        out["loaded_step"] = rest["ft_step"]
        out["after_load"] = _local_state(model.module, optimizer.optimizer)
    fabric.strategy.teardown()
    return out


#: The harness's process targets: one rank of a group that runs the engine loop, a Trainer, or Fabric.
_group_rank_main = functools.partial(_run_group_rank, _engine_rank)
_lightning_group_rank_main = functools.partial(_run_group_rank, _lightning_rank)
_fabric_group_rank_main = functools.partial(_run_group_rank, _fabric_rank)


class _Cluster:
    """The harness: a lighthouse here, replica groups as warm processes, bounded waits."""

    def __init__(self, out_dir: Path, min_replicas: int) -> None:
        from hp_lightning.ft import start_lighthouse
        from hp_lightning.ft.lighthouse import reachable_address

        self.out_dir = out_dir
        self.min_replicas = min_replicas
        # Generous: a live group that is slow under load (a 2-core machine shared with other work) must
        # not be left out of a quorum (join) or taken for dead (heartbeat); the survivors' stall after
        # a kill is the heartbeat timeout.
        self.lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=10_000, quorum_tick_ms=10,
                                           heartbeat_timeout_ms=3000)
        # What `python -m hp_lightning.ft lighthouse` prints: the bound host with the port served.
        self.address = reachable_address("127.0.0.1:0", self.lighthouse.address())
        assert self.address.startswith("http://127.0.0.1:") and not self.address.endswith(":0"), self.address
        self.procs: dict[tuple[int, int], Any] = {}
        self.stores: list[Any] = []

    def start_group(self, group: int, max_steps: int | None, target: Any = None) -> None:
        import torch.distributed as dist

        ctx = rank_context()
        # The group's rendezvous store, bound here on port 0 (no free_port() guess another process
        # could take before the group's rank 0 binds it: EADDRINUSE under load).
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
        self.stores.append(store)
        port = store.port
        for r in range(GROUP_WORLD):
            (self.out_dir / f"result_g{group}_r{r}.pkl").unlink(missing_ok=True)
            (self.out_dir / f"progress_g{group}_r{r}.jsonl").unlink(missing_ok=True)
            proc = ctx.Process(target=target or _group_rank_main, args=(group, r, port, self.address, str(self.out_dir), max_steps,
                                                                  self.min_replicas))
            proc.start()
            self.procs[(group, r)] = proc

    def progress(self, group: int, rank: int = 0) -> list[dict]:
        path = self.out_dir / f"progress_g{group}_r{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, what: str, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for key, proc in self.procs.items():
                if proc.exitcode not in (None, 0, -signal.SIGKILL) and key not in getattr(self, "expected_dead", set()):
                    raise AssertionError(f"{what}: group/rank {key} failed:\n{self.result(*key)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; progress: "
                                     f"{[self.progress(g)[-2:] for g in (0, 1)]}")
            time.sleep(0.05)

    def result(self, group: int, rank: int) -> Any:
        path = self.out_dir / f"result_g{group}_r{rank}.pkl"
        if not path.exists():
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def join_all(self, timeout: float) -> dict[tuple[int, int], Any]:
        deadline = time.monotonic() + timeout
        live = {k: p for k, p in self.procs.items() if k not in getattr(self, "expected_dead", set())}
        for proc in live.values():
            proc.join(max(0.1, deadline - time.monotonic()))
        stuck = [k for k, p in live.items() if p.is_alive()]
        results = {k: self.result(*k) for k in live}
        errors = [v[1] for v in results.values() if v is not None and v[0] == "error"]
        assert not stuck, f"processes {stuck} still running after {timeout}s (hang); errors: {errors}"
        assert not errors, "\n".join(errors)
        return {k: v[1] for k, v in results.items()}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        self.lighthouse.shutdown()


def _assert_bit_identical(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max diff {(a.float() - b.float()).abs().max().item()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bit_identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _both_groups(out_dir: Path, steps: int, target: Any, timeout: float = 180) -> dict[tuple[int, int], Any]:
    """Both replica groups from the start (``min_replicas=2``: no step before both are up) for ``steps`` steps; their results."""
    cluster = _Cluster(out_dir, min_replicas=2)
    try:
        cluster.start_group(0, steps, target)
        cluster.start_group(1, steps, target)
        return cluster.join_all(timeout=timeout)
    finally:
        cluster.close()


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("front_end", ["engine", "fabric"])
def test_no_fault_equals_plain_hsdp_2x2(tmp_path: Path, front_end: str) -> None:
    """2 replica groups x 2 ranks under torchft == plain HSDP on a (2, 2) mesh, same data order.

    Fabric: two micro-batches per step (the first under no_backward_sync), and ``fabric.save`` /
    ``fabric.load`` after the last step, written by the first participant only.
    """
    steps = 4
    reference = run_distributed(_hsdp_reference, 4, steps)[0]["params"]
    # min_replicas=2: no step may run before both groups are up (else the first would train alone).
    results = _both_groups(tmp_path, steps, _group_rank_main if front_end == "engine" else _fabric_group_rank_main, timeout=120)
    if front_end == "fabric":
        # One sharded directory, one shard file per rank of one group (the other group skipped the save).
        assert sorted(p.name for p in (tmp_path / "fabric.ckpt").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for (group, rank), out in results.items():
        assert out["step"] == steps, (group, rank, out["history"])
        assert all(count == 2 and committed for _, count, committed in out["history"]), out["history"]
        if front_end == "engine":
            assert out["batches_committed"] == 2 * steps
        else:
            assert out["loaded_step"] == steps
            _assert_bit_identical(out["after_load"], out["state"], f"g{group}r{rank} loaded")
        diff = max_rel_diff(out["full"], reference)
        assert diff <= 1e-5, f"group {group} rank {rank}: max relative difference to plain HSDP {diff:.3g}"
        # both groups hold exactly the same shards
        _assert_bit_identical(out["state"], results[(1 - group, rank)]["state"], f"g{group}r{rank}")


def _kill_and_heal(tmp_path: Path, target: Any, *, mid_step: bool = False) -> tuple[dict, float, float, int]:
    """Run both groups, SIGKILL group 1's rank 1, check the survivor goes on, restart group 1, stop together.

    ``mid_step``: the victim kills itself in its next ``on_before_backward`` (Lightning targets), so
    the survivor's step at that moment is certainly uncommitted; otherwise the harness kills it.
    """
    cluster = _Cluster(tmp_path, min_replicas=1)
    try:
        cluster.start_group(0, None, target)
        cluster.start_group(1, None, target)
        cluster.wait_for("both groups training together",
                         lambda: any(e["participants"] == 2 and e["step"] >= 3 for e in cluster.progress(1)), 120)
        victim = cluster.procs[(1, 1)]
        cluster.expected_dead = {(1, 0), (1, 1)}
        killed_at = time.time()
        if mid_step:
            (tmp_path / "kill_in_backward").touch()
            victim.join(60)
            assert victim.exitcode == -signal.SIGKILL, f"the victim did not kill itself mid-step: {victim.exitcode}"
            (tmp_path / "kill_in_backward").unlink()
        else:
            os.kill(victim.pid, signal.SIGKILL)
        # The rest of the dead group ends on its own (its collectives fail), within a bound.
        cluster.procs[(1, 0)].join(15)  # well inside the survivors' quorum_timeout (30 s)
        assert not cluster.procs[(1, 0)].is_alive(), "group 1's surviving rank hangs after its peer was killed"
        group_down_s = time.time() - killed_at
        down_step = cluster.progress(0)[-1]["step"]
        cluster.wait_for("group 0 stepping alone",
                         lambda: any(e["participants"] == 1 and e["committed"] and e["step"] >= down_step + 3
                                     for e in cluster.progress(0)), 60)
        survivor_resumed = next(e["t"] for e in cluster.progress(0) if e["t"] > killed_at and e["committed"]
                                and e["participants"] == 1)
        assert cluster.progress(0)[-1]["step"] > down_step, "the survivor did not keep stepping while group 1 was down"

        cluster.expected_dead = set()
        restarted_at = time.time()
        cluster.start_group(1, None, target)
        cluster.wait_for("group 1 healed and stepping with group 0",
                         lambda: any(e["participants"] == 2 and e["committed"] for e in cluster.progress(1)), 120)
        stop_at = max(cluster.progress(0)[-1]["step"], cluster.progress(1)[-1]["step"]) + 4
        tmp = tmp_path / "stop_at.tmp"
        tmp.write_text(str(stop_at))
        tmp.rename(tmp_path / "stop_at")
        results = cluster.join_all(timeout=120)
    finally:
        cluster.close()
    healed_first = next(e["t"] for e in cluster.progress(1) if e["committed"])
    uncommitted = sum(1 for e in cluster.progress(0) if e["committed"] is False)
    print(f"\nkill -> whole group 1 gone: {group_down_s:.2f}s; kill -> survivor's next committed step: {survivor_resumed - killed_at:.2f}s; "
          f"restart -> healed group's first committed step: {healed_first - restarted_at:.2f}s; "
          f"survivor's uncommitted steps: {uncommitted}")
    return results, survivor_resumed - killed_at, healed_first - restarted_at, stop_at


def test_torchrun_restarts_a_killed_group_in_place_and_it_heals_from_the_live_group(tmp_path: Path) -> None:
    """Group 1 a Trainer job under ``torchrun --standalone --max-restarts=1`` (``tests/scripts/ft_torchrun_group.py``):
    its rank 1 SIGKILLs itself mid-step after 3 steps with group 0, which trains on alone at its own full pace;
    torchrun restarts group 1 in place, whose new attempt forms a fresh process group, heals from group 0 (its
    first quorum), and both end bitwise equal at the same step, LR schedulers (plateau included) and the loggers'
    step equal to torchft's. (The engine loop's restart under torchrun: tests/integration/test_launchers.py.)"""
    import shutil
    import subprocess

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun ships with torch and must be on PATH next to the interpreter"
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cluster = _Cluster(tmp_path, min_replicas=1)
    job = None
    try:
        with open(tmp_path / "torchrun.log", "wb") as log:
            job = subprocess.Popen(
                [torchrun, "--standalone", "--nproc-per-node", str(GROUP_WORLD), "--max-restarts", "1",
                 str(root / "tests" / "scripts" / "ft_torchrun_group.py"), str(tmp_path), cluster.address, "trainer"],
                env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
            )
        cluster.start_group(0, None, _lightning_group_rank_main)  # warm processes: train while group 1 starts

        def restarted_and_healed() -> bool:
            if job.poll() is not None:
                raise AssertionError(f"torchrun ended early ({job.returncode}):\n{(tmp_path / 'torchrun.log').read_text()[-4000:]}")
            return any(e["participants"] == 2 and e["committed"] for e in cluster.progress(1))

        cluster.wait_for("group 1 restarted by torchrun, healed and stepping with group 0", restarted_and_healed, 240)
        stop_at = max(cluster.progress(0)[-1]["step"], cluster.progress(1)[-1]["step"]) + 3
        (tmp_path / "stop_at.tmp").write_text(str(stop_at))
        (tmp_path / "stop_at.tmp").rename(tmp_path / "stop_at")
        assert job.wait(timeout=120) == 0, (tmp_path / "torchrun.log").read_text()[-4000:]
        survivors = cluster.join_all(timeout=120)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        cluster.close()
    assert any(e["committed"] is False for e in cluster.progress(0)), "the survivors' step during the kill committed"
    first_attempt = [json.loads(x) for x in (tmp_path / "progress_g1a0_r0.jsonl").read_text().splitlines() if x.strip()]
    restarted_first = cluster.progress(1)[0]
    print(f"\ngroup 1's last step before the kill -> its restarted attempt's first committed step "
          f"{restarted_first['t'] - first_attempt[-1]['t']:.2f}s (survivor's steps meanwhile: "
          f"{restarted_first['step'] - first_attempt[-1]['step']})")
    for rank in range(GROUP_WORLD):
        status, restarted = cluster.result(1, rank)
        assert status == "ok", restarted
        survivor = survivors[(0, rank)]
        assert restarted["attempt"] == 1, "group 1 did not go through torchrun's restart"
        assert restarted["healed_at"] and restarted["healed_at"][0] > 3, restarted["healed_at"]
        for out in (survivor, restarted):
            assert out["global_step"] == out["ft_step"] == out["logger_step"] == stop_at, (out["global_step"], out["ft_step"], out["logger_step"])
            assert out["steps_off"] == [], out["steps_off"]
            _assert_schedulers_followed_committed_steps(out["lr"], stop_at)
        assert survivor["lr"] == restarted["lr"], (survivor["lr"], restarted["lr"])
        _assert_bit_identical(survivor["state"], restarted["state"], f"rank {rank}")
        _assert_bit_identical(survivor["full"], restarted["full"], f"rank {rank} full")
    _assert_logged_steps(tmp_path / "logs_g0", stop_at)


def _assert_schedulers_followed_committed_steps(lr: list[dict], committed: int) -> None:
    """StepLR and ReduceLROnPlateau (both per step) were stepped once per committed step, never for an uncommitted one."""
    step, plateau = lr
    assert step["last_epoch"] == committed and plateau["last_epoch"] == committed, (committed, lr)


def _assert_logged_steps(folder: Path, last: int) -> None:
    """The logger (the survivor's, one run) was given committed steps only: its highest step is the last committed one's.

    Lightning logs each step's metrics under the number of optimizer steps before it (the last step, ``last``,
    under ``last - 1``); an uncommitted step that was counted would push every later step one higher.
    """
    import csv

    files = sorted(folder.glob("version_*/metrics.csv"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert steps and max(steps) == last - 1, (last, steps[-10:])


@pytest.mark.parametrize("front_end", ["fabric"])
def test_sigkill_survivor_keeps_training_and_restarted_group_heals(tmp_path: Path, front_end: str) -> None:
    """Kill one rank of group 1 mid-run: group 0 trains on alone; group 1 restarts, heals, ends identical.
    (The Trainer's restart is torchrun's own: the test above.)"""
    results, _, _, stop_at = _kill_and_heal(tmp_path, _group_rank_main if front_end == "engine" else _fabric_group_rank_main)
    for rank in range(GROUP_WORLD):
        survivor, healed = results[(0, rank)], results[(1, rank)]
        assert survivor["step"] == healed["step"] == stop_at
        assert healed["history"][0][0] > 0, "the restarted group did not start from the quorum's step"
        _assert_bit_identical(survivor["state"], healed["state"], f"rank {rank}")
        _assert_bit_identical(survivor["full"], healed["full"], f"rank {rank} full")


BATCHES_PER_EPOCH = 4  # 64 samples / a global batch of 16 (test_parity's)


def _first_sample(group: int, rank: int, epoch: int, index: int) -> float:
    """x[0] of the first sample of batch ``index`` of ``epoch`` for group ``group``'s rank ``rank``.

    Plain HSDP 2x2's split, by Lightning's injected sampler: ``DistributedSampler(shuffle=True,
    seed=0)`` as rank ``g x 2 + r`` of 4, i.e. every 4th sample of the epoch's permutation, 4 per batch.
    """
    order = torch.randperm(64, generator=torch.Generator().manual_seed(epoch))
    return make_dataset().tensors[0][order[group * GROUP_WORLD + rank + 4 * 4 * index], 0].item()


def test_lightning_sigkill_counters_schedulers_and_data_agree_after_heal(tmp_path: Path) -> None:
    """The same under Lightning with accumulation windows of 2: the kill lands mid-window (the victim's
    first micro-batch); global_step, loop progress, LR scheduler, data position and weights heal."""
    accumulate = 2
    (tmp_path / "accumulate").write_text(str(accumulate))
    results, _, _, stop_at = _kill_and_heal(tmp_path, _lightning_group_rank_main, mid_step=True)
    for rank in range(GROUP_WORLD):
        survivor, healed = results[(0, rank)], results[(1, rank)]
        for out in (survivor, healed):
            # An uncommitted step (the survivor's, when the peer died) is not counted by Lightning.
            # Nor by the LR schedulers (the plateau one included) or the logger's step.
            assert out["global_step"] == out["ft_step"] == out["logger_step"] == stop_at, (out["global_step"], out["ft_step"], out["logger_step"])
            _assert_schedulers_followed_committed_steps(out["lr"], stop_at)
            # ... and in every training hook of every step (the uncommitted and the healing one included).
            assert out["steps_off"] == [], out["steps_off"]
        assert healed["healed_at"] and healed["healed_at"][0] > 0, healed["healed_at"]
        # The survivor may have healed while both groups started up, never from the restarted group.
        assert all(step < healed["healed_at"][0] for step in survivor["healed_at"]), (survivor["healed_at"], healed["healed_at"])
        _assert_bit_identical(survivor["state"], healed["state"], f"rank {rank}")
        _assert_bit_identical(survivor["full"], healed["full"], f"rank {rank} full")
        assert survivor["lr"] == healed["lr"], (survivor["lr"], healed["lr"])
        assert survivor["epoch"] == healed["epoch"] >= 2, (survivor["epoch"], healed["epoch"])
        # The survivor read every batch in order (an uncommitted step's batch is consumed, torchft's semantics).
        positions = [tuple(p) for p in survivor["positions"]]
        for before, after in zip(positions, positions[1:]):
            assert after == ((before[0], before[1] + 1) if before[1] + 1 < BATCHES_PER_EPOCH else (before[0] + 1, 0)), positions
    lines = [json.loads(x) for x in (tmp_path / "progress_g0_r0.jsonl").read_text().splitlines() if x.strip()]
    assert any(line["committed"] is False for line in lines), "the survivor's window during the mid-window kill committed"
    _assert_logged_steps(tmp_path / "logs_g0", stop_at)
    # Every window, committed or not, read exactly `accumulate` batches; each committed one advanced the
    # step by one, an uncommitted one not at all (the survivor's first step may come from a heal at start-up).
    assert len(results[(0, 0)]["positions"]) == accumulate * len(lines), (len(results[(0, 0)]["positions"]), len(lines))
    committed_steps = [line["step"] for line in lines if line["committed"]]
    assert committed_steps == list(range(committed_steps[0], stop_at + 1)), committed_steps
    assert all(line["step"] == before["step"] for before, line in zip(lines, lines[1:]) if not line["committed"]), lines
    progress = {(g, r): _progress_by_step(tmp_path, g, r) for g in (0, 1) for r in range(GROUP_WORLD)}
    for rank in range(GROUP_WORLD):
        survivor, restarted = progress[(0, rank)], progress[(1, rank)]
        together = sorted(set(survivor) & set(restarted))
        healed_at = min(s for s in restarted if restarted[s]["t"] > max(e["t"] for e in survivor.values() if e["participants"] == 1))
        assert restarted[healed_at]["position"] != [0, 0], "the restarted group trained batch 0, not the quorum's"
        assert healed_at in together and len(together) >= 4, (healed_at, together)
        for step in [s for s in together if s >= healed_at]:
            a, b = survivor[step], restarted[step]
            # Same batch of the same epoch, same loop counters; each group its own share of it. (The
            # healing step's hooks get the batch_idx Lightning computed before the heal: from the next on.)
            assert (a["position"], a["epoch"]) == (b["position"], b["epoch"]), (step, a, b)
            assert step == healed_at or a["batch_idx"] == b["batch_idx"], (step, a, b)
            for group, line in ((0, a), (1, b)):
                assert line["x0"] == _first_sample(group, rank, *line["position"]), (group, rank, step, line)


def _progress_by_step(out_dir: Path, group: int, rank: int) -> dict[int, dict]:
    """The last committed progress line of each global step of one rank (a restarted group's run only)."""
    lines = [json.loads(x) for x in (out_dir / f"progress_g{group}_r{rank}.jsonl").read_text().splitlines() if x.strip()]
    return {line["step"]: line for line in lines if line["committed"]}


def _plain_hsdp(ckpt: str | None, steps: int, accumulate: int = 1) -> dict:
    """Plain HSDP 2x2 (no fault tolerance) with Lightning's own sampler, from scratch or from ``ckpt``."""
    from lightning.pytorch import Trainer, seed_everything

    import hp_lightning
    from tests.distributed.test_parity import GLOBAL_BATCH as PARITY_BATCH
    from tests.helpers import RegressionModule, loader, trainer_kwargs

    seed_everything(0)
    model = RegressionModule()
    strategy = hp_lightning.HSDPStrategy(mesh_shape=[2, 2], resumable_dataloaders=True)
    trainer = Trainer(devices=4, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate, **trainer_kwargs())
    trainer.fit(model, loader(make_dataset(), PARITY_BATCH // 4), ckpt_path=ckpt)
    return {"params": full_params(model), "global_step": trainer.global_step}


def test_lightning_accumulation_windows_equal_plain_hsdp_with_one_cross_group_average_per_window(tmp_path: Path) -> None:
    """accumulate_grad_batches=4 in two Lightning replica groups == Lightning HSDP 2x2 with the same
    windows; torchft's all-reduce runs once per unit and window (counted at the Manager's call)."""
    steps, accumulate = 2, 4
    reference = run_distributed(_plain_hsdp, 4, None, steps, accumulate)[0]["params"]
    (tmp_path / "accumulate").write_text(str(accumulate))
    results = _both_groups(tmp_path, steps, _lightning_group_rank_main)
    for (group, rank), out in results.items():
        assert out["global_step"] == out["ft_step"] == steps, (group, rank, out["global_step"], out["ft_step"])
        assert [tuple(p) for p in out["positions"]] == [(e, i) for e in range(2) for i in range(BATCHES_PER_EPOCH)], out["positions"]
        assert out["units_with_params"] > 1, out["units_with_params"]
        assert out["cross_group_allreduces"] == out["units_with_params"] * steps, (out["cross_group_allreduces"], out["units_with_params"])
        diff = max_rel_diff(out["full"], reference)
        assert diff <= 1e-5, f"group {group} rank {rank}: max relative difference to Lightning HSDP 2x2 (k=4) {diff:.3g}"
        _assert_bit_identical(out["state"], results[(1 - group, rank)]["state"], f"g{group}r{rank}")


def test_lightning_trainer_groups_equal_plain_hsdp_and_checkpoint_resumes_in_plain_hsdp(tmp_path: Path) -> None:
    """Two Lightning jobs (one per replica group, the strategy's option) == Lightning HSDP 2x2; one group's
    checkpoint (written by that group only) resumes in plain HSDP 2x2 to the same weights."""
    steps = 4
    reference = run_distributed(_plain_hsdp, 4, None, steps)[0]["params"]
    results = _both_groups(tmp_path, steps, _lightning_group_rank_main)
    for (group, rank), out in results.items():
        assert out["global_step"] == out["ft_step"] == steps, (group, rank, out["global_step"], out["ft_step"])
        assert [tuple(p) for p in out["positions"]] == [(0, i) for i in range(steps)], out["positions"]
        diff = max_rel_diff(out["full"], reference)
        assert diff <= 1e-5, f"group {group} rank {rank}: max relative difference to Lightning HSDP 2x2 {diff:.3g}"
        _assert_bit_identical(out["state"], results[(1 - group, rank)]["state"], f"g{group}r{rank}")
    # Both groups' ModelCheckpoint share one folder; only the first participant (group 0) wrote: one
    # shard file per rank of one group, and nothing else in the folder.
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], saved
    for name in saved:
        assert sorted(p.name for p in (tmp_path / "ckpt" / name).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], name
    middle = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    resumed = run_distributed(_plain_hsdp, 4, middle, steps)
    for out in resumed:
        assert out["global_step"] == steps
        diff = max_rel_diff(out["params"], reference)
        assert diff <= 1e-5, f"resumed in plain HSDP 2x2: max relative difference to the uninterrupted run {diff:.3g}"
    # A full restart: both groups resume under fault tolerance from the step-2 checkpoint, continue
    # with the same batches (loader position, torchft's step) and end where the first run ended.
    (tmp_path / "resume_from").write_text(middle)
    restarted = _both_groups(tmp_path, steps, _lightning_group_rank_main)
    for (group, rank), out in restarted.items():
        assert out["global_step"] == out["ft_step"] == steps, (group, rank, out["global_step"], out["ft_step"])
        assert [tuple(p) for p in out["positions"]] == [(0, 2), (0, 3)], out["positions"]
        _assert_bit_identical(out["state"], restarted[(1 - group, rank)]["state"], f"restarted g{group}r{rank}")
        diff = max_rel_diff(out["full"], reference)
        assert diff <= 1e-5, f"restarted group {group} rank {rank}: max relative difference {diff:.3g}"
