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

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from .errors import LocalProtocolError, RemoteProtocolError
from .messages import REGISTRY, Message

PROTOCOL_VERSION = 1
PREFIX_SIZE = 4
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024  # bytes; tensors larger than a frame are chunked


def empty_buffer(size: int) -> memoryview:
    """A writable buffer of `size` bytes, not zeroed (every byte is written before it is read:
    zeroing frames and tensors as they arrive cost as much as receiving them)."""
    return memoryview(np.empty(size, dtype=np.uint8))


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


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat view of `data`'s bytes, whatever the buffer's own format."""
    return memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)


def _skip(buf, pos: int, depth: int = 0) -> int:
    """The end of the msgpack object that starts at `pos` (ValueError when it is not one we
    could decode: truncated, an unused or extension code, nested too deep)."""
    if depth > 64:
        raise ValueError("too deep")
    c = buf[pos]
    if c <= 0x7F or c >= 0xE0 or 0xC0 <= c <= 0xC3:  # fixint, nil, bool
        return pos + 1
    if 0xA0 <= c <= 0xBF:  # fixstr
        return pos + 1 + (c & 0x1F)
    if 0x80 <= c <= 0x9F:  # fixmap, fixarray
        items, pos = (c & 0x0F) * (2 if c < 0x90 else 1), pos + 1
    elif c in _FIXED:
        return pos + _FIXED[c]
    elif c in _SIZED:  # bin, str: a big-endian length, then the bytes
        n = _SIZED[c]
        return pos + 1 + n + int.from_bytes(buf[pos + 1 : pos + 1 + n], "big")
    elif c in _CONTAINERS:
        n, per = _CONTAINERS[c]
        items, pos = int.from_bytes(buf[pos + 1 : pos + 1 + n], "big") * per, pos + 1 + n
    else:  # 0xc1 and the extension types
        raise ValueError(f"code {c:#x}")
    for _ in range(items):
        pos = _skip(buf, pos, depth + 1)
    return pos


_FIXED = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
_BINS = {c: n for c, n in _SIZED.items() if c <= 0xC6}  # bin 8/16/32


def _bulk_fields(body: memoryview, bulk_min: int) -> dict[str, tuple[int, int, int]] | None:
    """Where the large bytes fields of a frame body lie: name -> (value start, data start, end),
    or None when there are none or the body is not laid out as ours are (a repeated key
    included): msgpack then decodes it the plain way, and names what is wrong."""
    try:
        if len(body) < bulk_min or body[0] != 0x94:
            return None
        pos = 1
        for _ in range(3):  # version, type, request id
            pos = _skip(body, pos)
        c = body[pos]
        if 0x80 <= c <= 0x8F:
            pairs, pos = c & 0x0F, pos + 1
        elif c == 0xDE:
            pairs, pos = int.from_bytes(body[pos + 1 : pos + 3], "big"), pos + 3
        else:
            return None
        keys, spans = [], {}
        for _ in range(pairs):
            key = pos
            pos = _skip(body, pos)
            keys.append(body[key:pos])
            value, c = pos, body[pos]
            if c in _BINS:
                n = _BINS[c]
                start = value + 1 + n
                pos = start + int.from_bytes(body[value + 1 : start], "big")
                if pos - start >= bulk_min and pos <= len(body):
                    spans[len(keys) - 1] = (value, start, pos)
            else:
                pos = _skip(body, pos)
        if pos != len(body) or not spans:
            return None
        names = [msgpack.unpackb(k, raw=False) for k in keys]
    except Exception:  # truncated, odd codes, a key msgpack refuses: the plain decode says what
        return None
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        return None
    return {names[i]: span for i, span in spans.items()}


def decode_body(body: bytes | bytearray | memoryview, bulk_min: int = _BIG) -> Message:
    """Parse one frame body (without its prefix) into a message; raises RemoteProtocolError.

    Bytes fields of at least `bulk_min` bytes that the message lists in `BULK_FIELDS` (tensor
    chunks, file chunks) come out as views of `body`, not copies: msgpack only ever sees the
    rest of the body. `body` must then stay unchanged for as long as the message lives."""
    view = _byte_view(body)
    spans = _bulk_fields(view, bulk_min)
    bulk: dict[str, memoryview] = {}
    if spans:
        rest, last = bytearray(), 0
        for name, (value, start, end) in sorted(spans.items(), key=lambda kv: kv[1]):
            bulk[name] = view[start:end]
            rest += view[last:value]
            rest.append(0xC0)  # nil where the bytes were
            last = end
        rest += view[last:]
        view = memoryview(rest)
    try:
        obj = msgpack.unpackb(view, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True)
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
    for name, data in bulk.items():
        fields[name] = data if name in cls.BULK_FIELDS else bytes(data)
    return cls.from_fields(fields, request_id)


class Decoder:
    """Incremental decoder: feed it bytes as they arrive, split or merged anywhere.

    Each frame's body is collected in a buffer of its own, so the bulk bytes of the message
    decoded from it can be views of that buffer. Two ways to give it bytes:

    - `feed(data)`: a frame that lies whole inside `data` is decoded in place when `data` is
      `bytes` (views of it); from any other buffer, which its owner may write again, frames are
      copied first.
    - `get_buffer()` / `buffer_updated(n)`, as in `asyncio.BufferedProtocol`: the caller reads
      straight into the buffer the decoder hands out, which is the body of the frame under way
      once its prefix is known. A large frame is then copied once, by the kernel.
    """

    SCRATCH = 1 << 16  # bytes read at a time between frames

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, bulk_min: int = _BIG):
        if max_frame_size < 1:
            raise LocalProtocolError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self.bulk_min = bulk_min
        self._prefix = bytearray()  # the part of a length prefix received so far
        self._body: memoryview | None = None  # the frame under way, once its prefix is known
        self._filled = 0
        self._scratch: bytearray | None = None
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame (the prefix of one under way too)."""
        return len(self._prefix) + (PREFIX_SIZE + self._filled if self._body is not None else 0)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        view = _byte_view(data)
        return self._poisoning(lambda: self._feed(view, in_place=isinstance(data, bytes)))

    def _poisoning(self, step: Callable[[], list[Message]]) -> list[Message]:
        """Run a decoding step; after its first error every later one raises the same."""
        if self._error is not None:
            raise self._error
        try:
            return step()
        except RemoteProtocolError as e:
            self._error = e
            self._prefix, self._body, self._filled = bytearray(), None, 0
            raise

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next bytes should go: the rest of the frame under way, else a scratch area."""
        if self._error is not None:
            raise self._error
        if self._body is not None:
            return self._body[self._filled :]
        if self._scratch is None:
            self._scratch = bytearray(self.SCRATCH)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """`nbytes` were written at the start of the last `get_buffer()`."""
        if self._body is not None:
            self._filled += nbytes
            return self._poisoning(self._complete)
        assert self._scratch is not None
        return self.feed(bytes(memoryview(self._scratch)[:nbytes]))  # bytes: the scratch is written again

    def _complete(self) -> list[Message]:
        """The message of the frame under way, once its body is full."""
        if self._body is None or self._filled < len(self._body):
            return []
        body, self._body, self._filled = self._body, None, 0
        return [decode_body(body, self.bulk_min)]

    def _feed(self, view: memoryview, in_place: bool) -> list[Message]:
        out: list[Message] = []
        pos, end = 0, len(view)
        while pos < end:
            if self._body is None:
                if self._prefix or end - pos < PREFIX_SIZE:
                    take = view[pos : pos + PREFIX_SIZE - len(self._prefix)]
                    self._prefix += take
                    pos += len(take)
                    if len(self._prefix) < PREFIX_SIZE:
                        break
                    size = int.from_bytes(self._prefix, "big")
                    self._prefix.clear()
                else:
                    size = int.from_bytes(view[pos : pos + PREFIX_SIZE], "big")
                    pos += PREFIX_SIZE
                if size == 0:
                    raise RemoteProtocolError("empty frame", "length")
                if size > self.max_frame_size:
                    raise RemoteProtocolError(f"frame of {size} bytes exceeds the {self.max_frame_size}-byte limit", "length")
                if in_place and end - pos >= size:  # the whole body is here, in bytes nobody changes
                    out.append(decode_body(view[pos : pos + size], self.bulk_min))
                    pos += size
                    continue
                self._body, self._filled = empty_buffer(size), 0
            take = min(len(self._body) - self._filled, end - pos)
            self._body[self._filled : self._filled + take] = view[pos : pos + take]
            self._filled += take
            pos += take
            out += self._complete()
        return out
