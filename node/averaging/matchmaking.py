"""Matchmaking: who averages with whom this round.

Every peer that wants a round key publishes a signed record under it in the DHT and joins the
group of the smallest peer id that wants the same key: that peer leads. A leader that sees a
smaller id later hands its joiners over (a redirect); a joiner follows redirects. The leader
closes its group when the expected peers have joined or its join window ends, and answers every
joiner with the group (members, slice bounds, codec, deadlines). A peer that arrives after the
group closed is told so and waits for the next round.

Two sans-IO state machines hold the decisions, a thin async driver does the I/O:
- `Search` (a peer looking for its leader): which peer to ask next, what an answer or a failure
  means, when to give up. Time comes in as `now`; tests drive it by hand.
- `Lobby` (a key this peer wants, as it looks to joiners): how to answer a join.
- `Matchmaker` (the driver): DHT records and look-ups, calls to leaders, leading, serving joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from protocol import AvgGroup, AvgJoin, RemoteProtocolError
from protocol.records import MemberRecord

from ..net.transport import NETWORK_ERRORS, CallContext, CallTimeout, PeerUnreachable, RPCError
from .config import MAX_EARLY_KEYS, AverageReport, AveragerConfig, RoundFailed
from .decisions import Arrivals, Liveness, close_reason, form_group

log = logging.getLogger(__name__)

MAX_REDIRECTS = 16  # a joiner follows at most this many redirects in one search
RETRY_S = 0.1  # pause before asking a leader again whose stream closed (once)
LOOK_AGAIN_S = 0.05  # pause before looking in the DHT again
OVER_HERE, FORMED, NOT_HERE = "this round is over here", "the group already formed", "not averaging this key"  # "closed" answers
GAVE_UP = "gave this round up without a group"  # (closed too: a joiner looks elsewhere, a leader stops waiting for it)
ALONE_ASK_S = 1.0  # a leader still alone after this long asks the next member of the last group about the key
ASK_AGAIN_S = 0.5  # pause before asking a peer again that redirected us to a leader gone silent on us
SILENT_FOR_S = 20.0  # a peer that went silent on us is not waited for this long (unless it joins or answers a probe again): about until its DHT record is stale


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


class Probes:
    """Pings the peers we wait for, while we wait: one watcher per peer, each probe once the
    last one ended (`Liveness.next_after`), waking whoever waits (`changed`) with each answer
    or miss. A leader lets an expected peer that is later than its measured arrivals say go
    only if its latest probe went unanswered too; a round stops waiting for a member whose
    last two went unanswered. A peer that answers is alive and most likely on its way (a slow
    inner phase, a starved CPU): it keeps its place. A watcher stops once nobody asked about
    its peer for `IDLE_S` (it joined, or the wait moved on)."""

    IDLE_S = 1.0

    def __init__(self, transport, rtts: dict[str, tuple[float, float]], silent: dict[str, float]):
        self.transport, self.rtts, self.marked = transport, rtts, silent
        self.live: dict[str, Liveness] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.asked: dict[str, float] = {}
        self.changed = asyncio.Event()

    def silent(self, peers: Collection[str], misses: int = 1) -> set[str]:
        """Of `peers` (probed from now on), those whose latest `misses` probes went unanswered."""
        now = time.monotonic()
        for p in peers:
            self.asked[p] = now
            live = self.live.setdefault(p, Liveness.known(self.rtts, p))
            task = self.tasks.get(p)
            if task is None or task.done():
                self.tasks[p] = asyncio.create_task(self._watch(p, live))
        return {p for p in peers if self.live[p].missed >= misses}

    async def _watch(self, peer: str, live: Liveness) -> None:
        while time.monotonic() - self.asked[peer] < self.IDLE_S:
            t0, wait = time.monotonic(), live.probe_timeout()
            try:
                live.answered(await self.transport.ping(peer, timeout=wait))
                live.remember(self.rtts, peer)
                if self.marked.pop(peer, None) is not None:  # it answers: no longer counted as silent
                    log.debug("%s answers probes again", peer[-8:])
                pause = live.next_after()
            except NETWORK_ERRORS as e:
                # the next at once only after a probe that waited its whole timeout; one that
                # failed quickly (refused, no route) waits the interval: no ping storm, which
                # would starve this process's training thread of the GIL
                timed_out = time.monotonic() - t0 >= wait * 0.9
                pause = live.next_after() if timed_out else live.interval_s
                if self.transport.heard.get(peer, 0.0) > t0:
                    pause = live.interval_s  # its data kept coming meanwhile (a busy link delays a ping): alive
                else:
                    live.unanswered()
                    log.debug("probe of %s unanswered (%d in a row): %s", peer[-8:], live.missed, e)
                    if live.silent():  # every wait on it (a leader's decision, say) knows at once
                        self.marked[peer] = time.monotonic()
                    if isinstance(e, CallTimeout):
                        await self.transport.reset(peer)  # the next probe on a fresh connection (after a cut, an old one stays stuck for seconds)
            self.changed.set()
            await asyncio.sleep(pause)

    async def wait(self, event: asyncio.Event | None, timeout: float, tasks: Collection[asyncio.Task | None] = ()) -> None:
        """Until `event` is set, a probe answers or misses, one of `tasks` ends, or `timeout`
        (clears nothing: clear `changed` and `event` before looking at what they tell)."""
        tasks = [t for t in tasks if t is not None]
        if any(t.done() for t in tasks):
            return
        waits = [asyncio.create_task(self.changed.wait())] + ([asyncio.create_task(event.wait())] if event is not None else [])
        try:
            await asyncio.wait(waits + tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def mark_silent(self, peers: Collection[str], now: float) -> None:
        """Of `peers` (not joined when the group closed), mark those whose latest probe went
        unanswered: the next rounds do not wait for them until they answer or join. (Two
        unanswered in a row mark a peer as they happen, see `_watch`.)"""
        for p in peers:
            if p in self.live and self.live[p].missed:
                self.marked[p] = now

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


class Matchmaker:
    """The async driver: DHT records and look-ups, calls to leaders, leading, serving joins.
    One per averager; its keys are those of the averager's namespace."""

    def __init__(self, averager):
        self.avg = averager
        self.config: AveragerConfig = averager.config
        self.lobbies: dict[str, Lobby] = {}
        self.closed_keys: dict[str, float] = {}  # round keys we finished recently -> when
        self.no_group: set[str] = set()  # of those, the ones we gave up without a group (alone, or our leader gone)
        self.key_started: dict[str, asyncio.Event] = {}  # keys joins wait for us to start averaging
        self.last_members: tuple[str, ...] = ()  # the last group we completed a round with
        self.last_ok = True  # whether our last round here committed
        self.rtts: dict[str, tuple[float, float]] = {}  # peer -> probe round trips measured (usual, slowest lately), seconds (see `Liveness`)
        self.silent: dict[str, float] = {}  # peer -> when it last went silent on us (monotonic)
        self.arrivals = Arrivals()  # how late each peer joins the groups we lead
        self.closed_opened: dict[str, float] = {}  # round keys we finished recently -> when we started on them
        self.joins_to_lose = averager.faults.lose_join_replies

    def dht_key(self, key: str) -> str:
        return f"swarmtrain/{self.config.swarm_id}/{self.config.namespace}/{key}"

    async def matchmake(self, key: str, numel: int, weight: float, expected: int | Collection[str] | None, report: AverageReport, window: float) -> AvgGroup:
        avg, me = self.avg, self.avg.peer_id
        if key in self.lobbies or key in self.closed_keys:
            raise RoundFailed(f"round {key} was already averaged or is in progress here")
        lobby = Lobby(key, numel, self.config.codec, window)
        self.lobbies[key] = lobby
        started = self.key_started.pop(key, None)
        if started is not None:  # joins that came before we did are waiting for this
            started.set()
        join = AvgJoin(round_key=key, numel=numel, weight=weight, bandwidth=avg.bandwidth, codec=self.config.codec, namespace=self.config.namespace)
        deadline = time.monotonic() + window
        now = time.time()
        rec = MemberRecord(self.config.swarm_id, me, (), "averaging", 0, now, expires_at=now + window + 60).sign(avg.host.key)
        # announced in the background: peers that know the group from the last round do not
        # need the DHT at all, and the others find us there a moment later
        avg.spawn(avg.host.dht_store(self.dht_key(key), rec.to_bytes(), rec.expires_at, subkey=me))
        search = Search(me, key, deadline, self.last_members, self.recently_silent())
        step = search.next()
        while True:
            if step.wait_s:
                await asyncio.sleep(step.wait_s)
            log.debug("matchmaking %s: %s %s%s", key, step.action, step.target[-8:], " (predicted)" if search.predicted else "")
            if step.action == "lookup":
                step = search.found(await self.candidates(key))
            elif step.action == "lead":
                lobby.mode = "leader"
                smaller = await self._lead(lobby, join, deadline, expected, search.excluded)
                if lobby.group is not None:
                    report.leader = me
                    return lobby.group
                step = search.led(smaller)
            elif step.action == "call":
                lobby.follow(step.target)
                try:
                    # a leader answers by the end of its own window, which may be longer than ours
                    reply = await self.call_alive(step.target, join, timeout=3 * window + 2 * self.config.decision_grace_s)
                except NETWORK_ERRORS as e:
                    log.debug("matchmaking %s: %s unusable as leader: %s", key, step.target[-8:], e)
                    step = search.call_failed(time.monotonic(), isinstance(e, CallTimeout))
                    continue
                log.debug("matchmaking %s: %s answered %s", key, step.target[-8:], getattr(reply, "status", reply))
                step = search.answered(reply, time.monotonic())
            elif step.action == "done":
                self._check_group(step.group, numel)
                report.leader = step.target
                lobby.group = step.group
                return step.group
            else:
                raise RoundFailed(step.reason, late=step.late)

    def abandon(self, key: str, why: str) -> bool:
        """Give up leading `key` before its group formed (the caller learned that the others
        moved on without us): `average()` fails at once with `why`. False if too late for that."""
        lobby = self.lobbies.get(key)
        if lobby is None or lobby.group is not None or lobby.mode != "leader":
            return False
        lobby.abandoned = why
        lobby.changed.set()
        return True

    def recently_silent(self, now: float | None = None) -> set[str]:
        """Peers that went silent on us within SILENT_FOR_S and have not joined us since."""
        now = time.monotonic() if now is None else now
        heard = self.avg.transport.heard
        for p in [p for p, t in self.silent.items() if now - t > SILENT_FOR_S or heard.get(p, 0.0) > t]:
            del self.silent[p]  # (a call of its came in since: it is back)
        return set(self.silent)

    def probes(self) -> Probes:
        """Probes of peers a round waits on, sharing what we know of their round trips and silence."""
        return Probes(self.avg.transport, self.rtts, self.silent)

    async def call_alive(self, target: str, request, timeout: float) -> object:
        """A long call to `target` (a join its leader answers when the group forms, a report
        it answers with its decision), while probing that it is still there (`Liveness`): a
        peer that stops answering is given up on within seconds (CallTimeout) and marked
        silent, not after the call's own timeout."""
        transport = self.avg.transport
        deadline = time.monotonic() + timeout
        live = Liveness.known(self.rtts, target)
        if target in self.recently_silent():
            live.missed = live.misses - 1  # silent on us lately: one more probe unanswered tells
        again = True  # a call whose connection failed goes once more if a probe is answered

        def start() -> asyncio.Task:
            return asyncio.create_task(transport.call(target, request, timeout=max(0.1, deadline - time.monotonic())))

        def lost(task: asyncio.Task) -> bool:
            return task.done() and not task.cancelled() and isinstance(task.exception(), (ConnectionError, PeerUnreachable))

        call = start()
        started = time.monotonic()
        try:
            while True:
                t0, wait = time.monotonic(), live.probe_timeout()
                probe = asyncio.create_task(transport.ping(target, timeout=wait))
                while not (call.done() or probe.done()):
                    await asyncio.wait([call, probe], timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                    if self.silent.get(target, 0.0) > started:  # our other probes of it (a round's) found it silent
                        probe.cancel()
                        await asyncio.gather(probe, return_exceptions=True)
                        raise CallTimeout(f"{target[-8:]} went silent (probes of it unanswered)")
                if call.done() and not (lost(call) and again):
                    probe.cancel()
                    await asyncio.gather(probe, return_exceptions=True)
                    return call.result()
                await asyncio.gather(probe, return_exceptions=True)  # (a lost call: this probe tells)
                try:
                    live.answered(probe.result())
                    live.remember(self.rtts, target)
                    if lost(call):  # its connection went (a reset, a restart), the peer answers: once more
                        again, call = False, start()
                except NETWORK_ERRORS as e:
                    if transport.heard.get(target, 0.0) <= t0:  # (its data kept coming meanwhile: alive)
                        live.unanswered()
                        if isinstance(e, CallTimeout) and not live.silent():
                            await transport.reset(target)  # the next probe on a fresh connection (after a cut, an old one stays stuck for seconds)
                if why := live.silent():
                    self.silent[target] = time.monotonic()
                    raise CallTimeout(f"{target[-8:]} went silent: {why}")
                if lost(call):
                    again, call = False, start()
                quick = time.monotonic() - t0 < wait * 0.9  # (answered, or failed at once: no ping storm)
                done, _ = await asyncio.wait([call], timeout=live.interval_s if quick else live.next_after())
                if done and not (lost(call) and again):
                    return call.result()
        finally:
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)

    async def candidates(self, key: str) -> set[str]:
        """Peers whose valid record says they want this key."""
        raw = await self.avg.host.dht_get(self.dht_key(key))
        out = set()
        if isinstance(raw, dict):
            for subkey, value in raw.items():
                try:
                    rec = MemberRecord.from_bytes(value, self.config.swarm_id)
                except RemoteProtocolError:
                    continue
                if rec.peer_id == subkey:
                    out.add(rec.peer_id)
        return out

    async def _lead(self, lobby: Lobby, own: AvgJoin, deadline: float, expected: int | Collection[str] | None, excluded: set[str]) -> str | None:
        """Lead until the window closes (form the group) or a smaller peer shows up (return it)."""
        me = self.avg.peer_id

        probes = self.probes()
        elsewhere: set[str] = set()  # expected peers that answered they averaged this key with others

        def overdue(now: float) -> set[str]:
            """Expected peers not waited for any more: silent on us lately (they may still
            join), later than their measured arrivals say they come (`Arrivals`) and not
            answering a probe either (`Probes`), or gone to another group for this key."""
            if expected is None or isinstance(expected, int):
                return set()
            waiting = set(expected) - lobby.joined(me)
            silent = probes.silent(waiting)
            late = self.arrivals.overdue(waiting, now - lobby.opened, lobby.window)
            return (waiting & (self.recently_silent(now) | elsewhere)) | (late & silent)

        def check(now: float) -> str:
            joined = lobby.joined(me)
            if len(joined) < self.config.min_group_size:
                # too few to average: closing now fails the round for sure, waiting out the
                # window costs nobody anything, and a peer may still come (one that is late,
                # or one our expectations missed: the DHT's records lag while a peer is cut off)
                return close_reason(now, deadline, joined, None)
            return close_reason(now, deadline, joined, expected, overdue(now))

        # Questions (`AvgJoin.ask_only`: where does this key stand with you?), one per peer:
        # - alone a while, to the next member of our last group: maybe the others averaged
        #   this key without us (we were frozen or cut off) or lead it without knowing of us
        #   (at once after a failed round: we may be back from a freeze, the others led by
        #   another). Averaged already: we are too late. A lone leader asked by a smaller
        #   peer follows it (`on_join`): two lone leaders of a key meet;
        # - to an expected peer later than its arrivals say, yet answering probes: it may lead
        #   the key alone (cut off a while, its view of us stale). Its answer brings us
        #   together, or says it went elsewhere.
        questions: dict[str, asyncio.Task] = {}
        seen: set[str] = set()
        lone = ""  # whom we asked as a leader alone
        ask_after = ALONE_ASK_S if self.last_ok else 0.0

        def ask(peer: str, now: float) -> None:
            # answered at once by a peer that is there: waited for as long as a probe of it
            # (its measured round trips; 0.75 s if none), so a connection our link's outage
            # left stuck is dropped and the question asked afresh within a second, not after two
            q = AvgJoin(round_key=lobby.key, numel=own.numel, codec=own.codec, namespace=own.namespace, ask_only=True)
            live = Liveness.known(self.rtts, peer)
            wait = min(live.probe_timeout() if live.rtt is not None else 0.75, 2.0, deadline - now)
            questions[peer] = asyncio.create_task(self.avg.transport.call(peer, q, timeout=max(live.min_timeout_s, wait)))

        lookup: asyncio.Task | None = None  # the DHT look-up in flight (a smaller peer that leads too?)
        try:
            while not (why := check(time.monotonic())) and not lobby.abandoned:
                # a join, a probe's, a question's or the look-up's answer, a peer overdue, or
                # 0.3 s: whichever first (a look-up may take seconds while a peer is cut off)
                lobby.changed.clear()
                probes.changed.clear()
                now = time.monotonic()
                waiting = set(expected) - lobby.joined(me) if expected is not None and not isinstance(expected, int) else set()
                pause = min(0.3, max(0.0, deadline - now), self.arrivals.next_overdue(waiting, now - lobby.opened, lobby.window))
                if not ask_after and not questions:
                    pause = 0.0  # after a failed round: ask at once, not after a first wait
                await probes.wait(lobby.changed, pause, (lookup, *(t for p, t in questions.items() if p not in seen)))
                if (why := check(time.monotonic())) or lobby.abandoned:  # everyone expected is here (or overdue)
                    break
                if lobby.defer_to:
                    return lobby.defer_to
                now = time.monotonic()
                if lookup is None:
                    lookup = asyncio.create_task(self.candidates(lobby.key))
                elif lookup.done():
                    found = lookup.result() if not lookup.cancelled() and lookup.exception() is None else set()
                    lookup = None
                    smaller = sorted(c for c in found - excluded if c < me)
                    if smaller:
                        return smaller[0]
                alone = len(lobby.joined(me)) < self.config.min_group_size
                if alone and not lone and now - lobby.opened >= ask_after:
                    # (all of them silent on us lately: after a cut, it may have been our link)
                    others = sorted(set(self.last_members) - {me} - excluded) or sorted(set(self.last_members) - {me})
                    if others:
                        lone = others[0]
                        ask(lone, now)
                if not alone and waiting:
                    late = self.arrivals.overdue(waiting, now - lobby.opened, lobby.window)
                    for p in sorted(late - probes.silent(waiting) - questions.keys()):
                        ask(p, now)
                for p, task in list(questions.items()):
                    if p in seen or not task.done():
                        continue
                    seen.add(p)
                    reply = task.result() if not task.cancelled() and task.exception() is None else None
                    if not isinstance(reply, AvgGroup):
                        if p == lone:  # no answer (after a cut our old connection may be stuck): afresh, shortly
                            await self.avg.transport.reset(p)
                            lone, ask_after = "", time.monotonic() - lobby.opened + 0.5
                            del questions[p]
                            seen.discard(p)
                        continue
                    if reply.status == "closed" and reply.reason == NOT_HERE:
                        if p == lone and ask_after < ALONE_ASK_S:  # asked early: once more later
                            lone, ask_after = "", ALONE_ASK_S
                            del questions[p]
                            seen.discard(p)
                    elif reply.status == "closed" and reply.reason == GAVE_UP:
                        elsewhere.add(p)  # it closed this key alone: it will not come
                    elif reply.status == "closed" and reply.reason in (OVER_HERE, FORMED):
                        if p == lone and alone:
                            raise RoundFailed(f"too late for round {lobby.key}: {p[-8:]} answered {reply.reason}", late=True)
                        elsewhere.add(p)
                    elif reply.status == "redirect" and reply.redirect and reply.redirect != me and (p == lone or reply.redirect == p):
                        # the one we asked alone averages the key with someone, or the late peer
                        # leads it (and is smaller: else it follows us now): join them. A late
                        # peer that follows another is on its way (or stuck): not followed
                        return reply.redirect
            if expected is not None and not isinstance(expected, int):
                probes.mark_silent(set(expected) - lobby.joined(me), time.monotonic())
        finally:
            for task in (lookup, *questions.values()):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await probes.close()
        lobby.mode = "closed"
        if lobby.abandoned:
            lobby.answer_all(AvgGroup(status="closed", reason=f"the leader gave the round up: {lobby.abandoned}"))
            raise RoundFailed(f"gave round {lobby.key} up: {lobby.abandoned}")
        joins = {me: own, **{p: j for p, (j, _) in lobby.pending.items()}}
        params = self.avg.codec.params() if self.config.codec != "none" else {}
        group, reason = form_group(joins, own.numel, self.config, params, secrets.token_hex(8))
        if group is None:
            lobby.answer_all(AvgGroup(status="closed", reason=reason))
            raise RoundFailed(f"too late or alone: no other peer joined {lobby.key} within {lobby.window:.1f} s", late=True)
        lobby.group = group
        lobby.answer_all(group)
        log.debug("matchmaking %s: formed group %s of %s (%s; %s)", lobby.key, group.group_id, ", ".join(m[-8:] for m in group.members), why, reason)
        return None

    def _check_group(self, g: AvgGroup, numel: int) -> None:
        if self.avg.peer_id not in g.members:
            raise RemoteProtocolError("we are not in the group we were given", "members")
        if g.bounds[-1] != numel:
            raise RemoteProtocolError(f"bounds cover {g.bounds[-1]} elements, we have {numel}", "bounds")
        if g.codec != self.config.codec:
            raise RemoteProtocolError(f"group codec {g.codec} differs from ours ({self.config.codec})", "codec")

    async def on_join(self, ctx: CallContext) -> AvgGroup:
        req: AvgJoin = ctx.request
        if self.silent.pop(ctx.peer_id, None) is not None:  # whatever it wants, it is back
            log.debug("%s is back: it joins %s", ctx.peer_id[-8:], req.round_key)
        if req.ask_only:  # where this key stands here, at once; nobody is taken in
            lobby = self.lobbies.get(req.round_key)
            if lobby is None:
                reason = (GAVE_UP if req.round_key in self.no_group else OVER_HERE) if req.round_key in self.closed_keys else NOT_HERE
                return AvgGroup(status="closed", reason=reason)
            if lobby.mode == "follower":
                return AvgGroup(status="redirect", redirect=lobby.following)
            if lobby.group is not None or lobby.mode == "closed":
                return AvgGroup(status="closed", reason=FORMED)
            if lobby.mode == "leader" and not lobby.pending and ctx.peer_id < self.avg.peer_id and not lobby.defer_to:
                # we lead it alone and a smaller peer is on it too (it leads, or is about to):
                # we follow it, as if the DHT had shown it to us (see `_lead`)
                lobby.defer_to = ctx.peer_id
                lobby.changed.set()
                log.debug("matchmaking %s: %s asks about it while we lead it alone: we follow it", req.round_key, ctx.peer_id[-8:])
            return AvgGroup(status="redirect", redirect=lobby.defer_to or self.avg.peer_id)
        lobby = self.lobbies.get(req.round_key)
        if lobby is None and req.round_key not in self.closed_keys and len(self.key_started) < MAX_EARLY_KEYS:
            # a peer that predicted us as leader may be a few ms ahead of our own call for this
            # key: wait a little rather than send it looking for another leader
            started = self.key_started.setdefault(req.round_key, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started.wait(), timeout=self.config.early_join_wait_s)
            lobby = self.lobbies.get(req.round_key)
            if lobby is None and self.key_started.get(req.round_key) is started:
                del self.key_started[req.round_key]
        if lobby is None:
            if req.round_key in self.closed_keys:
                opened = self.closed_opened.pop(req.round_key, None)
                if opened is not None:  # a join after our round was over: how late it is, measured
                    self.arrivals.arrived(ctx.peer_id, time.monotonic() - opened)
                if req.round_key in self.no_group:  # nobody averaged it with us: the joiner's search goes on
                    return AvgGroup(status="closed", reason=GAVE_UP)
                return AvgGroup(status="closed", reason=OVER_HERE)
            return AvgGroup(status="closed", reason=NOT_HERE)
        if lobby.mode != "follower" and ctx.peer_id not in lobby.measured:
            lobby.measured.add(ctx.peer_id)
            self.arrivals.arrived(ctx.peer_id, time.monotonic() - lobby.opened)
        answer = lobby.answer(ctx.peer_id, req)
        if answer is not None:
            return answer
        fut = asyncio.get_running_loop().create_future()
        lobby.admit(ctx.peer_id, req, fut)
        try:
            answer = await asyncio.wait_for(asyncio.shield(fut), timeout=lobby.window + self.config.decision_grace_s)
        except TimeoutError:
            lobby.pending.pop(ctx.peer_id, None)
            return AvgGroup(status="closed", reason="the leader did not form a group in time")
        if answer.status == "group" and self.joins_to_lose > 0:  # fault injection: the answer never arrives
            self.joins_to_lose -= 1
            raise ConnectionError("fault injection: join reply lost")
        return answer

    def forget_key(self, key: str) -> None:
        """The round of `key` is over here: joins for it are told so (for ten minutes)."""
        lobby = self.lobbies.pop(key, None)
        now = time.monotonic()
        self.closed_keys[key] = now
        if lobby is not None and lobby.group is None:
            self.no_group.add(key)  # we averaged it with nobody: a late joiner should look elsewhere
        if lobby is not None and lobby.mode == "closed":  # we led it: a late join is measured
            self.closed_opened[key] = lobby.opened
        for k, t in list(self.closed_keys.items()):
            if now - t > 600:
                del self.closed_keys[k]
                self.no_group.discard(k)
                self.closed_opened.pop(k, None)
