"""An owned swarm's gate on real libp2p transports: a caller presents its certificate once and
is served; one that has none, or a bad one, is refused with the reason before any handler runs;
a callee that forgot the caller (restarted) gets the certificate again without the call failing;
a renewed certificate is presented anew; a revoked peer is refused."""

import asyncio
import time

import pytest

from node.net.gate import NOT_PRESENTED, MemberGate
from node.net.transport import RemoteError, Transport
from protocol import Ack, Hello, SigningKey
from protocol.signatures import peer_id_from_public_key
from protocol.tokens import issue_certificate
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(60)

OWNER = SigningKey.generate()
SWARM = f"lab@{peer_id_from_public_key(OWNER.public_key)}"


def test_members_are_served_after_presenting_and_others_are_refused_with_the_reason():
    async def main():
        hosts = await start_hosts(3)
        server, member, stranger = (Transport(h) for h in hosts)
        served = []

        async def on_hello(ctx):
            served.append(ctx.peer_id)
            return Ack()

        try:
            for t in (server, member, stranger):
                await t.start()
            gate = MemberGate(SWARM)
            server.use_gate(gate)
            server.on(Hello, on_hello)
            hello = Hello(peer_id="x", swarm_id=SWARM)
            member.use_gate(MemberGate(SWARM))
            member.gate.credential = issue_certificate(OWNER, SWARM, member.peer_id, "replica", time.time()).to_bytes()
            assert isinstance(await member.call(server.peer_id, hello, 10), Ack)
            assert await member.call(server.peer_id, hello, 10) and member.stats["calls_made"] == 3  # one proof, two calls
            # a stranger: refused before the handler runs, with the reason
            with pytest.raises(RemoteError, match=f"unauthorized: {NOT_PRESENTED}"):
                await stranger.call(server.peer_id, hello, 10)
            stranger.use_gate(MemberGate(SWARM))
            stranger.gate.credential = issue_certificate(SigningKey.generate(), SWARM, stranger.peer_id, "replica", time.time()).to_bytes()
            with pytest.raises(RemoteError, match="membership certificate refused: forged"):
                await stranger.call(server.peer_id, hello, 10)
            assert served == [member.peer_id] * 2 and gate.refused == 2
            # the server forgets the member (a restart): the member presents again, the call goes through
            gate.admitted.clear()
            assert isinstance(await member.call(server.peer_id, hello, 10), Ack) and len(served) == 3
            # a renewed certificate is presented before the next call
            member.gate.credential = issue_certificate(OWNER, SWARM, member.peer_id, "replica", time.time() + 1).to_bytes()
            before = gate.admitted[member.peer_id]
            await member.call(server.peer_id, hello, 10)
            assert gate.admitted[member.peer_id] > before
            # revoked: refused whatever it presents
            gate.set_revoked(frozenset({member.peer_id}))
            with pytest.raises(RemoteError, match="is revoked by the owner"):
                await member.call(server.peer_id, hello, 10)
            assert len(served) == 4
        finally:
            for t in (server, member, stranger):
                await t.close()
            for h in hosts:
                await h.shutdown()

    asyncio.run(main())
