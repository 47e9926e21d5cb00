"""PauseWatch, with the clocks moved by hand."""

from node.roles.pause import PauseWatch


def test_a_gap_between_ticks_is_a_pause_and_ordinary_lateness_is_not():
    w = PauseWatch(tick_s=1.0, threshold_s=5.0)
    w._last = (100.0, 1000.0)
    assert w.observe(now=101.2, wall=1001.2) == 0.0  # a tick a little late: a busy loop
    assert w.observe(now=107.0, wall=1007.0) == 0.0  # 5.8 s: a tick plus 4.8 s, under the threshold
    assert w.observe(now=168.0, wall=1068.0) == 60.0  # frozen for a minute
    assert w.pauses == [(168.0, 60.0)]


def test_a_suspended_machine_shows_in_the_wall_clock_when_the_monotonic_one_stood_still():
    w = PauseWatch(tick_s=1.0, threshold_s=5.0)
    w._last = (100.0, 1000.0)
    assert w.observe(now=101.0, wall=1301.0) == 300.0


def test_paused_since_counts_only_pauses_that_ended_after_the_given_time():
    w = PauseWatch(tick_s=1.0, threshold_s=5.0)
    w.pauses = [(50.0, 20.0), (120.0, 30.0)]
    w._last = (10**9, 10**12)  # observing now finds nothing new (the clocks went back: no pause)
    assert w.paused_since(100.0) == 30.0
    assert w.paused_since(10.0) == 50.0
    assert w.paused_since(130.0) == 0.0
