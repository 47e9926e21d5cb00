"""What this node's role is doing, in one place: the counts and gauges its /metrics and /status
export (node/metrics.py) and its progress line shows (node/progress_line.py). Roles update it as
they work (an inner step, a micro-batch, a batch of calls, a round); readers take it as it is.

Updates are a few additions (some from a compute thread: each is one attribute store or one
deque append, which the GIL keeps whole); nothing here does I/O. Standard library only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

RATE_WINDOW = 32  # recent steps the rates are measured over


@dataclass
class Phase:
    """A replica's inner phase: `done` of `total` inner steps towards outer step `outer`, begun at
    `started` (monotonic seconds)."""

    outer: int
    done: int
    total: int
    started: float

    def eta(self, now: float) -> float | None:
        """Seconds until its last inner step, at the pace of the steps done (None: none done yet)."""
        if self.done <= 0:
            return None
        return (self.total - self.done) * (now - self.started) / self.done


class Activity:
    """The node's activity (see the module). `role` names the work ("" while there is none);
    `steps`, `samples`, `tokens`, `step_seconds` and `rounds` only grow while the node runs."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.role = ""
        self.steps = 0  # inner steps (replica), micro-batches (trainer), batches of calls (stage / expert server)
        self.samples = 0
        self.tokens = 0
        self.step_seconds = 0.0  # the time those steps took, together
        self.loss: float | None = None  # the latest training loss (an inner step's, a micro-batch's)
        self.rounds: Counter[tuple[str, str]] = Counter()  # (kind, outcome) -> rounds: ("outer", "ok"), ("sync", "failed"), ...
        self.queues: dict[str, Callable[[], int]] = {}  # name -> its length now (the role's work waiting or in flight)
        self.phase: Phase | None = None
        self._recent: deque[tuple[float, int, int]] = deque(maxlen=RATE_WINDOW)  # (when, samples, tokens) of the latest steps

    def begin(self, role: str) -> None:
        """A new role starts: what described the last one's work goes (the totals stay)."""
        self.role, self.loss, self.phase = role, None, None
        self.queues.clear()
        self._recent.clear()

    def trained(self, samples: int, tokens: int = 0, seconds: float = 0.0, loss: float | None = None) -> None:
        """One step done: `samples` (and `tokens`) trained in `seconds`, with this loss (None: none computed)."""
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.step_seconds += seconds
        if loss is not None:
            self.loss = loss
        self._recent.append((self.clock(), samples, tokens))
        if self.phase is not None:
            self.phase.done += 1

    def round(self, kind: str, outcome: str) -> None:
        """A round ended: `kind` is "outer" (a replica's averaging) or "sync" (a stage's or expert
        shard's peers); `outcome` "ok", "failed", or "alone" (a slot's only peer, nobody to sync with)."""
        self.rounds[(kind, outcome)] += 1

    def inner_phase(self, outer: int, total: int) -> None:
        """A replica starts `total` inner steps towards outer step `outer`."""
        self.phase = Phase(outer, 0, total, self.clock())

    def phase_done(self) -> None:
        self.phase = None

    def rates(self) -> tuple[float | None, float | None]:
        """(samples/s, tokens/s) over the latest steps (None: fewer than two steps to measure)."""
        if len(self._recent) < 2:
            return None, None
        elapsed = self._recent[-1][0] - self._recent[0][0]
        if elapsed <= 0:
            return None, None
        recent = list(self._recent)[1:]  # (what the first step did took time before the window began)
        return sum(s for _, s, _ in recent) / elapsed, sum(t for _, _, t in recent) / elapsed

    def queue_lengths(self) -> dict[str, int]:
        return {name: length() for name, length in list(self.queues.items())}
