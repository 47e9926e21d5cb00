"""The stage server's decisions (node/roles/stage_core.py), with time moved by hand: no p2pd, no
torch, no patched constants. Each decision says why."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from node.roles.stage_core import KeptGraphs, NormBook, StepSchedule, take_batch


@dataclass
class Call:
    op: str
    samples: int
    shape: tuple[int, ...]
    alone: bool = False


def fwd(samples: int, t: int = 16, alone: bool = False) -> Call:
    return Call("forward", samples, (samples, t), alone)


# ---- batching


def test_calls_queued_together_share_one_compute_up_to_the_sample_limit_and_the_rest_keep_their_order():
    a, b, c, d = fwd(8), fwd(8), fwd(8), fwd(8)
    queue = deque([a, b, c, d])
    batch, why = take_batch(queue, max_samples=20)
    assert batch == [a, b] and list(queue) == [c, d] and why == "2 forward calls queued together, 16 sequences"


def test_only_calls_of_the_same_op_and_sequence_shape_batch_and_a_kept_graph_is_computed_alone():
    first, other_len, train, same = fwd(4), fwd(4, t=32), Call("train", 4, (4, 16)), fwd(4)
    queue = deque([first, other_len, train, same])
    batch, _ = take_batch(queue, max_samples=256)
    assert batch == [first, same] and list(queue) == [other_len, train]
    kept, also = fwd(4, alone=True), fwd(4)
    queue = deque([kept, also])
    assert take_batch(queue, 256) == ([kept], "its graph is kept: computed alone") and list(queue) == [also]
    queue = deque([also, kept])
    assert take_batch(queue, 256)[0] == [also] and list(queue) == [kept]  # a kept one never joins a batch


# ---- kept graphs


def test_kept_graphs_go_oldest_first_past_the_limit_and_after_their_ttl_each_with_its_reason():
    kept = KeptGraphs(limit=2, ttl_s=60.0)
    assert kept.keep("a", 0.0, "ga") == [] and kept.keep("b", 10.0, "gb") == []
    assert kept.keep("c", 20.0, "gc") == [("a", "the oldest of 2 graphs kept")]
    assert "a" not in kept and len(kept) == 2
    assert kept.expire(70.0) == []  # b is 60 s old: still waiting for its backward
    assert kept.expire(70.5) == [("b", "kept over 60 s without its backward")] and len(kept) == 1
    assert kept.take("c") == "gc" and kept.take("c") is None  # used up
    kept.keep("d", 100.0, "gd")
    kept.drop("d")
    assert len(kept) == 0


def test_keeping_a_graph_first_drops_the_expired_ones():
    kept = KeptGraphs(limit=8, ttl_s=60.0)
    kept.keep("a", 0.0, "ga")
    assert kept.keep("b", 61.0, "gb") == [("a", "kept over 60 s without its backward")] and list(k for k in "ab" if k in kept) == ["b"]


# ---- when a stage steps, with the global clip


def schedule(clip_across: bool = True, index: int = 1) -> StepSchedule:
    return StepSchedule(step_samples=6, stages=3, index=index, clip_across=clip_across, pending_s=1.0, report_s=0.5)


def test_a_step_falls_due_after_its_samples_and_puts_its_norm_in_the_answers():
    s = schedule()
    assert not s.accumulated(3, 1) and not s.due and s.due_norm == (0, -1.0)
    assert s.accumulated(3, 1) and s.due  # just became due: the server gives its norm
    s.norm_due(4.0)
    assert s.due_norm == (1, 4.0)
    assert not s.accumulated(3, 1)  # still due, not again


def test_a_due_step_waits_for_the_other_stages_norms_then_steps_after_pending_s_without_a_call():
    s = schedule()
    assert s.when_idle(now=100.0, idle_since=100.0).action == "wait" and s.when_idle(100.0, 100.0).until is None  # nothing due
    s.accumulated(6, 2)
    d = s.when_idle(now=100.0, idle_since=100.0)
    assert (d.action, d.until, d.reason) == ("wait", 101.0, "the next call brings the other stages' norms of this step")
    assert s.when_idle(now=100.9, idle_since=100.0).action == "wait"
    d = s.when_idle(now=101.0, idle_since=100.0)
    assert (d.action, d.reason) == ("step", "no call for 1 s: stepping with the norms heard last")
    assert s.before_batch().action == "step" and s.after_batch() is None  # a call that comes first brings the norms: step before it computes


def test_norms_of_every_other_stage_complete_a_due_step_and_partial_ones_change_nothing():
    s = schedule(index=1)
    assert not s.heard((1.0, 2.0, 3.0)) and s.others2 == 4.0  # not due: kept for the step, no wake
    s.accumulated(6, 2)
    assert not s.heard((1.0, 2.0)) and s.others2 == 4.0  # a caller that knows two stages of three
    assert not s.heard((-1.0, 2.0, 9.0)) and s.others2 == 4.0  # one stage's norm not known yet
    assert s.heard((2.0, 7.0, 3.0)) and s.others2 == 5.0  # our own (index 1) does not count
    d = s.when_idle(now=100.0, idle_since=100.0)
    assert (d.action, d.reason) == ("step", "a call brought the other stages' norms of this step")


def test_after_a_step_the_stats_are_written_at_once_or_once_the_calls_pause():
    s = schedule()
    s.accumulated(6, 2)
    assert s.stepped(now=10.0)  # nothing written yet: now
    assert (s.acc_samples, s.acc_calls, s.norms_due) == (0, 0, False)
    s.reported(10.0)
    s.accumulated(6, 2)
    assert not s.stepped(now=10.2)  # written 0.2 s ago: later
    d = s.when_idle(now=10.2, idle_since=10.2)
    assert (d.action, d.until) == ("wait", 10.7)
    d = s.when_idle(now=10.7, idle_since=10.2)
    assert (d.action, d.reason) == ("report", "the calls paused: the steps since the last report are written")
    s.reported(10.7)
    assert s.when_idle(now=11.0, idle_since=10.7) == s.when_idle(now=99.0, idle_since=10.7)  # nothing due any more
    assert s.when_idle(now=11.0, idle_since=10.7).until is None


def test_clipped_by_its_own_norm_a_stage_steps_right_after_the_batch_that_made_it_due():
    s = schedule(clip_across=False)
    assert not s.accumulated(6, 2)  # due, but no norm to hand on
    assert s.before_batch() is None
    d = s.after_batch()
    assert (d.action, d.reason) == ("step", "its share of the step is in, clipped by its own norm")
    assert s.when_idle(now=0.0, idle_since=0.0).action == "wait"  # never waits for norms


def test_the_first_stage_steps_on_the_answer_that_brings_every_later_stages_norm_of_the_same_step():
    first = schedule(index=0)
    first.accumulated(6, 2)
    first.norm_due(1.0)  # its step 1 is due
    assert first.answer_completes((1, 1))
    assert not first.answer_completes((1, 0))  # stage 2 has not got that far: an older norm
    assert not schedule(index=1).answer_completes((0,))  # only the first stage hears answers of the whole way


# ---- the trainer's side of the global clip


def test_a_trainer_hands_on_the_newest_norm_of_each_stage_and_tells_the_later_stages_once_all_are_known():
    book = NormBook(stages=3)
    assert book.norms2() == (-1.0, -1.0, -1.0)
    book.heard(["p0", "p1", "p2"], 0, norm_steps=(1, 1, 1), norms2=(1.0, 2.0, 3.0))
    assert book.norms2() == (1.0, 2.0, 3.0)
    book.heard(["p1"], 1, norm_steps=(0,), norms2=(9.0,))  # an answer that crossed a newer one on the way
    assert book.norms2() == (1.0, 2.0, 3.0)
    book.heard(["q1"], 1, norm_steps=(0,), norms2=(5.0,))  # another peer of the stage: its own count
    assert book.norms2() == (1.0, 5.0, 3.0)
    norms2, peers = book.to_tell()
    assert norms2 == (1.0, 5.0, 3.0) and peers == [(1, "p1"), (1, "q1"), (2, "p2")]  # the first stage hears with the next micro-batch
    assert book.to_tell()[1] == []  # told: nobody until they answer again
    partial = NormBook(stages=2)
    partial.heard(["p1"], 1, norm_steps=(1,), norms2=(2.0,))
    assert partial.to_tell() == ((-1.0, 2.0), [])  # stage 0's norm unknown: nothing to tell
