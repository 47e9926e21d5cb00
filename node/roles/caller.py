"""A role's calls to the peers serving slots of the model (a trainer's to stage servers and expert
hosts): which peer to call, how long to wait for it, what a failure costs it.

    SlotPeers    pure bookkeeping, clock passed in: the pick by expected completion time, deadlines
                 from measured call times, backoff after failures
    PeerCaller   the calls themselves: a deadline on every one, the reply checked before it is
                 used, bytes counted; `call_any` retries on other peers of the slot
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from protocol import Message, RemoteProtocolError

from ..net.transport import NETWORK_ERRORS, RemoteError

log = logging.getLogger(__name__)

T = TypeVar("T")
NO_PEER_WAIT_S = 0.2  # while no peer of a slot can be called: a peer's ban ends, or the DHT names a new one
REFUSALS_TO_GIVE_UP = 3  # peers that refuse what we send as bad input before it is ours to fix


class NoSlotPeer(Exception):
    """No peer serves a slot (yet), or every one of them is left alone for its backoff."""


@dataclass
class PeerStats:
    ema_s: float | None = None  # smoothed seconds per call
    inflight: int = 0
    banned_until: float = 0.0
    backoff_s: float = 0.0
    failures: int = 0
    last_pick: float | None = None  # when it was last chosen (monotonic)


class SlotPeers:
    """Which peer to call for a slot, and how long to wait for it. Pure bookkeeping, clock passed in.

    The pick is by expected completion time: a peer's smoothed call time times the calls it
    would then have in flight from us; a peer never measured counts as instant, so new peers are
    tried at once. A measured peer not chosen for `reprobe_s` (its smoothed time, once slow, would
    keep it out for good: it measured slow while it started, say) gets the next call, when none
    is in flight to it: its time stays current, and so does the rate the planner sees for it. A
    failed or timed-out peer is left alone for a backoff (1 s, doubling per failure in a row, at
    most `max_backoff_s`); a success clears it. The deadline of a call is `timeout_factor` times
    the peer's smoothed call time, at least `min_timeout_s`. A peer in `shunned(now)` (the
    transport's bans: a peer caught lying, say) is never picked."""

    def __init__(self, min_timeout_s: float = 2.0, first_timeout_s: float = 10.0, timeout_factor: float = 8.0, max_backoff_s: float = 30.0, reprobe_s: float = 5.0,
                 shunned: Callable[[float], set[str]] = lambda now: set()):  # fmt: skip
        self.min_timeout_s, self.first_timeout_s, self.timeout_factor, self.max_backoff_s = min_timeout_s, first_timeout_s, timeout_factor, max_backoff_s
        self.reprobe_s, self.shunned = reprobe_s, shunned
        self.slots: dict[int, list[str]] = {}
        self.peers: dict[str, PeerStats] = {}
        self.announced: dict[str, float] = {}  # the load a peer announced in its record: breaks ties between peers never measured

    def update(self, slots: dict[int, list[str]]) -> None:
        self.slots = {s: sorted(ps) for s, ps in slots.items()}
        for ps in self.slots.values():
            for p in ps:
                self.peers.setdefault(p, PeerStats())

    def choose(self, slot: int, now: float, avoid: Iterable[str] = frozenset(), what: str = "stage") -> str:
        """The peer to call; NoSlotPeer if none serves the slot or all are banned."""
        shunned = self.shunned(now)
        candidates = [p for p in self.slots.get(slot, ()) if self.peers[p].banned_until <= now and p not in shunned]
        if not candidates:
            raise NoSlotPeer(f"no peer serves {what} {slot}" if not self.slots.get(slot) else f"every peer of {what} {slot} failed lately")
        avoid = set(avoid)
        fresh = [p for p in candidates if p not in avoid] or candidates

        def expected(p: str) -> tuple[float, float, float]:
            st = self.peers[p]
            return ((st.ema_s or 0.0) * (st.inflight + 1), self.announced.get(p, 0.0), random.random())

        def unpicked_for(p: str) -> float:
            st = self.peers[p]
            return -1.0 if st.last_pick is None or st.inflight else now - st.last_pick

        stalest = max(fresh, key=unpicked_for)
        peer = stalest if unpicked_for(stalest) > self.reprobe_s else min(fresh, key=expected)
        self.peers[peer].last_pick = now
        return peer

    def callable(self, slot: int, now: float) -> bool:
        """Whether some peer of the slot can be called now."""
        shunned = self.shunned(now)
        return any(self.peers[p].banned_until <= now and p not in shunned for p in self.slots.get(slot, ()))

    def timeout(self, peer: str) -> float:
        st = self.peers[peer]
        if st.ema_s is None:
            return self.first_timeout_s
        return max(self.min_timeout_s, self.timeout_factor * st.ema_s)

    def succeeded(self, peer: str, seconds: float) -> None:
        st = self.peers[peer]
        st.ema_s = seconds if st.ema_s is None else 0.8 * st.ema_s + 0.2 * seconds
        st.backoff_s, st.failures = 0.0, 0

    def failed(self, peer: str, now: float) -> float:
        """Ban the peer for its backoff; returns the ban's length. Calls that were in flight
        together and fail together (a peer that froze) count as one failure."""
        st = self.peers[peer]
        if st.banned_until > now:
            return st.banned_until - now
        st.failures += 1
        st.backoff_s = min(self.max_backoff_s, max(1.0, st.backoff_s * 2))
        st.banned_until = now + st.backoff_s
        return st.backoff_s


