"""The suite's time budget: each slow test's allowance, checked at the end of every run.

``tests/time_budget.toml`` lists the seconds each slow test may take (setup, call and teardown
together, so a launch fixture counts on the first test that uses it) and the whole suite's
allowance on 2 idle cores. At the end of a run this plugin prints one line for every test over
its allowance, and, for a full run (``pytest tests`` with no selection), the total against the
suite's allowance:

    time budget: 412.3 s of 480 s (86 %); 2 tests over their allowance

It reports and never fails the run: these machines are noisy, and a slow neighbour is no bug.
Every change's closing note quotes that line. A test not listed may take ``default_seconds``.
With ``HP_TIME_BUDGET_RECORD=durations.json`` set, each test's measured seconds are also written
there (what the allowances were set from: the idle run's time plus headroom).
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BUDGET_FILE = Path(__file__).with_name("time_budget.toml")
TESTS_ROOT = Path(__file__).resolve().parent


@dataclass
class Budget:
    """The allowances read from :data:`BUDGET_FILE`."""

    total_seconds: float
    default_seconds: float
    tests: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path = BUDGET_FILE) -> Budget:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        return cls(float(raw["total_seconds"]), float(raw["default_seconds"]), {k: float(v) for k, v in raw.get("tests", {}).items()})

    def allowance(self, nodeid: str) -> float:
        """The seconds ``nodeid`` may take: its own entry, else the first glob entry that matches, else the default."""
        if nodeid in self.tests:
            return self.tests[nodeid]
        for pattern, seconds in self.tests.items():
            if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(nodeid, pattern):
                return seconds
        return self.default_seconds


class TimeBudget:
    """Collects each test's duration and prints the budget's verdict in the terminal summary."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.budget = Budget.read()
        self.durations: dict[str, float] = {}
        self.started = time.monotonic()
        self.deselected = 0

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Run the files with the largest allowances first (each file's tests stay in their order).

        With ``make test``'s two workers (pytest-xdist, ``--dist loadfile --no-loadscope-reorder``)
        a file is the unit of work, handed out in this order: the longest first, so that both
        workers finish together instead of one waiting on a long file that came last.
        """
        by_file: dict[str, list[pytest.Item]] = {}
        for item in items:
            by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
        weight = {path: sum(self.budget.allowance(item.nodeid) for item in group) for path, group in by_file.items()}
        items[:] = [item for path in sorted(by_file, key=lambda p: (-weight[p], p)) for item in by_file[path]]

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def _full_run(self) -> bool:
        """``pytest tests`` (or no path) with nothing deselected or filtered out."""
        option = self.config.option
        if self.deselected or getattr(option, "keyword", "") or getattr(option, "markexpr", "") or getattr(option, "lf", False):
            return False
        args = [Path(a.split("::")[0]).resolve() for a in self.config.args] or [Path.cwd()]
        return all(a in (TESTS_ROOT, TESTS_ROOT.parent) for a in args)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        elapsed = time.monotonic() - self.started
        record = os.environ.get("HP_TIME_BUDGET_RECORD")
        if record:
            Path(record).write_text(json.dumps({"elapsed": elapsed, "tests": self.durations}, indent=1))
        over = sorted(
            ((seconds, self.budget.allowance(nodeid), nodeid) for nodeid, seconds in self.durations.items()
             if seconds > self.budget.allowance(nodeid)),
            reverse=True,
        )
        terminalreporter.section("time budget (tests/time_budget.toml)")
        for seconds, allowed, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s over its {allowed:5.1f} s: {nodeid}")
        tests = f"{len(over)} test{'s' if len(over) != 1 else ''} over {'its' if len(over) == 1 else 'their'} allowance"
        if self._full_run():
            share = 100 * elapsed / self.budget.total_seconds
            terminalreporter.write_line(f"time budget: {elapsed:.1f} s of {self.budget.total_seconds:.0f} s ({share:.0f} %); {tests}")
        else:
            terminalreporter.write_line(f"time budget: partial run, {elapsed:.1f} s (the {self.budget.total_seconds:.0f} s total applies to a full run); {tests}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TimeBudget(config), "hp_time_budget")


def allowances_from(record: Path, headroom: float = 1.3) -> str:
    """The ``[tests]`` table for :data:`BUDGET_FILE` from a run recorded with ``HP_TIME_BUDGET_RECORD``:
    every test that took more than the default allowance, at its time times ``headroom``, rounded up."""
    budget = Budget.read()
    measured = json.loads(Path(record).read_text())["tests"]
    lines = ["[tests]"]
    for nodeid, seconds in sorted(measured.items(), key=lambda kv: -kv[1]):
        if seconds * headroom > budget.default_seconds:
            lines.append(f'"{nodeid}" = {-(-seconds * headroom * 2 // 1) / 2:.1f}')
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m tests.time_budget durations.json: print the allowances of a recorded run
    import sys

    print(allowances_from(Path(sys.argv[1])), end="")
