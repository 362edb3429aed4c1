#!/usr/bin/env bash
# hp_lightning on one CUDA device: the device tests, end-to-end checks and a short benchmark.
#
#   bash scripts/gpu_check.sh                  # on a machine with an NVIDIA GPU (< 5 minutes)
#   HP_CHECK_DEVICE=cpu bash scripts/gpu_check.sh   # rehearse the same steps on the CPU (gloo)
#
# Needs a Python whose torch is a CUDA build (PYTHON=..., default .venv/bin/python, else
# python3) with hp_lightning installed (pip install -e '.[test]'). One device means one rank:
# NCCL does not run two ranks on one GPU, so multi-rank numerics stay with the gloo tests.
#
# Steps (each in its own process, so one failure does not hide the rest):
#   1. environment report (torch, CUDA, GPU name, NCCL version);
#   2. pytest: the device tests and the unit suite (on a GPU machine the CUDA branches of
#      devices.py, auto selection and the CUDA-default paths take the "cuda" side);
#   3. checks on the device, 1 rank, the backend hp_lightning picks (nccl on CUDA):
#        plumbing    device type -> backend, mesh, autocast, shard placement, loss goes down
#        parity      HSDP fp32 == plain Lightning on the same device == the CPU run
#        meta_init   configure_model on meta, materialized on the device (seed broadcast on NCCL)
#        cpu_offload shards on pinned host memory, meta init on the host, training on the device
#        checkpoint  full file loads on the CPU; sharded directory resumes to the same weights
#        stats       DeviceStatsMonitor logs the allocator's statistics; cache freed at teardown
#        auto        Trainer(accelerator="auto", strategy="hsdp") lands on the device
#   4. benchmark: a small transformer LM, bf16-mixed, median step time, tokens/s and peak memory
#      for Lightning's single-device strategy, HSDP and HSDP with CPU offload (and Lightning's
#      FSDPStrategy on CUDA).
#   5. host-device synchronizations per optimizer step (torch.cuda.set_sync_debug_mode("warn")),
#      each attributed to its Python caller: hp_lightning's must be 0.
# Output: a PASS/FAIL line per step, the benchmark table, and $OUT_DIR (default runs/gpu_check).
set -uo pipefail

cd "$(dirname "$0")/.."
DEVICE="${HP_CHECK_DEVICE:-cuda}"
OUT_DIR="${OUT_DIR:-runs/gpu_check}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/bench_*.json
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
START=$SECONDS
FAILED=()

step() {  # step NAME TIMEOUT_S COMMAND... : run, time, record
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "---- $name"
  if timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log" | tail -n 25; [[ ${PIPESTATUS[0]} -eq 0 ]]; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name ($((SECONDS - t0)) s; log: $OUT_DIR/$name.log)"
    FAILED+=("$name")
  fi
}

