"""Peers that stop without dying (SIGSTOP: a closed laptop lid, a paused VM): real averaging
peers in their own processes, real p2pd. A frozen leader costs its followers seconds, not the
join call's own timeout, and is back in rounds once it resumes."""

import os
import signal

import pytest

from tests.swarm import session_pids
from tests.test_swarm_averaging import Peer, close_peers, run_round, start_peers

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def freeze(p: Peer) -> None:
    for pid in session_pids(p.proc.pid):  # the peer, its DHT process and its p2pd
        os.kill(pid, signal.SIGSTOP)


def thaw(p: Peer) -> None:
    for pid in session_pids(p.proc.pid):
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def trio(tmp_path):
    ps = start_peers("f", 3, tmp_path)
    yield ps
    for p in ps:
        thaw(p)
    leftovers = close_peers(ps)
    assert not any(leftovers.values()), leftovers


def test_followers_of_a_frozen_leader_form_their_own_group_within_the_window(trio):
    # the join call to a leader waits up to 3 windows + grace (here 34 s); the window is 10 s
    for p in trio:
        p.configure(join_timeout_s=10.0)
    first = run_round(trio, "frozen-0", 20_000)
    assert all(r["ok"] for r in first.values()), first
    leader = min(trio, key=lambda p: p.peer_id)
    assert all(r["leader"] == leader.peer_id for r in first.values())
    others = [p for p in trio if p is not leader]
    freeze(leader)
    # the followers ask the last round's leader first: it never answers, its probes neither
    second = run_round(others, "frozen-1", 20_000, expected=2)
    for name, r in second.items():
        assert r["ok"], (name, r)
        assert sorted(r["members"]) == sorted(p.peer_id for p in others)
        assert r["sha"] == second[others[0].name]["sha"]
    thaw(leader)
    third = run_round(trio, "frozen-2", 20_000)
    assert all(r["ok"] for r in third.values()), third
    assert all(sorted(r["members"]) == sorted(p.peer_id for p in trio) for r in third.values())


def test_a_member_frozen_mid_round_is_let_go_on_unanswered_probes_not_at_the_deadline(trio):
    # the member holds its parts (alive, 6 s), and is frozen meanwhile: the others probe the
    # members whose parts they wait for, and stop waiting after two unanswered probes, long
    # before the phase deadline (15 s here)
    leader = min(trio, key=lambda p: p.peer_id)
    frozen = next(p for p in trio if p is not leader)
    others = [p for p in trio if p is not frozen]
    for p in trio:
        p.configure(join_timeout_s=10.0, base_timeout_s=15.0, faults={"delay_parts_s": 6.0} if p is frozen else {})
    seeds = {p.peer_id: i + 1 for i, p in enumerate(trio)}
    for p in trio:
        p.send(op="average", key="mid-round", seeds=seeds, numel=20_000, expected=3, watch=p is frozen)
    # matched (all three expected joined) and the others' parts in, its own still held back
    senders = {p.peer_id for p in others}
    frozen.wait_until("parts_from", "mid-round", lambda ev: senders <= set(ev["peers"]), 30, "the others' parts at the member that holds back its own")
    freeze(frozen)
    results = {p.name: p.next("result", 60, "mid-round") for p in others}
    for name, r in results.items():
        assert r["ok"], (name, r)
        assert frozen.peer_id not in r["survivors"] and r["equals_reference"]
        assert r["silent"] == [frozen.peer_id], r  # let go on its probes, not by the phase deadline
    thaw(frozen)
    assert not frozen.next("result", 60, "mid-round")["ok"]
