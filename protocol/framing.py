"""Length-prefixed msgpack frames: `encode(msg) -> bytes`, `Decoder.feed(bytes) -> [Message]`.

Frame layout::

    +----------------------+--------------------------------------------------+
    | length: uint32, BE   | msgpack body: [version, type_code, request_id, {fields}] |
    +----------------------+--------------------------------------------------+

The length is checked against `max_frame_size` as soon as its four bytes arrive, before any
body is buffered. After the first bad frame a `Decoder` is poisoned: a byte stream cannot be
re-synchronised, so every later `feed` raises the same error and the caller closes the stream.
Only `RemoteProtocolError` ever escapes `Decoder.feed`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import LocalProtocolError, RemoteProtocolError
from .messages import REGISTRY, Message

PROTOCOL_VERSION = 1
PREFIX_SIZE = 4
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024  # bytes; tensors larger than a frame are chunked


def _refuse_ext(code: int, data: bytes) -> Any:
    raise RemoteProtocolError(f"msgpack extension type {code} is not allowed", "frame")


def encode(msg: Message, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Serialize one message into one frame (prefix + body)."""
    return b"".join(encode_buffers(msg, max_frame_size))


_BIG = 1 << 16  # bytes fields at least this large are not copied into the msgpack body


def encode_buffers(msg: Message, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> list:
    """The same frame as `encode`, as a list of buffers to write one after another: large bytes
    fields (tensor chunks) are referenced, not copied. The bytes are identical to `encode`'s."""
    if not isinstance(msg, Message) or msg.TYPE not in REGISTRY:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: not a registered message")
    fields = msg.fields()
    pieces: list = []
    # [v, t, id, {fields}]: an array of 4 whose first three items we pack, then the map by hand
    head = bytearray(b"\x94")
    for item in (PROTOCOL_VERSION, msg.TYPE, msg.request_id):
        head += msgpack.packb(item)
    n = len(fields)
    head += bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    for key, value in fields.items():
        head += msgpack.packb(key, use_bin_type=True)
        if isinstance(value, (bytes, bytearray, memoryview)) and memoryview(value).nbytes >= _BIG:
            size = memoryview(value).nbytes
            head += b"\xc6" + size.to_bytes(4, "big")  # bin 32
            pieces.append(bytes(head))
            pieces.append(value)
            head = bytearray()
        else:
            head += msgpack.packb(value, use_bin_type=True)
    if head:
        pieces.append(bytes(head))
    total = sum(memoryview(p).nbytes for p in pieces)
    if total > max_frame_size:
        raise LocalProtocolError(f"{type(msg).__name__} frame is {total} bytes, over the {max_frame_size}-byte limit; chunk it")
    return [total.to_bytes(PREFIX_SIZE, "big"), *pieces]


def decode_body(body: bytes) -> Message:
    """Parse one frame body (without its prefix) into a message; raises RemoteProtocolError."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True)
    except RemoteProtocolError:
        raise
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, StackError, ...)
        raise RemoteProtocolError(f"not valid msgpack ({type(e).__name__}: {e})", "frame") from None
    if not isinstance(obj, list) or len(obj) != 4:
        raise RemoteProtocolError("body must be [version, type, request_id, fields]", "frame")
    version, code, request_id, fields = obj
    if isinstance(version, bool) or not isinstance(version, int):
        raise RemoteProtocolError("must be an int", "version")
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})", "version")
    if isinstance(code, bool) or not isinstance(code, int):
        raise RemoteProtocolError("must be an int", "type")
    cls = REGISTRY.get(code)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {code}", "type")
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id < 2**63:
        raise RemoteProtocolError("must be an int in [0, 2^63)", "request_id")
    if not isinstance(fields, dict):
        raise RemoteProtocolError("must be a map", "fields")
    return cls.from_fields(fields, request_id)


class Decoder:
    """Incremental decoder: feed it bytes as they arrive, split or merged anywhere."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        if max_frame_size < 1:
            raise LocalProtocolError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(data)
        except RemoteProtocolError as e:
            self._error = e
            self._buf = bytearray()
            raise

    def _feed(self, data: bytes) -> list[Message]:
        out: list[Message] = []
        buf = self._buf
        buf += data
        pos = 0  # start of the first unconsumed byte
        while True:
            avail = len(buf) - pos
            if avail < PREFIX_SIZE:
                break
            size = int.from_bytes(buf[pos : pos + PREFIX_SIZE], "big")
            if size == 0:
                raise RemoteProtocolError("empty frame", "length")
            if size > self.max_frame_size:
                raise RemoteProtocolError(f"frame of {size} bytes exceeds the {self.max_frame_size}-byte limit", "length")
            if avail < PREFIX_SIZE + size:
                break
            start = pos + PREFIX_SIZE
            pos = start + size
            with memoryview(buf) as view:  # no copy of the body; released before buf is resized
                out.append(decode_body(view[start:pos]))
        if pos:
            del buf[:pos]
        return out
