"""The `sparse` codec: chunked top-k with low-bit values (the SparseLoCo format for outer
gradients), to pair with error feedback.

The flat vector is cut into chunks of `chunk` elements. From each, the k = ⌈density·chunk⌉
values of largest magnitude travel (a last, shorter chunk of m elements sends ⌈k·m/chunk⌉), as
chunk-local indices of w bits (w counts to chunk − 1: 12 for 4096) and `bits`-bit codes: a sign
bit and bits − 1 bits of level. The 2^(bits−1) levels lie evenly between lo and hi, which the
sender fits to the row's magnitudes (`fit_levels`: the least squared error on an even grid); with
bits = 1 there is one level, their mean. A chunk that sends all its values (density 1) sends no
indices: every position travels, in order, and the codec is dense low-bit quantization.

Payload: one row per chunk, each row

    | lo fp32 | hi fp32 | k indices, w bits each, packed | k codes, `bits` each, packed |

(each packed field padded to whole bytes; no indices where k is the chunk's length). A row's
size follows from (numel, chunk, k, bits), so a payload's size is known before it is read, and rows can be cut apart at chunk boundaries
without decoding (`Codec.cut`). What a peer sends is checked row by row: lo and hi finite with
0 ≤ lo ≤ hi, indices inside the chunk and strictly increasing (no repeats).

At 2% density and 2 bits a chunk of 4096 travels in 8 + 123 + 21 bytes: 0.037 bytes per
element (int8: 1.004).
"""

from __future__ import annotations

import math

import torch

from .codecs import _SLICE, Codec, _expect_size, _int_param, decode_through_into
from .errors import LocalProtocolError, RemoteProtocolError
from .tensors import EncodedTensor, dtype_name, tensor_bytes, tensor_from_bytes

MIN_CHUNK, MAX_CHUNK = 16, 1 << 16
MAX_BITS = 8


def index_bits(chunk: int) -> int:
    """Bits of one chunk-local index: enough to count to chunk − 1."""
    return max(1, (chunk - 1).bit_length())


def row_bytes(k: int, chunk: int, bits: int, length: int | None = None) -> int:
    """Bytes of one row carrying k values of a chunk of `length` elements (`chunk` unless it is
    the last, shorter one): no indices when k is all of them."""
    return 8 + _index_bytes(k, chunk, chunk if length is None else length) + math.ceil(k * bits / 8)


def _index_bytes(k: int, chunk: int, length: int) -> int:
    return 0 if k >= length else math.ceil(k * index_bits(chunk) / 8)


