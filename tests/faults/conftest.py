"""Print the fault matrix's measurements (time from fault to the last process's end) after the run."""

from __future__ import annotations

from tests.faults.harness import MEASURED


def pytest_terminal_summary(terminalreporter) -> None:
    if not MEASURED:
        return
    terminalreporter.section("fault matrix: seconds from the fault to the end of every process")
    for test, bound, seconds, code in MEASURED:
        terminalreporter.write_line(f"{seconds:6.1f} s  (bound {bound:4.0f} s)  exit {code!s:>4}  {test}")
