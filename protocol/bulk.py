"""Bulk data and checkpoint messages: tensor chunks, state blob ranges, bandwidth probes, the
opening of direct connections, checkpoint manifests and uploads."""

from __future__ import annotations

import dataclasses

from .schema import MAX_ID_LEN, Message, Params, _require, message

# ---------------------------------------------------------------------------------------------
# Bulk data

MAX_TENSOR_NDIM = 8
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@message(20)
class TensorPart(Message):
    """One chunk of an encoded tensor. Every part repeats the small header so any part can be
    checked on its own; `offset`/`total_size` locate `data` inside the codec payload."""

    BULK_FIELDS = ("data",)

    key: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: Params = dataclasses.field(default_factory=dict)
    index: int = 0
    count: int = 1
    offset: int = 0
    total_size: int = 0
    data: bytes = b""

    def validate(self) -> None:
        _require(len(self.key) <= MAX_ID_LEN, "key", "must be at most 256 characters")
        _require(self.dtype in TENSOR_DTYPES, "dtype", f"unknown dtype {self.dtype!r}")
        _require(len(self.shape) <= MAX_TENSOR_NDIM, "shape", f"at most {MAX_TENSOR_NDIM} dimensions")
        _require(all(d >= 0 for d in self.shape), "shape", "dimensions must be >= 0")
        _require(self.count >= 1, "count", "must be >= 1")
        _require(0 <= self.index < self.count, "index", "must be in [0, count)")
        _require(self.total_size >= 0, "total_size", "must be >= 0")
        _require(0 <= self.offset <= self.total_size, "offset", "must be in [0, total_size]")
        _require(self.offset + len(self.data) <= self.total_size, "data", "runs past total_size")


@message(21)
class StateRequest(Message):
    """Ask for a byte range of a named state blob (a checkpoint file, a replica's state)."""

    name: str
    offset: int = 0
    length: int = 0  # 0: to the end

    def validate(self) -> None:
        _require(len(self.name) <= 1024, "name", "must be at most 1024 characters")
        _require(self.offset >= 0, "offset", "must be >= 0")
        _require(self.length >= 0, "length", "must be >= 0")


@message(22)
class StateChunk(Message):
    """A byte range of a named state blob; `sha256` is the hex digest of the whole blob."""

    BULK_FIELDS = ("data",)

    name: str
    offset: int
    total_size: int
    sha256: str
    data: bytes = b""

    def validate(self) -> None:
        _require(self.total_size >= 0, "total_size", "must be >= 0")
        _require(0 <= self.offset <= self.total_size, "offset", "must be in [0, total_size]")
        _require(self.offset + len(self.data) <= self.total_size, "data", "runs past total_size")
        _require(
            len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256),
            "sha256",
            "must be 64 lowercase hex digits",
        )


MAX_PROBE_BYTES = 8 << 20


@message(6)
class Probe(Message):
    """Bandwidth probe: the receiver answers with a Probe carrying `want` bytes."""

    BULK_FIELDS = ("data",)

    data: bytes = b""
    want: int = 0

    def validate(self) -> None:
        _require(0 <= self.want <= MAX_PROBE_BYTES, "want", f"must be in [0, {MAX_PROBE_BYTES}]")


MAX_DIRECT_ADDRS = 16


@message(7)
class DirectOpen(Message):
    """Sent over libp2p before a direct connection (plain TCP, records sealed with `key`, see
    `protocol/sealing.py`): the dialer presents `ticket` first on the connection, and the
    listener serves it as a stream from the peer that sent this message."""

    ticket: bytes
    key: bytes

    def validate(self) -> None:
        _require(len(self.ticket) == 16, "ticket", "must be 16 bytes")
        _require(len(self.key) == 32, "key", "must be 32 bytes (an AES-256 key)")


@message(8)
class DirectAddress(Message):
    """The reply to DirectOpen: where to connect ("host:port", most likely first)."""

    addrs: tuple[str, ...] = ()

    def validate(self) -> None:
        _require(len(self.addrs) <= MAX_DIRECT_ADDRS, "addrs", f"at most {MAX_DIRECT_ADDRS}")
        for a in self.addrs:
            host, sep, port = a.rpartition(":")
            _require(bool(sep and host) and len(a) <= 64 and port.isdigit() and 0 < int(port) < 65536, "addrs", f"not host:port: {a[:64]!r}")


# ---------------------------------------------------------------------------------------------
# Checkpoints


MAX_MANIFEST_BYTES = 1 << 20


@message(30)
class CheckpointQuery(Message):
    """Ask for a checkpoint's manifest: a given step, or the latest (`step` None); of a pipeline
    stage's checkpoints (`stage`) where the peer keeps them per stage (the coordinator)."""

    step: int | None = None
    stage: int | None = None

    def validate(self) -> None:
        _require(self.stage is None or self.stage >= 0, "stage", "must be >= 0")


@message(31)
class CheckpointManifest(Message):
    """A checkpoint's manifest (JSON bytes: files with sha256 and size, step, model config)."""

    step: int
    manifest: bytes

    def validate(self) -> None:
        _require(self.step >= 0, "step", "must be >= 0")
        _require(len(self.manifest) <= MAX_MANIFEST_BYTES, "manifest", f"at most {MAX_MANIFEST_BYTES} bytes")


@message(32)
class CheckpointOffer(Message):
    """Start of an upload: the manifest, then StateChunk frames (name = file name) for every
    file in it, in manifest order. The reply is an Ack once every hash has been checked."""

    step: int
    manifest: bytes

    def validate(self) -> None:
        _require(self.step >= 0, "step", "must be >= 0")
        _require(len(self.manifest) <= MAX_MANIFEST_BYTES, "manifest", f"at most {MAX_MANIFEST_BYTES} bytes")
