"""The all-reduce's pure decisions: slice sizes, who survives a round, who owns what."""

from __future__ import annotations

from itertools import pairwise

import pytest

from node.averaging import decide_survivors, reassign, slice_bounds, slice_shares
from protocol import AvgReport

A, B, C, D = "peerA", "peerB", "peerC", "peerD"


def _report(owner_received: list[str], blamed: dict[str, str] | None = None) -> AvgReport:
    blamed = blamed or {}
    return AvgReport(
        group_id="g", phase="scatter", received_from=tuple(owner_received), blamed=tuple(blamed), reasons=tuple(blamed.values())
    )


def test_noisy_equal_bandwidths_get_equal_slices():
    # ±15% measurement noise on identical links must not make one owner the straggler
    shares = slice_shares([10.9e6, 12.5e6, 9.8e6, 11.6e6])
    assert shares == [1.0, 1.0, 1.0, 1.0]
    bounds = slice_bounds(6_553_600, shares, 1024)
    sizes = [b - a for a, b in pairwise(bounds)]
    assert max(sizes) - min(sizes) <= 1024


def test_much_faster_peers_get_proportionally_bigger_slices():
    shares = slice_shares([10e6, 10e6, 40e6, 2.5e6])
    assert shares == [1.0, 1.0, 4.0, 0.25]
    bounds = slice_bounds(1 << 20, shares, 1024)
    sizes = [b - a for a, b in pairwise(bounds)]
    assert sizes[2] == pytest.approx(4 * sizes[0], rel=0.01)
    assert sizes[3] == pytest.approx(sizes[0] / 4, rel=0.02)


def test_shares_tolerate_zero_and_tiny_bandwidths():
    shares = slice_shares([0.0, 1e6, 1e6])
    assert all(s > 0 for s in shares)
    assert slice_bounds(4096, shares, 1024)[-1] == 4096


def test_slice_bounds_are_aligned_monotone_and_cover_everything():
    for numel in (1, 1023, 1024, 5000, 1_000_003):
        bounds = slice_bounds(numel, [1.0, 2.0, 1.0], 1024)
        assert bounds[0] == 0 and bounds[-1] == numel
        assert list(bounds) == sorted(bounds)
        assert all(b % 1024 == 0 or b == numel for b in bounds[1:-1])  # int8 blocks stay whole


def test_everyone_reporting_everything_survives():
    members = [A, B, C]
    reports = {A: _report([B, C]), B: _report([A, C]), C: _report([A, B])}
    assert decide_survivors(members, reports) == ([A, B, C], {})


def test_a_silent_member_fails_and_its_slice_is_reowned():
    members = [A, B, C, D]
    reports = {A: _report([B, D]), B: _report([A, D]), D: _report([A, B])}
    survivors, failed = decide_survivors(members, reports)
    assert survivors == [A, B, D]
    assert "no report" in failed[C]
    owners = reassign(members, survivors)
    assert owners[0] == A and owners[1] == B and owners[3] == D
    assert owners[2] in survivors


def test_a_nan_sender_among_three_is_excluded_not_its_honest_receivers():
    members = [A, B, C]
    reports = {A: _report([B], {C: "NaN in part"}), B: _report([A], {C: "NaN in part"}), C: _report([A, B])}
    survivors, failed = decide_survivors(members, reports)
    assert survivors == [A, B]
    assert set(failed) == {C} and "NaN in part" in failed[C]


def test_two_bad_senders_among_four_are_excluded_by_the_two_honest_owners():
    members = [A, B, C, D]
    bad = {C: "NaN in part", D: "wrong shape"}
    reports = {A: _report([B], bad), B: _report([A], bad), C: _report([A, B, D]), D: _report([A, B, C])}
    survivors, failed = decide_survivors(members, reports)
    assert survivors == [A, B]
    assert "wrong shape" in failed[D]


def test_a_lone_accuser_of_half_the_group_is_not_believed():
    members = [A, B, C]
    reports = {A: _report([C], {B: "NaN in part"}), B: _report([A, C]), C: _report([A, B])}
    survivors, failed = decide_survivors(members, reports)
    assert survivors == [B, C]
    assert set(failed) == {A}


def test_in_a_pair_the_accuser_is_believed():
    survivors, failed = decide_survivors([A, B], {A: _report([], {B: "NaN in part"}), B: _report([A])})
    assert survivors == [A] and "NaN" in failed[B]


def test_an_owner_that_blames_everyone_is_the_one_excluded():
    members = [A, B, C, D]
    reports = {
        A: _report([], {B: "bad shape", C: "bad shape", D: "bad shape"}),
        B: _report([A, C, D]),
        C: _report([A, B, D]),
        D: _report([A, B, C]),
    }
    survivors, failed = decide_survivors(members, reports)
    assert survivors == [B, C, D]
    assert set(failed) == {A}
