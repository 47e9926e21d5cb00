"""Harness for swarm tests: real processes on loopback, one small fault interface, no sleeps.

Every process is started in its own session; `Swarm.close()` kills whatever is left of each
session (node, its DHT child and p2pd) and fails the test if anything had to be killed that
should have exited by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from node.osutil import session_pids
from tests.forkserver import ForkServer, forks_daemons

ROOT = Path(__file__).resolve().parent.parent


async def start_hosts(n: int) -> list:
    """n libp2p hosts (real p2pd) in this process, the others bootstrapped from the first.
    The caller shuts them down."""
    from node.net.host import Host, HostConfig
    from protocol import SigningKey

    first = await Host.start(SigningKey.generate(), HostConfig())
    maddrs = tuple(await first.visible_maddrs())
    return [first] + [await Host.start(SigningKey.generate(), HostConfig(initial_peers=maddrs)) for _ in range(n - 1)]


@contextlib.asynccontextmanager
async def averagers(n: int, **config):
    """n real hosts (p2pd) in this process, each with a started Transport and an Averager of
    `config`; all closed afterwards. Yields the averagers (`.host`, `.transport` on each)."""
    from node.averaging import Averager, AveragerConfig
    from node.net.transport import Transport

    hosts = await start_hosts(n)
    transports = [Transport(h) for h in hosts]
    avgs = [Averager(h, t, AveragerConfig(**config)) for h, t in zip(hosts, transports)]
    try:
        for t in transports:
            await t.start()
        for a in avgs:
            await a.start()
        yield avgs
    finally:
        for a in avgs:
            await a.close()
        for t in transports:
            await t.close()
        for h in hosts:
            await h.shutdown()


FORKABLE = ("swarmtrain-node", "swarmtrain-coordinator")  # the console scripts the fork server runs
ORPHAN_GRACE_S = 10.0  # how long a killed daemon's DHT process and p2pd may take to go by themselves


def settled_leftovers(sid: int, grace: float = ORPHAN_GRACE_S) -> list[int]:
    """The processes still in session `sid` once they had `grace` seconds to exit."""
    deadline = time.monotonic() + grace
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessExited(AssertionError):
    """What a wait is for cannot come: the process that was to bring it exited (its log says why)."""


# signals no test sends: a daemon they end crashed (the log holds faulthandler's stacks)
CRASH_SIGNALS = {-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE}
_SWARMS: list[Swarm] = []  # the swarms of the running test, whose crashed daemons end every wait


def check_crashes() -> None:
    """ProcessExited naming a daemon of a running swarm that a fatal signal ended, with its log's end."""
    for swarm in _SWARMS:
        for p in swarm.procs:
            if p.popen.poll() in CRASH_SIGNALS:
                raise ProcessExited(f"{p.name} crashed ({signal.Signals(-p.popen.returncode).name}):\n{p.log()[-20000:]}")


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    """Poll `cond()` until it returns something truthy; fail with `what` after `timeout` s, or at
    once when `cond` raises ProcessExited or a daemon of a running swarm crashed."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        check_crashes()
        try:
            value = cond()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as e:  # the condition may not be checkable yet (server starting)
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


class Proc:
    """One daemon process (and, through its session, everything it started)."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict | None = None, fork: bool = False, netns: str | None = None):
        """`fork`: from the fork server (tests/forkserver.py), not a new interpreter; `netns`:
        then in that network namespace (`args` without its `ip netns exec`)."""
        self.name = name
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = {**os.environ, **(env or {})}
        if fork:
            self.popen = ForkServer.get().spawn(args[4:] if netns else args, env, ROOT, log_path, netns)
        else:
            self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=env)
        self.sid = self.popen.pid  # start_new_session: the session id is the leader's pid

    # -- the fault interface: kill, stall, resume --
    def kill(self) -> None:
        """SIGKILL the daemon itself (its children must notice and go on their own)."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self) -> None:
        self.popen.send_signal(signal.SIGTERM)

    def interrupt(self) -> None:
        self.popen.send_signal(signal.SIGINT)

    def stall(self) -> None:
        """SIGSTOP the whole session: the process is alive but silent (a straggler)."""
        os.killpg(self.sid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.sid, signal.SIGCONT)

    # -- inspection --
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def leftovers(self) -> list[int]:
        return session_pids(self.sid)

    def cleanup(self) -> list[int]:
        """Kill everything left in the session; return the pids that were still there. If the
        daemon itself is gone (a test killed it), what it started gets ORPHAN_GRACE_S to go by
        itself first: its DHT process notices within 0.2 s and stops p2pd (up to 2 s)."""
        left = settled_leftovers(self.sid) if not self.alive() else self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return left


class Swarm:
    """Starts coordinators and nodes from their console scripts; cleans up after itself."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[Proc] = []
        _SWARMS.append(self)

    def _bin(self, name: str) -> str:
        script = Path(sys.executable).parent / name
        return str(script) if script.exists() else name

    def start(self, name: str, script: str, *args: str, env: dict | None = None, prefix: Sequence[str] = ()) -> Proc:
        """`prefix`: argv the daemon runs under (e.g. `ip netns exec NS`: its own network namespace)."""
        netns = prefix[3] if len(prefix) == 4 and list(prefix[:3]) == ["ip", "netns", "exec"] else None  # (bench/netns.py Topology.wrap)
        fork = forks_daemons() and script in FORKABLE and (not prefix or netns is not None)
        p = Proc(name, [*prefix, self._bin(script), *args], self.tmp / f"{name}.log", env, fork, netns)
        self.procs.append(p)
        return p

    def coordinator(self, name="coordinator", port: int | None = None, http_port: int | None = None, *extra: str) -> Coordinator:
        port = port or free_port()
        http_port = http_port or free_port()
        args = ["--data-dir", str(self.tmp / name), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--http", f"127.0.0.1:{http_port}", *extra]
        proc = self.start(name, "swarmtrain-coordinator", *args)
        return Coordinator(proc, port, http_port, args)

    def restart(self, coord: Coordinator, name: str) -> Coordinator:
        """Start a coordinator again with the same data dir, ports and flags."""
        return Coordinator(self.start(name, "swarmtrain-coordinator", *coord.args), coord.port, coord.http_port, coord.args)

    def node(self, name: str, initial_peers: list[str], *extra: str, prefix: Sequence[str] = ()) -> Proc:
        return self.start(name, "swarmtrain-node", "--data-dir", str(self.tmp / name), "--initial-peers", *initial_peers, *extra, prefix=prefix)

    def close(self) -> list[str]:
        """Kill what is left; report processes that outlived a daemon that had exited."""
        if self in _SWARMS:
            _SWARMS.remove(self)
        orphans = []
        for p in self.procs:
            exited = not p.alive()
            left = p.cleanup()
            if exited and left:
                orphans.append(f"{p.name}: {len(left)} processes outlived it")
        return orphans


class Coordinator:
    def __init__(self, proc: Proc, port: int, http_port: int, args: list[str]):
        self.proc, self.port, self.http_port, self.args = proc, port, http_port, args

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=5) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def wait_ready(self, timeout: float = 60) -> dict:
        def ready():
            if not self.proc.alive():
                raise ProcessExited(f"coordinator exited:\n{self.proc.log()}")
            try:
                return self.status()
            except (urllib.error.URLError, ConnectionError, OSError):
                return None

        return wait_for(ready, timeout, "the coordinator's /status")

    def maddr(self) -> str:
        return self.status()["maddrs"][0]

    def members(self) -> dict[str, dict]:
        return {m["peer_id"]: m for m in self.status()["members"]}


def require_netns(nat: bool = False) -> None:
    """Skip the calling test, naming what is missing, where network namespaces cannot be used
    (not root, no `ip` or `tc`; with `nat`, for NAT routers: no `iptables`, or one that does not
    work inside a namespace). Checked before anything is built."""
    import pytest

    from bench import netns

    try:
        netns.check_available(nat=nat)
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def netns_topology(**kwargs) -> Iterator:
    """A bench/netns.py Topology for a test (its arguments), removed afterwards; the test is
    skipped, naming what is missing, where it cannot be built (see `require_netns`)."""
    from bench import netns

    require_netns(nat=bool(kwargs.get("natted")))
    netns.remove_stale()
    with netns.Topology.create(**kwargs) as topo:
        yield topo


def node_peer_id(proc: Proc, timeout: float = 60) -> str:
    """The peer id a node logs when it starts."""

    def find():
        for line in proc.log().splitlines():
            if "peer id " in line:
                return line.split("peer id ", 1)[1].split(",")[0].strip()
        if not proc.alive():
            raise ProcessExited(f"{proc.name} exited:\n{proc.log()}")
        return None

    return wait_for(find, timeout, f"{proc.name} to start")
