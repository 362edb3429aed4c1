"""Run torchft's lighthouse: the one small server every replica group asks for a quorum.

It holds no training state, only who is alive (heartbeats) and each step's quorum, so it is cheap
to run beside the job (a login node, the first node). It binds to loopback by default: a run
across machines must bind an address the other nodes reach (``--bind 0.0.0.0:29510``) on a
network it trusts; the protocol has no authentication.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from hp_lightning.ft.config import require_torchft

__all__ = ["DEFAULT_BIND", "main", "reachable_address", "start_lighthouse"]

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
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"lighthouse --bind expects host:port (e.g. {DEFAULT_BIND}); got {bind!r}.")
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
    """The address groups should use: the bound host with the port actually served.

    torchft's ``LighthouseServer.address()`` names the machine's host name, which is not where a
    loopback-bound lighthouse (the default) is reachable. A specific bound host is the address;
    only a wildcard bind (``0.0.0.0``, ``::``) is reachable by the host name torchft reports.

    Args:
        bind: the ``host:port`` the server was asked to bind (port 0: any free one).
        served: what ``LighthouseServer.address()`` returns (``http://<hostname>:<port>``).
    """
    host = bind.rpartition(":")[0].strip("[]")
    port = served.rpartition(":")[2]
    if host in ("0.0.0.0", "::", ""):
        return served
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hp_lightning.ft", description="hp_lightning fault tolerance (torchft).")
    commands = parser.add_subparsers(dest="command", required=True)
    lighthouse = commands.add_parser("lighthouse", help="run torchft's lighthouse until interrupted")
    lighthouse.add_argument("--bind", default=DEFAULT_BIND, help=f"host:port to listen on (default {DEFAULT_BIND}, loopback)")
    lighthouse.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups in a quorum (default 1)")
    lighthouse.add_argument("--join-timeout-ms", type=int, default=None, help="wait for rejoining groups (torchft default)")
    lighthouse.add_argument("--quorum-tick-ms", type=int, default=None, help="quorum re-evaluation period (torchft default)")
    lighthouse.add_argument(
        "--heartbeat-timeout-ms", type=int, default=None, help="silence after which a group is dead (torchft default)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hp_lightning.ft lighthouse ...``: serve until SIGINT/SIGTERM, then shut down.

    The stop signals are blocked before the server's threads start (they inherit the mask) and
    taken with ``sigwait``: no Python handler runs at an arbitrary point of the main thread, where
    setting a ``threading.Event`` whose lock that thread holds would deadlock the shutdown.
    """
    args = _parser().parse_args(argv)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        try:
            server = start_lighthouse(
                args.bind,
                min_replicas=args.min_replicas,
                join_timeout_ms=args.join_timeout_ms,
                quorum_tick_ms=args.quorum_tick_ms,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            )
        except (ValueError, ImportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        address = reachable_address(args.bind, server.address())
        print(f"lighthouse listening on {args.bind}; groups connect with TORCHFT_LIGHTHOUSE={address}", flush=True)
        signal.sigwait(stop_signals)
        server.shutdown()
        return 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
