"""A simulated multi-node cluster on one machine: network namespaces joined by a shaped veth pair.

Each "node" is a Linux network namespace; its ranks talk to each other over the namespace's own
loopback, and the nodes talk over one veth pair whose egress is shaped with ``tc`` (``tbf`` for
the bandwidth, ``netem`` for the latency where the kernel has it). The pair is the inter-node
link: its byte counters (``/proc/<tid>/net/dev`` inside a namespace) count exactly what crossed
between nodes.

**Addresses.** Gloo binds every rank to one interface (``GLOO_SOCKET_IFNAME``) and publishes that
interface's address to its peers. Every rank of node *n* binds to node *n*'s end of the veth
pair, address ``127.18.0.(n+1)``. Inside node *n* that address is local, so the kernel delivers
traffic between ranks of the same node over the namespace's loopback device and it never touches
the veth; a rank of the other node reaches it through the pair. For the pair to carry
loopback-range (127/8) addresses:

* each namespace's ``lo`` keeps only ``127.0.0.1/32`` (instead of the automatic ``/8``, whose
  local route would swallow the peer's 127.18.0.x address);
* ``net.ipv4.conf.<veth>.route_localnet=1`` stops the kernel treating 127/8 on a non-loopback
  device as martian;
* IPv6 is off on the pair, so gloo finds exactly one address on it.

So all traffic stays on this machine: the namespaces have no other interface, and no address
outside 127/8 is used. Nothing here is reachable from, or reaches, the host's own network.

**Lifetime.** :func:`simulated_cluster` creates the namespaces (named ``hplc<pid>-n<i>``, the
pid of the process that owns them) and removes them on exit whatever happens: normal return,
exception, SIGTERM / SIGINT / SIGHUP. Processes still inside a namespace (ranks that outlived a
timeout) are killed by pid first. At start, namespaces of this prefix whose owner process no
longer exists (a run killed with SIGKILL) are removed.

Rank processes enter their node with :func:`enter_node` (``setns(2)`` on the namespace file,
before any socket exists), so the usual ``multiprocessing`` launcher works unchanged.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

#: Every namespace this harness creates starts with this (``hplc<owner pid>-n<node>``).
PREFIX = "hplc"
_NAME = re.compile(rf"^{PREFIX}(\d+)-n(\d+)$")
#: Node n's end of the link has address 127.18.0.(n+1) (a /30: two usable addresses).
SUBNET = "127.18.0"
CLONE_NEWNET = 0x40000000
#: Seconds any one ``ip`` / ``tc`` command may take.
COMMAND_TIMEOUT_S = 20


@dataclass(frozen=True)
class LinkSpeed:
    """One setting of the inter-node link.

    Attributes:
        name: short key used in tables (``"1G"``).
        rate_mbit: bandwidth per direction (tbf rate).
        delay_us: one-way latency added with netem (round trip = 2x); 0 = none. Applied only where
            the kernel has ``sch_netem``; the run records whether it was.
    """

    name: str
    rate_mbit: int
    delay_us: int = 100

    @property
    def label(self) -> str:
        rate = f"{self.rate_mbit // 1000} Gbit/s" if self.rate_mbit % 1000 == 0 else f"{self.rate_mbit} Mbit/s"
        return f"{rate}, RTT {2 * self.delay_us / 1000:g} ms" if self.delay_us else rate

    def tbf_args(self) -> list[str]:
        """``tbf`` parameters: the rate, a burst of 1 ms at that rate (at least 256 KiB, so one
        64 KiB GSO segment never stalls the bucket) and a queue of 20 ms (TCP keeps it full
        without drops, like a switch buffer)."""
        burst = max(256 * 1024, self.rate_mbit * 1_000_000 // 8 // 1000)
        return ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "20ms"]


@dataclass(frozen=True)
class ClusterNetwork:
    """Names and addresses of one simulated cluster (picklable: every rank gets a copy)."""

    owner_pid: int
    nodes: int
    netem: bool

    def namespace(self, node: int) -> str:
        return f"{PREFIX}{self.owner_pid}-n{node}"

    def interface(self, node: int) -> str:
        """Node ``node``'s end of the inter-node link (name unique per namespace, <= 15 chars)."""
        return f"hplink{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def master_addr(self) -> str:
        """Where rank 0 (node 0) serves the TCPStore."""
        return self.address(0)


# ---------------------------------------------------------------------------- host side (root)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip`` / ``tc`` / ``sysctl`` command; with ``check``, a failure raises with its stderr.

    Raises:
        RuntimeError: when ``check`` and the command exits non-zero.
    """
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def missing_requirements() -> list[str]:
    """What this machine lacks to build the cluster (empty: everything is there)."""
    missing = []
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        missing.append("Linux network namespaces (/proc/self/ns/net)")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        missing.append(f"root (CAP_NET_ADMIN and CAP_SYS_ADMIN to create namespaces and shape links; running as uid {os.geteuid()})")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (iproute2)")
    if not missing:
        # Root is not always enough (a container without CAP_SYS_ADMIN): try one namespace.
        probe = f"{PREFIX}{os.getpid()}-n99"
        made = _run("ip", "netns", "add", probe, check=False)
        _run("ip", "netns", "del", probe, check=False)
        if made.returncode != 0:
            missing.append(f"permission to create network namespaces (`ip netns add` said: {made.stderr.strip()})")
    return missing


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(name: str) -> None:
    """Kill the processes left inside ``name`` (our ranks), then delete it (and its veth end)."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline and _run("ip", "netns", "pids", name, check=False).stdout.split():
        time.sleep(0.05)
    _run("ip", "netns", "del", name, check=False)


