"""Relay hops (node/net/relay.py) over real p2pd on loopback: a peer nobody can dial (client mode: it
listens nowhere) is called through the relay it keeps a connection to, unary calls and pipes,
megabytes each way, and serves the calls as the caller's own; hellos that a relay forged, sent
to the wrong peer, replayed or kept too long are refused with the reason (and get the relay
banned), and a relay refuses to carry a hello that is not its caller's; in an owned swarm a
relay carries members only. The NAT case, in network namespaces, is in
tests/test_swarm_relay.py."""

import asyncio
import contextlib
import dataclasses
import os
import time

import pytest

from node.net.host import Host, HostConfig, PeerUnreachable
from node.net.relay import HOP_PROTOCOL, RELAYED_PROTOCOL, circuit_addr, frame_hello
from node.net.transport import RPC_PROTOCOL, RemoteError, Transport, TransportConfig
from protocol import Ack, Decoder, Error, Ping, Pong, Probe, SigningKey, StateChunk, encode
from protocol.records import RelayHello
from protocol.signatures import peer_id_from_public_key
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)

MB = 1 << 20
CHUNK = StateChunk(name="x", offset=0, total_size=0, sha256="0" * 64)  # a call whose handler records its caller
BULKY = StateChunk(name="x", offset=0, total_size=4 << 20, sha256="0" * 64, data=bytes(4 << 20))  # still being sent when refused


@contextlib.asynccontextmanager
async def serving(hosts: list, relay: int):
    """A started Transport on each of `hosts` (the one at index `relay` serves relay hops);
    the transports, then the hosts, closed afterwards."""
    transports = []
    try:
        transports += [Transport(h, TransportConfig(relay_service=i == relay)) for i, h in enumerate(hosts)]
        for t in transports:
            await t.start()
        yield transports
    finally:
        for t in transports:
            await t.close()
        for h in hosts:
            await h.shutdown()


@contextlib.asynccontextmanager
async def hidden_behind_relay(swarm_id: str = ""):
    """Four hosts: a relay; a peer nobody can dial (client mode: it listens nowhere) that keeps
    a connection to the relay (`keep_relays`); two more peers. Yields (hosts, their transports,
    the relay's multiaddr); everything closed afterwards."""
    hosts = [await Host.start(SigningKey.generate(), HostConfig(swarm_id=swarm_id))]
    try:
        relay_maddr = next(m for m in await hosts[0].visible_maddrs() if "/p2p/" in m)
        hosts.append(await Host.start(SigningKey.generate(), HostConfig(initial_peers=(relay_maddr,), client_mode=True, relays=(relay_maddr,), swarm_id=swarm_id)))
        for _ in range(2):
            hosts.append(await Host.start(SigningKey.generate(), HostConfig(initial_peers=(relay_maddr,), swarm_id=swarm_id)))
    except BaseException:
        for h in hosts:
            await h.shutdown()
        raise
    async with serving(hosts, relay=0) as transports:
        keeper = asyncio.create_task(transports[1].keep_relays([relay_maddr]))
        try:
            yield hosts, transports, relay_maddr
        finally:
            keeper.cancel()


def callers_of(transport: Transport) -> list[str]:
    """The peers whose CHUNK calls `transport` serves, in order (a list that fills as they come)."""
    seen: list[str] = []

    async def chunk(ctx):
        seen.append(ctx.peer_id)
        return Ack()

    transport.on(StateChunk, chunk)
    return seen


async def _replies(reader: asyncio.StreamReader, timeout: float = 10.0) -> list:
    """The first message a stream carries ([] if it ends without one)."""
    dec, out = Decoder(), []
    async with asyncio.timeout(timeout):
        while not out and (data := await reader.read(1 << 16)):
            out += dec.feed(data)
    return out


