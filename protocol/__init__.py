"""swarmtrain's wire protocol, sans-IO: bytes in, messages out. No sockets, no event loop.

Files:
    errors.py      RemoteProtocolError (a peer's bad input) vs LocalProtocolError (our bug)
    messages.py    frozen, self-validating message dataclasses and the registry of type codes
    framing.py     encode(msg) -> bytes; Decoder.feed(bytes) -> [msg]; frame size cap
    tensors.py     EncodedTensor, dtype tables, chunking into TensorPart and reassembly
    codecs.py      none / fp16 / int8 / topk / powersgd codecs, decode_tensor, ErrorFeedback
    signatures.py  Ed25519 keys (0600 PEM files), sign/verify over a canonical tuple encoding
    tokens.py      signed join tokens for private swarms, verification with a reason
    records.py     signed DHT records: where the coordinator is, who is a member
    manifest.py    checkpoint manifests: validation, canonical signed tuple, JSON form, dir names
    sealing.py     AES-GCM sealed records for direct connections (the bulk data plane)
"""

from .codecs import Codec, ErrorFeedback, decode_tensor, make_codec
from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from .framing import DEFAULT_MAX_FRAME_SIZE, PROTOCOL_VERSION, Decoder, encode
from .messages import (
    REGISTRY,
    Ack,
    AvgDecision,
    AvgDecisionQuery,
    AvgGroup,
    AvgJoin,
    AvgReport,
    CheckpointManifest,
    CheckpointOffer,
    CheckpointQuery,
    Deregister,
    DirectAddress,
    DirectOpen,
    Error,
    Heartbeat,
    Hello,
    Message,
    Ping,
    Pong,
    Probe,
    Register,
    RoleAssignment,
    StageCall,
    StageResult,
    StateChunk,
    StateRequest,
    TensorPart,
)
from .signatures import KeyFileError, SigningKey, canonical, verify
from .tensors import EncodedTensor, TensorAssembler, pack_tensors, split, unpack_tensors
from .tokens import JoinToken, TokenCheck, issue_token, verify_token

__all__ = [name for name in dir() if not name.startswith("_")]
