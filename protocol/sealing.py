"""Sealed records for the direct data plane, sans-IO: AES-256-GCM over a byte stream.

A direct connection (plain TCP between two nodes, see `node/net/direct.py`) carries the same frames
as a libp2p stream, cut into records, each sealed:

    record = u32 big-endian length of what follows | AES-256-GCM(plaintext) with its 16-byte tag

The key is 32 random bytes the dialer made and sent to the listener over libp2p (encrypted and
authenticated by it), so only those two know it, and the listener knows which peer holds it.
Nonces are never sent: each side counts its records, and a record's nonce is the direction
(0: dialer to listener, 1: back) and its number. A record altered, dropped, replayed or
reordered on the way fails authentication, and the stream is broken from there on: the
`Opener` refuses everything after the first bad record.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import LocalProtocolError, RemoteProtocolError

KEY_BYTES = 32
TAG_BYTES = 16
MAX_RECORD = 1 << 20  # plaintext bytes per record; larger writes are cut
SMALL = 64 << 10  # writes below this are gathered into one record with their neighbours
_HEADER = struct.Struct(">I")

DIALER, LISTENER = 0, 1  # who seals: the direction part of the nonce


def _aead(key: bytes) -> AESGCM:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise LocalProtocolError(f"a sealing key is {KEY_BYTES} bytes")
    return AESGCM(bytes(key))


def _nonce(direction: int, counter: int) -> bytes:
    return bytes((direction, 0, 0, 0)) + counter.to_bytes(8, "big")


class Sealer:
    """Seals what one side writes: buffers in, the bytes to send out (a list, for writelines)."""

    def __init__(self, key: bytes, direction: int):
        self._aead = _aead(key)
        self._direction = direction
        self._count = 0

    def seal(self, buffers) -> list[bytes]:
        out: list[bytes] = []
        small = bytearray()
        for buf in buffers:
            view = memoryview(buf).cast("B")
            if len(view) < SMALL:  # gathered; sealed once enough is together
                small += view
                if len(small) < SMALL:
                    continue
                view, small = memoryview(small), bytearray()
            elif small:  # what was gathered goes first
                self._records(memoryview(small), out)
                small = bytearray()
            self._records(view, out)
        if small:
            self._records(memoryview(small), out)
        return out

    def _records(self, view: memoryview, out: list[bytes]) -> None:
        for start in range(0, len(view), MAX_RECORD):
            sealed = self._aead.encrypt(_nonce(self._direction, self._count), view[start : start + MAX_RECORD], None)
            self._count += 1
            out.append(_HEADER.pack(len(sealed)))
            out.append(sealed)


class Opener:
    """Opens what the other side sealed. Bytes from the wire go into its buffer (`get_buffer`,
    `buffer_updated`: no copy on the way in), whole records come out decrypted, straight into
    the caller's memory (`open_into`) or as bytes (`open`); `feed` does all of it for a chunk
    of bytes. A bad record raises `RemoteProtocolError`, and so does every later call."""

    def __init__(self, key: bytes, direction: int):
        self._aead = _aead(key)
        self._direction = direction
        self._count = 0
        self._buf = bytearray(2 * (_HEADER.size + MAX_RECORD + TAG_BYTES))  # never resized
        self._pos = self._end = 0
        self._broken: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that have not been opened yet."""
        return self._end - self._pos

    def get_buffer(self) -> memoryview:
        """Where the next bytes from the wire go (then call `buffer_updated`). There is always
        room for at least one whole record."""
        if self._pos == self._end:
            self._pos = self._end = 0
        elif len(self._buf) - self._end < _HEADER.size + MAX_RECORD + TAG_BYTES:
            held = self._end - self._pos
            self._buf[:held] = self._buf[self._pos : self._end]
            self._pos, self._end = 0, held
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes

    def missing(self) -> int:
        """Bytes still to come before the next record is all here (at least 1)."""
        held = self._end - self._pos
        if held < _HEADER.size:
            return _HEADER.size - held
        (size,) = _HEADER.unpack_from(self._buf, self._pos)
        return max(1, _HEADER.size + size - held)

    def next_size(self) -> int | None:
        """Plaintext bytes of the next record if all of it is here, else None."""
        if self._broken is not None:
            raise self._broken
        if self._end - self._pos < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buf, self._pos)
        if not TAG_BYTES <= size <= MAX_RECORD + TAG_BYTES:
            self._broken = RemoteProtocolError(f"sealed record of {size} bytes (at most {MAX_RECORD + TAG_BYTES})", "record")
            raise self._broken
        if self._end - self._pos < _HEADER.size + size:
            return None
        return size - TAG_BYTES

    def open_into(self, out: memoryview) -> None:
        """Decrypt the next record (`next_size()` bytes, all here) into `out`, exactly that long."""
        self._open(out)

    def open(self) -> bytes:
        """Decrypt the next record (all here) into new bytes."""
        return self._open(None)

    def _open(self, out: memoryview | None):
        size = self.next_size()
        if size is None:
            raise LocalProtocolError("no whole record to open")
        start = self._pos + _HEADER.size
        nonce = _nonce(self._direction, self._count)
        try:
            with memoryview(self._buf) as view, view[start : start + size + TAG_BYTES] as sealed:
                if out is None:
                    plain = self._aead.decrypt(nonce, sealed, None)
                elif _DECRYPT_INTO:
                    plain = self._aead.decrypt_into(nonce, sealed, None, out)
                else:  # an older cryptography
                    out[:] = plain = self._aead.decrypt(nonce, sealed, None)
        except InvalidTag:
            self._broken = RemoteProtocolError(f"sealed record {self._count} failed authentication (altered, replayed or out of order)", "record")
            raise self._broken from None
        self._count += 1
        self._pos = start + size + TAG_BYTES
        return plain

    def feed(self, data) -> list[bytes]:
        """Take bytes as they arrived; return the records they completed, opened."""
        view, out = memoryview(data).cast("B"), []
        while True:
            while self.next_size() is not None:
                out.append(self.open())
            if not view:
                return out
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]


_DECRYPT_INTO = hasattr(AESGCM, "decrypt_into")
