"""Streaming DiLoCo's pure decisions (node/roles/fragments.py), steps moved by hand, and one
cycle of the driver (node/roles/streaming.py) with the average handed in."""

from __future__ import annotations

import asyncio
import collections
import copy

import pytest
import torch

from node.averaging import AverageReport
from node.models.diloco import OuterOptimizer, state_hash
from node.models.gpt import PRESETS, init_model
from node.roles.fragments import Outcome, Schedule, after_cycle, split, when_to_apply
from node.roles.streaming import Streaming

pytestmark = pytest.mark.timeout(60)


def test_split_cuts_whole_tensors_in_order_into_balanced_fragments():
    assert split([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert split([10, 10, 10, 10], 1) == [range(0, 4)]
    assert split([1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    # a big tensor first: it is a fragment of its own; the rest share out
    assert split([100, 10, 10, 10, 10, 10], 2) == [range(0, 1), range(1, 6)]
    # every fragment gets a tensor, however lopsided the sizes
    assert split([1000, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    sizes = [p.numel() for p in init_model(PRESETS["small"], 0).parameters()]
    parts = split(sizes, 4)
    assert [r.start for r in parts][0] == 0 and parts[-1].stop == len(sizes)
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    shares = [sum(sizes[r.start : r.stop]) / sum(sizes) for r in parts]
    assert max(shares) < 0.35, shares  # ~1/4 each, in whole tensors


def test_split_refuses_what_cannot_be_cut():
    with pytest.raises(ValueError, match="cannot cut 3 parameter tensors into 4 fragments"):
        split([1, 2, 3], 4)
    with pytest.raises(ValueError, match="at least 1"):
        split([1, 2, 3], 0)


def test_schedule_staggers_rounds_over_the_cycle():
    s = Schedule(inner_steps=40, fragments=4)
    assert [s.start(f) for f in range(4)] == [0, 10, 20, 30]
    assert [s.period(f) for f in range(4)] == [10] * 4
    uneven = Schedule(inner_steps=10, fragments=3)
    assert [uneven.start(f) for f in range(3)] == [0, 3, 6]
    assert sum(uneven.period(f) for f in range(3)) == 10  # the periods fill the cycle
    assert [Schedule(5, 1).start(0), Schedule(5, 1).period(0)] == [0, 5]
    with pytest.raises(ValueError, match="fragments must be in 1..inner_steps"):
        Schedule(inner_steps=3, fragments=4)


def test_a_round_is_applied_one_fragment_period_late_and_waited_for_only_past_it():
    period = 10
    for trained in range(period):  # before the period is over: train on, done or not
        for done in (False, True):
            assert when_to_apply(trained, period, done).action == "train"
    assert when_to_apply(period, period, True).action == "apply"
    wait = when_to_apply(period, period, False)
    assert wait.action == "wait" and "still running" in wait.reason


def test_after_a_cycle_the_replica_looks_for_the_others_state_only_when_a_round_failed():
    ok = [Outcome(0, True), Outcome(1, True)]
    assert after_cycle(ok, wait_s=30)[0] == 0
    s, d = after_cycle([Outcome(0, True), Outcome(1, False)], wait_s=30)  # a member died: failed for everyone
    assert (s, d.action) == (3.0, "look") and "[1]" in d.reason
    s, d = after_cycle([Outcome(0, False, late=True), Outcome(1, True)], wait_s=30)
    assert (s, d.action) == (30, "catch up")
    s, d = after_cycle([Outcome(0, True), Outcome(1, False, moved_on=True)], wait_s=30)
    assert (s, d.action) == (30, "catch up")


def test_fragment_steps_give_the_bits_of_one_whole_step():
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    whole, parts = OuterOptimizer(params, 0.7, 0.9), OuterOptimizer(params, 0.7, 0.9)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        whole.apply(grads)
        for part in split([p.numel() for p in params], 2):
            parts.apply(grads[part.start : part.stop], part)
    assert state_hash(whole.params) == state_hash(parts.params) and state_hash(whole.buffers) == state_hash(parts.buffers)
    with pytest.raises(ValueError, match="expected 1 tensors"):
        parts.apply(grads, range(0, 1))


def _replica(model):
    model = copy.deepcopy(model)
    return model, OuterOptimizer(model.parameters(), 1.0, 0.8)


def test_a_cycle_steps_every_fragment_and_keeps_the_inner_steps_of_the_overlap():
    """Two replicas, a cycle each, the average computed from both pseudo-gradients as the
    all-reduce would: the same outer bits on both; each replica's local parameters are the new
    outer ones plus the inner steps taken while the round ran."""
    base = init_model(PRESETS["tiny"], 0)
    parts = split([p.numel() for p in base.parameters()], 3)
    replicas = [_replica(base), _replica(base)]
    sent: dict[str, list] = {}  # key -> pseudo-gradients of both replicas
    both: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)  # key -> both have sent
    keys_seen = []

    def trainer(model, r):
        def train(n):
            with torch.no_grad():
                for _ in range(n):
                    for p in model.parameters():
                        p.add_(0.01 * (r + 1))
            return [1.0] * n

        return train

    async def average(key, pseudo, state_key, window):
        keys_seen.append((key, state_key))
        sent.setdefault(key, []).append(pseudo)
        if len(sent[key]) == 2:
            both[key].set()
        await both[key].wait()
        avg = [(a + b) / 2 for a, b in zip(*sent[key])]
        return avg, AverageReport(key=key, ok=True, leader="a", members=["a", "b"], survivors=["a", "b"], bytes_sent=100), False

    async def compute(fn, *args):
        return fn(*args)

    async def run():
        cycles = []
        for r, (model, outer) in enumerate(replicas):
            s = Streaming(parts, 6, compute, trainer(model, r), average)
            cycles.append(s.cycle(model, outer, 0, 10.0, lambda: False))
        return await asyncio.gather(*cycles)

    cycles = asyncio.run(run())
    (m0, o0), (m1, o1) = replicas
    assert state_hash(o0.params) == state_hash(o1.params) and state_hash(o0.buffers) == state_hash(o1.buffers)
    assert state_hash(o0.params) != state_hash(list(base.parameters()))
    assert [k.split("-")[2] for k, _ in keys_seen[::2]] == ["f0", "f1", "f2"] and {s for _, s in keys_seen} == {"outer-f0", "outer-f1", "outer-f2"}
    for c in cycles:
        assert [o.ok for o in c.outcomes] == [True] * 3 and len(c.losses) == 6 and c.bytes_sent == 300 and c.leader == "a"
    # replica 1's last fragment: its local is the new outer plus the 2 inner steps of its period
    last = parts[-1]
    for p, o in zip(list(m1.parameters())[last.start : last.stop], o1.params[last.start : last.stop]):
        torch.testing.assert_close(p, o + 2 * 0.02)
    # fragment 0 was sent before any inner step: a zero pseudo-gradient, its outer state unmoved
    for p, b in zip(o0.params[parts[0].start : parts[0].stop], list(base.parameters())[parts[0].start : parts[0].stop]):
        assert torch.equal(p, b.detach())


def test_a_failed_fragment_round_leaves_that_fragment_as_it_was():
    base = init_model(PRESETS["tiny"], 0)
    parts = split([p.numel() for p in base.parameters()], 2)
    model, outer = _replica(base)
    before = [p.clone() for p in outer.params]

    def train(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * n)
        return [1.0] * n

    async def average(key, pseudo, state_key, window):
        if "-f1-" in key:
            return None, AverageReport(key=key, ok=False, reason="a member died"), False
        return pseudo, AverageReport(key=key, ok=True, leader="me", members=["me"], survivors=["me"]), False

    async def compute(fn, *args):
        return fn(*args)

    cycle = asyncio.run(Streaming(parts, 4, compute, train, average).cycle(model, outer, 3, 10.0, lambda: False))
    assert [(o.fragment, o.ok) for o in cycle.outcomes] == [(0, True), (1, False)]
    f1 = parts[1]
    assert all(torch.equal(a, b) for a, b in zip(outer.params[f1.start : f1.stop], before[f1.start : f1.stop]))
    # its local progress stays, to be carried by its next pseudo-gradient
    for p, b in zip(list(model.parameters())[f1.start : f1.stop], before[f1.start : f1.stop]):
        torch.testing.assert_close(p.detach(), b + 0.04)
    assert cycle.applied == 1 and cycle.leader == "me"


def test_a_round_long_past_its_period_is_given_up_and_the_cycle_goes_on(monkeypatch):
    import node.roles.streaming as streaming

    monkeypatch.setattr(streaming, "OVERDUE_S", 0.2)
    base = init_model(PRESETS["tiny"], 0)
    parts = split([p.numel() for p in base.parameters()], 2)
    model, outer = _replica(base)
    before = [p.clone() for p in outer.params]

    async def average(key, pseudo, state_key, window):
        if "-f0-" in key:
            await asyncio.Event().wait()  # a round that never ends
        return pseudo, AverageReport(key=key, ok=True, leader="me", members=["me"], survivors=["me"]), False

    async def compute(fn, *args):
        return fn(*args)

    cycle = asyncio.run(Streaming(parts, 2, compute, lambda n: [1.0] * n, average).cycle(model, outer, 0, 0.1, lambda: False))
    assert [(o.fragment, o.ok) for o in cycle.outcomes] == [(0, False), (1, True)]
    assert "given up" in cycle.reports[0].reason and 0.25 < cycle.wait_s < 5
    f0 = parts[0]
    assert all(torch.equal(a, b) for a, b in zip(outer.params[f0.start : f0.stop], before[f0.start : f0.stop]))
