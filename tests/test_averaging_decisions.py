"""The averager's pure decisions: matchmaking's state machines and the leader's choices, with
time moved by hand (no network, no clock, no sleeping)."""

import math

import pytest

from node.averaging.config import AveragerConfig
from node.averaging.decisions import (
    Arrivals,
    Liveness,
    choose_pace,
    close_reason,
    decide_commit,
    decide_scatter,
    form_group,
    learn_bandwidth,
    learn_flow_rate,
    stagger_patience,
)
from node.averaging.matchmaking import ASK_AGAIN_S, GAVE_UP, LOOK_AGAIN_S, MAX_REDIRECTS, RETRY_S, Lobby, Search
from node.net.transport import RPCError
from protocol import AvgGroup, AvgJoin, AvgReport

A, B, C, D = "peer-a", "peer-b", "peer-c", "peer-d"  # A < B < C < D


def group(*members):
    n = len(members)
    return AvgGroup(status="group", group_id="g", members=tuple(members), weights=(1.0,) * n, bounds=tuple(range(0, 10 * n + 1, 10)), deadline_s=1.0)


# ---- closing a group ------------------------------------------------------------------------


def test_a_leader_closes_when_the_expected_peers_joined_or_its_window_ends():
    assert close_reason(now=1.0, deadline=5.0, joined={A, B}, expected=3) == ""
    assert "3 of 3" in close_reason(now=1.0, deadline=5.0, joined={A, B, C}, expected=3)
    # given ids, a peer nobody counted on does not take the place of one still on its way
    assert close_reason(now=1.0, deadline=5.0, joined={A, B, D}, expected={A, B, C}) == ""
    assert "every expected" in close_reason(now=1.0, deadline=5.0, joined={A, B, C, D}, expected={A, B, C})
    assert close_reason(now=4.999, deadline=5.0, joined={A}, expected=None) == ""
    assert "window ended" in close_reason(now=5.0, deadline=5.0, joined={A}, expected=None)


def test_a_leader_stops_waiting_for_overdue_peers_only():
    # C is expected but overdue: the group closes once everyone else is in, and says who it left
    why = close_reason(now=1.0, deadline=15.0, joined={A, B}, expected={A, B, C}, overdue={C})
    assert "overdue" in why and C[-8:] in why
    # an overdue peer does not close a group that still waits for someone else
    assert close_reason(now=1.0, deadline=15.0, joined={A}, expected={A, B, C}, overdue={C}) == ""


def test_arrivals_wait_for_a_peer_as_long_as_it_is_usually_late():
    arr = Arrivals(factor=2.0, slack_s=2.0, keep=4)
    window = 15.0
    # not measured: the whole window
    assert arr.allowance(B, window)[0] == window and arr.overdue({B}, 14.9, window) == set()
    # a steady peer that comes within 0.3 s (median 0.2): waited for 2.4 s, then the others go
    # on if it does not answer probes either (frozen, cut off)
    for late in (0.1, 0.3, 0.2):
        arr.arrived(B, late)
    assert arr.allowance(B, window)[0] == pytest.approx(2.4)
    assert arr.overdue({B}, 2.3, window) == set() and arr.overdue({B}, 2.4, window) == {B}
    assert arr.next_overdue({B}, 1.0, window) == pytest.approx(1.4)
    # a slow but steady peer (2x slower: 3 s after the others every round) keeps its place
    for _ in range(4):
        arr.arrived(C, 3.0)
    assert arr.overdue({C}, 7.9, window) == set() and arr.overdue({C}, 8.0, window) == {C}
    # a peer that turned slower: its late joins (after the group closed) are measured, and once
    # they are what it usually does, the next rounds wait for it; one odd join does not set it
    arr.arrived(B, 5.0)
    assert arr.allowance(B, window)[0] == pytest.approx(2 * 0.25 + 2.0)  # median of 0.1, 0.3, 0.2, 5.0
    arr.arrived(B, 5.0)
    arr.arrived(B, 5.0)
    assert arr.allowance(B, window)[0] == pytest.approx(12.0)  # median of 0.2 (aged out: 0.1, 0.3), 5, 5, 5
    for _ in range(4):
        arr.arrived(B, 0.2)
    assert arr.allowance(B, window)[0] == pytest.approx(2.4)
    # never longer than the window; a peer that arrived before us counts as on time
    arr.arrived(D, 20.0)
    assert arr.allowance(D, window)[0] == window and arr.next_overdue({D}, 0.0, window) == math.inf
    arr.arrived(A, -3.0)
    assert arr.allowance(A, window)[0] == pytest.approx(2.0)


