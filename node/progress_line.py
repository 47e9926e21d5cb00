"""The node's progress where its operator watches it: while a role trains, one line in the terminal
updated in place (tqdm), when stderr is one; otherwise plain log lines as before, plus, every
PLAIN_EVERY_S during a replica's inner phase, a line that says where it is (a phase of 50 inner
steps on one thread takes tens of seconds: the log is not silent meanwhile).

    replica | outer step 4: inner 23/50 | loss 4.1234 | 3.1 samples/s | 790 tok/s | outer step in 14 s

Everything it shows is the node's activity (node/activity.py), read on each tick; `tick()` is the
whole decision, `run()` calls it on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .activity import Activity

PLAIN_EVERY_S = 10.0  # not a terminal: a line this often while a replica's inner phase runs
REFRESH_S = 0.5  # a terminal's line is redrawn this often
UNITS = {"replica": "inner steps", "trainer": "micro-batches"}  # what a role's steps are (others: batches of calls)

log = logging.getLogger("swarmtrain.progress")


def describe(activity: Activity, now: float) -> str | None:
    """The line for the activity as it is (None: no role at work yet)."""
    a, phase = activity, activity.phase
    if not a.role or (a.steps == 0 and phase is None):
        return None
    role = a.role.partition(":")[0]
    parts = [a.role]
    if phase is not None:
        parts.append(f"outer step {phase.outer}: inner {phase.done}/{phase.total}")
    else:
        parts.append(f"{a.steps} {UNITS.get(role, 'batches')}")
    if a.loss is not None:
        parts.append(f"loss {a.loss:.4f}")
    samples_per_s, tokens_per_s = a.rates()
    if samples_per_s is not None:
        parts.append(f"{samples_per_s:.1f} samples/s")
    if tokens_per_s:
        parts.append(f"{tokens_per_s:.0f} tok/s")
    parts += [f"{n} {name.replace('_', ' ')}" for name, n in a.queue_lengths().items()]
    eta = phase.eta(now) if phase is not None else None
    if eta is not None:
        parts.append(f"outer step in {eta:.0f} s")
    return " | ".join(parts)


class ProgressLine:
    """See the module. `stream`: where the terminal line goes (stderr); whether it is a terminal
    decides between the line and plain log lines."""

    def __init__(self, activity: Activity, stream: TextIO | None = None, clock: Callable[[], float] | None = None):
        self.activity = activity
        self.stream = stream or sys.stderr
        self.clock = clock or activity.clock
        self.terminal = _isatty(self.stream)
        self._bar: tqdm | None = None
        self._said = -math.inf  # when the last plain line was said

    def tick(self) -> None:
        now = self.clock()
        text = describe(self.activity, now)
        if self.terminal:
            self._draw(text)
            return
        phase = self.activity.phase
        if text is not None and phase is not None and now - max(self._said, phase.started) >= PLAIN_EVERY_S:
            log.info("%s", text)
            self._said = now

    def _draw(self, text: str | None) -> None:
        if text is None:
            self.close()
            return
        if self._bar is None:
            self._bar = tqdm(file=self.stream, bar_format="{desc}", dynamic_ncols=True, leave=False)
        elif text == self._bar.desc:
            return  # (nothing new: no redraw)
        self._bar.set_description_str(text, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def logging(self) -> contextlib.AbstractContextManager:
        """While it is entered, on a terminal, log records are written above the line, not through it."""
        return logging_redirect_tqdm() if self.terminal else contextlib.nullcontext()

    async def run(self) -> None:
        """Tick until cancelled."""
        try:
            with self.logging():
                while True:
                    self.tick()
                    await asyncio.sleep(REFRESH_S if self.terminal else 1.0)
        finally:
            self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False
