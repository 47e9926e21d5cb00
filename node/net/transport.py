"""RPC over libp2p binary streams, framed by `protocol/`.

One libp2p stream per call. The first frame on a stream is the request; what follows depends on
the call's shape, which both sides know from the method used:

- unary (`call`): one request, one reply, the server closes the stream;
- server streaming (`stream`): one request, replies until the server closes the stream;
- client streaming (`send`): a request followed by more frames the handler reads with
  `ctx.receive()`, one reply.

Bulk calls (`send(..., reuse=True)`) go on pipes: streams kept open between calls, over direct
TCP sealed with AES-GCM where the peer can be reached (`node/net/direct.py`), else over libp2p.
A peer that cannot be dialed (behind a NAT) and announced relays is reached through one of them
(`node/net/relay.py`): the stream is the same, the relay copies its bytes.

A reply of type `Error` ends any call and raises `RemoteError` at the caller. Every call has a
deadline. Per peer, the server caps concurrent calls and bytes in flight. A peer whose frames
are malformed gets an `Error(bad_request)` reply naming the problem, a lower score, and a ban
after repeated offences; it is logged once, and everyone else keeps being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from protocol import Decoder, DirectAddress, DirectOpen, Error, MemberProof, Message, Ping, Pong, Probe, RemoteProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, encode_buffers
from protocol.messages import ERROR_CODES
from protocol.records import RelayHello
from protocol.sealing import KEY_BYTES

from . import compat, direct, relay
from .host import Host, HostError, PeerUnreachable, tcp_ip4s

log = logging.getLogger(__name__)

RPC_PROTOCOL = "/swarmtrain/rpc/1"
PIPE_PROTOCOL = "/swarmtrain/pipe/1"  # calls one after another on a stream kept open (`send(..., reuse=True)`)
ROUTE_CHECK_S = 1.0  # a plain TCP connect's wait, before dialing a peer whose connections we dropped (see _check_route)
ROUTE_FALLBACK_S = 10.0  # libp2p dials it anyway this often (its direct address may be what is broken)
OPEN_AGAIN_S = 0.5  # a libp2p stream open still pending after this gets a companion (see _open_stream)
OPEN_ATTEMPTS = 3
RELAY_STREAMS_PER_PEER = 128  # streams a relay carries for one caller at once (pipes stay open between calls)
RELAY_FIRST_S = 60.0  # after an open a relay won, opens to that peer try the relay at once for this long
LINGER_BYTES = 16 << 20  # what a refused caller may still send us before we close on it


class RPCError(Exception):
    """Raised by a handler to refuse a request with a specific error code."""

    def __init__(self, code: str, message: str):
        if code not in ERROR_CODES:  # an Error frame cannot carry it: the caller would get no reply at all
            raise ValueError(f"RPCError code {code!r} is not one of {', '.join(ERROR_CODES)}")
        super().__init__(message)
        self.code, self.message = code, message


class RemoteError(Exception):
    """The peer answered with an Error frame."""

    def __init__(self, peer_id: str, code: str, message: str):
        super().__init__(f"{peer_id[-8:]} refused: {code}: {message}")
        self.peer_id, self.code, self.message = peer_id, code, message


class CallTimeout(Exception):
    """A call passed its deadline."""


class HandlerTaken(Exception):
    """Our bug: a second service tried to take a message type another one serves."""


# What a call to another peer can raise when the peer, or the way to it, fails: it is dead or
# unreachable, it passed the deadline, it refused, or it sent bytes that broke the protocol.
# One definition for every caller that treats "the peer failed" alike.
NETWORK_ERRORS: tuple[type[BaseException], ...] = (PeerUnreachable, CallTimeout, RemoteError, ConnectionError, RemoteProtocolError, OSError)


@dataclass(frozen=True)
class TransportConfig:
    call_timeout_s: float = 10.0  # default deadline of an outgoing call
    handler_timeout_s: float = 120.0  # longest a handler may run before the caller is told "timeout"
    request_read_timeout_s: float = 30.0  # a peer must deliver each frame of a request within this
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE  # bytes; larger frames are refused from their prefix
    max_concurrent_per_peer: int = 32  # calls one peer may have open with us at once
    max_bytes_in_flight_per_peer: int = 256 << 20  # request bytes of one peer held in our memory at once (received, not yet handled)
    ban_score: float = -10.0  # a peer at or below this score is refused for `ban_s`
    ban_s: float = 60.0  # first ban; doubles with each further ban
    # a peer's score is minus its penalties of the last `score_window_s`: it recovers with time,
    # never with calls (a peer that sends bad input cannot wash its score with cheap valid calls)
    score_window_s: float = 600.0
    # a served stream stays open after its last reply until the caller hangs up, at most this
    # long. p2pd ends a stream with close-then-reset, and a reset that overtakes the reply
    # between the two daemons throws the reply (or its end) away: on a busy machine, about one
    # call in a thousand; once the caller has hung up, it has read everything
    linger_s: float = 5.0
    pipe_idle_s: float = 300.0  # a pipe with no call for this long is closed (by the server; callers reuse one for half of it)
    pipes_per_peer: int = 4  # idle pipes kept open to one peer
    # pipes go over direct TCP (sealed, see node/net/direct.py) where the peer can be reached, else
    # over libp2p. The listener binds the IPv4 addresses of the host's host_maddrs; behind a
    # port-forwarding NAT, forward `direct_port` too (0: any free port)
    direct: bool = True
    direct_port: int = 0
    direct_connect_s: float = 2.0  # the whole direct attempt: ticket call, connect, confirmation
    direct_retry_s: float = 300.0  # after a failed attempt, that peer's pipes use libp2p this long
    # congestion control of direct connections, where the kernel allows it (else its default).
    # Measured with 4 peers averaging 25 MB on 100 Mbit token-bucket links (50 ms queue): with
    # BBR rounds took 1.40-1.46x the bandwidth bound, with CUBIC 1.12-1.23x
    direct_congestion: str | None = "cubic"
    # serve relay hops (node/net/relay.py): carry streams to peers that keep a connection to us for
    # callers that cannot dial them (members only, in an owned swarm)
    relay_service: bool = False


@dataclass
class _PeerState:
    penalties: deque[tuple[float, float]] = field(default_factory=deque)  # (when, amount), within the score window
    active: int = 0
    bytes_in_flight: int = 0
    banned_until: float = 0.0
    bans: int = 0
    last_logged: float = -1e9


class PeerScores:
    """Scores peers by their behaviour; bans the repeat offenders with exponential backoff."""

    def __init__(self, config: TransportConfig):
        self.config = config
        self.peers: dict[str, _PeerState] = defaultdict(_PeerState)

    def penalize(self, peer_id: str, amount: float, now: float) -> None:
        st = self.peers[peer_id]
        st.penalties.append((now, amount))
        if self._score(st, now) <= self.config.ban_score:
            st.banned_until = now + self.config.ban_s * (2**st.bans)
            st.bans += 1
            st.penalties.clear()

    def _score(self, st: _PeerState, now: float) -> float:
        while st.penalties and st.penalties[0][0] <= now - self.config.score_window_s:
            st.penalties.popleft()
        return -sum(amount for _, amount in st.penalties)

    def banned(self, peer_id: str, now: float) -> float:
        """Seconds of ban left (0: not banned)."""
        return max(0.0, self.peers[peer_id].banned_until - now)

    def score(self, peer_id: str, now: float | None = None) -> float:
        """Minus the peer's penalties within the score window (0: none)."""
        return self._score(self.peers[peer_id], time.monotonic() if now is None else now)


