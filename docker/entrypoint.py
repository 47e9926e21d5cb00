#!/usr/bin/env python3
"""Container entrypoint: `coordinator [ARGS...]` or `node [ARGS...]`, then exec the console script.

What a container needs that the CLIs cannot know: listen on all interfaces, announce an address
other containers can dial, and (nodes) the coordinator's peer id, which exists only once the
coordinator has started. A node therefore polls the coordinator's HTTP /status until it answers
and joins through the coordinator's multiaddrs, addressed by its service name
(`/dns4/coordinator/tcp/31337/p2p/<id>`, which p2pd resolves), so a coordinator recreated with a
new container IP is still found.

Settings (env; none uses the SWARMTRAIN_ prefix, which belongs to the CLIs' own config):
P2P_PORT (31337), HTTP_PORT (coordinator's /status, 8080), COORDINATOR_HOST (its service name,
"coordinator"), COORDINATOR_HTTP (HOST:PORT of its /status, default COORDINATOR_HOST:8080),
ANNOUNCE_IP (default: this container's IP), COORDINATOR_WAIT_S (how long a node waits for the
coordinator before exiting for the restart policy, 300), COORDINATOR_ARGS / NODE_ARGS (extra
flags, shell-quoted). Everything else the CLIs read from SWARMTRAIN_* /
SWARMTRAIN_COORDINATOR_* env vars (e.g. SWARMTRAIN_TOKEN, SWARMTRAIN_COORDINATOR_OWNER_PUBLIC_KEY).
Extra flags come last, so they override the defaults set here.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request

DATA_DIR = "/data"


def env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def log(msg: str) -> None:
    print(f"entrypoint: {msg}", file=sys.stderr, flush=True)


def container_ip(toward: str | None = None) -> str:
    """The address other containers reach us at: the interface that routes to `toward` (or,
    without one, the address our hostname resolves to, which compose engines put in /etc/hosts)."""
    if os.environ.get("ANNOUNCE_IP"):
        return os.environ["ANNOUNCE_IP"]
    if toward is None:
        try:
            ip = socket.gethostbyname(socket.gethostname())
            if not ipaddress.ip_address(ip).is_loopback:
                return ip
        except OSError:
            pass
        toward = "192.0.2.1"  # TEST-NET-1: only used to pick the outgoing interface, nothing is sent
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return s.getsockname()[0]


def extra_args(var: str) -> list[str]:
    return shlex.split(os.environ.get(var, ""))


def coordinator(argv: list[str]) -> list[str]:
    port = env("P2P_PORT", "31337")
    host = env("COORDINATOR_HOST", "coordinator")
    ip = container_ip()
    log(f"coordinator: libp2p on 0.0.0.0:{port}, announcing {ip} and {host}")
    return [
        "swarmtrain-coordinator",
        "--data-dir", DATA_DIR,  # identity.pem, registry and checkpoints live in the volume
        "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}",
        "--announce-maddrs", f"/dns4/{host}/tcp/{port}", f"/ip4/{ip}/tcp/{port}",
        "--http", f"0.0.0.0:{env('HTTP_PORT', '8080')}",
        # an owned swarm's /status answers loopback only, but here every request comes from
        # outside the container: the nodes read it for the coordinator's address
        *(["--http-public"] if "@" in env("SWARMTRAIN_COORDINATOR_SWARM_ID", "") else []),
        *extra_args("COORDINATOR_ARGS"),
        *argv,
    ]  # fmt: skip


def fetch_status(url: str, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                status = json.loads(r.read())
            if status.get("peer_id") and status.get("maddrs"):
                return status
            last = "no peer id yet"
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = e
        time.sleep(1)
    log(f"the coordinator did not answer at {url} within {wait_s:.0f} s (last: {last}); exiting so the restart policy retries")
    sys.exit(1)


def node(argv: list[str]) -> list[str]:
    port = env("P2P_PORT", "31337")
    host = env("COORDINATOR_HOST", "coordinator")
    url = f"http://{env('COORDINATOR_HTTP', host + ':8080')}/status"
    status = fetch_status(url, float(env("COORDINATOR_WAIT_S", "300")))
    peer_id = status["peer_id"]
    # dial the coordinator by its service name first (stable if its container IP changes), then
    # whatever it announces; its announced loopback addresses are useless from here
    by_name = f"/dns4/{host}/tcp/{port}/p2p/{peer_id}"
    peers = [by_name] + [m for m in status["maddrs"] if m != by_name and not m.startswith("/ip4/127.")]
    try:
        toward = socket.gethostbyname(host)
    except OSError:
        toward = None
    ip = container_ip(toward)
    log(f"node: coordinator {peer_id}; libp2p on 0.0.0.0:{port}, announcing {ip}")
    return [
        "swarmtrain-node",
        "--data-dir", DATA_DIR,
        "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}",
        "--announce-maddrs", f"/ip4/{ip}/tcp/{port}",
        "--initial-peers", *peers,
        "--coordinator", by_name,
        *extra_args("NODE_ARGS"),
        *argv,
    ]  # fmt: skip


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("coordinator", "node"):
        # anything else (a shell, python -c ...) runs as given
        if len(sys.argv) < 2:
            sys.exit("usage: coordinator [ARGS...] | node [ARGS...] | any command")
        os.execvp(sys.argv[1], sys.argv[1:])
    what, argv = sys.argv[1], sys.argv[2:]
    cmd = coordinator(argv) if what == "coordinator" else node(argv)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
