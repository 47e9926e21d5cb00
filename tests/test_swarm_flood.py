"""A stranger floods a replica of a training swarm with thousands of streams that each promise a
large frame and trickle it a byte a second (slowloris), from a process of its own with its own
libp2p host (bench/flood.py). The replica holds at most its per-peer limit of them, refuses the
rest at once, keeps its memory and open files bounded and gives them back, and the swarm trains
on in lockstep."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bench.flood import _proc_sample
from node.net.rpc import TransportConfig
from tests.swarm import ROOT, node_peer_id, wait_for
from tests.test_swarm_silent_replica import NAMES, history, step

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

RUN = ["--model", "tiny", "--inner-steps", "20", "--checkpoint-every", "100000", "--eval-batches", "2", "--warmup-steps", "5",
       "--heartbeat-timeout-s", "30", "--min-replicas", "3"]  # fmt: skip
NODE = ["--threads", "1", "--heartbeat-interval-s", "1", "--num-shards", "3"]


def test_a_slowloris_flood_of_thousands_of_streams_is_refused_bounded_and_the_swarm_trains_on(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i)) for i, n in enumerate(NAMES)}
    ids = {n: node_peer_id(p) for n, p in procs.items()}
    victim = min(NAMES, key=lambda n: ids[n])  # the one that leads the rounds
    wait_for(lambda: all(step(swarm, n) >= 2 for n in NAMES), 180, "two outer steps on every replica")
    before = _proc_sample(procs[victim].leftovers())

    maddrs = re.search(r"listening on (\S+)", procs[victim].log())[1]
    flooder = subprocess.Popen([sys.executable, "-m", "bench.flood", "attack", "--target", ids[victim], "--maddr", maddrs, "--kind", "slowloris",
                                "--seconds", "200", "--concurrency", "64"], cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    peak = dict(before)
    try:
        assert flooder.stdout.readline().strip() == "flooding"
        at_start = {n: step(swarm, n) for n in NAMES}

        def three_more_steps() -> bool:
            for k, v in _proc_sample(procs[victim].leftovers()).items():
                peak[k] = max(peak[k], v)
            return all(step(swarm, n) >= at_start[n] + 3 for n in NAMES)

        wait_for(three_more_steps, 180, "three more outer steps on every replica under the flood", interval=0.5)
    finally:
        flooder.terminate()
        out, _ = flooder.communicate(timeout=60)
    counts = json.loads(out.strip().splitlines()[-1])
    # hundreds of streams (796 in one run: the three steps can come fast): the replica refused every one at once but those it was still reading
    # when the flood ended (its per-peer limit of them) and those on their way then (the
    # flooder's streams at once, 64)
    limit = TransportConfig().max_concurrent_per_peer
    assert counts["opened"] >= 500 and counts["error:overloaded"] >= counts["opened"] - 64, counts
    assert procs[victim].alive()
    # memory and open files bounded under the flood (the daemon, its DHT child and p2pd), and
    # the files given back after it
    assert peak["rss_mib"] <= before["rss_mib"] + 256 and peak["open_files"] <= before["open_files"] + 16 * limit, (before, peak)
    wait_for(lambda: _proc_sample(procs[victim].leftovers())["open_files"] <= before["open_files"] + 16, 60, "the flood's open files given back")
    # the swarm trained on through it, in lockstep
    hashes = {n: {e["outer_step"]: e["state_hash"] for e in history(swarm, n)} for n in NAMES}
    common = [k for k in set.intersection(*(set(h) for h in hashes.values())) if k > at_start[victim]]
    assert len(common) >= 2 and all(len({h[k] for h in hashes.values()}) == 1 for k in common), hashes
