"""Framing and messages: round trips, byte-at-a-time feeding, refusal of bad frames."""

import dataclasses
import tracemalloc

import msgpack
import pytest

from protocol import REGISTRY, Decoder, LocalProtocolError, RemoteProtocolError, encode
from protocol import messages as m
from protocol.framing import PROTOCOL_VERSION

SAMPLES = [
    m.Hello(peer_id="QmPeer", swarm_id="swarm-1", software="swarmtrain/0.1", roles=("replica",), token=b"\x01\x02"),
    m.Error(code="bad_request", message="shape mismatch", request_id=9),
    m.Ping(nonce=42, sent_at=1.5),
    m.Probe(data=b"x" * 100, want=10),
    m.MemberProof(certificate=b"c" * 40),
    m.DirectOpen(ticket=b"t" * 16, key=b"k" * 32, request_id=4),
    m.DirectAddress(addrs=("10.0.0.2:31500", "127.0.0.1:31500")),
    m.Pong(nonce=42, sent_at=1.5),
    m.Ack(info={"accepted": True, "step": 3, "loss": 1.25, "note": "ok"}),
    m.Register(peer_id="p", maddrs=("/ip4/127.0.0.1/tcp/1",), capabilities={"device": "cpu", "tflops": 0.1}),
    m.Heartbeat(peer_id="p", step=10, loss=2.5, samples_per_second=100.0, state_hash="abcd"),
    m.Deregister(peer_id="p", reason="SIGTERM"),
    m.RoleAssignment(peer_id="p", role="stage", stage=1, epoch=3, reason="balance"),
    m.TensorPart(key="k", dtype="float32", shape=(2, 3), codec="none", index=0, count=1, total_size=24, data=bytes(24)),
    m.CheckpointQuery(step=None),
    m.CheckpointManifest(step=3, manifest=b'{"step": 3}'),
    m.CheckpointOffer(step=3, manifest=b'{"step": 3}'),
    m.AvgJoin(round_key="outer-1", numel=100, weight=2.0, bandwidth=1e7, codec="int8"),
    m.AvgGroup(status="group", group_id="g", members=("a", "b"), weights=(1.0, 2.0), bounds=(0, 50, 100), codec="int8",
               codec_params={"block_size": 64}, gather_codec="int8", deadline_s=3.0),
    m.AvgGroup(status="group", group_id="g", members=("a", "b"), weights=(1.0, 1.0), bounds=(0, 4096, 8192), codec="sparse",
               codec_params={"density": 0.02, "bits": 2, "chunk": 4096}, gather_codec="sparse",
               gather_codec_params={"density": 0.02, "bits": 2, "chunk": 4096}, deadline_s=3.0),
    m.AvgGroup(status="redirect", redirect="b"),
    m.AvgReport(group_id="g", phase="scatter", received_from=("a",), blamed=("b",), reasons=("NaN",)),
    m.AvgDecision(group_id="g", phase="gather", commit=True, survivors=("a",), owners=("a", "a")),
    m.AvgDecisionQuery(group_id="g", phase="scatter"),
    m.StateRequest(name="ckpt/000010/model.safetensors", offset=5, length=100),
    m.StateChunk(name="x", offset=0, total_size=3, sha256="0" * 64, data=b"abc", request_id=2**40),
    m.StageCall(
        stage=1, op="backward", micro_batch="t-3", shapes=((1, 2), (1, 2)), data=bytes(24),
        tensors=({"name": "x", "dtype": "float32", "codec": "none", "nbytes": 8}, {"name": "grad", "dtype": "float32", "codec": "int8", "nbytes": 16, "p.block_size": 64}),
    ),  # fmt: skip
    m.StageResult(loss=2.5),
    m.ExpertCall(
        op="forward", micro_batch="t-3.layer1", shapes=((3, 2),), data=bytes(24),
        tensors=({"name": "x:layer1.expert0", "dtype": "float32", "codec": "none", "nbytes": 24},),
    ),  # fmt: skip
    m.ExpertCall(op="commit", micro_batch="t-3", scale=0.25),
    m.ExpertResult(),
    m.ExpertResult(norm2=3.5),
]


def test_every_registered_message_has_a_sample():
    assert {type(s) for s in SAMPLES} == set(REGISTRY.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg):
    (out,) = Decoder().feed(encode(msg))
    assert out == msg
    assert out.request_id == msg.request_id


