"""Checkpoint save and resume time, hp_lightning against plain DCP on the same state (``make bench-checkpoint``).

Two gloo ranks (FSDP 2) hold the cluster benchmark's LLM-shaped GPT (21.5 M parameters, 32k
vocabulary) and its AdamW state after one step. Each round, interleaved and in a fresh directory:

* **plain DCP**: ``dcp.save`` / ``dcp.load`` of the same model and optimizer state dicts
  (torch's ``get_state_dict`` / ``set_state_dict``);
* **hp_lightning, CRC-32** (the default): ``save_checkpoint`` (staging directory, ``meta.pt``,
  manifest with every file's size and CRC-32s: the tensor bytes' taken from torch's own zip
  records, the few other bytes read back; atomic publish) and ``load_checkpoint`` (format check,
  manifest, sizes and the bytes outside the tensors against their CRC-32, keys and shapes against
  the model, DCP's index bounded against the files, then DCP's own reader, each archive's records
  bounded before ``torch.load`` and each tensor checked against the index and its CRC-32 before
  it is copied into the model);
* **hp_lightning, + SHA-256** (``checkpoint_checksums=True``): also the SHA-256 of every file,
  recorded at save (a read-back by the rank that wrote it) and checked before every resume;
* **hp_lightning, async_save** (``async_save=True``): the *stall* is how long the save call holds
  the training loop (state dicts, ``meta.pt``, the copy to host memory); the write and publish go
  on in the background and are timed to their end (*until published*). Target: stall ≤ 20 % of
  the synchronous save.

Reported: median seconds per save and per resume over the rounds, each as a ratio to plain DCP
(targets with the default: save ≤ 1.10×, resume ≤ 1.3×), and the median and range of the ratios
taken round by round (each against the plain DCP run next to it), which a burst of load on the
machine moves less. Files go to a temporary directory on the local disk;
the page cache is not dropped (root would be needed), so "resume" reads mostly from memory: the
ratio is what the extra work costs, not disk bandwidth.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROUNDS = 9


def _worker(out_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from benchmarks.cluster_settings import ClusterSettings
    from benchmarks.trainers import gpt_config
    from examples.gpt import GPT
    from hp_lightning import fully_shard, init_device_mesh
    from hp_lightning.checkpoint import AsyncSaves, load_checkpoint, model_state_dict, optimizer_state_dict, save_checkpoint

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPT(gpt_config(ClusterSettings().model))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, model.config.vocab_size, (2, 16))).float().mean().backward()
    optimizer.step()
    root = Path(out_dir)

    def timed(action: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        action()
        dist.barrier()
        return time.perf_counter() - start

    def lightning_checkpoint() -> dict[str, Any]:
        return {
            "state_dict": model_state_dict(model, full=False),
            "optimizer_states": [optimizer_state_dict(model, optimizer, full=False)],
            "global_step": 1,
        }

    def hp_save(path: Path, checksums: bool) -> None:
        save_checkpoint(lightning_checkpoint(), path, sharded=True, checksums=checksums)

    saves = AsyncSaves()
    async_times: dict[str, list[float]] = {"stall": [], "until_published": [], "sync_save": []}

    def dcp_save(path: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))

    def dcp_load(path: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    kinds = {
        "plain DCP": (dcp_save, dcp_load),
        "hp_lightning (CRC-32, default)": (lambda p: hp_save(p, False), lambda p: load_checkpoint(p, model, [optimizer])),
        "hp_lightning (+ SHA-256, checkpoint_checksums=True)": (lambda p: hp_save(p, True), lambda p: load_checkpoint(p, model, [optimizer])),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "resume": []} for k in kinds}
    for r in range(ROUNDS):
        for k, (name, (save, load)) in enumerate(kinds.items()):
            path = root / f"round{r}-kind{k}.ckpt"
            times[name]["save"].append(timed(lambda: save(path)))
            times[name]["resume"].append(timed(lambda: load(path)))
        # async_save: the stall (the save call) and the time until published, next to a sync save.
        stall = timed(lambda: saves.save(lightning_checkpoint(), root / f"round{r}-async.ckpt"))
        async_times["stall"].append(stall)
        async_times["until_published"].append(stall + timed(saves.wait))
        async_times["sync_save"].append(timed(lambda: hp_save(root / f"round{r}-sync.ckpt", False)))
    size = sum(f.stat().st_size for f in (root / "round0-kind0.ckpt").iterdir())
    return {"times": times, "async": async_times, "bytes": size, "world": dist.get_world_size()}


def main() -> int:
    from tests.helpers import run_distributed

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=str(Path.cwd())) as tmp:
        results = run_distributed(_worker, 2, tmp, timeout=1200)
    load_after = os.getloadavg()[0]
    rank0 = results[0]
    times = rank0["times"]
    base = {kind: statistics.median(times["plain DCP"][kind]) for kind in ("save", "resume")}
    lines = [
        f"# Checkpoint save / resume against plain DCP ({rank0['world']} ranks, {rank0['bytes'] / 2**20:.0f} MiB on disk, "
        f"median of {ROUNDS} interleaved rounds)",
        "",
        "| | save s | × plain DCP | per round: median (min–max) | resume s | × plain DCP | per round: median (min–max) |",
        "|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    for name, entry in times.items():
        save, resume = statistics.median(entry["save"]), statistics.median(entry["resume"])
        paired = {
            kind: [mine / plain for mine, plain in zip(entry[kind], times["plain DCP"][kind])] for kind in ("save", "resume")
        }
        summary[name] = {
            "save_s": save,
            "resume_s": resume,
            "save_ratio": save / base["save"],
            "resume_ratio": resume / base["resume"],
            "save_ratio_per_round": paired["save"],
            "resume_ratio_per_round": paired["resume"],
        }
        spread = {kind: f"{statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f})" for kind, r in paired.items()}
        lines.append(
            f"| {name} | {save:.3f} | {save / base['save']:.2f} | {spread['save']} | {resume:.3f} | {resume / base['resume']:.2f} | {spread['resume']} |"
        )
    stalls = {key: statistics.median(values) for key, values in rank0["async"].items()}
    summary["async_save"] = {**stalls, "stall_over_sync_save": stalls["stall"] / stalls["sync_save"]}
    lines += [
        "",
        "| async_save | seconds | × sync hp_lightning save |",
        "|---|---|---|",
        f"| training stall per save | {stalls['stall']:.3f} | {stalls['stall'] / stalls['sync_save']:.2f} (target ≤ 0.20) |",
        f"| save call to published | {stalls['until_published']:.3f} | {stalls['until_published'] / stalls['sync_save']:.2f} |",
        f"| sync save (same round) | {stalls['sync_save']:.3f} | 1.00 |",
    ]
    lines += [
        "",
        f"Load average (1 min) {load_before:.1f} before and {load_after:.1f} after the run on {os.cpu_count()} cores"
        + (
            ": other work shared the machine before the run, and the ratios carry its noise."
            if load_before > 0.5 * (os.cpu_count() or 1)
            else " (the run's own 2 ranks raise it; nothing else was running before it)."
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_io.md").write_text(text)
    (out / "checkpoint_io.json").write_text(
        json.dumps(
            {"bytes": rank0["bytes"], "rounds": times, "async_rounds": rank0["async"], "summary": summary, "load_average": [load_before, load_after]},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
