"""Noticing that this process was paused: SIGSTOP, a suspended VM, a process stalled in swap
(a closed laptop lid pauses the whole machine; on Linux the monotonic clock may or may not
count that time, the wall clock does). Nothing runs while paused, so the pause shows only
afterwards, as a jump of the clocks between two ticks of a task that wakes every `tick_s`.

`PauseWatch.paused_since(t)` says how many seconds of pauses fell after monotonic time `t`:
a role uses it to tell "my inner phase took 60 s" from "I was frozen for 58 of them", to drop
what it was doing and catch up with a swarm that moved on."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)


class PauseWatch:
    def __init__(self, tick_s: float = 1.0, threshold_s: float = 5.0):
        self.tick_s, self.threshold_s = tick_s, threshold_s  # a gap over tick + threshold is a pause
        self.pauses: list[tuple[float, float]] = []  # (monotonic time it ended, seconds), newest last
        self._last = (time.monotonic(), time.time())

    def observe(self, now: float | None = None, wall: float | None = None) -> float:
        """Check the clocks now; seconds of a pause that ended just now (0: none)."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        last_mono, last_wall = self._last
        self._last = (now, wall)
        gap = max(now - last_mono, wall - last_wall) - self.tick_s
        if gap <= self.threshold_s:
            return 0.0
        self.pauses.append((now, gap))
        del self.pauses[:-64]
        log.warning("this process was paused for about %.0f s", gap)
        return gap

    def paused_since(self, t: float) -> float:
        """Seconds of pauses that ended after monotonic time `t` (observing the clocks first)."""
        self.observe()
        return sum(s for end, s in self.pauses if end > t)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.observe()
