"""examples/fabric_train.py end to end: trains, saves, resumes on another mesh, and Lightning loads it.

The ranks start as torchrun would start them (warm, :func:`tests.helpers.run_script_in_ranks`);
Fabric's own launcher is exercised by ``tests/faults/test_fabric_faults.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from examples.gpt import VOCAB_SIZE
from tests.helpers import run_script_in_ranks
from tests.integration.test_cli import REPO

SCRIPT = REPO / "examples" / "fabric_train.py"
#: A model and corpus small enough for seconds per run.
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--max-chars", "20000", "--val-windows", "16"]


@pytest.mark.slow
def test_fabric_example_trains_resumes_on_another_mesh_and_loads_in_lightning(tmp_path):
    """HSDP (1, 2) for 6 steps, sharded save; FSDP 2 resumes it to step 8, full save; one process samples from it."""
    from examples.sample import load_model, sample

    run_script_in_ranks(SCRIPT, ["--devices", "2", "--steps", "6", "--eval-every", "3", "--out", "first", *TINY], tmp_path, 2)
    first = json.loads((tmp_path / "first" / "fabric_summary.json").read_text())
    sharded = tmp_path / "first" / "fabric.ckpt"
    assert (first["start_step"], first["end_step"], first["mesh"]) == (0, 6, [1, 2])
    assert len(list(sharded.glob("*.distcp"))) == 2  # one shard file per rank
    assert [step for step, _ in first["val_loss"]] == [3, 6]
    untrained = math.log(VOCAB_SIZE)
    assert first["losses"][0][1] == pytest.approx(untrained, abs=0.2)
    assert first["losses"][-1][1] < first["losses"][0][1] - 0.15, first["losses"]

    resume = ["--devices", "2", "--mesh-shape", "2", "--steps", "8", "--eval-every", "0", "--state-dict-type", "full"]
    run_script_in_ranks(SCRIPT, [*resume, "--resume", str(sharded), "--out", "second", *TINY], tmp_path, 2)
    second = json.loads((tmp_path / "second" / "fabric_summary.json").read_text())
    assert (second["start_step"], second["end_step"], second["mesh"]) == (6, 8, [2])
    # Training continued from the trained model and optimizer, not from a fresh one.
    assert second["losses"][0][1] < first["losses"][0][1] - 0.15, (first["losses"], second["losses"])

    # The full file is an ordinary Lightning checkpoint: load_from_checkpoint on one CPU process.
    full = tmp_path / "second" / "fabric.ckpt"
    raw = torch.load(full, map_location="cpu", weights_only=False)
    assert raw["step"] == 8 and raw["hyper_parameters"]["n_layer"] == 2
    model = load_model(full)
    (text,) = sample(model, ["def "], max_new_tokens=20)
    assert text.startswith("def ") and len(text) == 24