def test_a_group_is_sized_by_its_slowest_member_and_needs_min_group_size():
    cfg = AveragerConfig(codec="none", min_group_size=2, base_timeout_s=3.0, timeout_slack=4.0, slice_align=1)
    joins = {B: AvgJoin(round_key="k", numel=1000, bandwidth=10e6), A: AvgJoin(round_key="k", numel=1000, bandwidth=1e6)}
    g, why = form_group(joins, 1000, cfg, {}, "gid")
    assert g.members == (A, B) and g.bounds[-1] == 1000
    # 2 members, fp32: each moves 2·(1/2)·1000·4 bytes per phase at the slowest 1 MB/s
    assert g.deadline_s == pytest.approx(3.0 + 4.0 * 4000 / 1e6)
    assert "slowest 1.0 MB/s" in why
    # the faster member gets the larger slice (half-octave steps: 10x the bandwidth -> 2^3.5)
    assert g.bounds[2] - g.bounds[1] > 10 * (g.bounds[1] - g.bounds[0])
    alone, why = form_group({A: joins[A]}, 1000, cfg, {}, "gid")
    assert alone is None and "too few" in why


def test_a_group_on_uneven_links_gives_the_slowest_member_no_slice():
    cfg = AveragerConfig(codec="none", slice_align=1024)
    numel = 1 << 22
    joins = {m: AvgJoin(round_key="k", numel=numel, bandwidth=bw) for m, bw in zip((A, B, C, D), (12.5e6, 12.5e6, 3.125e6, 12.5e6))}
    g, why = form_group(joins, numel, cfg, {}, "gid")
    assert C not in {g.first_owner(j) for j in range(g.n_slices)} and g.n_slices > 3
    assert {g.first_owner(j) for j in range(g.n_slices)} == {A, B, D} and "too slow to own any" in why
    # the same group on equal links: one slice each, member i owns slice i
    g, _ = form_group({m: AvgJoin(round_key="k", numel=numel, bandwidth=12.5e6) for m in (A, B, C, D)}, numel, cfg, {}, "gid")
    assert g.slice_owners == () and g.n_slices == 4 and g.first_owner(2) == C


# ---- a follower's search ----------------------------------------------------------------------


def test_the_last_rounds_leader_is_asked_first_else_the_dht_is():
    assert Search(B, "k", deadline=10, last_members=(A, B, C)).next().action == "call"
    assert Search(B, "k", deadline=10, last_members=(A, B, C)).next().target == A
    assert Search(B, "k", deadline=10, last_members=(A, C)).next().action == "lookup"  # we were not in it
    s = Search(B, "k", deadline=10)
    step = s.found({C, D})
    assert step.action == "lead"  # nobody smaller wants the key
    step = Search(B, "k", deadline=10).found({A, C})
    assert (step.action, step.target) == ("call", A)


def test_a_failed_leader_is_retried_once_then_skipped_and_a_timeout_is_not_retried():
    s = Search(C, "k", deadline=10)
    s.found({A, B})
    step = s.call_failed(now=1.0, timed_out=False)
    assert (step.action, step.target, step.wait_s) == ("call", A, RETRY_S)  # a stream can close under load
    step = s.call_failed(now=1.2, timed_out=False)
    assert step.action == "lookup" and A in s.excluded
    assert s.found({A, B}).target == B  # A is not asked again
    step = s.call_failed(now=2.0, timed_out=True)
    assert step.action == "lookup" and B in s.excluded
    assert s.found({A, B}).action == "lead"


def test_a_search_past_its_deadline_fails():
    s = Search(C, "k", deadline=10)
    s.found({A})
    step = s.call_failed(now=10.5, timed_out=True)
    assert step.action == "fail" and not step.late and "before the join deadline" in step.reason


