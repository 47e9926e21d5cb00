"""The coordinator: membership registry, role planning, checkpoints, served over the same RPC
transport as nodes, and its signed record in the DHT so nodes can find it.

It is never in the data path: nodes keep training while it is down. All state is on disk
(SQLite registry, checkpoint directories), so a SIGKILL and restart loses nothing; members get
one heartbeat timeout of grace after a restart before any eviction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from protocol import (
    Ack,
    CheckpointOffer,
    Deregister,
    Heartbeat,
    Hello,
    JoinToken,
    Probe,
    Register,
    RemoteProtocolError,
    RoleAssignment,
    StateChunk,
    verify_token,
)
from protocol.records import CoordinatorRecord, RevocationRecord, coordinator_key, owner_of, revoked_key, role_label
from protocol.tokens import CERT_TTL_S, issue_certificate

from node.config import ConfigError
from node.net.gate import MemberGate
from node.net.host import DHTError, Host, HostConfig
from node.state.model_files import ModelFilesSource
from node.state.state_server import CheckpointServer
from node.net.transport import CallContext, RPCError, Transport, TransportConfig

from .checkpoints import CheckpointError, CheckpointStore, weights_as_first_checkpoint, weights_as_first_stage_checkpoints
from .config import CoordinatorConfig, check_coordinator, context_length, cut_dims, expert_slots, resolve_model
from .expert_stores import EXPERT_CHECKPOINTS, ExpertStores
from .history import Rate
from .journal import Recorder
from .tools import read_revoked, revocation_file
from .planner import TOKEN_ROLES, Eviction, Plan, PlannerConfig, checkpoint_quorum, evict, plan_roles
from .registry import AsyncRegistry, Member, Registry, RegistryError
from .status import checkpoint_rows, dense_view, member_rows, shard_views, stage_views

log = logging.getLogger(__name__)

STATUS_EVENTS = 200  # the newest events /status shows


# -- registry jobs: each runs on the registry's thread as one job (see AsyncRegistry.run), so
# what it reads is still true when it writes: no other handler's write comes in between

def _refresh_all(registry: Registry, now: float) -> None:
    """Mark every member alive at `now`."""
    for m in registry.members():
        registry.heartbeat(m.peer_id, now)


def _evict_silent(registry: Registry, planner: PlannerConfig, recorder: Recorder) -> list[Eviction]:
    """Remove the members `evict` picks now; the evictions that removed someone (as events too)."""
    now = time.time()
    evicted = [ev for ev in evict(now, registry.views(), planner) if registry.remove(ev.peer_id)]
    for ev in evicted:
        recorder.event(now, "evict", ev.peer_id, ev.reason)
        recorder.forget(ev.peer_id)
    return evicted


def _tick(registry: Registry, recorder: Recorder, now: float) -> None:
    """The history's interval points that are due (journal.Recorder.tick)."""
    recorder.tick(now, [Rate(m.peer_id, m.role, m.samples_per_second) for m in registry.members()])


def _plan_and_store(registry: Registry, planner: PlannerConfig) -> Plan:
    """Plan roles over the members; store the changes with the next plan epoch."""
    plan = plan_roles(registry.views(), planner)
    if plan.changes:
        epoch = int(registry.get_meta("epoch", 0)) + 1
        registry.set_assignments(
            [(p, plan.assignments[p].role, plan.assignments[p].stage, plan.assignments[p].expert) for p in plan.changes],
            epoch,
            meta={"epoch": epoch},
        )
    return plan


def _heartbeat(registry: Registry, recorder: Recorder, req: Heartbeat, now: float) -> tuple[Member | None, bool]:
    """Store a heartbeat and what the history takes from it; None for an unknown peer, and
    whether its role's failure changed (the plan changes with it). A throughput measured at
    other work than the member's current assignment (it has not switched yet) is dropped."""
    current = registry.get(req.peer_id)
    if current is None:
        return None, False
    rate = req.samples_per_second
    if req.measured_as and req.measured_as != role_label(current.role, current.stage if current.stage is not None else current.expert):
        rate = None
    member = registry.heartbeat(req.peer_id, now, req.step, req.loss, rate, req.state_hash, req.failure)
    if member is None:  # cannot happen: it was there in this same job
        return None, False
    recorder.heartbeat(now, req, member.role, current.failed)
    return member, member.failed != current.failed


