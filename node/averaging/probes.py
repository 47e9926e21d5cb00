"""`Probes`: pings of the peers we wait on, while we wait (a leader its expected joiners, a
round its members), so that one that went silent is not waited for to a deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

from ..net.transport import NETWORK_ERRORS, CallTimeout
from .decisions import Liveness

log = logging.getLogger(__name__)


class Probes:
    """Pings the peers we wait for, while we wait: one watcher per peer, each probe once the
    last one ended (`Liveness.next_after`), waking whoever waits (`changed`) with each answer
    or miss. A leader lets an expected peer that is later than its measured arrivals say go
    only if its latest probe went unanswered too; a round stops waiting for a member whose
    last two went unanswered. A peer that answers is alive and most likely on its way (a slow
    inner phase, a starved CPU): it keeps its place. A watcher stops once nobody asked about
    its peer for `IDLE_S` (it joined, or the wait moved on)."""

    IDLE_S = 1.0

    def __init__(self, transport, rtts: dict[str, tuple[float, float]], silent: dict[str, float]):
        self.transport, self.rtts, self.marked = transport, rtts, silent
        self.live: dict[str, Liveness] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.asked: dict[str, float] = {}
        self.changed = asyncio.Event()

    def silent(self, peers: Collection[str], misses: int = 1) -> set[str]:
        """Of `peers` (probed from now on), those whose latest `misses` probes went unanswered."""
        now = time.monotonic()
        for p in peers:
            self.asked[p] = now
            live = self.live.setdefault(p, Liveness.known(self.rtts, p))
            task = self.tasks.get(p)
            if task is None or task.done():
                self.tasks[p] = asyncio.create_task(self._watch(p, live))
        return {p for p in peers if self.live[p].missed >= misses}

    async def _watch(self, peer: str, live: Liveness) -> None:
        while time.monotonic() - self.asked[peer] < self.IDLE_S:
            t0, wait = time.monotonic(), live.probe_timeout()
            try:
                live.answered(await self.transport.ping(peer, timeout=wait))
                live.remember(self.rtts, peer)
                if self.marked.pop(peer, None) is not None:  # it answers: no longer counted as silent
                    log.debug("%s answers probes again", peer[-8:])
                pause = live.next_after()
            except NETWORK_ERRORS as e:
                # the next at once only after a probe that waited its whole timeout; one that
                # failed quickly (refused, no route) waits the interval: no ping storm, which
                # would starve this process's training thread of the GIL
                timed_out = time.monotonic() - t0 >= wait * 0.9
                pause = live.next_after() if timed_out else live.interval_s
                if self.transport.heard.get(peer, 0.0) > t0:
                    pause = live.interval_s  # its data kept coming meanwhile (a busy link delays a ping): alive
                else:
                    live.unanswered()
                    log.debug("probe of %s unanswered (%d in a row): %s", peer[-8:], live.missed, e)
                    if live.silent():  # every wait on it (a leader's decision, say) knows at once
                        self.marked[peer] = time.monotonic()
                    if isinstance(e, CallTimeout):
                        await self.transport.reset(peer)  # the next probe on a fresh connection (after a cut, an old one stays stuck for seconds)
            self.changed.set()
            await asyncio.sleep(pause)

    async def wait(self, event: asyncio.Event | None, timeout: float, tasks: Collection[asyncio.Task | None] = ()) -> None:
        """Until `event` is set, a probe answers or misses, one of `tasks` ends, or `timeout`
        (clears nothing: clear `changed` and `event` before looking at what they tell)."""
        tasks = [t for t in tasks if t is not None]
        if any(t.done() for t in tasks):
            return
        waits = [asyncio.create_task(self.changed.wait())] + ([asyncio.create_task(event.wait())] if event is not None else [])
        try:
            await asyncio.wait(waits + tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def mark_silent(self, peers: Collection[str], now: float) -> None:
        """Of `peers` (not joined when the group closed), mark those whose latest probe went
        unanswered: the next rounds do not wait for them until they answer or join. (Two
        unanswered in a row mark a peer as they happen, see `_watch`.)"""
        for p in peers:
            if p in self.live and self.live[p].missed:
                self.marked[p] = now

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