class CallFailed(Exception):
    """A call to `peer` failed: it is dead, unreachable, late, refused (`code`), or answered
    something that does not check out. `reason` says which, in a line."""

    def __init__(self, peer: str, reason: str, code: str = "", message: str = ""):
        super().__init__(reason)
        self.peer, self.reason, self.code, self.message = peer, reason, code, message or reason

    @property
    def refused(self) -> bool:
        """The peer refused what we sent as bad input: ours to fix if several do."""
        return self.code == "bad_request"


class GiveUp(Exception):
    """Peers keep refusing what we send: it is ours to fix, retrying elsewhere will not help."""


class PeerCaller:
    """Calls to the peers of `peers`' slots, on kept-open pipes."""

    def __init__(self, transport, peers: SlotPeers | None = None):
        self.transport = transport
        self.peers = peers or SlotPeers(shunned=transport.scores.banned_now)
        self.bytes_sent = self.bytes_received = 0
        self.retries = 0  # calls that failed and went to another peer (call_any)

    async def call(self, peer: str, request: Message, check: Callable[[Message], T], *, timeout: float | None = None,
                   timed: bool = True, route: tuple[str, ...] = ()) -> T:  # fmt: skip
        """`check(reply)`, the reply to `request` from `peer` (CallFailed if the call or the check
        fails; `check` raises RemoteProtocolError naming what is wrong). The deadline is the
        peer's (`SlotPeers.timeout`) unless given; `timed` (a call that does the peer's usual
        work) feeds its time back. The peers of `route` (a call that goes on through them)
        count it in flight too."""
        held = route or (peer,)
        for p in held:
            self.peers.peers[p].inflight += 1
        t0 = time.monotonic()
        try:
            reply = await self.transport.send(peer, request, timeout=self.peers.timeout(peer) if timeout is None else timeout, reuse=True)
            result = check(reply)
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:
            if isinstance(e, RemoteError):
                raise CallFailed(peer, short(e), e.code, e.message) from None
            raise CallFailed(peer, short(e)) from None
        finally:
            for p in held:
                self.peers.peers[p].inflight -= 1
        if timed:
            self.peers.succeeded(peer, time.monotonic() - t0)
        self.bytes_sent += len(request.data)
        self.bytes_received += len(reply.data)
        return result

    def fail(self, peer: str) -> float:
        """Leave `peer` alone for its backoff; the ban's length."""
        return self.peers.failed(peer, time.monotonic())

    async def call_any(self, slot: int, request: Message, check: Callable[[Message], T], what: str) -> tuple[T, str]:
        """(checked reply, peer): the call to a peer of `slot`, retried on the others until one
        answers well. GiveUp once REFUSALS_TO_GIVE_UP peers refused it as bad input."""
        refused: list[str] = []
        tried: set[str] = set()
        while True:
            try:
                peer = self.peers.choose(slot, time.monotonic(), tried)
            except NoSlotPeer:
                await asyncio.sleep(NO_PEER_WAIT_S)
                continue
            try:
                return await self.call(peer, request, check), peer
            except CallFailed as e:
                tried.add(peer)
                ban = self.fail(peer)
                self.retries += 1
                log.info("%s on %s failed (%s); retrying elsewhere, %s left alone for %.0f s", what, peer[-8:], e.reason, peer[-8:], ban)
                if e.refused:
                    refused.append(e.message)
                    if len(refused) >= REFUSALS_TO_GIVE_UP:
                        raise GiveUp(f"{what} refused by {REFUSALS_TO_GIVE_UP} peers: {refused[-1]}") from None

    def route(self, slots: int, avoid: Iterable[str]) -> list[str]:
        """One peer per slot 0..slots-1 (NoSlotPeer if a slot has none to call)."""
        now = time.monotonic()
        return [self.peers.choose(s, now, avoid) for s in range(slots)]


def short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 160 else text[:157] + "..."