def test_a_peer_nobody_can_dial_is_called_through_its_relay_both_ways_and_in_bulk():
    async def main():
        async with hidden_behind_relay() as (hosts, transports, relay_maddr):
            relay_host, hidden, caller, stranger = hosts
            t_relay, t_hidden, t_caller, t_stranger = transports
            seen = callers_of(t_hidden)
            assert await hidden.visible_maddrs() == [circuit_addr(relay_maddr)]  # listens nowhere: only its relay's circuit

            # without the route (its member record's addresses), nothing reaches it
            with pytest.raises(PeerUnreachable):
                await t_stranger.call(hidden.peer_id, Ping(), timeout=10)

            caller.learn_routes(hidden.peer_id, await hidden.visible_maddrs())
            assert caller.routes[hidden.peer_id] == (relay_host.peer_id,)
            assert isinstance(await t_caller.call(hidden.peer_id, Ping(), timeout=20), Pong)
            await t_caller.call(hidden.peer_id, CHUNK, timeout=20)
            assert seen == [caller.peer_id]  # served as the caller's own call, not the relay's

            # 4 MB each way, as a unary call and twice on a pipe (the second reuses it)
            before = t_relay.stats["relayed_bytes"]
            reply = await t_caller.call(hidden.peer_id, Probe(data=os.urandom(4 * MB), want=4 * MB), timeout=60)
            assert len(reply.data) == 4 * MB
            for _ in range(2):
                reply = await t_caller.send(hidden.peer_id, Probe(data=os.urandom(4 * MB), want=4 * MB), timeout=60, reuse=True)
                assert len(reply.data) == 4 * MB
            assert t_relay.stats["relayed_bytes"] - before >= 24 * MB, dict(t_relay.stats)
            assert t_caller.stats["pipes_opened"] == 1 and t_caller.stats["relay_opens"] >= 3, dict(t_caller.stats)
            assert t_hidden.stats["relayed_served"] >= 5 and t_hidden.stats["relayed_refused"] == 0, dict(t_hidden.stats)
            # both ends count those calls as relayed, the same bytes, and not also as libp2p
            sent, got = t_caller.traffic.bytes, t_hidden.traffic.bytes
            for a, b in (("sent", "received"), ("received", "sent")):
                assert sent[("relayed", hidden.peer_id, a)] == got[("relayed", caller.peer_id, b)] > 12 * MB
                assert sent[("libp2p", hidden.peer_id, a)] == got[("libp2p", caller.peer_id, b)] == 0

            # a relay that serves no hops: the call fails at once, saying so
            caller.routes[hidden.peer_id] = (stranger.peer_id,)
            with pytest.raises(PeerUnreachable):
                await t_caller.call(hidden.peer_id, Ping(), timeout=10)

    asyncio.run(main())


def test_forged_misdirected_replayed_and_stale_hellos_are_refused_naming_why():
    async def main():
        hosts = await start_hosts(4)
        target, relay_host, origin, liar = hosts
        async with serving(hosts, relay=1) as transports:
            t_target, t_relay = transports[:2]
            seen = callers_of(t_target)
            sid = target.config.swarm_id

            def hello(key: SigningKey, to: str, **changes) -> RelayHello:
                h = RelayHello(sid, "", to, RPC_PROTOCOL, time.time(), os.urandom(16)).sign(key)
                return dataclasses.replace(h, **changes)

            async def relayed(h: RelayHello, then=None) -> list:
                """What the target answers a stream the liar carries to it with hello `h` (and `then`)."""
                reader, writer = await liar.open_stream(target.peer_id, RELAYED_PROTOCOL)
                writer.write(frame_hello(h.to_bytes()) + (encode(then) if then else b""))
                await writer.drain()
                try:
                    return await _replies(reader)
                finally:
                    writer.close()

            def refused(replies: list, why: str) -> None:
                assert len(replies) == 1 and isinstance(replies[0], Error) and why in replies[0].message, replies

            good = hello(origin.key, target.peer_id)
            refused(await relayed(hello(origin.key, relay_host.peer_id)), "not us")  # another peer's hello
            refused(await relayed(dataclasses.replace(good, nonce=os.urandom(16))), "forged")  # altered after signing
            refused(await relayed(dataclasses.replace(good, peer_id=liar.peer_id)), "public key does not match")
            stale = RelayHello(sid, "", target.peer_id, RPC_PROTOCOL, time.time() - 600, os.urandom(16)).sign(origin.key)
            refused(await relayed(stale), "old")
            # a good one is served as the origin's call, once
            replies = await relayed(good, CHUNK)
            assert len(replies) == 1 and isinstance(replies[0], Ack), replies
            assert seen == [origin.peer_id]
            refused(await relayed(good, BULKY), "replay")  # (the rest of its call still on its way)
            assert seen == [origin.peer_id]
            assert t_target.stats["relayed_refused"] == 5 and t_target.stats["relayed_served"] == 1

            # the relay carries only its caller's own hello
            reader, writer = await liar.open_stream(relay_host.peer_id, HOP_PROTOCOL)
            writer.write(frame_hello(hello(origin.key, target.peer_id).to_bytes()))
            await writer.drain()
            refused(await _replies(reader), "not the caller's")
            writer.close()
            assert t_relay.stats["relay_refused"] == 1 and t_relay.stats["relayed_streams"] == 0

            # the peer that carried five bad hellos is banned like any peer sending bad frames;
            # the origin it tried to speak for is still served
            with pytest.raises(RemoteError, match="banned"):
                await transports[3].call(target.peer_id, Ping(), timeout=10)
            assert isinstance(await transports[2].call(target.peer_id, Ping(), timeout=10), Pong)

    asyncio.run(main())


