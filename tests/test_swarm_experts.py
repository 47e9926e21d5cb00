"""Swarm test of expert-parallel training: a real coordinator, four expert hosts (two shards of
the tiny MoE model's experts, two replicas each) and two trainers on loopback."""

from __future__ import annotations

import time

from tests.swarm import Swarm, node_peer_id, settled_leftovers, wait_for
from tests.test_swarm_pipeline import NODE, since_start, stats

import pytest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

RUN = [
    "--mode", "experts", "--model", "tiny-moe", "--expert-shards", "2", "--batch-size", "4", "--stage-step-samples", "8",
    "--warmup-steps", "5", "--heartbeat-timeout-s", "10", "--stage-sync-every-s", "2",
]  # fmt: skip


def hosts_of(coord) -> dict[str, list[str]]:
    """shard -> peer ids the coordinator assigned to it."""
    out: dict[str, list[str]] = {}
    for m in coord.status()["members"]:
        if m.get("role") == "expert":
            out.setdefault(m["expert"], []).append(m["peer_id"])
    return out


def micro_batches(swarm, name) -> int:
    return stats(swarm, name, "trainer").get("micro_batches", 0)


def served(swarm, name) -> int:
    return stats(swarm, name, "expert").get("calls", {}).get("forward", 0)


def common_syncs(swarm, names) -> dict[int, list[str]]:
    """sync round -> the hash each of `names` held after it, for rounds all of them averaged in
    since they took their shard (a host the planner moved synced with the other shard before)."""
    seen = [{e["sync"]: e["state_hash"] for e in since_start(stats(swarm, n, "expert").get("history", [])) if e.get("group", 0) >= 2} for n in names]
    return {k: [s[k] for s in seen] for k in set.intersection(*(set(s) for s in seen))}


def test_expert_hosts_and_trainers_train_through_a_killed_a_frozen_and_a_restarted_host(swarm: Swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    hosts = {f"h{i}": swarm.node(f"h{i}", [maddr], *NODE) for i in range(4)}
    trainers = {f"t{i}": swarm.node(f"t{i}", [maddr], *NODE, "--wanted-role", "trainer", "--shard-index", str(i)) for i in range(2)}
    wait_for(lambda: sorted(map(len, hosts_of(coord).values())) == [2, 2], 120, "two hosts on each of two shards")
    wait_for(lambda: min(micro_batches(swarm, t) for t in trainers) >= 16, 300, "16 micro-batches per trainer")
    ids = {n: node_peer_id(p) for n, p in hosts.items()}

    def serving_as_planned() -> dict[str, int] | None:
        """host -> its shard, once every host serves the shard the coordinator plans for it (the
        planner may move a host after the first micro-batches: shards even by speed)"""
        plan, shard = hosts_of(coord), {n: stats(swarm, n, "expert").get("expert_shard") for n in hosts}
        return shard if all(ids[n] in plan.get(f"shard{s}", []) for n, s in shard.items()) else None

    shard = wait_for(serving_as_planned, 60, "every host serving the shard planned for it")
    for n in hosts:  # each host holds its shard's experts only, and refused nothing
        st = stats(swarm, n, "expert")
        assert st["experts"] == [f"layer{li}.expert{e}" for li in (0, 1) for e in (shard[n], shard[n] + 2)], st["experts"]
        assert st["calls"]["refused"] == 0
    pairs = [[n for n in hosts if shard[n] == s] for s in (0, 1)]
    # the replicas of a shard report one hash after each sync
    wait_for(lambda: all(len(common_syncs(swarm, pair)) >= 2 for pair in pairs), 120, "two common syncs on each shard")
    for pair in pairs:
        for n, hashes in common_syncs(swarm, pair).items():
            assert len(set(hashes)) == 1, (pair, n, hashes)

    # SIGKILL a host of a shard with two (in its own stats and in the coordinator's plan): its
    # calls fail once and go to its replica; training goes on
    def settled() -> list[str]:
        plan = hosts_of(coord)
        for s in (0, 1):
            names = [n for n in hosts if stats(swarm, n, "expert").get("expert_shard") == s]
            if len(names) == 2 and sorted(ids[n] for n in names) == sorted(plan.get(f"shard{s}", [])):
                return names
        return []

    victim, replica = wait_for(settled, 60, "a shard whose two hosts serve it and are planned there")
    before = {t: micro_batches(swarm, t) for t in trainers}
    hosts[victim].kill()
    wait_for(lambda: all(micro_batches(swarm, t) >= before[t] + 8 for t in trainers), 120, "8 more micro-batches per trainer after the kill")
    assert not settled_leftovers(hosts[victim].sid)  # its DHT child and p2pd go down with it (within seconds)

    # SIGSTOP the other host of that shard, now its only one: its calls pass their deadline, then the
    # routers give its experts no tokens while it is frozen; training goes on
    skipped = {t: stats(swarm, t, "trainer")["skipped_experts"] for t in trainers}
    before = {t: micro_batches(swarm, t) for t in trainers}
    hosts[replica].stall()
    try:
        wait_for(lambda: all(micro_batches(swarm, t) >= before[t] + 8 for t in trainers), 120, "8 more micro-batches per trainer with the shard frozen")
        assert any(stats(swarm, t, "trainer")["skipped_experts"] > skipped[t] for t in trainers)
        timed_out = [w for t in trainers for w in trainers[t].log().split(f"with {ids[replica]} timed out after ")[1:]]
        assert timed_out and max(float(w.split(" s)")[0]) for w in timed_out) < 10.0, timed_out  # deadlines from measured times
    finally:
        hosts[replica].resume()
    calls = served(swarm, replica)
    wait_for(lambda: served(swarm, replica) > calls + 8, 120, "the frozen host to serve calls again after SIGCONT")

    # the killed host comes back (same data dir, same identity): it takes its shard's state from
    # the replica, hash-verified, not the initial weights
    restarted = time.time()
    again = swarm.start("h-again", "swarmtrain-node", "--data-dir", str(swarm.tmp / victim), "--initial-peers", maddr, *NODE)

    def started() -> dict | None:
        entries = [e for e in stats(swarm, victim, "expert").get("history", []) if e.get("start") and e["time"] > restarted]
        return entries[-1] if entries else None

    start = wait_for(started, 120, "the restarted host to take a shard")
    assert again.alive()
    assert start["state_from"] in {ids[n] for n in hosts if n != victim}, (start, ids)
    mine = stats(swarm, victim, "expert")["expert_shard"]
    holders = [n for n in hosts if n != victim and stats(swarm, n, "expert").get("expert_shard") == mine]
    assert start["state_hash"] in {e["state_hash"] for n in holders for e in stats(swarm, n, "expert")["history"] if "sync" in e}, start
    # no exception reached a trainer's training loop
    for t, proc in trainers.items():
        assert "Traceback" not in proc.log() and "role failed" not in proc.log(), proc.log()[-3000:]
    for t in trainers:
        h = stats(swarm, t, "trainer")["history"]
        assert h[-1]["loss"] < h[0]["loss"] - 0.3, [(e["micro_batches"], round(e["loss"], 3)) for e in h]
