"""What roles report: a stats file in the data dir (read by people, tests and benchmarks), the
progress their heartbeats carry, and how fast they compute.

    StatsFile     DATA_DIR/<role>-stats.json: the role's counters and a bounded history
    ComputeRate   samples per second of a peer's own compute, over its recent batches
    LossLog       a trainer's losses: every `REPORT_EVERY` micro-batches, one history entry,
                  one log line, the progress its heartbeat carries, and its stats file; every
                  micro-batch, the node's activity (node/activity.py)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..activity import Activity
from ..osutil import write_json

log = logging.getLogger(__name__)

REPORT_EVERY = 8  # micro-batches per entry of a trainer's loss history
MIN_RATE_BATCHES = 16  # batches a server computes before it says how fast it is


class StatsFile:
    """A role's stats file: `write(stats)` replaces it whole; `remember(entry)` appends to the
    history it carries (the newest `keep` entries)."""

    def __init__(self, data_dir: str | Path, role: str, keep: int):
        self.path = Path(data_dir) / f"{role}-stats.json"
        self.keep = keep
        self.history: list[dict[str, Any]] = []

    def remember(self, entry: dict[str, Any]) -> None:
        self.history.append(entry)
        del self.history[: -self.keep]

    def write(self, stats: dict[str, Any]) -> None:
        write_json(self.path, {**stats, "history": self.history})


class ComputeRate:
    """What a peer can do: samples trained (forward and backward) per second of its compute, over
    its recent batches. Not what it did: in a pipeline every stage does the pipeline's pace; the
    planner needs each stage's capacity to find the bottleneck."""

    def __init__(self, window: int = 64):
        self._batches: deque[tuple[float, int]] = deque(maxlen=window)  # (compute seconds, samples)

    def add(self, seconds: float, samples: int) -> None:
        self._batches.append((seconds, samples))

    def per_second(self) -> float | None:
        if len(self._batches) < MIN_RATE_BATCHES:  # too few batches at this work to say
            return None
        busy = sum(s for s, _ in self._batches)
        return sum(n for _, n in self._batches) / busy if busy > 0 else None


class LossLog:
    """A trainer's training loss, reported every REPORT_EVERY micro-batches (see the module)."""

    def __init__(self, data_dir: str | Path, membership, batch_size: int, stats: Callable[[], dict[str, Any]], line: Callable[[], str],
                 entry: Callable[[], dict[str, Any]] = dict, reports_step: bool = True, activity: Activity | None = None):  # fmt: skip
        """`stats()`: the role's own counters for its stats file; `line()`: the end of its log
        line; `entry()`: what its history entries carry besides the loss. `reports_step`: the
        heartbeats' step is the micro-batches trained (False: the role reports a step of its own).
        `activity`: the node's, which each micro-batch is counted into."""
        self.stats = StatsFile(data_dir, "trainer", keep=500)
        self.activity = activity if activity is not None else Activity()
        self.reports_step = reports_step
        self.membership, self.batch_size, self.extra, self.line, self.entry = membership, batch_size, stats, line, entry
        self.micro_batches = 0
        self.lost = 0  # micro-batches given up (only for input peers refuse as ours to fix)
        self.first_loss: float | None = None  # the mean of the first REPORT_EVERY micro-batches
        self._losses: list[float] = []
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()

    def record(self, loss: float | None, tokens: int = 0, seconds: float = 0.0) -> None:
        """A micro-batch came back with its loss (None: given up) after `seconds`, of `tokens` tokens."""
        if loss is None:
            self.lost += 1
            return
        self.activity.trained(self.batch_size, tokens, seconds, loss)
        self.micro_batches += 1
        self._losses.append(loss)
        if len(self._losses) < REPORT_EVERY:
            return
        mean = sum(self._losses) / len(self._losses)
        self._losses.clear()
        elapsed = time.monotonic() - self.t0
        rate = self.micro_batches * self.batch_size / elapsed if elapsed > 0 else None
        self.stats.remember({"micro_batches": self.micro_batches, "loss": mean, "time": time.time(), **self.entry()})
        if self.first_loss is None:
            self.first_loss = mean  # (the history keeps only its latest entries)
        log.info("trainer | %d micro-batches | loss %.4f | %.1f samples/s | %s", self.micro_batches, mean, rate or 0, self.line())
        p = self.membership.progress
        p.loss, p.samples_per_second = mean, rate
        if self.reports_step:
            p.step = self.micro_batches
        stats = {"micro_batches": self.micro_batches, "samples": self.micro_batches * self.batch_size, "lost": self.lost, "loss": mean,
                 "first_loss": self.first_loss, "samples_per_second": rate, **self.extra()}  # fmt: skip
        self.stats.write(stats)
