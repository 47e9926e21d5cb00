"""Codecs: round trips, error bounds, error feedback, chunking, refusal of bad payloads."""

import inspect
import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    Decoder,
    EncodedTensor,
    ErrorFeedback,
    LocalProtocolError,
    RemoteProtocolError,
    TensorAssembler,
    decode_tensor,
    encode,
    make_codec,
    split,
)
from protocol.tensors import DTYPES

CODECS = [
    ("none", {}), ("fp16", {}), ("int8", {"block_size": 64}), ("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2}),
    ("sparse", {"density": 0.1, "bits": 2, "chunk": 64}),
]  # fmt: skip
SHAPES = [(), (1,), (7,), (1000,), (33, 17), (4, 5, 6), (0,), (3, 0)]


@pytest.mark.parametrize("name,params", CODECS, ids=[c[0] for c in CODECS])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_shape_and_dtype(name, params, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    enc = make_codec(name, **params).encode(x)
    y = decode_tensor(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    if name == "none":
        assert torch.equal(x, y)
    if name == "fp16":
        assert torch.allclose(x, y, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_none_codec_is_exact_for_every_dtype(dtype):
    x = (torch.randn(5, 7) * 50).to(dtype)
    y = decode_tensor(make_codec("none").encode(x))
    assert y.dtype == dtype and torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name,params", CODECS[1:], ids=[c[0] for c in CODECS[1:]])
def test_lossy_codecs_keep_float_dtypes(name, params, dtype):
    x = torch.randn(64, 8).to(dtype)
    assert decode_tensor(make_codec(name, **params).encode(x)).dtype == dtype


def test_lossy_codec_refuses_integer_tensor():
    with pytest.raises(LocalProtocolError, match="floating"):
        make_codec("int8").encode(torch.arange(10))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    block=st.sampled_from([16, 64, 100, 1024]),
    scale=st.floats(1e-6, 1e6),
    seed=st.integers(0, 2**31),
)
def test_int8_error_bound_per_block(n, block, scale, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    y = decode_tensor(make_codec("int8", block_size=block).encode(x))
    pad = (-n) % block
    xb = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    err = torch.nn.functional.pad((x - y).abs(), (0, pad)).view(-1, block)
    absmax = xb.abs().amax(dim=1)
    assert torch.all(err.amax(dim=1) <= absmax / 127 * (1 + 1e-5))


def test_int8_zero_block_and_extremes():
    x = torch.cat([torch.zeros(64), torch.full((64,), 3e38), torch.tensor([1e-30] * 64)])
    y = decode_tensor(make_codec("int8", block_size=64).encode(x))
    assert torch.equal(y[:64], torch.zeros(64))
    assert torch.allclose(y[64:128], x[64:128], rtol=1e-6)
    assert torch.allclose(y[128:], x[128:], rtol=1e-2)


def test_fp16_clamps_instead_of_overflowing():
    y = decode_tensor(make_codec("fp16").encode(torch.tensor([1e6, -1e6, 1.0])))
    assert torch.isfinite(y).all() and y[0] == 65504 and y[1] == -65504


def test_topk_keeps_exactly_the_largest():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    y = decode_tensor(make_codec("topk", ratio=0.02).encode(x))
    kept = y != 0
    assert kept.sum() == 100
    assert x.abs()[kept].min() >= x.abs()[~kept].max()
    assert torch.equal(y[kept], x[kept])


def test_topk_large_tensor_uses_sampled_threshold_and_is_still_exact():
    x = torch.randn(3 << 20, generator=torch.Generator().manual_seed(2))
    y = decode_tensor(make_codec("topk", ratio=0.001).encode(x))
    k = math.ceil(0.001 * x.numel())
    expected = torch.zeros_like(x)
    idx = torch.topk(x.abs(), k).indices
    expected[idx] = x[idx]
    assert torch.equal(y, expected)


def test_powersgd_exact_on_low_rank_matrix():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 3, generator=g), torch.randn(3, 30, generator=g)
    x = a @ b
    codec = make_codec("powersgd", rank=3)
    state = {}
    codec.encode(x, state)
    y = decode_tensor(codec.encode(x, state))  # warm-started second step
    assert torch.allclose(x, y, atol=1e-3, rtol=1e-3)
    enc = codec.encode(x)
    assert enc.nbytes == (40 + 30) * 3 * 4 < x.numel() * 4


@pytest.mark.parametrize("name,params", CODECS[1:], ids=[c[0] for c in CODECS[1:]])
def test_error_feedback_running_sum_tracks_inputs(name, params):
    """sum(decoded) = sum(inputs) - final residual: the gap stays bounded by about one step's
    input, while without error feedback it grows with every step (the bias is lost each time)."""
    g = torch.Generator().manual_seed(4)
    ef = ErrorFeedback(make_codec(name, **params))
    codec = make_codec(name, **params)
    sum_in, sum_out, sum_plain = (torch.zeros(48, 32) for _ in range(3))
    gaps = {}
    for step in range(1, 121):
        x = torch.randn(48, 32, generator=g) + 0.5  # a consistent bias, as real gradients have
        sum_in += x
        sum_out += decode_tensor(ef.encode("w", x))
        sum_plain += decode_tensor(codec.encode(x))
        gaps[step] = (sum_in - sum_out).norm().item()
    assert torch.allclose(sum_in - sum_out, ef.residuals["w"], atol=1e-3)
    one_input = x.norm().item()
    assert gaps[120] <= 5 * one_input
    assert gaps[120] <= 1.5 * gaps[30] + 1e-3 * one_input  # bounded, not growing
    assert gaps[120] < 0.3 * (sum_in - sum_plain).norm().item()  # and far below no feedback


def test_error_feedback_refuses_shape_change():
    ef = ErrorFeedback(make_codec("int8"))
    ef.encode("a", torch.randn(10))
    with pytest.raises(LocalProtocolError, match="shape"):
        ef.encode("a", torch.randn(11))


@pytest.mark.parametrize("name,params", CODECS, ids=[c[0] for c in CODECS])
def test_chunked_through_frames(name, params):
    x = torch.randn(300, 70)
    enc = make_codec(name, **params).encode(x)
    parts = split(enc, "layer.0", chunk_size=1000, request_id=3)
    assert len(parts) == max(1, math.ceil(enc.nbytes / 1000))
    stream = b"".join(encode(p) for p in parts)
    dec, asm, out = Decoder(), TensorAssembler(), None
    for i in range(0, len(stream), 4096):
        for msg in dec.feed(stream[i : i + 4096]):
            out = asm.add(msg)
    assert out is not None
    assert torch.equal(decode_tensor(out), decode_tensor(enc))


def test_assembler_refuses_bad_sequences():
    enc = make_codec("none").encode(torch.randn(100))
    parts = split(enc, "k", chunk_size=100)
    with pytest.raises(RemoteProtocolError, match="index"):
        TensorAssembler().add(parts[1])
    asm = TensorAssembler()
    asm.add(parts[0])
    with pytest.raises(RemoteProtocolError, match="expected 1"):
        asm.add(parts[2])
    with pytest.raises(RemoteProtocolError, match="total_size"):
        TensorAssembler(max_total_size=399).add(parts[0])
    asm = TensorAssembler()
    asm.add(parts[0])
    other = split(make_codec("none").encode(torch.randn(10, 10)), "k", chunk_size=100)[1]
    with pytest.raises(RemoteProtocolError, match="shape"):
        asm.add(other)


@pytest.mark.parametrize(
    "enc, match",
    [
        (EncodedTensor("float32", (10,), "none", bytes(39)), "payload"),
        (EncodedTensor("float32", (10,), "zstd", bytes(40)), "unknown codec"),
        (EncodedTensor("int64", (10,), "int8", bytes(50), {"block_size": 64}), "cannot carry"),
        (EncodedTensor("float32", (10,), "int8", bytes(14), {"block_size": 3}), "block_size"),
        (EncodedTensor("float32", (10,), "int8", bytes(13), {"block_size": 64}), "payload"),
        (EncodedTensor("float32", (10,), "topk", bytes(16), {"k": 11}), "params.k"),
        (EncodedTensor("float32", (10,), "topk", b"\xff\x00\x00\x00" + bytes(4), {"k": 1}), "out of range"),
        (EncodedTensor("float32", (4, 4), "powersgd", bytes(64), {"rank": 2, "rows": 4, "cols": 5}), "rows"),
        (EncodedTensor("float32", (1 << 20, 1 << 20), "topk", b"", {"k": 0}), "exceed"),
        (EncodedTensor("float32", (-1,), "none", b""), "shape"),
    ],
)
def test_decode_refuses_inconsistent_payloads(enc, match):
    with pytest.raises(RemoteProtocolError, match=match):
        decode_tensor(enc)


@pytest.mark.parametrize("name,params", CODECS[1:], ids=[c[0] for c in CODECS[1:]])
def test_encode_with_error_returns_exactly_what_the_receiver_decodes(name, params):
    x = torch.randn(37, 61, generator=torch.Generator().manual_seed(5)) * 3
    x[0, :10] = -1e-9  # rounds to a code of -0.0: the bytes must still match the receiver's +0.0
    enc, decoded = make_codec(name, **params).encode_with_error(x, {})
    # bytes, not values: -0.0 == 0.0, but replicas compare hashes of the bytes
    assert decoded.numpy().tobytes() == decode_tensor(enc).reshape(-1).to(torch.float32).numpy().tobytes()


@pytest.mark.parametrize("name,params", CODECS, ids=[c[0] for c in CODECS])
def test_decode_with_a_bound_refuses_non_finite_and_huge_values(name, params):
    codec = make_codec(name, **params)
    ok = codec.encode(torch.ones(64, 64))
    assert torch.isfinite(decode_tensor(ok, max_abs=10.0)).all()
    with pytest.raises(RemoteProtocolError, match="exceed"):
        decode_tensor(codec.encode(torch.full((64, 64), 50.0)), max_abs=10.0)
    bad = torch.ones(64, 64)
    bad[3, 5] = float("nan")
    with pytest.raises(RemoteProtocolError, match="NaN"):
        decode_tensor(codec.encode(bad), max_abs=10.0)


@pytest.mark.parametrize("name,params", CODECS[1:], ids=[c[0] for c in CODECS[1:]])
def test_encode_with_feedback_matches_the_two_step_form(name, params):
    g = torch.Generator().manual_seed(6)
    x, r = torch.randn(3000, generator=g), torch.randn(3000, generator=g) * 0.1
    codec = make_codec(name, **params)
    r1 = r.clone()
    enc, decoded = codec.encode_with_feedback(x, r1, {})
    corrected = x + r
    ref_enc, ref_decoded = codec.encode_with_error(corrected, {})
    assert bytes(memoryview(enc.payload)) == bytes(memoryview(ref_enc.payload))
    assert torch.equal(decoded, ref_decoded) and torch.equal(r1, corrected - ref_decoded)


@pytest.mark.parametrize("name,params", CODECS[1:], ids=[c[0] for c in CODECS[1:]])
def test_feedback_without_keeping_the_decoded_copy_or_into_a_given_buffer(name, params):
    """A sender that only needs the residual (keep_decoded=False) gets the same encoding and
    residual, across slice boundaries; a given `decoded` buffer receives the same bits."""
    from protocol.codecs import _SLICE

    g = torch.Generator().manual_seed(8)
    n = _SLICE + 4099
    x, r = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    codec = make_codec(name, **params)
    r_ref, r_lean, r_buf = r.clone(), r.clone(), r.clone()
    enc, decoded = codec.encode_with_feedback(x, r_ref, {})
    lean, none = codec.encode_with_feedback(x, r_lean, {}, keep_decoded=False)
    buf = torch.full((n,), float("nan"))
    into, got = codec.encode_with_feedback(x, r_buf, {}, decoded=buf)
    assert none is None and got is buf
    for e in (lean, into):
        assert bytes(memoryview(e.payload)) == bytes(memoryview(enc.payload))
    assert torch.equal(r_lean, r_ref) and torch.equal(r_buf, r_ref) and torch.equal(buf, decoded)
    with pytest.raises(LocalProtocolError, match="decoded must be"):
        codec.encode_with_feedback(x, r.clone(), {}, decoded=torch.empty(n - 1))


@pytest.mark.parametrize("with_residual", [True, False])
def test_fp16_one_pass_feedback_matches_the_generic_path_bit_for_bit(with_residual):
    """fp16's fused encode (slice by slice, in cache) must send, decode and remember exactly
    what the plain five-pass version does, across slice boundaries and beyond the fp16 range."""
    from protocol.codecs import _SLICE, Codec

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2 * _SLICE + 777, generator=gen) * 100
    x[3], x[_SLICE + 1] = 1e6, -1e6  # clamped to ±65504
    codec = make_codec("fp16")
    r1 = torch.randn(x.numel(), generator=gen) * 1e-3 if with_residual else torch.zeros(x.numel())
    r2 = r1.clone()
    enc1, dec1 = codec.encode_with_feedback(x, r1)
    enc2, dec2 = Codec.encode_with_feedback(codec, x, r2)
    assert bytes(enc1.payload) == bytes(enc2.payload)
    assert torch.equal(dec1, dec2) and torch.equal(r1, r2)
    out = torch.empty(x.numel())
    decode_tensor(enc1, out=out)
    assert torch.equal(out, dec1)  # what a receiver decodes is what the sender kept


@pytest.mark.parametrize("where", [0, -1])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_bound_check_finds_a_non_finite_value_anywhere(where, bad):
    x = torch.randn(10_000)
    x[where] = bad
    with pytest.raises(RemoteProtocolError, match="NaN or Inf"):
        decode_tensor(make_codec("none").encode(x), max_abs=1e3)
    with pytest.raises(RemoteProtocolError, match="NaN or Inf" if math.isnan(bad) else "exceed the bound"):
        decode_tensor(make_codec("fp16").encode(x), max_abs=1e3)  # fp16 clamps ±inf to ±65504


@pytest.mark.parametrize("name,params", [("fp16", {}), ("int8", {"block_size": 64}), ("sparse", {"density": 0.05, "chunk": 64})], ids=["fp16", "int8", "sparse"])
def test_cut_of_a_whole_encoding_is_the_encoding_of_the_range(name, params):
    """A vector encoded whole (with error feedback) and cut at aligned bounds gives, per range,
    the bytes and the residual that encoding the range alone gives: a sender may encode before
    it knows the split."""
    from protocol.codecs import _SLICE

    g = torch.Generator().manual_seed(11)
    n = _SLICE + 64 * 7 + 5  # crosses a slice boundary; the last block is partial
    x, r = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    codec = make_codec(name, **params)
    whole_r = torch.empty(n)
    whole, _ = codec.encode_with_feedback(x, r, {}, out=whole_r, keep_decoded=False)
    bounds = [0, 64 * 3, _SLICE - 64, _SLICE + 64 * 5, n]
    for a, b in pairwise(bounds):
        part_r = torch.empty(b - a)
        alone, _ = codec.encode_with_feedback(x[a:b], r[a:b], {}, out=part_r, keep_decoded=False)
        cut = codec.cut(whole, a, b)
        assert cut.shape == (b - a,) and cut.params == alone.params
        assert bytes(memoryview(cut.payload)) == bytes(memoryview(alone.payload))
        assert torch.equal(decode_tensor(cut), decode_tensor(alone)) and torch.equal(whole_r[a:b], part_r)


def test_cut_refuses_misaligned_bounds_and_codecs_that_cannot_cut():
    int8 = make_codec("int8", block_size=64)
    enc = int8.encode(torch.randn(1000))
    for a, b in [(10, 128), (0, 100), (128, 64), (0, 1001)]:
        with pytest.raises(LocalProtocolError, match="cannot cut"):
            int8.cut(enc, a, b)
    assert int8.cut(enc, 960, 1000).shape == (40,)  # the end needs no alignment
    topk = make_codec("topk", ratio=0.1)
    assert topk.cut_align == 0
    with pytest.raises(LocalProtocolError, match="cannot cut"):
        topk.cut(topk.encode(torch.randn(100)), 0, 50)
    with pytest.raises(LocalProtocolError, match="flat int8 encoding"):
        int8.cut(make_codec("fp16").encode(torch.randn(100)), 0, 64)


# -- identity: a codec is its name and params --

ALL_CODECS = CODECS + [("int8", {}), ("topk", {}), ("powersgd", {}), ("powersgd", {"rank": 3, "seed": 7})]


@pytest.mark.parametrize("name,params", ALL_CODECS, ids=[f"{n}-{p}" for n, p in ALL_CODECS])
def test_codec_params_rebuild_an_equal_codec(name, params):
    codec = make_codec(name, **params)
    again = make_codec(codec.name, **codec.params())
    assert again == codec and hash(again) == hash(codec)
    assert codec.params().items() >= params.items()
    assert set(codec.params()) == set(inspect.signature(type(codec)).parameters)  # every constructor param
    assert all(type(v) in (int, float) for v in codec.params().values())  # travels in a message as it is
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    assert bytes(memoryview(again.encode(x).payload)) == bytes(memoryview(codec.encode(x).payload))


def test_codecs_with_other_params_or_names_differ():
    assert make_codec("int8", block_size=64) != make_codec("int8", block_size=128)
    assert make_codec("topk", ratio=0.1) != make_codec("topk", ratio=0.2)
    assert make_codec("powersgd", rank=2) != make_codec("powersgd", rank=2, seed=1)
    assert make_codec("none") != make_codec("fp16")
    assert make_codec("none") != "none"
    assert len({make_codec("int8", block_size=64), make_codec("int8", block_size=64), make_codec("int8")}) == 2
    assert repr(make_codec("int8", block_size=64)) == "Int8Codec(block_size=64)"


# -- sparse: chunked top-k, low-bit values --


def test_sparse_sends_each_chunks_largest_values_in_few_bytes():
    codec = make_codec("sparse", density=0.02, bits=2, chunk=4096)
    x = torch.randn(4096 * 3 + 100, generator=torch.Generator().manual_seed(1))
    enc, decoded = codec.encode_with_error(x)
    assert enc.params == {"chunk": 4096, "k": 82, "bits": 2}
    # per full chunk: lo, hi, 82 indices of 12 bits, 82 codes of 2 bits; the 100-element tail sends 3
    assert enc.nbytes == 3 * (8 + 123 + 21) + (8 + 5 + 1) and codec.bytes_per_element() < 0.04
    for c in range(4):
        chunk, got = x[c * 4096 : (c + 1) * 4096], decoded[c * 4096 : (c + 1) * 4096]
        sent = got != 0
        assert int(sent.sum()) == (82 if c < 3 else 3)
        assert chunk.abs()[sent].min() >= chunk.abs()[~sent].max()  # exactly the largest
        assert torch.equal(got[sent].sign(), chunk[sent].sign())
        levels = got[sent].abs().unique()
        assert len(levels) <= 2  # 2 bits: a sign and one bit of level
        nearest = (chunk[sent].abs().unsqueeze(1) - levels).abs().min(1).values
        assert torch.allclose((got - chunk)[sent].abs(), nearest, atol=1e-6)  # each rounded to its nearest level


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_sparse_levels_per_bit_width(bits):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(bits))
    enc, decoded = make_codec("sparse", density=0.1, bits=bits, chunk=256).encode_with_error(x)
    sent = decoded != 0
    assert torch.equal(decode_tensor(enc), decoded)
    assert len(decoded[sent].abs().unique()) <= (1 << (bits - 1)) * math.ceil(5000 / 256)
    err = (decoded - x)[sent].abs().mean() / x[sent].abs().mean()
    assert err < {1: 0.5, 3: 0.1, 8: 0.01}[bits]


@pytest.mark.parametrize("levels", [2, 4, 128])
def test_sparse_levels_are_fitted_to_the_magnitudes(levels):
    from protocol.sparse import fit_levels

    g = torch.Generator().manual_seed(levels)
    mag = torch.cat([torch.randn(3, 500, generator=g).abs(), torch.full((1, 500), 0.25), torch.zeros(1, 500)])
    lo, hi = fit_levels(mag, levels)
    assert ((0 <= lo) & (lo <= hi)).all() and torch.isfinite(hi).all()

    def sq_error(lo, hi):
        step = ((hi - lo) / (levels - 1)).clamp_min(1e-30).unsqueeze(1)
        q = ((mag - lo.unsqueeze(1)) / step).round().clamp(0, levels - 1)
        return (q * step + lo.unsqueeze(1) - mag).square().sum(1)

    fitted, spread = sq_error(lo, hi), sq_error(mag.amin(1), mag.amax(1))
    assert (fitted <= spread * 1.001 + 1e-9).all()  # never worse than levels over the whole spread
    if levels == 2:
        assert (fitted[:3] < 0.5 * spread[:3]).all()  # and much better on half-normal magnitudes
    assert torch.allclose(lo[3:], torch.tensor([0.25, 0.0])) and torch.allclose(hi[3:], torch.tensor([0.25, 0.0]))


def test_sparse_at_density_one_sends_every_value_in_order_and_no_indices():
    codec = make_codec("sparse", density=1.0, bits=1, chunk=256)
    x = torch.randn(256 * 2 + 10, generator=torch.Generator().manual_seed(4))
    enc, decoded = codec.encode_with_error(x)
    assert enc.nbytes == 2 * (8 + 32) + (8 + 2)  # per row: lo, hi and one bit per value
    assert torch.equal(decode_tensor(enc), decoded) and torch.equal(decoded.sign(), x.sign())
    for a, b in ((0, 256), (256, 512), (512, 522)):  # one bit: the sign and the chunk's mean magnitude
        assert torch.allclose(decoded[a:b].abs(), x[a:b].abs().mean().expand(b - a))
    # 1-bit with error feedback: what was decoded tracks what was sent, the lag bounded
    ef, total, got = ErrorFeedback(codec), torch.zeros(522), torch.zeros(522)
    for step in range(50):
        g = torch.randn(522, generator=torch.Generator().manual_seed(100 + step))
        total += g
        got += decode_tensor(ef.encode("w", g))
    assert torch.allclose(total - got, ef.residuals["w"], atol=1e-4)
    assert ef.residuals["w"].norm() < 0.5 * total.norm()  # the lag stays bounded while the sum grows


def test_sparse_constructor_refuses_bad_params():
    for params in ({"density": 0.0}, {"density": 1.5}, {"bits": 0}, {"bits": 9}, {"chunk": 8}, {"chunk": 1 << 17}, {"bits": 2.0}):
        with pytest.raises(LocalProtocolError, match="sparse"):
            make_codec("sparse", **params)


def _sparse_bad(mutate) -> EncodedTensor:
    """A valid sparse encoding (density 0.05, chunk 64: rows of k=4 values: 8 bytes of scales, 3
    of 6-bit indices, 1 of codes; then the 10-element tail's row: 1 value, 8 + 1 + 1 bytes),
    changed by `mutate(payload bytearray, params dict)`."""
    enc = make_codec("sparse", density=0.05, bits=2, chunk=64).encode(torch.randn(64 * 3 + 10, generator=torch.Generator().manual_seed(2)))
    payload, params = bytearray(enc.payload), dict(enc.params)
    mutate(payload, params)
    return EncodedTensor(enc.dtype, enc.shape, enc.codec, bytes(payload), params)


def _indices(row: int, values: list[int]):
    from protocol.sparse import _pack

    def mutate(p, params):
        p[row * 12 + 8 : row * 12 + 11] = _pack(torch.tensor([values]), 6).numpy().tobytes()

    return mutate


def _scales(row: int, lo: float, hi: float):
    def mutate(p, params):
        p[row * 12 : row * 12 + 8] = torch.tensor([lo, hi], dtype=torch.float32).numpy().tobytes()

    return mutate


def _set(**kw):
    return lambda p, params: params.update(kw)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p, params: None, None),
        (_indices(1, [3, 9, 9, 20]), "chunk 1: indices not strictly increasing"),
        (_indices(0, [3, 20, 9, 30]), "chunk 0: indices not strictly increasing"),
        (lambda p, params: p.__setitem__(3 * 12 + 8, 12), "chunk 3: index 12 out of range \\[0, 10\\)"),  # the 10-element tail
        (_scales(2, math.nan, 1.0), "chunk 2: scale is NaN or Inf"),
        (_scales(0, 0.5, math.inf), "chunk 0: scale is NaN or Inf"),
        (_scales(1, 2.0, 1.0), "chunk 1: scales need 0 <= lo <= hi"),
        (_scales(1, -1.0, 1.0), "chunk 1: scales need 0 <= lo <= hi"),
        (lambda p, params: p.pop(), "payload is 45 bytes, expected 46"),
        (lambda p, params: p.append(0), "payload is 47 bytes, expected 46"),
        (_set(k=5), "payload is 46 bytes, expected 52"),
        (_set(k=0), "params.k"),
        (_set(k=65), "params.k"),
        (_set(bits=9), "params.bits"),
        (_set(chunk=8), "params.chunk"),
        (_set(chunk=64.0), "params.chunk"),
        (lambda p, params: params.pop("bits"), "params.bits"),
    ],
)
def test_sparse_decode_refuses_bad_parts_and_names_the_problem(mutate, match):
    enc = _sparse_bad(mutate)
    if match is None:
        assert torch.isfinite(decode_tensor(enc, max_abs=100.0)).all()
        return
    with pytest.raises(RemoteProtocolError, match=match) as e:
        decode_tensor(enc, max_abs=100.0)
    assert e.value.field in ("payload", "params.k", "params.bits", "params.chunk")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_sparse_decode_of_mutated_payloads_refuses_or_stays_bounded(data):
    """Whatever bytes a peer sends under a sparse header: refused with RemoteProtocolError, or
    decoded to finite values no larger than the row's hi, at most k per chunk."""
    n = data.draw(st.integers(1, 400))
    codec = make_codec("sparse", density=data.draw(st.sampled_from([0.05, 0.3, 1.0])), bits=data.draw(st.integers(1, 8)), chunk=data.draw(st.sampled_from([16, 64])))
    enc = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))))
    payload = bytearray(enc.payload)
    for _ in range(data.draw(st.integers(1, 6))):
        if payload:
            payload[data.draw(st.integers(0, len(payload) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    try:
        out = decode_tensor(EncodedTensor(enc.dtype, enc.shape, enc.codec, bytes(payload), enc.params), max_abs=1e30)
    except RemoteProtocolError:
        return
    assert torch.isfinite(out).all()
    for c in range(0, n, codec.chunk):
        assert int((out[c : c + codec.chunk] != 0).sum()) <= codec.k