def test_a_relay_carries_streams_only_to_peers_that_keep_a_connection_to_it():
    async def main():
        hosts = await start_hosts(2)
        relay_host, caller = hosts
        async with serving(hosts, relay=0) as transports:
            nobody = peer_id_from_public_key(SigningKey.generate().public_key)
            caller.learn_routes(nobody, [circuit_addr(next(m for m in await relay_host.visible_maddrs() if "/p2p/" in m))])
            with pytest.raises(RemoteError) as e:
                await transports[1].call(nobody, Ping(), timeout=30)
            assert e.value.code == "not_found" and "carries streams only to peers that keep a connection to it" in e.value.message, e.value
            assert transports[0].stats["relay_refused"] == 1
            # a stream closed before its hello is an open its caller gave up, not a refusal
            _, writer = await caller.open_stream(relay_host.peer_id, HOP_PROTOCOL)
            writer.close()
            deadline = time.monotonic() + 10
            while transports[0].stats["relay_abandoned"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert transports[0].stats["relay_abandoned"] == 1 and transports[0].stats["relay_refused"] == 1, dict(transports[0].stats)

    asyncio.run(main())


def test_in_an_owned_swarm_a_relay_carries_members_only_and_the_target_serves_members_only():
    from node.net.gate import NOT_PRESENTED, MemberGate
    from protocol.tokens import issue_certificate

    owner = SigningKey.generate()
    swarm = f"lab@{peer_id_from_public_key(owner.public_key)}"

    async def main():
        async with hidden_behind_relay(swarm) as (hosts, transports, _):
            relay_host, hidden, member, stranger = hosts
            for t in transports:
                t.use_gate(MemberGate(swarm))
            for t in transports[:3]:  # the stranger has no certificate
                t.gate.credential = issue_certificate(owner, swarm, t.peer_id, "replica", time.time()).to_bytes()
            t_relay, t_hidden, t_member, t_stranger = transports
            seen = callers_of(t_hidden)
            for h in (member, stranger):
                h.learn_routes(hidden.peer_id, await hidden.visible_maddrs())
            assert isinstance(await t_member.call(hidden.peer_id, CHUNK, timeout=20), Ack)
            assert seen == [member.peer_id]
            for request in (CHUNK, BULKY):  # the refusal reaches the stranger even while it is still sending
                with pytest.raises(RemoteError, match=f"relay: {NOT_PRESENTED}"):
                    await t_stranger.call(hidden.peer_id, request, timeout=20)
            assert seen == [member.peer_id] and t_relay.stats["relay_refused"] == 2 and t_hidden.stats["relayed_served"] >= 2

    asyncio.run(main())
