"""The history's decisions (coordinator/history.py), pure: time is moved by hand."""

import pytest

from coordinator.history import EventLimiter, ProgressPoint, ProgressSampler, Rate, Thinning, ThroughputMeter, keep_points

pytestmark = pytest.mark.timeout(60)

DAY = 86400.0


def thinned_series(policy: Thinning, every_s: float, span_s: float, thin_every: int = 50) -> list[float]:
    """A point every `every_s` seconds for `span_s` seconds, thinned every `thin_every` points
    as the journal does; the times kept."""
    times: list[float] = []
    t = 0.0
    while t <= span_s:
        times.append(t)
        if len(times) % thin_every == 0:
            times = [x for x, k in zip(times, keep_points(times, t, policy)) if k]
        t += every_s
    return [x for x, k in zip(times, keep_points(times, times[-1], policy)) if k]


def test_a_day_of_points_every_second_keeps_a_bounded_series_dense_when_recent_sparse_when_old():
    policy = Thinning()
    kept = thinned_series(policy, 1.0, DAY)
    now = kept[-1]
    assert len(kept) <= policy.bound() and policy.bound() < 1000
    assert kept[0] == 0.0 and now == DAY  # the run's first point and the newest stay
    assert kept[-policy.dense:] == [now - i for i in range(policy.dense - 1, -1, -1)]  # the newest: every one
    assert kept == sorted(kept)
    # older ones: one per bucket of their age's tier (30 s in the last hour, 10 min before 6 h ago)
    hour = [t for t in kept[: -policy.dense] if now - t <= 3600]
    assert len(hour) == pytest.approx((3600 - policy.dense) / 30, abs=2)
    morning = [t for t in kept[1:] if 6 * 3600 < now - t <= DAY]
    assert len(morning) == pytest.approx(18 * 6, abs=2) and all(t % 600 == 0 for t in morning)
    # and the history reaches back evenly: no gap wider than the coarsest bucket its age allows
    assert max(b - a for a, b in zip(kept, kept[1:])) <= 600


def test_thinning_a_series_again_drops_nothing_more_and_points_past_the_last_tier_go():
    policy = Thinning(dense=3, tiers=((10.0, 2.0), (40.0, 10.0)))
    times = [float(t) for t in range(0, 61)]
    kept = [t for t, k in zip(times, keep_points(times, 60.0, policy)) if k]
    # the first; the 3 newest; ages <= 10 s one per 2 s bucket; <= 40 s one per 10 s; older: gone
    assert kept == [0.0, 20.0, 30.0, 40.0, 50.0, 52.0, 54.0, 56.0, 58.0, 59.0, 60.0]
    again = [t for t, k in zip(kept, keep_points(kept, 60.0, policy)) if k]
    assert again == kept
    assert keep_points([], 0.0, policy) == [] and keep_points([5.0], 1e9, policy) == [True]
    with pytest.raises(ValueError, match="tiers"):
        Thinning(tiers=((40.0, 10.0), (10.0, 2.0)))


def test_replicas_make_one_point_per_outer_step_the_first_time_it_is_reported():
    s = ProgressSampler()
    assert s.report(10.0, "a", "replica", 0, 5.5) == ProgressPoint(0, 5.5, 10.0, "a")
    assert s.report(11.0, "b", "replica", 0, 5.5) is None  # the same outer step: it has its point
    assert s.report(12.0, "a", "replica", 0, 5.5) is None  # and a heartbeat repeats it
    assert s.report(40.0, "b", "replica", 1, 4.9) == ProgressPoint(1, 4.9, 40.0, "b")
    assert s.report(41.0, "c", "replica", 0, 5.5) is None  # a joiner still at step 0
    assert s.report(42.0, "a", "replica", 2, None) is None  # no loss: no point
    assert s.report(43.0, "a", "idle", 3, 4.0) is None  # a member whose role failed reports its old loss
    assert s.due(1e6) is None  # replicas' points are made as they come
    restarted = ProgressSampler(last_step=1)  # the coordinator again: the history holds step 1
    assert restarted.report(50.0, "a", "replica", 1, 4.9) is None
    assert restarted.report(51.0, "a", "replica", 2, 4.5) == ProgressPoint(2, 4.5, 51.0, "a")


