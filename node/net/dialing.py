"""The dialing side of a transport (node/net/transport.py): how a stream to a peer is opened.

`Dialer.open_stream` opens a libp2p stream, with companions beside an open that hangs and
through the relays a peer behind a NAT announced (node/net/relay.py); before it dials a peer
that stopped answering, a plain TCP connect checks the route (`check_route`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import weakref
from typing import TYPE_CHECKING

from protocol.records import RelayHello

from . import relay
from .host import PeerUnreachable
from .streams import close, close_if_opened

if TYPE_CHECKING:
    from .transport import Transport

ROUTE_CHECK_S = 1.0  # a plain TCP connect's wait, before dialing a peer whose connections we dropped (see check_route)
ROUTE_FALLBACK_S = 10.0  # libp2p dials it anyway this often (its direct address may be what is broken)
OPEN_AGAIN_S = 0.5  # a libp2p stream open still pending after this gets a companion (see open_stream)
OPEN_ATTEMPTS = 3
RELAY_FIRST_S = 60.0  # after an open a relay won, opens to that peer try the relay at once for this long


class Dialer:
    """Opens a transport's streams to its peers, and remembers what it learned of the way there."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.reached: dict[str, tuple[str, int]] = {}  # peer -> the TCP address a direct pipe of ours reached it at
        self.dropped: dict[str, float] = {}  # peer -> when a call to it timed out or `reset` dropped our connections to it
        self._dialed: dict[str, float] = {}  # peer -> when check_route last let a libp2p dial through untested
        self._via_relay: dict[str, tuple[str, float]] = {}  # peer -> (relay, when) of the last open to it a relay won
        self.relayed: weakref.WeakSet[asyncio.StreamWriter] = weakref.WeakSet()  # the streams we opened that a relay carries (their traffic's plane)

    def mark_dropped(self, peer_id: str) -> None:
        """A call to the peer timed out, or our connections to it were dropped: its next
        stream checks the route first (see check_route)."""
        self.dropped.setdefault(peer_id, time.monotonic())

    async def open_stream(self, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A libp2p stream to the peer. An open still pending after OPEN_AGAIN_S gets a second
        one beside it (and a third), the first to succeed wins: p2pd's open waits on a dial in
        progress even when the peer has meanwhile connected to us, and a second open takes that
        connection at once (after a link came back, an open hung past its round's deadline while
        the peer had connected long before). An open that fails is not retried here."""
        host, stats = self.transport.host, self.transport.stats
        await self.check_route(peer_id)
        loop = asyncio.get_running_loop()
        # a peer that announced relays (node/net/relay.py): after the first open, through each of them;
        # at once beside it, through the relay that carried the last open, should one have
        # (a dial towards a NAT hangs rather than fails: each open would wait OPEN_AGAIN_S)
        relays = [r for r in host.routes.get(peer_id, ()) if r != self.transport.peer_id]
        last = self._via_relay.get(peer_id)
        at_once = last is not None and last[0] in relays and time.monotonic() - last[1] < RELAY_FIRST_S
        if at_once:
            relays.remove(last[0])
            relays.insert(0, last[0])
        if relays:
            openers = [(r, functools.partial(self._open_relayed, r, peer_id, protocol)) for r in relays]
        else:
            openers = [("", functools.partial(host.open_stream, peer_id, protocol))] * (OPEN_ATTEMPTS - 1)
        attempts = [loop.create_task(host.open_stream(peer_id, protocol))]
        through: dict[asyncio.Task, str] = {}  # relayed attempts -> their relay

        def another() -> None:
            relay_id, opener = openers.pop(0)
            stats["opens_again" if not relays else "relay_opens"] += 1
            attempts.append(task := loop.create_task(opener()))
            if relay_id:
                through[task] = relay_id

        if at_once:
            another()
        errors: list[BaseException] = []
        winner = None
        try:
            while True:
                done, _ = await asyncio.wait(attempts, timeout=OPEN_AGAIN_S, return_when=asyncio.FIRST_COMPLETED)
                if winner := next((t for t in done if t.exception() is None), None):
                    if winner in through:
                        self._via_relay[peer_id] = (through[winner], time.monotonic())
                        self.relayed.add(winner.result()[1])
                    elif relays:
                        self._via_relay.pop(peer_id, None)  # it is reachable without a relay now
                    return winner.result()
                errors += [t.exception() for t in done]
                attempts = [t for t in attempts if not t.done()]
                if not attempts and (not relays or not openers):
                    raise errors[-1] if relays else errors[0]  # every open failed (none is pending)
                if openers:  # beside a pending open; through a relay also after a failed one
                    another()
        finally:
            for t in attempts:
                if t is winner:
                    continue
                if t.done():
                    close_if_opened(t)
                else:
                    t.cancel()
                    t.add_done_callback(close_if_opened)

    async def check_route(self, peer_id: str) -> None:
        """Before libp2p dials a peer that stopped answering (a call to it timed out, or `reset`
        dropped our connections to it: frozen, or a link down), a plain TCP connect to where a direct pipe reached it tells
        whether the network carries anything to it yet; if not, PeerUnreachable without a dial.
        go-libp2p refuses to redial an address for 5 s after a failed dial (longer after each
        further failure): a cut-off peer's first dial as its link came back, before ARP had
        resolved, cost it seconds of rounds after the network carried packets again. A
        frozen peer's kernel still accepts connections, so this lets its dials through at once.
        Once the peer is heard from, or every ROUTE_FALLBACK_S since it stopped answering,
        libp2p dials untested."""
        since, addr = self.dropped.get(peer_id), self.reached.get(peer_id)
        if since is None or addr is None:
            return
        if self.transport.heard.get(peer_id, 0.0) > since:
            self.dropped.pop(peer_id, None)
            return
        now = time.monotonic()
        if now - max(since, self._dialed.get(peer_id, since)) >= ROUTE_FALLBACK_S:  # (an untested dial of an earlier silence does not count)
            self._dialed[peer_id] = now
            return
        try:
            async with asyncio.timeout(ROUTE_CHECK_S):
                _, writer = await asyncio.open_connection(*addr)
            close(writer)
        except (OSError, TimeoutError) as e:
            self.transport.stats["route_checks_failed"] += 1
            raise PeerUnreachable(f"no route to {peer_id[-8:]} at {addr[0]}:{addr[1]} yet ({e or 'no answer'}); not dialing it through libp2p") from None
        self.dropped.pop(peer_id, None)  # (calls checking together: each may get here)

    async def _open_relayed(self, relay_id: str, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `peer_id` through the relay `relay_id` (see node/net/relay.py). Should the
        relay not reach the peer, it answers with an Error frame: the call fails as refused."""
        t = self.transport
        if t.gate is not None and t.gate.credential:
            await t.presenter.present(relay_id, None)  # a relay serves members only
        hello = RelayHello(t.host.config.swarm_id, t.peer_id, peer_id, protocol, time.time(), os.urandom(16)).sign(t.host.key)
        reader, writer = await t.host.open_stream(relay_id, relay.HOP_PROTOCOL)
        try:
            writer.write(relay.frame_hello(hello.to_bytes()))
            await writer.drain()
        except (ConnectionError, OSError) as e:
            close(writer)
            raise PeerUnreachable(f"relay {relay_id} dropped the stream to {peer_id}: {e}") from None
        return reader, writer