def test_redirects_are_followed_but_not_forever():
    s = Search(D, "k", deadline=10)
    s.found({B})
    s.excluded.add(A)  # an earlier call to A failed...
    step = s.answered(AvgGroup(status="redirect", redirect=A), now=1.0)
    assert (step.action, step.target) == ("call", A)  # ...but the others follow it: try again
    assert A not in s.excluded
    for i in range(MAX_REDIRECTS - 1):  # 16 redirects in all
        step = s.answered(AvgGroup(status="redirect", redirect=B if i % 2 == 0 else A), now=1.0)
    assert step.action == "call"
    step = s.answered(AvgGroup(status="redirect", redirect=C), now=1.0)  # one too many: look again
    assert (step.action, step.wait_s) == ("lookup", LOOK_AGAIN_S)
    s.found({A, B, C})
    step = s.answered(AvgGroup(status="redirect", redirect=s.target), now=11.0)  # to itself, late
    assert step.action == "fail" and step.late


def test_not_averaging_yet_spares_a_predicted_leader_but_not_one_found_in_the_dht():
    s = Search(B, "k", deadline=10, last_members=(A, B))
    step = s.answered(AvgGroup(status="closed", reason="not averaging this key"), now=1.0)
    assert step.action == "lookup" and A not in s.excluded  # it may just not have started yet
    s.found({A})
    step = s.answered(AvgGroup(status="closed", reason="not averaging this key"), now=2.0)
    assert A in s.excluded  # found there, yet not averaging: gone
    assert step.action == "lead"  # and we are what is left of the last group
    s = Search(C, "k", deadline=10)
    s.found({A})
    step = s.answered(AvgGroup(status="closed", reason="not averaging this key"), now=10.1)
    assert step.action == "fail" and step.late


def test_a_predicted_leader_that_gave_the_round_up_alone_is_passed_over_not_a_reason_to_fail():
    # the fast replica closed the key alone before the slower ones came: they average without it
    s = Search(C, "k", deadline=10, last_members=(A, B, C))
    step = s.answered(AvgGroup(status="closed", reason=GAVE_UP), now=1.0)
    assert A in s.excluded and step.action == "call" and step.target == B


def test_when_the_last_leader_is_gone_the_next_member_of_the_last_group_is_asked_not_the_dht():
    """While a peer is silent, DHT look-ups can take seconds (they ask its DHT node too): the
    survivors of the last group find each other without it."""
    c = Search(C, "k", deadline=10, last_members=(A, B, C))
    b = Search(B, "k", deadline=10, last_members=(A, B, C))
    assert c.next().target == A and b.next().target == A
    assert (c.call_failed(now=4.5, timed_out=True).action, c.target) == ("call", B)
    assert b.call_failed(now=4.5, timed_out=True).action == "lead"
    # B, asked by C, is gone too: C is what is left of the last group
    assert c.call_failed(now=5.0, timed_out=True).action == "lead"
    d = Search(D, "k", deadline=10, last_members=(A, D))
    assert d.call_failed(now=1.0, timed_out=True).action == "lead"
    # the next round: A went silent on us lately, so it is not asked first again
    c = Search(C, "k2", deadline=10, last_members=(A, B, C), silent={A})
    assert c.next().target == B and A in c.excluded
    # but the others may follow it again (it woke up): their redirect is followed
    assert c.answered(AvgGroup(status="redirect", redirect=A), now=1.0).target == A


def test_a_redirect_to_a_leader_gone_silent_on_us_is_asked_again_not_followed():
    """C gave up on A (its probes went unanswered), asks B, and B still follows A: C asks B
    again in a moment (B notices too) instead of probing A for seconds once more."""
    c = Search(C, "k", deadline=10, last_members=(A, B, C))
    assert (c.call_failed(now=4.5, timed_out=True).action, c.target) == ("call", B)
    step = c.answered(AvgGroup(status="redirect", redirect=A), now=4.6)
    assert (step.action, step.target, step.wait_s) == ("call", B, ASK_AGAIN_S)
    step = c.answered(AvgGroup(status="redirect", redirect=D), now=5.2)  # B moved on: follow it
    assert (step.action, step.target) == ("call", D)
    # a peer that failed without timing out (a stream closed) is no reason to distrust a redirect
    s = Search(D, "k", deadline=10)
    s.found({A})
    s.call_failed(now=1.0, timed_out=False)
    s.found({B})
    assert s.answered(AvgGroup(status="redirect", redirect=A), now=1.5).target == A


