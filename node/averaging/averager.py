"""`Averager`: the public face of the all-reduce. It composes the pieces of this package —
matchmaking, the round, the send schedule, the buffers — and keeps what lives across rounds
(measured bandwidth, the last group). One per namespace; any number per process."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence

import torch

from protocol import make_codec

from .faults import Faults
from ..net.host import Host
from ..net.transport import NETWORK_ERRORS, Transport
from .aggregators import HarmRuns
from .buffers import Buffers, unflatten
from .config import AverageReport, AveragerConfig, AveragingFailed, RoundFailed
from .decisions import learn_bandwidth
from .handlers import RoundHandlers
from .matchmaking import Matchmaker
from .round import Judge, Round, RoundDriver
from .schedule import Sender
from .service import ROUND_KEEP_S, AveragingService

log = logging.getLogger(__name__)


class Averager:
    """Averages tensors with the peers of its namespace; serves any number of concurrent
    rounds (different keys). `start()` attaches it to the transport's averaging service,
    `close()` detaches it (its message types are freed when the last averager leaves)."""

    def __init__(self, host: Host, transport: Transport, config: AveragerConfig = AveragerConfig(), faults: Faults = Faults()):
        self.host, self.transport, self.config, self.faults = host, transport, config, faults
        self.peer_id = host.peer_id
        self.codec = make_codec(config.codec, **config.codec_params)
        self.buffers = Buffers(self.codec, config.slice_align)
        self.sender = Sender(transport, config, faults, lambda: self.bandwidth)
        self.matchmaker = Matchmaker(self)
        self.handlers = RoundHandlers(self)
        self.service: AveragingService | None = None
        self._measured_bandwidth: float | None = None
        self.harm_runs = HarmRuns()  # each peer's rounds running whose parts harmed our check batch (`average(judge=...)`)
        self.on_phase = None  # optional callable(key, phase): progress for logs and tests
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self.service is None:
            service = AveragingService.of(self.transport)
            service.attach(self)
            self.service = service

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.service is not None:
            self.service.detach(self)
            self.service = None

    def reset_feedback(self, state_key: str | None = None) -> None:
        """Zero the error feedback of `state_key` (None: of every key), keeping its buffers."""
        self.buffers.reset(state_key)

    @property
    def bandwidth(self) -> float:
        return self.config.bandwidth or self._measured_bandwidth or self.config.default_bandwidth

    def phase(self, key: str, phase: str) -> None:
        log.debug("averaging %s: %s", key, phase)
        if self.on_phase is not None:
            self.on_phase(key, phase)

    def spawn(self, coro) -> None:
        """A background task we keep a reference to (and cancel on close)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def average(
        self,
        key: str,
        tensors: Sequence[torch.Tensor],
        weight: float = 1.0,
        expected_peers: int | Collection[str] | None = None,
        state_key: str | None = None,
        join_timeout_s: float | None = None,
        judge: Judge | None = None,
    ) -> tuple[list[torch.Tensor], AverageReport]:
        """Average `tensors` with the peers averaging the same `key`. Returns new tensors and a
        report, or raises AveragingFailed (inputs and error-feedback state untouched).
        `state_key` names the error-feedback residual that carries over between rounds;
        `join_timeout_s` overrides the config's wait for late peers for this round.
        `expected_peers`: a leader closes its group early once this many peers joined, or, given
        peer ids, once every one of them joined (a peer nobody counted on does not take the
        place of one that is still on its way). `judge(a, b, parts, aggregate, members)`: with a
        robust aggregator that accuses, for each slice [a, b) we own, per member the loss of a
        check batch (its own data) at θ, with the aggregate's and with its part's slice
        (round.Judge): parts that raise it, round after round, where the aggregate lowers it
        are evidence against their senders."""
        if self.service is None:
            raise RuntimeError("Averager.average() before start()")
        t0 = time.monotonic()
        report = AverageReport(key=key)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"averaging {key}: weight must be finite and > 0, got {weight}")
        state_key = state_key or self.config.namespace
        numel = sum(t.numel() for t in tensors)
        # flattening, checking and snapshotting (seconds for big models) overlap matchmaking
        reuse, spare = self.buffers.take_flat(numel, tensors)
        feedback = self.buffers.feedback(state_key, numel)
        own = self.buffers.last_own.get(numel, ())  # the slices we owned last time: likely ours again
        prepare = asyncio.get_running_loop().run_in_executor(None, self.buffers.prepare, key, tensors, spare, feedback, own)
        try:
            window = self.config.join_timeout_s if join_timeout_s is None else join_timeout_s
            group = await self.matchmaker.matchmake(key, numel, weight, expected_peers, report, window)
            report.phases["matchmaking"] = time.monotonic() - t0
            prepared = await prepare
            result, gather_feedback = await self._run_round(group, prepared, state_key, report, judge)
        except (RoundFailed, *NETWORK_ERRORS) as e:
            # the residual of earlier rounds is untouched (this round wrote into a spare)
            report.ok, report.reason = False, str(e) or type(e).__name__
            report.late = getattr(e, "late", False)
            self.matchmaker.last_ok = False
            report.seconds = time.monotonic() - t0
            await asyncio.gather(prepare, return_exceptions=True)
            raise AveragingFailed(report) from None
        except BaseException:
            await asyncio.gather(prepare, return_exceptions=True)
            raise
        finally:
            self.matchmaker.forget_key(key)
            if reuse and prepare.done() and not prepare.cancelled() and prepare.exception() is None:
                self.buffers.give_back_flat(prepare.result().flat)
        self.buffers.commit(state_key, prepared.new_residual, gather_feedback)
        report.ok, report.seconds = True, time.monotonic() - t0
        self._measured_bandwidth = learn_bandwidth(self._measured_bandwidth, report.phases, report.bytes_sent + report.bytes_received).value
        self.matchmaker.last_members, self.matchmaker.last_ok = tuple(report.survivors), True
        self.buffers.last_own[numel] = tuple((group.bounds[j], group.bounds[j + 1]) for j in range(group.n_slices) if group.first_owner(j) == self.peer_id)
        return unflatten(result, tensors), report

    async def waiting(self, key: str) -> set[str]:
        """The peers whose records say they wait to average `key` now (a DHT read)."""
        return await self.matchmaker.candidates(key)

    @property
    def last_members(self) -> tuple[str, ...]:
        """The peers of the last round that committed here (us included)."""
        return self.matchmaker.last_members

    def abandon(self, key: str, why: str) -> bool:
        """Give up the round of `key` while we still wait, alone, as its leader for others to
        join (e.g. the swarm is known to be ahead of us): its `average()` raises AveragingFailed
        at once. False when the round is past that point (a group formed, or we follow)."""
        return self.matchmaker.abandon(key, why)

    async def _run_round(self, group, prepared, state_key: str, report: AverageReport, judge: Judge | None = None) -> tuple[torch.Tensor, dict]:
        """The round's result and what its gather lost per slice we own (for the feedback)."""
        rnd = Round(group=group, me=self.peer_id, leader=report.leader, report=report, state_key=state_key, judge=judge)
        rnd.result = torch.empty_like(prepared.flat)  # gathered slices are decoded straight into it
        report.group_id, report.members, report.bounds = group.group_id, list(group.members), group.bounds
        report.slice_owners = group.slice_owners
        self.phase(report.key, "matched")
        self.service.add_round(self, rnd)
        driver = RoundDriver(self, rnd, prepared)
        try:
            result = await driver.run()
            if self.faults.replay_gather_s:
                self.spawn(driver.replay_gather(self.faults.replay_gather_s))
            return result, driver.gather_feedback()
        finally:
            await driver.finish()
            self.spawn(self._forget_round_later(group.group_id))

    async def _forget_round_later(self, group_id: str) -> None:
        await asyncio.sleep(ROUND_KEEP_S)  # keep decisions around for members that ask late
        if self.service is not None:
            self.service.forget_round(group_id)
