"""Property tests: whatever bytes arrive, only RemoteProtocolError escapes the decoder."""

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import Decoder, RemoteProtocolError, encode
from protocol import messages as m
from protocol.framing import PROTOCOL_VERSION
from tests.test_framing import SAMPLES, _buffered

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode(data: bytes, chunk: int, bulk_min: int, buffered: bool) -> tuple[list, str | None]:
    """(messages, error field or None); only RemoteProtocolError may escape the decoder."""
    dec, out = Decoder(max_frame_size=1 << 16, bulk_min=bulk_min), []
    try:
        for pos in range(0, len(data), chunk):
            piece = data[pos : pos + chunk]
            # buffered: as a BufferedProtocol would, straight into the decoder's buffers
            out += _buffered(dec, piece, chunk) if buffered else dec.feed(piece)
    except RemoteProtocolError as e:
        return out, e.field
    assert all(isinstance(msg, m.Message) for msg in out)
    return out, None


def _feed_all(data: bytes, chunk: int) -> None:
    # bytes fields decoded as views (bulk_min=1: every one) and read into the decoder's own
    # buffers must give what the plain decode gives: the same verdict, the same messages (a
    # `feed` that fails drops what it decoded before the bad frame: only a prefix is compared)
    plain, error = _decode(data, chunk, 1 << 30, False)
    for buffered in (False, True):
        got, got_error = _decode(data, chunk, 1, buffered)
        assert got_error == error
        n = min(len(got), len(plain))
        assert got[:n] == plain[:n] and (error or got == plain)


@FAST
@given(st.binary(max_size=2048), st.integers(1, 64))
def test_random_bytes(data, chunk):
    _feed_all(data, chunk)


@FAST
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_frames(msg, data):
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "flip" and frame:
            frame[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and frame:
            del frame[pos]
        elif op == "truncate":
            del frame[pos:]
    _feed_all(bytes(frame), data.draw(st.integers(1, 32)))


_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@FAST
@given(st.sampled_from(sorted(m.REGISTRY)), st.dictionaries(st.text(max_size=12), _json_like, max_size=6), _json_like)
def test_well_framed_nonsense_fields(code, fields, request_id):
    # plausible field names with arbitrary values: validation must refuse cleanly, never crash
    names = [f for f in m.REGISTRY[code].__dataclass_fields__ if f != "request_id"]
    for i, name in enumerate(names):
        if i < len(fields):
            fields[name] = list(fields.values())[i]
    body = msgpack.packb([PROTOCOL_VERSION, code, request_id, fields], use_bin_type=True)
    _feed_all(len(body).to_bytes(4, "big") + body, 1 << 16)


def test_the_fuzz_bench_feeds_every_entry_and_counts_what_escapes():
    """bench/fuzz.py, a few hundred inputs per entry: each entry both refuses and takes some of
    its inputs (the mutations reach past the first check), and nothing else escapes."""
    from bench.fuzz import ENTRIES, fuzz

    for entry in ENTRIES:
        row = fuzz(entry, 300, seed=1, hang_s=5.0)
        assert row["crashes"] == 0 and row["hangs"] == 0, row
        assert row["refused"] > 30 and row["accepted"] > 30, row
