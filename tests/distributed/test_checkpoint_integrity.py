"""Integrity by default and full disks, on 2 real gloo ranks, in one launch.

* A sharded checkpoint saved with the defaults (no ``checksums``), then damaged on disk: a flipped
  byte in a tensor of rank 1's shard (caught as DCP reads it), one in a zip header of rank 1's
  shard (caught before DCP starts), one in the last tensor of rank 0's shard (caught by rank 0
  as it reads it, raised on rank 1 too), rank 1's shard replaced by rank 0's file of the same size
  (of a weights-only save, where both ranks' files have the same size), a truncated shard. Every
  rank refuses each with the same ``CorruptCheckpointError`` naming the file; the intact one loads
  exactly.
* A real full disk: rank 0 mounts a tmpfs that holds one checkpoint and not two, and the ranks
  save over it, synchronously and with ``AsyncSaves``. Every rank raises the same ``OSError``
  (ENOSPC) naming the checkpoint and the free space; the async one also says which save it was.
  The previous checkpoint of that name still loads, and nothing half-written is left.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from hp_lightning.checkpoint.layout import MANIFEST_FILE
from tests.helpers import RegressionModule, full_params, run_distributed

SHARDS = ("__0_0.distcp", "__1_0.distcp")
DAMAGE = ("flipped", "header", "rank0_tail", "swapped", "truncated")
#: The shard each damage case alters.
DAMAGED_SHARD = {"flipped": SHARDS[1], "header": SHARDS[1], "rank0_tail": SHARDS[0], "swapped": SHARDS[1], "truncated": SHARDS[1]}


def _sharded_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from hp_lightning import fully_shard, init_device_mesh

    torch.manual_seed(0)
    model = RegressionModule(width=192, depth=2)  # fc weights of 147 KiB per rank: their CRC-32s come from torch's writer
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for block in model.net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.net, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.net(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    import lightning

    from hp_lightning.checkpoint import model_state_dict, optimizer_state_dict

    return {
        "state_dict": model_state_dict(model, full=False),
        "optimizer_states": [optimizer_state_dict(model, optimizer, full=False)],
        "pytorch-lightning_version": lightning.__version__,
        "global_step": step,
        "epoch": 0,
    }


def _outcome(action: Callable[[], Any]) -> tuple[str, str, Any]:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
        return type(exc).__name__, str(exc), getattr(exc, "errno", None)
    return "ok", "", None


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def integrity_worker(tmp: str, mount: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hp_lightning.checkpoint import AsyncSaves, load_checkpoint, model_state_dict, save_checkpoint

    dist.init_process_group("gloo")
    root, small = Path(tmp), Path(mount)
    model, optimizer = _sharded_model()
    saved = full_params(model)
    save_checkpoint(_checkpoint(model, optimizer, 1), root / "good", sharded=True)  # the defaults
    # Weights only: every tensor is split evenly, so both ranks' shard files have the same size
    # (with optimizer state, rank 0 also writes the replicated entries: step counts, param groups).
    weights = {"state_dict": model_state_dict(model, full=False), "global_step": 1, "pytorch-lightning_version": "2.6.6"}
    save_checkpoint(weights, root / "weights", sharded=True)
    out: dict[str, Any] = {}

    if dist.get_rank() == 0:
        for case in DAMAGE:
            shutil.copytree(root / ("weights" if case == "swapped" else "good"), root / case)
        import json

        ranges = json.loads((root / "good" / MANIFEST_FILE).read_text())["files"]
        # (case, shard, byte to flip, whether a tensor range the reader checks holds it)
        flips = [("flipped", SHARDS[1], None), ("header", SHARDS[1], 30), ("rank0_tail", SHARDS[0], -1)]
        for case, shard, where in flips:
            data = bytearray((root / case / shard).read_bytes())
            spans = ranges[shard]["crc32_ranges"]
            at = len(data) // 2 if where is None else where if where >= 0 else spans[-1][0] + spans[-1][1] // 2
            data[at] ^= 0x01
            (root / case / shard).write_bytes(bytes(data))
            out[f"{case}:in_range"] = any(o <= at < o + n for o, n, _ in spans)
        out["same_size"] = (root / "weights" / SHARDS[0]).stat().st_size == (root / "weights" / SHARDS[1]).stat().st_size
        shutil.copy(root / "weights" / SHARDS[0], root / "swapped" / SHARDS[1])  # rank 0's shard in rank 1's place
        (root / "truncated" / SHARDS[1]).write_bytes((root / "good" / SHARDS[1]).read_bytes()[:1000])
    dist.barrier()
    for case in DAMAGE:
        optimizers = [] if case == "swapped" else [optimizer]
        out[case] = _outcome(lambda case=case, optimizers=optimizers: load_checkpoint(root / case, model, optimizers))
    out["weights"] = _outcome(lambda: load_checkpoint(root / "weights", model, []))
    out["good"] = _outcome(lambda: load_checkpoint(root / "good", model, [optimizer]))
    out["good:diff"] = _max_diff(full_params(model), saved)

    # A disk that holds one checkpoint and not two.
    if dist.get_rank() == 0:
        size = sum(p.stat().st_size for p in (root / "good").iterdir())
        pages = (size + size // 2) // 4096 + 1
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * 4096}", "tmpfs", str(small)], check=True)
    dist.barrier()
    target = small / "last.ckpt"
    save_checkpoint(_checkpoint(model, optimizer, 1), target, sharded=True)
    _step(model, optimizer)  # training goes on; the next saves do not fit beside the first
    out["sync"] = _outcome(lambda: save_checkpoint(_checkpoint(model, optimizer, 2), target, sharded=True))
    saves = AsyncSaves()
    saves.save(_checkpoint(model, optimizer, 3), target)
    out["async"] = _outcome(saves.wait)
    saves.close()
    out["left_behind"] = sorted(p.name for p in small.iterdir())
    out["previous"] = _outcome(lambda: load_checkpoint(target, model, [optimizer]))
    out["previous:diff"] = _max_diff(full_params(model), saved)
    dist.barrier()
    if dist.get_rank() == 0:
        subprocess.run(["umount", str(small)], check=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    if os.geteuid() != 0:
        pytest.skip("the full-disk cases mount a small tmpfs, which needs root")
    tmp = tmp_path_factory.mktemp("integrity")
    mount = tmp / "small"
    mount.mkdir()
    try:
        return run_distributed(integrity_worker, 2, str(tmp), str(mount), timeout=240), mount
    finally:
        if os.path.ismount(mount):
            subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_shard_is_refused_by_default_naming_the_file_on_every_rank(results: tuple[list[dict[str, Any]], Path], case: str) -> None:
    per_rank, _ = results
    assert per_rank[0]["same_size"], "the swap must be of a same-size file"
    expected = "is truncated" if case == "truncated" else "was altered or replaced after the save"
    if case in ("flipped", "rank0_tail", "header"):  # which check meets it: the reader's (in a tensor) or the one before DCP
        assert per_rank[0][f"{case}:in_range"] == (case != "header"), case
    assert len({out[case][1] for out in per_rank}) == 1, [out[case][1] for out in per_rank]  # word for word on every rank
    for rank, out in enumerate(per_rank):
        raised, message, _ = out[case]
        assert raised == "CorruptCheckpointError", f"rank {rank}: {case}: {raised}: {message}"
        assert f"{DAMAGED_SHARD[case]}' {expected}" in message and f"{case}/" in message, f"rank {rank}: {message}"


def test_the_intact_checkpoint_loads_exactly(results: tuple[list[dict[str, Any]], Path]) -> None:
    for out in results[0]:
        assert out["weights"][0] == "ok" and out["good"][0] == "ok" and out["good:diff"] == 0.0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_full_disk_gives_the_same_named_error_on_every_rank(results: tuple[list[dict[str, Any]], Path], kind: str) -> None:
    per_rank, mount = results
    target = mount / "last.ckpt"
    messages = {out[kind][1] for out in per_rank}
    assert len(messages) == 1, messages  # word for word the same on every rank
    for rank, out in enumerate(per_rank):
        raised, message, code = out[kind]
        assert raised == "OSError" and code == errno.ENOSPC, f"rank {rank}: {kind}: {raised} ({code}): {message}"
        assert f"No space left on device while writing checkpoint '{target}' (" in message and " bytes free on " in message, message
        if kind == "async":
            assert f"The async save 1 of this run (to '{target}', started at global step 3, epoch 0) failed in the background" in message


def test_after_a_full_disk_the_previous_checkpoint_loads_and_nothing_is_left(results: tuple[list[dict[str, Any]], Path]) -> None:
    for out in results[0]:
        assert out["left_behind"] == ["last.ckpt"]
        assert out["previous"][0] == "ok" and out["previous:diff"] == 0.0, out["previous"]
