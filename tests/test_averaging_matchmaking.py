"""Matchmaking with two real hosts (p2pd) in one process, for what only timing between peers
shows: a join that reaches its leader a little before the leader starts the round."""

import asyncio

import pytest
import torch

from node.averaging import AveragingFailed
from protocol import AvgJoin
from tests.swarm import averagers

pytestmark = pytest.mark.timeout(120)


def test_a_join_that_arrives_before_its_leader_starts_waits_for_it():
    async def main():
        async with averagers(2, join_timeout_s=5, early_join_wait_s=5) as (leader, other):
            join = AvgJoin(round_key="early", numel=100, codec="none")
            asked = asyncio.create_task(other.transport.call(leader.peer_id, join, timeout=30))
            await asyncio.sleep(0.3)  # time for an answer to come back, were the join refused at once
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


def test_a_leader_alone_waits_its_window_and_can_give_the_round_up():
    async def main():
        async with averagers(2, join_timeout_s=30) as (a, b):
            # it expects only itself (its view of the swarm may lag): alone, it still waits for
            # others instead of failing at once; it gives the round up when told the swarm moved on
            me = a.peer_id if a.peer_id < b.peer_id else b.peer_id
            alone = a if a.peer_id == me else b
            round_ = asyncio.create_task(alone.average("alone", [torch.ones(100)], expected_peers={me}))
            await asyncio.sleep(1.0)  # time to fail, were it failing at once
            assert not round_.done()
            assert not alone.abandon("another key", "test")
            assert alone.abandon("alone", "the others are at outer step 9")
            with pytest.raises(AveragingFailed, match="gave round alone up: the others are at outer step 9"):
                await asyncio.wait_for(round_, 5)

    asyncio.run(main())


def test_a_leader_alone_asks_the_last_group_and_learns_the_round_went_on_without_it():
    """Back from a freeze, a peer predicts itself leader (the smallest of its last group) and
    would wait alone for its whole window: one question to the next member tells it the
    others averaged that key without it."""

    async def main():
        async with averagers(2, join_timeout_s=30) as avgs:
            small, big = sorted(avgs, key=lambda a: a.peer_id)
            big.matchmaker.forget_key("round-7")  # the others averaged round-7 without it
            small.matchmaker.last_members = (small.peer_id, big.peer_id)
            # the answer to its question, not the end of its 30 s window ("too late or alone")
            with pytest.raises(AveragingFailed, match="too late for round round-7: .* this round is over here") as e:
                await small.average("round-7", [torch.ones(100)], expected_peers={small.peer_id, big.peer_id})
            assert e.value.report.late  # the caller catches up from the others

    asyncio.run(main())


def test_a_late_joiner_of_a_key_its_leader_gave_up_alone_is_sent_on_not_failed():
    """A leader that closed a key alone averaged it with nobody: a peer that comes later (the
    others, slower this round) is told it gave the round up without a group and looks for
    another leader, rather than "over here", which would fail its round too."""

    async def main():
        async with averagers(2, join_timeout_s=1) as (a, b):
            with pytest.raises(AveragingFailed, match="too late or alone"):
                await a.average("lonely", [torch.ones(100)], expected_peers=2)
            reply = await b.transport.call(a.peer_id, AvgJoin(round_key="lonely", numel=100, codec="none"), timeout=10)
            assert reply.status == "closed" and "without a group" in reply.reason
            # a key it did average with someone stays "over here" for late joiners
            # (a window of its own: on a loaded machine two peers can take more than 1 s to meet)
            both = await asyncio.gather(
                *(x.average("together", [torch.ones(100)], expected_peers=2, join_timeout_s=20) for x in (a, b))
            )
            assert all(len(report.members) == 2 for _, report in both)
            reply = await b.transport.call(a.peer_id, AvgJoin(round_key="together", numel=100, codec="none"), timeout=10)
            assert reply.status == "closed" and "over here" in reply.reason

    asyncio.run(main())
