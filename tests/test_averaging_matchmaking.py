"""Matchmaking with two real hosts (p2pd) in one process, for what only timing between peers
shows: a join that reaches its leader a little before the leader starts the round."""

import asyncio

import pytest
import torch

from protocol import AvgJoin
from tests.swarm import averagers

pytestmark = pytest.mark.timeout(120)


def test_a_join_that_arrives_before_its_leader_starts_waits_for_it():
    async def main():
        async with averagers(2, join_timeout_s=5, early_join_wait_s=5) as (leader, other):
            join = AvgJoin(round_key="early", numel=100, codec="none")
            asked = asyncio.create_task(other.transport.call(leader.peer_id, join, timeout=30))
            await asyncio.sleep(0.3)
            assert not asked.done()  # not told "not averaging this key": it waits for the leader
            round_ = asyncio.create_task(leader.average("early", [torch.ones(100)], expected_peers=2))
            reply = await asked
            assert reply.status == "group" and sorted(reply.members) == sorted([leader.peer_id, other.peer_id])
            round_.cancel()
            await asyncio.gather(round_, return_exceptions=True)
            # a key the leader never averages: the wait ends, and the answer says so
            reply = await other.transport.call(leader.peer_id, AvgJoin(round_key="never", numel=100, codec="none"), timeout=30)
            assert reply.status == "closed" and "not averaging" in reply.reason
            assert not leader.matchmaker.key_started  # nothing left waiting

    asyncio.run(main())
