"""The direct data plane: bulk streams over plain TCP between two nodes, sealed with AES-GCM.

libp2p (p2pd) stays the control plane: identities, the DHT, NAT traversal, relays, every short
call. Bulk pipes (`Transport.send(..., reuse=True)`: tensor parts) go direct when the peer can
be reached, because every byte through p2pd crosses two daemons and two unix sockets: the
daemons' CPU and the streams' flow control cost rounds time (bench/RESULTS.md, allreduce).

How a direct stream opens (the dialer is the side that wants to send):
1. over libp2p, the dialer sends `DirectOpen(ticket, key)`: 16 and 32 random bytes. libp2p
   encrypts the call and authenticates the dialer, so the listener learns which peer holds
   the key, and nobody else learns the key. The reply is `DirectAddress`: where to connect.
2. the dialer connects, writes the ticket, and from then on both sides write sealed records
   (`protocol/sealing.py`). The listener takes each ticket once, within `TICKET_TTL_S`, and
   confirms with one sealed byte: the dialer then knows it reached the holder of the key.
3. anything wrong (no listener, unreachable address, a bad ticket, a record that fails
   authentication) closes the connection; the dialer then uses a libp2p stream instead, and
   skips the direct attempt for that peer for a while.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
import sys
import time
from typing import Awaitable, Callable

from protocol import RemoteProtocolError
from protocol.sealing import DIALER, LISTENER, Opener, Sealer

log = logging.getLogger(__name__)

TICKET_BYTES = 16
TICKET_TTL_S = 30.0  # a ticket not presented by then is forgotten
HANDSHAKE_S = 5.0  # an accepted connection must present its ticket within this
MAX_TICKETS = 4096  # outstanding, all peers together (the oldest goes first)
MAX_TICKETS_PER_PEER = 64
MAX_HANDSHAKES = 256  # accepted connections that have not shown a ticket yet; beyond, the oldest is closed for the new one
MAX_CONNECTIONS_PER_PEER = 16  # open direct connections from one peer (each holds ~2 MiB of buffers)
ACCEPTED = b"\x01"  # the listener's first (sealed) byte: the ticket was good
STREAM_LIMIT = 1 << 22  # the StreamReader's buffer limit (the frame reader takes reading over)
# The kernel wakes us only when this much of the record we wait for is here (SO_RCVLOWAT; less
# when less is missing). On a slow link bytes trickle in a packet at a time: without it a peer
# spent about 1 CPU-second per 37 MB received at 100 Mbit, in wakeups.
MAX_RCVLOWAT = 64 << 10

# Pacing (SO_MAX_PACING_RATE, Linux): the kernel spaces a socket's packets to a rate, so that
# several flows leaving at once each keep to their share of a link instead of filling its
# queue and fighting over it (TCP paces internally; no qdisc needed)
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47 if sys.platform == "linux" else None)
CAN_PACE = SO_MAX_PACING_RATE is not None
_UNPACED = 0xFFFFFFFF  # the kernel's "no limit"

StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class SealedTransport(asyncio.Transport):
    """An asyncio transport over a TCP transport: what is written is sealed, what is read is
    opened. Protocols on top (a StreamReaderProtocol, the transport's frame reader) see
    plaintext, and flow control passes through both ways."""

    def __init__(self, raw: asyncio.Transport, sealer: Sealer, opener: Opener):
        super().__init__()
        self._raw = raw
        self._sealer = sealer
        self._opener = opener
        self._protocol: asyncio.BaseProtocol | None = None
        self._pending: collections.deque[memoryview] = collections.deque()  # opened, not yet taken in full
        self._paused = False
        self._eof = False  # the peer finished writing (delivered once the pending bytes are)
        self._closing = False

    # -- for the protocol on top ----------------------------------------------------------------

    def write(self, data) -> None:
        self.writelines([data])

    def writelines(self, list_of_data) -> None:
        if self._closing or self._raw.is_closing():
            return
        self._raw.writelines(self._sealer.seal(list_of_data))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self._raw.write_eof()

    def close(self) -> None:
        self._closing = True
        self._raw.close()

    def abort(self) -> None:
        self._closing = True
        self._raw.abort()

    def is_closing(self) -> bool:
        return self._closing or self._raw.is_closing()

    def get_extra_info(self, name, default=None):
        return self._raw.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self.pump()

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[return-value]

    def is_reading(self) -> bool:
        return not self._paused

    def pause_reading(self) -> None:
        if not self._paused:
            self._paused = True
            if not self._raw.is_closing():
                self._raw.pause_reading()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self.pump()
            if not self._paused and not self._raw.is_closing():
                self._raw.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self):
        return self._raw.get_write_buffer_limits()

    # -- from the raw side (its protocol, `_RawProtocol`, calls these) ----------------------------

    def pump(self) -> None:
        """Open the records that are all here and hand them on, while the protocol reads.
        A protocol that reads into its own buffers gets them decrypted right there."""
        p = self._protocol
        try:
            while not self._paused and p is not None:
                if self._pending:
                    self._hand_on(p)
                    continue
                size = self._opener.next_size()
                if size is None:
                    break
                if size and isinstance(p, asyncio.BufferedProtocol):
                    buf = p.get_buffer(size)
                    if len(buf) >= size:
                        self._opener.open_into(buf[:size])
                        p.buffer_updated(size)
                        continue
                self._pending.append(memoryview(self._opener.open()))
        except RemoteProtocolError as e:
            log.debug("direct stream from %s closed: %s", self._raw.get_extra_info("peername"), e)
            self._pending.clear()
            self._raw.abort()
            return
        if self._eof and not self._paused and not self._pending and p is not None:
            if self._opener.buffered:  # the peer stopped inside a record
                log.debug("direct stream from %s ended inside a sealed record", self._raw.get_extra_info("peername"))
                self._raw.abort()
                return
            self._eof = False
            if not p.eof_received():  # type: ignore[attr-defined]
                self.close()

    def _hand_on(self, p: asyncio.BaseProtocol) -> None:
        data = self._pending[0]
        if not data:
            self._pending.popleft()
        elif isinstance(p, asyncio.BufferedProtocol):
            buf = p.get_buffer(len(data))
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            if n == len(data):
                self._pending.popleft()
            else:
                self._pending[0] = data[n:]
            p.buffer_updated(n)
        else:
            self._pending.popleft()
            p.data_received(bytes(data))  # type: ignore[attr-defined]

    def raw_eof(self) -> None:
        """The peer finished writing; the protocol on top hears of it after the pending bytes."""
        self._eof = True
        self.pump()

    def raw_lost(self, exc: Exception | None) -> None:
        """The TCP connection is gone."""
        self._closing = True
        if self._protocol is not None:
            self._protocol.connection_lost(exc)


class _RawProtocol(asyncio.BufferedProtocol):
    """The TCP side of a direct connection. A listener's first reads the ticket (exactly
    TICKET_BYTES); after that, bytes land in the opener's buffer and the SealedTransport opens
    and hands them on."""

    def __init__(self, on_ticket: Callable[[_RawProtocol, bytes], None] | None = None):
        self.transport: asyncio.Transport | None = None
        self.born = time.monotonic()
        self.sealed: SealedTransport | None = None
        self.opener: Opener | None = None
        self._on_ticket = on_ticket
        self._ticket = bytearray(TICKET_BYTES)
        self._got = 0
        self._timer: asyncio.TimerHandle | None = None
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._sock = transport.get_extra_info("socket") if hasattr(socket, "SO_RCVLOWAT") else None
        self._lowat = 1
        if self._on_ticket is not None:
            self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_S, transport.abort)

    def start(self, opener: Opener, sealed: SealedTransport) -> None:
        self.opener, self.sealed = opener, sealed
        if self._timer is not None:
            self._timer.cancel()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.opener is None:  # a listener, before the ticket: no more than the ticket
            return memoryview(self._ticket)[self._got :]
        return self.opener.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.opener is not None:
            self.opener.buffer_updated(nbytes)
            self.sealed.pump()
            self._set_lowat(min(self.opener.missing(), MAX_RCVLOWAT))
            return
        self._got += nbytes
        if self._got < TICKET_BYTES:
            return
        if self._on_ticket is not None:
            self._on_ticket(self, bytes(self._ticket))
        if self.opener is None:  # refused (or a dialer's peer spoke first: never valid)
            self.transport.abort()

    def _set_lowat(self, lowat: int) -> None:
        if lowat == self._lowat or self._sock is None:
            return
        self._lowat = lowat
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
        except OSError:  # not everywhere: then every packet wakes us, as without it
            self._sock = None

    def eof_received(self) -> bool:
        if self.sealed is not None:
            self.sealed.raw_eof()
        return True  # half-open: our replies may still be on their way

    def pause_writing(self) -> None:
        p = self.sealed.get_protocol() if self.sealed is not None else None
        if p is not None:
            p.pause_writing()

    def resume_writing(self) -> None:
        p = self.sealed.get_protocol() if self.sealed is not None else None
        if p is not None:
            p.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.sealed is not None:
            self.sealed.raw_lost(exc)
        if not self.lost.done():
            self.lost.set_result(exc)


def _streams(raw: _RawProtocol, key: bytes, dialer: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    opener = Opener(key, LISTENER if dialer else DIALER)
    sealed = SealedTransport(raw.transport, Sealer(key, DIALER if dialer else LISTENER), opener)
    reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
    proto = asyncio.StreamReaderProtocol(reader, loop=loop)
    sealed.set_protocol(proto)
    proto.connection_made(sealed)
    raw.start(opener, sealed)
    return reader, asyncio.StreamWriter(sealed, proto, reader, loop)


def _tune(transport: asyncio.Transport, congestion: str | None) -> None:
    """Best effort: the congestion control asked for (a kernel may not allow it: then its default)."""
    if congestion and hasattr(socket, "TCP_CONGESTION"):
        _setsockopt(transport, socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())


def set_pacing(transport: asyncio.BaseTransport, rate: int) -> None:
    """Best effort: pace a direct stream's socket to `rate` bytes/s (0: no limit)."""
    if CAN_PACE:  # a u32: the kernel's "no limit" does not fit a C int
        _setsockopt(transport, socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", min(int(rate), _UNPACED - 1) if rate > 0 else _UNPACED))


def _setsockopt(transport: asyncio.BaseTransport, level: int, option: int, value: bytes) -> None:
    """Set an option on a transport's socket where it has one and the kernel takes it."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


class DirectListener:
    """Accepts direct connections that present a ticket we issued, and serves each as a stream
    from the peer the ticket was issued to."""

    def __init__(self, handler: StreamHandler, congestion: str | None = None):
        self.handler = handler
        self.congestion = congestion
        self.port = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._tickets: collections.OrderedDict[bytes, tuple[str, bytes, float]] = collections.OrderedDict()
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()
        self._raws: set[_RawProtocol] = set()
        self._open: collections.Counter[str] = collections.Counter()  # peer -> open direct connections
        self.accepted = 0

    async def start(self, hosts: list[str], port: int = 0) -> None:
        """Listen on each of `hosts` (all on one port: the first bind picks it when `port` is 0)."""
        loop = asyncio.get_running_loop()
        for host in hosts:
            server = await loop.create_server(self._make_protocol, host, port or self.port, reuse_address=True)
            self._servers.append(server)
            self.port = server.sockets[0].getsockname()[1]

    def _make_protocol(self) -> _RawProtocol:
        """A connection that has not shown its ticket waits at most HANDSHAKE_S; beyond
        MAX_HANDSHAKES of them, the oldest is closed for the new one. An honest dialer writes its
        ticket as soon as it is connected: a flood of silent connections (slowloris) pushes out
        its own; refusing newcomers instead would refuse every honest dialer while it lasts."""
        waiting = [r for r in self._raws if r.opener is None and r.transport is not None and not r.transport.is_closing()]
        if len(waiting) >= MAX_HANDSHAKES:
            min(waiting, key=lambda r: r.born).transport.abort()
        raw = _RawProtocol(on_ticket=self._take)
        self._raws.add(raw)
        raw.lost.add_done_callback(lambda _: self._raws.discard(raw))
        return raw

    def issue(self, peer_id: str, ticket: bytes, key: bytes) -> None:
        self._expire()
        if self._per_peer[peer_id] >= MAX_TICKETS_PER_PEER:
            raise OverflowError(f"more than {MAX_TICKETS_PER_PEER} direct tickets outstanding")
        if ticket in self._tickets:
            raise ValueError("ticket already issued")
        while len(self._tickets) >= MAX_TICKETS:
            self._drop(next(iter(self._tickets)))
        self._tickets[ticket] = (peer_id, bytes(key), time.monotonic() + TICKET_TTL_S)
        self._per_peer[peer_id] += 1

    def _closed(self, peer_id: str) -> None:
        self._open[peer_id] -= 1
        if self._open[peer_id] <= 0:
            del self._open[peer_id]

    def _drop(self, ticket: bytes) -> tuple[str, bytes, float]:
        entry = self._tickets.pop(ticket)
        self._per_peer[entry[0]] -= 1
        if not self._per_peer[entry[0]]:
            del self._per_peer[entry[0]]
        return entry

    def _expire(self) -> None:
        now = time.monotonic()
        while self._tickets and next(iter(self._tickets.values()))[2] < now:
            self._drop(next(iter(self._tickets)))

    def _take(self, raw: _RawProtocol, ticket: bytes) -> None:
        self._expire()
        if ticket not in self._tickets:
            log.debug("direct connection from %s: unknown ticket", raw.transport.get_extra_info("peername"))
            return
        peer_id, key, _ = self._drop(ticket)
        if self._open[peer_id] >= MAX_CONNECTIONS_PER_PEER:
            log.debug("direct connection from %s refused: %d open already", peer_id, self._open[peer_id])
            return
        self._open[peer_id] += 1
        raw.lost.add_done_callback(lambda _: self._closed(peer_id))
        _tune(raw.transport, self.congestion)
        reader, writer = _streams(raw, key, dialer=False)
        writer.write(ACCEPTED)  # sealed: it also shows the dialer it reached the key's holder
        self.accepted += 1
        task = asyncio.get_running_loop().create_task(self._serve(peer_id, reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.handler(peer_id, reader, writer)
        except asyncio.CancelledError:
            writer.close()
        except Exception:  # the handler answers its own errors; this is a bug, logged, not fatal
            log.exception("direct stream handler failed for %s", peer_id)
            writer.close()

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for raw in list(self._raws):
            if raw.transport is not None:
                raw.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)
        self._servers.clear()
        self._tickets.clear()
        self._per_peer.clear()


async def dial(addrs: list[str], ticket: bytes, key: bytes, timeout: float, congestion: str | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the first of `addrs` that answers within `timeout` (shared), present the
    ticket, and return the sealed stream. OSError if none answers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    errors = []
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            async with asyncio.timeout(left):
                transport, raw = await loop.create_connection(_RawProtocol, host.strip("[]"), int(port))
        except (OSError, TimeoutError, ValueError) as e:
            errors.append(f"{addr}: {e or type(e).__name__}")
            continue
        _tune(transport, congestion)
        transport.write(ticket)
        reader, writer = _streams(raw, key, dialer=True)
        try:
            async with asyncio.timeout(max(deadline - loop.time(), 0.5)):
                if await reader.readexactly(len(ACCEPTED)) == ACCEPTED:
                    return reader, writer
            errors.append(f"{addr}: not accepted")
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
            errors.append(f"{addr}: ticket not accepted ({type(e).__name__})")
        writer.close()
    raise OSError(f"no direct address answered ({'; '.join(errors) or ('no time left' if addrs else 'none given')})")