# ------------------------------------------------------------------ 1. environment
"$PYTHON" - "$DEVICE" <<'EOF' | tee "$OUT_DIR/environment.log"
import sys
import torch
device = sys.argv[1]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit(
            "No usable CUDA device: this torch is a CPU build or sees no GPU. Point PYTHON at an "
            "environment with a CUDA build of torch 2.13 and hp_lightning installed (pip install -e '.[test]')."
        )
    print(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, NCCL {torch.cuda.nccl.version()}")
import lightning, hp_lightning
print(f"lightning {lightning.__version__}, hp_lightning {hp_lightning.__version__} ({hp_lightning.__file__})")
EOF
[[ ${PIPESTATUS[0]} -eq 0 ]] || exit 2

# ------------------------------------------------------------------ 2. tests
# HP_CHECK_TESTS narrows the test selection (for a rehearsal on a busy machine).
read -r -a TESTS <<< "${HP_CHECK_TESTS:-tests/unit}"
step pytest 150 "$PYTHON" -m pytest -q -x -p no:cacheprovider "${TESTS[@]}"

# ------------------------------------------------------------------ 3. checks on the device
cat > "$WORK/checks.py" <<'EOF'
"""One end-to-end check of hp_lightning on one device and one rank: python checks.py DEVICE CHECK OUT_DIR."""
import csv
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.distributed.tensor import DTensor

import hp_lightning
from hp_lightning import HSDPStrategy, devices
from tests.helpers import LossRecorder, RegressionModule, TinyNet, full_params, loader, make_dataset, max_rel_diff, trainer_kwargs

DEVICE, CHECK, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
ON_ACCELERATOR = devices.is_accelerator(DEVICE)
# Exact fp32 matmuls, so the parity check compares like with like.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


class MetaInitModule(RegressionModule):
    """Builds its network in configure_model, where HSDPStrategy puts it on the meta device."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        self.save_hyperparameters({"lr": 1e-2, "optimizer": "adamw"})
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = TinyNet()


def fit(strategy, *, steps=6, precision="32-true", model=None, device=DEVICE, ckpt_path=None, **kwargs):
    seed_everything(0)
    model = model if model is not None else RegressionModule()
    recorder = LossRecorder()
    callbacks = [recorder, *kwargs.pop("callbacks", [])]
    # One rank: keep the data order of the plain run (HSDPStrategy would inject a shuffling sampler).
    options = trainer_kwargs(
        accelerator=device, devices=1, max_steps=steps, precision=precision, callbacks=callbacks, use_distributed_sampler=False
    )
    options.update(kwargs)
    trainer = Trainer(strategy=strategy, **options)
    trainer.fit(model, loader(make_dataset(), 16), ckpt_path=ckpt_path)
    return trainer, model, recorder.losses


def local_devices(model):
    assert all(isinstance(p, DTensor) for p in model.parameters()), "every parameter should be sharded"
    return {p.to_local().device.type for p in model.parameters()}


def check_plumbing():
    strategy = HSDPStrategy()
    trainer, model, losses = fit(strategy, steps=20, precision="bf16-mixed")
    assert strategy.root_device.type == DEVICE, strategy.root_device
    assert dist.get_backend() == devices.process_group_backend(DEVICE), dist.get_backend()
    assert strategy.device_mesh.device_type == DEVICE
    assert strategy.precision_plugin.device_type == DEVICE
    assert local_devices(model) == {DEVICE}
    assert losses[-1] < losses[0], losses
    return f"backend {dist.get_backend()}, mesh on {strategy.device_mesh.device_type}, loss {losses[0]:.4f} -> {losses[-1]:.4f}"


def check_parity():
    _, plain, plain_losses = fit("auto")
    _, cpu, cpu_losses = fit("auto", device=devices.CPU)
    _, sharded, sharded_losses = fit(HSDPStrategy())
    same_device = max_rel_diff(full_params(sharded), full_params(plain))
    vs_cpu = max_rel_diff(full_params(sharded), full_params(cpu))
    assert same_device < 1e-5, f"HSDP vs plain Lightning on {DEVICE}: max relative difference {same_device:.2e}"
    assert vs_cpu < 1e-4, f"HSDP on {DEVICE} vs the CPU: max relative difference {vs_cpu:.2e}"
    assert max(abs(a - b) for a, b in zip(sharded_losses, cpu_losses)) < 1e-4
    return f"max rel. diff vs plain {DEVICE}: {same_device:.1e}; vs CPU: {vs_cpu:.1e}"


def check_meta_init():
    strategy = HSDPStrategy()
    devices.reset_peak_memory(torch.device(DEVICE, 0) if ON_ACCELERATOR else devices.cpu_device())
    _, model, losses = fit(strategy, steps=10, model=MetaInitModule())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert local_devices(model) == {DEVICE}
    assert losses[-1] < losses[0], losses
    peak = devices.max_memory_allocated(strategy.root_device)
    return f"materialized on {DEVICE}, peak {peak} bytes, loss {losses[0]:.4f} -> {losses[-1]:.4f}"


def check_cpu_offload():
    strategy = HSDPStrategy(cpu_offload=True)
    _, model, losses = fit(strategy, steps=10, precision="bf16-mixed", model=MetaInitModule())
    assert local_devices(model) == {devices.CPU}
    pinned = all(p.to_local().is_pinned() for p in model.parameters())
    assert pinned == ON_ACCELERATOR, f"shards pinned: {pinned}"
    assert losses[-1] < losses[0], losses
    return f"backend {dist.get_backend()}, shards on the host (pinned: {pinned}), loss {losses[0]:.4f} -> {losses[-1]:.4f}"


def check_checkpoint():
    full_path = OUT / "full.ckpt"
    trainer, model, _ = fit(HSDPStrategy(state_dict_type="full"), steps=4)
    trainer.save_checkpoint(full_path)
    expected = full_params(model)
    loaded = RegressionModule.load_from_checkpoint(full_path, map_location=devices.cpu_device())
    assert max_rel_diff(full_params(loaded), expected) == 0.0

    # Resuming is compared with plain Lightning resuming its own checkpoint: Lightning's loop,
    # not hp_lightning, decides which batches a run resumed after max_steps sees next.
    def resumed(strategy, path):
        trainer, _, _ = fit(strategy(), steps=4)
        trainer.save_checkpoint(path)
        return full_params(fit(strategy(), steps=6, ckpt_path=path)[1])

    sharded = resumed(HSDPStrategy, OUT / "sharded.ckpt")
    plain = resumed(lambda: "auto", OUT / "plain.ckpt")
    gap = max_rel_diff(sharded, plain)
    assert gap < 1e-5, f"HSDP resumed from a sharded checkpoint vs plain Lightning resumed: {gap:.2e}"
    assert (OUT / "sharded.ckpt").is_dir()
    return f"full file loads on the CPU exactly; sharded resume matches plain Lightning's (max rel. diff {gap:.1e})"


def check_stats():
    if not ON_ACCELERATOR:
        return "n/a on the CPU (Lightning reports host stats through psutil)"
    from lightning.pytorch.callbacks import DeviceStatsMonitor
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(OUT, name="stats")
    strategy = HSDPStrategy()
    trainer, _, _ = fit(strategy, steps=6, callbacks=[DeviceStatsMonitor()], logger=logger, log_every_n_steps=1)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert any("allocated_bytes.all.current" in c for c in columns), columns[:10]
    reserved_after = devices.memory_stats(strategy.root_device).get("reserved_bytes.all.current", 0)
    return f"{len(columns)} logged columns include allocator stats; reserved after teardown: {reserved_after} bytes"


def check_auto():
    trainer = Trainer(accelerator="auto", devices=1, strategy="hsdp", **{k: v for k, v in trainer_kwargs().items() if k != "accelerator"})
    chosen = type(trainer.accelerator).__name__
    assert trainer.strategy.root_device.type == devices.current_accelerator_type() == DEVICE, chosen
    return f"accelerator='auto' chose {chosen} ({trainer.strategy.root_device})"


print(f"{CHECK}: {globals()['check_' + CHECK]()}")
EOF

for check in plumbing parity meta_init cpu_offload checkpoint stats auto; do
  step "check_$check" 120 "$PYTHON" "$WORK/checks.py" "$DEVICE" "$check" "$OUT_DIR"
done

# ------------------------------------------------------------------ 4. benchmark
cat > "$WORK/bench.py" <<'EOF'
"""Median step time, tokens/s and peak memory of one configuration: python bench.py DEVICE CONFIG OUT_DIR."""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

import hp_lightning
from hp_lightning import HSDPStrategy, devices

DEVICE, CONFIG, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
ON_ACCELERATOR = devices.is_accelerator(DEVICE)
# Big enough to keep an H100-class GPU busy for a few ms per step, small enough for 30 s.
VOCAB, WIDTH, DEPTH, HEADS, SEQ, BATCH = (8192, 1024, 8, 16, 512, 16) if ON_ACCELERATOR else (256, 64, 2, 4, 32, 4)
WARMUP, STEPS = (5, 20) if ON_ACCELERATOR else (2, 6)


class LM(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(DEPTH)
        )
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def training_step(self, batch, batch_idx):
        x = self.emb(batch[:, :-1])
        for block in self.blocks:
            x = block(x, src_mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(Callback):
    def __init__(self) -> None:
        self.times, self._t0 = [], 0.0

    def on_train_batch_start(self, trainer, *args):
        devices.synchronize(trainer.strategy.root_device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, *args):
        devices.synchronize(trainer.strategy.root_device)
        self.times.append(time.perf_counter() - self._t0)


def strategy_for(config):
    if config == "lightning_single":
        return "auto"
    if config == "lightning_fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={nn.TransformerEncoderLayer})
    if config == "hsdp":
        return HSDPStrategy()
    if config == "hsdp_offload":
        return HSDPStrategy(cpu_offload=True)
    raise SystemExit(f"unknown config {config!r}")


seed_everything(0)
data = torch.randint(0, VOCAB, (BATCH * (WARMUP + STEPS), SEQ + 1))
timer = StepTimer()
trainer = Trainer(
    accelerator=DEVICE, devices=1, strategy=strategy_for(CONFIG), precision="bf16-mixed", max_steps=WARMUP + STEPS,
    callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
root = trainer.strategy.root_device
model = LM()
params = sum(p.numel() for p in model.parameters())
if ON_ACCELERATOR:
    devices.reset_peak_memory(torch.device(DEVICE, 0))
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))
step_s = statistics.median(timer.times[WARMUP:])
result = {
    "config": CONFIG,
    "device": str(trainer.strategy.root_device),
    "params_M": round(params / 1e6, 1),
    "step_ms": round(step_s * 1e3, 2),
    "tokens_per_s": round(BATCH * SEQ / step_s),
    "peak_GiB": round((devices.max_memory_allocated(trainer.strategy.root_device) or 0) / 2**30, 3),
}
(OUT / f"bench_{CONFIG}.json").write_text(json.dumps(result))
print(json.dumps(result))
EOF

CONFIGS=(lightning_single hsdp hsdp_offload)
[[ "$DEVICE" == cuda ]] && CONFIGS+=(lightning_fsdp)
for config in "${CONFIGS[@]}"; do
  step "bench_$config" 120 "$PYTHON" "$WORK/bench.py" "$DEVICE" "$config" "$OUT_DIR"
done
"$PYTHON" - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path
rows = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("bench_*.json"))]
if rows:
    print(f"{'config':<18}{'device':<9}{'params':>8}{'step ms':>10}{'tokens/s':>12}{'peak GiB':>10}")
    for r in rows:
        print(f"{r['config']:<18}{r['device']:<9}{r['params_M']:>7}M{r['step_ms']:>10}{r['tokens_per_s']:>12}{r['peak_GiB']:>10}")
EOF

# ------------------------------------------------------------------ 5. host-device syncs per step
# Self-contained: torch.cuda.set_sync_debug_mode("warn") from the third optimizer step on; each
# warning's Python stack names who synchronized (the first frame outside torch). hp_lightning's
# own count per optimizer step must be 0 (one rank: the step agreement has no peers here; its
# host-side gloo path is pinned on CPU by tests/distributed/test_hot_path.py). Lightning's and
# the optimizer's are reported, not judged. HP_CHECK_DEVICE=cpu rehearses it with
# hp_lightning.core.diagnostics.HostReads (reads of tensor values into Python) instead.
cat > "$WORK/syncs.py" <<'EOF'
import json, sys, traceback, warnings
from collections import Counter
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import hp_lightning
from hp_lightning.core.diagnostics import HostReads
from tests.helpers import RegressionModule, loader, make_dataset

DEVICE, OUT = sys.argv[1], Path(sys.argv[2])
TORCH, PACKAGE = str(Path(torch.__file__).parent), str(Path(hp_lightning.__file__).parent)
WARMUP, COUNTED, ACCUMULATE = 2, 4, 2
sites: Counter = Counter()


def who(stack) -> str:
    """The first frame outside torch (and this handler) on the warning's stack."""
    for frame in reversed(stack[:-2]):
        if not frame.filename.startswith(TORCH) and not frame.filename.endswith("warnings.py"):
            owner = "hp_lightning" if frame.filename.startswith(PACKAGE) else "other"
            return f"{owner} {frame.filename.rpartition('site-packages/')[2]}:{frame.lineno}"
    return "torch"


def on_warning(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message).lower():
        sites[who(traceback.extract_stack())] += 1


class Window(Callback):
    """Counts from the start of optimizer step WARMUP to the end of fit."""

    def __init__(self):
        self.reads, self.on = HostReads(), False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.on and trainer.global_step == WARMUP:
            self.on = True
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            else:
                self.reads.__enter__()

    def on_train_end(self, trainer, pl_module):
        if self.on:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            else:
                self.reads.__exit__(None, None, None)
                sites.update(f"hp_lightning {site} {kind}" for kind, site in self.reads.reads)


seed_everything(0)
window = Window()
trainer = Trainer(
    accelerator=DEVICE, devices=1, strategy="hsdp", max_steps=WARMUP + COUNTED, accumulate_grad_batches=ACCUMULATE,
    callbacks=[window], limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)
with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.showwarning = on_warning
    trainer.fit(RegressionModule(), loader(make_dataset(), 8))
ours = sum(n for site, n in sites.items() if site.startswith("hp_lightning"))
result = {
    "device": DEVICE,
    "what": "CUDA synchronizations" if DEVICE == "cuda" else "reads of tensor values (CPU rehearsal)",
    "optimizer_steps_counted": COUNTED,
    "per_optimizer_step_hp_lightning": ours / COUNTED,
    "per_optimizer_step_all": sum(sites.values()) / COUNTED,
    "sites": dict(sites.most_common()),
}
(OUT / "syncs.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
sys.exit(0 if ours == 0 else 1)
EOF
step syncs_per_step 180 "$PYTHON" "$WORK/syncs.py" "$DEVICE" "$OUT_DIR"

echo "---- $(( SECONDS - START )) s in all on $DEVICE"
if (( ${#FAILED[@]} )); then
  echo "FAILED: ${FAILED[*]}"
  exit 1
fi
echo "ALL PASSED"