class CallContext:
    """What a handler sees of the call: who, the first frame, and further frames on demand."""

    def __init__(self, peer_id: str, request: Message, receive: Callable[[], Awaitable[Message]]):
        self.peer_id = peer_id
        self.request = request
        self._receive = receive

    async def receive(self) -> Message:
        """The next frame the caller sent (client-streaming calls)."""
        return await self._receive()


Handler = Callable[[CallContext], Awaitable["Message | AsyncIterator[Message]"]]


class _FrameReader(asyncio.BufferedProtocol):
    """Reads whole messages off a stream through a `Decoder`, taking the stream's reading over
    from its StreamReader: the transport reads straight into the decoder's buffers (a frame's
    body lands in its own buffer, copied once, by the kernel; tensor chunks in the messages are
    views of it). The StreamWriter keeps working: write flow control and connection loss are
    passed on to the stream's own protocol.

    `on_bytes(+n)` is called for bytes read, `on_bytes(-n)` when they are handed on as a
    message: what is counted is what this stream holds in memory right now. Reading pauses
    while a decoded message waits to be taken (at most one frame is read ahead)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_size: int, on_bytes: Callable[[int], None] | None = None):
        self.decoder = Decoder(max_frame_size)
        self.pending: list[tuple[Message, int]] = []  # decoded messages and the bytes they stand for
        self.on_bytes = on_bytes or (lambda n: None)
        self._error: BaseException | None = None
        self._eof = False
        self._lost: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._discard: bytearray | None = None  # after an error: bytes are read and dropped
        self._dropped = 0
        self._transport = writer.transport
        self._inner = self._transport.get_protocol()  # the StreamReaderProtocol the writer relies on
        self._paused = compat.stream_reader_paused(reader)  # it may have paused reading
        leftover = compat.take_stream_reader_buffer(reader)  # what the StreamReader read before we took over
        self._transport.set_protocol(self)
        if reader.exception() is not None:
            self._eof, self._lost = True, reader.exception()
        elif reader.at_eof():
            self._eof = True
        if leftover:
            self._got(len(leftover), lambda: self.decoder.feed(leftover))

    # -- protocol callbacks (the transport calls these) ------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._error is not None:
            if self._discard is None:
                self._discard = bytearray(1 << 16)
            return memoryview(self._discard)
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._error is not None:
            self._dropped += nbytes
            self._wake()
            return
        self._got(nbytes, lambda: self.decoder.buffer_updated(nbytes))

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        self._inner.eof_received()
        return True  # keep the transport open for writing; the reply may still be on its way

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._lost = exc
        self._wake()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- ours -----------------------------------------------------------------------------------

    def _got(self, nbytes: int, decode: Callable[[], list[Message]]) -> None:
        before = self.decoder.buffered
        try:
            self.on_bytes(nbytes)
            msgs = decode()
        except (RemoteProtocolError, RPCError) as e:
            self._error = e
            msgs = []
        if msgs:
            framed = before + nbytes - self.decoder.buffered  # bytes of the frames just decoded
            share, extra = divmod(framed, len(msgs))
            self.pending.extend((m, share + (extra if i == 0 else 0)) for i, m in enumerate(msgs))
            if not self._paused:
                self._paused = True
                self._transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def next(self) -> Message | None:
        """The next message, or None at a clean end of stream."""
        while not self.pending:
            if self._error is not None:
                raise self._error
            if self._eof:
                if self._lost is not None:
                    raise ConnectionResetError(f"stream lost: {self._lost}")
                if self.decoder.buffered:  # the sender gave up mid-frame (a cancelled send): a hang-up
                    raise ConnectionResetError(f"stream ended inside a frame ({self.decoder.buffered} bytes)")
                return None
            self._resume()
            await self._wait()
        msg, size = self.pending.pop(0)
        self.on_bytes(-size)
        if not self.pending:
            self._resume()  # read ahead (the end of the stream too) while this one is handled
        return msg

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._transport.resume_reading()

    async def drain(self, seconds: float, max_bytes: int) -> None:
        """Read and drop what the peer still sends, until it stops, `max_bytes` or `seconds`."""
        if self._error is None:
            self._error = RemoteProtocolError("the rest of this stream is dropped", "frame")
        self.pending.clear()
        deadline = time.monotonic() + seconds
        self._resume()
        while not self._eof and self._dropped < max_bytes and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._wait(), left)
            except TimeoutError:
                return


async def _write(writer: asyncio.StreamWriter, msg: Message, max_frame_size: int) -> None:
    writer.writelines(encode_buffers(msg, max_frame_size))  # tensor chunks go out without a copy
    await writer.drain()


def _close_if_opened(task: asyncio.Task) -> None:
    """A losing stream open that succeeded anyway: close its stream."""
    if not task.cancelled() and task.exception() is None:
        _close(task.result()[1])


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # the other side may have gone already; nothing left to release
        pass


@dataclass
class _Pipe:
    """Our end of a pipe (see `Transport._pipe_call`)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    frames: _FrameReader
    next_id: int = 1
    used: float = 0.0
    direct: bool = False  # over direct TCP (can be paced), not a libp2p stream
    pace: int = 0  # the socket's pacing rate now, bytes/s (0: none)


