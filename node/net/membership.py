"""The node's side of membership: find the coordinator, register, heartbeat, and publish a
signed membership record in the DHT. The swarm does not depend on the coordinator being up:
when it is unreachable the node keeps its role and retries with backoff, and its DHT record
keeps announcing it; when the coordinator comes back the node registers again. A coordinator
that answers with a refusal (`Refused`) ends the node instead."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import Deregister, Heartbeat, Probe, Register, RemoteProtocolError, RoleAssignment
from protocol.session import MAX_NOTE_LEN, MAX_NOTES
from protocol.records import CoordinatorRecord, MemberRecord, RevocationRecord, coordinator_key, members_key, revoked_key, role_label

from ..config import NodeConfig
from ..osutil import woken
from .host import DHTError, Host, split_peer_maddr
from .transport import NETWORK_ERRORS, RemoteError, Transport

log = logging.getLogger(__name__)

PROBE_BYTES = 2 << 20


class CoordinatorNotFound(Exception):
    pass


class Refused(Exception):
    """The coordinator refused this node ("unauthorized": no join token, an expired one, another
    peer's or swarm's, revoked by the owner). Final: asking again gets the same answer, so the
    node stops (a coordinator that is down or restarting is no refusal: that is retried)."""


@dataclass
class Progress:
    """What the role runner reports in heartbeats; updated in place by the runner."""

    step: int = 0
    loss: float | None = None
    samples_per_second: float | None = None
    state_hash: str | None = None
    measured_as: str = ""  # the work samples_per_second was measured at (a member record's role label); "": any
    failure: str = ""  # why the role failed ("": it did not); the node takes no other role until restarted
    notes: deque = field(default_factory=lambda: deque(maxlen=MAX_NOTES))  # for the operator, sent with the next heartbeat
    bans: deque = field(default_factory=lambda: deque(maxlen=MAX_NOTES))  # peers this node banned, sent with the next heartbeat
    extra: dict = field(default_factory=dict)

    def note(self, text: str) -> None:
        """Tell the coordinator's operator this (a failed round and why, say) with the next heartbeat."""
        self.notes.append(text[:MAX_NOTE_LEN] or "-")

    def banned(self, peer_id: str, text: str) -> None:
        """Tell the coordinator's operator that this node banned `peer_id` (`text`: for how long, and why)."""
        self.bans.append(f"{peer_id} {text}"[:MAX_NOTE_LEN])