def _snapshot(registry: Registry) -> dict[str, Any]:
    """Members, plan epoch and the history, as of one moment."""
    h = registry.history
    return {"members": registry.members(), "epoch": registry.get_meta("epoch", 0), "progress": h.progress(), "throughput": h.throughput(), "events": h.events(STATUS_EVENTS)}


class StoreSource:
    """The checkpoint store as node/state/state_server.py serves it: verified checkpoints only."""

    def __init__(self, store: CheckpointStore):
        self.store = store

    def latest_step(self) -> int | None:
        info = self.store.latest()
        return None if info is None else info.step

    def manifest(self, step: int) -> dict | None:
        return next((i.manifest for i in self.store.list() if i.step == step), None)

    def files(self, step: int) -> dict[str, tuple[int, str]]:
        try:
            return {name: (size, sha) for name, size, sha in self.store.files(step)}
        except CheckpointError as e:
            raise KeyError(str(e)) from None

    def read_chunk(self, step: int, name: str, offset: int, length: int) -> bytes:
        return self.store.read_chunk(step, name, offset, length)


def stage_costs(config: CoordinatorConfig) -> tuple[float, ...]:
    """Pipeline mode: each stage's compute per sample relative to the others, its blocks (the
    embeddings' look-up and the head are small next to a block); RunConfigError (a ConfigError,
    naming it) when the cut does not fit the model."""
    if config.mode != "pipeline" or config.run.num_stages < 1:
        return ()
    return tuple(float(end - start) for start, end in config.run.stage_plan(cut_dims(config)))


