"""The replica's inner phase under `inner_phase = "time"` (node/roles/budget.py): decisions by hand."""

import pytest

from node.roles.budget import keep_stepping, median_ready
from node.runconfig import RunConfig, RunConfigError


def test_a_replica_stops_early_once_half_of_the_replicas_wait_to_average():
    # three replicas: the two others waiting means the median (the second fastest) is done
    assert median_ready(2, 3)[0] and not median_ready(1, 3)[0]
    assert median_ready(2, 4)[0] and not median_ready(1, 4)[0]  # four: the second of four
    assert median_ready(1, 2)[0]  # two: the other one finished
    assert median_ready(0, 1) == (False, "0 of the 1 replicas wait to average (stopping early needs 1)")  # alone: H steps
    assert "the median replica finished" in median_ready(3, 5)[1] and not median_ready(2, 5)[0]


def test_steps_stop_at_h_or_when_told_but_never_before_the_first():
    assert keep_stepping(0, 40, False) and keep_stepping(39, 40, False) and not keep_stepping(40, 40, False)
    assert not keep_stepping(10, 40, True)  # the median replica is done: join with the 10 steps taken
    assert keep_stepping(0, 40, True)  # one step at least


def test_the_inner_phase_setting_is_steps_or_time():
    assert RunConfig().inner_phase == "steps" and RunConfig(inner_phase="time").inner_phase == "time"
    with pytest.raises(RunConfigError, match="inner_phase"):
        RunConfig(inner_phase="seconds")
