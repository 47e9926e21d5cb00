"""What every server of a slot of the model (a stage server, an expert host) is made of, and does
around the calls it serves: take the slot's state, serve its calls in turn with its steps between
them, sync with the slot's other peers, report, and hand the state over when it leaves.

A role composes one `SlotServer` with its own handler and arithmetic (`compute`: a StageCompute
or an ExpertCompute) and asks it to `start`, `serve` and `stop`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from protocol.records import role_label

from ..models.diloco import state_hash
from ..net.transport import HandlerTaken
from ..runconfig import RunConfig
from .role import RoleContext, RoleError
from .serving import CallQueue, Pending
from .slot_state import SlotState
from .slot_sync import SlotSync
from .stage_core import StepSchedule
from .stats import ComputeRate, StatsFile
from .view import SwarmView
from .weights import SlotWeights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotName:
    """How a slot is named: its files (`kind`), its log lines (`what`), its member records (`role`
    and `slot`), its peers' averaging (`namespace`), and where the coordinator keeps its
    checkpoints (`coordinator_slot`; None: it keeps none)."""

    kind: str
    what: str
    role: str
    slot: str
    namespace: str
    coordinator_slot: int | None


class Compute(Protocol):
    steps: int
    samples: int
    clips: dict[str, int]
    last_norm: tuple[float, float]
    rate: ComputeRate

    def run_batch(self, batch: list[Pending]) -> list[Any]: ...

    def step(self) -> None: ...


class SlotServer:
    def __init__(self, ctx: RoleContext, run: RunConfig, name: SlotName, meta: dict[str, Any], schedule: StepSchedule,
                 compute: Callable[[SlotWeights], Compute], stats: Callable[[], dict[str, Any]]):  # fmt: skip
        """`compute(weights)` makes the slot's arithmetic; `stats()` gives what its stats file
        carries besides what every slot's does."""
        c, data = ctx.node_config, Path(ctx.node_config.data_dir)
        self.ctx, self.name, self.what, self.label = ctx, name, name.what, role_label(name.role, name.slot)
        self.weights = SlotWeights(c.torch_threads(), run.stage_outer_momentum, name.kind)
        self.state = SlotState(ctx.transport, data / f"{name.kind}-state", data / f"{name.kind}-downloads", name.what, meta, model_hash, self.weights.compute)
        self.view = SwarmView(ctx.host, c.swarm_id, c.record_ttl_s)
        self.sync = SlotSync(ctx, run, self.weights, self.state, self.view, name.namespace, name.role, name.slot, name.coordinator_slot, self.report)
        self.schedule, self.compute, self.slot_stats = schedule, compute(self.weights), stats
        self.queue = CallQueue(name.what, self.weights.busy)
        self.stats = StatsFile(data, name.kind, keep=200)
        self._registration = None

    async def start(self, build: Callable[[], tuple[Any, Any]], handlers: dict, describe: Callable[[], str]) -> None:
        """Build the slot's module and optimizer, take the slot's newest state, then serve
        `handlers` (RoleError when this node cannot: another service holds them)."""
        own = await asyncio.to_thread(self.state.own)  # what this node saved of this slot before it restarted
        if own is None:
            await asyncio.to_thread(shutil.rmtree, self.state.dir, True)  # another slot's, from an earlier role
        progress = self.ctx.membership.progress
        progress.samples_per_second, progress.measured_as = None, ""  # measured anew at this slot
        self.weights.hold(*await self.weights.compute(build))
        await self.sync.start(own)
        try:
            self._registration = self.ctx.transport.serve(handlers, owner=self.what)
        except HandlerTaken as e:
            raise RoleError(str(e)) from None
        self.ctx.activity.queues["calls"] = lambda: len(self.queue)
        log.info("%s: %s, state of round %d from %s, hash %s", self.what, describe(), self.state.step, self.state.source[-8:], self.weights.hash)
        self.report(start=True, state_from=self.state.source)
        self.ctx.membership.publish_soon()  # trainers find it through the DHT

    async def serve(self, take: Callable) -> None:
        """Serve the queued calls (`take` picks each batch) and sync with the slot's peers, until cancelled."""
        syncing = asyncio.create_task(self.sync.run(), name=f"{self.name.namespace}-sync")
        try:
            await self.queue.serve(self.schedule, take, self._run_batch, self.step_now, self.report)
        finally:
            syncing.cancel()
            await asyncio.gather(syncing, return_exceptions=True)

    async def stop(self, planned: bool) -> None:
        """Give everything back. Planned (SIGTERM, Ctrl-C, a new assignment): new calls are
        refused (callers retry them on other peers), and the slot's last peer hands its state
        over first."""
        self._unserve()
        if planned and self.weights.module is not None:
            await self.sync.hand_over(self._flush)
        await self.sync.close()
        self.view.close()
        self._unserve()
        self.weights.close()

    def _unserve(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        self.queue.refuse_all()

    async def _flush(self) -> None:
        if self.schedule.due:  # a step that waited for the next call: nothing trained stays behind
            await self.step_now()

    def _run_batch(self, batch: list[Pending]) -> list[Any]:
        """The compute's batch, counted into the node's activity (the samples whose gradients it
        accumulated: a micro-batch's forward and backward count once)."""
        t0, samples = time.monotonic(), self.compute.samples
        results = self.compute.run_batch(batch)
        self.ctx.activity.trained(self.compute.samples - samples, seconds=time.monotonic() - t0)
        return results

    async def step_now(self) -> None:
        async with self.weights.busy:  # (on the loop's thread, as batches run)
            self.compute.step()
            report = self.schedule.stepped(time.monotonic())
        if report:  # (a report hashes the parameters: not at every step)
            self.report()

    def report(self, **entry: Any) -> None:
        """The stats file, with `entry` in its history, and the progress heartbeats carry."""
        self.schedule.reported(time.monotonic())
        p, compute = self.ctx.membership.progress, self.compute
        p.step, p.state_hash = self.state.step, self.state.hash  # the same on every peer of the slot after a sync
        rate = compute.rate.per_second()
        if rate is not None:
            p.samples_per_second, p.measured_as = rate, self.label
        state_hash = self.weights.hash
        self.stats.remember({"step": compute.steps, "samples": compute.samples, "state_hash": state_hash, "time": time.time(), "norms": compute.last_norm, **entry})
        self.stats.write({
            **self.slot_stats(), "params": sorted(self.weights.names()), "num_params": self.weights.module.num_params(), "steps": compute.steps,
            "syncs": self.sync.syncs, "samples": compute.samples, "state_hash": state_hash, "clips": compute.clips, "samples_per_second": rate,
        })  # fmt: skip


def model_hash(state) -> str:
    """What a slot's state manifest carries: the hash of its parameters."""
    return state_hash(state["model"])
