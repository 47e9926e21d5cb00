"""Keeping this peer's copy of a slot (a stage, an expert shard) in step with the slot's other peers.

    take()       at start: the newest state of the slot, from a peer of it, the coordinator's
                 checkpoint, or what this node saved before it restarted (the later round wins;
                 peers first on a tie, our own disk last); else the run's seeded initialisation
    run()        every `stage_sync_every_s` of wall-clock time (the same boundaries everywhere, so
                 peers arrive together and nobody waits) one round with the slot's other peers:
                 each averages its pseudo-gradient (outer state minus its parameters) in the slot's
                 averager namespace, compressed with the run's codec, and applies an outer step of
                 lr 1 and momentum `stage_outer_momentum` (0: plain parameter averaging). Afterwards
                 they hold bitwise-identical parameters: the steps taken while the round ran (calls
                 are served meanwhile) are dropped; each peer's AdamW state stays its own. A round's
                 key carries the outer state's hash: peers whose outer states differ never mix;
                 after a failed round a peer takes a newer state its peers hold (`catch_up`). A
                 slot's only peer takes its parameters as its outer state.
    hand_over()  on a planned stop of the slot's last peer: its latest parameters become a new
                 state, it leaves the swarm (the planner moves a peer to the slot and the
                 coordinator names it) and waits until that peer has downloaded the state.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

from ..averaging import Averager, AveragingFailed, NamespaceTaken
from ..config import averager_config
from ..net.transport import HandlerTaken
from ..runconfig import RunConfig
from .attacks import sync_attack
from .role import RoleContext, RoleError
from .slot_state import Offer, SlotState, choose_state
from .view import SwarmView
from .weights import SlotWeights

log = logging.getLogger(__name__)

HANDOVER_S = 60.0  # longest the last peer of a slot waits on a planned stop for a peer to take its state
OFFER_S = 5.0  # longest a peer or the coordinator may take to say which state it holds, at start
CATCH_UP_S = 3.0  # ... after a failed round


def sync_averager(ctx: RoleContext, run: RunConfig, namespace: str) -> Averager:
    """The averager of peers that synchronise every `stage_sync_every_s` (a stage's, an expert
    shard's, the trainers' dense parts): the run's codec, a join window of half the period; a
    robust aggregator clips, but accuses nobody (AveragerConfig.accuse: honest peers' updates
    differ in size here by their steps since the last sync)."""
    c = ctx.node_config
    codec_params = run.codec_params()
    config = averager_config(
        c, swarm_id=c.swarm_id, namespace=namespace, codec=run.codec, codec_params=codec_params,
        join_timeout_s=min(run.join_timeout_s, run.stage_sync_every_s / 2), bandwidth=c.bandwidth_mbps * 1e6 / 8, accuse=False,
    )  # fmt: skip
    return Averager(ctx.host, ctx.transport, config)


async def every_period(period_s: float):
    """Yields n at each wall-clock boundary n * period_s (the same moments on every peer)."""
    while True:
        n = math.floor(time.time() / period_s) + 1
        await asyncio.sleep(max(0.0, n * period_s - time.time()))
        yield n


def handover_round(held: int, newest_saved: int, now: float, period_s: float) -> int:
    """The round a slot's last peer saves its state as when it leaves. Pure. Above every round
    it saved (a sync cancelled by the stop may have saved its round without holding it yet: the
    same number again, other contents, was refused and the leaver died). At least the clock's
    round, and the caller waits until the clock reaches it: the peer that takes the state
    numbers its next round by the clock, so it must never meet this number again."""
    return max(held + 1, newest_saved + 1, math.floor(now / period_s))


class SlotSync:
    """See the module's docstring. `role` and `slot` name the slot in member records ("stage",
    "1"); `coordinator_slot` is its index where the coordinator keeps checkpoints of it (None:
    it keeps none); `report(**entry)` writes the role's stats with `entry` in its history."""

    def __init__(self, ctx: RoleContext, run: RunConfig, weights: SlotWeights, state: SlotState, view: SwarmView, namespace: str,
                 role: str, slot: str, coordinator_slot: int | None, report: Callable[..., None]):  # fmt: skip
        self.ctx, self.run_config, self.weights, self.state, self.view = ctx, run, weights, state, view
        self.role, self.slot, self.coordinator_slot, self.report = role, slot, coordinator_slot, report
        self.what = state.what
        self.averager = sync_averager(ctx, run, namespace)
        self.syncs = 0  # rounds that committed
        self.peers: list[str] = []  # the other peers of the slot, as the last sync read them
        self.attack = sync_attack(ctx.node_config)  # a Byzantine peer of the slot (tests, drills, benches)

    async def peers_of_slot(self) -> list[str]:
        return (await self.view.read()).peers(self.role, self.slot, exclude=self.ctx.host.peer_id)

    # ---- start

    async def start(self, own: Offer | None) -> None:
        """Take the averager's namespace and serve our states, then take the slot's newest state."""
        try:
            await self.averager.start()
            self.state.start()
        except (NamespaceTaken, HandlerTaken) as e:
            raise RoleError(str(e)) from None
        await self._take(own)
        self.state.hash = self.weights.hash
        await self.state.save(self.state.step, self.weights.state(), self.state.hash)

    async def _take(self, own: Offer | None) -> None:
        coordinator = self.ctx.membership.coordinator
        asks = [self.state.ask(await self.peers_of_slot(), OFFER_S)]
        if coordinator and self.coordinator_slot is not None:
            asks.append(self.state.ask([coordinator], OFFER_S, slot=self.coordinator_slot))
        offers = [o for found in await asyncio.gather(*asks) for o in found.values()]
        if own is not None and not any(o.step >= own.step for o in offers) and await self._adopt(own):
            return  # a peer that was the only one of its slot loses nothing by a restart
        for offer in sorted(offers, key=lambda o: (o.step, o.from_peer, random.random()), reverse=True):
            if await self._adopt(offer):
                return

    async def _adopt(self, offer: Offer) -> bool:
        state = await self.state.fetch(offer)
        if state is None:
            return False
        async with self.weights.busy:
            await self.weights.compute(self.weights.adopt, state)
        self.state.held(offer.step, offer.hash, offer.peer)
        return True

    # ---- the rounds

    async def run(self) -> None:
        async for n in every_period(self.run_config.stage_sync_every_s):
            self.peers = await self.peers_of_slot()
            if self.peers:
                await self._sync(n)
            else:
                await self._advance_alone(n)
                self.ctx.activity.round("sync", "alone")

    async def _advance_alone(self, n: int) -> None:
        """The slot's only peer: its parameters become its outer state as they are, so the state
        a peer that joins downloads is what this one trained, not where the last sync left it."""
        async with self.weights.busy:
            synced = self.weights.take_as_outer()
        await self._committed(n, synced, upload=True)
        self.report(sync=n, group=1, state_hash=synced)

    async def _committed(self, n: int, synced: str, upload: bool) -> None:
        self.syncs += 1
        await self.state.save(n, self.weights.state(), synced)
        self.state.held(n, synced, self.state.source)  # (once on disk: what we offer can be downloaded)
        if upload and self.coordinator_slot is not None and self.syncs % self.run_config.checkpoint_every == 0:
            self.state.upload(self.ctx.membership.coordinator, n, synced)

    async def _sync(self, n: int) -> None:
        """One round with the slot's other peers. Calls are served while it runs (a dead or
        frozen peer of the slot must not stall the pipeline); the optimizer steps taken
        meanwhile are dropped when the round commits."""
        async with self.weights.busy:
            outer_hash = self.weights.outer_hash()
            pseudo = await self.weights.compute(self.weights.pseudo_gradient)
            version = self.weights.version
        lie = {}
        if self.attack is not None:
            pseudo = self.attack.apply(pseudo)
            lie = {"lie_norm": round(math.sqrt(sum(float(t.double().pow(2).sum()) for t in pseudo)), 4)}  # (the stats: what a test or bench checks)
        try:
            avg, report = await self.averager.average(f"sync-{n}-{outer_hash[:8]}", pseudo, weight=1.0, expected_peers=self.peers, state_key="outer")
        except AveragingFailed as e:
            log.warning("%s: sync %d failed (%s); training on, the next one covers it", self.what, n, e.report.reason)
            self.ctx.membership.progress.note(f"{self.what}: sync {n} failed ({e.report.reason})")
            self.ctx.activity.round("sync", "failed")
            if await self.catch_up() is None and e.report.late:
                # nobody else averaged and no peer of the slot answered: the peers the DHT still
                # lists are gone. Our parameters become the slot's state, as for a lone peer. (A
                # peer that answered with an older state takes ours: ours stays as it was, so both
                # enter the next round from the same hash)
                await self._advance_alone(n)
            return
        if self.attack is not None:
            self.attack.observe(avg)
        async with self.weights.busy:
            dropped = self.weights.version - version  # (each step since the snapshot moved it once)
            await self.weights.compute(self.weights.apply_outer, avg)
            synced = self.weights.hash
        size = math.sqrt(sum(float(t.double().pow(2).sum()) for t in avg))
        await self._committed(n, synced, upload=self.ctx.host.peer_id == min(report.members))
        self.ctx.activity.round("sync", "ok")
        log.info("%s: sync %d with %d peers in %.2f s, hash %s (%d steps of the round dropped)", self.what, n, len(report.members), report.seconds, synced, dropped)
        self.report(sync=n, group=len(report.members), dropped_steps=dropped, state_hash=synced, update_norm=round(size, 6), **lie)

    async def catch_up(self) -> bool | None:
        """After a failed sync: if the slot's other peers hold a newer state than ours (or, at
        the same round, the one more of them hold; a tie goes to the smaller hash), take it, so
        peers that drifted apart average together again. True: taken; False: ours is the one to
        keep; None: no peer of the slot answered."""
        offers = await self.state.ask(self.peers, CATCH_UP_S)
        if not offers:
            return None
        choice = choose_state((self.state.step, self.state.hash), {p: o.held for p, o in offers.items()})
        if choice is None:
            return False
        for offer in (o for o in offers.values() if o.held == choice):
            if await self._adopt(offer):
                await self.state.save(offer.step, self.weights.state(), offer.hash)
                log.info("%s: took the slot's state of round %d (hash %s) from %s", self.what, offer.step, offer.hash, offer.peer[-8:])
                self.report(caught_up_from=offer.peer, sync=offer.step, state_hash=offer.hash)
                return True
        return False

    # ---- leaving

    async def hand_over(self, flush: Callable[[], Awaitable[None]]) -> None:
        """The slot's last peer does not take the slot with it (see the module's docstring); the
        peers of a slot that stay keep its state: nothing to hand. `flush` takes a step that
        waited (nothing trained stays behind)."""
        if await self.peers_of_slot():
            return
        await flush()
        await self.state.writes_done()  # (a sync this stop cancelled may still be saving its round)
        period = self.run_config.stage_sync_every_s
        step = handover_round(self.state.step, self.state.newest(), time.time(), period)
        await asyncio.sleep(max(0.0, step * period - time.time()))  # the clock's round reaches it
        async with self.weights.busy:
            params, state_hash = self.weights.latest(), self.weights.hash
        await self.state.save(step, self.weights.state(params), state_hash)
        answer = await self.ctx.membership.leave()  # the coordinator re-plans without us: a peer moves to this slot
        named = [p for p in str((answer or {}).get("stage_peers", "")).split(",") if p and p != self.ctx.host.peer_id]
        if not named:  # no coordinator, or no peer it could move: nobody will come for the state
            log.warning("%s: its last peer is leaving and no peer takes it; its state (hash %s) stays in %s", self.what, state_hash, self.state.dir)
            return
        log.info("%s: its last peer is leaving; handing over its state (round %d, hash %s) to %s", self.what, step, state_hash, ", ".join(p[-8:] for p in named))
        taker = await self.state.taken(step, HANDOVER_S)
        if taker is None:
            log.warning("%s: no peer took its state within %.0f s; it stays in %s", self.what, HANDOVER_S, self.state.dir)
            return
        log.info("%s: %s took its state (hash %s); leaving", self.what, taker[-8:], state_hash)
        self.report(handed_over_to=taker, handover_step=step)

    async def close(self) -> None:
        await self.averager.close()
        await self.state.close()