def test_byte_at_a_time_and_merged():
    stream = b"".join(encode(s) for s in SAMPLES)
    dec = Decoder()
    got = []
    for i in range(len(stream)):
        got += dec.feed(stream[i : i + 1])
    assert got == SAMPLES
    assert dec.buffered == 0
    # what a decoder holds of a frame under way is every byte of it fed so far, prefix included
    frame = encode(SAMPLES[-1])
    for api in ("feed", "buffered"):
        dec = Decoder()
        half = frame[: len(frame) // 2]
        assert (dec.feed(half) if api == "feed" else _buffered(dec, half, 3)) == []
        assert dec.buffered == len(half)
    # all at once, and in odd-sized pieces
    assert Decoder().feed(stream) == SAMPLES
    dec, got = Decoder(), []
    for i in range(0, len(stream), 7):
        got += dec.feed(stream[i : i + 7])
    assert got == SAMPLES


def _frame(body_obj) -> bytes:
    body = msgpack.packb(body_obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def test_unknown_fields_are_ignored():
    frame = _frame([PROTOCOL_VERSION, m.Ping.TYPE, 5, {"nonce": 1, "sent_at": 0.0, "future_field": [1, 2]}])
    (msg,) = Decoder().feed(frame)
    assert msg == m.Ping(nonce=1, sent_at=0.0, request_id=5)


@pytest.mark.parametrize(
    "body, field",
    [
        ([PROTOCOL_VERSION, 999, 0, {}], "type"),
        ([PROTOCOL_VERSION + 1, m.Ping.TYPE, 0, {}], "version"),
        ([PROTOCOL_VERSION, m.Ping.TYPE, -1, {}], "request_id"),
        ([PROTOCOL_VERSION, m.Ping.TYPE, 0, []], "fields"),
        ([PROTOCOL_VERSION, m.Ping.TYPE, 0], "frame"),
        ({"v": 1}, "frame"),
        ([PROTOCOL_VERSION, m.Ping.TYPE, 0, {"nonce": "seven"}], "nonce"),
        ([PROTOCOL_VERSION, m.Ping.TYPE, 0, {"nonce": True}], "nonce"),
        ([PROTOCOL_VERSION, m.Hello.TYPE, 0, {"swarm_id": "s"}], "peer_id"),
        ([PROTOCOL_VERSION, m.Error.TYPE, 0, {"code": "whatever"}], "code"),
        ([PROTOCOL_VERSION, m.Heartbeat.TYPE, 0, {"peer_id": "p", "loss": float("nan")}], "loss"),
        ([PROTOCOL_VERSION, m.StateChunk.TYPE, 0, {"name": "x", "offset": 2, "total_size": 3, "sha256": "0" * 64, "data": b"ab"}], "data"),
        ([PROTOCOL_VERSION, m.TensorPart.TYPE, 0, {"key": "k", "dtype": "complex64", "shape": [1], "codec": "none"}], "dtype"),
        ([PROTOCOL_VERSION, m.ExpertCall.TYPE, 0, {"op": "commit", "micro_batch": "t-3", "scale": 1.5}], "scale"),
        ([PROTOCOL_VERSION, m.ExpertCall.TYPE, 0, {"op": "commit", "micro_batch": "t-3"}], "scale"),
        ([PROTOCOL_VERSION, m.ExpertCall.TYPE, 0, {"op": "forward", "micro_batch": "t-3", "scale": 0.5}], "scale"),
        ([PROTOCOL_VERSION, m.ExpertResult.TYPE, 0, {"norm2": float("nan")}], "norm2"),
        ([PROTOCOL_VERSION, m.ExpertResult.TYPE, 0, {"norm2": -1.0}], "norm2"),
    ],
)
def test_bad_frames_name_the_problem(body, field):
    with pytest.raises(RemoteProtocolError) as info:
        Decoder().feed(_frame(body))
    assert field in str(info.value)


def test_not_msgpack_and_ext_types_refused():
    with pytest.raises(RemoteProtocolError, match="msgpack"):
        Decoder().feed(b"\x00\x00\x00\x01\xc1")  # 0xc1 is never used in msgpack
    ext = msgpack.packb([PROTOCOL_VERSION, m.Ping.TYPE, 0, {"nonce": msgpack.ExtType(5, b"x")}])
    with pytest.raises(RemoteProtocolError, match="extension"):
        Decoder().feed(len(ext).to_bytes(4, "big") + ext)
    trailing = msgpack.packb([PROTOCOL_VERSION, m.Ping.TYPE, 0, {}]) + b"\x00"
    with pytest.raises(RemoteProtocolError):
        Decoder().feed(len(trailing).to_bytes(4, "big") + trailing)


def test_oversized_length_prefix_refused_before_allocating():
    dec = Decoder(max_frame_size=1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="exceeds") as info:
            dec.feed((2**32 - 1).to_bytes(4, "big"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.field == "length"
    assert peak < 64 * 1024  # nothing near the announced 4 GiB (or even the 1 MiB limit) was allocated
    # the decoder is poisoned: the stream cannot be re-synchronised
    with pytest.raises(RemoteProtocolError):
        dec.feed(encode(m.Ping()))


def test_prefix_over_limit_refused_even_when_split():
    dec = Decoder(max_frame_size=100)
    assert dec.feed(b"\x00\x00") == []
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        dec.feed(b"\x00\x65")  # 101


def test_empty_frame_refused():
    with pytest.raises(RemoteProtocolError, match="empty"):
        Decoder().feed(b"\x00\x00\x00\x00")


def test_local_misuse_is_a_local_error():
    with pytest.raises(LocalProtocolError, match="peer_id"):
        m.Hello(peer_id="", swarm_id="s")
    with pytest.raises(LocalProtocolError, match="nonce"):
        m.Ping(nonce="x")
    with pytest.raises(LocalProtocolError, match="over"):
        encode(m.StateChunk(name="x", offset=0, total_size=200, sha256="0" * 64, data=bytes(200)), max_frame_size=100)
    with pytest.raises(LocalProtocolError):
        encode("not a message")


def test_fields_keep_or_coerce_their_types_as_declared_and_errors_name_the_item():
    # the checks are built once per annotation, with fast paths for values of exactly the
    # declared type: each case here takes the other path too
    info = m.Ack(info={"i": 1, "b": True, "f": 1.0, "s": "x"}).info
    assert [type(info[k]) for k in "ibfs"] == [int, bool, float, str]  # a union of scalars keeps each as it is
    hb = m.Heartbeat(peer_id="p", step=3, loss=2)
    assert type(hb.loss) is float and hb.loss == 2.0  # an int where a float is declared becomes one
    call = m.StageCall(stage=1, op="norms", norms2=[1, 0.5])
    assert call.norms2 == (1.0, 0.5) and [type(v) for v in call.norms2] == [float, float]  # lists become tuples
    head = {"name": "x", "dtype": "float32", "codec": "none", "nbytes": 24}
    assert m.StageCall(stage=1, op="forward", tensors=[head], shapes=[[2, 3]], data=bytes(24)).shapes == ((2, 3),)
    assert m.AvgJoin(round_key="r", numel=4, weight=2, bandwidth=1, codec="none").weight == 2.0
    assert len(m.Probe(data=memoryview(bytearray(8)).cast("I")).data) == 8  # a view of 4-byte items counts bytes
    for make, where in [
        (lambda: m.Heartbeat(peer_id="p", step=True), "Heartbeat.step: expected int, got bool"),
        (lambda: m.Heartbeat(peer_id="p", loss="2"), "Heartbeat.loss: expected float or None, got str"),
        (lambda: m.StageCall(stage=1, op="norms", norms2=(0.5, True)), "StageCall.norms2[1]: expected float, got bool"),
        (lambda: m.StageCall(stage=1, op="forward", shapes=((1, 2), (3, "4"))), "StageCall.shapes[1][1]: expected int, got str"),
        (lambda: m.Ack(info={"k": [1]}), "Ack.info.k: expected int or float or str or bool, got list"),
        (lambda: m.Ack(info={1: 2}), "Ack.info: map key 1 is not str"),
        (lambda: m.Hello(peer_id="p", swarm_id="s", roles="replica"), "Hello.roles: expected a list, got str"),
    ]:
        with pytest.raises(LocalProtocolError) as e:
            make()
        assert str(e.value) == where


def test_a_message_under_another_request_id_is_a_copy_with_only_that_changed():
    call = m.StageCall(stage=1, op="norms", norms2=(0.5,), request_id=3)
    moved = call.with_request_id(7)
    assert moved.request_id == 7 and call.request_id == 3
    assert dataclasses.replace(moved, request_id=3) == call
    assert call.with_request_id(3) is call
    for bad in (-1, 2**63, True, 1.0):
        with pytest.raises(LocalProtocolError, match="request_id"):
            call.with_request_id(bad)


def test_messages_are_frozen():
    msg = m.Ping(nonce=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.nonce = 2


def _buffered(dec: Decoder, stream: bytes, chunk: int) -> list:
    """Feed `stream` the way a BufferedProtocol does: into the decoder's own buffers."""
    out, pos = [], 0
    while pos < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), chunk, len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        out += dec.buffer_updated(n)
        pos += n
    return out


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_every_sample_through_both_apis_with_every_bytes_field_bulk(chunk):
    stream = b"".join(encode(s) for s in SAMPLES)
    assert _buffered(Decoder(bulk_min=1), stream, chunk) == SAMPLES
    dec = Decoder(bulk_min=1)
    got = []
    for i in range(0, len(stream), chunk):
        got += dec.feed(stream[i : i + chunk])
    assert got == SAMPLES


def test_bulk_bytes_are_views_of_the_frame_not_copies():
    data = bytes(range(256)) * 1024  # 256 KiB
    part = m.TensorPart(key="k", dtype="uint8", shape=(len(data),), codec="none", total_size=len(data), data=data)
    frame = encode(part)
    (whole,) = Decoder().feed(frame)  # the frame lies whole in what was fed: decoded in place
    assert isinstance(whole.data, memoryview) and whole.data.obj is frame and whole.data == data
    dec = Decoder()
    first, second = _buffered(dec, frame + frame, 5000)
    # read into a body buffer of the frame's own: the next frame's bytes went elsewhere
    assert first.data.obj is not second.data.obj and first.data == data and second.data == data
    # a buffer its owner may write again is copied from, so the message does not change with it
    reused = bytearray(frame)
    (copied,) = Decoder().feed(reused)
    reused[-len(data) :] = bytes(len(data))
    assert copied.data == data and copied.data.obj is not reused
    # a large bytes field a message does not list as bulk is copied out: it is parsed as bytes
    manifest = b'{"files": "' + b"x" * 100_000 + b'"}'
    (offer,) = Decoder().feed(encode(m.CheckpointOffer(step=1, manifest=manifest)))
    assert type(offer.manifest) is bytes and offer.manifest == manifest


def test_buffered_api_refuses_what_feed_refuses():
    dec = Decoder(max_frame_size=100)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        _buffered(dec, (101).to_bytes(4, "big"), 4)
    with pytest.raises(RemoteProtocolError, match="exceeds"):  # poisoned
        dec.get_buffer()
    bad = msgpack.packb([PROTOCOL_VERSION, m.Probe.TYPE, 0, {"data": b"x" * 300, "want": -1}], use_bin_type=True)
    with pytest.raises(RemoteProtocolError, match="want"):
        _buffered(Decoder(bulk_min=1), len(bad).to_bytes(4, "big") + bad, 64)


def test_a_framed_sparse_part_with_repeated_indices_is_refused_naming_the_chunk():
    """A sparse part as a peer sends it (split into frames, decoded, reassembled) whose second
    chunk lists an index twice: the frames are fine, the tensor is refused at decode."""
    import torch

    from protocol import EncodedTensor, TensorAssembler, decode_tensor, make_codec, split
    from protocol.sparse import _pack

    enc = make_codec("sparse", density=0.05, bits=2, chunk=64).encode(torch.randn(128))  # rows of 12 bytes: 4 values
    payload = bytearray(enc.payload)
    payload[12 + 8 : 12 + 11] = _pack(torch.tensor([[1, 1, 2, 3]]), 6).numpy().tobytes()
    parts = split(EncodedTensor(enc.dtype, enc.shape, enc.codec, bytes(payload), enc.params), "w", chunk_size=7)
    asm, out = TensorAssembler(), None
    for msg in Decoder().feed(b"".join(encode(p) for p in parts)):
        out = asm.add(msg)
    assert out is not None and out.codec == "sparse"
    with pytest.raises(RemoteProtocolError, match="sparse chunk 1: indices not strictly increasing") as e:
        decode_tensor(out)
    assert e.value.field == "payload"