def test_trainers_make_one_swarm_point_per_interval_while_losses_arrive_and_none_while_idle():
    s = ProgressSampler(interval_s=5.0)
    assert s.report(0.0, "a", "trainer", 8, 4.0) is None  # trainers' points come with the interval
    s.report(1.0, "b", "trainer", 16, 3.0)
    s.report(2.0, "a", "trainer", 8, 4.0)  # the same report again: counted once
    assert s.due(2.5) == ProgressPoint(16, 3.5, 2.5, None)  # the mean, the highest step
    s.report(3.0, "a", "trainer", 16, 2.0)
    assert s.due(6.0) is None  # 5 s not passed since the last point
    assert s.due(7.5) == ProgressPoint(16, 2.0, 7.5, "a")  # one member reported: its id
    s.report(8.0, "a", "trainer", 16, 2.0)  # idle: it heartbeats its last loss again
    assert s.due(100.0) is None and s.due(200.0) is None  # nothing while idle


def test_throughput_sums_the_members_that_train_and_counts_bytes_from_total_differences():
    m = ThroughputMeter(context=64, interval_s=5.0, active_s=60.0)
    assert m.due(0.0, []) is None  # the first interval starts
    m.report(1.0, "a", 1, 1_000)  # first sight: its total says nothing about this interval
    m.report(1.0, "b", 1, 5_000)
    m.report(3.0, "a", 2, 11_000)  # +10 000
    m.report(4.0, "b", 2, 2_000)  # went down: b restarted; 2 000 sent since, not -3 000
    members = [Rate("a", "replica", 3.0), Rate("b", "replica", 1.0), Rate("s", "stage", 50.0), Rate("t", "trainer", None)]
    p = m.due(5.0, members)
    assert (p.time, p.members, p.samples_per_second, p.tokens_per_second, p.bytes_per_second) == (5.0, 4, 4.0, 256.0, 12_000 / 5.0)
    assert m.due(7.0, members) is None  # the next interval is not over
    m.report(8.0, "a", 3, 11_000)  # a keeps training; b's step stays where it was
    m.report(70.0, "a", 4, 11_500)
    p = m.due(70.0, members)
    assert p.samples_per_second == 3.0 and p.bytes_per_second == pytest.approx(500 / 65.0)  # b idle 66 s: not counted
    assert m.due(80.0, []) is None  # an empty swarm: no point
    assert ThroughputMeter(context=None).due(0.0, []) is None
    unknown = ThroughputMeter(context=None, interval_s=1.0)
    unknown.due(0.0, [])
    unknown.report(0.5, "a", 1, 0)
    assert unknown.due(1.0, [Rate("a", "trainer", 2.0)]).tokens_per_second is None


def test_a_refused_peer_retrying_adds_one_event_per_window_and_says_how_many_were_left_out():
    lim = EventLimiter()
    assert lim.allow(0.0, "refused", "x") == (True, 0)
    assert [lim.allow(t, "refused", "x") for t in (2.0, 4.0, 6.0)] == [(False, 0)] * 3
    assert lim.allow(0.5, "refused", "y") == (True, 0)  # another peer has its own window
    assert lim.allow(301.0, "refused", "x") == (True, 3)  # the window passed: the 3 left out are told
    assert all(lim.allow(t, "join", "x") == (True, 0) for t in range(10))  # joins are never limited
    rounds = [lim.allow(float(t), "round_failed", "r")[0] for t in range(15)]
    assert rounds == [True] * 10 + [False] * 5


def test_many_refused_peers_together_are_limited_too():
    lim = EventLimiter(per_peer={"refused": (1, 300.0)}, per_kind={"refused": (30, 300.0)})
    allowed = [lim.allow(float(i), "refused", f"peer-{i}")[0] for i in range(100)]
    assert allowed == [True] * 30 + [False] * 70
    assert lim.allow(301.0, "refused", "peer-99") == (True, 1)
