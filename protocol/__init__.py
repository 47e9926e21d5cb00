"""swarmtrain's wire protocol, sans-IO: bytes in, messages out. No sockets, no event loop.

Files:
    errors.py      RemoteProtocolError (a peer's bad input) vs LocalProtocolError (our bug)
    messages.py    every wire message and the registry of type codes: import them from here
    schema.py      `Message` (frozen, self-validating dataclasses), its field checks, the registry
    session.py     hello, errors, pings, acks, membership proofs; registration, heartbeats, roles
    bulk.py        tensor chunks, state blobs, bandwidth probes, direct connections, checkpoints
    averaging.py   group joins, the leader's answers, members' reports and the leader's decisions
    calls.py       a trainer's calls to pipeline stages and expert hosts, and their answers
    framing.py     encode(msg) -> bytes; Decoder.feed(bytes) -> [msg]; frame size cap
    tensors.py     EncodedTensor, dtype tables, chunking into TensorPart and reassembly
    codecs.py      none / fp16 / int8 / topk / powersgd codecs, decode_tensor, ErrorFeedback
    sparse.py      the sparse codec: chunked top-k with low-bit values (registered by codecs.py)
    signatures.py  Ed25519 keys (0600 PEM files), sign/verify over a canonical tuple encoding
    tokens.py      signed join tokens for private swarms, verification with a reason
    records.py     signed DHT records: where the coordinator is, who is a member
    manifest.py    checkpoint manifests: validation, canonical signed tuple, JSON form, dir names
    sealing.py     AES-GCM sealed records for direct connections (the bulk data plane)
"""

import importlib

# Each submodule loads when one of its names is first used (`from protocol import Hello`), not
# when the package does: keys, tokens and messages then come without numpy and torch (which
# framing, tensors and codecs import), as the CLIs' checks before the daemons load need.
_EXPORTS = {
    "errors": ("LocalProtocolError", "ProtocolError", "RemoteProtocolError"),
    "framing": ("DEFAULT_MAX_FRAME_SIZE", "PROTOCOL_VERSION", "Decoder", "encode"),
    "messages": (
        "REGISTRY", "Ack", "AvgDecision", "AvgDecisionQuery", "AvgGroup", "AvgJoin", "AvgReport", "CheckpointManifest",
        "CheckpointOffer", "CheckpointQuery", "Deregister", "DirectAddress", "DirectOpen", "Error", "Heartbeat", "Hello",
        "MemberProof", "Message", "Ping", "Pong", "Probe", "Register", "RoleAssignment", "StageCall", "StageResult", "StateChunk",
        "StateRequest", "TensorPart",
    ),
    "signatures": ("KeyFileError", "SigningKey", "canonical", "verify"),
    "tokens": ("JoinToken", "MemberCertificate", "TokenCheck", "issue_certificate", "issue_token", "verify_certificate", "verify_token"),
    "codecs": ("Codec", "ErrorFeedback", "decode_tensor", "make_codec"),
    "tensors": ("EncodedTensor", "TensorAssembler", "pack_tensors", "split", "unpack_tensors"),
}  # fmt: skip
_LAZY = {name: module for module, names in _EXPORTS.items() for name in (module, *names)}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = module if name == _LAZY[name] else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = sorted(_LAZY)
