"""The all-reduce's pure decisions: slice sizes, who survives a round, who owns what."""

from __future__ import annotations

from itertools import pairwise

import pytest

from node.averaging import decide_survivors, reassign, slice_bounds, slice_shares
from node.averaging.decisions import PIPELINE_SLICES, bound_shares, decide_scatter, slice_layout
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


def test_equal_links_own_equal_shares_and_one_slice_each():
    assert bound_shares([12.5e6] * 4) == pytest.approx([0.25] * 4)
    bounds, owners, why = slice_layout(6_553_600, [11e6, 12.5e6, 12.5e6, 13e6], 1024)  # noise stays equal
    assert owners == () and len(bounds) == 5 and "equal links" in why
    assert [b - a for a, b in pairwise(bounds)] == [1_638_400] * 4


def test_a_link_too_slow_for_any_share_owns_nothing():
    # 3 x 100 Mbit/s + 25 Mbit/s: shares in proportion to bandwidth gave the slow member 1/13
    # of the vector, so it uploaded (1 + 2/13)·S; owning nothing it uploads S (the least any
    # all-reduce can: its data must reach the others), the others 1/3 each
    shares = bound_shares([12.5e6, 12.5e6, 12.5e6, 3.125e6])
    assert shares == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    # what each member moves each way, (1 + (N-2)·s_i)·S, over its link: the slow one sets the time
    times = [(1 + 2 * s) / bw for s, bw in zip(shares, [4, 4, 4, 1])]
    assert max(times) == pytest.approx(1.0) and times[0] < 0.5


def test_a_somewhat_slower_link_owns_less_so_that_every_link_takes_as_long():
    bws = [1.0, 1.0, 1.0, 2**-0.5]
    shares = bound_shares(bws)
    assert 0 < shares[3] < 0.25 < shares[0] and sum(shares) == pytest.approx(1.0)
    times = [(1 + 2 * s) / bw for s, bw in zip(shares, bws)]
    assert max(times) == pytest.approx(min(times))  # levelled: no link waits on another
    assert bound_shares([1.0, 3.0]) == pytest.approx([0.25, 0.75])  # two members move S whatever they own


def test_uneven_links_cut_the_vector_into_interleaved_slices_of_the_members_that_own_any():
    numel = 6_553_600
    bounds, owners, why = slice_layout(numel, [12.5e6, 3.125e6, 12.5e6, 12.5e6], 1024)
    assert owners == (0, 2, 3) * PIPELINE_SLICES  # the slow member 1 owns none; the others in turn
    assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == len(owners) + 1
    sizes = [b - a for a, b in pairwise(bounds)]
    assert max(sizes) - min(sizes) <= 1024 and "too slow to own any" in why
    # a vector too short to cut finely: one slice per owning member
    bounds, owners, _ = slice_layout(3 * 4096, [12.5e6, 3.125e6, 12.5e6, 12.5e6], 1024)
    assert owners == (0, 2, 3) and bounds[-1] == 3 * 4096


def test_a_member_owning_no_slice_accuses_nobody_by_silence_and_inherits_no_slice():
    members, owners = [A, B, C, D], (0, 1, 2) * 2  # D owns nothing: it hears no parts
    reports = {A: _report([B, C, D]), B: _report([A, C, D]), C: _report([A, B, D]), D: _report([])}
    d = decide_scatter("g", members, reports, 2, owners)
    assert d.commit and d.survivors == (A, B, C, D) and d.reason == ""
    # C died: its slices go to the surviving owners, not to D
    reports = {A: _report([B, D]), B: _report([A, D]), D: _report([], {C: "bad scatter part: NaN"})}
    d = decide_scatter("g", members, reports, 2, owners)
    assert d.survivors == (A, B, D) and "no report" in d.reason
    assert d.owners == (A, B, A, A, B, B)
    assert reassign(members, [D], owners) == (D,) * 6  # nobody else left: the one survivor takes all


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
