"""Pipes: streams to a peer kept open between calls (`Transport.send(..., reuse=True)`: bulk
transfers such as tensor parts), over direct TCP sealed with AES-GCM where the peer can be
reached (node/net/direct.py; the kernel can pace those), else over libp2p. `Pipes` holds a
transport's idle pipes, its direct listener and the addresses it announces for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol import DirectAddress, DirectOpen, Error, Message, RemoteProtocolError
from protocol.sealing import KEY_BYTES

from . import direct, relay
from .host import HostError, PeerUnreachable, tcp_ip4s
from .rpc import PIPE_PROTOCOL, CallContext, CallTimeout, RemoteError, RPCError, check_reply
from .streams import FrameReader, close, write

if TYPE_CHECKING:
    from .transport import Transport

log = logging.getLogger(__name__)


@dataclass
class Pipe:
    """Our end of a pipe (see `Pipes.call`)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    frames: FrameReader
    next_id: int = 1
    used: float = 0.0
    direct: bool = False  # over direct TCP (can be paced), not a libp2p stream
    pace: int = 0  # the socket's pacing rate now, bytes/s (0: none)


class Pipes:
    """A transport's pipes to its peers, and its direct listener for theirs."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.config = transport.config
        self.idle: dict[str, list[Pipe]] = defaultdict(list)  # peer -> idle pipes to it
        self.listener: direct.DirectListener | None = None
        self.addrs: tuple[str, ...] = ()  # where others reach our listener
        self._no_direct: dict[str, float] = {}  # peer -> until when its pipes skip the direct attempt

    async def listen(self) -> None:
        """Listen for direct connections (TransportConfig.direct) on the host's IPv4 addresses."""
        host = self.transport.host
        ips = host.listen_ips() if self.config.direct else []
        if ips:
            self.listener = direct.DirectListener(self.transport.server.serve_pipe, self.config.direct_congestion)
            try:
                await self.listener.start(ips, self.config.direct_port)
            except OSError as e:
                await self.listener.close()
                self.listener = None
                raise HostError(f"cannot listen for direct connections on {'/'.join(ips)} port {self.config.direct_port}: {os.strerror(e.errno) if e.errno else e}") from None
            self.addrs = await self._announced(self.listener.port)

    async def _announced(self, port: int) -> tuple[str, ...]:
        """Where others reach our direct listener: the IPv4 addresses libp2p announces, on our
        port; loopback last (a peer on another machine that tries it reaches its own)."""
        ips = [ip for ip in tcp_ip4s([m for m in await self.transport.host.visible_maddrs() if relay.CIRCUIT not in m]) if ip != "0.0.0.0"]
        ips.sort(key=lambda ip: ip.startswith("127."))
        return tuple(f"{ip}:{port}" for ip in ips[:16])

    async def on_direct_open(self, ctx: CallContext) -> Message:
        if self.listener is None:
            raise RPCError("unsupported", "no direct listener here")
        req: DirectOpen = ctx.request
        try:
            self.listener.issue(ctx.peer_id, req.ticket, req.key)
        except OverflowError as e:
            raise RPCError("overloaded", str(e)) from None
        except ValueError as e:
            raise RPCError("bad_request", str(e)) from None
        return DirectAddress(addrs=self.addrs)

    async def call(self, peer_id: str, request: Message, more: Iterable[Message], timeout: float, pace: float | None = None) -> Message:
        """`send` on a pipe: a stream to the peer that outlives the call, so the next call skips
        opening a stream and starts with the flow-control window this one grew (a fresh libp2p
        stream starts at 256 KiB and takes round trips to widen). A pipe carries one call at a
        time; concurrent calls take other pipes. Frames carry the call's id; the reply must too."""
        t = self.transport
        deadline = time.monotonic() + timeout
        idle = self.idle[peer_id]
        pipe = None
        while idle and pipe is None:
            candidate = idle.pop()
            if time.monotonic() - candidate.used < self.config.pipe_idle_s / 2:
                pipe = candidate
            else:
                close(candidate.writer)
        reused = pipe is not None
        try:
            async with asyncio.timeout(timeout):
                if pipe is None:
                    reader, writer = await self._open(peer_id)
                    pipe = Pipe(reader, writer, FrameReader(reader, writer, self.config.max_frame_size, meter=t.meter(peer_id, writer)))
                    pipe.direct = isinstance(writer.transport, direct.SealedTransport)
                    t.stats["pipes_opened"] += 1
                if pipe.direct and pipe.pace != int(pace or 0):
                    pipe.pace = int(pace or 0)
                    direct.set_pacing(pipe.writer.transport, pipe.pace)
                rid = pipe.next_id
                pipe.next_id += 1
                try:
                    for msg in (request, *more):
                        await write(pipe.writer, msg.with_request_id(rid), self.config.max_frame_size, pipe.frames.meter)
                    reply = await pipe.frames.next()
                except (ConnectionError, BrokenPipeError) as e:
                    reply = None
                    with contextlib.suppress(ConnectionError, TimeoutError, RemoteProtocolError):
                        reply = await asyncio.wait_for(pipe.frames.next(), 2.0)  # a refusal says why
                    if reply is None:
                        raise ConnectionError(f"{peer_id} closed the pipe: {e}") from None
                if reply is None or isinstance(reply, Error):  # the server ends a pipe after an error
                    close(pipe.writer)
                    check_reply(peer_id, reply)
                if reply.request_id != rid:
                    raise RemoteProtocolError(f"reply to call {reply.request_id} on call {rid}'s turn", "request_id")
        except TimeoutError:
            if pipe is not None:
                close(pipe.writer)
            t.dialer.mark_dropped(peer_id)  # (its next stream: see Dialer.check_route)
            raise CallTimeout(f"{type(request).__name__} with {peer_id} timed out after {timeout:.1f} s") from None
        except ConnectionError:
            if pipe is not None:
                close(pipe.writer)
            if reused and deadline - time.monotonic() > 0:  # the peer closed an idle pipe, or restarted: once more, on a fresh one
                return await self.call(peer_id, request, more, deadline - time.monotonic(), pace)
            raise
        except BaseException as e:
            if pipe is not None:
                close(pipe.writer)
            if isinstance(e, RemoteProtocolError):
                t.scores.penalize(peer_id, 2.0, time.monotonic(), f"a malformed reply: {e}")
            raise
        pipe.used = t.heard[peer_id] = time.monotonic()
        if len(idle) < self.config.pipes_per_peer:
            idle.append(pipe)
        else:
            close(pipe.writer)
        t.stats["calls_made"] += 1
        return reply

    def paces(self, peer_id: str) -> bool:
        """Whether `send(..., reuse=True, pace=...)` to this peer is paced: its pipes go over
        direct TCP (none of its idle pipes is a libp2p stream) and the kernel can pace sockets."""
        if self.listener is None or not direct.CAN_PACE or self._no_direct.get(peer_id, 0.0) > time.monotonic():
            return False
        return all(p.direct for p in self.idle.get(peer_id, ()))

    async def _open(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new pipe's stream: direct where the peer takes it, else a libp2p stream."""
        t = self.transport
        if self.listener is not None and self._no_direct.get(peer_id, 0.0) <= time.monotonic():
            ticket, key = os.urandom(direct.TICKET_BYTES), os.urandom(KEY_BYTES)
            t0 = time.monotonic()
            try:
                reply = await t.call(peer_id, DirectOpen(ticket=ticket, key=key), self.config.direct_connect_s)
                if not isinstance(reply, DirectAddress):
                    raise ConnectionError(f"answered DirectOpen with {type(reply).__name__}")
                left = self.config.direct_connect_s - (time.monotonic() - t0)
                stream = await direct.dial(list(reply.addrs), ticket, key, left, self.config.direct_congestion)
                t.stats["direct_pipes"] += 1
                if isinstance(peer := stream[1].get_extra_info("peername"), tuple):
                    t.dialer.reached[peer_id] = (peer[0], peer[1])
                return stream
            except (CallTimeout, PeerUnreachable) as e:
                # the peer did not answer over libp2p either (frozen, its link down): nothing
                # says a direct connection cannot work once it is back. Remembering this for
                # direct_retry_s kept its pipes on libp2p, a round slower, long after a cut
                t.stats["direct_fallbacks"] += 1
                log.debug("no direct connection to %s (%s): the peer did not answer", peer_id[-8:], e)
            except (RemoteError, RemoteProtocolError, OSError) as e:
                self._no_direct[peer_id] = time.monotonic() + self.config.direct_retry_s
                t.stats["direct_fallbacks"] += 1
                log.info("no direct connection to %s (%s): its pipes use libp2p for %.0f s", peer_id[-8:], e, self.config.direct_retry_s)
        return await t.dialer.open_stream(peer_id, PIPE_PROTOCOL)

    def drop(self, peer_id: str) -> None:
        """Close our idle pipes to the peer."""
        idle = self.idle.get(peer_id, [])
        for pipe in idle:
            close(pipe.writer)
        idle.clear()

    async def close(self) -> None:
        """Stop listening; close every idle pipe."""
        if self.listener is not None:
            await self.listener.close()
        for pipes in self.idle.values():
            for pipe in pipes:
                close(pipe.writer)
        self.idle.clear()