def tail_k(k: int, m: int, chunk: int) -> int:
    """Values a last, shorter chunk of m elements sends: k in proportion, at least one."""
    return min(m, max(1, -(-k * m // chunk)))


def payload_bytes(n: int, chunk: int, k: int, bits: int) -> int:
    full, m = divmod(n, chunk)
    return full * row_bytes(k, chunk, bits) + (row_bytes(tail_k(k, m, chunk), chunk, bits, m) if m else 0)


def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, count] ints < 2^width -> [rows, ⌈count·width/8⌉] bytes, little-endian bit order."""
    rows, count = values.shape
    bits = ((values.unsqueeze(-1) >> torch.arange(width)) & 1).to(torch.uint8).reshape(rows, count * width)
    bits = torch.nn.functional.pad(bits, (0, (-count * width) % 8)).view(rows, -1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _unpack(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of `_pack`: [rows, nbytes] bytes -> [rows, count] int64."""
    rows = data.shape[0]
    bits = ((data.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(rows, -1)[:, : count * width]
    return (bits.view(rows, count, width).to(torch.int64) << torch.arange(width)).sum(-1)


def _values(lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The values codes stand for, per row's (lo, hi). The one place they are computed, so a
    sender's own copy and every receiver's decode agree bit for bit (unfused mul, then add)."""
    levels = 1 << (bits - 1)
    q = (codes & (levels - 1)).to(torch.float32)
    if levels > 1:
        step = (hi - lo) / (levels - 1)
        mag = q.mul_(step.unsqueeze(1)).add_(lo.unsqueeze(1))
    else:
        mag = q.add_(hi.unsqueeze(1))
    return torch.where(codes >> (bits - 1) == 1, -mag, mag)


def fit_levels(mag: torch.Tensor, levels: int, rounds: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of magnitudes [r, L], the first and last of `levels` evenly spaced levels that
    (nearly) minimise the squared error of rounding each magnitude to its nearest level: Lloyd's
    iteration on an even grid (assign each to its nearest level, then fit first level and spacing by
    least squares), from the quantiles where an even grid of the same spread would sit. Only the
    sender runs this; a receiver reads lo and hi (0 <= lo <= hi)."""
    grid = torch.tensor([(j + 0.5) / levels for j in (0, levels - 1)])
    lo, hi = torch.quantile(mag, grid, dim=1)
    for _ in range(rounds):
        j = _nearest(mag, lo, hi, levels)
        j_mean, mag_mean = j.mean(1, keepdim=True), mag.mean(1, keepdim=True)
        var = (j - j_mean).square().mean(1)
        slope = torch.where(var > 0, ((j - j_mean) * (mag - mag_mean)).mean(1) / var.clamp_min(1e-30), (hi - lo) / (levels - 1))
        lo = (mag_mean.squeeze(1) - slope * j_mean.squeeze(1)).clamp_min(0)
        hi = torch.maximum(lo + slope * (levels - 1), lo)
    spread = mag.amin(1), mag.amax(1)  # where the whole spread does better (few values, many levels), it is kept
    worse = _grid_error(mag, lo, hi, levels) > _grid_error(mag, *spread, levels)
    return torch.where(worse, spread[0], lo), torch.where(worse, spread[1], hi)


def _nearest(mag: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Each magnitude's nearest level's number (float) on the grid lo..hi."""
    step = ((hi - lo) / (levels - 1)).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    return ((mag - lo.unsqueeze(1)) / step).round_().clamp_(0, levels - 1)


def _grid_error(mag: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    step = (hi - lo) / (levels - 1)
    return (_nearest(mag, lo, hi, levels) * step.unsqueeze(1) + lo.unsqueeze(1) - mag).square_().sum(1)


class SparseCodec(Codec):
    """Chunked top-k, low-bit values (see the module's docstring)."""

    name, lossy, param_names = "sparse", True, ("density", "bits", "chunk")

    def __init__(self, density: float = 0.02, bits: int = 2, chunk: int = 4096):
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise LocalProtocolError(f"sparse density must be in (0, 1], got {density!r}")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
            raise LocalProtocolError(f"sparse bits must be an int in [1, {MAX_BITS}], got {bits!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not MIN_CHUNK <= chunk <= MAX_CHUNK:
            raise LocalProtocolError(f"sparse chunk must be an int in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk!r}")
        self.density, self.bits, self.chunk = density, bits, chunk
        self.k = min(chunk, max(1, math.ceil(density * chunk)))

    def bytes_per_element(self) -> float:
        """What a long vector costs on the wire, per element."""
        return row_bytes(self.k, self.chunk, self.bits) / self.chunk

    # ---- encode ----

    def _encode(self, x, dtype, state):
        return self._encode_sparse(x, dtype, None)

    def encode_with_error(self, x, state=None):
        x = self._float_input(x)
        decoded = torch.empty(x.numel(), dtype=torch.float32)
        return self._encode_sparse(x, dtype_name(x.dtype), decoded), decoded

    def _encode_sparse(self, x: torch.Tensor, dtype: str, decoded: torch.Tensor | None) -> EncodedTensor:
        """Rows of whole chunks a slab at a time (a slab stays in cache), then the short one;
        with `decoded`, also write there exactly what a receiver decodes."""
        flat = x.reshape(-1).to(torch.float32)
        n, c = flat.numel(), self.chunk
        full, m = divmod(n, c)
        rows, step = [], max(1, _SLICE // c)
        for r0 in range(0, full, step):
            r1 = min(full, r0 + step)
            out = decoded[r0 * c : r1 * c].view(r1 - r0, c) if decoded is not None else None
            rows.append(self._rows(flat[r0 * c : r1 * c].view(r1 - r0, c), self.k, out))
        if m:
            out = decoded[full * c :].view(1, m) if decoded is not None else None
            rows.append(self._rows(flat[full * c :].view(1, m), tail_k(self.k, m, c), out))
        payload = torch.cat([r.reshape(-1) for r in rows]) if rows else torch.empty(0, dtype=torch.uint8)
        return EncodedTensor(dtype, tuple(x.shape), self.name, tensor_bytes(payload), {"chunk": c, "k": self.k, "bits": self.bits})

    def _rows(self, v: torch.Tensor, k: int, decoded: torch.Tensor | None) -> torch.Tensor:
        """[r, L] values -> [r, row_bytes] encoded rows of k values each."""
        # all of them (density 1): every value travels, in order, no indices
        idx = None if k >= v.shape[1] else torch.topk(v.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
        sel = v if idx is None else v.gather(1, idx)
        mag = sel.abs()
        levels = 1 << (self.bits - 1)
        if levels == 1:
            lo = hi = mag.mean(1)
            q = torch.zeros(sel.shape, dtype=torch.int64)
        else:
            lo, hi = fit_levels(mag, levels)
            step = (hi - lo) / (levels - 1)
            q = torch.where(step.unsqueeze(1) > 0, (mag - lo.unsqueeze(1)) / step.unsqueeze(1), 0.0).round_().clamp_(0, levels - 1).to(torch.int64)
        codes = q | ((sel < 0).to(torch.int64) << (self.bits - 1))
        if decoded is not None and idx is None:
            decoded.copy_(_values(lo, hi, codes, self.bits))
        elif decoded is not None:
            decoded.zero_().scatter_(1, idx, _values(lo, hi, codes, self.bits))
        scales = torch.stack([lo, hi], 1).contiguous().view(torch.uint8)
        packed_idx = scales[:, :0] if idx is None else _pack(idx, index_bits(self.chunk))
        return torch.cat([scales, packed_idx, _pack(codes, self.bits)], 1)

    # ---- cut ----

    @property
    def cut_align(self) -> int:
        return self.chunk

    def _cut(self, payload, n, a, b):
        """Whole rows: a chunk's row is the encoding of that chunk alone."""
        row = row_bytes(self.k, self.chunk, self.bits)
        return payload[a // self.chunk * row : (b // self.chunk * row if b < n else len(payload))]

    # ---- decode ----

    @classmethod
    def _decode(cls, enc, dtype):
        return decode_through_into(cls, enc, dtype)

    @classmethod
    def _decode_into(cls, enc, out):
        c = _int_param(enc, "chunk", MIN_CHUNK, MAX_CHUNK)
        k = _int_param(enc, "k", 1, c)
        bits = _int_param(enc, "bits", 1, MAX_BITS)
        n = enc.numel
        _expect_size(enc, payload_bytes(n, c, k, bits))
        raw = tensor_from_bytes(enc.payload, torch.uint8, enc.nbytes)
        full, m = divmod(n, c)
        row = row_bytes(k, c, bits)
        step = max(1, _SLICE // c)
        for r0 in range(0, full, step):
            r1 = min(full, r0 + step)
            rows = raw[r0 * row : r1 * row].view(r1 - r0, row)
            cls._decode_rows(rows, k, c, bits, out[r0 * c : r1 * c].view(r1 - r0, c), r0)
        if m:
            rows = raw[full * row :].view(1, -1)
            cls._decode_rows(rows, tail_k(k, m, c), c, bits, out[full * c :].view(1, m), full)
        return out

    @staticmethod
    def _decode_rows(rows: torch.Tensor, k: int, chunk: int, bits: int, out: torch.Tensor, first: int) -> None:
        """Check and decode [r, row] rows (chunks first, first + 1, ...) into [r, L] `out`."""
        w = index_bits(chunk)
        ib = _index_bytes(k, chunk, out.shape[1])
        scales = rows[:, :8].reshape(-1).clone().view(torch.float32).view(-1, 2)  # (a copy: a row may start at any byte)
        lo, hi = scales[:, 0], scales[:, 1]
        bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
        if bad.any():
            r = int(bad.nonzero()[0])
            raise RemoteProtocolError(f"sparse chunk {first + r}: scale is NaN or Inf (lo={float(lo[r])}, hi={float(hi[r])})", "payload")
        bad = ~((lo >= 0) & (lo <= hi))
        if bad.any():
            r = int(bad.nonzero()[0])
            raise RemoteProtocolError(f"sparse chunk {first + r}: scales need 0 <= lo <= hi, got lo={float(lo[r])}, hi={float(hi[r])}", "payload")
        codes = _unpack(rows[:, 8 + ib :], k, bits)
        if not ib:  # every value of the chunk, in order
            out.copy_(_values(lo, hi, codes, bits))
            return
        idx = _unpack(rows[:, 8 : 8 + ib], k, w)
        if int(idx.max()) >= out.shape[1]:
            r = int((idx.amax(1) >= out.shape[1]).nonzero()[0])
            raise RemoteProtocolError(f"sparse chunk {first + r}: index {int(idx[r].max())} out of range [0, {out.shape[1]})", "payload")
        if k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            r = int((idx[:, 1:] <= idx[:, :-1]).any(1).nonzero()[0])
            raise RemoteProtocolError(f"sparse chunk {first + r}: indices not strictly increasing (repeated or out of order)", "payload")
        out.zero_().scatter_(1, idx, _values(lo, hi, codes, bits))
