"""Network namespaces for the shaped-link benchmarks: one namespace per peer, a bridge between them.

    with Topology.create(n_peers=4, rate="100mbit") as topo:
        topo.wrap(i, [python, "-m", "bench.allreduce_peer"])   # argv that runs inside peer i's namespace
        topo.ip(i)                                              # "10.77.0.<i+1>"
        topo.tx_bytes()                                         # bytes each peer has sent so far
        topo.cut(i); topo.restore(i)                            # peer i's link down / up again

    Topology.create(n_peers=4, rate="100mbit", rates={3: "25mbit"})  # peer 3 behind a slower link

Layout (nothing is added to the root namespace, so the host's own networking is untouched):

    <run>-p0 (eth0 10.77.0.1/24) ──veth── vp0 ┐
    <run>-p1 (eth0 10.77.0.2/24) ──veth── vp1 ├─ br0 in <run>-br
    ...                                        ┘

A peer in `natted` sits behind its own router instead (a home NAT): the router namespace
`<run>-r<i>` holds the peer's bridge address on its WAN side and masquerades everything from the
peer's private subnet (192.168.<i>.2, gateway .1) behind it; nothing is forwarded in, so the
peer has no inbound path at all (`topo.ip(i)` is its private address, `topo.public_ip(i)` the
router's).

Each peer's link is shaped in both directions with a token bucket (tbf) at `rate` (or its own
rate in `rates`): its upload on
eth0 inside its namespace, its download on vp<i> in the bridge namespace. The all-reduce bandwidth
bound 2(N-1)/N·S/B assumes each peer uploads at B; shaping the download too makes the link a
symmetric access link (what a volunteer has, give or take asymmetry) and stops the bridge from
delivering N-1 senders into one peer faster than B.

Names carry the creating process's pid (`stb<pid>-...`), so namespaces left behind by a process
that was SIGKILLed are recognised and removed by the next run (`remove_stale`). Linux, root only,
with iproute2 (ip, tc); NAT routers also need iptables and sysctl (procps). `check_available(nat=...)`
tries them and says, in one line, what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from node.osutil import pid_alive

PREFIX = "stb"
SUBNET = "10.77.0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


class NetnsUnavailable(Exception):
    """Namespaces cannot be used here; the message says why in one line."""


def _ip(*args: str, timeout: float = 10.0) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _tc(ns: str, *args: str) -> None:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {out.stderr.strip() or out.returncode}")


def list_namespaces() -> list[str]:
    out = _ip("netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# the tools the topologies run, each with the Debian package that has it and what it is for
TOOLS = {"ip": ("iproute2", "network namespaces"), "tc": ("iproute2", "the shaped links")}
NAT_TOOLS = {"iptables": ("iptables", "the NAT routers"), "sysctl": ("procps", "the NAT routers' forwarding")}


def _needs(tool: str, why: str) -> NetnsUnavailable:
    package, what = {**TOOLS, **NAT_TOOLS}[tool]
    return NetnsUnavailable(f"needs {tool} (apt install {package}) for {what}: {why}")


def missing_tool(nat: bool = False) -> NetnsUnavailable | None:
    """The first tool a topology (with `nat`: one with NAT routers) runs that is not on PATH."""
    for tool in (*TOOLS, *(NAT_TOOLS if nat else ())):
        if shutil.which(tool) is None:
            elsewhere = shutil.which(tool, path="/usr/sbin:/sbin")  # root without sbin on PATH (`su` without `-`)
            return _needs(tool, f"not on PATH (it is at {elsewhere})" if elsewhere else "not found")
    return None


def check_available(nat: bool = False) -> None:
    """Raise NetnsUnavailable, naming what is missing, unless we are root and `ip netns` and `tc`
    work (with `nat`: and the NAT routers' iptables rules can be added inside a namespace). Tries
    them in a throwaway namespace: nothing is left behind."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"needs root for network namespaces (ip netns, tc): running as uid {os.geteuid()}")
    if missing := missing_tool(nat):
        raise missing
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "set", "lo", "up")
            _tc(probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst", "32kbit", "latency", "50ms")
            if nat:
                for cmd in _nat_rules(0):
                    out = subprocess.run(["ip", "netns", "exec", probe, *cmd], capture_output=True, text=True, timeout=10)
                    if out.returncode != 0:
                        said = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[0]
                        why = f"`{' '.join(cmd)}` fails inside a network namespace: {said}"
                        raise _needs(cmd[0], why)
        finally:
            _ip("netns", "del", probe)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        raise NetnsUnavailable(f"ip netns / tc do not work here: {e}") from None


def remove_stale() -> list[str]:
    """Delete namespaces left by earlier runs whose process is gone; return their names."""
    removed = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            try:
                _ip("netns", "del", ns)
                removed.append(ns)
            except RuntimeError:
                pass
    return removed


def _nat_rules(i: int) -> list[list[str]]:
    """What makes a router namespace peer i's NAT: forwarding on, the private subnet masqueraded
    out of eth0, and nothing forwarded in from eth0 but the replies to what went out."""
    return [
        ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
        ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"192.168.{i}.0/24", "-o", "eth0", "-j", "MASQUERADE"],
        ["iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-j", "DROP"],
    ]


