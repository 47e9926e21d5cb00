"""Frames on a stream, both ways: `FrameReader` reads whole messages off a stream straight into a
`Decoder`'s buffers, `write` puts one on it without copying its tensor chunks, `close` lets a
stream go whatever state it is in. Both count the stream's bytes into its `Meter` (traffic.py):
every frame of a call passes here, whatever the plane. Used by the serving side, the calls and the pipes of
node/net/transport.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from protocol import Decoder, Message, RemoteProtocolError
from protocol.framing import PREFIX_SIZE, encode_buffers

from . import compat
from .rpc import RPCError
from .traffic import Meter


class FrameReader(asyncio.BufferedProtocol):
    """Reads whole messages off a stream through a `Decoder`, taking the stream's reading over
    from its StreamReader: the transport reads straight into the decoder's buffers (a frame's
    body lands in its own buffer, copied once, by the kernel; tensor chunks in the messages are
    views of it). The StreamWriter keeps working: write flow control and connection loss are
    passed on to the stream's own protocol.

    `on_bytes(+n)` is called for bytes read, `on_bytes(-n)` when they are handed on as a
    message: what is counted is what this stream holds in memory right now. Reading pauses
    while a decoded message waits to be taken (at most one frame is read ahead). `meter`
    counts every byte read, for good (the node's traffic)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_size: int, on_bytes: Callable[[int], None] | None = None,
                 meter: Meter | None = None):  # fmt: skip
        self.decoder = Decoder(max_frame_size)
        self.meter = meter
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
            if meter is not None:
                meter.received(len(leftover))
            self._got(len(leftover), lambda: self.decoder.feed(leftover))

    # -- protocol callbacks (the transport calls these) ------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._error is not None:
            if self._discard is None:
                self._discard = bytearray(1 << 16)
            return memoryview(self._discard)
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.received(nbytes)
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


async def write(writer: asyncio.StreamWriter, msg: Message, max_frame_size: int, meter: Meter | None = None) -> None:
    buffers = encode_buffers(msg, max_frame_size)
    writer.writelines(buffers)  # tensor chunks go out without a copy
    if meter is not None:
        meter.sent(PREFIX_SIZE + int.from_bytes(buffers[0], "big"))  # (the first buffer is the length prefix)
    await writer.drain()


def close_if_opened(task: asyncio.Task) -> None:
    """A losing stream open that succeeded anyway: close its stream."""
    if not task.cancelled() and task.exception() is None:
        close(task.result()[1])


def close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # the other side may have gone already; nothing left to release
        pass
