"""Wire messages: frozen dataclasses that validate themselves, and the registry of type codes.

Every message validates its fields on construction (a bad value from our own code raises
`LocalProtocolError`) and on decode (a bad value from a peer raises `RemoteProtocolError`
naming the field). Unknown fields in a decoded message are ignored, so later versions can add
optional fields; unknown type codes are refused.

The one place to import messages from: importing it registers every family, so `REGISTRY`
(what framing.py decodes with) is complete. Where each part lives:
    schema.py     `Message`, the per-annotation field checks, `message` (the class decorator
                  that registers a type code) and `REGISTRY`
    session.py    Hello, Error, Ping, Pong, Ack, MemberProof; Register, Heartbeat, Deregister,
                  RoleAssignment (membership)
    bulk.py       TensorPart, StateRequest, StateChunk, Probe, DirectOpen, DirectAddress;
                  CheckpointQuery, CheckpointManifest, CheckpointOffer
    averaging.py  AvgJoin, AvgGroup, AvgReport, AvgDecision, AvgDecisionQuery
    calls.py      StageCall, StageResult (pipeline stages), ExpertCall, ExpertResult (experts)
"""

# the families in the order they register their type codes
from .schema import MAX_ID_LEN, REGISTRY, Checker, Message, Params, Scalar, message
from .session import ERROR_CODES, ROLES, Ack, Deregister, Error, Heartbeat, Hello, MemberProof, Ping, Pong, Register, RoleAssignment
from .bulk import (
    MAX_DIRECT_ADDRS, MAX_MANIFEST_BYTES, MAX_PROBE_BYTES, MAX_TENSOR_NDIM, TENSOR_DTYPES, CheckpointManifest, CheckpointOffer,
    CheckpointQuery, DirectAddress, DirectOpen, Probe, StateChunk, StateRequest, TensorPart,
)
from .averaging import AVG_PHASES, DEFAULT_NAMESPACE, GROUP_STATUS, MAX_GROUP, AvgDecision, AvgDecisionQuery, AvgGroup, AvgJoin, AvgReport
from .calls import (
    EXPERT_OPS, MAX_BUNDLE_TENSORS, MAX_CALL_EXPERTS, MAX_DEADLINE_S, MAX_ROUTE, STAGE_OPS, ExpertCall, ExpertResult, StageCall,
    StageResult,
)
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "AVG_PHASES", "Ack", "AvgDecision", "AvgDecisionQuery", "AvgGroup", "AvgJoin", "AvgReport", "CheckpointManifest",
    "CheckpointOffer", "CheckpointQuery", "Checker", "DEFAULT_NAMESPACE", "Deregister", "DirectAddress", "DirectOpen",
    "ERROR_CODES", "EXPERT_OPS", "Error", "ExpertCall", "ExpertResult", "GROUP_STATUS", "Heartbeat", "Hello",
    "LocalProtocolError", "MAX_BUNDLE_TENSORS", "MAX_CALL_EXPERTS", "MAX_DEADLINE_S", "MAX_DIRECT_ADDRS", "MAX_GROUP",
    "MAX_ID_LEN", "MAX_MANIFEST_BYTES", "MAX_PROBE_BYTES", "MAX_ROUTE", "MAX_TENSOR_NDIM", "MemberProof", "Message",
    "Params", "Ping", "Pong", "Probe", "REGISTRY", "ROLES", "Register", "RemoteProtocolError", "RoleAssignment", "STAGE_OPS",
    "Scalar", "StageCall", "StageResult", "StateChunk", "StateRequest", "TENSOR_DTYPES", "TensorPart", "message",
]  # fmt: skip
