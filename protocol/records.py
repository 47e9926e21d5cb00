"""Signed records that live in the DHT (small: the DHT cannot carry values over ~64 KB).

A record is signed by its publisher's Ed25519 key over a canonical tuple with a domain tag,
and carries the public key; the libp2p peer id is derived from that key, so a valid record
for peer P can only have been made by the holder of P's key. `from_bytes` never trusts its
input: any failure raises RemoteProtocolError naming the problem.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import msgpack

from .errors import RemoteProtocolError
from .signatures import PUBLIC_KEY_SIZE, SigningKey, peer_id_from_public_key, public_key_from_peer_id, verify

MAX_RECORD_SIZE = 8192
MAX_RECORD_TTL_S = 3600.0  # a record is kept in the DHT at most this long after it was issued
CLOCK_SKEW_S = 60.0  # a record issued this far in our future is still taken (peers' clocks differ)
OWNER_SEP = "@"  # an owned swarm's id: "<name>@<the owner's peer id>"


def owner_of(swarm_id: str) -> str | None:
    """The peer id that owns `swarm_id` ("name@<peer id>"): only its key may sign the swarm's
    coordinator record. None for an unowned id (any peer may claim to coordinate it)."""
    name, sep, owner = swarm_id.rpartition(OWNER_SEP)
    return owner if sep else None


def swarm_id_problem(swarm_id: str) -> str | None:
    """What is wrong with a swarm id, None if nothing."""
    if not swarm_id or len(swarm_id) > 200 or any(c.isspace() or c == "/" for c in swarm_id):
        return "must be 1..200 characters without spaces or '/'"
    owner = owner_of(swarm_id)
    if owner is not None:
        name = swarm_id[: -len(owner) - 1]
        if not name or OWNER_SEP in name:
            return f"an owned swarm id is <name>{OWNER_SEP}<owner peer id>, with one {OWNER_SEP!r}"
        if public_key_from_peer_id(owner) is None:
            return f"its owner {owner!r} is not an Ed25519 libp2p peer id (12D3KooW..., 52 characters)"
    return None


def coordinator_key(swarm_id: str) -> str:
    return f"swarmtrain/{swarm_id}/coordinator"


def members_key(swarm_id: str) -> str:
    return f"swarmtrain/{swarm_id}/members"


def revoked_key(swarm_id: str) -> str:
    return f"swarmtrain/{swarm_id}/revoked"


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _strs(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(m, str) for m in v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bytes(v: Any) -> bool:
    return isinstance(v, bytes)


@dataclass(frozen=True)
class _SignedRecord:
    """Fields in order; the last two are always public_key and signature."""

    DOMAIN: ClassVar[str]
    CHECKS: ClassVar[tuple[Callable[[Any], bool], ...]]

    def _values(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def signed_fields(self) -> tuple:
        body = self._values()[:-2]
        return (self.DOMAIN, *(tuple(v) if isinstance(v, (list, tuple)) else v for v in body))

    def sign(self, key: SigningKey):
        unsigned = dataclasses.replace(self, peer_id=peer_id_from_public_key(key.public_key), public_key=b"", signature=b"")
        return dataclasses.replace(unsigned, public_key=key.public_key, signature=key.sign(unsigned.signed_fields()))

    def to_bytes(self) -> bytes:
        return msgpack.packb([list(v) if isinstance(v, tuple) else v for v in self._values()], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, swarm_id: str):
        """Parse and verify; raises RemoteProtocolError if malformed, forged or for another swarm."""
        what = cls.__name__
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_RECORD_SIZE:
            raise RemoteProtocolError(f"must be bytes of at most {MAX_RECORD_SIZE}", what)
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:
            raise RemoteProtocolError(f"not msgpack ({type(e).__name__})", what) from None
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(obj, list) or len(obj) != len(names):
            raise RemoteProtocolError(f"must be a list of {len(names)} fields", what)
        for name, value, check in zip(names, obj, cls.CHECKS):
            if not check(value):
                raise RemoteProtocolError(f"field {name} has the wrong type", what)
        rec = cls(**{n: tuple(v) if isinstance(v, list) else v for n, v in zip(names, obj)})
        if len(rec.public_key) != PUBLIC_KEY_SIZE or peer_id_from_public_key(rec.public_key) != rec.peer_id:
            raise RemoteProtocolError("public key does not match the peer id", what)
        if not verify(rec.public_key, rec.signed_fields(), rec.signature):
            raise RemoteProtocolError("forged: bad signature", what)
        if rec.swarm_id != swarm_id:
            raise RemoteProtocolError(f"record is for swarm {rec.swarm_id!r}, not {swarm_id!r}", what)
        return rec


@dataclass(frozen=True)
class CoordinatorRecord(_SignedRecord):
    """Where the swarm's coordinator is. The newest valid record wins."""

    swarm_id: str
    peer_id: str
    maddrs: tuple[str, ...]
    http: str  # "host:port" of its status page, "" if none
    issued_at: float  # seconds since the epoch
    expires_at: float = 0.0  # the latest the DHT may keep it (signed: nobody keeps it longer for its signer)
    public_key: bytes = b""
    signature: bytes = b""

    DOMAIN = "swarmtrain/coordinator-record/v2"
    CHECKS = (_str, _str, _strs, _str, _time, _time, _bytes, _bytes)


