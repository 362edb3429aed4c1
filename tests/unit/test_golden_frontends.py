"""Proof that a refactor of the front ends changed nothing users see (issue 26, item 7).

``tests/golden/frontends.json`` was first written (now by ``make generate``, ``scripts/generate.py``) before the
options and strategies were reorganized: both front ends' constructor signatures, and for every
registered strategy name and every YAML in ``examples/configs/`` the compared settings, the
sharding plan and the mesh layout. Regenerate it only for an intended change, and say which.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "scripts" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_front_ends_resolve_exactly_what_the_golden_file_holds():
    script = _script()
    expected = json.loads(script.GOLDEN.read_text())
    actual = json.loads(json.dumps(script.golden(), sort_keys=True))
    assert set(actual) == set(expected)
    for section in expected:
        for key in sorted(set(expected[section]) | set(actual[section])):
            assert actual[section].get(key) == expected[section].get(key), f"{section}[{key!r}] changed (intended? then `make generate`)"
    # What it covers: both signatures, three registered names per front end, every YAML per front end.
    assert len(expected["signatures"]["trainer"]) > 40 and len(expected["registered"]) == 6
    assert len(expected["configs"]) == 2 * len(list((ROOT / "examples" / "configs").glob("*.yaml")))