def cleanup_leftovers() -> list[str]:
    """Remove namespaces of this prefix whose owner process is gone; returns their names."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    return removed


def leftover_namespaces(owner_pid: Optional[int] = None) -> list[str]:
    """This prefix's namespaces that exist now (of one owner, or of any)."""
    return [n for n in _namespaces() if (m := _NAME.match(n)) and (owner_pid is None or int(m.group(1)) == owner_pid)]


def _netem_available(net: ClusterNetwork) -> bool:
    """Whether the kernel has ``sch_netem`` (many VM kernels are built without it)."""
    ns, dev = net.namespace(0), net.interface(0)
    probe = _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay", "1us", check=False)
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    return probe.returncode == 0


def create(nodes: int = 2) -> ClusterNetwork:
    """Create ``nodes`` namespaces joined by one veth pair (2 nodes: a point-to-point link).

    Raises:
        ValueError: for a node count other than 2 (one link joins exactly two nodes).
        RuntimeError: when an ``ip`` command fails (the caller cleans up).
    """
    if nodes != 2:
        raise ValueError(f"the simulated cluster has exactly 2 nodes joined by one link; got nodes={nodes}.")
    net = ClusterNetwork(owner_pid=os.getpid(), nodes=nodes, netem=False)
    for node in range(nodes):
        _run("ip", "netns", "add", net.namespace(node))
    _run("ip", "link", "add", net.interface(0), "netns", net.namespace(0), "type", "veth",
         "peer", "name", net.interface(1), "netns", net.namespace(1))
    for node in range(nodes):
        ns, dev = net.namespace(node), net.interface(node)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # Bringing lo up adds 127.0.0.1/8; its local route would claim the peer's 127.18.0.x.
        _run("ip", "-n", ns, "addr", "del", "127.0.0.1/8", "dev", "lo", check=False)
        _run("ip", "-n", ns, "addr", "add", "127.0.0.1/32", "dev", "lo")
        _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.route_localnet=1",
             f"net.ipv6.conf.{dev}.disable_ipv6=1")
        _run("ip", "-n", ns, "addr", "add", f"{net.address(node)}/30", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
    return ClusterNetwork(owner_pid=net.owner_pid, nodes=nodes, netem=_netem_available(net))


def destroy(net: ClusterNetwork) -> None:
    """Remove every namespace of ``net`` (deleting a namespace deletes its end of the pair, and so the pair)."""
    for node in range(net.nodes):
        _remove_namespace(net.namespace(node))


@contextmanager
def simulated_cluster(nodes: int = 2) -> Iterator[ClusterNetwork]:
    """Build the cluster, yield it, and remove it whatever happens (signals included).

    Raises:
        SystemExit: (code 2) when :func:`missing_requirements` is not empty, naming what is missing.
    """
    missing = missing_requirements()
    if missing:
        raise SystemExit(
            "The simulated cluster needs " + "; ".join(missing) + ". Run `make bench-cluster` as root on Linux "
            "with iproute2 installed (e.g. `sudo make bench-cluster`, or in a container started with --cap-add "
            "NET_ADMIN --cap-add SYS_ADMIN). Nothing was run."
        )
    cleanup_leftovers()
    previous = {}

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[sig] = signal.signal(sig, on_signal)
    net = ClusterNetwork(owner_pid=os.getpid(), nodes=nodes, netem=False)
    try:
        net = create(nodes)
        yield net
    finally:
        destroy(net)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------- rank side


def enter_node(net: ClusterNetwork, node: int) -> None:
    """Move the calling thread (call it first thing, from the main thread) into node ``node``'s namespace.

    Sockets, threads and child processes created afterwards live in that namespace. Also sets
    ``GLOO_SOCKET_IFNAME`` to the node's end of the link (see the module docstring for why).

    Raises:
        OSError: when ``setns`` fails (not root, or the namespace is gone).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{net.namespace(node)}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {net.namespace(node)} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = net.interface(node)


def shape_link(net: ClusterNetwork, node: int, speed: LinkSpeed) -> str:
    """Shape the egress of this node's end of the link (call from inside the node); returns what was applied.

    With netem: netem (delay) as the root qdisc, tbf (rate) below it. Without: tbf alone, and the
    latency is the veth's own (tens of microseconds).
    """
    dev = net.interface(node)
    tbf = speed.tbf_args()
    if net.netem and speed.delay_us:
        _run("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{speed.delay_us}us", "limit", "100000")
        _run("tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        return f"netem delay {speed.delay_us}us + {' '.join(tbf)}"
    _run("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", *tbf)
    return " ".join(tbf) + ("" if not speed.delay_us else " (no netem in this kernel: latency not added)")


def interface_bytes() -> dict[str, int]:
    """Bytes received + transmitted by every interface of the calling thread's namespace.

    On the link, node 0's received bytes are node 1's transmitted ones, so one end's sum is
    everything that crossed in both directions (payload plus TCP/IP headers and ACKs).
    """
    out = {}
    with open("/proc/thread-self/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep:
                fields = rest.split()
                out[name.strip()] = int(fields[0]) + int(fields[8])
    return out
