"""Fault-tolerance option and helpers: validation at the boundary, data shares, the lighthouse command.

No process group here: everything is refused (or served) before one would exist. The lighthouse is
torchft's real server on 127.0.0.1.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft", reason="fault tolerance needs the 'ft' extra (torchft)")

from hp_lightning.ft import (  # noqa: E402
    LIGHTHOUSE_ENV,
    FaultTolerance,
    ParticipantBatches,
    TrainingState,
    check_lighthouse_reachable,
    start_lighthouse,
)
from hp_lightning.ft.lighthouse import main as lighthouse_main  # noqa: E402
from tests.helpers import TinyNet, free_port  # noqa: E402


def test_defaults_and_dict_form() -> None:
    ft = FaultTolerance(replica_group=1, num_replica_groups=2)
    assert (ft.min_replicas, ft.lighthouse, ft.init_sync) == (1, None, True)
    assert FaultTolerance.from_value({"replica_group": 1, "num_replica_groups": 2}) == ft
    assert FaultTolerance.from_value(None) is None and FaultTolerance.from_value(ft) is ft
    assert ft.replica_id() == "hp_replica_group_1"
    with pytest.raises(TypeError, match="positional"):
        FaultTolerance(1, 2)  # type: ignore[misc]  # keyword-only
    with pytest.raises(Exception, match="frozen|cannot assign"):
        ft.replica_group = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"replica_group": 2, "num_replica_groups": 2}, ValueError, r"replica_group=2\) is out of range.*0 <= replica_group < 2"),
        ({"replica_group": -1, "num_replica_groups": 2}, ValueError, r"replica_group=.*>= 0; got -1"),
        ({"replica_group": "0", "num_replica_groups": 2}, TypeError, r"replica_group=.*int.*got str"),
        ({"replica_group": True, "num_replica_groups": 2}, TypeError, r"replica_group=.*got bool"),
        ({"replica_group": 0, "num_replica_groups": 0}, ValueError, r"num_replica_groups=.*>= 1"),
        ({"replica_group": 0, "num_replica_groups": 2, "min_replicas": 3}, ValueError, r"min_replicas=3\) exceeds"),
        ({"replica_group": 0, "num_replica_groups": 2, "min_replicas": 0}, ValueError, r"min_replicas=.*>= 1"),
        ({"replica_group": 0, "num_replica_groups": 2, "lighthouse": "vm:notaport"}, ValueError, r"lighthouse=.*http://host:port"),
        ({"replica_group": 0, "num_replica_groups": 2, "lighthouse": "ftp://a:1"}, ValueError, r"http://host:port"),
        ({"replica_group": 0, "num_replica_groups": 2, "lighthouse": 29510}, TypeError, r"lighthouse=.*got int"),
        ({"replica_group": 0, "num_replica_groups": 2, "quorum_timeout": 0}, ValueError, r"quorum_timeout=.*> 0"),
        ({"replica_group": 0, "num_replica_groups": 2, "timeout": "60"}, TypeError, r"timeout=.*seconds"),
        ({"replica_group": 0, "num_replica_groups": 2, "init_sync": 1}, TypeError, r"init_sync=.*bool"),
        ({"replica_group": 0, "num_replica_groups": 2, "manager_port": 70000}, ValueError, r"manager_port=.*65535"),
        ({"replica_group": 0, "num_replica_groups": 2, "hostname": ""}, TypeError, r"hostname=.*non-empty.*got ''"),
    ],
)
def test_bad_settings_are_refused_with_the_option_named(kwargs, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        FaultTolerance(**kwargs)


def test_unknown_dict_key_is_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['replica_groups'\]"):
        FaultTolerance.from_value({"replica_groups": 1, "num_replica_groups": 2})
    with pytest.raises(TypeError, match="FaultTolerance, a dict"):
        FaultTolerance.from_value([0, 2])  # type: ignore[arg-type]


def test_lighthouse_address_from_field_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    ft = FaultTolerance(replica_group=0, num_replica_groups=1)
    with pytest.raises(ValueError, match=f"reads the lighthouse address from {LIGHTHOUSE_ENV}, which is not set"):
        ft.lighthouse_address()
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://10.0.0.1:29510")
    assert ft.lighthouse_address() == "http://10.0.0.1:29510"
    monkeypatch.setenv(LIGHTHOUSE_ENV, "garbage")
    with pytest.raises(ValueError, match=f"from {LIGHTHOUSE_ENV}"):
        ft.lighthouse_address()
    assert FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse="127.0.0.1:1").lighthouse_address() == "http://127.0.0.1:1"


def test_missing_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # what `import torchft` sees when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'hp-lightning\[ft\]'"):
        FaultTolerance(replica_group=0, num_replica_groups=2)


def test_unreachable_lighthouse_fails_within_the_timeout() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no lighthouse reachable at http://127.0.0.1:{port} within connect_timeout=0.5s"):
        check_lighthouse_reachable(f"http://127.0.0.1:{port}", 0.5)
    assert time.monotonic() - start < 5
    server = start_lighthouse("127.0.0.1:0", min_replicas=1)
    try:
        check_lighthouse_reachable(f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}", 5.0)
    finally:
        server.shutdown()


def test_participant_batches_cover_each_global_batch_exactly() -> None:
    batches = ParticipantBatches(64, 8)
    for participants in (1, 2):
        shares = [
            batches.indices(3, participant_rank=p, participants=participants, group_rank=r, group_world_size=2)
            for p in range(participants)
            for r in range(2)
        ]
        assert sum(shares, []) == list(range(24, 32))  # the same samples whoever takes part
        assert len({len(s) for s in shares}) == 1
    assert batches.global_batch(8) == list(range(8))  # epoch 1 starts over
    shuffled = ParticipantBatches(64, 8, shuffle=True, seed=5)
    assert sorted(sum((shuffled.global_batch(b) for b in range(8)), [])) == list(range(64))
    assert shuffled.global_batch(0) != shuffled.global_batch(8)  # a fresh permutation per epoch
    with pytest.raises(ValueError, match=r"does not split evenly over 3 participating group\(s\) x 2 rank\(s\)"):
        batches.indices(0, participant_rank=0, participants=3, group_rank=0, group_world_size=2)
    with pytest.raises(ValueError, match="read data only after joining the step's quorum"):
        batches.indices(0, participant_rank=-1, participants=2, group_rank=0, group_world_size=2)
    with pytest.raises(ValueError, match="exceeds dataset_size"):
        ParticipantBatches(4, 8)


def test_training_state_round_trip_and_layout_mismatch() -> None:
    torch.manual_seed(0)
    src, dst = TinyNet(), TinyNet(width=16)
    opt_src = torch.optim.AdamW(src.parameters(), lr=1e-2)
    src(torch.randn(4, 8)).sum().backward()
    opt_src.step()
    progress = {"epoch": 3}

    class Progress:
        def state_dict(self):
            return dict(progress)

        def load_state_dict(self, sd):
            progress.update(sd)

    state = TrainingState(src, [opt_src], {"progress": Progress()}).state_dict()
    opt_dst = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    TrainingState(dst, [opt_dst], {"progress": Progress()}).load_state_dict(state)
    for (name, a), b in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(opt_src.state_dict()["state"][0]["exp_avg"], opt_dst.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="parameter names differ"):
        TrainingState(TinyNet(depth=3), [torch.optim.SGD(TinyNet(depth=3).parameters(), lr=1)]).load_state_dict(state)
    with pytest.raises(ValueError, match="local shard shape"):
        TrainingState(TinyNet(width=8), [torch.optim.SGD(TinyNet(width=8).parameters(), lr=1)]).load_state_dict(state)
    with pytest.raises(TypeError, match="needs state_dict\\(\\) and load_state_dict\\(\\)"):
        TrainingState(src, [opt_src], {"bad": object()})  # type: ignore[dict-item]


def test_lighthouse_command_serves_until_terminated() -> None:
    assert lighthouse_main(["lighthouse", "--bind", "nonsense"]) == 2
    port = free_port()
    env = {**os.environ, "RUST_LOG": "warn"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hp_lightning.ft", "lighthouse", "--min-replicas", "1", "--bind", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # bounded: the import takes seconds
        assert ready, "the lighthouse command printed nothing within 120 s"
        line = proc.stdout.readline()  # printed before the process becomes torchft's torchft_lighthouse
        assert f"on 127.0.0.1:{port}; groups connect with TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port}" in line, line
        check_lighthouse_reachable(f"http://127.0.0.1:{port}", 120.0)  # torchft's command imports torch first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # torchft's command ends by the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ the strategy option and the registered name


def test_strategy_option_from_a_dict_env_or_registered_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch import Trainer

    import hp_lightning
    from hp_lightning.fabric import HSDPFabricStrategy

    for cls in (hp_lightning.HSDPStrategy, HSDPFabricStrategy):
        strategy = cls(fault_tolerance={"replica_group": 1, "num_replica_groups": 3})
        assert strategy.fault_tolerance_config == FaultTolerance(replica_group=1, num_replica_groups=3)
        # A replica group shards over its own ranks: the default mesh is 1-D, not (nodes, devices).
        assert strategy.options.layout(world_size=4, num_nodes=2, devices_per_node=2).dp == (4,)
    monkeypatch.setenv("HP_FT_REPLICA_GROUP", "1")
    monkeypatch.setenv("HP_FT_NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("HP_FT_MIN_REPLICAS", "2")
    trainer = Trainer(strategy="hsdp_ft", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.fault_tolerance_config == FaultTolerance(replica_group=1, num_replica_groups=2, min_replicas=2)
    monkeypatch.delenv("HP_FT_REPLICA_GROUP")
    with pytest.raises(ValueError, match="HP_FT_REPLICA_GROUP"):
        hp_lightning.HSDPStrategy(fault_tolerance="env")
    monkeypatch.setenv("HP_FT_REPLICA_GROUP", "one")
    with pytest.raises(ValueError, match="not an integer"):
        hp_lightning.HSDPStrategy(fault_tolerance="env")
    with pytest.raises(ValueError, match="got the string 'yes'"):
        hp_lightning.HSDPStrategy(fault_tolerance="yes")
    with pytest.raises(TypeError, match="unknown key"):
        hp_lightning.HSDPStrategy(fault_tolerance={"replica_group": 0, "num_replica_groups": 2, "groups": 2})


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"pipeline_parallel_size": 2, "pipeline_split_points": ["blocks.1"]}, "pipeline_parallel_size=2"),
        ({"expert_parallel_size": 2}, "expert_parallel_size=2"),
        ({"mesh_shape": [2, 2]}, r"mesh_shape=\[2, 2\]"),
        ({"replicate_params": ["*.bias"]}, "replicate_params"),
        ({"accumulation_mode": "every"}, "accumulation_mode='skip'.*got accumulation_mode='every'"),
        ({"accumulation_mode": "defer_all_reduce"}, "got accumulation_mode='defer_all_reduce'"),
    ],
)
def test_strategy_option_refuses_what_torchft_cannot_serve(kwargs, named) -> None:
    import hp_lightning
    from hp_lightning.fabric import HSDPFabricStrategy

    ft = {"replica_group": 0, "num_replica_groups": 2}
    for strategy in (hp_lightning.HSDPStrategy, HSDPFabricStrategy):
        with pytest.raises(ValueError, match=f"fault_tolerance.*{named}"):
            strategy(fault_tolerance=ft, **kwargs)
    hp_lightning.HSDPStrategy(fault_tolerance=ft, mesh_shape=[1, 4])  # (1, n) is 1-D


def test_accumulation_mode_cannot_leave_skip_during_fit_under_fault_tolerance() -> None:
    """GradientAccumulationSync's API: refused at the call under fault tolerance, allowed without it."""
    import hp_lightning

    strategy = hp_lightning.HSDPStrategy(fault_tolerance={"replica_group": 0, "num_replica_groups": 2})
    with pytest.raises(ValueError, match="fault_tolerance needs accumulation_mode='skip'.*got accumulation_mode='every'"):
        strategy.set_accumulation_mode("every")
    assert strategy.accumulation_mode == "skip"
    assert strategy.set_accumulation_mode("skip") == "skip"
    assert hp_lightning.HSDPStrategy().set_accumulation_mode("every") == "skip"


