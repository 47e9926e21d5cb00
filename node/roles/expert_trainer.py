"""The trainer role of an experts run: holds the data and the model's dense parts (embeddings,
attention, routers, head), calls the experts on their hosts (expert_client.py).

One micro-batch at a time (trainer_loop.py), on the role's compute thread: forward with the
experts remote, backward, the gradients clipped by one global norm with the experts' (a commit to
each host), an AdamW step on the dense parts. While no expert host can be called the micro-batch
waits (never a crash). The trainers average their dense parts among themselves every
`stage_sync_every_s`, in namespace "dense", weighted by the steps each has trained (a trainer
that joins late takes the others' at its first sync). Every `checkpoint_every` such rounds the
round's dense parts (the average, or a lone trainer's own) are a state the coordinator keeps
(`DenseCheckpoints`): each trainer reports its hash as its heartbeat's (step, state hash), and
one of them uploads it. A trainer starts from the newest of those the coordinator keeps.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch
from torch import nn

from protocol import RoleAssignment

from ..averaging import AveragingFailed, NamespaceTaken
from ..models.diloco import adamw, lr_at, state_hash
from ..runconfig import RunConfig
from .activations import activation_codec
from .expert_client import ExpertClient, NoExpertAlive, clip_and_commit
from .expert_host import MAX_CALL_TOKENS
from .expert_model import ExpertModel, expert_model, preset_model
from .role import Role, RoleContext, RoleError
from .slot_server import model_hash
from .slot_state import SlotState
from .slot_sync import OFFER_S, every_period, sync_averager
from .stats import LossLog
from .trainer_loop import micro_batch_loop, trainer_batches
from .view import Members, SwarmView
from .weights import ComputeThread

log = logging.getLogger(__name__)

NO_EXPERT_WAIT_S = 0.2  # while no expert host can be called: a host's ban ends, or the DHT names a new one


class ExpertTrainer(Role):
    """The trainer role of an experts run (see the module's docstring)."""

    name = "trainer"

    def __init__(self, ctx: RoleContext, run: RunConfig, assignment: RoleAssignment | None = None):
        self.spec: ExpertModel | None = None  # the run's model (a Hugging Face model's files are fetched at start)
        if not run.is_hf:
            self.spec = preset_model(run)
            self.spec.shard(run, 0)  # the shards fit the model
        c = ctx.node_config
        self.ctx, self.run_config, self.train_config = ctx, run, run.train_config()
        self.model: nn.Module | None = None
        self.opt = None
        self.client: ExpertClient | None = None
        self.steps = self.syncs = self.skipped_experts = 0
        self.trainers: list[str] = []  # the other trainers, who average the dense parts with us
        self.view = SwarmView(ctx.host, c.swarm_id, c.record_ttl_s)
        self._stopping = False
        self.losses = LossLog(Path(c.data_dir), ctx.membership, run.batch_size, stats=self._stats, line=lambda: f"{self.client.skipped} expert calls skipped",
                              entry=lambda: {"skipped_experts": self.skipped_experts}, reports_step=False, activity=ctx.activity)  # fmt: skip
        self._known = asyncio.Event()
        self._lock = asyncio.Lock()  # held while a micro-batch or a sync uses the dense parameters
        self._compute = ComputeThread(c.torch_threads(), "trainer")
        self.averager = sync_averager(ctx, run, "dense")
        self.kept: DenseCheckpoints | None = None
        self.dense_from: dict | None = None  # the coordinator's checkpoint the dense parts started from (None: the initial ones)

    def _build(self) -> None:
        self.model = self.spec.make_dense()  # its experts live on the expert hosts
        self.opt = adamw(self.model.parameters(), self.train_config)

    async def start(self) -> None:
        if self.spec is None:
            self.spec = await expert_model(self.run_config, self.ctx, lambda: self._stopping)
            self.spec.shard(self.run_config, 0)
        self.codec = activation_codec(self.run_config, self.spec.layout.width)
        await self._compute(self._build)
        self.kept = DenseCheckpoints(self.ctx, self.spec.meta, self._compute)
        taken = await self.kept.newest(self.run_config.expert_shards)
        if taken is not None:  # (the trainers' last kept dense parts, not the initial ones: every trainer may have restarted)
            step, h, params = taken
            await self._compute(self.model.load_state_dict, params)
            self.dense_from = {"step": step, "state_hash": h}
            log.info("trainer: dense parts of round %d (hash %s) from the coordinator", step, h)
        width = self.spec.layout.width
        self.client = ExpertClient(self.ctx.transport, asyncio.get_running_loop(), self.run_config, self.codec, MAX_CALL_TOKENS * width, self.spec.layout)
        try:
            await self.averager.start()
        except NamespaceTaken as e:
            raise RoleError(str(e)) from None

    async def stop(self, planned: bool = True) -> None:
        self._stopping = True
        self.view.close()
        await self.averager.close()
        if self.kept is not None:
            await self.kept.close()
        self._compute.close()

    async def run(self) -> None:
        batches, shard, nshards = await trainer_batches(self.ctx, self.run_config, self.spec.context, self.spec.tokenizer)
        tasks = [asyncio.create_task(self.view.follow(self._peers, self._known), name="expert-hosts"), asyncio.create_task(self._sync_forever(), name="dense-sync")]
        run = self.run_config
        try:
            await self._known.wait()
            layout = self.spec.layout
            log.info("trainer: %s, %d layers x %d experts (top %d) on %d shards, micro-batches of %d, activations %s, data shard %d/%d",
                     self.spec.source, layout.layers, layout.experts, layout.top_k, run.expert_shards, run.batch_size, self.codec.name, shard, nshards)  # fmt: skip
            self.losses.start()
            await micro_batch_loop(self.ctx.host.peer_id[-6:], batches, self._one, self.losses, in_flight=1)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _peers(self, members: Members) -> bool:
        """Which hosts serve which shard, and who the other trainers are; True once a shard has a host."""
        self.client.peers.announced = {peer: rec.load for peer, rec in members.records.items()}
        shards = members.numbered("expert", "shard", below=self.run_config.expert_shards)
        self.client.peers.update(shards)
        self.trainers = members.peers("trainer", exclude=self.ctx.host.peer_id)
        return any(shards.values())

    def _stats(self) -> dict:
        lat = sorted(self.client.latencies)
        return {
            "skipped_calls": self.client.skipped, "calls": self.client.calls, "skipped_experts": self.skipped_experts, "syncs": self.syncs,
            "layer_latency_p50_s": lat[len(lat) // 2] if lat else None, "layer_latency_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            "bytes_sent": self.client.caller.bytes_sent, "bytes_received": self.client.caller.bytes_received, "dense_from": self.dense_from,
            "checks": self.client.audit.counts,
        }  # fmt: skip

    async def _one(self, name: str, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One micro-batch (its loss; None for a non-finite one). While no expert host can be
        called it waits for one and tries again."""
        waiting = False
        while True:
            async with self._lock:
                loss, skipped = await self._compute(self._train_step, name, x, y)
            if skipped >= 0:
                self.skipped_experts += skipped
                return loss
            if not waiting:
                log.warning("trainer: no expert host can be called; waiting for one")
                waiting = True
            await asyncio.sleep(NO_EXPERT_WAIT_S)

    def _train_step(self, mb: str, x: torch.Tensor, y: torch.Tensor) -> tuple[float | None, int]:
        """One micro-batch: forward (the experts remote), backward, an AdamW step. On the compute thread."""
        try:
            ce, loss, skipped = self.spec.forward(self.model, self.client, mb, x, y)
        except NoExpertAlive:
            return None, -1
        if not torch.isfinite(loss):
            log.warning("micro-batch %s: non-finite loss; skipped", mb)
            return None, skipped
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        cfg = self.train_config
        if clip_and_commit(self.model, self.client, mb, cfg.grad_clip) == 0.0:
            log.warning("micro-batch %s: non-finite gradient norm; its gradients dropped here and on the hosts", mb)
            return None, skipped
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.steps, cfg)
        self.opt.step()
        self.steps += 1
        return ce.item(), skipped

    async def _sync_forever(self) -> None:
        """Average the dense parts with the other trainers at every period's boundary, each weighted
        by the steps it has trained (a trainer that just joined, its dense parts at their initial
        values, takes the others' instead of pulling them back). What a trainer learned while the
        round ran is kept: its parameters become the average plus its own progress since the
        snapshot. Every checkpoint_every rounds the round's dense parts are kept (module docstring)."""
        async for n in every_period(self.run_config.stage_sync_every_s):
            keep = n % self.run_config.checkpoint_every == 0
            if not self.trainers:
                if keep:
                    async with self._lock:
                        snap = [p.detach().clone() for p in self.model.parameters()]
                    await self._keep(n, snap, upload=True)
                continue
            async with self._lock:
                snap = [p.detach().clone() for p in self.model.parameters()]
            try:
                avg, report = await self.averager.average(f"dense-{n}", snap, weight=float(max(1, self.steps)), expected_peers=self.trainers)
            except AveragingFailed as e:
                log.warning("dense sync %d failed (%s); training on", n, e.report.reason)
                self.ctx.membership.progress.note(f"dense sync {n} failed ({e.report.reason})")
                self.ctx.activity.round("sync", "failed")
                continue
            async with self._lock:
                with torch.no_grad():
                    for p, s, a in zip(self.model.parameters(), snap, avg):
                        p.add_(a - s)
            self.syncs += 1
            self.ctx.activity.round("sync", "ok")
            log.info("dense sync %d with %d trainers in %.2f s", n, len(report.members), report.seconds)
            if keep:
                await self._keep(n, avg, upload=self.ctx.host.peer_id == min(report.members))

    async def _keep(self, n: int, params: list[torch.Tensor], upload: bool) -> None:
        names = [name for name, _ in self.model.named_parameters()]
        await self.kept.keep(n, dict(zip(names, params)), upload)


class DenseCheckpoints:
    """The trainers' dense parts as states the coordinator keeps (see the module's docstring):
    saved under DATA_DIR/dense-state (the newest few), reported, uploaded."""

    def __init__(self, ctx: RoleContext, meta: dict, compute: ComputeThread):
        data = Path(ctx.node_config.data_dir)
        self.ctx, self.compute = ctx, compute
        self.state = SlotState(ctx.transport, data / "dense-state", data / "dense-downloads", "dense parts", {**meta, "dense": True}, model_hash, compute)

    async def keep(self, n: int, params: dict[str, torch.Tensor], upload: bool) -> None:
        """Round `n`'s dense parts: saved, their hash in our heartbeats, uploaded when `upload`."""
        h = await self.compute(state_hash, params)
        await self.state.save(n, {"model": params}, h)
        p = self.ctx.membership.progress
        p.step, p.state_hash = n, h
        if upload:
            self.state.upload(self.ctx.membership.coordinator, n, h)

    async def newest(self, shards: int) -> tuple[int, str, dict[str, torch.Tensor]] | None:
        """(round, hash, parameters) of the newest dense parts the coordinator keeps (asked for by
        index `shards`, after the shards'), downloaded and hash-checked; None when it keeps none or
        cannot be reached."""
        coordinator = self.ctx.membership.coordinator
        if coordinator is None:
            return None
        for offer in (await self.state.ask([coordinator], OFFER_S, slot=shards)).values():
            state = await self.state.fetch(offer)
            if state is not None:
                return offer.step, offer.hash, state["model"]
        return None

    async def close(self) -> None:
        await self.state.close()