class Registration:
    """A service's handlers on a transport (see `Transport.serve`); `close()` unregisters them.
    Calls already being handled finish; new ones are answered "unsupported"."""

    def __init__(self, transport: Transport, handlers: dict[type[Message], Handler], owner: str):
        self.transport, self.handlers, self.owner = transport, handlers, owner
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport._unserve(self.handlers)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport:
    def __init__(self, host: Host, config: TransportConfig = TransportConfig()):
        self.host = host
        self.config = config
        self.scores = PeerScores(config)
        self.handlers: dict[type[Message], Handler] = {Ping: self._on_ping, Probe: self._on_probe}
        self.stats: dict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task] = set()
        self._pipes: dict[str, list[_Pipe]] = defaultdict(list)  # peer -> idle pipes to it
        self._direct: direct.DirectListener | None = None
        self._direct_addrs: tuple[str, ...] = ()
        self._no_direct: dict[str, float] = {}  # peer -> until when its pipes skip the direct attempt
        self.heard: dict[str, float] = {}  # peer -> when bytes of its calls or replies last came in (monotonic)
        self._reached: dict[str, tuple[str, int]] = {}  # peer -> the TCP address a direct pipe of ours reached it at
        self._dropped: dict[str, float] = {}  # peer -> when a call to it timed out or `reset` dropped our connections to it
        self._dialed: dict[str, float] = {}  # peer -> when _check_route last let a libp2p dial through untested
        self.gate = None  # an owned swarm's MemberGate (node/net/gate.py): who we serve, and the certificate we present
        self._presented: dict[str, bytes] = {}  # peer -> the certificate of ours it accepted
        self._presenting: dict[tuple[str, bytes], asyncio.Future] = {}
        self._nonces = relay.Nonces()  # of the relay hellos we took
        self._hops: dict[str, int] = defaultdict(int)  # caller -> streams we relay for it now
        self._via_relay: dict[str, tuple[str, float]] = {}  # peer -> (relay, when) of the last open to it a relay won

    def use_gate(self, gate) -> None:
        """Serve members only (`gate.check` before every handler but `gate.exempt`'s), and
        present `gate.credential` to every peer before calling it (see node/net/gate.py)."""
        self.gate = gate
        self.on(MemberProof, gate.on_proof)

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    def on(self, msg_type: type[Message], handler: Handler) -> None:
        """Serve `msg_type` with `handler`. Each message type has one owner: a second handler
        for a taken type raises `HandlerTaken` (it would silently steal the first one's calls)."""
        self.serve({msg_type: handler})

    def serve(self, handlers: Mapping[type[Message], Handler], owner: str = "") -> Registration:
        """Register a service's handlers as one group: all of them, or none if any type is
        taken (`HandlerTaken`). `Registration.close()` removes exactly these handlers."""
        taken = [t.__name__ for t in handlers if t in self.handlers]
        if taken:
            raise HandlerTaken(f"{owner or 'a service'} wants {', '.join(taken)}, already served here")
        self.handlers.update(handlers)
        return Registration(self, dict(handlers), owner)

    def _unserve(self, handlers: Mapping[type[Message], Handler]) -> None:
        for msg_type, handler in handlers.items():
            if self.handlers.get(msg_type) is handler:
                del self.handlers[msg_type]

    async def start(self) -> None:
        await self.host.add_stream_handler(RPC_PROTOCOL, self._serve)
        await self.host.add_stream_handler(PIPE_PROTOCOL, self._serve_pipe)
        await self.host.add_stream_handler(relay.RELAYED_PROTOCOL, self._serve_relayed)
        if self.config.relay_service:
            await self.host.add_stream_handler(relay.HOP_PROTOCOL, self._serve_hop)
        ips = self.host.listen_ips() if self.config.direct else []
        if ips:
            self._direct = direct.DirectListener(self._serve_pipe, self.config.direct_congestion)
            try:
                await self._direct.start(ips, self.config.direct_port)
            except OSError as e:
                await self._direct.close()
                self._direct = None
                raise HostError(f"cannot listen for direct connections on {'/'.join(ips)} port {self.config.direct_port}: {os.strerror(e.errno) if e.errno else e}") from None
            self._direct_addrs = await self._announced(self._direct.port)
            self.handlers[DirectOpen] = self._on_direct_open

    async def _announced(self, port: int) -> tuple[str, ...]:
        """Where others reach our direct listener: the IPv4 addresses libp2p announces, on our
        port; loopback last (a peer on another machine that tries it reaches its own)."""
        ips = [ip for ip in tcp_ip4s([m for m in await self.host.visible_maddrs() if relay.CIRCUIT not in m]) if ip != "0.0.0.0"]
        ips.sort(key=lambda ip: ip.startswith("127."))
        return tuple(f"{ip}:{port}" for ip in ips[:16])

    async def _on_direct_open(self, ctx: CallContext) -> Message:
        if self._direct is None:
            raise RPCError("unsupported", "no direct listener here")
        req: DirectOpen = ctx.request
        try:
            self._direct.issue(ctx.peer_id, req.ticket, req.key)
        except OverflowError as e:
            raise RPCError("overloaded", str(e)) from None
        except ValueError as e:
            raise RPCError("bad_request", str(e)) from None
        return DirectAddress(addrs=self._direct_addrs)

    async def _on_ping(self, ctx: CallContext) -> Message:
        return Pong(nonce=ctx.request.nonce, sent_at=ctx.request.sent_at)

    async def _on_probe(self, ctx: CallContext) -> Message:
        return Probe(data=bytes(ctx.request.want))

    # ---- server side ---------------------------------------------------------------------

    async def _serve(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve_calls(peer_id, reader, writer, pipe=False)

    async def _serve_pipe(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve_calls(peer_id, reader, writer, pipe=True)

    def _check_not_banned(self, peer_id: str) -> None:
        """RPCError(unauthorized) while `peer_id` is banned after repeated bad frames."""
        left = self.scores.banned(peer_id, time.monotonic())
        if left:
            raise RPCError("unauthorized", f"banned for {left:.0f} more seconds after repeated bad frames")

    async def _read_hello(self, reader: asyncio.StreamReader) -> tuple[bytes, RelayHello]:
        """The RelayHello a relayed stream starts with: its bytes and the verified record
        (RemoteProtocolError if malformed or forged, ValueError if oversized)."""
        data = await asyncio.wait_for(relay.read_hello(reader), self.config.request_read_timeout_s)
        return data, RelayHello.from_bytes(data, self.host.config.swarm_id)

    async def _serve_hop(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """As a relay: carry `peer_id`'s stream to the target its hello names (node/net/relay.py),
        if the target keeps a connection to us (its pings: we are not a proxy to anyone else)."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        counted = False
        try:
            try:
                self._check_not_banned(peer_id)
                if self._hops[peer_id] >= RELAY_STREAMS_PER_PEER:
                    raise RPCError("overloaded", f"more than {RELAY_STREAMS_PER_PEER} streams relayed for one peer at once")
                self._hops[peer_id] += 1
                counted = True
                data, hello = await self._read_hello(reader)
                if hello.peer_id != peer_id:
                    raise RemoteProtocolError(f"the hello is {hello.peer_id}'s, not the caller's", "RelayHello")
                if hello.target == self.peer_id or hello.protocol not in (RPC_PROTOCOL, PIPE_PROTOCOL):
                    raise RPCError("bad_request", f"cannot relay {hello.protocol!r} to {hello.target}")
                if self.gate is not None:
                    self.gate.check(peer_id)
                if time.monotonic() - self.heard.get(hello.target, -math.inf) > 3 * relay.KEEPALIVE_S:
                    raise RPCError("not_found", f"relay {self.peer_id[-8:]} carries streams only to peers that keep a connection to it; {hello.target} does not")
                try:
                    async with asyncio.timeout(self.config.call_timeout_s):
                        target = await self.host.open_stream(hello.target, relay.RELAYED_PROTOCOL)
                except (PeerUnreachable, TimeoutError) as e:
                    raise RPCError("not_found", f"relay {self.peer_id[-8:]} cannot reach {hello.target}: {e or 'no answer'}") from None
            except (RemoteProtocolError, RPCError, ValueError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
                if isinstance(e, asyncio.IncompleteReadError) and not e.partial:
                    # closed before a byte of its hello: an open the caller gave up (it opens
                    # several side by side and closes the losers, Transport._open_stream), not
                    # one we refused; nobody is left to read a reply
                    self.stats["relay_abandoned"] += 1
                    log.debug("%s closed a relayed stream before its hello", peer_id[-8:])
                    _close(writer)
                    return
                self.stats["relay_refused"] += 1
                if isinstance(e, (RemoteProtocolError, ValueError)):
                    self.scores.penalize(peer_id, 2.0, time.monotonic())
                code = e.code if isinstance(e, RPCError) else "bad_request"
                log.info("refused to relay for %s: %s", peer_id[-8:], getattr(e, "message", None) or e or type(e).__name__)
                await self._refuse(reader, writer, code, f"relay: {getattr(e, 'message', None) or e or type(e).__name__}")
                return
            self.stats["relayed_streams"] += 1
            target[1].write(relay.frame_hello(data))

            def count(n: int) -> None:
                self.stats["relayed_bytes"] += n

            await relay.splice((reader, writer), target, count)
        finally:
            if counted:
                self._hops[peer_id] -= 1
            if task is not None:
                self._tasks.discard(task)

    async def _serve_relayed(self, relay_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A stream a relay carried to us: served as the origin's own, once its hello holds."""
        try:
            _, hello = await self._read_hello(reader)
            now = time.time()
            if hello.target != self.peer_id:
                raise RemoteProtocolError(f"the hello is for {hello.target}, not us", "RelayHello")
            if abs(now - hello.issued_at) > relay.HELLO_FRESH_S:
                raise RemoteProtocolError(f"the hello is {now - hello.issued_at:.0f} s old", "RelayHello")
            if hello.protocol not in (RPC_PROTOCOL, PIPE_PROTOCOL):
                raise RemoteProtocolError(f"no relayed protocol {hello.protocol!r}", "RelayHello")
            if not self._nonces.fresh(hello.nonce, now):
                raise RemoteProtocolError("the hello was used before (a replay)", "RelayHello")
        except (RemoteProtocolError, ValueError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.stats["relayed_refused"] += 1
            self.scores.penalize(relay_id, 2.0, time.monotonic())
            log.info("refused a stream relayed by %s: %s", relay_id[-8:], e or type(e).__name__)
            await self._refuse(reader, writer, "bad_request", f"relayed stream refused: {e or type(e).__name__}")
            return
        self.stats["relayed_served"] += 1
        await self._serve_calls(hello.peer_id, reader, writer, pipe=hello.protocol == PIPE_PROTOCOL)

    async def _serve_calls(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pipe: bool) -> None:
        """Serve one call (an RPC stream) or calls one after another until the caller closes
        (a pipe). On a pipe, a call that ends in an error ends the pipe: its caller may still
        be writing frames that belong to it."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        st = self.scores.peers[peer_id]
        counted = 0

        def on_bytes(n: int) -> None:
            nonlocal counted
            counted += n
            st.bytes_in_flight += n
            if n > 0:
                self.heard[peer_id] = time.monotonic()
            if n > 0 and st.bytes_in_flight > self.config.max_bytes_in_flight_per_peer:
                raise RPCError("overloaded", f"more than {self.config.max_bytes_in_flight_per_peer} bytes in flight")

        frames = _FrameReader(reader, writer, self.config.max_frame_size, on_bytes)

        async def receive() -> Message:
            async with asyncio.timeout(self.config.request_read_timeout_s):
                msg = await frames.next()
            if msg is None:  # the caller hung up (a call cancelled, a send given up): nothing bad about it
                raise ConnectionResetError("the caller closed the stream before its request was complete")
            return msg

        linger = True  # for the caller to hang up first, after our last reply (see TransportConfig.linger_s)
        try:
            while True:
                request_id = 0
                ok = active = False
                try:
                    if pipe:  # between calls a pipe may idle, for up to pipe_idle_s
                        try:
                            async with asyncio.timeout(self.config.pipe_idle_s):
                                first = await frames.next()
                        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                            linger = False  # idle (no reply on its way) or gone
                            return
                        if first is None:
                            return
                    st.active += 1
                    active = True
                    self._check_not_banned(peer_id)
                    if st.active > self.config.max_concurrent_per_peer:
                        raise RPCError("overloaded", f"more than {self.config.max_concurrent_per_peer} concurrent calls")
                    request = first if pipe else await receive()
                    request_id = request.request_id
                    handler = self.handlers.get(type(request))
                    if handler is None:
                        raise RPCError("unsupported", f"no handler for {type(request).__name__} here")
                    if self.gate is not None and type(request) not in self.gate.exempt:
                        self.gate.check(peer_id)  # an owned swarm serves its members only
                    self.stats["calls_served"] += 1
                    async with asyncio.timeout(self.config.handler_timeout_s):
                        result = await handler(CallContext(peer_id, request, receive))
                        if isinstance(result, Message):
                            await _write(writer, result.with_request_id(request_id), self.config.max_frame_size)
                        else:
                            async for msg in result:
                                await _write(writer, msg.with_request_id(request_id), self.config.max_frame_size)
                    ok = True
                except RemoteProtocolError as e:
                    self.stats["bad_frames"] += 1
                    self.scores.penalize(peer_id, 2.0, time.monotonic())
                    self._log_peer(peer_id, st, f"refused bad input from {peer_id}: {e}")
                    await self._reply_error(writer, "bad_request", str(e), request_id)
                except RPCError as e:
                    await self._reply_error(writer, e.code, e.message, request_id)
                except TimeoutError:
                    await self._reply_error(writer, "timeout", "request or handler passed its deadline", request_id)
                except (ConnectionError, asyncio.IncompleteReadError, BrokenPipeError):
                    linger = False  # the caller hung up, or the handler hangs up on it: no reply to protect
                except asyncio.CancelledError:
                    linger = False  # shutting down
                    raise
                except Exception:
                    log.exception("handler failed on a request from %s", peer_id)
                    await self._reply_error(writer, "internal", "the handler failed; see the server's log", request_id)
                finally:
                    if active:
                        st.active -= 1
                if not (pipe and ok):
                    return
        finally:
            st.bytes_in_flight -= counted
            counted = 0
            try:
                if linger:  # until the caller hangs up, what it still sends (the rest of a refused request) is dropped
                    await frames.drain(self.config.linger_s, LINGER_BYTES)
            finally:
                _close(writer)
                if task is not None:
                    self._tasks.discard(task)

    def _log_peer(self, peer_id: str, st: _PeerState, text: str) -> None:
        now = time.monotonic()
        if now - st.last_logged > 60:
            st.last_logged = now
            log.warning(text + " (further problems from this peer are logged at debug level for 60 s)")
        else:
            log.debug(text)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: str, message: str) -> None:
        """An error reply to a stream refused before its call was read, then its close once the
        caller hung up (or after linger_s): a stream closed with the caller's request unread is
        reset, and a reset may overtake the reply that says why."""
        try:
            await self._reply_error(writer, code, message, 0)
            await _FrameReader(reader, writer, self.config.max_frame_size, lambda n: None).drain(self.config.linger_s, LINGER_BYTES)
        finally:
            _close(writer)

    async def _reply_error(self, writer: asyncio.StreamWriter, code: str, message: str, request_id: int) -> None:
        try:
            await asyncio.wait_for(_write(writer, Error(code=code, message=message[:1000], request_id=request_id), self.config.max_frame_size), 5)
        except Exception:  # best effort: the peer may be gone or not reading
            pass

    # ---- client side ---------------------------------------------------------------------

    async def _open(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await self._open_stream(peer_id, RPC_PROTOCOL)

    async def _open_stream(self, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A libp2p stream to the peer. An open still pending after OPEN_AGAIN_S gets a second
        one beside it (and a third), the first to succeed wins: p2pd's open waits on a dial in
        progress even when the peer has meanwhile connected to us, and a second open takes that
        connection at once. (Seen after a link came back: a part's open hung 3.5 s, the round's
        deadline, while the peer had connected 0.1 s after it began.) An open that fails is
        not retried here."""
        await self._check_route(peer_id)
        loop = asyncio.get_running_loop()
        # a peer that announced relays (node/net/relay.py): after the first open, through each of them;
        # at once beside it, through the relay that carried the last open, should one have
        # (a dial towards a NAT hangs rather than fails: each open would wait OPEN_AGAIN_S)
        relays = [r for r in self.host.routes.get(peer_id, ()) if r != self.peer_id]
        last = self._via_relay.get(peer_id)
        at_once = last is not None and last[0] in relays and time.monotonic() - last[1] < RELAY_FIRST_S
        if at_once:
            relays.remove(last[0])
            relays.insert(0, last[0])
        if relays:
            openers = [(r, functools.partial(self._open_relayed, r, peer_id, protocol)) for r in relays]
        else:
            openers = [("", functools.partial(self.host.open_stream, peer_id, protocol))] * (OPEN_ATTEMPTS - 1)
        attempts = [loop.create_task(self.host.open_stream(peer_id, protocol))]
        through: dict[asyncio.Task, str] = {}  # relayed attempts -> their relay

        def another() -> None:
            relay_id, opener = openers.pop(0)
            self.stats["opens_again" if not relays else "relay_opens"] += 1
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
                    _close_if_opened(t)
                else:
                    t.cancel()
                    t.add_done_callback(_close_if_opened)

    async def _check_route(self, peer_id: str) -> None:
        """Before libp2p dials a peer that stopped answering (a call to it timed out, or `reset`
        dropped our connections to it: frozen, or a link down), a plain TCP connect to where a direct pipe reached it tells
        whether the network carries anything to it yet; if not, PeerUnreachable without a dial.
        go-libp2p refuses to redial an address for 5 s after a failed dial (longer after each
        further failure): a cut-off peer's first dial as its link came back, before ARP had
        resolved, cost it 5-6 s of rounds after the network carried packets again (measured in
        a network namespace: a plain connect worked 0.7 s after the restore, libp2p 6 s). A
        frozen peer's kernel still accepts connections, so this lets its dials through at once.
        Once the peer is heard from, or every ROUTE_FALLBACK_S since it stopped answering,
        libp2p dials untested."""
        since, addr = self._dropped.get(peer_id), self._reached.get(peer_id)
        if since is None or addr is None:
            return
        if self.heard.get(peer_id, 0.0) > since:
            self._dropped.pop(peer_id, None)
            return
        now = time.monotonic()
        if now - max(since, self._dialed.get(peer_id, since)) >= ROUTE_FALLBACK_S:  # (an untested dial of an earlier silence does not count)
            self._dialed[peer_id] = now
            return
        try:
            async with asyncio.timeout(ROUTE_CHECK_S):
                _, writer = await asyncio.open_connection(*addr)
            _close(writer)
        except (OSError, TimeoutError) as e:
            self.stats["route_checks_failed"] += 1
            raise PeerUnreachable(f"no route to {peer_id[-8:]} at {addr[0]}:{addr[1]} yet ({e or 'no answer'}); not dialing it through libp2p") from None
        self._dropped.pop(peer_id, None)  # (calls checking together: each may get here)

    async def _open_relayed(self, relay_id: str, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `peer_id` through the relay `relay_id` (see node/net/relay.py). Should the
        relay not reach the peer, it answers with an Error frame: the call fails as refused."""
        if self.gate is not None and self.gate.credential:
            await self._present(relay_id, None)  # a relay serves members only
        hello = RelayHello(self.host.config.swarm_id, self.peer_id, peer_id, protocol, time.time(), os.urandom(16)).sign(self.host.key)
        reader, writer = await self.host.open_stream(relay_id, relay.HOP_PROTOCOL)
        try:
            writer.write(relay.frame_hello(hello.to_bytes()))
            await writer.drain()
        except (ConnectionError, OSError) as e:
            _close(writer)
            raise PeerUnreachable(f"relay {relay_id} dropped the stream to {peer_id}: {e}") from None
        return reader, writer

    def _check_reply(self, peer_id: str, reply: Message | None) -> Message:
        if reply is None:
            raise ConnectionError(f"{peer_id} closed the stream without a reply")
        if isinstance(reply, Error):
            raise RemoteError(peer_id, reply.code, reply.message)
        return reply

    async def _pipe_call(self, peer_id: str, request: Message, more: Iterable[Message], timeout: float, pace: float | None = None) -> Message:
        """`send` on a pipe: a stream to the peer that outlives the call, so the next call skips
        opening a stream and starts with the flow-control window this one grew (a fresh libp2p
        stream starts at 256 KiB and takes round trips to widen). A pipe carries one call at a
        time; concurrent calls take other pipes. Frames carry the call's id; the reply must too."""
        deadline = time.monotonic() + timeout
        idle = self._pipes[peer_id]
        pipe = None
        while idle and pipe is None:
            candidate = idle.pop()
            if time.monotonic() - candidate.used < self.config.pipe_idle_s / 2:
                pipe = candidate
            else:
                _close(candidate.writer)
        reused = pipe is not None
        try:
            async with asyncio.timeout(timeout):
                if pipe is None:
                    reader, writer = await self._open_pipe(peer_id)
                    pipe = _Pipe(reader, writer, _FrameReader(reader, writer, self.config.max_frame_size))
                    pipe.direct = isinstance(writer.transport, direct.SealedTransport)
                    self.stats["pipes_opened"] += 1
                if pipe.direct and pipe.pace != int(pace or 0):
                    pipe.pace = int(pace or 0)
                    direct.set_pacing(pipe.writer.transport, pipe.pace)
                rid = pipe.next_id
                pipe.next_id += 1
                try:
                    for msg in (request, *more):
                        await _write(pipe.writer, msg.with_request_id(rid), self.config.max_frame_size)
                    reply = await pipe.frames.next()
                except (ConnectionError, BrokenPipeError) as e:
                    reply = None
                    with contextlib.suppress(ConnectionError, TimeoutError, RemoteProtocolError):
                        reply = await asyncio.wait_for(pipe.frames.next(), 2.0)  # a refusal says why
                    if reply is None:
                        raise ConnectionError(f"{peer_id} closed the pipe: {e}") from None
                if reply is None or isinstance(reply, Error):  # the server ends a pipe after an error
                    _close(pipe.writer)
                    self._check_reply(peer_id, reply)
                if reply.request_id != rid:
                    raise RemoteProtocolError(f"reply to call {reply.request_id} on call {rid}'s turn", "request_id")
        except TimeoutError:
            if pipe is not None:
                _close(pipe.writer)
            self._dropped.setdefault(peer_id, time.monotonic())  # (its next stream: see _check_route)
            raise CallTimeout(f"{type(request).__name__} with {peer_id} timed out after {timeout:.1f} s") from None
        except ConnectionError:
            if pipe is not None:
                _close(pipe.writer)
            if reused and deadline - time.monotonic() > 0:  # the peer closed an idle pipe, or restarted: once more, on a fresh one
                return await self._pipe_call(peer_id, request, more, deadline - time.monotonic(), pace)
            raise
        except BaseException as e:
            if pipe is not None:
                _close(pipe.writer)
            if isinstance(e, RemoteProtocolError):
                self.scores.penalize(peer_id, 2.0, time.monotonic())
            raise
        pipe.used = self.heard[peer_id] = time.monotonic()
        if len(idle) < self.config.pipes_per_peer:
            idle.append(pipe)
        else:
            _close(pipe.writer)
        self.stats["calls_made"] += 1
        return reply

    def paces(self, peer_id: str) -> bool:
        """Whether `send(..., reuse=True, pace=...)` to this peer is paced: its pipes go over
        direct TCP (none of its idle pipes is a libp2p stream) and the kernel can pace sockets."""
        if self._direct is None or not direct.CAN_PACE or self._no_direct.get(peer_id, 0.0) > time.monotonic():
            return False
        return all(p.direct for p in self._pipes.get(peer_id, ()))

    async def _open_pipe(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new pipe's stream: direct where the peer takes it, else a libp2p stream."""
        if self._direct is not None and self._no_direct.get(peer_id, 0.0) <= time.monotonic():
            ticket, key = os.urandom(direct.TICKET_BYTES), os.urandom(KEY_BYTES)
            t0 = time.monotonic()
            try:
                reply = await self.call(peer_id, DirectOpen(ticket=ticket, key=key), self.config.direct_connect_s)
                if not isinstance(reply, DirectAddress):
                    raise ConnectionError(f"answered DirectOpen with {type(reply).__name__}")
                left = self.config.direct_connect_s - (time.monotonic() - t0)
                stream = await direct.dial(list(reply.addrs), ticket, key, left, self.config.direct_congestion)
                self.stats["direct_pipes"] += 1
                if isinstance(peer := stream[1].get_extra_info("peername"), tuple):
                    self._reached[peer_id] = (peer[0], peer[1])
                return stream
            except (CallTimeout, PeerUnreachable) as e:
                # the peer did not answer over libp2p either (frozen, its link down): nothing
                # says a direct connection cannot work once it is back. Remembering this for
                # direct_retry_s kept its pipes on libp2p, a round slower, long after a cut
                self.stats["direct_fallbacks"] += 1
                log.debug("no direct connection to %s (%s): the peer did not answer", peer_id[-8:], e)
            except (RemoteError, RemoteProtocolError, OSError) as e:
                self._no_direct[peer_id] = time.monotonic() + self.config.direct_retry_s
                self.stats["direct_fallbacks"] += 1
                log.info("no direct connection to %s (%s): its pipes use libp2p for %.0f s", peer_id[-8:], e, self.config.direct_retry_s)
        return await self._open_stream(peer_id, PIPE_PROTOCOL)

    async def call(self, peer_id: str, request: Message, timeout: float | None = None) -> Message:
        """One request, one reply. Raises RemoteError, CallTimeout, PeerUnreachable, ConnectionError,
        or RemoteProtocolError (the peer's reply was malformed; the peer is scored down)."""
        return await self.send(peer_id, request, (), timeout)

    @contextlib.asynccontextmanager
    async def _exchange(self, peer_id: str, request: Message, timeout: float | None):
        """A stream to `peer_id` with `request` written on it, under one deadline; yields the
        reply reader. Timeouts become CallTimeout; a malformed reply scores the peer down."""
        timeout = self.config.call_timeout_s if timeout is None else timeout
        writer = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await self._open(peer_id)
                frames = _FrameReader(reader, writer, self.config.max_frame_size)
                await _write(writer, request, self.config.max_frame_size)
                yield frames, writer
        except TimeoutError:
            self._dropped.setdefault(peer_id, time.monotonic())  # (its next stream: see _check_route)
            raise CallTimeout(f"{type(request).__name__} with {peer_id} timed out after {timeout:.1f} s") from None
        except RemoteProtocolError:
            self.scores.penalize(peer_id, 2.0, time.monotonic())
            raise
        finally:
            if writer is not None:
                _close(writer)

    async def send(
        self,
        peer_id: str,
        request: Message,
        more: Iterable[Message] | AsyncIterator[Message] = (),
        timeout: float | None = None,
        reuse: bool = False,
        pace: float | None = None,
    ) -> Message:
        """A request followed by more frames (client streaming); one reply. `reuse`: on a pipe
        kept open to the peer (bulk transfers; `more` must then be a plain iterable). `pace`:
        bytes/s the kernel lets this call's data leave at, where the pipe is direct TCP (see
        `paces`); elsewhere, and with None, as fast as the network takes it."""
        if self.gate is None or not self.gate.credential or isinstance(request, MemberProof):
            return await self._send(peer_id, request, more, timeout, reuse, pace)
        await self._present(peer_id, timeout)
        try:
            return await self._send(peer_id, request, more, timeout, reuse, pace)
        except RemoteError as e:  # the peer forgot us (it restarted): once more, after presenting again
            from .gate import NOT_PRESENTED

            if not (e.code == "unauthorized" and e.message.startswith(NOT_PRESENTED) and isinstance(more, (list, tuple))):
                raise
            self._presented.pop(peer_id, None)
            await self._present(peer_id, timeout)
            return await self._send(peer_id, request, more, timeout, reuse, pace)

    async def _present(self, peer_id: str, timeout: float | None) -> None:
        """Our membership certificate to `peer_id`, unless it has it already (one call, shared by
        the calls that wait for it). RemoteError(unauthorized) if the peer refuses it."""
        credential = self.gate.credential
        if self._presented.get(peer_id) == credential:
            return
        key = (peer_id, credential)
        pending = self._presenting.get(key)
        if pending is None:
            pending = self._presenting[key] = asyncio.ensure_future(self._send(peer_id, MemberProof(certificate=credential), (), timeout, False, None))
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read even when every waiter was cancelled)
        try:
            await asyncio.shield(pending)
        finally:
            if pending.done() and self._presenting.get(key) is pending:
                del self._presenting[key]
        self._presented[peer_id] = credential

    async def _send(self, peer_id: str, request: Message, more, timeout: float | None, reuse: bool, pace: float | None) -> Message:
        if reuse:
            timeout = self.config.call_timeout_s if timeout is None else timeout
            return await self._pipe_call(peer_id, request, list(more), timeout, pace)  # type: ignore[arg-type]
        async with self._exchange(peer_id, request, timeout) as (frames, writer):
            try:
                if hasattr(more, "__aiter__"):
                    async for msg in more:  # type: ignore[union-attr]
                        await _write(writer, msg, self.config.max_frame_size)
                else:
                    for msg in more:  # type: ignore[union-attr]
                        await _write(writer, msg, self.config.max_frame_size)
            except (ConnectionError, BrokenPipeError) as e:
                # the server may have refused before reading everything: its reply says why
                try:
                    reply = await asyncio.wait_for(frames.next(), 2.0)
                except (ConnectionError, TimeoutError, RemoteProtocolError):
                    reply = None
                if isinstance(reply, Error):
                    raise RemoteError(peer_id, reply.code, reply.message) from None
                raise e
            reply = self._check_reply(peer_id, await frames.next())
            self.heard[peer_id] = time.monotonic()
            self.stats["calls_made"] += 1
            return reply

    async def stream(self, peer_id: str, request: Message, timeout: float | None = None) -> AsyncIterator[Message]:
        """One request, replies until the server ends the stream. `timeout` bounds the whole call."""
        if self.gate is not None and self.gate.credential:
            await self._present(peer_id, timeout)
        async with self._exchange(peer_id, request, timeout) as (frames, _):
            while (msg := await frames.next()) is not None:
                yield self._check_reply(peer_id, msg)

    async def reset(self, peer_id: str, timeout: float = 1.0) -> None:
        """Drop our idle pipes and p2pd's connections to a peer that stopped answering (calls
        to it on them fail): after its link was down a while, a connection may stay stuck
        for seconds (TCP backs off its retransmissions); the next call dials afresh."""
        idle = self._pipes.get(peer_id, [])
        for pipe in idle:
            _close(pipe.writer)
        idle.clear()
        self._dropped.setdefault(peer_id, time.monotonic())
        disconnect = getattr(self.host, "disconnect", None)
        if disconnect is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(disconnect(peer_id), timeout)

    async def keep_relays(self, maddrs: Sequence[str]) -> None:
        """Keep a connection open to each relay we announce (node/net/relay.py): the relay carries
        callers' streams to us over it. Each is pinged every KEEPALIVE_S and dialed again at its
        address when a ping fails."""
        up: dict[str, bool] = {}
        while True:
            for maddr in maddrs:
                rid = maddr.rsplit("/p2p/", 1)[1]
                try:
                    if not up.get(rid):
                        await self.host.connect(rid, [maddr])
                    await self.ping(rid, timeout=5.0)
                    if not up.get(rid):
                        log.info("reachable through relay %s", maddr)
                    up[rid] = True
                except (CallTimeout, PeerUnreachable, RemoteError, ConnectionError, OSError) as e:
                    if up.get(rid, True):
                        log.warning("relay %s unreachable (%s): dialing it again every %.0f s", maddr, e, relay.KEEPALIVE_S)
                    up[rid] = False
            await asyncio.sleep(relay.KEEPALIVE_S)

    async def ping(self, peer_id: str, timeout: float = 5.0) -> float:
        """Round-trip time in seconds."""
        t0 = time.monotonic()
        await self.call(peer_id, Ping(nonce=1, sent_at=time.time()), timeout)
        return time.monotonic() - t0

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()
        for pipes in self._pipes.values():
            for pipe in pipes:
                _close(pipe.writer)
        self._pipes.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = [
    "CallContext",
    "CallTimeout",
    "HandlerTaken",
    "NETWORK_ERRORS",
    "Registration",
    "PeerScores",
    "PeerUnreachable",
    "RPCError",
    "RemoteError",
    "Transport",
    "TransportConfig",
    "RPC_PROTOCOL",
    "PIPE_PROTOCOL",
]
