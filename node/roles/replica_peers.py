"""The other replicas as one replica sees them: who they are and what state each holds.

Who: the replicas of the member records (DHT records that live a record TTL), and the members
of our last round, which our DHT may have lost sight of (a link that was down) while they are
still where they were. What they hold: the newest state each serves (`SlotState.ask`).
"""

from __future__ import annotations

from .slot_state import Offer, SlotState
from .view import SwarmView

ASK_S = 3.0  # longest a replica peer may take to say which state it holds


class ReplicaPeers:
    def __init__(self, me: str, view: SwarmView, averager, state: SlotState):
        self.me, self.view, self.averager, self.state = me, view, averager, state

    async def ids(self) -> set[str]:
        """The replicas alive as far as the member records show, this one included."""
        return set((await self.view.read()).peers("replica")) | {self.me}

    async def states(self) -> dict[str, Offer]:
        """The latest state of every other replica that answers (records and last round)."""
        members = await self.view.read()
        peers = (set(members.peers("replica")) | set(self.averager.last_members)) - {self.me}
        return await self.state.ask(sorted(peers), ASK_S)

    async def waiting(self, key: str) -> set[str]:
        """The other replicas whose records say they wait to average `key` now (a DHT read)."""
        return await self.averager.waiting(key) - {self.me}

    async def last_round_answering(self) -> set[str]:
        """The other replicas of our last round that answer a question about their state."""
        last = sorted(set(self.averager.last_members) - {self.me})
        return set(await self.state.ask(last, ASK_S)) if last else set()
