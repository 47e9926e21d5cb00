"""Replicas that stop without dying, with real coordinator and replica daemons: one frozen
(SIGSTOP of its whole session: node, DHT process, p2pd: a closed laptop lid, a paused VM), one
cut off (its link taken down in a network namespace: a home router that dropped), one steadily
slower than the others. The one frozen or cut off is the round's leader (the smallest peer id),
the worst case: its followers ask it first. They must not wait on it, must lose at most one
round, and once it is back it must take the swarm's state and average again within two steps."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.swarm import Proc, Swarm, netns_topology, node_peer_id, session_pids, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

RUN = ["--model", "tiny", "--inner-steps", "10", "--checkpoint-every", "5", "--eval-batches", "2", "--warmup-steps", "5",
       "--heartbeat-timeout-s", "10", "--min-replicas", "3"]  # the default 15 s join window
NODE = ["--threads", "1", "--heartbeat-interval-s", "1", "--num-shards", "4"]
OUTAGE_S = 20
STEPS_S = 60  # the longest the others may take for two outer steps while the leader is out (15 to 30 s each in a loaded suite)
NAMES = ["a", "b", "c"]


def history(swarm: Swarm, name: str) -> list[dict]:
    try:
        return json.loads((Path(swarm.tmp) / name / "replica-stats.json").read_text())["history"]
    except (FileNotFoundError, ValueError, KeyError):
        return []


def step(swarm: Swarm, name: str) -> int:
    h = history(swarm, name)
    return h[-1]["outer_step"] if h else -1


def averaged(entries: list[dict]) -> list[dict]:
    """The rounds a replica averaged (not its starting point, not a state it took from a peer)."""
    return [e for e in entries if "start" not in e and "caught_up_from" not in e]


def rounds_lost(entries: list[dict], since: int) -> int:
    """Outer steps after `since` that a replica did not average: failed rounds (the step moves
    on without an entry) and states taken from peers."""
    steps = [e["outer_step"] for e in averaged(entries) if e["outer_step"] > since]
    return (steps[-1] - since - len(steps)) if steps else 0


def outage(swarm: Swarm, procs: dict[str, Proc], ids: dict[str, str], begin: Callable[[str], None], end: Callable[[str], None], what: str) -> None:
    """Take the leader out for OUTAGE_S (`begin`, then `end`) and check what the issue asks:
    the others keep taking outer steps, losing at most one round; the leader is back in rounds
    with the swarm's hash within two outer steps of its return."""
    wait_for(lambda: all(step(swarm, n) >= 2 for n in NAMES), 240, "two outer steps on every replica")
    leader = min(NAMES, key=lambda n: ids[n])
    others = [n for n in NAMES if n != leader]
    at_start = {n: step(swarm, n) for n in others}
    begin(leader)
    t0 = time.monotonic()
    try:
        # two outer steps at least (rounds_lost below says they lost at most one): with three,
        # the cut-off case (outer steps of 5 s, 8 s and more on a slower machine) failed now and
        # then. The outage lasts OUTAGE_S, longer if a loaded machine makes two steps take longer
        # (a CI machine under other load took 15 s per outer step): a swarm stuck on its
        # leader takes one outer step a minute, and fails this either way
        wait_for(lambda: all(step(swarm, n) >= at_start[n] + 2 for n in others), STEPS_S, f"the others' outer steps while the leader is {what}")
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))  # the outage lasts its full time
    finally:
        end(leader)
    at_end = max(step(swarm, n) for n in others)
    for n in others:
        lost = rounds_lost(history(swarm, n), at_start[n])
        assert lost <= 1, f"{n} lost {lost} rounds while the leader was {what}: {history(swarm, n)[-12:]}"
    seen = len(history(swarm, leader))

    def back_in_rounds():
        done = averaged(history(swarm, leader)[seen:])
        return done[0] if done else None

    first = wait_for(back_in_rounds, 120, f"the {what} replica back in rounds")
    back = history(swarm, leader)[seen:]
    assert any("caught_up_from" in e for e in back), f"it averaged a stale round instead of taking the swarm's state: {back}"
    assert first["outer_step"] <= at_end + 2, f"back only at outer step {first['outer_step']}; the others were at {at_end}"
    k = first["outer_step"]
    wait_for(lambda: all(step(swarm, n) >= k for n in others), 60, f"the others at outer step {k}")
    hashes = {n: {e["outer_step"]: e["state_hash"] for e in history(swarm, n)}.get(k) for n in NAMES}
    assert len(set(hashes.values())) == 1, hashes


def test_a_frozen_leader_costs_the_others_at_most_a_round_and_is_back_after_it_resumes(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i)) for i, n in enumerate(NAMES)}
    ids = {n: node_peer_id(p) for n, p in procs.items()}
    frozen: list[int] = []

    def freeze(name):
        frozen.extend(session_pids(procs[name].sid))
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)

    def thaw(name):
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)

    outage(swarm, procs, ids, freeze, thaw, "frozen")
    leader = min(NAMES, key=lambda n: ids[n])
    assert "paused for about" in procs[leader].log()


