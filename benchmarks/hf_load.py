"""Loading a Hugging Face directory into FSDP 4 on CPU: memory and time (``make bench-hf``).

A Llama-shaped model of about 500 MB in fp32 (hidden 1024, 5 layers, 32k vocabulary; its largest
tensor, the embedding, 131 MB) is saved twice with ``save_pretrained``: in 100 MB shards with an
index, and as one ``model.safetensors``. Four gloo ranks build it on the meta device, shard it
with ``fully_shard`` (each block, then the root), materialize their shards, and load:

* **HF directory** (``load_weights(model, hf_dir)``): each rank reads only its own rows (DCP's
  Hugging Face reader, through a memory map);
* **rank 0 reads + broadcasts** (``load_weights(model, "model.safetensors")``, the path for a
  single file): rank 0 reads the whole file and broadcasts every tensor;

Then the whole setup, from a model built on the meta device to a loaded one, under Fabric with
``HSDPStrategy`` (the strategy shards and materializes): **initialized, then loaded**
(``load_weights`` after ``fabric.setup``: the meta-device initialization runs for every tensor,
one full-size tensor at a time on every rank, then the file overwrites it) against **loaded
while materializing** (``load_weights`` named before ``fabric.setup``: the tensors the directory
holds are allocated and loaded, never initialized).

And, in one plain process, **from_pretrained** (then every parameter read once: transformers
may leave them as views of the memory-mapped files, loaded only when first touched). Reported per rank: seconds, and the peak resident
memory above the sharded model's own state (the kernel's high-water mark: anonymous memory and
the file pages mapped in alike), against the target ``largest tensor + 10 %``. Each
method runs in rounds interleaved with the others; medians are reported. The page cache is warm
(root would be needed to drop it): times are what the work costs, not disk bandwidth.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROUNDS = 3
WORLD = 4


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=5, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=256, tie_word_embeddings=False,
    )


def _status(field: str) -> int:
    """A ``/proc/self/status`` size field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_during(fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds ``fn`` took and this process's peak resident memory above the start, in bytes.

    The kernel's own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``): every
    page counts, anonymous or a file's pages mapped in (a memory-mapped safetensors file), however
    briefly it was resident. A sampling thread would miss peaks while a native call holds the GIL.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, _status("VmHWM") - base


def _worker(hf_dir: str, single: str) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    from hp_lightning import fully_shard, init_device_mesh
    from hp_lightning.checkpoint import load_weights
    from hp_lightning.fabric import HSDPStrategy

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    own = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters() if isinstance(p, DTensor))
    times: dict[str, list[tuple[float, int]]] = {"HF directory": [], "rank 0 reads + broadcasts": []}
    for _ in range(ROUNDS):
        for name, path in (("HF directory", hf_dir), ("rank 0 reads + broadcasts", single)):
            dist.barrier()
            times[name].append(peak_during(lambda path=path: load_weights(model, Path(path))))
    setups: dict[str, list[float]] = {SETUP_INIT_THEN_LOAD: [], SETUP_DEFERRED: []}
    fabric = Fabric(strategy=HSDPStrategy(mesh_shape=[dist.get_world_size()]), devices=dist.get_world_size(), accelerator="cpu")
    fabric.launch()  # the process group exists already: Fabric uses it

    def setup(deferred: bool) -> None:
        with fabric.init_module(empty_init=True):
            built = LlamaForCausalLM(config())
        if deferred:
            load_weights(built, Path(hf_dir))  # loaded by the strategy while it materializes
        built = fabric.setup_module(built)
        if not deferred:
            load_weights(built, Path(hf_dir))

    for _ in range(ROUNDS):
        for name, deferred in ((SETUP_INIT_THEN_LOAD, False), (SETUP_DEFERRED, True)):
            dist.barrier()
            start = time.perf_counter()
            setup(deferred)
            dist.barrier()
            setups[name].append(time.perf_counter() - start)
    return {"own_bytes": own, "times": times, "setups": setups}


