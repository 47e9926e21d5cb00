"""node/net/compat.py against the installed library versions: real asyncio streams over a real
socket pair, hivemind's real P2P class and real p2pd daemons."""

import asyncio
import socket

import pytest

from node.net.compat import CompatError, add_p2pd_flags, p2pd_connect, stream_reader_paused, take_stream_reader_buffer
from node.net.host import P2P, PeerUnreachable
from protocol import SigningKey
from protocol.signatures import peer_id_from_public_key
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)


async def _reader_over_socketpair(data: bytes, limit: int = 1 << 16):
    """A StreamReader on one end of a socket pair whose other end already sent `data`."""
    ours, theirs = socket.socketpair()
    theirs.sendall(data)
    reader, writer = await asyncio.open_connection(sock=ours, limit=limit)
    return reader, writer, theirs


def test_take_stream_reader_buffer_hands_over_what_was_read_ahead():
    async def main():
        reader, writer, theirs = await _reader_over_socketpair(b"hello world")
        try:
            assert await reader.readexactly(5) == b"hello"  # one recv took all 11 bytes
            assert take_stream_reader_buffer(reader) == b" world"
            assert take_stream_reader_buffer(reader) == b""  # taken: the reader holds nothing now
            theirs.sendall(b"!")
            assert await reader.readexactly(1) == b"!"  # and keeps working
        finally:
            writer.close()
            theirs.close()

    asyncio.run(main())


def test_stream_reader_paused_follows_the_readers_flow_control():
    async def main():
        small, small_w, small_peer = await _reader_over_socketpair(b"x" * 4096, limit=16)
        roomy, roomy_w, roomy_peer = await _reader_over_socketpair(b"y" * 64)
        try:
            assert await small.readexactly(1) == b"x"  # over twice its limit buffered: it paused reading
            assert stream_reader_paused(small) and not small_w.transport.is_reading()
            assert await roomy.readexactly(1) == b"y"
            assert not stream_reader_paused(roomy) and roomy_w.transport.is_reading()
        finally:
            for w, peer in ((small_w, small_peer), (roomy_w, roomy_peer)):
                w.close()
                peer.close()

    asyncio.run(main())


def test_add_p2pd_flags_reaches_hivemind_p2pd_argv():
    class P(P2P):  # a subclass: the flags stay off the class other tests start p2pd with
        pass

    add_p2pd_flags(P, noise=False)
    args = P._make_process_args("p2pd", tls=True, listen="/ip4/127.0.0.1/tcp/0")
    assert args[0] == "p2pd" and "-noise=0" in args and "-tls=1" in args
    assert "-noise=0" not in P2P._make_process_args("p2pd", tls=True)
    add_p2pd_flags(P, tls=False)  # ours override hivemind's own
    assert "-tls=0" in P._make_process_args("p2pd", tls=True)


def test_shims_name_the_missing_internal():
    class Other:
        pass

    with pytest.raises(CompatError, match="_make_process_args"):
        add_p2pd_flags(Other, noise=False)
    with pytest.raises(CompatError, match="_client"):
        asyncio.run(p2pd_connect(Other(), "peer", []))
    with pytest.raises(CompatError, match="_buffer"):
        take_stream_reader_buffer(Other())
    assert stream_reader_paused(Other())  # unknown: resume once, harmless


def test_p2pd_connect_lets_two_unrelated_hosts_open_a_stream():
    async def main():
        a, b = await start_hosts(1) + await start_hosts(1)  # two separate DHTs: b cannot find a alone
        try:
            async def echo(peer_id, reader, writer):
                writer.write(await reader.readexactly(4))
                await writer.drain()
                writer.close()

            await a.add_stream_handler("compat-echo", echo)
            await b.connect(a.peer_id, await a.visible_maddrs())
            reader, writer = await b.open_stream(a.peer_id, "compat-echo")
            writer.write(b"ping")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
            writer.close()
            nobody = peer_id_from_public_key(SigningKey.generate().public_key)
            with pytest.raises(PeerUnreachable):  # p2pd's own refusal still comes through
                await b.connect(nobody, ["/ip4/127.0.0.1/tcp/1"])
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(main())
