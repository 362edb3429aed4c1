"""Was the machine busy while a benchmark ran? Load average and CPU time of other processes.

The 1-minute load average alone cannot tell: during a run it counts the benchmark's own ranks
(4 runnable ranks on 2 cores read as "load 4"). So :class:`LoadMonitor` records three things:

* the load average before the run starts and after it ends (and the highest seen in between,
  sampled every few seconds) — the familiar figure;
* the CPU time the whole machine spent busy over the run (``/proc/stat``) minus the CPU time
  of this benchmark's processes — what *other* processes used, in cores on average. This
  benchmark's share is its whole process tree, each process counted once: ``os.times()`` (this
  process and the children it reaped, with everything those had reaped) plus, from two snapshots
  of ``/proc/<pid>/stat`` (start and end), the descendants still there at the end (ranks a
  forkserver started, a launcher not yet reaped) with what they had reaped themselves. A
  descendant orphaned before the end (its parent gone) counts as *other*;
* the CPU time stolen by the hypervisor (``steal`` in ``/proc/stat``), on a VM.

A run is marked **busy** when other processes used more than a quarter of the cores on
average, or the load average before the run already exceeded half the cores. Absolute times of
a busy run are noise; ratios between configurations timed in interleaved rounds much less so.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

#: Other processes' average CPU use (in cores, as a share of all cores) above which a run is busy.
BUSY_OTHER_SHARE = 0.25
#: Load average before the run (as a share of the cores) above which a run is busy.
BUSY_LOAD_SHARE = 0.5


def _proc_stat() -> Optional[dict[str, int]]:
    """Jiffies of the whole machine by state (first line of /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {name: int(value) for name, value in zip(names, fields[1:])}


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _process_table() -> dict[int, tuple[int, float, int]]:
    """Every live (or unreaped) process: pid -> (parent pid, CPU seconds of itself and of the children it
    reaped (utime + stime + cutime + cstime), start time in clock ticks since boot)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces: split after it
        # fields[0] is field 3 of proc(5) (state): ppid is field 4, utime..cstime 14-17, starttime 22.
        cpu = sum(int(fields[i]) for i in (11, 12, 13, 14)) / hz
        table[int(entry)] = (int(fields[1]), cpu, int(fields[19]))
    return table


def _descendants(root: int) -> dict[int, tuple[float, int]]:
    """Every process below ``root`` now: pid -> (CPU seconds with its reaped children, start time)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, tuple[float, int]] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1:]
        todo.extend(children.get(pid, ()))
    return found


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


@dataclass
class LoadMonitor:
    """Context manager around a benchmark run; :meth:`summary` says whether the machine was busy."""

    interval_s: float = 5.0
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    load_before: Optional[float] = None
    load_after: Optional[float] = None
    load_max: Optional[float] = None
    _stat_before: Optional[dict[str, int]] = None
    _stat_after: Optional[dict[str, int]] = None
    _own_before: float = 0.0
    _own_after: float = 0.0
    _wall_before: float = 0.0
    _wall_after: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None
    #: Descendants at the start and at the end: pid -> (CPU seconds with their reaped children, start time).
    _tree_before: dict[int, tuple[float, int]] = field(default_factory=dict)
    _tree_after: dict[int, tuple[float, int]] = field(default_factory=dict)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            load = load_average()
            if load is not None:
                self.load_max = max(self.load_max or 0.0, load)

    def _tree_cpu_s(self) -> float:
        """CPU seconds the descendants still there at the end used during the run (each process once)."""
        total = 0.0
        for pid, (cpu, started) in self._tree_after.items():
            before = self._tree_before.get(pid)
            total += cpu - (before[0] if before is not None and before[1] == started else 0.0)
        return total

    def __enter__(self) -> LoadMonitor:
        self.load_before = self.load_max = load_average()
        self._tree_before = _descendants(os.getpid())  # what they used before the run is not the run's
        self._stat_before, self._own_before, self._wall_before = _proc_stat(), _own_cpu_s(), time.monotonic()
        self._thread = threading.Thread(target=self._sample, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.load_after = load_average()
        if self.load_after is not None:
            self.load_max = max(self.load_max or 0.0, self.load_after)
        self._tree_after = _descendants(os.getpid())
        self._stat_after, self._own_after, self._wall_after = _proc_stat(), _own_cpu_s(), time.monotonic()

    def summary(self) -> dict[str, Any]:
        """Load figures, CPU shares and the verdict (``busy``) with a one-line explanation."""
        wall = max(self._wall_after - self._wall_before, 1e-9)
        out: dict[str, Any] = {"cores": self.cores, "load_before": self.load_before, "load_after": self.load_after,
                               "load_max": self.load_max, "wall_s": wall}
        other = steal = None
        if self._stat_before and self._stat_after:
            hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
            delta = {k: (self._stat_after[k] - self._stat_before[k]) / hz for k in self._stat_before}
            busy_s = delta["user"] + delta["nice"] + delta["system"]
            own_s = self._own_after - self._own_before + self._tree_cpu_s()
            other = max(busy_s - own_s, 0.0) / wall
            steal = delta.get("steal", 0.0) / wall
            out.update(own_cores=own_s / wall, other_cores=other, steal_cores=steal)
        reasons = []
        if other is not None and other > BUSY_OTHER_SHARE * self.cores:
            reasons.append(f"other processes used {other:.2f} of {self.cores} cores on average")
        if self.load_before is not None and self.load_before > BUSY_LOAD_SHARE * self.cores:
            reasons.append(f"the load average was already {self.load_before:.2f} before the run")
        if steal is not None and steal > BUSY_OTHER_SHARE * self.cores:
            reasons.append(f"the hypervisor took {steal:.2f} cores (steal time)")
        out["busy"] = bool(reasons)
        out["busy_reasons"] = reasons
        return out


def describe_load(summary: dict[str, Any]) -> str:
    """One line for a report's Machine section."""
    def fmt(value: Optional[float]) -> str:
        return "?" if value is None else f"{value:.2f}"

    line = (f"1-min load average {fmt(summary['load_before'])} before, {fmt(summary['load_after'])} after, "
            f"{fmt(summary['load_max'])} at most during the run")
    if "other_cores" in summary:
        line += (f"; CPU use on average: this benchmark {summary['own_cores']:.2f} cores, other processes "
                 f"{summary['other_cores']:.2f}, stolen by the hypervisor {summary['steal_cores']:.2f} (of {summary['cores']})")
    return line


def busy_banner(summary: dict[str, Any]) -> list[str]:
    """Markdown lines that mark a busy run at the top of a report (none for a quiet one)."""
    if not summary.get("busy"):
        return []
    return [
        "> **BUSY MACHINE: taken while other work shared it** (" + "; ".join(summary["busy_reasons"]) + "). "
        "Absolute times are noisy; compare configurations through the ratios of interleaved rounds, and read "
        "the per-round ranges next to them. Rerun on an idle machine to judge a few-percent target.",
        "",
    ]
