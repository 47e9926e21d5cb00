"""A replica that stops without dying (SIGSTOP of its whole session: node, DHT process, p2pd),
with real coordinator and replica daemons on loopback. The one frozen is the round's leader
(the smallest peer id): its followers must not wait on it, and once it resumes it must notice
the pause, take the swarm's state and be back in rounds."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.swarm import Swarm, node_peer_id, session_pids, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

RUN = ["--model", "tiny", "--inner-steps", "10", "--checkpoint-every", "5", "--eval-batches", "2", "--warmup-steps", "5",
       "--join-timeout-s", "8", "--heartbeat-timeout-s", "10", "--min-replicas", "3"]
NODE = ["--threads", "1", "--heartbeat-interval-s", "1", "--num-shards", "4"]
FREEZE_S = 30


def history(swarm: Swarm, name: str) -> list[dict]:
    try:
        return json.loads((Path(swarm.tmp) / name / "replica-stats.json").read_text())["history"]
    except (FileNotFoundError, ValueError, KeyError):
        return []


def step(swarm: Swarm, name: str) -> int:
    h = history(swarm, name)
    return h[-1]["outer_step"] if h else -1


def test_a_frozen_leader_costs_the_others_little_and_is_back_in_rounds_after_it_resumes(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    names = ["a", "b", "c"]
    procs = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i)) for i, n in enumerate(names)}
    ids = {n: node_peer_id(p) for n, p in procs.items()}
    wait_for(lambda: all(step(swarm, n) >= 2 for n in names), 240, "two outer steps on every replica")
    leader = min(names, key=lambda n: ids[n])
    others = [n for n in names if n != leader]
    at_freeze = {n: step(swarm, n) for n in others}
    frozen = session_pids(procs[leader].sid)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        # the others go on without it: they stop waiting on their silent leader within seconds
        wait_for(lambda: all(step(swarm, n) >= at_freeze[n] + 3 for n in others), FREEZE_S, "the others' outer steps during the freeze")
        time.sleep(max(0.0, FREEZE_S - 1))  # the freeze lasts its full time: the swarm moves on meanwhile
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    at_thaw = max(step(swarm, n) for n in others)
    seen = len(history(swarm, leader))

    def back_in_rounds():
        averaged = [e for e in history(swarm, leader)[seen:] if "start" not in e and "caught_up_from" not in e]
        return averaged[0] if averaged else None

    first = wait_for(back_in_rounds, 120, "the frozen replica back in rounds")
    woke = history(swarm, leader)[seen:]
    assert any("caught_up_from" in e for e in woke), f"it averaged a stale round instead of taking the swarm's state: {woke}"
    assert first["outer_step"] <= at_thaw + 2, f"back only at outer step {first['outer_step']}; the others were at {at_thaw}"
    k = first["outer_step"]
    wait_for(lambda: all(step(swarm, n) >= k for n in others), 60, f"the others at outer step {k}")
    hashes = {n: {e["outer_step"]: e["state_hash"] for e in history(swarm, n)}.get(k) for n in names}
    assert len(set(hashes.values())) == 1, hashes
    assert "paused for about" in procs[leader].log()