def test_yaml_sets_the_option(tmp_path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from tests.helpers import RegressionModule

    config = tmp_path / "ft.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
        "  strategy:\n    class_path: hp_lightning.HSDPStrategy\n    init_args:\n"
        "      fault_tolerance: {replica_group: 1, num_replica_groups: 2, min_replicas: 1, lighthouse: 'http://127.0.0.1:29510'}\n"
    )
    cli = LightningCLI(RegressionModule, run=False, args=["--config", str(config)], save_config_callback=None)
    assert cli.trainer.strategy.fault_tolerance_config == FaultTolerance(
        replica_group=1, num_replica_groups=2, lighthouse="http://127.0.0.1:29510"
    )


def test_positioned_loader_re_reads_and_jumps_like_a_healed_group() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from hp_lightning.ft.data import PositionedLoader

    data = TensorDataset(torch.arange(20.0))
    loader = PositionedLoader(DataLoader(data, batch_size=2))
    it = iter(loader)
    first, prefetched = next(it), next(it)  # the loop holds one batch and has fetched the next
    assert loader.take() == (0, 0) and loader.pending == 1 and loader.upcoming == 2
    # Healed to batch 6: read it now; the prefetched batch 1 still comes next, then the iteration continues at 8.
    assert torch.equal(loader.batch_at(6)[0], torch.tensor([12.0, 13.0]))
    generation = loader.jump(6 + 1 + loader.pending)
    assert loader.upcoming == 8 and loader.upcoming_generation == generation == 1
    rest = list(it)
    assert [b[0].tolist() for b in rest] == [[16.0, 17.0], [18.0, 19.0]]
    assert [loader.take() for _ in range(3)] == [(0, 1), (1, 8), (1, 9)]
    assert torch.equal(first[0], torch.tensor([0.0, 1.0])) and torch.equal(prefetched[0], torch.tensor([2.0, 3.0]))
    assert loader.state_dict() == {"batches_served": 10, "batches_per_epoch": 10}
    with pytest.raises(TypeError, match="map-style dataset with batch_size"):
        PositionedLoader(DataLoader(data, batch_size=None))
    with pytest.raises(IndexError):
        loader.batch_at(10)
