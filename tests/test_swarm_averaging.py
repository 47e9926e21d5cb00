"""Swarm tests of the all-reduce: every peer is its own process with its own p2pd."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.swarm import ROOT, settled_leftovers

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


class Peer:
    def __init__(self, name: str, initial: list[str], log_dir, wait: bool = True):
        self.name = name
        self.log = open(log_dir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.avg_peer", *initial],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT, start_new_session=True,
        )
        self.events: queue.Queue = queue.Queue()
        self._quit = False
        threading.Thread(target=self._read, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        ready = self.next("ready", 90)
        self.peer_id, self.maddr = ready["peer_id"], ready["maddr"]

    def _read(self):
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def send(self, **cmd):
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def next(self, kind: str, timeout: float, key: str | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise queue.Empty
                ev = self.events.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {kind} event in {timeout:.0f} s") from None
            if ev["event"] == "exit":
                raise AssertionError(f"{self.name} exited")
            if ev["event"] == kind and (key is None or ev.get("key") == key):
                return ev

    def wait_until(self, kind: str, key: str, cond, timeout: float, what: str) -> dict:
        """The first `kind` event of round `key` for which `cond(event)` holds (the events of an
        `average` sent with watch=True); fails naming `what` after `timeout` s."""
        deadline = time.monotonic() + timeout
        try:
            while not cond(ev := self.next(kind, deadline - time.monotonic(), key)):
                pass
        except TimeoutError:
            raise TimeoutError(f"{self.name}: timed out after {timeout:.0f} s waiting for {what}") from None
        return ev

    def configure(self, faults: dict | None = None, **config):
        self.send(op="config", config=config, faults=faults or {})
        self.next("configured", 30)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def quit(self) -> None:
        """Ask the peer to leave (`close` waits for it)."""
        if self.proc.poll() is None and not self._quit:
            try:
                self.send(op="quit")
                self._quit = True
            except OSError:
                pass

    def close(self) -> list[int]:
        self.quit()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        left = settled_leftovers(self.proc.pid)  # (a killed peer's DHT process and p2pd go by themselves, within seconds)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
        return left


def start_peers(prefix: str, n: int, log_dir) -> list[Peer]:
    """n peers named <prefix>0..: the first, then the others, bootstrapped from it, all at once."""
    ps = [Peer(f"{prefix}0", [], log_dir)]
    try:
        ps += [Peer(f"{prefix}{i}", [ps[0].maddr], log_dir, wait=False) for i in range(1, n)]
        for p in ps[1:]:
            p.wait_ready()
    except BaseException:
        close_peers(ps)
        raise
    return ps


def close_peers(ps: list[Peer]) -> dict[str, list[int]]:
    """Ask every peer to leave at once, then wait for each; what was left of each (killed now)."""
    for p in ps:
        p.quit()
    return {p.name: p.close() for p in ps}


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    ps = start_peers("p", 5, tmp_path_factory.mktemp("avg"))
    yield ps
    leftovers = close_peers(ps)
    assert not any(leftovers.values()), leftovers


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """The peers live for the whole module; their cleanup is checked by the fixture above."""
    yield


@pytest.fixture(autouse=True)
def fresh_reputations(request):
    """Every test starts with peers that hold nothing against each other. The peers live for the
    whole module, and the tests that inject bad parts score their sender down at its receivers:
    carried over, a few such tests add up to a ban, and later tests would see the banned peer
    excluded from rounds it should be part of."""
    if "peers" in request.fixturenames:
        for p in request.getfixturevalue("peers"):
            if p.proc.poll() is None:
                p.send(op="forget")
                p.next("forgot", 30)
    yield


def run_round(group: list[Peer], key: str, numel: int, timeout: float = 90, expected: int | None = None) -> dict[str, dict]:
    seeds = {p.peer_id: i + 1 for i, p in enumerate(group)}
    for p in group:
        p.send(op="average", key=key, seeds=seeds, numel=numel, expected=len(group) if expected is None else expected)
    return {p.name: p.next("result", timeout, key) for p in group}


CODECS = [
    ("none", {}),
    ("fp16", {}),
    ("int8", {"block_size": 256}),
    ("topk", {"ratio": 0.05}),
    ("powersgd", {"rank": 4}),
    ("sparse", {"density": 0.05, "bits": 2, "chunk": 4096}),  # gathered sparse too, with the owners' feedback
    ("sparse", {"density": 1.0, "bits": 2, "chunk": 1024}),  # every value, no indices: dense 2-bit
]


def bound(codec: str, max_abs: float) -> float:
    """Max abs error vs the exact mean, per codec: scatter and gather error of one step each."""
    return {
        "none": 1e-5 * max_abs,
        "fp16": 2 * max_abs * 2**-10,
        "int8": 2 * max_abs / 127,
    }.get(codec, float("inf"))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_groups_of_every_size_and_codec(peers, size):
    group = peers[:size]
    # groups of three declare their bandwidth, so their parts leave paced, all at once; the
    # others send them in turn: both schedules with every codec
    declared = 50e6 if size == 3 else 0.0
    for i, (name, params) in enumerate(CODECS):
        for p in group:
            p.configure(codec=name, codec_params=params, join_timeout_s=10, bandwidth=declared)
        results = run_round(group, f"g{size}-{i}-{name}", numel=20_000)
        shas = {r["sha"] for r in results.values() if r["ok"]}
        assert all(r["ok"] for r in results.values()), results
        for r in results.values():
            assert (r["schedule"], r["pace"]) == (("paced", 0.92 * declared) if declared else ("in turn", 0.0)), r
        assert len(shas) == 1, f"{name}: results differ across peers"
        # owners send their slices before the decision (optimistic gather), and those count
        assert sum(r["early_used"] for r in results.values()) > 0, results
        for r in results.values():
            assert sorted(r["members"]) == sorted(p.peer_id for p in group) and r["failed"] == []
            assert r["shapes_kept"]
            # bitwise equal to the same codec pipeline computed locally from the inputs
            assert r["equals_reference"], (name, r)
            assert r["max_err"] <= bound(name, r["max_abs"]), (name, r["max_err"])
            if name in ("topk", "powersgd", "sparse"):
                assert r["rel_err"] < 1.0  # one lossy step without history; error feedback sends the rest later


@pytest.mark.parametrize("size", [3, 4])
def test_nan_and_wrong_shape_senders_are_excluded_and_named(peers, size):
    # in a group of three the bad sender is accused by both honest owners; a rule that trusted
    # neither accuser (each accused half of the others) would exclude the honest pair instead
    group = peers[:size]
    leader = min(group, key=lambda p: p.peer_id)
    # with a lossy codec, the owner that inherits the bad sender's slice counts its own part
    # as the bad sender would have decoded it: still the same bits everywhere
    for kind, codec, params in (("nan", "none", {}), ("shape", "none", {}), ("nan", "int8", {"block_size": 256}), ("nan", "sparse", {"density": 0.05})):
        # the NaN sender is the round's leader: excluded, it must still coordinate the commit
        bad = leader if kind == "nan" else next(p for p in group if p is not leader)
        for p in group:
            p.configure(faults={"corrupt_parts": kind} if p is bad else {}, codec=codec, codec_params=params, join_timeout_s=10)
        results = run_round(group, f"bad{size}-{kind}-{codec}", numel=20_000)
        good = [results[p.name] for p in group if p is not bad]
        assert all(r["ok"] for r in good), [(r["ok"], r.get("reason"), r.get("failed")) for r in good]
        assert len({r["sha"] for r in good}) == 1
        for r in good:
            assert bad.peer_id not in r["survivors"]
            assert [f[0] for f in r["failed"]] == [bad.peer_id]
            assert "NaN" in r["failed"][0][1] if kind == "nan" else "shape" in r["failed"][0][1]
            assert r["equals_reference"]  # the mean of the good peers, exactly
        assert not results[bad.name]["ok"]
        assert results[bad.name]["unchanged"]


def test_on_uneven_links_the_slowest_owns_no_slice_and_a_failed_owners_slices_are_reowned(peers):
    """Members that declare uneven links: the slowest owns no slice, the others several each,
    interleaved, and parts leave in turn (slice order). Every member ends with the same bits,
    those of the same pipeline computed locally. Then an owner sends NaN: it is excluded, its
    slices go to the surviving owners (not to the slow member), the survivors still agree."""
    group = peers[:4]
    slow = group[2]
    numel = 400_000  # long enough for two slices per owner
    rounds = (("int8", {"block_size": 256}, None), ("none", {}, next(p for p in group if p is not slow and p is not min(group, key=lambda p: p.peer_id))))
    for codec, params, bad in rounds:
        for p in group:
            p.configure(faults={"corrupt_parts": "nan"} if p is bad else {}, codec=codec, codec_params=params, join_timeout_s=10,
                        bandwidth=12.5e6 if p is slow else 50e6)
        results = run_round(group, f"uneven-{codec}", numel=numel)
        good = [results[p.name] for p in group if p is not bad]
        assert all(r["ok"] for r in good), [(r["ok"], r.get("reason"), r.get("failed")) for r in good]
        assert len({r["sha"] for r in good}) == 1
        for r in good:
            owners = {r["members"][i] for i in r["slice_owners"]}
            assert slow.peer_id not in owners and len(owners) == 3 and len(r["slice_owners"]) == 6, r["slice_owners"]
            assert r["schedule"] == "in turn" and r["equals_reference"], r
            assert r["max_err"] <= bound(codec, r["max_abs"])
            assert [f[0] for f in r["failed"]] == ([bad.peer_id] if bad else [])
        if bad:
            assert not results[bad.name]["ok"] and results[bad.name]["unchanged"]


def test_a_member_that_keeps_sending_nan_is_banned_and_left_out(peers):
    """Bad parts score their sender down at each receiver; a sender that keeps at it is banned
    there (the transport refuses its calls). A banned member that turns honest is still left
    out: the others finish the round without it, with the same result."""
    group = peers[:3]
    leader = min(group, key=lambda p: p.peer_id)
    bad = next(p for p in group if p is not leader)
    others = [p for p in group if p is not bad]
    for p in group:
        p.configure(faults={"corrupt_parts": "nan"} if p is bad else {}, codec="none", join_timeout_s=5)
    banned_by = set()
    for k in range(8):
        results = run_round(group, f"ban-{k}", numel=20_000)
        assert all(results[p.name]["ok"] for p in others), results
        assert not results[bad.name]["ok"]
        for p in others:
            p.send(op="banned")
            if bad.peer_id in p.next("banned", 30)["peers"]:
                banned_by.add(p.name)
        if len(banned_by) == len(others):
            break
    print(f"banned by both receivers after {k + 1} rounds")
    assert len(banned_by) == len(others), f"still not banned after {k + 1} rounds of NaN parts"
    bad.configure(codec="none", join_timeout_s=5)
    results = run_round(group, "ban-after", numel=20_000)
    good = [results[p.name] for p in others]
    assert all(r["ok"] for r in good), good
    assert len({r["sha"] for r in good}) == 1
    for r in good:
        assert bad.peer_id not in r["survivors"] and r["equals_reference"]
    assert not results[bad.name]["ok"] and results[bad.name]["unchanged"]


def test_selective_liar_voids_the_slices_sent_before_the_decision(peers):
    """A member sends NaN to one owner only: the other owners hold every part, average over all
    four and send their slices before the decision (optimistic gather). The decision excludes
    the liar, so those slices must be thrown away and sent again over the three survivors.
    The accuser reports late, so the early slices have surely arrived by then."""
    group = peers[:4]
    leader = min(group, key=lambda p: p.peer_id)
    liar, victim = [p for p in group if p is not leader][:2]
    for p in group:
        faults = {}
        if p is liar:
            faults = {"corrupt_parts": "nan", "corrupt_only_to": [victim.peer_id]}
        elif p is victim:
            faults = {"delay_reports_s": 1.5}
        p.configure(faults=faults, codec="none", join_timeout_s=10)
    results = run_round(group, "liar-1", numel=20_000)
    good = [results[p.name] for p in group if p is not liar]
    assert all(r["ok"] for r in good), [(r["ok"], r.get("reason"), r.get("failed")) for r in good]
    assert len({r["sha"] for r in good}) == 1
    for r in good:
        assert [f[0] for f in r["failed"]] == [liar.peer_id] and "NaN" in r["failed"][0][1]
        assert r["equals_reference"]  # the mean of the three honest peers, not of all four
        assert r["early_used"] == 0
    assert sum(r["early_discarded"] for r in good) >= 2, good
    assert not results[liar.name]["ok"] and results[liar.name]["unchanged"]


def _round_with_a_faulty_leader(group: list[Peer], faults: dict, key: str) -> dict[str, dict]:
    """One round in which the group's leader (the smallest peer id) runs with `faults`; every
    member must succeed with the same result."""
    leader = min(group, key=lambda p: p.peer_id)
    for p in group:
        p.configure(faults=faults if p is leader else {}, codec="none", join_timeout_s=10)
    results = run_round(group, key, numel=20_000)
    assert all(r["ok"] for r in results.values()), [(r["ok"], r.get("reason")) for r in results.values()]
    assert len({r["sha"] for r in results.values()}) == 1
    return results


def test_a_lost_decision_reply_is_asked_for_again(peers):
    """The leader decides and commits, but its replies to both followers' reports are lost
    (the stream closes without an answer), in both phases. Neither follower can learn the
    decision from the other, who lacks it too: each must ask the leader again, or the leader
    would commit a round that its members report as failed."""
    results = _round_with_a_faulty_leader(peers[:3], {"lose_decision_replies": 4}, "lost-reply-1")
    assert all(r["equals_reference"] for r in results.values())


def test_a_member_whose_join_reply_was_lost_is_answered_again(peers):
    """The leader counts both followers into the group, but its answers are lost; each follower
    asks once more and must get the same group back, not "the group already formed" (which
    left the leader waiting for a member that had given up)."""
    results = _round_with_a_faulty_leader(peers[:3], {"lose_join_replies": 2}, "lost-join-1")
    assert all(len(r["members"]) == 3 for r in results.values())


def test_a_part_arriving_after_the_round_never_touches_the_result(peers):
    """Once `average` has returned, the tensors are the caller's: a member that sends its slice
    again (here zeroed, a second after the round) is refused, and the result stays as returned."""
    group = peers[:3]
    replayer = group[1]
    for p in group:
        p.configure(faults={"replay_gather_s": 1.0} if p is replayer else {}, codec="none", join_timeout_s=10)
    results = run_round(group, "replay-1", numel=20_000)
    assert all(r["ok"] for r in results.values()), [(r["ok"], r.get("reason")) for r in results.values()]
    while replayer.next("phase", 30, "replay-1")["phase"] != "replayed":
        pass  # the round's own phases, if not read yet; then every replayed part was answered
    for p in group:
        if p is not replayer:
            p.send(op="recheck")
            assert p.next("recheck", 30)["sha"] == results[p.name]["sha"]


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_on_both_sides_makes_the_running_mean_converge(peers, feedback):
    """int8 both ways, the same inputs every round. With error feedback at the senders and at
    the slice owners, the mean of K results is the exact mean up to two residuals over K; with
    the owners' feedback off, every gather's rounding error stays in (the reference here)."""
    group = peers[:3]
    for p in group:
        p.configure(codec="int8", codec_params={"block_size": 256}, join_timeout_s=10, gather_feedback=feedback)
    seeds = {p.peer_id: i + 1 for i, p in enumerate(group)}
    for p in group:
        p.send(op="repeat", key=f"ef-{feedback}", seeds=seeds, numel=20_000, rounds=8)
    results = [p.next("result", 120, f"ef-{feedback}") for p in group]
    assert all(r["ok"] for r in results), results
    assert len({r["sha"] for r in results}) == 1
    first, last = results[0]["errors"][0], results[0]["errors"][-1]
    print("errors of the running mean, round by round:", results[0]["errors"])
    if feedback:
        assert last < 0.25 * first, results[0]["errors"]  # measured: ~0.12
    else:
        assert last > 0.3 * first, results[0]["errors"]  # measured: ~0.40; what the line above catches


def test_an_unexpected_joiner_does_not_take_the_place_of_an_expected_one(peers):
    """The leader counts on itself and x. y, whom it did not know about, joins first: with a
    count the group would close at two and leave x out; with ids it waits for x as well."""
    leader, x, y = sorted(peers[:3], key=lambda p: p.peer_id)
    for p in (leader, x, y):
        p.configure(codec="none", join_timeout_s=10)
    seeds = {p.peer_id: i + 1 for i, p in enumerate((leader, x, y))}
    expected = [leader.peer_id, x.peer_id]
    for p in (leader, y):
        p.send(op="average", key="ids-1", seeds=seeds, numel=20_000, expected=expected, watch=p is leader)
    # x is on its way, a little behind: it asks once y waits in the leader's group
    leader.wait_until("joined", "ids-1", lambda ev: y.peer_id in ev["peers"], 30, "y's join in the leader's group")
    x.send(op="average", key="ids-1", seeds=seeds, numel=20_000, expected=expected)
    results = [p.next("result", 60, "ids-1") for p in (leader, x, y)]
    assert all(r["ok"] for r in results), results
    assert all(sorted(r["members"]) == sorted(seeds) for r in results), results
    assert len({r["sha"] for r in results}) == 1


def test_late_peer_joins_the_next_round(peers):
    group, late = peers[:2], peers[2]
    for p in peers[:3]:
        p.configure(codec="int8", codec_params={"block_size": 256}, join_timeout_s=2)
    seeds = {p.peer_id: i + 1 for i, p in enumerate(peers[:3])}
    for p in group:
        p.send(op="average", key="late-1", seeds=seeds, numel=20_000, expected=None)
    group[0].next("phase", 30, "late-1")  # the group has formed (window closed) before the late peer asks
    late.send(op="average", key="late-1", seeds=seeds, numel=20_000, expected=None)
    first = {p.name: p.next("result", 60, "late-1") for p in peers[:3]}
    assert first[late.name]["ok"] is False and "late" in first[late.name]["reason"]
    assert first[late.name]["unchanged"]
    assert all(first[p.name]["ok"] and len(first[p.name]["members"]) == 2 for p in group)
    second = run_round(peers[:3], "late-2", numel=20_000)
    assert all(r["ok"] and late.peer_id in r["members"] for r in second.values())
    assert len({r["sha"] for r in second.values()}) == 1


def test_peer_killed_mid_round(peers, tmp_path):
    """A non-leader is SIGKILLed during the scatter: survivors finish with identical results
    (its contribution dropped, its slice re-owned) within the deadline. Then the leader is
    killed mid-round: every survivor reports failure, nobody hangs."""
    group = peers[:5]
    leader = min(group, key=lambda p: p.peer_id)
    victim = next(p for p in group if p is not leader)
    for p in group:
        p.configure(faults={"delay_parts_s": 3.0} if p is victim else {}, codec="none", join_timeout_s=10, base_timeout_s=2.0, bandwidth=50e6)
    seeds = {p.peer_id: i + 1 for i, p in enumerate(group)}
    for p in group:
        p.send(op="average", key="kill-1", seeds=seeds, numel=200_000, expected=5)
    for p in group:
        p.next("phase", 60, "kill-1")  # everyone matched: the round is under way
    t0 = time.monotonic()
    victim.kill()
    survivors = [p for p in group if p is not victim]
    results = {p.name: p.next("result", 60, "kill-1") for p in survivors}
    took = time.monotonic() - t0
    oks = [r["ok"] for r in results.values()]
    assert all(oks), results
    assert len({r["sha"] for r in results.values()}) == 1
    for r in results.values():
        assert victim.peer_id not in r["survivors"] and [f[0] for f in r["failed"]] == [victim.peer_id]
        assert r["equals_reference"]  # the exact mean of the four others
    assert took < 30

    # now kill the leader of a round in progress: all report failure, none hangs, inputs kept
    rest = survivors
    leader = min(rest, key=lambda p: p.peer_id)
    for p in rest:
        p.configure(faults={"delay_parts_s": 3.0} if p is leader else {}, codec="none", join_timeout_s=10, base_timeout_s=2.0, bandwidth=50e6)
    for p in rest:
        p.send(op="average", key="kill-2", seeds=seeds, numel=200_000, expected=4)
    for p in rest:
        p.next("phase", 60, "kill-2")
    leader.kill()
    results = {p.name: p.next("result", 60, "kill-2") for p in rest if p is not leader}
    assert not any(r["ok"] for r in results.values()), {k: (r.get("members"), r.get("leader"), r.get("failed"), leader.peer_id) for k, r in results.items()}
    assert all(r["unchanged"] for r in results.values())
