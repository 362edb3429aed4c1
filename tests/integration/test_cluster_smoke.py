"""Smoke test of the simulated 2-node cluster harness (``make bench-cluster``): a few steps end to end.

Asserts what the harness must guarantee, never speed: intra-node traffic stays off the
inter-node link, inter-node bytes are counted for every configuration, results are written, and
no namespace is left behind. Needs root and iproute2 (``ip``, ``tc``); elsewhere it is skipped
with the reason, and ``python -m benchmarks.cluster`` itself exits with code 2 saying what is
missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import cluster_net
from benchmarks.cluster import run
from benchmarks.cluster_settings import CLUSTER_SMOKE

MISSING = cluster_net.missing_requirements()
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason="simulated cluster needs " + "; ".join(MISSING) + " (runs as root with iproute2)"
)


@pytest.mark.slow
def test_cluster_harness_counts_inter_node_bytes_and_cleans_up(tmp_path: Path) -> None:
    summary = run(CLUSTER_SMOKE, tmp_path)

    # The namespaces are gone (this process owned them).
    assert summary["network"]["leftover_namespaces"] == []
    assert cluster_net.leftover_namespaces(os.getpid()) == []

    # Routing: an all-reduce inside each node leaves the link (almost) untouched, one across nodes crosses it.
    for check in summary["link_check"]["node 0"].values():
        payload = check["payload_bytes"] * check["groups_per_kind"]
        assert check["intra_loopback_bytes"] >= payload
        assert check["intra_link_bytes"] < 0.05 * payload, check
        assert check["cross_link_bytes"] >= payload, check

    # Every configuration was timed and its inter-node bytes counted; HSDP keeps most of them inside the nodes.
    rows = summary["speeds"]["1G"]["rows"]
    assert set(rows) == set(CLUSTER_SMOKE.only)
    for row in rows.values():
        assert row["samples"] == CLUSTER_SMOKE.timed_steps and row["step_s"] > 0
        assert row["link_bytes"] > 0 and row["loopback_bytes_node0"] > 0
    fsdp, hsdp = rows["raw_fsdp2[FSDP 4, k=1]"], rows["hp_lightning[HSDP 2x2, k=1]"]
    assert hsdp["link_bytes"] < fsdp["link_bytes"]

    assert "## Targets" in (tmp_path / "cluster.md").read_text()
    assert json.loads((tmp_path / "cluster.json").read_text())["speeds"]["1G"]["rows"]
    assert json.loads((tmp_path / "raw" / "cluster_ranks.json").read_text())["ranks"]
    assert (tmp_path / "cluster_step_time_and_link.png").stat().st_size > 1000
