"""Join tokens for private swarms, and the membership certificates of owned swarms.

A token says: "the holder of peer id P (or any peer) may join swarm S in roles R until time T",
signed by the swarm owner's Ed25519 key. Wire form: msgpack [swarm_id, peer_id, roles,
expires_at, signature]; text form: URL-safe base64 of that, for flags and env vars.
`verify_token` returns a `TokenCheck` whose `reason` says why a token is refused.

A membership certificate says: "peer P is a member of swarm S, in role R, until time T", signed
by the swarm's owner (the key its id names, "name@<owner peer id>", which the coordinator holds).
The coordinator issues one after Register (in a private swarm: after checking the join token)
and a fresh one with heartbeats; every peer of the swarm checks it before it serves P (the
certificate travels in P's member record) and trusts no record of P without it. It lives
CERT_TTL_S: a revoked peer gets no new one, and the owner's revocation list (signed, in the DHT)
stops the current one everywhere within a record refresh.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass

import msgpack

from .errors import LocalProtocolError, RemoteProtocolError
from .signatures import SigningKey, verify

DOMAIN = "swarmtrain/join-token/v1"
ANY_PEER = "*"
MAX_TOKEN_SIZE = 4096


def _fields(data: bytes, what: str, names: tuple[str, ...]) -> list:
    """The msgpack list of `names` that a token or certificate is; RemoteProtocolError otherwise."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise RemoteProtocolError(f"not a {what} ({type(e).__name__})", what) from None
    if not (isinstance(obj, list) and len(obj) == len(names)):
        raise RemoteProtocolError(f"must be [{', '.join(names)}]", what)
    return obj


@dataclass(frozen=True)
class JoinToken:
    swarm_id: str
    peer_id: str  # a peer id, or "*" for any peer
    roles: tuple[str, ...]  # empty: any role
    expires_at: float  # seconds since the epoch
    signature: bytes = b""

    def signed_fields(self) -> tuple:
        return (DOMAIN, self.swarm_id, self.peer_id, tuple(sorted(self.roles)), float(self.expires_at))

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.swarm_id, self.peer_id, list(self.roles), float(self.expires_at), self.signature])

    def to_text(self) -> str:
        return base64.urlsafe_b64encode(self.to_bytes()).decode().rstrip("=")

    @classmethod
    def from_bytes(cls, data: bytes) -> JoinToken:
        if len(data) > MAX_TOKEN_SIZE:
            raise RemoteProtocolError(f"token is {len(data)} bytes, over {MAX_TOKEN_SIZE}", "token")
        swarm_id, peer_id, roles, expires_at, sig = _fields(data, "token", ("swarm_id", "peer_id", "roles", "expires_at", "signature"))
        if not (
            isinstance(swarm_id, str)
            and isinstance(peer_id, str)
            and isinstance(roles, list)
            and all(isinstance(r, str) for r in roles)
            and isinstance(expires_at, (int, float))
            and not isinstance(expires_at, bool)
            and not math.isnan(expires_at)
            and isinstance(sig, bytes)
        ):
            raise RemoteProtocolError("a field has the wrong type", "token")
        return cls(swarm_id, peer_id, tuple(roles), float(expires_at), sig)

    @classmethod
    def from_text(cls, text: str) -> JoinToken:
        text = text.strip()
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise RemoteProtocolError("not URL-safe base64", "token") from None
        return cls.from_bytes(raw)


def issue_token(
    owner: SigningKey, swarm_id: str, peer_id: str = ANY_PEER, roles: tuple[str, ...] = (), expires_at: float = math.inf
) -> JoinToken:
    if not swarm_id:
        raise LocalProtocolError("swarm_id must not be empty")
    unsigned = JoinToken(swarm_id, peer_id, tuple(roles), float(expires_at))
    return JoinToken(swarm_id, peer_id, tuple(roles), float(expires_at), owner.sign(unsigned.signed_fields()))


@dataclass(frozen=True)
class TokenCheck:
    ok: bool
    reason: str  # "ok", or why the token is refused

    def __bool__(self) -> bool:
        return self.ok


