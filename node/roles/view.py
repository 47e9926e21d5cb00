"""The roles' one view of the swarm: who is a member, in what role, from the DHT's member records.

Every role reads the members through `SwarmView.read`: one DHT read path, one timeout
(`READ_TIMEOUT_S`: a lookup can hang for tens of seconds on a frozen or cut-off peer, and no
step of a role may wait that long) and one freshness rule (`stale`). A read that fails or times
out gives the last members read, marked not `ok`. Each read says why it left a peer out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from protocol.records import MemberRecord, parse_role_label, slot_index

from ..net.host import DHTError
from ..net.membership import read_members

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 3.0
FRESH_FRACTION = 0.5  # records are published again every ttl/3: one older than ttl/2 missed that, most likely a dead peer's
FOLLOW_S = 2.0  # how often a role that follows the members (a trainer) reads them once it knows some
FIRST_FOLLOW_S = 0.5  # ... and before it does


def stale(rec: MemberRecord, now: float, ttl_s: float) -> str | None:
    """Why a member record no longer counts (None: it does)."""
    age, limit = now - rec.issued_at, ttl_s * FRESH_FRACTION
    return None if age < limit else f"its record is {age:.0f} s old (fresh: under {limit:.0f} s)"


@dataclass(frozen=True)
class Members:
    """One read of the member records: the fresh ones by peer, and why every other was left out.
    `ok` is False when the DHT did not answer: these are then the last records read."""

    records: Mapping[str, MemberRecord] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    ok: bool = True

    @classmethod
    def of(cls, records: Mapping[str, MemberRecord], now: float, ttl_s: float) -> Members:
        fresh, skipped = {}, {}
        for peer, rec in records.items():
            why = stale(rec, now, ttl_s)
            if why is None:
                fresh[peer] = rec
            else:
                skipped[peer] = why
        return cls(fresh, skipped)

    def peers(self, role: str, slot: str | None = None, exclude: str = "") -> list[str]:
        """The peers in `role` (at `slot`, when given), sorted, without `exclude`."""
        return sorted(p for p, rec in self.records.items() if p != exclude and _matches(rec.role, role, slot))

    def numbered(self, role: str, prefix: str = "", below: int | None = None) -> dict[int, list[str]]:
        """slot number -> the peers in `role` there, for a role whose slots are numbered
        ("stage:1"; "expert:shard1" with prefix "shard"), slots from `below` on left out."""
        out: dict[int, list[str]] = {}
        for peer, rec in sorted(self.records.items()):
            n = slot_index(rec.role, role, prefix)
            if n is not None and (below is None or n < below):
                out.setdefault(n, []).append(peer)
        return out


def _matches(label: str, role: str, slot: str | None) -> bool:
    r, s = parse_role_label(label)
    return r == role and (slot is None or s == slot)


class SwarmView:
    """Reads the swarm's member records for a role (see the module's docstring)."""

    def __init__(self, host, swarm_id: str, ttl_s: float, clock: Callable[[], float] = time.time):
        self.host, self.swarm_id, self.ttl_s, self.clock = host, swarm_id, ttl_s, clock
        self.last = Members(ok=False)
        self._reading: asyncio.Future | None = None
        self._read_at = -math.inf  # monotonic

    async def read(self) -> Members:
        """The members now, within READ_TIMEOUT_S; else the last ones read, not `ok`."""
        self._read_at = time.monotonic()
        try:
            records = await asyncio.wait_for(read_members(self.host, self.swarm_id), READ_TIMEOUT_S)
        except (TimeoutError, DHTError) as e:
            (log.info if self.last.ok else log.debug)("the member records could not be read (%s): going by the last ones read", e or f"no answer in {READ_TIMEOUT_S:.0f} s")
            self.last = replace(self.last, ok=False)
            return self.last
        self.last = Members.of(records, self.clock(), self.ttl_s)
        for peer, why in self.last.skipped.items():
            log.debug("not counting %s: %s", peer[-8:], why)
        return self.last

    async def read_shared(self, min_interval_s: float) -> Members:
        """A read shared by every caller waiting for one, at most every `min_interval_s` (a peer
        not in the last read makes callers look again, but a burst of them reads once)."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_after(min_interval_s))
        reading = self._reading
        try:
            return await asyncio.shield(reading)
        finally:
            if self._reading is reading and reading.done():
                self._reading = None

    async def _read_after(self, min_interval_s: float) -> Members:
        await asyncio.sleep(max(0.0, self._read_at + min_interval_s - time.monotonic()))
        return await self.read()

    async def follow(self, update: Callable[[Members], bool], known: asyncio.Event) -> None:
        """Read the members for ever, in the background (a step never waits on the DHT), and
        hand each good read to `update`; `known` is set once `update` says the role can work."""
        while True:
            members = await self.read()
            if members.ok and (members.records or members.skipped) and update(members):  # (no records at all: the DHT lost its neighbours, say)
                known.set()
            await asyncio.sleep(FOLLOW_S if known.is_set() else FIRST_FOLLOW_S)

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
