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
from .signatures import PUBLIC_KEY_SIZE, SigningKey, peer_id_from_public_key, verify

MAX_RECORD_SIZE = 8192


def coordinator_key(swarm_id: str) -> str:
    return f"swarmtrain/{swarm_id}/coordinator"


def members_key(swarm_id: str) -> str:
    return f"swarmtrain/{swarm_id}/members"


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
    public_key: bytes = b""
    signature: bytes = b""

    DOMAIN = "swarmtrain/coordinator-record/v1"
    CHECKS = (_str, _str, _strs, _str, _time, _bytes, _bytes)


@dataclass(frozen=True)
class MemberRecord(_SignedRecord):
    """A node's own announcement: who it is, where, in what role, at what step, how fast and how busy."""

    swarm_id: str
    peer_id: str
    maddrs: tuple[str, ...]
    role: str
    step: int
    issued_at: float
    throughput: float = 0.0  # samples/s it measured at its role (an expert host: tokens/s of compute); 0: not yet
    load: float = 0.0  # calls waiting on it when it published (an expert host's queue)
    public_key: bytes = b""
    signature: bytes = b""

    DOMAIN = "swarmtrain/member-record/v2"
    CHECKS = (_str, _str, _strs, _str, _int, _time, _time, _time, _bytes, _bytes)
