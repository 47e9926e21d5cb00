"""Two replicas behind NATs (each in its own network namespace behind a masquerading router: no
inbound path, and no path between them) average with a public replica through it as their relay
(`--relays`, `--serve-relay`): every round all three take part in ends with one hash on all three,
and the relay reports the bytes it carried. The public replica itself reaches them without a relay,
over the connections they opened to it. Real console scripts, real p2pd; root only (network
namespaces), skipped elsewhere."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm import free_port, netns_topology, node_peer_id, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

RUN = ["--model", "tiny", "--inner-steps", "5", "--eval-batches", "2", "--warmup-steps", "5", "--join-timeout-s", "8", "--heartbeat-timeout-s", "10",
       "--min-replicas", "3"]  # fmt: skip
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5", "--num-shards", "4"]
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"
GET = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


@pytest.fixture
def topo():
    with netns_topology(n_peers=4, rate="1gbit", natted=frozenset({2, 3})) as t:
        yield t


def averaged(swarm, name) -> dict[int, str]:
    """outer step -> state hash, for the steps this replica reached by averaging."""
    try:
        h = json.loads((Path(swarm.tmp) / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return {}
    return {e["outer_step"]: e["state_hash"] for e in h if "start" not in e and "caught_up_from" not in e}


def transport_stats(swarm, name) -> dict:
    try:
        return json.loads((Path(swarm.tmp) / name / "transport-stats.json").read_text())
    except (OSError, ValueError):
        return {}


def test_replicas_behind_nats_average_through_a_relay(swarm, topo):
    http = free_port()
    coord = swarm.start("coordinator", "swarmtrain-coordinator", "--data-dir", str(Path(swarm.tmp) / "coordinator"),
                        "--host-maddrs", f"/ip4/{topo.ip(0)}/tcp/0", "--http", f"{topo.ip(0)}:{http}", *RUN, prefix=topo.wrap(0, []))  # fmt: skip
    find = lambda proc, i: re.search(rf"/ip4/{re.escape(topo.ip(i))}/tcp/\d+/p2p/\w+", proc.log())  # noqa: E731
    maddr = wait_for(lambda: find(coord, 0), 60, "the coordinator's address").group(0)
    relay = swarm.node("r", [maddr], *NODE, "--shard-index", "1", "--host-maddrs", f"/ip4/{topo.ip(1)}/tcp/0", "--serve-relay", prefix=topo.wrap(1, []))
    relay_maddr = wait_for(lambda: find(relay, 1), 60, "the relay's address").group(0)
    http = free_port()  # n2's /metrics, on the loopback of its namespace
    hidden = {name: swarm.node(name, [maddr], *NODE, "--shard-index", str(i), "--host-maddrs", f"/ip4/{topo.ip(i)}/tcp/0", "--relays", relay_maddr,
                               *(["--http", f"127.0.0.1:{http}"] if name == "n2" else []), prefix=topo.wrap(i, []))
              for i, name in ((2, "n2"), (3, "n3"))}  # fmt: skip
    for name, proc in hidden.items():
        node_peer_id(proc)
    # nothing reaches a hidden replica from outside, nor from the other one: not its own
    # address, not its router's
    port = int(re.search(rf"/ip4/{re.escape(topo.ip(3))}/tcp/(\d+)", hidden["n3"].log()).group(1))
    for ip in (topo.ip(3), topo.public_ip(3)):
        for i in (1, 2):
            tried = subprocess.run(topo.wrap(i, [sys.executable, "-c", CONNECT, ip, str(port)]), capture_output=True, text=True, timeout=30)
            assert tried.returncode != 0, f"{ip}:{port} answered peer {i} from outside the NAT"

    names = ("r", "n2", "n3")
    common = lambda: set.intersection(*(set(averaged(swarm, n)) for n in names))  # noqa: E731
    wait_for(lambda: len(common()) >= 3, 300, "3 rounds averaged by r, n2 and n3")
    for k in common():
        assert len({averaged(swarm, n)[k] for n in names}) == 1, k
    # the hidden replicas reached each other through the relay, which counted what it carried
    wait_for(lambda: transport_stats(swarm, "r").get("relayed_bytes", 0) > 0, 30, "the relay's stats")
    carried = transport_stats(swarm, "r")
    assert carried["relayed_streams"] > 0 and carried.get("relay_refused", 0) == 0, carried
    assert carried.get("relay_opens", 0) == 0, carried  # its own calls to them: over their connections to it
    for name in hidden:
        st = transport_stats(swarm, name)
        assert st.get("relay_opens", 0) > 0 and st.get("relayed_served", 0) > 0 and st.get("relayed_refused", 0) == 0, (name, st)
    # n2 counts its calls with n3 (through the relay) as relayed, those with the relay and the
    # coordinator (over its own connections to them) as libp2p
    metrics = subprocess.run(topo.wrap(2, [sys.executable, "-c", GET, f"http://127.0.0.1:{http}/metrics"]), capture_output=True, text=True, timeout=30)
    assert metrics.returncode == 0, metrics.stderr
    n3 = node_peer_id(hidden["n3"])
    by_plane = {}
    for line in metrics.stdout.splitlines():
        if line.startswith("swarmtrain_node_bytes_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (labels["plane"], labels["direction"], labels["peer"] == n3)
            by_plane[key] = by_plane.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    for direction in ("sent", "received"):
        assert by_plane.get(("relayed", direction, True), 0) > 0 and by_plane.get(("libp2p", direction, False), 0) > 0, by_plane
        assert by_plane.get(("libp2p", direction, True), 0) == 0, by_plane
    sent = topo.tx_bytes()
    print(f"relayed {carried['relayed_bytes']} bytes in {carried['relayed_streams']} streams; bytes put on each link: "
          f"coordinator {sent[0]}, relay {sent[1]}, n2 {sent[2]}, n3 {sent[3]}")  # fmt: skip
