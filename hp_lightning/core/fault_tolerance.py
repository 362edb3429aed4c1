"""The fault-tolerance option (:class:`FaultTolerance`): which replica group this job is, and how it finds the others.

A replica group is one whole copy of the model, sharded over its own ranks (its own job, its own
rendezvous). Groups find each other through torchft's *lighthouse*, which forms a quorum before
every optimizer step. Everything here is validated when the config is built, before any socket or
process group exists, so a typo fails on every rank alike instead of hanging one of them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "FROM_ENV", "FaultTolerance", "GROUP_ENV", "LIGHTHOUSE_ENV", "check_accumulation_mode", "check_lighthouse_reachable",
    "require_torchft",
]

#: torchft's own environment variable naming the lighthouse (``http://host:port``).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

#: ``fault_tolerance="env"``: the fields read from the environment of each replica group's job.
GROUP_ENV = {
    "replica_group": "HP_FT_REPLICA_GROUP",
    "num_replica_groups": "HP_FT_NUM_REPLICA_GROUPS",
    "min_replicas": "HP_FT_MIN_REPLICAS",
}
#: The option value that reads :data:`GROUP_ENV` (one config file serves every replica group).
FROM_ENV = "env"

_EXTRA_HINT = "pip install 'hp-lightning[ft]'"


def require_torchft() -> Any:
    """Import torchft, or raise an ``ImportError`` naming the extra that brings it.

    Raises:
        ImportError: torchft is not installed (or fails to import).
    """
    try:
        import torchft
    except ImportError as exc:
        raise ImportError(
            f"fault_tolerance needs torchft (PyTorch's fault-tolerance library), which is not installed: {exc}. "
            f"Install the extra: {_EXTRA_HINT} (or `pip install torchft`), or drop the fault_tolerance option."
        ) from exc
    return torchft


def _require_int(owner: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}({name}=...) expects an int >= {minimum}; got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{owner}({name}=...) expects an int >= {minimum}; got {value}.")
    return value


def _require_seconds(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}({name}=...) expects a number of seconds > 0; got {type(value).__name__} {value!r}.")
    if not value > 0:
        raise ValueError(f"{owner}({name}=...) expects a number of seconds > 0; got {value}.")
    return float(value)


def _parse_lighthouse(owner: str, address: str, origin: str) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None:
        raise ValueError(
            f"{owner}(lighthouse=...) expects the lighthouse address as 'http://host:port' ({origin}); got "
            f"{address!r}. Start one with `python -m hp_lightning.ft lighthouse --bind 127.0.0.1:29510` and pass "
            f"the address it prints."
        )
    return parsed.hostname, port


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """Fault-tolerant HSDP across replica groups on torchft.

    Inside a group, FSDP2 shards over the group's own ranks; across groups torchft's ``Manager``
    all-reduces the gradients over the groups in the current quorum, and commits a step only when
    every rank of the group agrees. A dead group costs the survivors one failed step and a
    heartbeat timeout; a returning group copies the whole training state from a live peer.

    Args:
        replica_group: this job's replica group, ``0 <= replica_group < num_replica_groups``.
        num_replica_groups: how many replica groups the run has at most (the data is split by the
            participants of each step, so fewer may train at a time).
        min_replicas: fewest groups that may commit a step. 1 keeps training on one survivor;
            higher refuses to step (and waits) with fewer.
        lighthouse: the lighthouse address ``http://host:port``; None reads ``TORCHFT_LIGHTHOUSE``.
        quorum_timeout: seconds a quorum may take (must exceed a step's time, or healthy groups
            are dropped).
        timeout: seconds for the cross-group collectives, the commit vote and the state transfer
            while healing.
        connect_timeout: seconds to reach the lighthouse and the peers' managers; the lighthouse
            must answer within it at setup, or setup fails with that error (under torchrun the
            job then ends instead of restarting: a wrong address fails every attempt alike).
        join_timeout: seconds a group restarted in place by torchrun waits for a lighthouse that
            answered earlier in the same run (one restarting itself, most likely) before it fails
            with an error naming the address and ends the job.
        init_sync: at step 0, every group but the quorum's first copies that one's state, so all
            start identical. Turn off only when every group initializes identically (same seed):
            it saves one state transfer.
        manager_port: port of this group's manager server (group rank 0), 0 = any free port.
        hostname: the address group rank 0 advertises to the lighthouse and the other groups;
            None: ``socket.gethostname()`` (torchft's default, and always its healing server's),
            which must then resolve to an address the other groups reach.
    """

    replica_group: int
    num_replica_groups: int
    min_replicas: int = 1
    lighthouse: str | None = None
    quorum_timeout: float = 60.0
    timeout: float = 60.0
    connect_timeout: float = 10.0
    join_timeout: float = 300.0
    init_sync: bool = True
    manager_port: int = 0
    hostname: str | None = None

    def __post_init__(self) -> None:
        owner = "FaultTolerance"
        _require_int(owner, "num_replica_groups", self.num_replica_groups, 1)
        _require_int(owner, "replica_group", self.replica_group, 0)
        if self.replica_group >= self.num_replica_groups:
            raise ValueError(
                f"{owner}(replica_group={self.replica_group}) is out of range for num_replica_groups="
                f"{self.num_replica_groups}: expected 0 <= replica_group < {self.num_replica_groups}. Give each "
                f"replica group's job its own index (e.g. from SLURM_HET_GROUP or a launch argument)."
            )
        _require_int(owner, "min_replicas", self.min_replicas, 1)
        if self.min_replicas > self.num_replica_groups:
            raise ValueError(
                f"{owner}(min_replicas={self.min_replicas}) exceeds num_replica_groups={self.num_replica_groups}: no "
                f"quorum could ever commit. Use 1 <= min_replicas <= num_replica_groups."
            )
        if self.lighthouse is not None and not isinstance(self.lighthouse, str):
            raise TypeError(
                f"{owner}(lighthouse=...) expects 'http://host:port' or None (read {LIGHTHOUSE_ENV}); got "
                f"{type(self.lighthouse).__name__} {self.lighthouse!r}."
            )
        if isinstance(self.lighthouse, str):
            _parse_lighthouse(owner, self.lighthouse, "given")
        for name in ("quorum_timeout", "timeout", "connect_timeout", "join_timeout"):
            object.__setattr__(self, name, _require_seconds(owner, name, getattr(self, name)))
        if not isinstance(self.init_sync, bool):
            raise TypeError(f"{owner}(init_sync=...) expects a bool; got {type(self.init_sync).__name__} {self.init_sync!r}.")
        _require_int(owner, "manager_port", self.manager_port, 0)
        if self.manager_port > 65535:
            raise ValueError(f"{owner}(manager_port=...) expects a port in [0, 65535]; got {self.manager_port}.")
        if self.hostname is not None and (not isinstance(self.hostname, str) or not self.hostname):
            raise TypeError(f"{owner}(hostname=...) expects a non-empty host name or address, or None; got {self.hostname!r}.")
        require_torchft()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultTolerance:
        """The option from ``HP_FT_REPLICA_GROUP``, ``HP_FT_NUM_REPLICA_GROUPS`` (and optionally
        ``HP_FT_MIN_REPLICAS``); the lighthouse from ``TORCHFT_LIGHTHOUSE`` when it is used.

        Raises:
            ValueError: a required variable is missing or not an integer.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, variable in GROUP_ENV.items():
            raw = environ.get(variable)
            if raw is None or raw == "":
                if field == "min_replicas":
                    continue
                raise ValueError(
                    f"fault_tolerance={FROM_ENV!r} reads this job's replica group from the environment, but {variable} is "
                    f"not set. Export {GROUP_ENV['replica_group']}=<0..N-1> and {GROUP_ENV['num_replica_groups']}=<N> in "
                    f"each replica group's launch (or give fault_tolerance as a dict of FaultTolerance's fields)."
                )
            try:
                values[field] = int(raw)
            except ValueError:
                raise ValueError(f"fault_tolerance={FROM_ENV!r}: {variable}={raw!r} is not an integer.") from None
        return cls(**values)

    @classmethod
    def from_value(cls, value: FaultTolerance | dict[str, Any] | str | None) -> FaultTolerance | None:
        """The option as users and YAML give it: an instance, a plain dict of its fields, ``"env"``
        (:meth:`from_env`), or None (off).

        Raises:
            TypeError: for any other type, or a dict with unknown keys.
            ValueError: for ``"env"`` without the variables, or any other string.
        """
        if value is None or isinstance(value, FaultTolerance):
            return value
        if isinstance(value, str):
            if value != FROM_ENV:
                raise ValueError(
                    f"fault_tolerance expects a dict of FaultTolerance's fields, {FROM_ENV!r} (read {sorted(GROUP_ENV.values())}) "
                    f"or None; got the string {value!r}."
                )
            return cls.from_env()
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise TypeError(f"fault_tolerance got unknown key(s) {unknown}; expected some of {sorted(known)}.")
            return cls(**value)
        raise TypeError(
            f"fault_tolerance expects a FaultTolerance, a dict of its fields, {FROM_ENV!r} or None; got {type(value).__name__}."
        )

    def lighthouse_address(self) -> str:
        """The lighthouse address: the field, else ``TORCHFT_LIGHTHOUSE``.

        Raises:
            ValueError: neither is set, or the value is not ``http://host:port``.
        """
        if self.lighthouse is not None:
            return self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}"
        address = os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                f"FaultTolerance(lighthouse=None) reads the lighthouse address from {LIGHTHOUSE_ENV}, which is not "
                f"set. Start one (`python -m hp_lightning.ft lighthouse --bind 127.0.0.1:29510`) and pass "
                f"lighthouse='http://127.0.0.1:29510' or export {LIGHTHOUSE_ENV}."
            )
        _parse_lighthouse("FaultTolerance", address, f"from {LIGHTHOUSE_ENV}")
        return address if "://" in address else f"http://{address}"

    def replica_id(self) -> str:
        """The group's name at the lighthouse; torchft appends a fresh UUID per (re)start."""
        return f"hp_replica_group_{self.replica_group}"


