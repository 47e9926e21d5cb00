"""Ed25519 keys and signatures over a canonical encoding.

The canonical encoding of a record is msgpack of a *tuple* of scalars (or nested tuples) in a
fixed order, never a dict, so that signer and verifier always hash the same bytes. A domain tag
as the first element keeps a signature for one kind of record from being replayed as another.

Keys on disk are PKCS#8 PEM, written with mode 0600 (created that way, never chmod-ed later).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import LocalProtocolError

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64

_SCALARS = (bytes, str, int, float, bool, type(None))


class KeyFileError(Exception):
    """A key file is missing, unreadable, or not an Ed25519 private key. The message says which."""


def canonical(fields: tuple) -> bytes:
    """Deterministic bytes for a tuple of scalars / nested tuples."""
    if not isinstance(fields, tuple):
        raise LocalProtocolError(f"canonical encoding needs a tuple, got {type(fields).__name__}")

    def check(v):
        if isinstance(v, tuple):
            for x in v:
                check(x)
        elif not isinstance(v, _SCALARS):
            raise LocalProtocolError(f"canonical encoding cannot hold {type(v).__name__}")

    check(fields)
    return msgpack.packb(fields, use_bin_type=True)


class SigningKey:
    """An Ed25519 private key."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def seed(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def public_key(self) -> bytes:
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, fields: tuple) -> bytes:
        return self._key.sign(canonical(fields))

    def save(self, path: str | os.PathLike) -> None:
        """Write as PKCS#8 PEM, mode 0600, atomically (a crash leaves the old file or none)."""
        path = Path(path)
        pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> SigningKey:
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise KeyFileError(f"key file {path} does not exist") from None
        except OSError as e:
            raise KeyFileError(f"cannot read key file {path}: {e.strerror}") from None
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise KeyFileError(f"key file {path} is not a PEM private key (corrupt or wrong format)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> SigningKey:
        """Load the key at `path`; create and save a new one only if the file does not exist."""
        if not Path(path).exists():
            key = cls.generate()
            key.save(path)
            return key
        return cls.load(path)


_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _base58(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def libp2p_public_key(public_key: bytes) -> bytes:
    """libp2p's protobuf PublicKey{Type: Ed25519, Data: key}."""
    return b"\x08\x01\x12\x20" + public_key


def libp2p_private_key(key: SigningKey) -> bytes:
    """libp2p's protobuf PrivateKey{Type: Ed25519, Data: seed || public key}: the p2pd identity file."""
    return b"\x08\x01\x12\x40" + key.seed + key.public_key


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id ("12D3KooW...") of an Ed25519 key: the identity multihash of its
    protobuf encoding, in base58. Binds a signed record to the peer that transports it."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise LocalProtocolError(f"an Ed25519 public key has {PUBLIC_KEY_SIZE} bytes, got {len(public_key)}")
    encoded = libp2p_public_key(public_key)
    return _base58(bytes([0x00, len(encoded)]) + encoded)


def verify(public_key: bytes, fields: tuple, signature: bytes) -> bool:
    """True iff `signature` is `public_key`'s signature over canonical(fields)."""
    if len(public_key) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, canonical(fields))
        return True
    except (InvalidSignature, ValueError):
        return False


def public_key_from_peer_id(peer_id: str) -> bytes | None:
    """The Ed25519 public key an Ed25519 peer id ("12D3KooW...") embeds; None for anything else
    (so a swarm id names its owner's key, not only a hash of it)."""
    n = 0
    for c in peer_id:
        i = _B58.find(c)
        if i < 0:
            return None
        n = n * 58 + i
    raw = n.to_bytes(38, "big") if n < 1 << (8 * 38) else b""
    head = bytes([0x00, 36]) + b"\x08\x01\x12\x20"
    if len(raw) != 38 or not raw.startswith(head) or peer_id_from_public_key(raw[len(head):]) != peer_id:
        return None
    return raw[len(head):]
