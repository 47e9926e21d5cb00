"""Matchmaking's two sans-IO state machines (matchmaking.py tells the protocol and drives them):
- `Search` (a peer looking for its leader): which peer to ask next, what an answer or a failure
  means, when to give up. Time comes in as `now`; tests drive it by hand.
- `Lobby` (a key this peer wants, as it looks to joiners): how to answer a join.
Also the "closed" answers both give and read, and a searching peer's pauses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from protocol import AvgGroup, AvgJoin

from ..net.transport import RPCError

MAX_REDIRECTS = 16  # a joiner follows at most this many redirects in one search
RETRY_S = 0.1  # pause before asking a leader again whose stream closed (once)
LOOK_AGAIN_S = 0.05  # pause before looking in the DHT again
OVER_HERE, FORMED, NOT_HERE = "this round is over here", "the group already formed", "not averaging this key"  # "closed" answers
GAVE_UP = "gave this round up without a group"  # (closed too: a joiner looks elsewhere, a leader stops waiting for it)
ASK_AGAIN_S = 0.5  # pause before asking a peer again that redirected us to a leader gone silent on us


@dataclass(frozen=True)
class Next:
    """What a searching peer does next: `lookup` (the DHT, then `Search.found`), `lead`, `call`
    `target` (then `answered` or `call_failed`), `done` (joined `group`) or `fail` (`reason`;
    `late`: a group may be averaging without us). `wait_s`: pause before doing it."""

    action: str
    target: str = ""
    wait_s: float = 0.0
    group: AvgGroup | None = None
    reason: str = ""
    late: bool = False


class Search:
    """A peer's search for the leader of one round key (sans-IO)."""

    def __init__(self, me: str, key: str, deadline: float, last_members: Collection[str] = (), silent: Collection[str] = ()):
        self.me, self.key, self.deadline = me, key, deadline
        # the leader of the last round is most likely the leader of this one; if it is gone
        # (or went silent on us lately), the next smallest member of that group (the DHT may
        # be slow while a peer is silent)
        self.excluded: set[str] = set(silent) - {me}
        self.last = set(last_members) - self.excluded if me in last_members else set()
        self.target: str | None = min(self.last) if self.last else None
        self.predicted = self.target is not None
        self.silent: set[str] = set()  # peers whose call timed out in this search (frozen, cut off)
        self.redirects = 0
        self.failures: dict[str, int] = {}

    def next(self, wait_s: float = 0.0) -> Next:
        if self.target is None:
            return Next("lookup", wait_s=wait_s)
        if self.target == self.me:
            return Next("lead", self.me, wait_s=wait_s)
        return Next("call", self.target, wait_s=wait_s)

    def _drop(self, exclude: bool = True) -> None:
        """Give up on the target; `exclude`: for good (then the next member of the last
        group is tried before the DHT)."""
        if exclude and self.target is not None:
            self.excluded.add(self.target)
            rest = sorted(self.last - self.excluded)
            if rest:
                self.target, self.predicted = rest[0], True
                return
        self.target, self.predicted = None, False

    def found(self, candidates: Collection[str]) -> Next:
        """The peers the DHT says want this key: the smallest we have not given up on (us included)."""
        self.target = sorted((set(candidates) - self.excluded) | {self.me})[0]
        return self.next()

    def led(self, smaller: str) -> Next:
        """We led, and a smaller peer that wants the key showed up: hand over to it."""
        self.target, self.predicted = smaller, False
        return self.next()

    def call_failed(self, now: float, timed_out: bool) -> Next:
        target = self.target or ""
        self.failures[target] = self.failures.get(target, 0) + 1
        if timed_out:
            self.silent.add(target)
        if self.failures[target] == 1 and not timed_out and now < self.deadline:
            return self.next(wait_s=RETRY_S)  # one retry: a stream can close under load
        self._drop()
        if now > self.deadline:
            return Next("fail", reason="no leader could be reached before the join deadline")
        return self.next()

    def answered(self, reply: object, now: float) -> Next:
        target = self.target or ""
        if not isinstance(reply, AvgGroup):
            self._drop()
            return self.next()
        if reply.status == "group":
            return Next("done", target, group=reply)
        if reply.status == "redirect":
            if reply.redirect in self.silent and self.redirects < MAX_REDIRECTS and now < self.deadline:
                # it still follows the leader that went silent on us: it will notice too, and
                # lead or follow someone else; ask it again in a moment instead of probing
                # the silent one for seconds once more
                self.redirects += 1
                return self.next(wait_s=ASK_AGAIN_S)
            if reply.redirect and reply.redirect != target and self.redirects < MAX_REDIRECTS:
                # the redirect names the peer the others follow: worth another try even if an
                # earlier call to it failed (a stream closed under load, say)
                self.redirects += 1
                self.excluded.discard(reply.redirect)
                self.target, self.predicted = reply.redirect, False
                return self.next()
            # a redirect we cannot follow (to nowhere, back to the same peer, or in circles)
            # says nothing about a group: look again in the DHT
            self._drop()
            if now > self.deadline:
                return Next("fail", reason="no usable leader before the join deadline", late=True)
            return self.next(wait_s=LOOK_AGAIN_S)
        if reply.reason in (NOT_HERE, GAVE_UP):
            # found in the DHT, yet not averaging: finished or restarted; a predicted leader
            # may just not have arrived yet (one that gave the key up will not lead it)
            self._drop(exclude=not self.predicted or reply.reason == GAVE_UP)
            if now > self.deadline:
                return Next("fail", reason="no group formed before the join deadline", late=True)
            return self.next(wait_s=LOOK_AGAIN_S)
        return Next("fail", reason=f"too late for round {self.key}: {target[-8:]} answered {reply.status}: {reply.reason or 'the group formed without us'}", late=True)