class Membership:
    def __init__(self, host: Host, transport: Transport, config: NodeConfig, capabilities: dict, token: bytes | None = None):
        self.host, self.transport, self.config = host, transport, config
        self.capabilities = dict(capabilities)
        self.token = token
        self.progress = Progress()
        self.coordinator: str | None = None  # peer id
        self.known_coordinator: tuple[str, list[str]] | None = None  # (peer id, maddrs) last found in the DHT
        self.assignment: RoleAssignment | None = None
        self.registered = asyncio.Event()
        self.on_assignment: Callable[[RoleAssignment], None] | None = None
        self._trouble_logged = False
        self._wake = asyncio.Event()
        self._publish_wake = asyncio.Event()
        self.leaving = False  # deregistered on purpose: no more heartbeats or registrations
        self._deregistered = False
        self._announced: tuple[str, ...] | None = None  # the addresses our member record last carried
        self.interval = config.heartbeat_interval_s  # seconds between heartbeats (shorter where the coordinator's timeout asks it)

    def heartbeat_soon(self) -> None:
        """Report progress now instead of at the next interval (e.g. right after an outer step)."""
        self._wake.set()

    def publish_soon(self) -> None:
        """Announce ourselves in the DHT now instead of at the next interval: back on the
        network, our record has most likely gone stale and peers no longer count on us."""
        self._publish_wake.set()
    # ---- finding the coordinator ------------------------------------------------------------

    async def find_coordinator(self) -> str:
        if self.config.coordinator:
            addr, peer_id = split_peer_maddr(self.config.coordinator)
            await self.host.connect(peer_id, [addr])
            return peer_id
        raw = await self.host.dht_get(coordinator_key(self.config.swarm_id))
        if raw is None:
            if self.known_coordinator is not None:
                # our DHT may have lost its neighbours (a link that was down): the coordinator
                # we knew is most likely still where it was
                peer_id, maddrs = self.known_coordinator
                await self.host.connect(peer_id, maddrs)
                return peer_id
            raise CoordinatorNotFound(f"no coordinator record for swarm {self.config.swarm_id!r} in the DHT")
        rec = CoordinatorRecord.from_bytes(raw, self.config.swarm_id)
        await self.host.connect(rec.peer_id, list(rec.maddrs))
        self.known_coordinator = (rec.peer_id, list(rec.maddrs))
        return rec.peer_id

    def known_peers(self) -> dict[str, list[str]]:
        """Peers to join the DHT through again if it lost every neighbour: the coordinator."""
        if self.config.coordinator:
            return {split_peer_maddr(self.config.coordinator)[1]: [self.config.coordinator]}
        return dict([self.known_coordinator]) if self.known_coordinator else {}

    async def measure_bandwidth(self, peer_id: str) -> None:
        if self.config.bandwidth_mbps > 0:
            self.capabilities.update(up_mbps=self.config.bandwidth_mbps, down_mbps=self.config.bandwidth_mbps)
            return
        t0 = time.perf_counter()
        await self.transport.call(peer_id, Probe(data=bytes(PROBE_BYTES)), timeout=self.config.rpc_timeout_s)
        up = time.perf_counter() - t0
        t0 = time.perf_counter()
        await self.transport.call(peer_id, Probe(want=PROBE_BYTES), timeout=self.config.rpc_timeout_s)
        down = time.perf_counter() - t0
        self.capabilities.update(up_mbps=round(PROBE_BYTES * 8 / up / 1e6, 1), down_mbps=round(PROBE_BYTES * 8 / down / 1e6, 1))

    # ---- register / heartbeat -----------------------------------------------------------------

    async def register(self) -> RoleAssignment:
        peer_id = await self.find_coordinator()
        if "up_mbps" not in self.capabilities:
            await self.measure_bandwidth(peer_id)
        reply = await self.transport.call(
            peer_id,
            Register(
                peer_id=self.host.peer_id,
                maddrs=tuple(await self.host.visible_maddrs()),
                capabilities=self.capabilities,
                token=self.token,
                wanted_role=self.config.wanted_role or None,
            ),
            timeout=self.config.rpc_timeout_s,
        )
        self.coordinator = peer_id
        return self._accept(reply)

    async def heartbeat(self) -> RoleAssignment:
        assert self.coordinator is not None
        p = self.progress
        notes, bans, sent_total, received_total = tuple(p.notes), tuple(p.bans), *self.transport.traffic.totals()
        p.notes.clear()
        p.bans.clear()
        try:
            reply = await self.transport.call(
                self.coordinator,
                Heartbeat(
                    peer_id=self.host.peer_id, step=p.step, loss=p.loss, samples_per_second=p.samples_per_second, state_hash=p.state_hash,
                    measured_as=p.measured_as, bytes_sent=sent_total, bytes_received=received_total, failure=p.failure, notes=notes, bans=bans,
                ),  # fmt: skip
                timeout=self.config.rpc_timeout_s,
            )
        except BaseException:
            p.notes.extendleft(reversed(notes))  # not delivered: with the next one (the newest kept if too many)
            p.bans.extendleft(reversed(bans))
            raise
        return self._accept(reply)

    def _accept(self, reply) -> RoleAssignment:
        if not isinstance(reply, RoleAssignment):
            raise RemoteProtocolError(f"expected RoleAssignment, got {type(reply).__name__}", "reply")
        changed = self.assignment is None or (reply.role, reply.stage, reply.expert) != (
            self.assignment.role, self.assignment.stage, self.assignment.expert
        )
        if self.assignment is None or reply.config != self.assignment.config:
            self._heed_timeout(reply.config)
        self.assignment = reply
        gate = self.transport.gate
        if reply.certificate and gate is not None and reply.certificate != gate.credential:  # an owned swarm's certificate, new or renewed
            gate.credential = reply.certificate
            self.publish_soon()  # our record carries it: peers trust our records by it
        if changed:
            # what the old role measured and held is not the new one's to report
            p = self.progress
            p.state_hash, p.samples_per_second, p.measured_as = None, None, ""
            where = f" stage {reply.stage}" if reply.stage is not None else f" expert {reply.expert}" if reply.expert else ""
            log.info("role: %s%s (%s)", reply.role, where, reply.reason)
            if self.on_assignment:
                self.on_assignment(reply)
            self.publish_soon()  # our record names the role: peers look for e.g. a stage's servers by it
        return reply

    def _heed_timeout(self, config: bytes) -> None:
        """Heartbeat at least every third of the coordinator's heartbeat timeout (its assignments'
        config says it): at a longer interval it would evict us between two heartbeats."""
        try:
            timeout = json.loads(config).get("heartbeat_timeout_s") if config else None
        except (ValueError, AttributeError):  # (the run's config is checked where it is used)
            timeout = None
        ours = self.config.heartbeat_interval_s
        self.interval = ours
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < 3 * ours:
            self.interval = timeout / 3
            log.warning("--heartbeat-interval-s %g is more than a third of the coordinator's heartbeat timeout (%g s): heartbeating every %.2g s instead", ours, timeout, self.interval)

    async def run(self) -> None:
        """Register, then heartbeat forever; on trouble keep the role and retry with backoff.
        `Refused` when the coordinator refuses us: the node stops."""
        backoff = 0.5
        while True:
            if self.leaving:
                await asyncio.sleep(3600)
                continue
            try:
                if not self.registered.is_set():
                    await self.register()
                    self.registered.set()
                    if self._trouble_logged:
                        log.info("registered with the coordinator again")
                        self.publish_soon()
                    self._trouble_logged = False
                else:
                    await self.heartbeat()
                backoff = 0.5
                self._wake.clear()
                await woken(self._wake, self.interval)
            except (*NETWORK_ERRORS, CoordinatorNotFound, DHTError) as e:
                if isinstance(e, RemoteError) and e.code == "unauthorized":
                    raise Refused(f"the coordinator refused this node: {e.message}") from None
                if not self._trouble_logged:
                    log.warning("coordinator unreachable (%s); keeping role %s, retrying", e, self.assignment.role if self.assignment else None)
                    self._trouble_logged = True
                self.registered.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.max_backoff_s)

    async def publish_records(self) -> None:
        """Announce ourselves in the DHT, so peers find us even while the coordinator is down
        (and, in an owned swarm, read the owner's revocation list as often)."""
        while True:
            self._publish_wake.clear()
            if self.transport.gate is not None:
                await self.read_revocations()
            if self.transport.gate is None or self.transport.gate.credential:  # (an owned swarm's DHT keeps no record without a certificate)
                await self.publish_record()
            await woken(self._publish_wake, self.config.record_ttl_s / 3)

    async def publish_record(self) -> None:
        now = time.time()
        maddrs = tuple(await self.host.visible_maddrs())
        if maddrs != self._announced:  # (what p2pd reports may change: interfaces, an observed address)
            log.info("announcing %s", " ".join(maddrs) or "no address (client mode: others cannot dial us)")
            self._announced = maddrs
        rec = MemberRecord(
            swarm_id=self.config.swarm_id,
            peer_id=self.host.peer_id,
            maddrs=maddrs,
            role=self.assignment.label if self.assignment is not None else role_label(None),
            step=self.progress.step,
            issued_at=now,
            throughput=float(self.progress.samples_per_second or 0.0),
            load=float(self.progress.extra.get("load", 0.0)),
            expires_at=now + self.config.record_ttl_s,
            certificate=self.transport.gate.credential if self.transport.gate is not None else b"",
        ).sign(self.host.key)
        try:
            await self.host.dht_store(members_key(self.config.swarm_id), rec.to_bytes(), rec.expires_at, subkey=self.host.peer_id)
        except DHTError as e:  # the next round retries
            log.debug("could not publish member record: %s", e)

    async def read_revocations(self) -> None:
        """The owner's revocation list, from the DHT: its peers are refused by our transport, and
        their member records are not trusted (`read_members`)."""
        try:
            raw = await self.host.dht_get(revoked_key(self.config.swarm_id))
        except DHTError as e:  # the list stays as it was
            log.debug("could not read the revocation list: %s", e)
            return
        if raw is None:
            return
        try:
            rec = RevocationRecord.from_bytes(raw, self.config.swarm_id)  # (owner-signed: every DHT checks it)
        except RemoteProtocolError as e:
            log.debug("ignoring a revocation list: %s", e)
            return
        self.host.revoked = frozenset(rec.revoked)
        self.transport.gate.set_revoked(self.host.revoked)

    async def leave(self) -> dict | None:
        """Deregister now and register no more: the node is going, and the coordinator should plan
        without it already (e.g. move a peer to the stage it holds, which then takes its state).
        The coordinator's answer (Ack.info), None if it could not be told."""
        self.leaving = True
        self._wake.set()
        return await self._deregister()

    async def deregister(self, timeout: float = 2.0) -> bool:
        return await self._deregister(timeout) is not None

    async def _deregister(self, timeout: float = 2.0) -> dict | None:
        if self.coordinator is None or self._deregistered:
            return None
        self._deregistered = True
        try:
            reply = await self.transport.call(self.coordinator, Deregister(peer_id=self.host.peer_id, reason="shutting down"), timeout=timeout)
            return dict(getattr(reply, "info", {}) or {})
        except NETWORK_ERRORS as e:
            log.warning("could not deregister: %s", e)
            return None


async def read_members(host: Host, swarm_id: str) -> dict[str, MemberRecord]:
    """Valid member records currently in the DHT (forged or malformed ones are dropped)."""
    raw = await host.dht_get(members_key(swarm_id))
    out: dict[str, MemberRecord] = {}
    if not isinstance(raw, dict):
        return out
    for subkey, value in raw.items():
        try:
            rec = MemberRecord.from_bytes(value, swarm_id)
        except RemoteProtocolError as e:
            log.debug("ignoring a member record: %s", e)
            continue
        if rec.peer_id == subkey and rec.peer_id not in host.revoked:
            out[rec.peer_id] = rec
            host.learn_routes(rec.peer_id, rec.maddrs)  # relays it is reached through, if any
    return out