def check_lighthouse_reachable(address: str, timeout: float) -> None:
    """Wait until the lighthouse accepts a TCP connection, for at most ``timeout`` seconds.

    Raises:
        ConnectionError: nothing listens at ``address`` within ``timeout`` (its cause: the last connection error).
    """
    host, port = _parse_lighthouse("FaultTolerance", address, "resolved")
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"FaultTolerance: no lighthouse reachable at {address} within connect_timeout={timeout:g}s ({last}). "
                f"Start it first (`python -m hp_lightning.ft lighthouse --bind {host}:{port}`), check the address "
                f"(lighthouse=... or {LIGHTHOUSE_ENV}) and that the port is open, or raise connect_timeout."
            ) from last
        time.sleep(0.1)


def check_accumulation_mode(mode: str, accumulate_grad_batches: int | None = None) -> None:
    """Refuse accumulation windows whose non-final micro-batches would communicate under fault tolerance.

    torchft's cross-group average runs in FSDP2's all-reduce hook, after every reduce-scatter; only
    ``accumulation_mode="skip"`` (no reduce-scatter before the window's last micro-batch) makes it
    run once per window, on the window's whole gradient, so that a group lost mid-window leaves the
    window uncommitted rather than partly averaged. ``accumulate_grad_batches`` None (not known
    yet, at the strategy's construction) is checked as if accumulating.

    Raises:
        ValueError: for a mode other than ``"skip"`` where a window accumulates.
    """
    if mode == "skip" or (accumulate_grad_batches is not None and accumulate_grad_batches <= 1):
        return
    window = "" if accumulate_grad_batches is None else f" with accumulate_grad_batches={accumulate_grad_batches}"
    raise ValueError(
        f"fault_tolerance{window} needs accumulation_mode='skip' (the cross-group average once per accumulation window, "
        f"on the whole window's gradient); got accumulation_mode={mode!r}. Set HSDPStrategy(accumulation_mode='skip') "
        f"and keep it during fit (GradientAccumulationSync changes it)."
    )
