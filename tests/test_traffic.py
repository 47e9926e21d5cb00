"""Counting a node's traffic at its choke points (node/net/streams.py): every frame written and
every byte read on a stream goes into its `Meter`, over real sockets. The planes as transports
pick them (direct, libp2p, relayed) are checked in tests/test_direct.py and tests/test_relay.py."""

import asyncio

import pytest

from node.net.streams import FrameReader, write
from node.net.traffic import PLANES, Traffic
from protocol import Ack, Ping, StateChunk, encode
from protocol.framing import DEFAULT_MAX_FRAME_SIZE

pytestmark = pytest.mark.timeout(30)

MESSAGES = [Ping(nonce=7, sent_at=1.0), StateChunk(name="x", offset=0, total_size=1 << 20, sha256="0" * 64, data=bytes(1 << 20)), Ack(info={"k": "v"})]


async def _pair():
    """Both ends of a real loopback TCP connection: (reader, writer) each."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
    a = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    b = await accepted
    server.close()
    return a, b


def test_frames_written_and_read_are_counted_once_each_at_their_size_on_the_stream_meter():
    async def main():
        (ra, wa), (rb, wb) = await _pair()
        ours, theirs = Traffic(), Traffic()
        out = ours.meter("direct", "peer-b")
        frames = FrameReader(rb, wb, DEFAULT_MAX_FRAME_SIZE, meter=theirs.meter("direct", "peer-a"))
        for msg in MESSAGES:
            await write(wa, msg, DEFAULT_MAX_FRAME_SIZE, out)
        got = [await frames.next() for _ in MESSAGES]
        size = sum(len(encode(m)) for m in MESSAGES)
        assert [type(m) for m in got] == [type(m) for m in MESSAGES]
        assert dict(ours.bytes) == {("direct", "peer-b", "sent"): size}
        assert dict(theirs.bytes) == {("direct", "peer-a", "received"): size}
        assert ours.totals() == (size, 0) and theirs.totals() == (0, size)
        assert set(ours.by_plane()) == set(PLANES) and ours.by_plane()["direct"] == {"sent": size, "received": 0}
        assert ours.by_plane()["libp2p"] == {"sent": 0, "received": 0}
        for w in (wa, wb):
            w.close()

    asyncio.run(main())


def test_bytes_read_before_the_frame_reader_took_the_stream_over_and_after_a_bad_frame_are_counted_too():
    async def main():
        (ra, wa), (rb, wb) = await _pair()
        theirs = Traffic()
        wa.write(encode(MESSAGES[0]))
        await wa.drain()
        for _ in range(100):  # until the StreamReader has read it ahead into its own buffer
            if rb._buffer:
                break
            await asyncio.sleep(0.01)
        frames = FrameReader(rb, wb, DEFAULT_MAX_FRAME_SIZE, meter=theirs.meter("libp2p", "peer-a"))
        assert isinstance(await frames.next(), Ping)
        garbage = b"\xff" * 64
        wa.write(garbage)
        await wa.drain()
        with pytest.raises(Exception):
            await frames.next()
        expected = len(encode(MESSAGES[0])) + len(garbage)
        for _ in range(100):
            if theirs.bytes[("libp2p", "peer-a", "received")] == expected:
                break
            await asyncio.sleep(0.01)
        assert theirs.totals() == (0, expected)
        for w in (wa, wb):
            w.close()

    asyncio.run(main())
