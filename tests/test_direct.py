"""The direct data plane: sealed records (sans-IO), and pipes over direct TCP between real
transports (real p2pd for the ticket call), with their fallbacks and refusals."""

import asyncio
import hashlib
import os
import socket
import struct

import pytest

from node.net import direct
from node.net.transport import Transport, TransportConfig
from protocol import Ack, DirectAddress, DirectOpen, EncodedTensor, RemoteProtocolError, TensorPart
from protocol.sealing import DIALER, LISTENER, MAX_RECORD, Opener, Sealer
from protocol.tensors import split
from tests.swarm import start_hosts

# -- sealed records, no I/O ----------------------------------------------------------------------


def _wire(key, buffers, direction=DIALER):
    return b"".join(Sealer(key, direction).seal(buffers))


def test_sealed_records_open_to_the_same_bytes_however_the_wire_cuts_them():
    key = os.urandom(32)
    buffers = [b"h" * 9, os.urandom(MAX_RECORD * 2 + 123), b"", b"t" * 70000, bytearray(b"x" * 5)]
    wire = _wire(key, buffers)
    for step in (1, 7, 4099, 1 << 20, len(wire)):
        opener, out = Opener(key, DIALER), []
        for i in range(0, len(wire), step):
            out += opener.feed(wire[i : i + step])
        assert b"".join(out) == b"".join(bytes(b) for b in buffers)
        assert opener.buffered == 0
        assert max(len(p) for p in out) <= MAX_RECORD


def test_an_altered_replayed_reordered_or_misdirected_record_is_refused_and_the_stream_stays_broken():
    key = os.urandom(32)
    sealer = Sealer(key, DIALER)
    first, second = b"".join(sealer.seal([b"a" * 100])), b"".join(sealer.seal([b"b" * 100]))

    altered = bytearray(first)
    altered[40] ^= 1
    cases = {
        "altered": bytes(altered),
        "replayed": first + first,
        "reordered": second + first,
        "other direction": _wire(key, [b"a" * 100], LISTENER),
        "other key": _wire(os.urandom(32), [b"a" * 100]),
    }
    for name, wire in cases.items():
        opener = Opener(key, DIALER)
        with pytest.raises(RemoteProtocolError, match="failed authentication"):
            opener.feed(wire)
        with pytest.raises(RemoteProtocolError):  # nothing after a bad record is opened
            opener.feed(second)


def test_the_opener_says_how_many_bytes_the_next_record_still_needs():
    key = os.urandom(32)
    wire = _wire(key, [b"r" * 1000])  # one record: 4-byte length, 1000 bytes, 16-byte tag
    opener = Opener(key, DIALER)
    assert opener.missing() == 4
    assert opener.feed(wire[:2]) == [] and opener.missing() == 2
    assert opener.feed(wire[2:10]) == [] and opener.missing() == len(wire) - 10
    assert opener.feed(wire[10:]) == [b"r" * 1000] and opener.missing() == 4


def test_a_record_length_beyond_the_limit_is_refused_before_waiting_for_it():
    opener = Opener(os.urandom(32), DIALER)
    with pytest.raises(RemoteProtocolError, match="sealed record of"):
        opener.feed(struct.pack(">I", MAX_RECORD + 17))
    with pytest.raises(RemoteProtocolError, match="sealed record of"):
        Opener(os.urandom(32), DIALER).feed(struct.pack(">I", 3) + b"abc")


# -- direct pipes between real transports --------------------------------------------------------


def run(scenario, server_config=None, client_config=None):
    async def main():
        hosts = await start_hosts(2)
        server = Transport(hosts[0], TransportConfig(**(server_config or {})))
        client = Transport(hosts[1], TransportConfig(**(client_config or {})))
        try:
            await server.start()
            await client.start()
            server.on(TensorPart, _digest_parts)
            return await scenario(server, client)
        finally:
            for t in (server, client):
                await t.close()
            for h in hosts:
                await h.shutdown()

    return asyncio.run(main())


async def _digest_parts(ctx):
    """Reads a tensor's parts; answers with their sha256 and the peer it was served for."""
    part, h = ctx.request, hashlib.sha256()
    h.update(part.data)
    while part.index < part.count - 1:
        part = await ctx.receive()
        h.update(part.data)
    return Ack(info={"sha256": h.hexdigest(), "peer": ctx.peer_id})


def _tensor(nbytes: int, name: str):
    data = os.urandom(nbytes)
    return data, split(EncodedTensor("uint8", (nbytes,), "none", data), name, 1 << 20)


