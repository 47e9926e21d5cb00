"""Each message type has one owner on a transport; a service registers and unregisters its
handlers as one group. Real p2pd hosts, real calls."""

import asyncio
import contextlib

import pytest

from node.net.transport import HandlerTaken, RemoteError, Transport
from protocol import Ack, CheckpointQuery, StateChunk, StateRequest
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def server_and_client():
    """Two started transports on real hosts; closed afterwards."""
    hosts = await start_hosts(2)
    server, client = Transport(hosts[0]), Transport(hosts[1])
    try:
        await server.start()
        await client.start()
        yield server, client
    finally:
        await client.close()
        await server.close()
        for h in hosts:
            await h.shutdown()


def test_a_taken_message_type_is_refused_and_a_group_registers_all_or_nothing():
    async def main():
        async def first(ctx):
            return Ack(info={"by": "first"})

        async def second(ctx):
            return Ack(info={"by": "second"})

        async with server_and_client() as (server, client):
            reg = server.serve({CheckpointQuery: first, StateRequest: first}, owner="state")
            with pytest.raises(HandlerTaken, match="CheckpointQuery"):
                server.on(CheckpointQuery, second)
            # a group with one taken type registers none of its types
            with pytest.raises(HandlerTaken, match="StateRequest"):
                server.serve({StateChunk: second, StateRequest: second}, owner="other")
            assert StateChunk not in server.handlers
            reply = await client.call(server.peer_id, CheckpointQuery(), timeout=10)
            assert reply.info == {"by": "first"}  # never silently replaced
            reg.close()
            assert CheckpointQuery not in server.handlers and StateRequest not in server.handlers
            with pytest.raises(RemoteError, match="unsupported"):
                await client.call(server.peer_id, CheckpointQuery(), timeout=10)
            with server.serve({CheckpointQuery: second}, owner="next"):  # free again
                reply = await client.call(server.peer_id, CheckpointQuery(), timeout=10)
                assert reply.info == {"by": "second"}
            assert CheckpointQuery not in server.handlers

    asyncio.run(main())
