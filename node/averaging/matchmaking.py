"""Matchmaking: who averages with whom this round.

Every peer that wants a round key publishes a signed record under it in the DHT and joins the
group of the smallest peer id that wants the same key: that peer leads. A leader that sees a
smaller id later hands its joiners over (a redirect); a joiner follows redirects. The leader
closes its group when the expected peers have joined or its join window ends, and answers every
joiner with the group (members, slice bounds, codec, deadlines). A peer that arrives after the
group closed is told so and waits for the next round.

Two sans-IO state machines hold the decisions, a thin async driver does the I/O:
- `Search` (a peer looking for its leader): which peer to ask next, what an answer or a failure
  means, when to give up. Time comes in as `now`; tests drive it by hand. (joins.py)
- `Lobby` (a key this peer wants, as it looks to joiners): how to answer a join. (joins.py)
- `Matchmaker` (the driver, here): DHT records and look-ups, calls to leaders, leading (one
  lead of a key is a `Leading`, leading.py), serving joins. `Probes` (probes.py) pings the
  peers a leader or a round waits on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection

from protocol import AvgGroup, AvgJoin, LocalProtocolError, RemoteProtocolError, make_codec
from protocol.records import MemberRecord

from ..net.transport import NETWORK_ERRORS, CallContext, CallTimeout, PeerUnreachable
from .config import MAX_EARLY_KEYS, AverageReport, AveragerConfig, RoundFailed
from .decisions import Arrivals, Liveness
from .joins import ASK_AGAIN_S, FORMED, GAVE_UP, LOOK_AGAIN_S, MAX_REDIRECTS, NOT_HERE, OVER_HERE, RETRY_S, Lobby, Next, Search
from .leading import ALONE_ASK_S, Leading
from .probes import Probes

__all__ = [
    "ALONE_ASK_S", "ASK_AGAIN_S", "FORMED", "GAVE_UP", "LOOK_AGAIN_S", "MAX_REDIRECTS", "NOT_HERE", "OVER_HERE", "RETRY_S",
    "SILENT_FOR_S", "Leading", "Lobby", "Matchmaker", "Next", "Probes", "Search",
]  # fmt: skip

log = logging.getLogger(__name__)

SILENT_FOR_S = 20.0  # a peer that went silent on us is not waited for this long (unless it joins or answers a probe again): about until its DHT record is stale


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
        # a peer silent on us lately, or banned here (its calls are refused: it cannot join us,
        # and we follow no group it leads), is neither led by nor waited for
        search = Search(me, key, deadline, self.last_members, self.recently_silent() | self.banned())
        step = search.next()
        while True:
            if step.wait_s:
                await asyncio.sleep(step.wait_s)
            log.debug("matchmaking %s: %s %s%s", key, step.action, step.target[-8:], " (predicted)" if search.predicted else "")
            if step.action == "lookup":
                step = search.found(await self.candidates(key))
            elif step.action == "lead":
                lobby.mode = "leader"
                smaller = await Leading(self, lobby, join, deadline, expected, search.excluded).run()
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

    def banned(self) -> set[str]:
        """Peers our transport refuses now (node/net/rpc.py `PeerScores`: bad input, or evidence of lies)."""
        return self.avg.transport.scores.banned_now(time.monotonic())

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
        """Peers whose valid record says they want this key (none banned here)."""
        raw = await self.avg.host.dht_get(self.dht_key(key))
        out, banned = set(), self.banned()
        if isinstance(raw, dict):
            for subkey, value in raw.items():
                try:
                    rec = MemberRecord.from_bytes(value, self.config.swarm_id)
                except RemoteProtocolError:
                    continue
                if rec.peer_id == subkey and rec.peer_id not in banned:
                    out.add(rec.peer_id)
        return out

    def _check_group(self, g: AvgGroup, numel: int) -> None:
        if self.avg.peer_id not in g.members:
            raise RemoteProtocolError("we are not in the group we were given", "members")
        if g.bounds[-1] != numel:
            raise RemoteProtocolError(f"bounds cover {g.bounds[-1]} elements, we have {numel}", "bounds")
        if g.codec != self.config.codec:
            raise RemoteProtocolError(f"group codec {g.codec} differs from ours ({self.config.codec})", "codec")
        for name, params in ((g.codec, g.codec_params), (g.gather_codec, g.gather_codec_params)):
            try:
                make_codec(name, **params)
            except LocalProtocolError as e:
                raise RemoteProtocolError(f"the group's codec cannot be built: {e}", "codec_params") from None

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
                # we follow it, as if the DHT had shown it to us (see `Leading`)
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
