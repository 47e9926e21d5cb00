"""The serving side of a transport (node/net/transport.py): calls that peers open with us.

`Server.serve_calls` serves one call on an RPC stream, or calls one after another on a pipe,
under the per-peer limits of `TransportConfig` and the gate; a peer whose frames are malformed
is answered `bad_request`, scored down (`PeerScores`) and logged once a minute. Streams a relay
carried to us (`serve_relayed`) are served as their origin's own once its hello holds; as a
relay (`serve_hop`) we carry a caller's stream to a peer that keeps a connection to us. A
stream refused before its call was read gets its error reply and is closed once the caller hung
up (`refuse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from protocol import Error, Message, Pong, Probe, RemoteProtocolError
from protocol.records import RelayHello

from . import relay
from .host import PeerUnreachable
from .rpc import PIPE_PROTOCOL, RPC_PROTOCOL, CallContext, PeerState, RPCError
from .streams import FrameReader, close, write
from .traffic import Meter

if TYPE_CHECKING:
    from .transport import Transport

log = logging.getLogger(__name__)

RELAY_STREAMS_PER_PEER = 128  # streams a relay carries for one caller at once (pipes stay open between calls)
LINGER_BYTES = 16 << 20  # what a refused caller may still send us before we close on it


async def answer_ping(ctx: CallContext) -> Message:
    return Pong(nonce=ctx.request.nonce, sent_at=ctx.request.sent_at)


async def answer_probe(ctx: CallContext) -> Message:
    return Probe(data=bytes(ctx.request.want))


class Server:
    """Serves the streams peers open with a transport: its handlers, its limits, its gate."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.config = transport.config
        self.tasks: set[asyncio.Task] = set()  # the streams being served now (close cancels them)
        self._nonces = relay.Nonces()  # of the relay hellos we took
        self._hops: dict[str, int] = defaultdict(int)  # caller -> streams we relay for it now

    async def serve(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.serve_calls(peer_id, reader, writer, pipe=False)

    async def serve_pipe(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.serve_calls(peer_id, reader, writer, pipe=True)

    @contextlib.contextmanager
    def _tracked(self):
        """The current task in `tasks` while it serves."""
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        try:
            yield
        finally:
            if task is not None:
                self.tasks.discard(task)

    def check_not_banned(self, peer_id: str) -> None:
        """RPCError(unauthorized) while `peer_id` is banned after repeated bad frames."""
        left = self.transport.scores.banned(peer_id, time.monotonic())
        if left:
            raise RPCError("unauthorized", f"banned for {left:.0f} more seconds after {self.transport.scores.peers[peer_id].ban_reason}")

    async def _read_hello(self, reader: asyncio.StreamReader) -> tuple[bytes, RelayHello]:
        """The RelayHello a relayed stream starts with: its bytes and the verified record
        (RemoteProtocolError if malformed or forged, ValueError if oversized)."""
        data = await asyncio.wait_for(relay.read_hello(reader), self.config.request_read_timeout_s)
        return data, RelayHello.from_bytes(data, self.transport.host.config.swarm_id)

    async def serve_hop(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """As a relay: carry `peer_id`'s stream to the target its hello names (node/net/relay.py),
        if the target keeps a connection to us (its pings: we are not a proxy to anyone else)."""
        t, stats = self.transport, self.transport.stats
        counted = False
        with self._tracked():
            try:
                try:
                    self.check_not_banned(peer_id)
                    if self._hops[peer_id] >= RELAY_STREAMS_PER_PEER:
                        raise RPCError("overloaded", f"more than {RELAY_STREAMS_PER_PEER} streams relayed for one peer at once")
                    self._hops[peer_id] += 1
                    counted = True
                    data, hello = await self._read_hello(reader)
                    if hello.peer_id != peer_id:
                        raise RemoteProtocolError(f"the hello is {hello.peer_id}'s, not the caller's", "RelayHello")
                    if hello.target == t.peer_id or hello.protocol not in (RPC_PROTOCOL, PIPE_PROTOCOL):
                        raise RPCError("bad_request", f"cannot relay {hello.protocol!r} to {hello.target}")
                    if t.gate is not None:
                        t.gate.check(peer_id)
                    if time.monotonic() - t.heard.get(hello.target, -math.inf) > 3 * relay.KEEPALIVE_S:
                        raise RPCError("not_found", f"relay {t.peer_id[-8:]} carries streams only to peers that keep a connection to it; {hello.target} does not")
                    try:
                        async with asyncio.timeout(self.config.call_timeout_s):
                            target = await t.host.open_stream(hello.target, relay.RELAYED_PROTOCOL)
                    except (PeerUnreachable, TimeoutError) as e:
                        raise RPCError("not_found", f"relay {t.peer_id[-8:]} cannot reach {hello.target}: {e or 'no answer'}") from None
                except (RemoteProtocolError, RPCError, ValueError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
                    if isinstance(e, asyncio.IncompleteReadError) and not e.partial:
                        # closed before a byte of its hello: an open the caller gave up (it opens
                        # several side by side and closes the losers, Dialer.open_stream), not
                        # one we refused; nobody is left to read a reply
                        stats["relay_abandoned"] += 1
                        log.debug("%s closed a relayed stream before its hello", peer_id[-8:])
                        close(writer)
                        return
                    stats["relay_refused"] += 1
                    if isinstance(e, (RemoteProtocolError, ValueError)):
                        t.scores.penalize(peer_id, 2.0, time.monotonic(), f"a bad relay request: {e}")
                    code = e.code if isinstance(e, RPCError) else "bad_request"
                    log.info("refused to relay for %s: %s", peer_id[-8:], getattr(e, "message", None) or e or type(e).__name__)
                    await self.refuse(reader, writer, code, f"relay: {getattr(e, 'message', None) or e or type(e).__name__}")
                    return
                stats["relayed_streams"] += 1
                target[1].write(relay.frame_hello(data))

                def count(n: int) -> None:
                    stats["relayed_bytes"] += n

                await relay.splice((reader, writer), target, count)
            finally:
                if counted:
                    self._hops[peer_id] -= 1

    async def serve_relayed(self, relay_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A stream a relay carried to us: served as the origin's own, once its hello holds."""
        t = self.transport
        try:
            _, hello = await self._read_hello(reader)
            now = time.time()
            if hello.target != t.peer_id:
                raise RemoteProtocolError(f"the hello is for {hello.target}, not us", "RelayHello")
            if abs(now - hello.issued_at) > relay.HELLO_FRESH_S:
                raise RemoteProtocolError(f"the hello is {now - hello.issued_at:.0f} s old", "RelayHello")
            if hello.protocol not in (RPC_PROTOCOL, PIPE_PROTOCOL):
                raise RemoteProtocolError(f"no relayed protocol {hello.protocol!r}", "RelayHello")
            if not self._nonces.fresh(hello.nonce, now):
                raise RemoteProtocolError("the hello was used before (a replay)", "RelayHello")
        except (RemoteProtocolError, ValueError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            t.stats["relayed_refused"] += 1
            t.scores.penalize(relay_id, 2.0, time.monotonic(), f"a bad relayed stream: {e or type(e).__name__}")
            log.info("refused a stream relayed by %s: %s", relay_id[-8:], e or type(e).__name__)
            await self.refuse(reader, writer, "bad_request", f"relayed stream refused: {e or type(e).__name__}")
            return
        t.stats["relayed_served"] += 1
        await self.serve_calls(hello.peer_id, reader, writer, pipe=hello.protocol == PIPE_PROTOCOL, relayed=True)

    async def serve_calls(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pipe: bool, relayed: bool = False) -> None:
        """Serve one call (an RPC stream) or calls one after another until the caller closes
        (a pipe). On a pipe, a call that ends in an error ends the pipe: its caller may still
        be writing frames that belong to it. `relayed`: a relay carries the stream (its traffic's plane)."""
        config, st = self.config, self.transport.scores.peers[peer_id]
        counted = 0

        def on_bytes(n: int) -> None:
            nonlocal counted
            counted += n
            st.bytes_in_flight += n
            if n > 0:
                self.transport.heard[peer_id] = time.monotonic()
            if n > 0 and st.bytes_in_flight > config.max_bytes_in_flight_per_peer:
                raise RPCError("overloaded", f"more than {config.max_bytes_in_flight_per_peer} bytes in flight")

        frames = FrameReader(reader, writer, config.max_frame_size, on_bytes, self.transport.meter(peer_id, writer, relayed))
        meter = frames.meter

        async def receive() -> Message:
            async with asyncio.timeout(config.request_read_timeout_s):
                msg = await frames.next()
            if msg is None:  # the caller hung up (a call cancelled, a send given up): nothing bad about it
                raise ConnectionResetError("the caller closed the stream before its request was complete")
            return msg

        linger = True  # for the caller to hang up first, after our last reply (see TransportConfig.linger_s)
        with self._tracked():
            try:
                while True:
                    request_id = 0
                    ok = active = False
                    try:
                        if pipe:  # between calls a pipe may idle, for up to pipe_idle_s
                            try:
                                async with asyncio.timeout(config.pipe_idle_s):
                                    first = await frames.next()
                            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                                linger = False  # idle (no reply on its way) or gone
                                return
                            if first is None:
                                return
                        st.active += 1
                        active = True
                        self.check_not_banned(peer_id)
                        if st.active > config.max_concurrent_per_peer:
                            raise RPCError("overloaded", f"more than {config.max_concurrent_per_peer} concurrent calls")
                        request = first if pipe else await receive()
                        request_id = request.request_id
                        await self._handle(CallContext(peer_id, request, receive), writer, meter)
                        ok = True
                    except RemoteProtocolError as e:
                        await self._bad_input(peer_id, st, writer, e, request_id, meter)
                    except RPCError as e:
                        await self._reply_error(writer, e.code, e.message, request_id, meter)
                    except TimeoutError:
                        await self._reply_error(writer, "timeout", "request or handler passed its deadline", request_id, meter)
                    except (ConnectionError, asyncio.IncompleteReadError, BrokenPipeError):
                        linger = False  # the caller hung up, or the handler hangs up on it: no reply to protect
                    except asyncio.CancelledError:
                        linger = False  # shutting down
                        raise
                    except Exception:
                        log.exception("handler failed on a request from %s", peer_id)
                        await self._reply_error(writer, "internal", "the handler failed; see the server's log", request_id, meter)
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
                        await frames.drain(config.linger_s, LINGER_BYTES)
                finally:
                    close(writer)

    async def _handle(self, ctx: CallContext, writer: asyncio.StreamWriter, meter: Meter | None = None) -> None:
        """The request's handler, its reply (or replies) written back with the call's id."""
        t, request = self.transport, ctx.request
        handler = t.handlers.get(type(request))
        if handler is None:
            raise RPCError("unsupported", f"no handler for {type(request).__name__} here")
        if t.gate is not None and type(request) not in t.gate.exempt:
            t.gate.check(ctx.peer_id)  # an owned swarm serves its members only
        t.stats["calls_served"] += 1
        async with asyncio.timeout(self.config.handler_timeout_s):
            result = await handler(ctx)
            if isinstance(result, Message):
                await write(writer, result.with_request_id(request.request_id), self.config.max_frame_size, meter)
            else:
                async for msg in result:
                    await write(writer, msg.with_request_id(request.request_id), self.config.max_frame_size, meter)

    async def _bad_input(self, peer_id: str, st: PeerState, writer: asyncio.StreamWriter, e: RemoteProtocolError, request_id: int, meter: Meter) -> None:
        """A peer's malformed frames: counted, scored down, logged, answered `bad_request`."""
        self.transport.stats["bad_frames"] += 1
        self.transport.scores.penalize(peer_id, 2.0, time.monotonic(), f"bad input: {e}")
        self._log_peer(peer_id, st, f"refused bad input from {peer_id}: {e}")
        await self._reply_error(writer, "bad_request", str(e), request_id, meter)

    def _log_peer(self, peer_id: str, st: PeerState, text: str) -> None:
        now = time.monotonic()
        if now - st.last_logged > 60:
            st.last_logged = now
            log.warning(text + " (further problems from this peer are logged at debug level for 60 s)")
        else:
            log.debug(text)

    async def refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: str, message: str) -> None:
        """An error reply to a stream refused before its call was read, then its close once the
        caller hung up (or after linger_s): a stream closed with the caller's request unread is
        reset, and a reset may overtake the reply that says why."""
        try:
            await self._reply_error(writer, code, message, 0)
            await FrameReader(reader, writer, self.config.max_frame_size, lambda n: None).drain(self.config.linger_s, LINGER_BYTES)
        finally:
            close(writer)

    async def _reply_error(self, writer: asyncio.StreamWriter, code: str, message: str, request_id: int, meter: Meter | None = None) -> None:
        try:
            await asyncio.wait_for(write(writer, Error(code=code, message=message[:1000], request_id=request_id), self.config.max_frame_size, meter), 5)
        except Exception:  # best effort: the peer may be gone or not reading
            pass

    async def close(self) -> None:
        """Cancel the streams being served, and wait for them to end."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