def role_label(role: str | None, slot: int | str | None = None) -> str:
    """How a member record names a peer's work (`MemberRecord.role`): its role and, for a role that
    holds one slot of the model, that slot: "replica", "trainer", "stage:2", "expert:shard1";
    "idle" for none. `parse_role_label` reads it back; nothing else writes or splits labels."""
    if not role:
        return "idle"
    return role if slot is None or slot == "" else f"{role}:{slot}"


def parse_role_label(label: str) -> tuple[str, str]:
    """(role, slot) of a role label; slot "" for a role that holds none ("stage:2" -> ("stage", "2"))."""
    role, _, slot = label.partition(":")
    return role, slot


def slot_index(label: str, role: str, prefix: str = "") -> int | None:
    """The number of a numbered slot: "stage:2" -> 2 for role "stage"; "expert:shard1" -> 1 for
    role "expert" with prefix "shard"; None for a label of another role or slot."""
    r, slot = parse_role_label(label)
    number = slot[len(prefix) :] if slot.startswith(prefix) else ""
    return int(number) if r == role and number.isdigit() else None


@dataclass(frozen=True)
class MemberRecord(_SignedRecord):
    """A node's own announcement: who it is, where, in what role, at what step, how fast and how busy."""

    swarm_id: str
    peer_id: str
    maddrs: tuple[str, ...]
    role: str  # its role label (`role_label`)
    step: int
    issued_at: float
    throughput: float = 0.0  # samples/s it measured at its role (an expert host: tokens/s of compute); 0: not yet
    load: float = 0.0  # calls waiting on it when it published (an expert host's queue)
    expires_at: float = 0.0  # the latest the DHT may keep it (signed: nobody keeps it longer for its signer)
    certificate: bytes = b""  # an owned swarm's: its membership certificate, signed by the owner (protocol/tokens.py)
    public_key: bytes = b""
    signature: bytes = b""

    DOMAIN = "swarmtrain/member-record/v3"
    CHECKS = (_str, _str, _strs, _str, _int, _time, _time, _time, _time, _bytes, _bytes, _bytes)


@dataclass(frozen=True)
class RevocationRecord(_SignedRecord):
    """An owned swarm's revocation list: peers every member refuses, signed by the owner. The
    coordinator publishes it with its own record; the newest valid one wins."""

    swarm_id: str
    peer_id: str  # the owner's
    revoked: tuple[str, ...]
    issued_at: float
    expires_at: float = 0.0
    public_key: bytes = b""
    signature: bytes = b""

    DOMAIN = "swarmtrain/revocation-record/v1"
    CHECKS = (_str, _str, _strs, _time, _time, _bytes, _bytes)


