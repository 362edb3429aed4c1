"""Run torchft's lighthouse: the one small server every replica group asks for a quorum.

It holds no training state (only heartbeats and quorums), so it runs cheaply beside the job. It
binds to loopback by default: across machines bind an address the nodes reach on a trusted network
(the protocol has no authentication). ``python -m hp_lightning.ft lighthouse`` becomes torchft's
``torchft_lighthouse`` with two defaults of ours: the loopback bind and one replica group for a quorum.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence
from typing import Any

from hp_lightning.core.fault_tolerance import require_torchft

__all__ = ["DEFAULT_BIND", "command", "main", "reachable_address", "start_lighthouse"]

DEFAULT_BIND = "127.0.0.1:29510"


def start_lighthouse(
    bind: str = DEFAULT_BIND,
    *,
    min_replicas: int = 1,
    join_timeout_ms: int | None = None,
    quorum_tick_ms: int | None = None,
    heartbeat_timeout_ms: int | None = None,
) -> Any:
    """Start torchft's ``LighthouseServer`` in this process; ``.address()`` is what groups connect to.

    Args:
        bind: ``host:port`` to listen on (port 0: any free one).
        min_replicas: fewest replica groups that form a quorum.
        join_timeout_ms: how long a quorum waits for groups that were alive to rejoin.
        quorum_tick_ms: how often the lighthouse re-evaluates the quorum.
        heartbeat_timeout_ms: silence after which a group counts as dead (the survivors' stall).

    Raises:
        ValueError: for a malformed ``bind`` or ``min_replicas`` < 1.
        ImportError: without torchft.
    """
    _check_bind(bind)
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"lighthouse --min-replicas expects an int >= 1; got {min_replicas!r}.")
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def reachable_address(bind: str, served: str) -> str:
    """The address groups should use: the bound host with the port ``served`` (``LighthouseServer.address()``).

    torchft reports the machine's host name, where a loopback-bound lighthouse is not reachable;
    only a wildcard bind (``0.0.0.0``, ``::``) is reachable by it.
    """
    host = bind.rpartition(":")[0].strip("[]")
    port = served.rpartition(":")[2]
    if host in ("0.0.0.0", "::", ""):
        return served
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_bind(bind: str) -> None:
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"lighthouse --bind expects host:port (e.g. {DEFAULT_BIND}); got {bind!r}.")


def command(argv: Sequence[str]) -> list[str]:
    """``torchft_lighthouse``'s command line for these options: torchft's (``--min_replicas``, ...), also
    with dashes (``--min-replicas``), binding loopback and 1 replica group unless told otherwise.

    Raises:
        ValueError: a malformed ``--bind``.
        ImportError: without torchft (its command is not installed).
    """
    args: list[str] = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        args += [f"--{name[2:].replace('-', '_')}", *([value] if sep else [])] if arg.startswith("--") else [arg]
    args = ([] if "--bind" in args else ["--bind", DEFAULT_BIND]) + args + ([] if "--min_replicas" in args else ["--min_replicas", "1"])
    _check_bind(args[args.index("--bind") + 1])
    binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or shutil.which("torchft_lighthouse")
    if binary is None:
        raise ImportError("the lighthouse is torchft's torchft_lighthouse command, which is not installed: pip install 'hp-lightning[ft]'.")
    return [binary, *args]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hp_lightning.ft lighthouse ...``: say where groups connect, then become ``torchft_lighthouse``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] != ["lighthouse"]:
            raise ValueError("usage: python -m hp_lightning.ft lighthouse [--bind HOST:PORT] [--min-replicas N] [torchft_lighthouse's options]")
        line = command(args[1:])
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bind = line[line.index("--bind") + 1]
    address = reachable_address(bind, f"http://{socket.gethostname()}:{bind.rpartition(':')[2]}")
    print(f"lighthouse (torchft_lighthouse) on {bind}; groups connect with TORCHFT_LIGHTHOUSE={address}", flush=True)
    os.execv(line[0], line)
