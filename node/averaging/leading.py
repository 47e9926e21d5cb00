"""A leader's side of matchmaking: one lead of a round key, from opening its group to forming it.

The smallest peer id that wants a key leads it (matchmaking.py tells the whole protocol). While
its group is open, the leader waits for joins and, after each wake-up:
1. looks in the DHT for a smaller peer that wants the key too: it hands over to that one;
2. alone a while, asks the next member of its last group where the key stands;
3. not alone, asks the expected peers that are later than their arrivals say, yet answer probes;
4. hears the answers: a leader to join, peers that will not come, or that it is too late.
It closes when everyone expected joined (or is overdue) or its window ends, and answers every
joiner with the group it forms, or with why there is none.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from protocol import AvgGroup, AvgJoin

from .config import RoundFailed
from .decisions import Liveness, close_reason, form_group
from .joins import FORMED, GAVE_UP, NOT_HERE, OVER_HERE, Lobby

if TYPE_CHECKING:
    from .matchmaking import Matchmaker

log = logging.getLogger(__name__)

ALONE_ASK_S = 1.0  # a leader still alone after this long asks the next member of the last group about the key


class Leading:
    """One lead of `lobby`'s key for a `Matchmaker`: `run` leads until the window closes (it
    forms the group) or a smaller peer shows up (it returns that peer, to be followed)."""

    def __init__(self, mm: Matchmaker, lobby: Lobby, own: AvgJoin, deadline: float, expected: int | Collection[str] | None, excluded: set[str]):
        self.mm, self.lobby, self.own, self.deadline, self.expected, self.excluded = mm, lobby, own, deadline, expected, excluded
        self.me, self.config = mm.avg.peer_id, mm.config
        self.probes = mm.probes()
        self.elsewhere: set[str] = set()  # expected peers that answered they averaged this key with others
        # Questions (`AvgJoin.ask_only`: where does this key stand with you?), one per peer:
        # - alone a while, to the next member of our last group: maybe the others averaged
        #   this key without us (we were frozen or cut off) or lead it without knowing of us
        #   (at once after a failed round: we may be back from a freeze, the others led by
        #   another). Averaged already: we are too late. A lone leader asked by a smaller
        #   peer follows it (`on_join`): two lone leaders of a key meet;
        # - to an expected peer later than its arrivals say, yet answering probes: it may lead
        #   the key alone (cut off a while, its view of us stale). Its answer brings us
        #   together, or says it went elsewhere.
        self.questions: dict[str, asyncio.Task] = {}
        self.seen: set[str] = set()
        self.lone = ""  # whom we asked as a leader alone
        self.ask_after = ALONE_ASK_S if mm.last_ok else 0.0
        self.lookup: asyncio.Task | None = None  # the DHT look-up in flight (a smaller peer that leads too?)
        self.why = ""  # why the group closes

    async def run(self) -> str | None:
        """Lead until the window closes (form the group) or a smaller peer shows up (return it)."""
        try:
            while not self.over():
                waiting = await self.wait()
                if self.over():  # everyone expected is here (or overdue)
                    break
                if self.lobby.defer_to:
                    return self.lobby.defer_to
                now = time.monotonic()
                smaller = self.look_for_smaller()
                if smaller is not None:
                    return smaller
                alone = len(self.lobby.joined(self.me)) < self.config.min_group_size
                if alone:
                    self.ask_the_last_group(now)
                elif waiting:
                    self.ask_the_late(waiting, now)
                leader = await self.hear_answers(alone)
                if leader is not None:
                    return leader
            self.probes.mark_silent(self.waiting(), time.monotonic())
        finally:
            await self.stop()
        self.form()
        return None

    # ---- when to close ----

    def over(self) -> bool:
        """Whether the group closes now (`why` says why) or the round was given up."""
        self.why = self.reason_to_close(time.monotonic())
        return bool(self.why) or bool(self.lobby.abandoned)

    def reason_to_close(self, now: float) -> str:
        joined = self.lobby.joined(self.me)
        if len(joined) < self.config.min_group_size:
            # too few to average: closing now fails the round for sure, waiting out the
            # window costs nobody anything, and a peer may still come (one that is late,
            # or one our expectations missed: the DHT's records lag while a peer is cut off)
            return close_reason(now, self.deadline, joined, None)
        return close_reason(now, self.deadline, joined, self.expected, self.overdue(now))

    def waiting(self) -> set[str]:
        """The expected peers (where the caller named them) that have not joined yet."""
        if self.expected is None or isinstance(self.expected, int):
            return set()
        return set(self.expected) - self.lobby.joined(self.me)

    def overdue(self, now: float) -> set[str]:
        """Expected peers not waited for any more: silent on us lately (they may still
        join), banned here (they cannot), later than their measured arrivals say they come
        (`Arrivals`) and not answering a probe either (`Probes`), or gone to another group
        for this key."""
        if self.expected is None or isinstance(self.expected, int):
            return set()
        waiting = self.waiting()
        silent = self.probes.silent(waiting)
        late = self.mm.arrivals.overdue(waiting, now - self.lobby.opened, self.lobby.window)
        return (waiting & (self.mm.recently_silent(now) | self.mm.banned() | self.elsewhere)) | (late & silent)

    async def wait(self) -> set[str]:
        """Until a join, a probe's, a question's or the look-up's answer, a peer overdue, or
        0.3 s: whichever first (a look-up may take seconds while a peer is cut off). Returns
        the expected peers not joined yet, as they were before the wait."""
        self.lobby.changed.clear()
        self.probes.changed.clear()
        now = time.monotonic()
        waiting = self.waiting()
        pause = min(0.3, max(0.0, self.deadline - now), self.mm.arrivals.next_overdue(waiting, now - self.lobby.opened, self.lobby.window))
        if not self.ask_after and not self.questions:
            pause = 0.0  # after a failed round: ask at once, not after a first wait
        await self.probes.wait(self.lobby.changed, pause, (self.lookup, *(t for p, t in self.questions.items() if p not in self.seen)))
        return waiting

    # ---- a smaller leader? ----

    def look_for_smaller(self) -> str | None:
        """A smaller peer that wants the key, as the last DHT look-up found (it leads: we follow
        it); starts the next look-up once the last one is done."""
        if self.lookup is None:
            self.lookup = asyncio.create_task(self.mm.candidates(self.lobby.key))
        elif self.lookup.done():
            found = self.lookup.result() if not self.lookup.cancelled() and self.lookup.exception() is None else set()
            self.lookup = None
            smaller = sorted(c for c in found - self.excluded if c < self.me)
            if smaller:
                return smaller[0]
        return None

    # ---- questions ----

    def ask_the_last_group(self, now: float) -> None:
        """Alone `ask_after` s into the window: ask the next member of our last group (one at a time)."""
        if self.lone or now - self.lobby.opened < self.ask_after:
            return
        # (all of them silent on us lately: after a cut, it may have been our link)
        others = sorted(set(self.mm.last_members) - {self.me} - self.excluded) or sorted(set(self.mm.last_members) - {self.me})
        if others:
            self.lone = others[0]
            self.ask(self.lone, now)

    def ask_the_late(self, waiting: set[str], now: float) -> None:
        """Ask the expected peers later than their arrivals say, yet answering probes."""
        late = self.mm.arrivals.overdue(waiting, now - self.lobby.opened, self.lobby.window)
        for p in sorted(late - self.probes.silent(waiting) - self.questions.keys()):
            self.ask(p, now)

    def ask(self, peer: str, now: float) -> None:
        # answered at once by a peer that is there: waited for as long as a probe of it
        # (its measured round trips; 0.75 s if none), so a connection our link's outage
        # left stuck is dropped and the question asked afresh within a second, not after two
        q = AvgJoin(round_key=self.lobby.key, numel=self.own.numel, codec=self.own.codec, namespace=self.own.namespace, ask_only=True)
        live = Liveness.known(self.mm.rtts, peer)
        wait = min(live.probe_timeout() if live.rtt is not None else 0.75, 2.0, self.deadline - now)
        self.questions[peer] = asyncio.create_task(self.mm.avg.transport.call(peer, q, timeout=max(live.min_timeout_s, wait)))

    def ask_alone_again(self, after: float) -> None:
        """Forget the question to the last group's member: ask afresh `after` s into the window."""
        del self.questions[self.lone]
        self.seen.discard(self.lone)
        self.lone, self.ask_after = "", after

    async def hear_answers(self, alone: bool) -> str | None:
        """What the questions answered since we last looked tell: a leader to join (returned),
        peers that will not come, or that we are too late (RoundFailed)."""
        for p, task in list(self.questions.items()):
            if p in self.seen or not task.done():
                continue
            self.seen.add(p)
            reply = task.result() if not task.cancelled() and task.exception() is None else None
            if not isinstance(reply, AvgGroup):
                if p == self.lone:  # no answer (after a cut our old connection may be stuck): afresh, shortly
                    await self.mm.avg.transport.reset(p)
                    self.ask_alone_again(time.monotonic() - self.lobby.opened + 0.5)
                continue
            leader = self.heard(p, reply, alone)
            if leader is not None:
                return leader
        return None

    def heard(self, p: str, reply: AvgGroup, alone: bool) -> str | None:
        """What `p`'s answer tells (see `hear_answers`)."""
        if reply.status == "closed" and reply.reason == NOT_HERE:
            if p == self.lone and self.ask_after < ALONE_ASK_S:  # asked early: once more later
                self.ask_alone_again(ALONE_ASK_S)
        elif reply.status == "closed" and reply.reason == GAVE_UP:
            self.elsewhere.add(p)  # it closed this key alone: it will not come
        elif reply.status == "closed" and reply.reason in (OVER_HERE, FORMED):
            if p == self.lone and alone:
                raise RoundFailed(f"too late for round {self.lobby.key}: {p[-8:]} answered {reply.reason}", late=True)
            self.elsewhere.add(p)
        elif reply.status == "redirect" and reply.redirect and reply.redirect != self.me and (p == self.lone or reply.redirect == p):
            # the one we asked alone averages the key with someone, or the late peer
            # leads it (and is smaller: else it follows us now): join them. A late
            # peer that follows another is on its way (or stuck): not followed
            return reply.redirect
        return None

    # ---- the end ----

    async def stop(self) -> None:
        """Cancel the look-up and the questions still in flight; stop probing."""
        for task in (self.lookup, *self.questions.values()):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.probes.close()

    def form(self) -> None:
        """Close the group: form it and answer every joiner with it, or tell them why there is
        none (RoundFailed)."""
        lobby, me, own = self.lobby, self.me, self.own
        lobby.mode = "closed"
        if lobby.abandoned:
            lobby.answer_all(AvgGroup(status="closed", reason=f"the leader gave the round up: {lobby.abandoned}"))
            raise RoundFailed(f"gave round {lobby.key} up: {lobby.abandoned}")
        joins = {me: own, **{p: j for p, (j, _) in lobby.pending.items()}}
        params = self.mm.avg.codec.params() if self.config.codec != "none" else {}
        group, reason = form_group(joins, own.numel, self.config, params, secrets.token_hex(8))
        if group is None:
            lobby.answer_all(AvgGroup(status="closed", reason=reason))
            raise RoundFailed(f"too late or alone: no other peer joined {lobby.key} within {lobby.window:.1f} s", late=True)
        lobby.group = group
        lobby.answer_all(group)
        log.debug("matchmaking %s: formed group %s of %s (%s; %s)", lobby.key, group.group_id, ", ".join(m[-8:] for m in group.members), self.why, reason)
