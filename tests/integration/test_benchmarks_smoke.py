"""Smoke test of the benchmark harness: one tiny run end to end, its table, JSON and plots.

Asserts structure and that measured values are positive; never speed (timings are the
benchmark's business, printed as PASS/FAIL lines, not test assertions).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.run import run
from benchmarks.settings import HP, RAW, SMOKE, ModelShape

#: Two configurations, no accumulation, one sweep model: the least that exercises every stage.
TINY = replace(
    SMOKE,
    families=(RAW, HP),
    accumulations=(1,),
    rounds=1,
    warmup_steps=1,
    timed_steps=2,
    measure_steps=2,
    sweep_shapes=(ModelShape(n_layer=2, n_embd=32, n_head=2, block_size=8),),
    formula_world_sizes=(1, 2, 4),
)


@pytest.mark.slow
def test_benchmark_runs_end_to_end_and_writes_results(tmp_path: Path) -> None:
    summary = run(TINY, "cpu", tmp_path)

    rows = summary["worlds"]["2"]["rows"]
    assert {row["family"] for row in rows.values()} == {RAW, HP}
    for row in rows.values():
        assert row["samples"] == TINY.timed_steps
        for key in ("step_s", "tokens_per_s", "peak_bytes", "state_bytes", "collective_calls", "collective_bytes"):
            assert row[key] > 0, (row["name"], key, row[key])
        assert row["ratios"]["step"] > 0
    raw = next(row for row in rows.values() if row["family"] == RAW)
    assert raw["ratios"]["step"] == pytest.approx(1.0)

    families = {row["family"] for row in summary["sweep"]}
    assert {RAW, HP} <= families
    for row in summary["sweep"]:
        assert row["resident_bytes"] > 0 and row["step_peak_bytes"] > 0 and row["formula_bytes"] > 0

    assert [t["verdict"] for t in summary["targets"]] and all(t["verdict"] in {"PASS", "FAIL", "N/A"} for t in summary["targets"])

    table = (tmp_path / "results.md").read_text()
    for heading in ("## Machine", "## Targets", "## World size 2", "## Model-state memory per rank (sweep)", "## Plots"):
        assert heading in table
    assert "| raw FSDP2 loop (FSDP 2) | 1 |" in table
    assert json.loads((tmp_path / "results.json").read_text())["worlds"]["2"]["rows"]
    assert json.loads((tmp_path / "raw" / "ranks.json").read_text())["ranks"][0][0]["times"]
    for name in summary["plots"]:
        assert (tmp_path / name).stat().st_size > 1000
