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

`Transport` is the facade; its parts live beside it (node/net/__init__.py maps them): the
serving side (serving.py), the dialing side (dialing.py), pipes (pipes.py) and our certificate's
presentation (presenting.py), on what both sides share (rpc.py, streams.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

from protocol import DirectOpen, Error, MemberProof, Message, Ping, Probe, RemoteProtocolError

from . import direct, relay
from .dialing import Dialer
from .host import Host, PeerUnreachable
from .pipes import Pipes
from .presenting import Presenter
from .rpc import (
    NETWORK_ERRORS,
    PIPE_PROTOCOL,
    RPC_PROTOCOL,
    CallContext,
    CallTimeout,
    Handler,
    HandlerTaken,
    PeerScores,
    RemoteError,
    RPCError,
    TransportConfig,
    check_reply,
)
from .serving import Server, answer_ping, answer_probe
from .streams import FrameReader, close, write
from .traffic import Meter, Traffic

log = logging.getLogger(__name__)


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
    """The facade: handlers served, calls made, one host. Its parts: `server` (serving.py),
    `dialer` (dialing.py), `pipes` (pipes.py), `presenter` (presenting.py)."""

    def __init__(self, host: Host, config: TransportConfig = TransportConfig()):
        self.host = host
        self.config = config
        self.scores = PeerScores(config)
        self.handlers: dict[type[Message], Handler] = {Ping: answer_ping, Probe: answer_probe}
        self.stats: dict[str, int] = defaultdict(int)
        self.traffic = Traffic()  # bytes by plane and peer (traffic.py)
        self.heard: dict[str, float] = {}  # peer -> when bytes of its calls or replies last came in (monotonic)
        self.gate = None  # an owned swarm's MemberGate (node/net/gate.py): who we serve, and the certificate we present
        self.server = Server(self)
        self.dialer = Dialer(self)
        self.pipes = Pipes(self)
        self.presenter = Presenter(self)
        # the parts' state under the names it had before they were split off (tests read them)
        self._tasks = self.server.tasks
        self._pipes = self.pipes.idle
        self._reached = self.dialer.reached
        self._dropped = self.dialer.dropped

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
        await self.host.add_stream_handler(RPC_PROTOCOL, self.server.serve)
        await self.host.add_stream_handler(PIPE_PROTOCOL, self.server.serve_pipe)
        await self.host.add_stream_handler(relay.RELAYED_PROTOCOL, self.server.serve_relayed)
        if self.config.relay_service:
            await self.host.add_stream_handler(relay.HOP_PROTOCOL, self.server.serve_hop)
        await self.pipes.listen()
        if self.pipes.listener is not None:
            self.handlers[DirectOpen] = self.pipes.on_direct_open

    # the direct listener and its addresses, by their names from before the split (tests read
    # them, and point the addresses elsewhere)
    @property
    def _direct(self) -> direct.DirectListener | None:
        return self.pipes.listener

    @property
    def _direct_addrs(self) -> tuple[str, ...]:
        return self.pipes.addrs

    @_direct_addrs.setter
    def _direct_addrs(self, addrs: tuple[str, ...]) -> None:
        self.pipes.addrs = addrs

    def meter(self, peer_id: str, writer: asyncio.StreamWriter, relayed: bool = False) -> Meter:
        """The traffic counters of a stream with `peer_id`, by its plane: direct TCP, carried by a
        relay (`relayed`: one served to us; the dialer knows those it opened), else libp2p."""
        if isinstance(writer.transport, direct.SealedTransport):
            plane = "direct"
        elif relayed or writer in self.dialer.relayed:
            plane = "relayed"
        else:
            plane = "libp2p"
        return self.traffic.meter(plane, peer_id)

    # ---- client side ---------------------------------------------------------------------

    async def _open_stream(self, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A libp2p stream to the peer (`Dialer.open_stream`; tests open one with a fake host)."""
        return await self.dialer.open_stream(peer_id, protocol)

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
                reader, writer = await self.dialer.open_stream(peer_id, RPC_PROTOCOL)
                frames = FrameReader(reader, writer, self.config.max_frame_size, meter=self.meter(peer_id, writer))
                await write(writer, request, self.config.max_frame_size, frames.meter)
                yield frames, writer
        except TimeoutError:
            self.dialer.mark_dropped(peer_id)  # (its next stream: see Dialer.check_route)
            raise CallTimeout(f"{type(request).__name__} with {peer_id} timed out after {timeout:.1f} s") from None
        except RemoteProtocolError as e:
            self.scores.penalize(peer_id, 2.0, time.monotonic(), f"a malformed reply: {e}")
            raise
        finally:
            if writer is not None:
                close(writer)

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
        await self.presenter.present(peer_id, timeout)
        try:
            return await self._send(peer_id, request, more, timeout, reuse, pace)
        except RemoteError as e:  # the peer forgot us (it restarted): once more, after presenting again
            from .gate import NOT_PRESENTED

            if not (e.code == "unauthorized" and e.message.startswith(NOT_PRESENTED) and isinstance(more, (list, tuple))):
                raise
            self.presenter.forget(peer_id)
            await self.presenter.present(peer_id, timeout)
            return await self._send(peer_id, request, more, timeout, reuse, pace)

    async def _send(self, peer_id: str, request: Message, more, timeout: float | None, reuse: bool, pace: float | None) -> Message:
        if reuse:
            timeout = self.config.call_timeout_s if timeout is None else timeout
            return await self.pipes.call(peer_id, request, list(more), timeout, pace)  # type: ignore[arg-type]
        async with self._exchange(peer_id, request, timeout) as (frames, writer):
            try:
                if hasattr(more, "__aiter__"):
                    async for msg in more:  # type: ignore[union-attr]
                        await write(writer, msg, self.config.max_frame_size, frames.meter)
                else:
                    for msg in more:  # type: ignore[union-attr]
                        await write(writer, msg, self.config.max_frame_size, frames.meter)
            except (ConnectionError, BrokenPipeError) as e:
                # the server may have refused before reading everything: its reply says why
                try:
                    reply = await asyncio.wait_for(frames.next(), 2.0)
                except (ConnectionError, TimeoutError, RemoteProtocolError):
                    reply = None
                if isinstance(reply, Error):
                    raise RemoteError(peer_id, reply.code, reply.message) from None
                raise e
            reply = check_reply(peer_id, await frames.next())
            self.heard[peer_id] = time.monotonic()
            self.stats["calls_made"] += 1
            return reply

    async def stream(self, peer_id: str, request: Message, timeout: float | None = None) -> AsyncIterator[Message]:
        """One request, replies until the server ends the stream. `timeout` bounds the whole call."""
        if self.gate is not None and self.gate.credential:
            await self.presenter.present(peer_id, timeout)
        async with self._exchange(peer_id, request, timeout) as (frames, _):
            while (msg := await frames.next()) is not None:
                yield check_reply(peer_id, msg)

    def paces(self, peer_id: str) -> bool:
        """Whether `send(..., reuse=True, pace=...)` to this peer is paced: its pipes go over
        direct TCP (none of its idle pipes is a libp2p stream) and the kernel can pace sockets."""
        return self.pipes.paces(peer_id)

    async def reset(self, peer_id: str, timeout: float = 1.0) -> None:
        """Drop our idle pipes and p2pd's connections to a peer that stopped answering (calls
        to it on them fail): after its link was down a while, a connection may stay stuck
        for seconds (TCP backs off its retransmissions); the next call dials afresh."""
        self.pipes.drop(peer_id)
        self.dialer.mark_dropped(peer_id)
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
        await self.pipes.close()
        await self.server.close()


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