def test_a_group_or_a_closed_group_ends_the_search():
    s = Search(B, "k", deadline=10)
    s.found({A})
    assert s.answered(group(A, B), now=1.0).action == "done"
    step = s.answered(AvgGroup(status="closed", reason="the group already formed"), now=1.0)
    assert step.action == "fail" and step.late and "too late for round k" in step.reason
    s.found({A})
    assert s.answered("garbage", now=1.0).action == "lookup" and A in s.excluded


# ---- a leader's lobby ------------------------------------------------------------------------


def test_a_lobby_answers_joins_by_its_state():
    lobby = Lobby("k", numel=10, codec="int8", window=5)
    join = AvgJoin(round_key="k", numel=10, codec="int8")
    assert lobby.answer(B, join) is None  # waits for the group
    with pytest.raises(RPCError, match="elements"):
        lobby.answer(B, AvgJoin(round_key="k", numel=11, codec="int8"))
    with pytest.raises(RPCError, match="codec"):
        lobby.answer(B, AvgJoin(round_key="k", numel=10, codec="fp16"))
    lobby.group = group(A, B)
    assert lobby.answer(B, join) is lobby.group  # a member asking again: its answer was lost
    assert lobby.answer(C, join).status == "closed"
    lobby.follow(A)
    assert lobby.answer(C, join).redirect == A


# ---- the leader's decisions ------------------------------------------------------------------


def test_the_scatter_decision_excludes_the_liar_and_aborts_below_min_group_size():
    reports = {
        A: AvgReport(group_id="g", phase="scatter", received_from=(B,), blamed=(C,), reasons=("NaN",)),
        B: AvgReport(group_id="g", phase="scatter", received_from=(A,), blamed=(C,), reasons=("NaN",)),
        C: AvgReport(group_id="g", phase="scatter", received_from=(A, B)),
    }
    d = decide_scatter("g", (A, B, C), reports, min_group_size=2)
    assert d.commit and d.survivors == (A, B) and d.owners == (A, B, A) and "NaN" in d.reason
    d = decide_scatter("g", (A, B, C), reports, min_group_size=3)
    assert not d.commit and "NaN" in d.reason


def test_the_commit_needs_every_survivor_holding_every_slice():
    ok = AvgReport(group_id="g", phase="gather", ok=True)
    d = decide_commit("g", (A, B), (A, B), (A, B), {A: ok, B: ok})
    assert d.commit and d.survivors == (A, B)
    d = decide_commit("g", (A, B), (A, B), (A, B), {A: ok})
    assert not d.commit and "did not report" in d.reason
    # a member gone silent (probes unanswered) does not cost the others the round: its data
    # are in the average and they hold all of it; one that is merely late still does
    d = decide_commit("g", (A, B, C), (A, B, C), (A, B, C), {A: ok, B: ok}, silent=(C,))
    assert d.commit and d.survivors == (A, B, C) and "without the report of peer-c" in d.reason
    d = decide_commit("g", (A, B, C), (A, B, C), (A, B, C), {A: ok}, silent=(C,))
    assert not d.commit and "peer-b did not report" in d.reason and "peer-c" not in d.reason
    bad = AvgReport(group_id="g", phase="gather", ok=False, blamed=(A,), reasons=("slice 0 never arrived",))
    d = decide_commit("g", (A, B), (A, B), (A, B), {A: ok, B: bad})
    assert not d.commit and "slice 0 never arrived" in d.reason


def test_sends_are_paced_only_to_a_declared_rate_over_direct_links():
    assert choose_pace(AveragerConfig(), True) == (None, "no bandwidth declared")
    rate, why = choose_pace(AveragerConfig(bandwidth=12.5e6), True)
    assert rate == pytest.approx(0.92 * 12.5e6) and "declared" in why
    assert choose_pace(AveragerConfig(bandwidth=12.5e6), False)[0] is None
    assert choose_pace(AveragerConfig(bandwidth=12.5e6, pace=False), True)[0] is None
    assert choose_pace(AveragerConfig(bandwidth=1e9), True)[0] is None  # the CPU sets the pace
    # slices laid out for uneven links leave in order, one at a time: not paced
    rate, why = choose_pace(AveragerConfig(bandwidth=12.5e6), True, pipelined=True)
    assert rate is None and "uneven links" in why