@dataclass
class Lobby:
    """A round key this peer wants, as joiners see it (sans-IO apart from the joiners' futures)."""

    key: str
    numel: int
    codec: str
    window: float  # seconds this peer, as leader, keeps the group open
    opened: float = field(default_factory=time.monotonic)  # when this peer started on the key
    mode: str = "candidate"  # candidate | leader | follower | closed
    following: str = ""
    pending: dict[str, tuple[AvgJoin, asyncio.Future]] = field(default_factory=dict)
    group: AvgGroup | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    measured: set[str] = field(default_factory=set)  # joiners whose arrival time was taken
    abandoned: str = ""  # why we gave the key up while leading it (see `Matchmaker.abandon`)
    defer_to: str = ""  # a smaller peer that asked about the key while we led it alone: we follow it

    def answer(self, peer: str, req: AvgJoin) -> AvgGroup | None:
        """The answer to a join right away, or None: it waits for the group (see `admit`)."""
        if self.mode == "follower":
            return AvgGroup(status="redirect", redirect=self.following)
        if self.group is not None and peer in self.group.members:
            return self.group  # a member asking again: our first answer was lost on the way
        if self.mode == "closed" or self.group is not None:
            return AvgGroup(status="closed", reason=FORMED)
        if req.numel != self.numel:
            raise RPCError("bad_request", f"vector has {req.numel} elements, this group averages {self.numel}")
        if req.codec != self.codec:
            raise RPCError("bad_request", f"codec {req.codec} differs from this group's {self.codec}")
        return None

    def admit(self, peer: str, req: AvgJoin, fut: asyncio.Future) -> None:
        old = self.pending.get(peer)
        if old and not old[1].done():
            old[1].set_result(AvgGroup(status="closed", reason="superseded by a newer join"))
        self.pending[peer] = (req, fut)
        self.changed.set()

    def joined(self, me: str) -> set[str]:
        return {me, *self.pending}

    def answer_all(self, answer: AvgGroup) -> None:
        for _, fut in self.pending.values():
            if not fut.done():
                fut.set_result(answer)

    def follow(self, target: str) -> None:
        """We follow `target` now: our joiners are sent there."""
        self.mode, self.following = "follower", target
        self.answer_all(AvgGroup(status="redirect", redirect=target))
        self.pending.clear()