def verify_token(
    token: JoinToken, owner_public_key: bytes, swarm_id: str, peer_id: str, now: float, role: str | None = None
) -> TokenCheck:
    """Check signature, swarm, peer, role and expiry; the first failure is the reason."""
    if not verify(owner_public_key, token.signed_fields(), token.signature):
        return TokenCheck(False, "forged: signature does not match the swarm owner's key")
    if token.swarm_id != swarm_id:
        return TokenCheck(False, f"other swarm: token is for {token.swarm_id!r}, this is {swarm_id!r}")
    if token.peer_id not in (ANY_PEER, peer_id):
        return TokenCheck(False, f"other peer: token is for {token.peer_id}, not {peer_id}")
    if role is not None and token.roles and role not in token.roles:
        return TokenCheck(False, f"role {role!r} not allowed (token allows {', '.join(token.roles)})")
    if now >= token.expires_at:
        return TokenCheck(False, f"expired {now - token.expires_at:.0f} s ago")
    return TokenCheck(True, "ok")


CERT_DOMAIN = "swarmtrain/member-certificate/v1"
CERT_TTL_S = 600.0  # how long a certificate is good for (renewed with heartbeats once half of it is gone)
MAX_CERT_SIZE = 2048


@dataclass(frozen=True)
class MemberCertificate:
    swarm_id: str
    peer_id: str
    role: str  # the role label it was issued for ("replica", "stage:1", ...); informative: roles change between certificates
    issued_at: float
    expires_at: float
    signature: bytes = b""

    def signed_fields(self) -> tuple:
        return (CERT_DOMAIN, self.swarm_id, self.peer_id, self.role, float(self.issued_at), float(self.expires_at))

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.swarm_id, self.peer_id, self.role, float(self.issued_at), float(self.expires_at), self.signature])

    @classmethod
    def from_bytes(cls, data: bytes) -> MemberCertificate:
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_CERT_SIZE:
            raise RemoteProtocolError(f"must be bytes of at most {MAX_CERT_SIZE}", "certificate")
        swarm_id, peer_id, role, issued, expires, sig = _fields(data, "certificate", ("swarm_id", "peer_id", "role", "issued_at", "expires_at", "signature"))
        times_ok = all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (issued, expires))
        if not (isinstance(swarm_id, str) and isinstance(peer_id, str) and isinstance(role, str) and times_ok and isinstance(sig, bytes)):
            raise RemoteProtocolError("a field has the wrong type", "certificate")
        return cls(swarm_id, peer_id, role, float(issued), float(expires), sig)


def issue_certificate(owner: SigningKey, swarm_id: str, peer_id: str, role: str, now: float, ttl_s: float = CERT_TTL_S) -> MemberCertificate:
    unsigned = MemberCertificate(swarm_id, peer_id, role, float(now), float(now + ttl_s))
    return dataclasses.replace(unsigned, signature=owner.sign(unsigned.signed_fields()))


def certificate_problem(data: bytes, swarm_id: str, peer_id: str, now: float, revoked: Collection[str] = ()) -> str | None:
    """Why `data` is not a valid membership certificate of `peer_id` in the owned swarm
    `swarm_id` (whose id names the owner's key), None when it is."""
    from .records import owner_of
    from .signatures import public_key_from_peer_id

    owner = owner_of(swarm_id)
    owner_key = public_key_from_peer_id(owner) if owner else None
    if owner_key is None:
        return f"swarm {swarm_id!r} names no owner whose key could sign certificates"
    if not data:
        return "none presented"
    try:
        cert = MemberCertificate.from_bytes(data)
    except RemoteProtocolError as e:
        return str(e)
    check = verify_certificate(cert, owner_key, swarm_id, peer_id, now, revoked)
    return None if check else check.reason


def verify_certificate(cert: MemberCertificate, owner_public_key: bytes, swarm_id: str, peer_id: str, now: float, revoked: Collection[str] = ()) -> TokenCheck:
    """Signature (the owner's), swarm, peer, time and revocation; the first failure is the reason."""
    if not verify(owner_public_key, cert.signed_fields(), cert.signature):
        return TokenCheck(False, "forged: not signed by the swarm owner's key")
    if cert.swarm_id != swarm_id:
        return TokenCheck(False, f"other swarm: certificate is for {cert.swarm_id!r}, this is {swarm_id!r}")
    if cert.peer_id != peer_id:
        return TokenCheck(False, f"other peer: certificate is for {cert.peer_id}, not {peer_id}")
    if now >= cert.expires_at:
        return TokenCheck(False, f"expired {now - cert.expires_at:.0f} s ago")
    if peer_id in revoked:
        return TokenCheck(False, "revoked by the swarm owner")
    return TokenCheck(True, "ok")
