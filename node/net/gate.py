"""Who a peer of an owned swarm serves: its members, each proven by a certificate.

In a swarm whose id names its owner ("name@<owner peer id>", see `swarmtrain-coordinator init`),
the coordinator (which holds the owner's key) gives every peer it registers a membership
certificate, renewed with heartbeats (protocol/tokens.py). A peer's transport presents its
certificate (MemberProof) before its first call to another peer, and again after a renewal; a
peer serves a caller nothing but MemberProof and Ping (the coordinator: Register and Heartbeat,
for peers joining) until the caller's certificate checks out: the owner's signature, this swarm,
the caller's own peer id, not expired, not revoked. Every other call is refused as
`unauthorized` with the reason, before any work. The owner's revocation list (a signed DHT
record the coordinator publishes) is read with each member record refresh: a revoked peer is
refused by everyone within one refresh, and its member records are not trusted.

Why certificates and not the join tokens themselves: a token may be open (any peer), is
long-lived and is only the coordinator's to judge; a certificate names one peer, lives
`CERT_TTL_S`, and exists only while the coordinator keeps registering that peer, so revocation
needs no token list on every peer. An unowned swarm id (no '@') has no owner to sign
certificates: its peers serve anyone (a public swarm's open default).
"""

from __future__ import annotations

import logging
import time

from protocol import Ack, MemberCertificate, MemberProof, Ping
from protocol.records import owner_of
from protocol.tokens import certificate_problem

from .transport import CallContext, RPCError

log = logging.getLogger(__name__)

NOT_PRESENTED = "no valid membership certificate presented"


class MemberGate:
    def __init__(self, swarm_id: str, exempt: tuple[type, ...] = ()):
        owner = owner_of(swarm_id)
        if owner is None:
            raise ValueError(f"swarm {swarm_id!r} has no owner: nothing certifies its members")
        self.swarm_id, self.owner = swarm_id, owner
        self.exempt = frozenset({MemberProof, Ping, *exempt})
        self.credential = b""  # our own certificate, presented to the peers we call
        self.admitted: dict[str, float] = {}  # peer -> when the certificate it presented expires
        self.revoked: frozenset[str] = frozenset()
        self.refused = 0  # calls refused for want of a certificate (and certificates refused)

    def check(self, peer_id: str) -> None:
        """Raises RPCError(unauthorized) naming the reason, unless `peer_id` may be served."""
        if peer_id == self.owner:
            return
        if peer_id in self.revoked:
            self.refused += 1
            raise RPCError("unauthorized", f"{peer_id} is revoked by the owner of swarm {self.swarm_id}")
        until = self.admitted.get(peer_id)
        if until is None or time.time() >= until:
            self.refused += 1
            why = "its last one expired" if until is not None else "send MemberProof first"
            raise RPCError("unauthorized", f"{NOT_PRESENTED} ({why}): swarm {self.swarm_id} serves its members only")

    async def on_proof(self, ctx: CallContext) -> Ack:
        data = ctx.request.certificate
        problem = certificate_problem(data, self.swarm_id, ctx.peer_id, time.time(), self.revoked)
        if problem:
            self.refused += 1
            log.info("refused the membership certificate of %s: %s", ctx.peer_id, problem)
            raise RPCError("unauthorized", f"membership certificate refused: {problem}")
        self.admitted[ctx.peer_id] = MemberCertificate.from_bytes(data).expires_at
        return Ack()

    def set_revoked(self, peers: frozenset[str]) -> None:
        if peers != self.revoked:
            log.info("revocation list of swarm %s: %d peer(s)", self.swarm_id, len(peers))
        self.revoked = peers
