"""How a round's parts leave: in turn (one receiver at a time) or paced (all at once, each
flow at its share of the declared upload rate). `Sender` sends; `settle` ends what is left."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from protocol import TensorPart, split

from .faults import Faults
from ..net.transport import Transport
from .config import AveragerConfig
from .decisions import learn_flow_rate, stagger_patience

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 3  # sends in turn under way at once (see `Sender.in_turn`)


@dataclass
class Batch:
    """Paced sends that left together (see `Sender.paced`)."""

    started: asyncio.Future  # loop time they began
    seconds: float  # how long they take at their pace
    tasks: list[asyncio.Task] = field(default_factory=list)


@dataclass
class InTurn:
    """One send in turn (see `Sender.in_turn`): the next one waits for it."""

    task: asyncio.Task
    nbytes: int
    started: asyncio.Future  # loop time it began
    earlier: tuple[asyncio.Task, ...] = ()  # the sends before it that may still be under way (up to MAX_IN_FLIGHT - 1)


class Sender:
    """Sends one averager's parts: frames them, applies injected faults, measures flows."""

    def __init__(self, transport: Transport, config: AveragerConfig, faults: Faults, bandwidth: Callable[[], float]):
        self.transport, self.config, self.faults = transport, config, faults
        self.flow_rate: float | None = None  # bytes/s one send achieved lately
        self.bandwidth = bandwidth  # the averager's current estimate, bytes/s (for patience)

    def parts(self, group_id: str, phase: str, j: int, enc) -> list[TensorPart]:
        return split(enc, f"{group_id}|{phase}|{j}", self.config.chunk_bytes)

    async def send_part(self, rnd, phase: str, j: int, enc, peer: str, parts: list[TensorPart] | None = None, pace: float | None = None) -> None:
        if self.faults.active:
            await self.faults.before_send()
            enc, parts = self.faults.outgoing(enc, peer), None
        parts = parts or self.parts(rnd.group.group_id, phase, j, enc)
        rnd.report.bytes_sent += enc.nbytes
        log.debug("send %s %d to %s: %d bytes", phase, j, peer[-6:], enc.nbytes)
        timeout = max(1.0, rnd.group.deadline_s)
        t0 = time.monotonic()
        await self.transport.send(peer, parts[0], parts[1:], timeout=timeout, reuse=self.config.reuse_streams, pace=pace)
        took = time.monotonic() - t0
        log.debug("sent %s %d to %s in %.3f s", phase, j, peer[-6:], took)
        self.flow_rate = learn_flow_rate(self.flow_rate, enc.nbytes, took, bool(pace)).value

    def paced(self, rnd, prev, phase: str, items: list[tuple]) -> Batch:
        """Send every (slice, encoded, peer, frames) item at once, once `prev` (the sends before)
        is done or should be, each flow paced by the kernel to its share of `rnd.pace` by size.
        Flows that keep to their shares neither queue at our uplink nor at a receiver's
        downlink (each receiver gets one such flow from every sender), so a member that starts
        late slows only its own flows (closer to the bandwidth bound than one receiver at a time:
        bench/RESULTS.md)."""
        loop = asyncio.get_running_loop()
        total = sum(enc.nbytes for _, enc, _, _ in items) or 1
        batch = Batch(started=loop.create_future(), seconds=total / rnd.pace)

        async def go(j, enc, peer, parts) -> None:
            if not batch.started.done():
                if prev is not None:
                    await self.after(prev)
                if not batch.started.done():
                    batch.started.set_result(loop.time())
            await self.send_part(rnd, phase, j, enc, peer, parts, pace=rnd.pace * enc.nbytes / total)

        batch.tasks = [asyncio.create_task(go(*item)) for item in items]
        return batch

    @staticmethod
    async def after(prev: Batch | InTurn) -> None:
        """Until the sends of `prev` are done, or a paced batch has had the time its size and
        rate need."""
        if isinstance(prev, Batch):
            started = await asyncio.shield(prev.started)
            left = started + prev.seconds - asyncio.get_running_loop().time()
            if left > 0:
                await asyncio.wait(prev.tasks, timeout=left)
        else:
            await asyncio.wait([prev.task])

    def in_turn(self, rnd, prev: InTurn | None, phase: str, j: int, enc, peer: str, parts=None) -> InTurn:
        """A send of a part once `prev` (the send before it) is done, or has run longer than it
        should have. Every member sends its parts in the order of member indices starting after
        its own, so at any moment each peer uploads to one receiver and each receiver downloads
        from one sender: on a shaped link, N-1 concurrent flows per peer fight in both
        bottlenecks. A receiver that stalls holds the next send up for less than one part's time.
        At most MAX_IN_FLIGHT sends are under way at once: patience alone is a clock, and on a
        link a little slower than expected sends would pile up and finish out of order (a part
        that fills a slice last would arrive with the last); one at a time, the link would idle
        while each receiver acknowledges."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()  # when this send began (for the patience of the next)
        chain = (*prev.earlier, prev.task) if prev is not None else ()

        async def go() -> None:
            try:
                if len(chain) >= MAX_IN_FLIGHT and self.config.staggered:
                    await asyncio.wait([chain[-MAX_IN_FLIGHT]])
                if prev is not None and self.config.staggered:
                    # the next send starts a little before the previous should end.
                    # Patience counts from when the previous send began, not from now.
                    await asyncio.wait([prev.started, prev.task], return_when=asyncio.FIRST_COMPLETED)
                    since = prev.started.result() if prev.started.done() and not prev.started.cancelled() else loop.time()
                    patience = stagger_patience(self.config.stagger_overlap, prev.nbytes, self.flow_rate, self.bandwidth(), self.config.bandwidth)
                    left = since + patience - loop.time()
                    if left > 0 and not prev.task.done():
                        await asyncio.wait([prev.task], timeout=left)
            finally:
                if not started.done():
                    started.set_result(loop.time())
            await self.send_part(rnd, phase, j, enc, peer, parts)

        return InTurn(asyncio.create_task(go()), enc.nbytes, started, chain[len(chain) - MAX_IN_FLIGHT + 1 :] if MAX_IN_FLIGHT > 1 else ())


async def settle(tasks: Iterable[asyncio.Task], deadline: float) -> None:
    """Wait for send tasks until the deadline; cancel the rest. Errors are the receivers' to report."""
    tasks = list(tasks)
    if not tasks:
        return
    left = max(0.0, deadline - time.monotonic())
    done, pending = await asyncio.wait(tasks, timeout=left)
    for t in pending:
        t.cancel()
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.debug("a send failed: %s", t.exception(), exc_info=t.exception())
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
