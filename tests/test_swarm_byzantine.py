"""A Byzantine replica in a real swarm: it sends its pseudo-gradient reversed and scaled a
thousandfold in every round (well formed: the all-reduce's checks pass it). The honest replicas
average with CenteredClip, train on as if it were not there, hold one state, and ban it on the
evidence of its parts, each with the reason in its log and /status. Nobody honest is banned.
The liar has the smallest peer id, so it leads every round it is in: the worst case (once
banned, the honest ones must neither follow it nor wait for it)."""

from __future__ import annotations

import json
import re

import pytest

from protocol import SigningKey
from protocol.signatures import peer_id_from_public_key
from tests.swarm import free_port, node_peer_id, wait_for
from tests.test_swarm_training import RUN, assert_same_hashes, history, replica, scrape, step_of, trained_steps

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

HONEST = ["a", "b", "c"]
ROBUST = ["--aggregator", "centered_clip"]


def test_a_sign_flipping_replica_is_outvoted_and_banned_by_the_honest_ones(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN, "--min-replicas", "4")
    maddr = coord.wait_ready()["maddrs"][0]
    http = free_port()
    keys = sorted((SigningKey.generate() for _ in range(4)), key=lambda k: peer_id_from_public_key(k.public_key))
    for n, key in zip(["liar", *HONEST], keys):  # the liar's peer id the smallest: it leads
        key.save(swarm.tmp / f"{n}.pem")
    procs = {n: replica(swarm, n, maddr, i, *ROBUST, "--identity", str(swarm.tmp / f"{n}.pem"), *(["--http", f"127.0.0.1:{http}"] if n == "a" else []))
             for i, n in enumerate(HONEST)}  # fmt: skip
    procs["liar"] = replica(swarm, "liar", maddr, 3, *ROBUST, "--identity", str(swarm.tmp / "liar.pem"), "--fault-attack", "sign-flip")
    ids = {n: node_peer_id(p) for n, p in procs.items()}
    assert min(ids.values()) == ids["liar"]

    def banned_by(n: str) -> set[str]:
        return set(re.findall(r"banned (\S+) for \d+ s", procs[n].log()))

    # every honest replica bans the liar on its own evidence: its parts far from the robust aggregate
    wait_for(lambda: all(ids["liar"] in banned_by(n) for n in HONEST), 300, "every honest replica to ban the liar")
    for n in HONEST:
        assert banned_by(n) == {ids["liar"]}, (n, banned_by(n))  # and nobody else
        assert re.search(rf"banned {ids['liar']} for \d+ s \(ban 1\): 5 offences in \d+ s, the last: round outer-\d+-\w+: its part of slice \d+ was [\d.]+x the group's spread", procs[n].log())
    bans = json.loads(scrape(http, "/status"))["bans"]
    assert [b["peer_id"] for b in bans] == [ids["liar"]] and "from the robust aggregate" in bans[0]["reason"], bans

    # the honest ones train on, in lockstep, and better than where they started
    at_ban = max(step_of(swarm, n) for n in HONEST)
    wait_for(lambda: min(step_of(swarm, n) for n in HONEST) >= at_ban + 3, 240, "three more outer steps of the honest replicas")
    together = set.intersection(*(trained_steps(swarm, n) for n in HONEST))
    assert len(together) >= 5, {n: history(swarm, n) for n in HONEST}
    assert_same_hashes(swarm, HONEST, together)
    h = history(swarm, "a")
    assert h[-1]["val_loss"] < h[0]["val_loss"] - 0.3, [(e["outer_step"], e.get("val_loss")) for e in h]
