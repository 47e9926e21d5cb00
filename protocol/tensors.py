"""Tensors on the wire: `EncodedTensor` (dtype, shape, codec, params, payload) and chunking.

An encoded tensor larger than a frame travels as several `TensorPart` messages; a
`TensorAssembler` puts them back together, checking that every part agrees with the first,
that parts arrive in order without gaps, and that the declared total size is under a cap
before anything is allocated for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import LocalProtocolError, RemoteProtocolError
from .framing import empty_buffer
from .messages import MAX_TENSOR_NDIM, Params, TensorPart

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")

DEFAULT_MAX_NUMEL = 1 << 28  # elements a peer may make us allocate for one tensor (1 GiB of fp32)
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024  # payload bytes per TensorPart; well under the frame limit


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise LocalProtocolError(f"dtype {dtype} cannot travel on the wire") from None


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as a codec produced it. `payload` layout is the codec's business."""

    dtype: str
    shape: tuple[int, ...]
    codec: str
    payload: bytes | bytearray | memoryview
    params: Params = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return memoryview(self.payload).nbytes

    def check_header(self, max_numel: int = DEFAULT_MAX_NUMEL) -> None:
        """Validate what a peer declared before anything is allocated for it."""
        if self.dtype not in DTYPES:
            raise RemoteProtocolError(f"unknown dtype {self.dtype!r}", "dtype")
        if len(self.shape) > MAX_TENSOR_NDIM or any(d < 0 for d in self.shape):
            raise RemoteProtocolError(f"invalid shape {self.shape}", "shape")
        if self.numel > max_numel:
            raise RemoteProtocolError(f"{self.numel} elements exceed the limit of {max_numel}", "shape")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (any dtype, bfloat16 and bool included), as a
    zero-copy view that keeps the tensor's memory alive. Do not modify the tensor while it lives."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Inverse of `tensor_bytes` for a flat tensor. Shares memory with a writable buffer
    (bytearray, or a view of one); copies read-only bytes."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    view = memoryview(data)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype)[:numel]


def split(enc: EncodedTensor, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE, request_id: int = 0) -> list[TensorPart]:
    """Cut an encoded tensor into parts of at most `chunk_size` payload bytes."""
    if chunk_size < 1:
        raise LocalProtocolError("chunk_size must be positive")
    total = enc.nbytes
    count = max(1, math.ceil(total / chunk_size))
    view = memoryview(enc.payload)
    return [
        TensorPart(
            request_id=request_id,
            key=key,
            dtype=enc.dtype,
            shape=enc.shape,
            codec=enc.codec,
            params=enc.params,
            index=i,
            count=count,
            offset=i * chunk_size,
            total_size=total,
            data=view[i * chunk_size : (i + 1) * chunk_size],  # a view: framed without copying
        )
        for i in range(count)
    ]


class TensorAssembler:
    """Reassembles the parts of one tensor, in order. `add` returns the tensor when complete."""

    def __init__(self, max_total_size: int = 1 << 31):
        self.max_total_size = max_total_size
        self._first: TensorPart | None = None
        self._buf: memoryview | None = None
        self._received = 0
        self._next_index = 0

    @property
    def started(self) -> bool:
        return self._first is not None

    def add(self, part: TensorPart) -> EncodedTensor | None:
        first = self._first
        if first is None:
            if part.index != 0:
                raise RemoteProtocolError(f"first part has index {part.index}, expected 0", "index")
            if part.total_size > self.max_total_size:
                raise RemoteProtocolError(
                    f"declared {part.total_size} bytes, over the limit of {self.max_total_size}", "total_size"
                )
            self._first = first = part
            self._buf = empty_buffer(part.total_size)  # every byte is written: parts leave no gaps
        else:
            for name in ("key", "dtype", "shape", "codec", "params", "count", "total_size"):
                if getattr(part, name) != getattr(first, name):
                    raise RemoteProtocolError(f"part {part.index} disagrees with part 0", name)
            if part.index != self._next_index:
                raise RemoteProtocolError(f"got part {part.index}, expected {self._next_index}", "index")
        if part.offset != self._received:
            raise RemoteProtocolError(f"part {part.index} starts at {part.offset}, expected {self._received}", "offset")
        if part.index < part.count - 1 and not part.data:
            raise RemoteProtocolError(f"part {part.index} is empty", "data")
        assert self._buf is not None
        self._buf[part.offset : part.offset + len(part.data)] = part.data
        self._received += len(part.data)
        self._next_index += 1
        if self._next_index < first.count:
            return None
        if self._received != first.total_size:
            raise RemoteProtocolError(f"parts carry {self._received} of {first.total_size} declared bytes", "total_size")
        payload, self._buf = self._buf, None
        return EncodedTensor(dtype=first.dtype, shape=first.shape, codec=first.codec, payload=payload, params=first.params)


def pack_tensors(named: dict[str, EncodedTensor]) -> dict:
    """The bundle fields (`tensors`, `shapes`, `data`) of a StageCall / StageResult carrying these
    encoded tensors: one header each, the payloads one after another."""
    heads, shapes, payloads = [], [], []
    for name, enc in named.items():
        heads.append({"name": name, "dtype": enc.dtype, "codec": enc.codec, "nbytes": enc.nbytes, **{f"p.{k}": v for k, v in enc.params.items()}})
        shapes.append(tuple(enc.shape))
        payloads.append(memoryview(enc.payload).cast("B"))
    return {"tensors": tuple(heads), "shapes": tuple(shapes), "data": b"".join(payloads)}


def unpack_tensors(msg, max_numel: int = DEFAULT_MAX_NUMEL) -> dict[str, EncodedTensor]:
    """The encoded tensors of a bundle a peer sent (headers checked against `max_numel`; decode each
    with `codecs.decode_tensor`, which checks its payload). Views of the message's data, not copies."""
    out, offset, view = {}, 0, memoryview(msg.data).cast("B")
    for head, shape in zip(msg.tensors, msg.shapes):
        n = head["nbytes"]
        params = {k[2:]: v for k, v in head.items() if k.startswith("p.")}
        enc = EncodedTensor(dtype=head["dtype"], shape=tuple(shape), codec=head["codec"], payload=view[offset : offset + n], params=params)
        enc.check_header(max_numel)
        out[head["name"]] = enc
        offset += n
    return out
