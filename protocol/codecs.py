"""Tensor codecs and sender-side error feedback.

| codec      | params                  | payload                                    | lossy |
|------------|-------------------------|--------------------------------------------|-------|
| `none`     | -                       | the raw bytes, in the tensor's own dtype   | no    |
| `fp16`     | -                       | float16 values (clamped to ±65504)         | yes   |
| `int8`     | `block_size`            | fp32 absmax per block, then int8 values    | yes   |
| `topk`     | `ratio`                 | int32 indices, then fp32 values            | yes   |
| `powersgd` | `rank`, `rows`, `cols`  | fp32 P (rows×rank), then fp32 Q (cols×rank) | yes   |
| `sparse`   | `chunk`, `k`, `bits`    | per chunk: scales, packed indices and codes (sparse.py) | yes |

`encode` runs on our own tensors (misuse raises `LocalProtocolError`); `decode_tensor` runs on
what a peer sent and checks every size against the header before allocating
(`RemoteProtocolError`). Lossy codecs pair with `ErrorFeedback`: what a step lost is added to
the next step's input, so the running sum of decoded tensors tracks the running sum of inputs.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from .errors import LocalProtocolError, RemoteProtocolError
from .tensors import DEFAULT_MAX_NUMEL, DTYPES, FLOAT_DTYPES, EncodedTensor, dtype_name, tensor_bytes, tensor_from_bytes

FP16_MAX = 65504.0


class Codec:
    """Base class. Subclasses set `name`, `lossy`, `param_names` (their constructor's
    parameters, each kept as an attribute of that name), and implement `_encode` / `_decode`.

    A codec is identified by its name and params: `make_codec(c.name, **c.params()) == c`,
    and two codecs that compare equal encode the same input to the same bytes."""

    name: ClassVar[str]
    lossy: ClassVar[bool]
    param_names: ClassVar[tuple[str, ...]] = ()
    codecs: ClassVar[dict[str, type[Codec]]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        Codec.codecs[cls.name] = cls

    def params(self) -> dict[str, Any]:
        """Exactly the keyword arguments `make_codec(self.name, ...)` takes to build this codec
        again: numbers, so they travel in a message as they are."""
        return {k: getattr(self, k) for k in self.param_names}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return self.name == other.name and self.params() == other.params()

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params().items()))))

    def encode(self, x: torch.Tensor, state: dict[str, Any] | None = None) -> EncodedTensor:
        """Encode a local tensor. `state` (per tensor, owned by the caller) lets a codec warm-start."""
        if not isinstance(x, torch.Tensor):
            raise LocalProtocolError(f"expected a torch.Tensor, got {type(x).__name__}")
        x = self._float_input(x) if self.lossy else x.detach().cpu().contiguous()
        return self._encode(x, dtype_name(x.dtype), state)

    def _encode(self, x: torch.Tensor, dtype: str, state: dict[str, Any] | None) -> EncodedTensor:
        raise NotImplementedError

    def encode_with_error(self, x: torch.Tensor, state: dict[str, Any] | None = None) -> tuple[EncodedTensor, torch.Tensor]:
        """Encode, and also return what the receiver will decode (flat fp32), for error feedback.
        Codecs that know it while encoding override this to save a decode pass."""
        enc = self.encode(x, state)
        return enc, decode_own(enc)

    def _float_input(self, x: torch.Tensor) -> torch.Tensor:
        """x detached, on the CPU and contiguous, for a codec that encodes floating-point values
        only (LocalProtocolError, naming the dtype, for any other)."""
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            raise LocalProtocolError(f"codec {self.name} needs a floating-point tensor, got {dtype_name(x.dtype)}")
        return x.detach().cpu().contiguous()

    def encode_with_feedback(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        state: dict[str, Any] | None = None,
        out: torch.Tensor | None = None,
        decoded: torch.Tensor | None = None,
        keep_decoded: bool = True,
    ) -> tuple[EncodedTensor, torch.Tensor | None]:
        """Error feedback in one call: encode x + residual; write what that loses into `out`
        (flat fp32; default: `residual`, in place); return the encoding and what the receiver
        will decode (written into `decoded` if given; None with `keep_decoded=False`, for a
        sender that only needs the residual: codecs that can then skip the full-size copy do).
        With a separate `out` the old residual survives for a rollback."""
        buf = _decoded_buffer(x.numel(), decoded, False)  # checked before anything is written
        corrected = x.reshape(-1).to(torch.float32) + residual
        enc, dec = self.encode_with_error(corrected, state)
        torch.sub(corrected, dec, out=residual if out is None else out)
        if buf is not None:
            return enc, buf.copy_(dec)
        return enc, dec if keep_decoded else None

    @property
    def cut_align(self) -> int:
        """Elements at which `cut` can split this codec's encoding of a flat vector (0: never)."""
        return 0

    def cut(self, enc: EncodedTensor, a: int, b: int) -> EncodedTensor:
        """The encoding of elements [a, b) of the flat vector `enc` encodes, bit for bit what
        encoding that range alone gives (with error feedback too: it is element-wise). So a
        sender can encode a whole vector before it knows how it will be split. `a` and `b` are
        multiples of `cut_align`, or `b` is the end."""
        n, align = enc.numel, self.cut_align
        if len(enc.shape) != 1 or enc.codec != self.name:
            raise LocalProtocolError(f"cut needs a flat {self.name} encoding, got {enc.codec} {enc.shape}")
        if not align or not 0 <= a <= b <= n or a % align or (b % align and b != n):
            raise LocalProtocolError(f"{self.name} cannot cut [{a}, {b}) of {n} elements (alignment {align or 'none'})")
        return EncodedTensor(enc.dtype, (b - a,), self.name, self._cut(memoryview(enc.payload), n, a, b), dict(enc.params))

    def _cut(self, payload: memoryview, n: int, a: int, b: int) -> bytes | memoryview:
        raise NotImplementedError

    @classmethod
    def _max_abs(cls, enc: EncodedTensor) -> float | None:
        """max |value| of the decoded tensor if the payload gives it cheaply (NaN if any value
        is not finite); None: decode and look."""
        return None

    @classmethod
    def _decode_into(cls, enc: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
        """Decode as fp32 into flat `out`; codecs that can write there directly override it."""
        out.copy_(cls._decode(enc, torch.float32).reshape(-1))
        return out

    @classmethod
    def _decode(cls, enc: EncodedTensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"


def decode_through_into(cls: type[Codec], enc: EncodedTensor, dtype: torch.dtype) -> torch.Tensor:
    """`_decode` of a codec that decodes into fp32 memory (`_decode_into`): a new buffer, then `dtype`."""
    out = cls._decode_into(enc, torch.empty(enc.numel, dtype=torch.float32))
    return out if dtype == torch.float32 else out.to(dtype)


def _expect_size(enc: EncodedTensor, expected: int) -> None:
    if enc.nbytes != expected:
        raise RemoteProtocolError(
            f"{enc.codec} payload is {enc.nbytes} bytes, expected {expected} for shape {enc.shape}", "payload"
        )


def _int_param(enc: EncodedTensor, name: str, lo: int, hi: int) -> int:
    v = enc.params.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RemoteProtocolError(f"{enc.codec} needs an int in [{lo}, {hi}], got {v!r}", f"params.{name}")
    return v


# Element-wise work runs over slices of this many elements, so that each pass of a multi-pass
# codec stays in cache instead of streaming the whole tensor through memory once per pass.
_SLICE = 1 << 18


class NoneCodec(Codec):
    """Exact: the tensor's own bytes, in its own dtype (fp32, bf16, fp16, ints, bool)."""

    name, lossy = "none", False

    def _encode(self, x, dtype, state):
        return EncodedTensor(dtype, tuple(x.shape), self.name, tensor_bytes(x))

    @classmethod
    def _decode(cls, enc, dtype):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        _expect_size(enc, enc.numel * itemsize)
        return tensor_from_bytes(enc.payload, dtype, enc.numel)


class Fp16Codec(Codec):
    """Half precision, values clamped to the fp16 range so nothing finite becomes inf."""

    name, lossy = "fp16", True

    def _encode(self, x, dtype, state):
        half = x.reshape(-1).to(torch.float16)
        half.clamp_(-FP16_MAX, FP16_MAX)  # inf -> ±max; NaN stays NaN for the receiver to see
        return EncodedTensor(dtype, tuple(x.shape), self.name, tensor_bytes(half))

    def encode_with_error(self, x, state=None):
        return self.encode_with_feedback(x, None)

    def encode_with_feedback(self, x, residual, state=None, out=None, decoded=None, keep_decoded=True):
        """One pass over memory: each slice is corrected, rounded to half, widened back and
        differenced while in cache (the generic path makes five passes and three copies)."""
        x = self._float_input(x)
        flat, n = x.reshape(-1), x.numel()
        half = torch.empty(n, dtype=torch.float16)
        decoded = _decoded_buffer(n, decoded, keep_decoded)
        scratch = torch.empty(min(n, _SLICE)) if decoded is None else None
        residual_out = residual if out is None else out
        for start in range(0, n, _SLICE):
            end = min(n, start + _SLICE)
            chunk = flat[start:end]
            if residual is not None:
                chunk = chunk.to(torch.float32) + residual[start:end]
            h = half[start:end]
            h.copy_(chunk).clamp_(-FP16_MAX, FP16_MAX)
            dec = decoded[start:end] if decoded is not None else scratch[: end - start]
            dec.copy_(h)
            if residual is not None:
                torch.sub(chunk, dec, out=residual_out[start:end])
        return EncodedTensor(dtype_name(x.dtype), tuple(x.shape), self.name, tensor_bytes(half)), decoded

    cut_align = 1

    def _cut(self, payload, n, a, b):
        return payload[2 * a : 2 * b]

    @classmethod
    def _decode(cls, enc, dtype):
        _expect_size(enc, enc.numel * 2)
        return tensor_from_bytes(enc.payload, torch.float16, enc.numel).to(dtype)

    @classmethod
    def _decode_into(cls, enc, out):
        _expect_size(enc, enc.numel * 2)
        out.copy_(tensor_from_bytes(enc.payload, torch.float16, enc.numel))
        return out


class Int8Codec(Codec):
    """Blockwise absmax int8: per block of `block_size` values, one fp32 absmax and int8 codes
    q = round(x / absmax * 127). Max abs error per block: absmax / 254 (rounding) ≤ absmax / 127."""

    name, lossy, param_names = "int8", True, ("block_size",)
    MIN_BLOCK, MAX_BLOCK = 16, 1 << 20

    def __init__(self, block_size: int = 1024):
        if not self.MIN_BLOCK <= block_size <= self.MAX_BLOCK:
            raise LocalProtocolError(f"int8 block_size must be in [{self.MIN_BLOCK}, {self.MAX_BLOCK}]")
        self.block_size = block_size

    def _encode(self, x, dtype, state):
        return self._encode_int8(x, dtype, None)

    @property
    def cut_align(self) -> int:
        return self.block_size

    def _cut(self, payload, n, a, b):
        """Block scales of the range, then its codes (one copy: the layout puts them apart)."""
        bs = self.block_size
        scales = payload[4 * (a // bs) : 4 * math.ceil(b / bs)]
        codes = payload[4 * math.ceil(n / bs) + a : 4 * math.ceil(n / bs) + b]
        out = bytearray(len(scales) + len(codes))
        out[: len(scales)], out[len(scales) :] = scales, codes
        return out

    def encode_with_error(self, x, state=None):
        x = self._float_input(x)
        decoded = torch.empty(x.numel(), dtype=torch.float32)
        return self._encode_int8(x, dtype_name(x.dtype), decoded), decoded

    def encode_with_feedback(self, x, residual, state=None, out=None, decoded=None, keep_decoded=True):
        x = self._float_input(x)
        decoded = _decoded_buffer(x.numel(), decoded, keep_decoded)
        return self._encode_int8(x, dtype_name(x.dtype), decoded, residual, residual if out is None else out), decoded

    def _encode_int8(self, x, dtype, decoded, residual=None, residual_out=None):
        """Encode x (+ residual); with `decoded`, also write there exactly what `_decode` will
        produce; with `residual`, write what was lost into `residual_out`. One pass over memory:
        each slice is corrected, quantized, dequantized and differenced while in cache."""
        flat = x.reshape(-1)
        n, bs = flat.numel(), self.block_size
        nblocks = math.ceil(n / bs)
        out = torch.empty(nblocks * 4 + n, dtype=torch.uint8)
        absmax_out = out[: nblocks * 4].view(torch.float32)
        codes_out = out[nblocks * 4 :].view(torch.int8)
        step = max(1, _SLICE // bs) * bs  # whole blocks per slice
        scratch = torch.empty(min(n, step)) if decoded is None and residual is not None else None
        for start in range(0, n, step):
            chunk = flat[start : start + step].to(torch.float32)
            if residual is not None:
                chunk = chunk + residual[start : start + step]
            m = chunk.numel()
            b0, nb = start // bs, math.ceil(m / bs)
            if m % bs:
                chunk = torch.nn.functional.pad(chunk, (0, nb * bs - m))
            blocks = chunk.view(nb, bs)
            absmax = torch.amax(blocks.abs(), dim=1, out=absmax_out[b0 : b0 + nb])
            inv = torch.where(absmax > 0, 127.0 / absmax, 0.0)
            blocks = blocks.mul(inv.unsqueeze(1)).round_().clamp_(-127, 127)
            codes_out[start : start + m].copy_(blocks.view(-1)[:m])
            if decoded is not None or residual is not None:  # what the receiver gets: _decode's own arithmetic, on our codes
                end = start + m
                dec = decoded[start:end] if decoded is not None else scratch[:m]
                _dequantize(codes_out[start:end], absmax_out[b0 : b0 + nb] / 127.0, m, bs, dec)
                if residual is not None:
                    torch.sub(chunk[:m], dec, out=residual_out[start:end])
        return EncodedTensor(dtype, tuple(x.shape), self.name, tensor_bytes(out), {"block_size": bs})

    @classmethod
    def _max_abs(cls, enc):
        bs = _int_param(enc, "block_size", cls.MIN_BLOCK, cls.MAX_BLOCK)
        nblocks = math.ceil(enc.numel / bs)
        _expect_size(enc, nblocks * 4 + enc.numel)
        if nblocks == 0:
            return 0.0
        absmax = tensor_from_bytes(memoryview(enc.payload)[: nblocks * 4], torch.float32, nblocks)
        return float(absmax.abs().max())  # codes are at most 127: |value| <= absmax; NaN propagates

    @classmethod
    def _decode(cls, enc, dtype):
        return decode_through_into(cls, enc, dtype)

    @classmethod
    def _decode_into(cls, enc, out):
        bs = _int_param(enc, "block_size", cls.MIN_BLOCK, cls.MAX_BLOCK)
        n = enc.numel
        nblocks = math.ceil(n / bs)
        _expect_size(enc, nblocks * 4 + n)
        raw = tensor_from_bytes(enc.payload, torch.uint8, enc.nbytes)
        _dequantize(raw[nblocks * 4 :].view(torch.int8), raw[: nblocks * 4].view(torch.float32) / 127.0, n, bs, out)
        return out


def _decoded_buffer(n: int, given: torch.Tensor | None, keep: bool) -> torch.Tensor | None:
    """Where an encoder writes what the receiver will decode: the caller's buffer, a new one,
    or none at all (then the encoder works slice by slice in a small scratch)."""
    if given is not None:
        return _flat_fp32(given, n, "decoded")
    return torch.empty(n, dtype=torch.float32) if keep else None


def _flat_fp32(buf: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """A caller's buffer for n fp32 values, viewed flat; refused unless it is exactly that."""
    if buf.dtype != torch.float32 or buf.numel() != n or not buf.is_contiguous():
        raise LocalProtocolError(f"{name} must be a contiguous fp32 buffer of {n} elements")
    return buf if buf.dim() == 1 else buf.view(-1)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, n: int, bs: int, out: torch.Tensor) -> None:
    """out = codes × scale per block, slice by slice. The one place int8 values are produced,
    so an encoder's own copy and every receiver's decode agree bit for bit (signed zeros too)."""
    step = max(1, _SLICE // bs) * bs
    for start in range(0, n, step):
        m = min(step, n - start)
        b0, nb = start // bs, math.ceil(m / bs)
        full = (m // bs) * bs
        dst = out[start : start + full].view(-1, bs)
        dst.copy_(codes[start : start + full].view(-1, bs))  # int8 -> fp32 is exact; a mixed-dtype
        dst.mul_(scale[b0 : b0 + full // bs].unsqueeze(1))  # mul would be 3x slower, same bits
        if full < m:  # the last, partial block
            out[start + full : start + m] = codes[start + full : start + m].to(torch.float32) * scale[b0 + nb - 1]


def _concat(*tensors: torch.Tensor) -> memoryview:
    """The bytes of several tensors, one after another, in one buffer."""
    return tensor_bytes(torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]))


def _topk_indices(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest magnitudes. On large tensors a threshold estimated from a
    strided sample first narrows the candidates (a full torch.topk over 64M values takes seconds);
    the answer is still exact, because when the candidates fall short it falls back to full topk."""
    n = mag.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if n > (1 << 20) and k < n // 8:
        sample = mag[:: n // (1 << 16)]
        q = max(0.0, 1.0 - 2.0 * k / n)  # aim for about 2k candidates
        threshold = torch.quantile(sample, q).item()
        cand = torch.nonzero(mag >= threshold).view(-1)
        if cand.numel() >= k:
            idx = cand[torch.topk(mag[cand], k, sorted=False).indices]
            return torch.sort(idx).values
    return torch.sort(torch.topk(mag, k, sorted=False).indices).values


class TopKCodec(Codec):
    """Sparse: the `ratio`·n largest-magnitude values (at least one) and their int32 indices."""

    name, lossy, param_names = "topk", True, ("ratio",)

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise LocalProtocolError("topk ratio must be in (0, 1]")
        self.ratio = ratio

    def _encode(self, x, dtype, state):
        flat = x.reshape(-1).to(torch.float32)
        n = flat.numel()
        if n >= 2**31:
            raise LocalProtocolError("topk supports tensors under 2^31 elements")
        k = min(n, max(1, math.ceil(self.ratio * n))) if n else 0
        idx = _topk_indices(flat.abs(), k)
        payload = _concat(idx.to(torch.int32), flat[idx])
        return EncodedTensor(dtype, tuple(x.shape), self.name, payload, {"k": k})

    @classmethod
    def _decode(cls, enc, dtype):
        n = enc.numel
        k = _int_param(enc, "k", 0, n)
        _expect_size(enc, k * 8)
        view = memoryview(enc.payload)
        idx = tensor_from_bytes(view[: k * 4], torch.int32, k).to(torch.int64)
        vals = tensor_from_bytes(view[k * 4 :], torch.float32, k)
        if k and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise RemoteProtocolError(f"topk index out of range [0, {n})", "payload")
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = vals
        return out.to(dtype)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """How powersgd sees a tensor: (dim 0, the rest), or a near-square padding of a vector."""
    n = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 1 and n // shape[0] > 1:
        return shape[0], n // shape[0]
    rows = max(1, math.isqrt(max(n, 1)))
    return rows, max(1, math.ceil(n / rows))


class PowerSGDCodec(Codec):
    """Low rank: M ≈ P Qᵀ with P (rows×rank) orthonormal, from one power iteration.
    Pass a per-tensor `state` dict to warm-start Q from the previous step, as PowerSGD does."""

    name, lossy, param_names = "powersgd", True, ("rank", "seed")
    MAX_RANK = 1024

    def __init__(self, rank: int = 4, seed: int = 0):
        if not 1 <= rank <= self.MAX_RANK:
            raise LocalProtocolError(f"powersgd rank must be in [1, {self.MAX_RANK}]")
        self.rank, self.seed = rank, seed

    def _encode(self, x, dtype, state):
        rows, cols = _matrix_shape(tuple(x.shape))
        flat = x.reshape(-1).to(torch.float32)
        if flat.numel() < rows * cols:
            flat = torch.nn.functional.pad(flat, (0, rows * cols - flat.numel()))
        m = flat.view(rows, cols)
        r = min(self.rank, rows, cols)
        q = state.get("q") if state is not None else None
        if q is None or q.shape != (cols, r):
            gen = torch.Generator().manual_seed(self.seed)
            q = torch.randn(cols, r, generator=gen)
        p = m @ q
        p, _ = torch.linalg.qr(p)  # orthonormal columns
        q = m.T @ p
        if state is not None:
            state["q"] = q
        payload = _concat(p, q)
        return EncodedTensor(dtype, tuple(x.shape), self.name, payload, {"rank": r, "rows": rows, "cols": cols})

    @classmethod
    def _decode(cls, enc, dtype):
        n = enc.numel
        rows, cols = _matrix_shape(enc.shape)
        r = _int_param(enc, "rank", 1, min(cls.MAX_RANK, rows, cols))
        if enc.params.get("rows") != rows or enc.params.get("cols") != cols:
            raise RemoteProtocolError(f"expected rows={rows}, cols={cols} for shape {enc.shape}", "params")
        _expect_size(enc, (rows + cols) * r * 4)
        view = memoryview(enc.payload)
        p = tensor_from_bytes(view[: rows * r * 4], torch.float32, rows * r).view(rows, r)
        q = tensor_from_bytes(view[rows * r * 4 :], torch.float32, cols * r).view(cols, r)
        return (p @ q.T).reshape(-1)[:n].to(dtype)


def make_codec(name: str, **params: Any) -> Codec:
    """Build a codec by name, e.g. `make_codec("int8", block_size=1024)`."""
    cls = Codec.codecs.get(name)
    if cls is None:
        raise LocalProtocolError(f"unknown codec {name!r}; known: {', '.join(Codec.codecs)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise LocalProtocolError(f"bad parameters for codec {name}: {e}") from None


def decode_tensor(
    enc: EncodedTensor, max_numel: int = DEFAULT_MAX_NUMEL, max_abs: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode what a peer sent, validating header, params and payload size first. With
    `max_abs`, also refuse non-finite values and values beyond ±max_abs (checked on the
    payload when the codec allows, e.g. int8's block scales, else on the decoded tensor)."""
    enc.check_header(max_numel)
    cls = Codec.codecs.get(enc.codec)
    if cls is None:
        raise RemoteProtocolError(f"unknown codec {enc.codec!r}", "codec")
    dtype = DTYPES[enc.dtype]
    if cls.lossy and enc.dtype not in FLOAT_DTYPES:
        raise RemoteProtocolError(f"codec {enc.codec} cannot carry dtype {enc.dtype}", "dtype")
    bound = cls._max_abs(enc) if max_abs is not None else None
    if bound is not None:
        _check_bound(bound, max_abs)
    if out is not None:  # decode straight into the caller's buffer (flat, fp32)
        decoded = cls._decode_into(enc, _flat_fp32(out, enc.numel, "out"))
    else:
        decoded = cls._decode(enc, dtype).reshape(enc.shape)
    if max_abs is not None and bound is None and enc.dtype in FLOAT_DTYPES and decoded.numel():
        _check_bound(finite_max_abs(decoded), max_abs)
    return decoded


def decode_own(enc: EncodedTensor) -> torch.Tensor:
    """What every receiver decodes from an encoding we made ourselves, as a flat fp32 vector,
    bit for bit (no bound check or size cap: the values are our own)."""
    return decode_tensor(enc, max_numel=max(enc.numel, 1)).reshape(-1).to(torch.float32)


def finite_max_abs(t: torch.Tensor) -> float:
    """max |x| over a tensor, NaN if any value is NaN or ±Inf (0 for an empty one). One
    `aminmax` pass, no |x| copy."""
    if not t.numel():
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(t))
    return max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.nan


def _check_bound(observed: float, max_abs: float) -> None:
    if not math.isfinite(observed):
        raise RemoteProtocolError("tensor contains NaN or Inf", "payload")
    if observed > max_abs:
        raise RemoteProtocolError(f"values up to {observed:.3g} exceed the bound |x| <= {max_abs:g}", "payload")


class ErrorFeedback:
    """Sender-side error feedback for one codec over named tensors.

    encode(key, x): send C(x + e), keep e ← (x + e) − D(C(x + e)). Summed over steps, what was
    decoded equals what was input minus the final residual, so nothing is lost, only delayed.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residuals: dict[str, torch.Tensor] = {}
        self.states: dict[str, dict[str, Any]] = {}

    def encode(self, key: str, x: torch.Tensor) -> EncodedTensor:
        if not self.codec.lossy:
            return self.codec.encode(x)
        corrected = x.detach().to(torch.float32)
        residual = self.residuals.get(key)
        if residual is not None:
            if residual.shape != corrected.shape:
                raise LocalProtocolError(f"tensor {key!r} changed shape from {tuple(residual.shape)} to {tuple(x.shape)}")
            corrected = corrected + residual
        enc, decoded = self.codec.encode_with_error(corrected.to(x.dtype) if x.dtype != torch.float32 else corrected, self.states.setdefault(key, {}))
        self.residuals[key] = corrected - decoded.view(corrected.shape)
        return enc

    def reset(self, key: str | None = None) -> None:
        """Forget residuals (e.g. after a failed round whose inputs are kept locally)."""
        if key is None:
            self.residuals.clear()
            self.states.clear()
        else:
            self.residuals.pop(key, None)
            self.states.pop(key, None)


from . import sparse  # noqa: E402, F401  (registers the sparse codec; it builds on the helpers above)
