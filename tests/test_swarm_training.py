"""Swarm tests of DiLoCo training: a real coordinator and real replica daemons on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.net.host import Host, HostConfig
from node.net.rpc import RPC_PROTOCOL
from protocol import SigningKey
from tests.swarm import Swarm, free_port, settled_leftovers, wait_for
from tests.test_monitoring import queried_metric_names

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

RUN = [
    "--model", "tiny", "--inner-steps", "5", "--checkpoint-every", "2", "--eval-batches", "2", "--warmup-steps", "5",
    "--join-timeout-s", "8", "--heartbeat-timeout-s", "10",
]
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5", "--num-shards", "4"]


def history(swarm: Swarm, name: str) -> list[dict]:
    path = Path(swarm.tmp) / name / "replica-stats.json"
    try:
        return json.loads(path.read_text())["history"]
    except (FileNotFoundError, ValueError, KeyError):
        return []


def step_of(swarm, name) -> int:
    h = history(swarm, name)
    return h[-1]["outer_step"] if h else -1


def hashes(swarm, name) -> dict[int, str]:
    """outer step -> hash of the outer state this replica held at it."""
    return {e["outer_step"]: e["state_hash"] for e in history(swarm, name)}


def trained_steps(swarm, name) -> set[int]:
    """Steps this replica reached by averaging (not by starting or catching up)."""
    return {e["outer_step"] for e in history(swarm, name) if "start" not in e and "caught_up_from" not in e}


def replica(swarm, name, maddr, shard, *extra):
    return swarm.node(name, [maddr], *NODE, "--shard-index", str(shard), *extra)


def scrape(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition."""
    return [(x.name, x.labels, x.value) for family in text_string_to_metric_families(text) for x in family.samples]


def total(found: list[tuple[str, dict, float]], name: str, **labels: str) -> float:
    return sum(v for n, got, v in found if n == name and labels.items() <= got.items())


def check_node_http(port: int, coord) -> None:
    """A replica's --http after a few outer steps, its counters against what it did; every metric
    the monitoring profile's dashboard queries is one this node or the coordinator exports."""
    text = scrape(port, "/metrics")
    for family in ("swarmtrain_node_bytes_total", "swarmtrain_node_rounds_total", "swarmtrain_node_steps_total"):
        assert f"# TYPE {family} counter" in text
    found = samples(text)
    for plane in ("libp2p", "direct"):  # averaging's bulk parts go direct, everything else over libp2p
        for direction in ("sent", "received"):
            assert total(found, "swarmtrain_node_bytes_total", plane=plane, direction=direction) > 0, (plane, direction)
    assert total(found, "swarmtrain_node_bytes_total", plane="relayed") == 0
    assert total(found, "swarmtrain_node_rounds_total", kind="outer", outcome="ok") >= 1
    steps = total(found, "swarmtrain_node_steps_total")
    assert steps >= 5 and total(found, "swarmtrain_node_step_seconds_count") >= steps and total(found, "swarmtrain_node_step_seconds_sum") > 0
    assert total(found, "swarmtrain_node_tokens_total") > 0 and total(found, "swarmtrain_node_samples_total") > 0
    assert total(found, "process_resident_memory_bytes") > 50e6
    status = json.loads(scrape(port, "/status"))
    member = coord.members()[status["peer_id"]]
    assert status["role"] == member["role"] == "replica" and status["progress"]["step"] >= 1 and status["progress"]["failure"] == ""
    assert status["traffic"]["direct"]["sent"] > 0 and status["traffic"]["sent"] >= status["traffic"]["direct"]["sent"]
    assert status["capabilities"]["software"] == member["capabilities"]["software"] and status["uptime_s"] > 0
    assert status["activity"]["rounds"]["outer/ok"] >= 1
    assert status["bans"] == []  # honest peers: nobody banned
    exported = {n for n, _, _ in found} | {n for n, _, _ in samples(coord.metrics())}
    assert queried_metric_names() <= exported, queried_metric_names() - exported