@pytest.fixture
def topology():
    with netns_topology(n_peers=1 + len(NAMES), rate="1gbit", shape_download=False) as topo:
        yield topo


def test_a_cut_off_leader_costs_the_others_at_most_a_round_and_is_back_after_its_link_is(swarm, topology):
    # every daemon in its own network namespace; the coordinator in the first. 200 inner steps:
    # outer steps of about five seconds, longer than the network's own recovery once the link
    # is back (measured 3-6 s: stuck connections are dropped on a timeout, the DHT is re-joined
    # on a 2 s check); with 100 (under three seconds) the others were sometimes two steps on
    # before the replica could take their state. Real outer steps take minutes
    ip = topology.ip(0)
    coord = swarm.start("coordinator", "swarmtrain-coordinator", "--data-dir", str(swarm.tmp / "coordinator"), "--host-maddrs", f"/ip4/{ip}/tcp/0",
                        "--http", f"{ip}:0", *RUN, "--inner-steps", "200", prefix=topology.wrap(0, []))
    found = wait_for(lambda: re.search(rf"/ip4/{re.escape(ip)}/tcp/\d+/p2p/\w+", coord.log()), 60, "the coordinator's address")
    maddr = found.group(0)
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i), "--host-maddrs", f"/ip4/{topology.ip(i + 1)}/tcp/0",
                           prefix=topology.wrap(i + 1, [])) for i, n in enumerate(NAMES)}
    ids = {n: node_peer_id(p) for n, p in procs.items()}
    peer = {n: i + 1 for i, n in enumerate(NAMES)}
    outage(swarm, procs, ids, lambda n: topology.cut(peer[n]), lambda n: topology.restore(peer[n]), "cut off")


def test_a_steadily_slower_replica_keeps_its_place_in_rounds(swarm):
    # 40 inner steps: the slow replica arrives an inner phase (four to nine seconds in the
    # suite) after the others, every round. (A busy moment of the machine can make the others
    # later than it in a round or two: the waits below are per round)
    run = [*RUN, "--inner-steps", "40"]
    coord = swarm.coordinator("coordinator", None, None, *run)
    maddr = coord.wait_ready()["maddrs"][0]
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i), *(["--fault-slowdown", "2"] if n == "c" else []))
             for i, n in enumerate(NAMES)}
    for p in procs.values():
        node_peer_id(p)
    wait_for(lambda: step(swarm, "c") >= 5, 300, "five outer steps on the slow replica")
    slow = history(swarm, "c")
    start = next(e["outer_step"] for e in slow if "start" in e)
    assert rounds_lost(slow, start) == 0 and not any("caught_up_from" in e for e in slow), slow
    assert all(e["members"] == 3 for e in averaged(slow)), [e["members"] for e in averaged(slow)]
    # every inner phase ran on the thread count asked for (--threads 1); a thread that had
    # computed before the count was set kept torch's default, two threads per replica on two
    # cores, and made inner steps ten times slower
    assert {n: {e.get("threads") for e in averaged(history(swarm, n))} for n in NAMES} == {n: {1} for n in NAMES}
    # it is the slow one: in some round both others waited over a second for it while it
    # waited under half a second (per-round waits, not medians: a busy moment of the 2-core
    # machine, or a replica whose training stalls for a while, can make the others later
    # than it in a round or two of five)
    waits = {n: {e["outer_step"]: e["round_s"] for e in averaged(history(swarm, n))} for n in NAMES}
    assert any(min(waits["a"].get(k, 0.0), waits["b"].get(k, 0.0)) > 1.0 and w < 0.5 for k, w in waits["c"].items()), waits


def test_with_a_time_budget_a_slower_replica_trains_fewer_steps_and_nobody_waits_for_it(swarm):
    """--inner-phase time: the slow replica stops once the two others wait to average (the
    median replica finished), its pseudo-gradient weighed by its samples; every round keeps all
    three and one state."""
    coord = swarm.coordinator("coordinator", None, None, *RUN, "--inner-steps", "40", "--inner-phase", "time")
    maddr = coord.wait_ready()["maddrs"][0]
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i), *(["--fault-slowdown", "3"] if n == "c" else []))
             for i, n in enumerate(NAMES)}
    for p in procs.values():
        node_peer_id(p)
    wait_for(lambda: all(step(swarm, n) >= 4 for n in NAMES), 300, "four outer steps on every replica")
    rounds = {n: {e["outer_step"]: e for e in averaged(history(swarm, n))} for n in NAMES}
    common = sorted(set.intersection(*(set(r) for r in rounds.values())))
    assert len(common) >= 3, rounds
    assert all(len({rounds[n][k]["state_hash"] for n in NAMES}) == 1 and rounds["c"][k]["members"] == 3 for k in common), rounds
    # the fast replicas take their 40 steps; the slow one (a third of their speed) far fewer
    assert all(rounds[n][k]["inner_steps"] == 40 for n in ("a", "b") for k in common), rounds
    assert all(rounds["c"][k]["inner_steps"] <= 30 for k in common), [rounds["c"][k]["inner_steps"] for k in common]