@dataclass(frozen=True)
class RelayHello(_SignedRecord):
    """The first bytes of a stream a relay carries (node/net/transport.py): who opened it, signed by
    them, to whom, for which of the target's protocols. The target serves the calls on it as
    calls of `peer_id` only if the signature holds, it is the target, the hello is fresh and its
    nonce new: a relay cannot make up a caller, send one caller's hello to another peer, or open
    a second stream with a hello it carried once."""

    swarm_id: str
    peer_id: str  # who opened the stream (the origin)
    target: str
    protocol: str
    issued_at: float
    nonce: bytes
    public_key: bytes = b""
    signature: bytes = b""

    DOMAIN = "swarmtrain/relay-hello/v1"
    CHECKS = (_str, _str, _str, _str, _time, _bytes, _bytes, _bytes)


RECORDS = {"coordinator": CoordinatorRecord, "members": MemberRecord, "revoked": RevocationRecord}


def check_stored(swarm_id: str, kind: str, value: bytes, subkey: str | None, expiration: float, now: float) -> CoordinatorRecord | MemberRecord | RevocationRecord:
    """Whether a value may be kept and served in the DHT under the swarm's `kind` key
    ("coordinator" or "members"), as every node's DHT checks it on store and in answers:
    a well-formed record of this swarm, signed by the key that owns it (the swarm owner's for the
    coordinator record, where the swarm id names one; the member's own, under its own peer id as
    the subkey), issued no later than CLOCK_SKEW_S from `now`, and kept no longer than the
    expiry its signer signed (at most MAX_RECORD_TTL_S after it was issued): nobody keeps
    another's record alive longer, so the newest valid record is the one that expires last.
    Returns the record; raises RemoteProtocolError naming the problem."""
    if kind in ("coordinator", "revoked"):
        cls = RECORDS[kind]
        if subkey is not None:
            raise RemoteProtocolError("one value, not a dictionary", cls.__name__)
        rec = cls.from_bytes(value, swarm_id)
        owner = owner_of(swarm_id)
        if owner is not None and rec.peer_id != owner:
            raise RemoteProtocolError(f"signed by {rec.peer_id}, not by the swarm's owner {owner}", cls.__name__)
        if owner is None and kind == "revoked":
            raise RemoteProtocolError("an unowned swarm has nobody to revoke peers", cls.__name__)
    elif kind == "members":
        if subkey is None:
            raise RemoteProtocolError("member records live under their peer ids as subkeys", "MemberRecord")
        rec = MemberRecord.from_bytes(value, swarm_id)
        if rec.peer_id != subkey:
            raise RemoteProtocolError(f"the record of {rec.peer_id} under the subkey {subkey!r}", "MemberRecord")
        if owner_of(swarm_id) is not None:  # an owned swarm's members hold a certificate from its owner
            from .tokens import certificate_problem

            problem = certificate_problem(rec.certificate, swarm_id, rec.peer_id, now)
            if problem:
                raise RemoteProtocolError(f"no valid membership certificate: {problem}", "MemberRecord")
    else:
        raise ValueError(f"no record kind {kind!r}")
    if rec.issued_at > now + CLOCK_SKEW_S:
        raise RemoteProtocolError(f"issued {rec.issued_at - now:.0f} s in the future", type(rec).__name__)
    if not rec.issued_at < rec.expires_at <= rec.issued_at + MAX_RECORD_TTL_S:
        raise RemoteProtocolError(f"expires {rec.expires_at - rec.issued_at:.0f} s after it was issued, not within (0, {MAX_RECORD_TTL_S:.0f}]", type(rec).__name__)
    if not math.isfinite(expiration) or expiration > rec.expires_at:
        raise RemoteProtocolError(f"to be kept {expiration - rec.expires_at:.0f} s past the expiry its signer signed", type(rec).__name__)
    return rec