@dataclass
class Topology:
    n_peers: int
    rate: str  # tc rate, e.g. "100mbit"
    rates: dict[int, str] = field(default_factory=dict)  # peers whose link has another rate
    natted: frozenset[int] = frozenset()  # peers behind a masquerading router (no inbound path)
    run: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    created: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{self.run}-br"

    def ns(self, i: int) -> str:
        return f"{self.run}-p{i}"

    def ip(self, i: int) -> str:
        """Peer i's own address: on the bridge, or its private one behind its NAT."""
        return f"192.168.{i}.2" if i in self.natted else self.public_ip(i)

    def public_ip(self, i: int) -> str:
        """Where peer i's packets come from on the bridge (its router's, behind a NAT)."""
        return f"{SUBNET}.{i + 1}"

    def rate_of(self, i: int) -> str:
        """Peer i's link rate (tc units), each way."""
        return self.rates.get(i, self.rate)

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i), *argv]

    @classmethod
    def create(
        cls, n_peers: int, rate: str, shape_download: bool = True, natted: frozenset[int] = frozenset(), rates: dict[int, str] | None = None
    ) -> Topology:
        if not 1 <= n_peers <= 250:
            raise ValueError(f"n_peers must be in 1..250, got {n_peers}")
        rates = dict(rates or {})
        if bad := [i for i in rates if not 0 <= i < n_peers]:
            raise ValueError(f"rates name peers {bad} of a topology of {n_peers}")
        for r in (rate, *rates.values()):
            parse_rate(r)  # a bad rate is named here, not by tc half-way through building
        if missing := missing_tool(nat=bool(natted)):  # before anything is built
            raise missing
        topo = cls(n_peers, rate, rates, frozenset(natted))
        try:
            topo._build(shape_download)
        except BaseException:
            topo.destroy()
            raise
        return topo

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self, shape_download: bool) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i in range(self.n_peers):
            tbf = ["root", "tbf", "rate", self.rate_of(i), "burst", "32kbit", "latency", "50ms"]
            ns = self.ns(i)
            self._add_ns(ns)
            # on the bridge: the peer itself, or its router
            wan = self._router(i) if i in self.natted else ns
            _ip("-n", br, "link", "add", f"vp{i}", "type", "veth", "peer", "name", "eth0", "netns", wan)
            _ip("-n", br, "link", "set", f"vp{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"vp{i}", "up")
            _ip("-n", wan, "addr", "add", f"{self.public_ip(i)}/24", "dev", "eth0")
            _ip("-n", wan, "link", "set", "eth0", "up")
            _tc(wan, "qdisc", "add", "dev", "eth0", *tbf)
            if i in self.natted:
                self._nat(i, wan)
            if shape_download:
                _tc(br, "qdisc", "add", "dev", f"vp{i}", *tbf)

    def _router(self, i: int) -> str:
        name = f"{self.run}-r{i}"
        self._add_ns(name)
        return name

    def _nat(self, i: int, router: str) -> None:
        """Peer i behind `router`: a private link, a default route through it, masquerading out,
        and nothing forwarded in but the replies to what went out."""
        ns = self.ns(i)
        _ip("-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "lan0", "netns", ns)
        _ip("-n", router, "addr", "add", f"192.168.{i}.1/24", "dev", "lan0")
        _ip("-n", router, "link", "set", "lan0", "up")
        _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "lan0")
        _ip("-n", ns, "link", "set", "lan0", "up")
        _ip("-n", ns, "route", "add", "default", "via", f"192.168.{i}.1")
        for cmd in _nat_rules(i):
            out = subprocess.run(["ip", "netns", "exec", router, *cmd], capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} in {router}: {out.stderr.strip() or out.returncode}")

    def cut(self, i: int) -> None:
        """Take peer i's link down at the bridge: its packets go nowhere, nobody reaches it (a
        router that dropped, a cable pulled). Its own interface stays up, addresses and routes kept."""
        _ip("-n", self.bridge_ns, "link", "set", f"vp{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"vp{i}", "up")

    def tx_bytes(self) -> list[int]:
        """Bytes each peer has put on its link so far (L2, i.e. with TCP/IP/Ethernet headers)."""
        links = json.loads(_ip("-n", self.bridge_ns, "-s", "-j", "link", "show"))
        by_name = {link["ifname"]: link for link in links}
        # what vp<i> receives from the veth is what peer i transmitted
        return [int(by_name[f"vp{i}"]["stats64"]["rx"]["bytes"]) for i in range(self.n_peers)]

    def destroy(self) -> None:
        """Delete every namespace this topology created (their veths and the bridge go with them)."""
        for name in reversed(self.created):
            try:
                _ip("netns", "del", name)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                pass
        self.created.clear()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
print("listening", flush=True)
c, _ = s.accept(); c.settimeout(60); n = 0; t0 = None
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    t0 = t0 or time.monotonic()
    n += len(d)
print(n, time.monotonic() - t0, flush=True)
"""
_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(buf)
c.close()
"""


def measure_goodput(topo: Topology, python: str, mib: int = 12, port: int = 5599) -> float:
    """TCP payload throughput (bit/s) from peer 0 to peer 1 over the shaped links."""
    sink = subprocess.Popen(topo.wrap(1, [python, "-c", _SINK, topo.ip(1), str(port)]), stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "listening":
            raise RuntimeError("goodput sink did not start")
        subprocess.run(topo.wrap(0, [python, "-c", _SOURCE, topo.ip(1), str(port), str(mib)]), check=True, timeout=120)
        out, _ = sink.communicate(timeout=30)
        nbytes, seconds = out.split()
        return int(nbytes) * 8 / float(seconds)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(5)


def parse_rate(text: str) -> float:
    """tc rate in bit/s ("100mbit" -> 1e8). Only the bit units: tc's "bps" means bytes per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", text.strip().lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (use e.g. 100mbit)")
    return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
