"""A DHT that lost every neighbour (its link was down: each failed request took a neighbour out
of the routing table) joins again through the peers it knows, with real p2pd and hivemind DHT
processes. hivemind's DHT bootstraps only at start: without this, such a node stays alone."""

import asyncio
import time

import pytest

from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)


async def _forget_everyone(_dht, node) -> int:  # runs in the DHT's process: what a long cut does
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


async def _wait(cond, timeout: float, what: str):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if value := await cond():
            return value
        await asyncio.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_node_whose_dht_lost_every_neighbour_joins_again_and_sees_records():
    async def main():
        hosts = await start_hosts(3)
        first, _, lonely = hosts
        keeper = None
        try:
            assert await lonely.dht_neighbours() > 0
            for h in hosts:  # the cut as everyone sees it: nobody has the lonely node, it has nobody
                assert await h.dht.run_coroutine(_forget_everyone, return_future=True) == 0
            assert await lonely.dht_neighbours() == 0
            # alone, it cannot see what the others store
            await first.dht_store("rejoin-test", b"value", time.time() + 60)
            assert await lonely.dht_get("rejoin-test") is None
            rejoined = asyncio.Event()  # the node re-announces itself on it
            keeper = asyncio.create_task(lonely.keep_joined(interval=0.5, on_rejoined=rejoined.set))  # its initial peer is `first`
            await _wait(lonely.dht_neighbours, 30, "the lonely node's DHT to have neighbours again")
            await asyncio.wait_for(rejoined.wait(), 10)
            assert await _wait(lambda: lonely.dht_get("rejoin-test"), 30, "the record, seen from the node that rejoined") == b"value"
        finally:
            if keeper is not None:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            for h in hosts:
                await h.shutdown()

    asyncio.run(main())