SETUP_INIT_THEN_LOAD = "meta -> loaded: initialized, then loaded (load_weights after setup)"
SETUP_DEFERRED = "meta -> loaded: loaded while materializing (load_weights before setup)"


def _from_pretrained(hf_dir: str) -> tuple[float, int]:
    from transformers import LlamaForCausalLM

    def load_and_touch() -> None:
        model = LlamaForCausalLM.from_pretrained(hf_dir)
        with torch.no_grad():  # its tensors may still be views of the memory-mapped files: read every byte once
            for p in model.parameters():
                p.sum()

    return peak_during(load_and_touch)


def main() -> int:
    from transformers import LlamaForCausalLM

    from benchmarks.load import LoadMonitor, busy_banner, describe_load
    from tests.helpers import rank_context, run_distributed

    with tempfile.TemporaryDirectory(dir=str(Path.cwd())) as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        hf_dir, single = Path(tmp) / "hf", Path(tmp) / "single"
        model.save_pretrained(hf_dir, max_shard_size="100MB")
        model.save_pretrained(single, max_shard_size="2GB")
        del model
        shards = len([p for p in hf_dir.iterdir() if p.name.endswith(".safetensors")])
        with LoadMonitor() as monitor:
            results = run_distributed(_worker, WORLD, str(hf_dir), str(single / "model.safetensors"), timeout=1800)
            one = []
            for _ in range(ROUNDS):
                with rank_context().Pool(1) as pool:  # a fresh process each round: its peak is its own
                    one.append(pool.apply(_from_pretrained, (str(hf_dir),)))
    limit = largest * 1.10
    lines = [
        f"# Loading a Hugging Face directory into FSDP {WORLD} on CPU ({total / 1e6:.0f} MB fp32 in {shards} shards; "
        f"largest tensor {largest / 1e6:.0f} MB; median of {ROUNDS} interleaved rounds)",
        "",
        "| method | rank | seconds | peak memory above the sharded state, MB | ≤ largest tensor + 10 % |",
        "|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {"total_bytes": total, "largest_tensor_bytes": largest, "rounds": ROUNDS, "world": WORLD, "methods": {}}
    for name in ("HF directory", "rank 0 reads + broadcasts"):
        for rank, res in enumerate(results):
            runs = res["times"][name]
            seconds, peak = (statistics.median(r[i] for r in runs) for i in range(2))
            summary["methods"].setdefault(name, []).append({"rank": rank, "seconds": seconds, "peak_bytes": peak})
            lines.append(f"| {name} | {rank} | {seconds:.2f} | {peak / 1e6:.0f} | {'yes' if peak <= limit else 'no'} |")
    seconds, peak = (statistics.median(r[i] for r in one) for i in range(2))
    summary["methods"]["from_pretrained (1 process)"] = [{"rank": 0, "seconds": seconds, "peak_bytes": peak}]
    lines.append(f"| from_pretrained, 1 process | - | {seconds:.2f} | {peak / 1e6:.0f} (no sharded state: the whole model) | - |")
    lines += ["", "| setup under Fabric + HSDPStrategy (FSDP 4), the slowest rank | seconds (median) | per round |", "|---|---|---|"]
    summary["setups"] = {}
    for name in (SETUP_INIT_THEN_LOAD, SETUP_DEFERRED):
        rounds = results[0]["setups"][name]  # between two barriers: every rank's time is the slowest's
        summary["setups"][name] = rounds
        lines.append(f"| {name} | {statistics.median(rounds):.2f} | {', '.join(f'{t:.2f}' for t in rounds)} |")
    report = monitor.summary()
    summary["load"] = report
    lines += ["", f"Machine: {os.cpu_count()} cores. {describe_load(report)}", *busy_banner(report)]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_load.md").write_text(text)
    (out / "hf_load.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