def check_a_ban_in_status(port: int, proc) -> None:
    """A peer that keeps sending a node bad frames is banned there, and the node's /status
    shows the ban with what earned it."""
    maddr = re.search(r"listening on (\S+)", proc.log()).group(1)
    node_id = maddr.rsplit("/p2p/", 1)[1]

    async def offend() -> str:
        host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(maddr,)))
        try:
            for _ in range(5):  # 2 points a bad frame; banned at -10
                reader, writer = await host.open_stream(node_id, RPC_PROTOCOL)
                writer.write(b"\x00\x00\x00\x03abc")  # a frame of 3 bytes that decode to nothing
                await writer.drain()
                await asyncio.wait_for(reader.read(1 << 16), 10)  # its bad_request reply
                writer.close()
            return host.peer_id
        finally:
            await host.shutdown()

    me = asyncio.run(offend())
    bans = {b["peer_id"]: b for b in json.loads(scrape(port, "/status"))["bans"]}
    assert list(bans) == [me] and bans[me]["bans"] == 1 and bans[me]["left_s"] > 0, bans
    assert re.fullmatch(r"5 offences in \d+ s, the last: bad input: .+", bans[me]["reason"]), bans[me]


def assert_same_hashes(swarm, names, steps):
    for k in steps:
        seen = {n: hashes(swarm, n).get(k) for n in names}
        assert len(set(seen.values())) == 1 and None not in seen.values(), f"step {k}: {seen}"


def three_replicas(swarm, *run: str):
    """A coordinator of RUN (then `run`) that waits for three replicas, and replicas a, b and c
    (c holds each of its parts 1 s, so a kill at its "matched", seen within the 0.1 s a poll
    takes, lands mid-round; every round of theirs waits on c's holds; and c logs at DEBUG):
    (the coordinator, its multiaddr, the replicas' processes by name)."""
    coord = swarm.coordinator("coordinator", None, None, *RUN, *run, "--min-replicas", "3")
    maddr = coord.wait_ready()["maddrs"][0]
    procs = {n: replica(swarm, n, maddr, i, *(["--fault-delay-parts-s", "1", "--log-level", "DEBUG"] if n == "c" else [])) for i, n in enumerate("abc")}
    return coord, maddr, procs


def three_steps_in_lockstep(swarm, names: list[str], drop: float) -> tuple[set[int], list[dict]]:
    """Three outer steps trained by every replica of `names` together, one hash at each, and a's
    validation loss down by more than `drop` since its start: (the steps all of them trained,
    a's history). The first of them by outer step 3: on a loaded machine a replica starved
    past a round's deadline fails that round, takes the others' state and trains the next."""

    def common() -> set[int]:
        together = set.intersection(*(trained_steps(swarm, n) for n in names))
        return together if len(together) >= 3 else set()

    together = wait_for(common, 300, "3 outer steps trained by every replica")
    assert min(together) <= 3, {n: history(swarm, n) for n in names}
    assert_same_hashes(swarm, names, together)
    h = history(swarm, "a")
    assert h[0].get("start") and h[-1]["val_loss"] < h[0]["val_loss"] - drop, [(e["outer_step"], e.get("val_loss")) for e in h]
    return together, h


def test_replicas_train_in_lockstep_survive_a_kill_and_take_a_joiner(swarm):
    coord, maddr, procs = three_replicas(swarm)
    names = ["a", "b", "c"]
    # three replicas train; identical outer state after every outer step; validation loss falls
    three_steps_in_lockstep(swarm, names, drop=0.3)

    # SIGKILL c while it is inside an all-reduce (its parts are held 1 s, so "matched" means mid-round)
    log_len = len(procs["c"].log())
    wait_for(lambda: ": matched" in procs["c"].log()[log_len:], 120, "c to enter an averaging round")
    procs["c"].kill()
    killed_at = max(step_of(swarm, "a"), step_of(swarm, "b"))
    wait_for(lambda: min(step_of(swarm, n) for n in ("a", "b")) >= killed_at + 3, 240, "a and b to go on after the kill")
    assert_same_hashes(swarm, ["a", "b"], trained_steps(swarm, "a") & trained_steps(swarm, "b"))
    assert not settled_leftovers(procs["c"].sid)  # its DHT child and p2pd go down with it (within seconds)

    # a 4th replica joins mid-run: it starts from the swarm's state and averages in lockstep
    procs["d"] = replica(swarm, "d", maddr, 3)
    wait_for(lambda: trained_steps(swarm, "d"), 240, "d to complete an outer step with the others")
    first = min(trained_steps(swarm, "d"))
    wait_for(lambda: min(step_of(swarm, n) for n in ("a", "b")) >= first, 60, "a and b to reach d's first step")
    assert_same_hashes(swarm, ["a", "b", "d"], [first])
    start = history(swarm, "d")[0]
    assert start.get("start") and hashes(swarm, "a").get(start["outer_step"]) == start["state_hash"]
    status = coord.status()
    assert any(c["step"] >= 2 for c in status["checkpoints"]), status["checkpoints"]
    assert status["progress"], "the coordinator shows the swarm's loss history"