def test_sends_in_turn_expect_the_declared_rate_not_the_one_their_overlap_measured():
    # a 1 MB send on a declared 3 MB/s link: the next starts at 90% of its 1/3 s
    assert stagger_patience(0.9, 1_000_000, flow_rate=2e6, bandwidth=3e6, declared=3e6) == pytest.approx(0.3)
    assert stagger_patience(0.9, 1_000_000, flow_rate=2e6, bandwidth=3e6) == pytest.approx(0.45)  # learned
    assert stagger_patience(0.9, 1_000_000, flow_rate=None, bandwidth=3e6) == pytest.approx(0.6)  # half the estimate


def test_bandwidth_is_learned_from_rounds_big_enough_to_tell():
    assert learn_bandwidth(None, {"scatter": 0.01, "gather": 0.01}, 10 << 20).value is None
    assert learn_bandwidth(5e6, {"scatter": 1.0, "gather": 1.0}, 1000).value == 5e6
    first = learn_bandwidth(None, {"scatter": 1.0, "gather": 1.0}, 20_000_000).value
    assert first == pytest.approx(10e6)
    assert learn_bandwidth(first, {"scatter": 1.0, "gather": 1.0}, 40_000_000).value == pytest.approx(0.7 * 10e6 + 0.3 * 20e6)
    assert learn_flow_rate(None, 2 << 20, 1.0, paced=True).value is None  # a paced send says only what it was told
    assert learn_flow_rate(None, 2 << 20, 1.0, paced=False).value == pytest.approx(2 << 20)
    assert math.isclose(learn_flow_rate(1e6, 100, 1.0, paced=False).value, 1e6)


def test_a_leader_that_stops_answering_probes_is_silent_after_two_misses():
    live = Liveness()
    assert live.probe_timeout() == pytest.approx(2.0)  # nothing measured yet
    live.answered(0.002)
    assert live.probe_timeout() == pytest.approx(0.3)  # 10x a loopback round trip, at least 0.3 s
    assert live.next_after() == pytest.approx(0.1)
    live.unanswered()
    assert live.silent() == ""  # one lost probe is not enough
    assert live.next_after() == 0.0  # but the next one goes at once
    live.answered(0.004)  # it answered again: the count starts over
    live.unanswered()
    assert live.silent() == ""
    live.unanswered()
    assert "2 probes in a row" in live.silent()


def test_a_busy_peers_slow_answers_lengthen_its_probes_and_are_remembered():
    live = Liveness()
    for _ in range(10):
        live.answered(0.002)
    live.answered(0.4)  # a loaded machine answered late once: the next probes wait longer
    assert live.probe_timeout() > 1.2
    for _ in range(3):
        live.answered(0.002)
    assert live.probe_timeout() == pytest.approx(3 * 0.4 * 0.9**3)  # 3x the slowest, fading
    rtts: dict = {}
    live.remember(rtts, A)
    again = Liveness.known(rtts, A)  # the next round's probes of the same peer
    assert again.probe_timeout() == pytest.approx(live.probe_timeout())
    assert Liveness.known(rtts, B).probe_timeout() == pytest.approx(2.0)


def test_the_probe_after_a_miss_waits_less_but_never_below_the_floor():
    live = Liveness()
    for _ in range(10):
        live.answered(0.002)
    live.answered(0.3)  # a busy moment: probes wait about 3x that
    first = live.probe_timeout()
    assert first == pytest.approx(max(10 * live.rtt, 3 * 0.3))
    live.unanswered()  # it has had 0.9 s to answer already: silence is confirmed sooner
    assert live.probe_timeout() == pytest.approx(0.6 * first)
    live.answered(0.002)
    assert live.probe_timeout() > 0.8  # answered: full waits again
    quick = Liveness()
    quick.answered(0.002)
    quick.unanswered()
    assert quick.probe_timeout() == pytest.approx(quick.min_timeout_s)  # 0.6 x 0.3 s would be below the floor
    unknown = Liveness()
    unknown.unanswered()
    assert unknown.probe_timeout() == pytest.approx(1.2)  # 0.6 x the 2 s of a peer never measured


def test_a_slow_but_steady_peer_gets_probes_that_wait_for_it():
    live = Liveness()
    for _ in range(10):
        live.answered(0.4)  # a peer 0.4 s away
    assert live.probe_timeout() == pytest.approx(4.0)
    for _ in range(10):
        live.answered(2.0)
    assert live.probe_timeout() == pytest.approx(5.0)  # capped: silence is still found in seconds
