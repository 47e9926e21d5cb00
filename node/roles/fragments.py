"""Streaming DiLoCo's pure decisions: how the model is cut into fragments, when each fragment's
round starts and when its result is applied, what a replica does once a cycle is over. No I/O,
no clocks: the driver (streaming.py) passes inner steps and outcomes in, tests move them by hand.

A cycle is the H inner steps between two outer steps. Fragment f's round starts at inner step
`Schedule.start(f)` of the cycle (f·H/F, rounded down) with the fragment's pseudo-gradient of that
moment, runs while the inner steps go on, and is applied one fragment period later, at the start
of the next fragment's round (the last fragment's at the end of the cycle): so at a cycle's end
every fragment has taken its outer step and nothing is in flight, the state a checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def split(sizes: Sequence[int], fragments: int) -> list[range]:
    """Cut tensors of `sizes` elements, in order, into `fragments` contiguous groups of whole
    tensors, each as close to an equal share of the elements as the cuts allow (a cut goes where
    the running total is nearest the next share). Every group holds at least one tensor."""
    n = len(sizes)
    if fragments < 1:
        raise ValueError(f"fragments must be at least 1, got {fragments}")
    if fragments > n:
        raise ValueError(f"cannot cut {n} parameter tensors into {fragments} fragments: at most {n}")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    total, cuts = prefix[-1], [0]
    for k in range(1, fragments):
        # after the previous cut, leaving one tensor at least for each fragment still to come
        lo, hi = cuts[-1] + 1, n - (fragments - k)
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] * fragments - k * total), i)))
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


@dataclass(frozen=True)
class Schedule:
    """Where in a cycle of `inner_steps` (H) inner steps each of `fragments` (F) rounds starts."""

    inner_steps: int
    fragments: int

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.inner_steps:
            raise ValueError(f"fragments must be in 1..inner_steps ({self.inner_steps}), got {self.fragments}")

    def start(self, f: int) -> int:
        """The inner step of the cycle (0-based) at which fragment f's round starts."""
        return f * self.inner_steps // self.fragments

    def period(self, f: int) -> int:
        """Inner steps fragment f's round runs alongside: until the next fragment's starts."""
        end = self.start(f + 1) if f + 1 < self.fragments else self.inner_steps
        return end - self.start(f)


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str


def when_to_apply(trained: int, period: int, done: bool) -> Decision:
    """What a replica does with a fragment's round after `trained` inner steps since it started:
    "train" (not before one fragment period: the round's result waits while the steps go on),
    "apply" (the period is over and the round is done), or "wait" (the period is over and the
    round is not: it is over its deadline, and this is the one time the replica waits on the
    network; the next fragment's round must not start before this one is applied, since its key
    carries the outer state it is applied to)."""
    if trained < period:
        return Decision("train", f"{trained} of the fragment period's {period} inner steps taken")
    if done:
        return Decision("apply", f"the round is done and the fragment period ({period} inner steps) is over")
    return Decision("wait", f"the fragment period ({period} inner steps) is over and its round is still running")


@dataclass(frozen=True)
class Outcome:
    """How one fragment's round of a cycle ended, as the cycle's end decision needs it."""

    fragment: int
    ok: bool
    late: bool = False  # failed because the others may have averaged without us
    moved_on: bool = False  # given up: the other replicas were seen at a later outer step


def after_cycle(outcomes: Sequence[Outcome], wait_s: float, look_s: float = 3.0) -> tuple[float, Decision]:
    """At a cycle's end: how long to look for a state of the other replicas to take instead of
    ours (seconds; 0: none), and why. Every round done: none (we hold what the others hold). A
    round that failed because we were late, or because the others were seen ahead, may have left
    only us behind: wait up to `wait_s` for their state. Rounds that failed otherwise failed for
    everyone, most likely (a member died): a quick look (`look_s`), then go on together, the
    failed fragments' progress carried in their next pseudo-gradients."""
    failed = [o.fragment for o in outcomes if not o.ok]
    if not failed:
        return 0.0, Decision("go on", "every fragment's round was done")
    behind = [o.fragment for o in outcomes if not o.ok and (o.late or o.moved_on)]
    if behind:
        return wait_s, Decision("catch up", f"fragment(s) {behind} failed with the others ahead or without us: wait for their state")
    return look_s, Decision("look", f"fragment(s) {failed} failed for everyone, most likely: a quick look, then on together")
