"""A replica behind a NAT (its own network namespace behind a masquerading router: no inbound
path at all) joins a swarm of public replicas and averages with them: the connections it opens
itself carry the others' calls to it too, and every round it takes part in ends with one hash on
all three. Real console scripts, real p2pd; root only (network namespaces), skipped elsewhere."""

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


@pytest.fixture
def topo():
    with netns_topology(n_peers=4, rate="1gbit", natted=frozenset({3})) as t:
        yield t


def averaged(swarm, name) -> dict[int, str]:
    """outer step -> state hash, for the steps this replica reached by averaging."""
    try:
        h = json.loads((Path(swarm.tmp) / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return {}
    return {e["outer_step"]: e["state_hash"] for e in h if "start" not in e and "caught_up_from" not in e}


def test_a_replica_behind_a_nat_averages_with_public_replicas(swarm, topo):
    http = free_port()
    coord = swarm.start("coordinator", "swarmtrain-coordinator", "--data-dir", str(Path(swarm.tmp) / "coordinator"),
                        "--host-maddrs", f"/ip4/{topo.ip(0)}/tcp/0", "--http", f"{topo.ip(0)}:{http}", *RUN, prefix=topo.wrap(0, []))  # fmt: skip
    maddr = wait_for(lambda: re.search(rf"/ip4/{re.escape(topo.ip(0))}/tcp/\d+/p2p/\w+", coord.log()), 60, "the coordinator's address").group(0)
    nodes = {name: swarm.node(name, [maddr], *NODE, "--shard-index", str(i), "--host-maddrs", f"/ip4/{topo.ip(i)}/tcp/0", prefix=topo.wrap(i, []))
             for i, name in ((1, "a"), (2, "b"), (3, "n"))}  # fmt: skip
    node_peer_id(nodes["n"])
    port = int(re.search(rf"/ip4/{re.escape(topo.ip(3))}/tcp/(\d+)", nodes["n"].log()).group(1))
    # nothing reaches n from outside: not its own address, not its router's
    for ip in (topo.ip(3), topo.public_ip(3)):
        tried = subprocess.run(topo.wrap(1, [sys.executable, "-c", CONNECT, ip, str(port)]), capture_output=True, text=True, timeout=30)
        assert tried.returncode != 0, f"{ip}:{port} answered from outside the NAT"
    # rounds with n in them end with one hash on all three
    both = lambda: set(averaged(swarm, "n")) & set(averaged(swarm, "a")) & set(averaged(swarm, "b"))  # noqa: E731
    wait_for(lambda: len(both()) >= 3, 300, "3 rounds averaged by n, a and b")
    for k in both():
        assert averaged(swarm, "n")[k] == averaged(swarm, "a")[k] == averaged(swarm, "b")[k], k
    sent = topo.tx_bytes()
    print(f"bytes put on each link: coordinator {sent[0]}, a {sent[1]}, b {sent[2]}, n (through its router) {sent[3]}")