def test_coordinator_restart_loses_no_checkpoint_and_a_stopped_run_resumes(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN, "--min-replicas", "2")
    maddr = coord.wait_ready()["maddrs"][0]
    http = free_port()
    nodes = {n: replica(swarm, n, maddr, i, *(["--http", f"127.0.0.1:{http}"] if n == "a" else [])) for i, n in enumerate(["a", "b"])}
    wait_for(lambda: any(c["step"] >= 4 for c in coord.status()["checkpoints"]), 300, "a checkpoint of step >= 4")
    check_node_http(http, coord)
    check_a_ban_in_status(http, nodes["a"])
    before = {c["step"]: c["state_hash"] for c in coord.status()["checkpoints"]}

    # the coordinator dies; the replicas keep training without it
    coord.proc.kill()
    at_kill = min(step_of(swarm, n) for n in nodes)
    wait_for(lambda: min(step_of(swarm, n) for n in nodes) >= at_kill + 2, 180, "training to go on without the coordinator")
    again = swarm.restart(coord, "coordinator-2")
    status = again.wait_ready()
    after = {c["step"]: c["state_hash"] for c in status["checkpoints"]}
    assert all(after.get(step) == h for step, h in before.items() if step >= min(before)), (before, after)
    wait_for(lambda: len(m := again.members()) == 2 and all(time.time() - x["last_seen"] < 5 for x in m.values()), 60,
             "both replicas to report again")

    # stop everything, then resume with fresh replicas: they start from the latest checkpoint
    for p in nodes.values():
        p.terminate()
    for p in nodes.values():
        assert p.wait(30) == 0
    latest = max(c["step"] for c in again.status()["checkpoints"])
    latest_hash = {c["step"]: c["state_hash"] for c in again.status()["checkpoints"]}[latest]
    again.proc.terminate()
    assert again.proc.wait(30) == 0
    third = swarm.restart(coord, "coordinator-3")
    third.wait_ready()
    fresh = {n: replica(swarm, n, maddr, i) for i, n in enumerate(["e", "f"])}
    wait_for(lambda: all(history(swarm, n) for n in fresh), 180, "the fresh replicas to start")
    for n in fresh:
        start = history(swarm, n)[0]
        assert start["outer_step"] == latest and start["state_hash"] == latest_hash
    wait_for(lambda: min(step_of(swarm, n) for n in fresh) >= latest + 1, 180, "training to resume")
    assert_same_hashes(swarm, list(fresh), trained_steps(swarm, "e") & trained_steps(swarm, "f"))


def test_a_lone_replica_trains_and_its_checkpoints_are_kept(swarm):
    # the default --min-replicas 1: a swarm of one replica applies its own outer steps
    coord = swarm.coordinator("coordinator", None, None, *RUN, "--max-outer-steps", "4")
    maddr = coord.wait_ready()["maddrs"][0]
    node = replica(swarm, "a", maddr, 0)
    wait_for(lambda: step_of(swarm, "a") >= 4, 180, "4 outer steps of the lone replica")
    h = history(swarm, "a")
    assert trained_steps(swarm, "a") >= {1, 2, 3, 4}, h
    seen = [e["state_hash"] for e in h]
    assert len(set(seen)) == len(seen), seen  # a new state at every outer step
    assert h[-1]["val_loss"] < h[0]["val_loss"] - 0.3, [(e["outer_step"], e.get("val_loss")) for e in h]
    assert "the swarm's only replica" in node.log() and "averaging failed" not in node.log()
    # checkpoints 2 and 4 (every 2, and the last) are kept, each verified by the one replica
    kept = wait_for(lambda: {c["step"]: c for c in coord.status()["checkpoints"] if c["step"] >= 4}, 60, "the last checkpoint")
    assert kept[4]["state_hash"] == hashes(swarm, "a")[4] and kept[4]["verified_by"] == 1, kept
    assert "verified by one replica" in coord.proc.log()