async def _send(client, server, nbytes=3 << 20, name="t"):
    data, parts = _tensor(nbytes, name)
    reply = await client.send(server.peer_id, parts[0], parts[1:], timeout=30, reuse=True)
    assert reply.info == {"sha256": hashlib.sha256(data).hexdigest(), "peer": client.peer_id}


async def _raw_connect(server):
    host, _, port = server._direct_addrs[0].rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def _closed_by_peer(reader, within=10.0) -> bool:
    try:
        async with asyncio.timeout(within):
            while await reader.read(1 << 16):
                pass
        return True
    except ConnectionError:
        return True


@pytest.mark.timeout(120)
def test_bulk_calls_go_direct_and_arrive_intact_attributed_to_the_caller():
    async def scenario(server, client):
        for i in range(3):  # the pipe is kept and reused: one direct connection
            await _send(client, server, name=f"t{i}")
        assert client.stats["direct_pipes"] == 1 and client.stats["direct_fallbacks"] == 0
        assert server._direct.accepted == 1
        assert client.stats["pipes_opened"] == 1
        # the frames are counted on the direct plane, the same bytes at both ends; the
        # DirectOpen call before them on libp2p
        sent, got = client.traffic.bytes, server.traffic.bytes
        assert sent[("direct", server.peer_id, "sent")] == got[("direct", client.peer_id, "received")] > 9 << 20
        assert got[("direct", client.peer_id, "sent")] == sent[("direct", server.peer_id, "received")] > 0
        assert 0 < sent[("libp2p", server.peer_id, "sent")] < 1 << 10 and sent[("relayed", server.peer_id, "sent")] == 0
        assert client.traffic.by_plane()["direct"]["sent"] == sent[("direct", server.peer_id, "sent")]
        sock = client._pipes[server.peer_id][0].writer.get_extra_info("socket")
        if _cubic_allowed():  # the congestion control asked for, where the kernel lets us
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"cubic"

    run(scenario)