class Coordinator:
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.registry: AsyncRegistry | None = None  # its calls run off the event loop, in order
        self.recorder: Recorder | None = None  # the history: used only in the registry's jobs
        self.store: CheckpointStore | None = None
        self.host: Host | None = None
        self.transport: Transport | None = None
        self.http = None
        self.owner_key: bytes | None = None
        self.evictions = 0
        self.reasons: dict[str, str] = {}  # why each member has its role (for its log and ours)
        self.hash_reports: dict[int, dict[str, str]] = {}  # step -> peer -> state hash it reported
        self.stage_hash_reports: dict[tuple[int, int], dict[str, str]] = {}  # (stage, sync round) -> peer -> hash
        self.stage_stores: dict[int, CheckpointStore] = {}  # pipeline mode: each stage's checkpoints
        self.expert_stores: ExpertStores | None = None  # experts mode: each shard's and the dense parts' checkpoints
        self.run = config.run  # as members get it: a model directory becomes its pin (validate)
        self.run_config = self._assignment_config(config.run)
        self.model_files: ModelFilesSource | None = None
        self.started_at = time.time()
        self._tasks: list[asyncio.Task] = []
        self.owned = False  # the swarm id names its owner (this coordinator's identity): members hold certificates
        self.gate: MemberGate | None = None
        self.certified: dict[str, float] = {}  # peer -> when we last gave it a certificate
        self.revoked: frozenset[str] = frozenset()
        self._plan_lock = asyncio.Lock()
        try:
            self.planner = PlannerConfig(
                mode=config.mode, num_stages=config.run.num_stages, heartbeat_timeout_s=config.heartbeat_timeout_s,
                rebalance_margin=config.rebalance_margin, stage_costs=stage_costs(config), experts=expert_slots(config),
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # ---- lifecycle ------------------------------------------------------------------------------

    def validate(self):
        c = self.config
        data, key = check_coordinator(c)  # --http, data dir, identity, multiaddrs (the CLI ran them first)
        self.run = resolve_model(c, data)
        self.run_config = self._assignment_config(self.run)
        self.model_files = ModelFilesSource(data / "model")
        if c.owner_public_key:
            try:
                self.owner_key = bytes.fromhex(c.owner_public_key)
            except ValueError:
                self.owner_key = None
            if self.owner_key is None or len(self.owner_key) != 32:
                raise ConfigError("--owner-public-key must be 64 hex digits (an Ed25519 public key)")
        if c.private:
            self.owner_key = key.public_key  # the owner's key is this coordinator's identity (checked above)
        self.owned = owner_of(c.swarm_id) is not None
        self.revocations = revocation_file(data)
        self.revoked: frozenset[str] = frozenset(read_revoked(self.revocations))
        if c.keep_checkpoints < 1:
            raise ConfigError("--keep-checkpoints must be at least 1")
        try:
            self.registry = AsyncRegistry(Registry(data / "registry.sqlite"))
        except RegistryError as e:
            raise ConfigError(str(e)) from None
        self.recorder = Recorder(self.registry.registry.history, context_length(c))
        try:
            self.store = CheckpointStore(data / "checkpoints", keep=c.keep_checkpoints, signing_key=key)
            if c.mode == "pipeline":
                self.stage_stores = {
                    i: CheckpointStore(data / "stage-checkpoints" / f"stage-{i}", keep=c.keep_checkpoints, signing_key=key) for i in range(c.run.num_stages)
                }
            if c.mode == "experts":
                self.expert_stores = ExpertStores(data / EXPERT_CHECKPOINTS, c.run.expert_shards, c.keep_checkpoints, key)
        except (CheckpointError, OSError) as e:
            raise ConfigError(f"checkpoint store: {e}") from None
        if self.run.model != c.run.model:  # a model directory given: its weights, if any, start a new run
            try:
                if self.stage_stores:
                    weights_as_first_stage_checkpoints(self.stage_stores, c.run.model, self.run.model, c.run.stage_plan(cut_dims(c)))
                else:
                    weights_as_first_checkpoint(self.store, c.run.model, self.run.model)
            except (CheckpointError, OSError) as e:
                raise ConfigError(f"model: {e}") from None
        return key

    def _assignment_config(self, run) -> bytes:
        """What every assignment carries: the run, and our heartbeat timeout (a node whose
        heartbeat interval is longer than a third of it heartbeats more often)."""
        return json.dumps({**run.to_dict(), "heartbeat_timeout_s": self.config.heartbeat_timeout_s}, sort_keys=True).encode()

    async def start(self) -> None:
        key = self.validate()
        c = self.config
        # grace after a restart: members get a full timeout to check in before eviction
        await self.registry.run(_refresh_all, time.time())
        self.host = await Host.start(key, HostConfig(c.initial_peers, c.host_maddrs, c.announce_maddrs, swarm_id=c.swarm_id))
        self.transport = Transport(self.host, TransportConfig(relay_service=c.serve_relay))
        if self.owned:  # members only, but for what joining takes
            self.gate = MemberGate(c.swarm_id, exempt=(Hello, Register, Heartbeat, Deregister, Probe))
            self.gate.set_revoked(self.revoked)
            self.transport.use_gate(self.gate)
        for msg_type, handler in [
            (Hello, self.on_hello),
            (Register, self._on_register),
            (Heartbeat, lambda ctx: self._refusals(self.on_heartbeat(ctx), ctx.peer_id)),
            (Deregister, self.on_deregister),
            (CheckpointOffer, self.on_checkpoint_offer),
        ]:
            self.transport.on(msg_type, handler)
        stage_sources = {i: StoreSource(store) for i, store in self.stage_stores.items()}
        if self.expert_stores is not None:  # (asked for by index, as a stage's are: expert_stores.py)
            stage_sources = {i: StoreSource(store) for i, store in self.expert_stores.by_index().items()}
        CheckpointServer(self.transport, StoreSource(self.store), stage_source=stage_sources.get, model_source=self.model_files).start()
        await self.transport.start()
        if c.http:
            from .http import start_http

            self.http = await start_http(self, c.http)
        maddrs = await self.host.visible_maddrs()
        log.info("coordinator %s for swarm %r on %s; status at %s", self.host.peer_id, c.swarm_id, " ".join(maddrs), self.http_address or "-")
        await self._replan()
        self._tasks += [
            asyncio.create_task(self._publish_record_loop(), name="coordinator-record"),
            *([asyncio.create_task(self._revocation_loop(), name="revocations")] if self.owned else []),
            asyncio.create_task(self._evict_loop(), name="evict"),
        ]

    @property
    def http_address(self) -> str:
        return self.http.address if self.http else ""

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.stop()
        if self.transport is not None:
            await self.transport.close()
        if self.host is not None:
            await self.host.shutdown()
        if self.registry is not None:
            await self.registry.close()

    # ---- background loops -----------------------------------------------------------------------

    async def _publish_record_loop(self) -> None:
        c = self.config
        while True:
            now = time.time()
            rec = CoordinatorRecord(c.swarm_id, self.host.peer_id, tuple(await self.host.visible_maddrs()), self.http_address, now, now + 3 * c.record_interval_s).sign(self.host.key)
            try:
                await self.host.dht_store(coordinator_key(c.swarm_id), rec.to_bytes(), now + 3 * c.record_interval_s)
            except DHTError as e:  # no DHT peers yet, say: next round
                log.debug("could not publish the coordinator record: %s", e)
            await asyncio.sleep(c.record_interval_s)

    async def _revocation_loop(self) -> None:
        """The owner's revocation list (DATA_DIR/revoked, which `swarmtrain-coordinator revoke`
        writes): read every record interval, published signed in the DHT (every member refuses
        the peers on it within one record refresh), and its peers deregistered here."""
        c = self.config
        while True:
            try:
                self.revoked = frozenset(await asyncio.to_thread(read_revoked, self.revocations))
            except (ConfigError, OSError) as e:
                log.error("revocation list %s not read: %s (the last one read stays)", self.revocations, e)
            self.gate.set_revoked(self.revoked)
            for peer in self.revoked:
                if await self.registry.remove(peer):
                    self.certified.pop(peer, None)
                    log.info("deregistered %s: revoked by the owner", peer)
                    await self._record("revoke", peer, "revoked by the owner: deregistered", forget=True)
                    await self._replan()
            now = time.time()
            rec = RevocationRecord(c.swarm_id, "", tuple(sorted(self.revoked)), now, now + 3 * c.record_interval_s).sign(self.host.key)
            try:
                await self.host.dht_store(revoked_key(c.swarm_id), rec.to_bytes(), rec.expires_at)
            except DHTError as e:  # no DHT peers yet, say: next round
                log.debug("could not publish the revocation list: %s", e)
            await asyncio.sleep(c.record_interval_s)

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.heartbeat_timeout_s / 4))
            for ev in await self.registry.run(_evict_silent, self.planner, self.recorder):
                self.evictions += 1
                self.reasons.pop(ev.peer_id, None)
                log.info("evicted %s: %s", ev.peer_id, ev.reason)
            await self.registry.run(_tick, self.recorder, time.time())
            # every tick, not only on churn: throughputs arrive in heartbeats, and the planner
            # moves at most one peer per call when it rebalances
            await self._replan()

    async def _replan(self) -> None:
        async with self._plan_lock:
            plan = await self.registry.run(_plan_and_store, self.planner)
            for p in plan.changes:
                a = plan.assignments[p]
                self.reasons[p] = a.reason
                log.info("assigned %s: %s%s (%s)", p, a.role, f" {a.stage}" if a.stage is not None else f" {a.expert}" if a.expert else "", a.reason)

    async def _record(self, kind: str, peer_id: str | None, detail: str, forget: bool = False) -> None:
        """An event for /status (history.EventLimiter may leave it out); `forget`: the peer left,
        its counters go."""

        def record(registry: Registry) -> None:
            self.recorder.event(time.time(), kind, peer_id, detail)
            if forget and peer_id is not None:
                self.recorder.forget(peer_id)

        await self.registry.run(record)

    async def _assignment(self, peer_id: str) -> RoleAssignment:
        m = await self.registry.get(peer_id)
        if m is None:
            raise RPCError("not_found", "unknown peer: register first")
        cert = b""
        now = time.time()
        if self.owned and now - self.certified.get(peer_id, -math.inf) > CERT_TTL_S / 2:  # new, or half of it gone: a fresh one
            cert = issue_certificate(self.host.key, self.config.swarm_id, peer_id, m.role or "idle", now).to_bytes()
            self.certified[peer_id] = now
        return RoleAssignment(
            peer_id=peer_id,
            role=m.role or "idle",
            stage=m.stage,
            expert=m.expert,
            epoch=m.epoch,
            reason=self.reasons.get(peer_id, "assigned before the coordinator restarted"),
            config=self.run_config,
            certificate=cert,
        )

    # ---- membership handlers --------------------------------------------------------------------

    @staticmethod
    def _check_sender(ctx: CallContext, peer_id: str) -> None:
        # the transport authenticated ctx.peer_id; a message may only speak for its sender
        if peer_id != ctx.peer_id:
            raise RPCError("unauthorized", f"peer {ctx.peer_id} cannot act for {peer_id}")

    async def on_hello(self, ctx: CallContext) -> Hello:
        return Hello(peer_id=self.host.peer_id, swarm_id=self.config.swarm_id, software="swarmtrain-coordinator/0.1")

    async def _refusals(self, call, peer_id: str):
        """Await a handler's `call`; a peer it refuses (token, revocation) is an event."""
        try:
            return await call
        except RPCError as e:
            if e.code == "unauthorized":
                await self._record("refused", peer_id, e.message)
            raise

    async def _on_register(self, ctx: CallContext) -> RoleAssignment:
        """on_register, with its refusals and the members it lets in as events."""
        known = await self.registry.get(ctx.peer_id) is not None
        reply = await self._refusals(self.on_register(ctx), ctx.peer_id)
        if not known:
            caps = ctx.request.capabilities
            device = " ".join(str(caps[k]) for k in ("device", "device_name") if caps.get(k))
            await self._record("join", ctx.peer_id, f"assigned {reply.role} ({device or 'device unknown'}, {caps.get('software') or 'software unknown'})")
        return reply

    async def on_register(self, ctx: CallContext) -> RoleAssignment:
        req: Register = ctx.request
        self._check_sender(ctx, req.peer_id)
        if req.peer_id in self.revoked:
            raise RPCError("unauthorized", f"{req.peer_id} is revoked by the owner of swarm {self.config.swarm_id}")
        self.certified.pop(req.peer_id, None)  # (registering again: a certificate with the answer)
        capabilities = {k: v for k, v in req.capabilities.items() if k != TOKEN_ROLES}  # (ours to say, not the node's)
        if self.owner_key is not None:
            if req.token is None:
                raise RPCError("unauthorized", "this swarm is private: a join token is required")
            try:
                token = JoinToken.from_bytes(req.token)
            except RemoteProtocolError as e:
                raise RPCError("unauthorized", f"bad join token: {e}") from None
            check = verify_token(token, self.owner_key, self.config.swarm_id, req.peer_id, time.time(), role=req.wanted_role)
            if not check:
                raise RPCError("unauthorized", f"join token refused: {check.reason}")
            if token.roles:  # the planner gives it no other role (planner.allowed_roles)
                capabilities[TOKEN_ROLES] = ",".join(sorted(token.roles))
        try:
            await self.registry.register(req.peer_id, req.maddrs, capabilities, time.time(), wanted_role=req.wanted_role)
        except ValueError as e:
            raise RemoteProtocolError(str(e), "capabilities") from None
        log.info("registered %s (%s)", req.peer_id, ", ".join(f"{k}={v}" for k, v in sorted(req.capabilities.items())))
        await self._replan()
        return await self._assignment(req.peer_id)

    async def on_heartbeat(self, ctx: CallContext) -> RoleAssignment:
        req: Heartbeat = ctx.request
        self._check_sender(ctx, req.peer_id)
        if req.peer_id in self.revoked:
            raise RPCError("unauthorized", f"{req.peer_id} is revoked by the owner of swarm {self.config.swarm_id}")
        member, failure_changed = await self.registry.run(_heartbeat, self.recorder, req, time.time())
        if member is None:
            raise RPCError("not_found", "unknown peer: register first")
        if failure_changed:
            log.warning("%s: %s", req.peer_id, f"its role failed: {member.failed}" if member.failed else "its role no longer fails")
            await self._replan()
        if req.state_hash and self.expert_stores is not None:  # a shard's host or a trainer, after a round of its slot
            self.expert_stores.report(req.peer_id, member.role, member.expert, req.step, req.state_hash)
        elif req.state_hash:
            # a stage server reports the sync round and the hash of its stage's state after it
            stage_key = member.stage if member.role == "stage" else None
            reports, key = (self.stage_hash_reports, (stage_key, req.step)) if stage_key is not None else (self.hash_reports, req.step)
            reports.setdefault(key, {})[req.peer_id] = req.state_hash
            while len(reports) > 64 * max(1, len(self.stage_stores)):  # a bounded window of the most recent steps
                del reports[min(reports, key=lambda k: k if stage_key is None else k[1])]
        return await self._assignment(req.peer_id)

    async def on_deregister(self, ctx: CallContext) -> Ack:
        req: Deregister = ctx.request
        self._check_sender(ctx, req.peer_id)
        leaving = await self.registry.get(req.peer_id)
        removed = await self.registry.remove(req.peer_id)
        info: dict = {"removed": removed}
        if removed:
            self.reasons.pop(req.peer_id, None)
            log.info("deregistered %s (%s)", req.peer_id, req.reason or "no reason given")
            await self._record("leave", req.peer_id, req.reason or "no reason given", forget=True)
            await self._replan()
            if leaving is not None and leaving.role in ("stage", "expert"):
                # who serves its stage (or shard of experts) now: the last peer of one hands its state to them
                info["stage_peers"] = ",".join(
                    sorted(m.peer_id for m in await self.registry.members() if (m.role, m.stage, m.expert) == (leaving.role, leaving.stage, leaving.expert))
                )
        return Ack(info=info)

    # ---- checkpoints ----------------------------------------------------------------------------

    async def on_checkpoint_offer(self, ctx: CallContext) -> Ack:
        offer: CheckpointOffer = ctx.request
        try:
            manifest = json.loads(offer.manifest)
        except ValueError as e:
            raise RemoteProtocolError(f"manifest is not JSON: {e}", "manifest") from None
        state_hash = manifest.get("state_hash") if isinstance(manifest, dict) else None
        state_hash = state_hash if isinstance(state_hash, str) else None  # (anything else is no hash)
        stage = (manifest.get("model_config") or {}).get("stage") if isinstance(manifest, dict) and isinstance(manifest.get("model_config"), dict) else None
        store, expert_slot = self.store, None
        if self.expert_stores is not None:  # experts mode: a shard's experts, or the trainers' dense parts
            expert_slot, store = self.expert_stores.store_for(manifest)
            stage = None
        elif self.stage_stores:  # pipeline mode: a stage server's state, kept per stage
            if stage not in self.stage_stores or isinstance(stage, bool):
                raise RemoteProtocolError(f"a checkpoint of this pipeline must name its stage (0..{len(self.stage_stores) - 1}) in model_config, got {stage!r}", "manifest")
            store = self.stage_stores[stage]
        else:
            stage = None
        verified_by = await self._await_quorum(offer.step, state_hash, stage, expert_slot)
        try:
            upload = store.begin_upload(offer.step, manifest, verified_by)
        except CheckpointError as e:
            raise RemoteProtocolError(f"manifest refused: {e}", "manifest") from None
        try:
            remaining = {name: meta["size"] for name, meta in manifest["files"].items()}
            while any(remaining.values()):
                chunk = await ctx.receive()
                if not isinstance(chunk, StateChunk):
                    raise RemoteProtocolError(f"expected StateChunk, got {type(chunk).__name__}", "upload")
                if remaining.get(chunk.name, 0) < len(chunk.data) or not chunk.data:
                    raise RemoteProtocolError(f"unexpected data for {chunk.name!r}", "upload")
                upload.write(chunk.name, chunk.offset, chunk.data)
                remaining[chunk.name] -= len(chunk.data)
            info = await asyncio.get_running_loop().run_in_executor(None, upload.commit)
        except CheckpointError as e:
            upload.abort()
            raise RemoteProtocolError(f"upload refused: {e}", "upload") from None
        except BaseException:
            upload.abort()
            raise
        where = f" of stage {stage}" if stage is not None else f" of {expert_slot}" if expert_slot else ""
        one = " (verified by one replica)" if verified_by == 1 else ""
        log.info("stored checkpoint %d%s uploaded by %s%s", info.step, where, ctx.peer_id, one)
        await self._record("checkpoint", ctx.peer_id, f"step {info.step}{where}, hash {(state_hash or '')[:16] or 'none'}{one}")
        return Ack(info={"step": info.step})

    async def _await_quorum(self, step: int, state_hash: str | None, stage: int | None = None, expert_slot: str | None = None, wait_s: float = 15.0) -> int | None:
        """Hold an upload until enough replicas (of the stage, or members of the experts run's
        slot) reported its hash (their heartbeats may trail it); how many did (None: step 0,
        the initial state, which needs nobody's)."""
        deadline = time.monotonic() + wait_s
        while True:
            if expert_slot is not None:
                replicas, reports = self.expert_stores.reported(expert_slot, step, await self.registry.members())
            elif stage is None:
                replicas, reports = sum(1 for m in await self.registry.members() if m.role == "replica"), self.hash_reports.get(step, {})
            else:
                replicas = sum(1 for m in await self.registry.members() if m.role == "stage" and m.stage == stage)
                reports = self.stage_hash_reports.get((stage, step), {})
            ok, reason = checkpoint_quorum(step, state_hash, reports, replicas)
            if ok:
                log.debug("checkpoint %d: %s", step, reason)
                return sum(h == state_hash for h in reports.values()) if step else None
            if time.monotonic() > deadline:
                raise RPCError("timeout", f"checkpoint {step} refused: {reason}")
            await asyncio.sleep(0.2)

    # ---- status ---------------------------------------------------------------------------------

    async def status(self) -> dict:
        snap = await self.registry.run(_snapshot)
        registered = snap["members"]
        kept = self.expert_stores.listed() if self.expert_stores is not None else {}
        return {
            "swarm_id": self.config.swarm_id,
            "run": self.run.to_dict(),  # as members get it (a Hugging Face model by its pin)
            "stages": stage_views(registered, self.config.run.num_stages, self.stage_stores) if self.config.mode == "pipeline" else {},
            "expert_shards": shard_views(registered, self.planner.experts, kept),
            "dense": dense_view(registered, kept) if self.expert_stores is not None else {},
            "peer_id": self.host.peer_id if self.host else None,
            "maddrs": await self.host.visible_maddrs() if self.host else [],
            "now": time.time(),
            "started_at": self.started_at,
            "epoch": snap["epoch"],
            "members": member_rows(registered),
            "checkpoints": checkpoint_rows(self.store),
            "progress": [p._asdict() for p in snap["progress"]],  # one point per outer step, or per interval (coordinator/history.py)
            "throughput": [p._asdict() for p in snap["throughput"]],
            "events": [e._asdict() for e in snap["events"]],  # newest last
            "evictions": self.evictions,
        }
