"""How a slot's server (a stage server, an expert host) serves the calls queued for its compute.

Calls wait in a `CallQueue`; `serve` takes them a batch at a time under the weights' lock, on the
event loop's thread (handing each batch to a compute thread and back cost two thread wake-ups and
GIL hand-overs on the pipeline's critical path), and carries out the `StepSchedule`'s decisions
between batches: a due step, the stats written once calls pause. A call's own problem found in
compute goes to its caller; anything else fails the whole batch's callers, logged, and serving
goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from protocol import RemoteProtocolError

from ..net.transport import RPCError
from ..osutil import woken
from .stage_core import StepSchedule

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A call waiting for the compute."""

    op: str
    x: Any  # the input (None: a backward through the graph this peer kept, `key`)
    extra: Any = None  # the gradient (backward), targets (train), a clip scale (an expert's commit)
    key: tuple | None = None  # (caller, micro-batch): the graph a forward keeps, or a backward uses
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def alone(self) -> bool:
        """Computed on its own: its graph is kept, or was."""
        return self.key is not None

    @property
    def samples(self) -> int:
        return (self.x if self.x is not None else self.extra).size(0)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape) if self.x is not None else ()


class CallQueue:
    def __init__(self, what: str, lock: asyncio.Lock):
        self.what, self.lock = what, lock
        self.queue: deque[Pending] = deque()
        self.wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self.queue)

    async def submit(self, p: Pending) -> Any:
        """Queue `p`; its result once computed (or the error its batch met)."""
        self.queue.append(p)
        self.wake.set()
        return await p.done

    def refuse_all(self) -> None:
        """The role is leaving: the calls still queued are refused (their callers retry elsewhere)."""
        while self.queue:
            p = self.queue.popleft()
            if not p.done.done():
                p.done.set_exception(RPCError("overloaded", f"{self.what} is leaving this peer"))

    async def serve(self, schedule: StepSchedule, take: Callable[[deque[Pending]], list[Pending]], compute: Callable[[list[Pending]], list[Any]],
                    step: Callable[[], Awaitable[None]], report: Callable[[], None]) -> None:  # fmt: skip
        """Serve for ever (see the module's docstring)."""
        while True:
            await self._while_idle(schedule, step, report)
            if schedule.before_batch():
                await step()
            async with self.lock:
                if not self.queue:  # refused while we waited (the role is leaving)
                    continue
                batch = take(self.queue)
                self._run(batch, compute)
            await asyncio.sleep(0)  # their callers hand the results on (and new calls come in) before the next batch
            if schedule.after_batch():
                await step()

    async def _while_idle(self, schedule: StepSchedule, step: Callable[[], Awaitable[None]], report: Callable[[], None]) -> None:
        idle_since = time.monotonic()
        while not self.queue:
            self.wake.clear()
            decision = schedule.when_idle(time.monotonic(), idle_since)
            if decision.action == "step":
                await step()
                idle_since = time.monotonic()
            elif decision.action == "report":
                report()
            elif decision.until is None:
                await self.wake.wait()
            else:
                await woken(self.wake, max(0.0, decision.until - time.monotonic()))

    def _run(self, batch: list[Pending], compute: Callable[[list[Pending]], list[Any]]) -> None:
        try:
            results = compute(batch)
        except (RPCError, RemoteProtocolError) as e:  # the call's own problem, found in compute: its caller hears it
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(e)
            return
        except Exception as e:  # our bug, or the tensors together broke something: every caller hears it
            log.exception("%s: a %s batch failed", self.what, batch[0].op)
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(RPCError("internal", f"{self.what} failed on this batch: {type(e).__name__}"))
            return
        for p, r in zip(batch, results):
            if not p.done.done():
                p.done.set_result(r)