def _cubic_allowed() -> bool:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            available = f.read().split()
    except OSError:
        return False
    return "cubic" in available and (os.geteuid() == 0 or "cubic" in open("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read().split())


@pytest.mark.timeout(120)
@pytest.mark.skipif(not direct.CAN_PACE, reason="the kernel cannot pace sockets here")
def test_a_paced_call_sets_its_sockets_pacing_rate_and_an_unpaced_one_lifts_it():
    async def scenario(server, client):
        assert client.paces(server.peer_id)
        _, parts = _tensor(1 << 20, "paced")
        await client.send(server.peer_id, parts[0], parts[1:], timeout=30, reuse=True, pace=5e6)
        sock = client._pipes[server.peer_id][0].writer.get_extra_info("socket")

        def pacing() -> int:
            return struct.unpack("=I", sock.getsockopt(socket.SOL_SOCKET, direct.SO_MAX_PACING_RATE, 4))[0]

        assert pacing() == 5_000_000
        await _send(client, server, name="unpaced")  # the same pipe, no pace: no limit again
        assert client.stats["pipes_opened"] == 1 and pacing() == 0xFFFFFFFF

    run(scenario)


@pytest.mark.timeout(120)
def test_direct_connections_per_peer_are_capped_and_the_rest_use_libp2p(monkeypatch):
    monkeypatch.setattr(direct, "MAX_CONNECTIONS_PER_PEER", 1)

    async def scenario(server, client):
        await asyncio.gather(*(_send(client, server, name=f"c{i}") for i in range(2)))  # two pipes at once
        assert client.stats["pipes_opened"] == 2
        assert client.stats["direct_pipes"] == 1 and client.stats["direct_fallbacks"] == 1
        assert server._direct.accepted == 1 and sum(server._direct._open.values()) == 1
        for pipes in client._pipes.values():
            for pipe in pipes:
                pipe.writer.close()
        client._pipes.clear()
        for _ in range(100):  # the server notices the direct connection closed
            if not server._direct._open:
                break
            await asyncio.sleep(0.05)
        assert not server._direct._open

    run(scenario)


@pytest.mark.timeout(120)
def test_a_peer_without_a_direct_listener_is_reached_over_libp2p():
    async def scenario(server, client):
        assert server._direct is None
        await _send(client, server)
        await _send(client, server, name="again")
        assert client.stats["direct_pipes"] == 0
        assert client.stats["direct_fallbacks"] == 1  # tried once, then remembered
        assert not client.paces(server.peer_id)  # a libp2p stream cannot be paced
        sent, got = client.traffic.bytes, server.traffic.bytes
        assert sent[("libp2p", server.peer_id, "sent")] == got[("libp2p", client.peer_id, "received")] > 6 << 20
        assert sent[("direct", server.peer_id, "sent")] == 0

    run(scenario, server_config={"direct": False})


@pytest.mark.timeout(120)
def test_a_peer_that_does_not_answer_the_direct_offer_in_time_gets_direct_pipes_again_later():
    # a peer frozen or cut off does not answer DirectOpen over libp2p either: that pipe uses
    # libp2p, but nothing is remembered against direct connections to it (remembered, its
    # pipes stayed on libp2p for direct_retry_s after the cut, a round slower)
    async def scenario(server, client):
        answer = server.handlers[DirectOpen]

        async def too_late(ctx):
            await asyncio.sleep(1.5)
            return await answer(ctx)

        server.handlers[DirectOpen] = too_late
        await _send(client, server)
        assert client.stats["direct_fallbacks"] == 1 and client.stats["direct_pipes"] == 0
        server.handlers[DirectOpen] = answer
        for pipe in client._pipes.pop(server.peer_id):  # the next call opens a new pipe
            pipe.writer.close()
        await _send(client, server, name="again")
        assert client.stats["direct_pipes"] == 1

    run(scenario, client_config={"direct_connect_s": 0.5})


@pytest.mark.timeout(120)
def test_an_unreachable_direct_address_falls_back_to_libp2p_within_the_connect_budget():
    async def scenario(server, client):
        server._direct_addrs = ("127.0.0.1:1",)  # nothing listens there
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await _send(client, server)
        assert client.stats["direct_fallbacks"] == 1 and client.stats["direct_pipes"] == 0
        assert loop.time() - t0 < 20

    run(scenario)


@pytest.mark.timeout(120)
def test_forged_or_missing_tickets_are_closed_and_the_listener_keeps_serving(monkeypatch):
    monkeypatch.setattr(direct, "HANDSHAKE_S", 0.5)

    async def scenario(server, client):
        reader, writer = await _raw_connect(server)
        writer.write(os.urandom(direct.TICKET_BYTES) + b"x" * 100)
        assert await _closed_by_peer(reader)
        writer.close()
        reader, writer = await _raw_connect(server)  # says nothing: closed after HANDSHAKE_S
        assert await _closed_by_peer(reader, within=5)
        writer.close()
        await _send(client, server)
        assert client.stats["direct_pipes"] == 1 and server._direct.accepted == 1

    run(scenario)


@pytest.mark.timeout(120)
def test_a_flood_of_silent_connections_is_held_to_max_handshakes_and_an_honest_dialer_still_gets_in(monkeypatch):
    """Slowloris on the direct plane: connections that never show a ticket. The listener holds
    at most MAX_HANDSHAKES of them, closing the oldest for each newcomer; an honest dialer, who
    shows its ticket at once, gets its direct pipe in the middle of the flood."""
    monkeypatch.setattr(direct, "MAX_HANDSHAKES", 8)
    monkeypatch.setattr(direct, "HANDSHAKE_S", 60.0)  # (none leaves by the timer in this test)

    async def still_open(reader) -> bool:
        try:
            return not await _closed_by_peer(reader, within=0.3)
        except TimeoutError:
            return True

    async def scenario(server, client):
        silent = [await _raw_connect(server) for _ in range(20)]
        await asyncio.sleep(0.2)
        open_now = [await still_open(reader) for reader, _ in silent]
        assert open_now == [False] * 12 + [True] * 8, open_now  # the twelve oldest closed, one for each newcomer
        await _send(client, server)
        assert client.stats["direct_pipes"] == 1 and server._direct.accepted == 1
        for _, writer in silent:
            writer.close()

    run(scenario)


@pytest.mark.timeout(120)
def test_a_ticket_is_good_for_one_connection_and_a_tampered_stream_is_cut():
    async def scenario(server, client):
        ticket, key = os.urandom(direct.TICKET_BYTES), os.urandom(32)
        reply = await client.call(server.peer_id, DirectOpen(ticket=ticket, key=key), 10)
        assert isinstance(reply, DirectAddress) and reply.addrs
        reader, writer = await _raw_connect(server)
        writer.write(ticket)
        opener = Opener(key, LISTENER)
        confirmation = []
        while not confirmation:
            confirmation = opener.feed(await asyncio.wait_for(reader.read(1 << 16), 10))
        assert confirmation == [direct.ACCEPTED]
        sealed = bytearray(b"".join(Sealer(key, DIALER).seal([b"y" * 1000])))
        sealed[20] ^= 0xFF
        writer.write(bytes(sealed))
        assert await _closed_by_peer(reader)
        writer.close()

        reader, writer = await _raw_connect(server)  # the same ticket again: refused
        writer.write(ticket)
        assert await _closed_by_peer(reader)
        writer.close()
        await _send(client, server)  # everyone else still served, directly
        assert client.stats["direct_pipes"] == 1

    run(scenario)


@pytest.mark.timeout(120)
def test_a_stream_that_ends_inside_a_record_is_closed_not_left_hanging():
    async def scenario(server, client):
        ticket, key = os.urandom(direct.TICKET_BYTES), os.urandom(32)
        await client.call(server.peer_id, DirectOpen(ticket=ticket, key=key), 10)
        reader, writer = await _raw_connect(server)
        writer.write(ticket)
        record = b"".join(Sealer(key, DIALER).seal([b"z" * 1000]))
        writer.write(record[: len(record) // 2])
        writer.write_eof()
        assert await _closed_by_peer(reader)  # the confirmation, then the close
        writer.close()

    run(scenario)


def test_direct_open_messages_validate_their_fields():
    with pytest.raises(Exception, match="ticket"):
        DirectOpen(ticket=b"short", key=os.urandom(32))
    with pytest.raises(Exception, match="addrs"):
        DirectAddress(addrs=("no-port",))
    assert DirectAddress(addrs=("10.0.0.1:4000",)).addrs == ("10.0.0.1:4000",)


@pytest.mark.timeout(120)
def test_a_direct_port_in_use_is_a_clear_start_error():
    from node.net.host import HostError

    async def main():
        hosts = await start_hosts(2)
        first = Transport(hosts[0])
        try:
            await first.start()
            second = Transport(hosts[1], TransportConfig(direct_port=first._direct.port))
            with pytest.raises(HostError, match="cannot listen for direct connections on 127.0.0.1 port .*in use"):
                await second.start()
            await second.close()
        finally:
            await first.close()
            for h in hosts:
                await h.shutdown()

    asyncio.run(main())


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connect is refused
    return port


@pytest.mark.timeout(120)
def test_a_peer_whose_connections_were_dropped_is_dialed_only_once_a_plain_connect_reaches_it(monkeypatch):
    from node.net import dialing
    from node.net.host import PeerUnreachable

    async def scenario(server, client):
        await _send(client, server)  # a direct pipe: the client knows where the server's machine answers
        sid = server.peer_id
        real = client._reached[sid]
        assert f"{real[0]}:{real[1]}" in server._direct_addrs
        await client.reset(sid)  # it stopped answering: our connections to it are dropped
        client._reached[sid] = ("127.0.0.1", _closed_port())  # and the network does not reach it yet
        with pytest.raises(PeerUnreachable, match="no route to"):
            await client.ping(sid, timeout=5)  # refused before libp2p dials (a failed dial bars the next for 5 s)
        assert client.stats["route_checks_failed"] == 1
        client._reached[sid] = real  # the network carries packets again
        assert await client.ping(sid, timeout=5) > 0  # checked, dialed, answered
        assert sid not in client._dropped

        await client.reset(sid)
        client._reached[sid] = ("127.0.0.1", _closed_port())  # a direct address that is what is broken
        monkeypatch.setattr(dialing, "ROUTE_FALLBACK_S", 0.5)
        with pytest.raises(PeerUnreachable, match="no route to"):
            await client.ping(sid, timeout=5)
        await asyncio.sleep(0.6)  # past ROUTE_FALLBACK_S since that failed check
        assert await client.ping(sid, timeout=5) > 0  # libp2p dials it anyway, every ROUTE_FALLBACK_S
        assert await client.ping(sid, timeout=5) > 0  # heard from it: no more checks
        assert client.stats["route_checks_failed"] == 2 and sid not in client._dropped

        await asyncio.sleep(0.6)  # longer than the fallback since that untested dial
        await client.reset(sid)  # silent again: the fallback counts from this silence, not the last
        with pytest.raises(PeerUnreachable, match="no route to"):
            await client.ping(sid, timeout=5)
        assert client.stats["route_checks_failed"] == 3

    run(scenario)
