"""Swarm test of a role that fails: a coordinator whose run diverges (`--inner-lr 1e9`) and real
replica daemons on loopback. Each replica's role fails at its first inner step; the coordinator
shows why, plans it idle, and the node stays up without a role until it is restarted."""

from __future__ import annotations

import pytest

from tests.swarm import Swarm, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

RUN = ["--model", "tiny", "--inner-steps", "5", "--eval-batches", "2", "--warmup-steps", "5", "--inner-lr", "1e9", "--heartbeat-timeout-s", "4"]
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5", "--num-shards", "4"]
DECLINED = "this node takes no role until it is restarted"


def failed_members(coord, n: int):
    """The members once `n` are listed, every one failed and planned idle (else None)."""
    members = coord.status()["members"]
    return members if len(members) == n and all(m["failed"] and m["role"] == "idle" for m in members) else None


def test_a_diverging_run_fails_each_replicas_role_shown_with_its_reason_and_the_nodes_take_no_role_again(swarm: Swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i)) for i, n in enumerate("ab")}

    members = wait_for(lambda: failed_members(coord, 2), 180, "both replicas' roles to fail and be planned idle")
    for m in members:
        assert m["failed"].startswith("the replica role failed: training diverged (non-finite") and "learning rate" in m["failed"], m
    status = coord.status()
    failures = [e for e in status["events"] if e["kind"] == "role_failed"]
    assert sorted(e["peer_id"] for e in failures) == sorted(m["peer_id"] for m in members)
    assert all(e["detail"] == next(m["failed"] for m in members if m["peer_id"] == e["peer_id"]) for e in failures)
    assert {e["kind"] for e in status["events"]} == {"join", "role_failed", "checkpoint"}  # (checkpoint 0: the initial state)

    # the nodes stay up, heartbeating, and say why once
    seen = {m["peer_id"]: m["last_seen"] for m in members}
    wait_for(lambda: all(m["last_seen"] > seen[m["peer_id"]] + 1 for m in coord.status()["members"]), 30, "heartbeats after the failure")
    for p in procs.values():
        assert p.alive() and "Traceback" not in p.log() and p.log().count(DECLINED) == 1, p.log()[-3000:]

    # a's heartbeats stop for longer than the timeout: it is evicted and registers again (the
    # coordinator forgets its failure: registering again is what a restart does) and is given the
    # replica role; the node declines it with one line and reports its failure again
    a = procs["a"]
    a_id = next(m["peer_id"] for m in members if m["peer_id"] in a.log())
    a.stall()
    try:
        wait_for(lambda: any(e["kind"] == "evict" and e["peer_id"] == a_id for e in coord.status()["events"]), 60, "a's eviction")
    finally:
        a.resume()
    wait_for(lambda: "not taking the replica role" in a.log(), 60, "a to decline the replica role it is given again")
    wait_for(lambda: failed_members(coord, 2), 60, "a to be failed and idle again")
    events = [(e["kind"], e["peer_id"]) for e in coord.status()["events"] if e["peer_id"] == a_id]
    assert events[-4:] == [("role_failed", a_id), ("evict", a_id), ("join", a_id), ("role_failed", a_id)], events
    log = a.log()
    assert a.alive() and "Traceback" not in log and log.count(DECLINED) == 1 and log.count("not taking the replica role") == 1, log[-3000:]
    assert log.count("replica: tiny model") == 1  # the role was taken once, at the start
