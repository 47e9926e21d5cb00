"""Swarm test of the streaming outer step (run setting fragments): a real coordinator and real
replica daemons on loopback, each fragment averaged in its own round while the inner steps go on."""

from __future__ import annotations

import re

import pytest

from tests.swarm import settled_leftovers, wait_for
from tests.test_swarm_training import (
    assert_same_hashes,
    hashes,
    history,
    replica,
    step_of,
    three_replicas,
    three_steps_in_lockstep,
    trained_steps,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

FRAGMENTS = ["--inner-steps", "6", "--fragments", "3"]  # (later flags win: H=6, not RUN's 5)


def test_fragment_replicas_keep_one_hash_through_a_kill_mid_fragment_and_a_joiner(swarm):
    coord, maddr, procs = three_replicas(swarm, *FRAGMENTS)
    names = ["a", "b", "c"]
    # three replicas train in fragments: one hash after every outer step, validation loss falls,
    # and every outer step is three rounds, each a third of the model
    common, h = three_steps_in_lockstep(swarm, names, drop=0.2)
    trained = [e for e in h if e["outer_step"] in common]
    assert all(e["fragments"] == 3 and not e["failed_fragments"] for e in trained), trained
    assert all(e["sync_bytes"] < 0.5 * (e["bytes_sent"] - prev["bytes_sent"]) for prev, e in zip(trained, trained[1:])), trained
    assert re.search(r"averaging outer-\d+-f2-[0-9a-f]{8}: matched", procs["c"].log())  # the key names the fragment

    # SIGKILL c inside the round of a fragment in the middle of its cycle (its parts are held 1 s)
    log_len = len(procs["c"].log())
    wait_for(lambda: re.search(r"averaging outer-\d+-f1-\w+: matched", procs["c"].log()[log_len:]), 120, "c to enter fragment 1's round")
    procs["c"].kill()
    killed_at = max(step_of(swarm, "a"), step_of(swarm, "b"))
    wait_for(lambda: min(step_of(swarm, n) for n in ("a", "b")) >= killed_at + 3, 240, "a and b to go on after the kill")
    assert_same_hashes(swarm, ["a", "b"], trained_steps(swarm, "a") & trained_steps(swarm, "b"))
    assert not settled_leftovers(procs["c"].sid)

    # a 4th replica joins while the others are in their cycle (they always are: one fragment's
    # round follows another's): it takes their state, then averages every fragment with them
    procs["d"] = replica(swarm, "d", maddr, 3)
    wait_for(lambda: trained_steps(swarm, "d"), 240, "d to complete an outer step with the others")
    first = min(trained_steps(swarm, "d"))
    wait_for(lambda: min(step_of(swarm, n) for n in ("a", "b", "d")) >= first + 2, 120, "two more outer steps of a, b and d")
    start = history(swarm, "d")[0]
    assert start.get("start") and hashes(swarm, "a").get(start["outer_step"]) == start["state_hash"]
    assert_same_hashes(swarm, ["a", "b", "d"], [first, first + 1, first + 2])
    last = {n: [e for e in history(swarm, n) if e["outer_step"] == first + 2][0] for n in ("a", "b", "d")}
    assert all(e["members"] == 3 and not e.get("failed_fragments") for e in last.values()), last
    assert any(c["step"] >= 2 for c in coord.status()["checkpoints"]), coord.status()["checkpoints"]
