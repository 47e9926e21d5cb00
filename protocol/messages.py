"""Wire messages: frozen dataclasses that validate themselves, and the registry of type codes.

Every message validates its fields on construction (a bad value from our own code raises
`LocalProtocolError`) and on decode (a bad value from a peer raises `RemoteProtocolError`
naming the field). Unknown fields in a decoded message are ignored, so later versions can add
optional fields; unknown type codes are refused.

Field types understood by the validator: int, float, str, bytes, bool, `X | None`,
`tuple[X, ...]`, `dict[str, X]` and unions of scalars. `bool` is never accepted for `int`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import LocalProtocolError, RemoteProtocolError

Scalar = int | float | str | bool
Params = dict[str, Scalar]

# the registry: type code -> message class
REGISTRY: dict[int, type[Message]] = {}


class _Invalid(Exception):
    """Raised by validators; turned into the right error family by the caller."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


Checker = Callable[[Any, str], Any]
_CHECKERS: dict[Any, Checker] = {}


def _checker(tp: Any) -> Checker:
    """The check of annotation `tp` (it returns the value, coerced: list -> tuple, int -> float),
    built once per annotation (every message is checked on
    construction and on decode: working the annotation out for every value cost about a
    quarter of a stage call's CPU)."""
    fn = _CHECKERS.get(tp)
    if fn is None:
        fn = _CHECKERS[tp] = _compile(tp)
    return fn


def _type_check(tp: type, accepted: tuple[type, ...], coerce: Callable[[Any], Any] | None = None) -> Checker:
    name = tp.__name__

    def check(value: Any, path: str) -> Any:
        if type(value) is tp:  # the common case, first
            return value
        if isinstance(value, bool) and tp is not bool or not isinstance(value, accepted):
            raise _Invalid(path, f"expected {name}, got {type(value).__name__}")
        return value if coerce is None else coerce(value)

    return check


def _bytes_check(value: Any, path: str) -> Any:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise _Invalid(path, f"expected bytes, got {type(value).__name__}")
    if isinstance(value, memoryview) and (value.ndim != 1 or value.format != "B"):
        value = value.cast("B")  # a flat view of the same memory: len() counts bytes
    return value  # not copied: large tensor chunks are framed straight from their buffer


def _compile(tp: Any) -> Checker:
    if tp is Any:
        return lambda value, path: value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        nullable = type(None) in options
        checks = [_checker(o) for o in options if o is not type(None)]
        names = " or ".join("None" if o is type(None) else _type_name(o) for o in options)
        # a value of exactly one of the scalar options passes as it is, as the loop below would
        # pass it; except an int where float comes first (the loop makes it a float)
        exact = {o for o in options if o in (float, str, bool, bytes)}
        if int in options and (float not in options or options.index(int) < options.index(float)):
            exact.add(int)

        def check_union(value: Any, path: str) -> Any:
            if value is None and nullable:
                return None
            if type(value) in exact:
                return value
            for c in checks:
                try:
                    return c(value, path)
                except _Invalid:
                    continue
            raise _Invalid(path, f"expected {names}, got {type(value).__name__}")

        return check_union
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        item = _checker(item_tp)
        plain = item_tp if item_tp in (int, float, str) else None  # taken as they are when every item is exactly that

        def check_tuple(value: Any, path: str) -> Any:
            if not isinstance(value, (list, tuple)):
                raise _Invalid(path, f"expected a list, got {type(value).__name__}")
            if plain is not None and all(type(v) is plain for v in value):
                return tuple(value)
            return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))

        return check_tuple
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        val = _checker(val_tp)

        def check_dict(value: Any, path: str) -> Any:
            if not isinstance(value, dict):
                raise _Invalid(path, f"expected a map, got {type(value).__name__}")
            out = {}
            for k, v in value.items():
                if not isinstance(k, key_tp):
                    raise _Invalid(path, f"map key {k!r} is not {_type_name(key_tp)}")
                out[k] = val(v, f"{path}.{k}")
            return out

        return check_dict
    if tp is bool:
        return _type_check(bool, (bool,))
    if tp is int:
        return _type_check(int, (int,))
    if tp is float:
        return _type_check(float, (int, float), float)
    if tp is str:
        return _type_check(str, (str,))
    if tp is bytes:
        return _bytes_check
    raise TypeError(f"unsupported field annotation {tp!r}")  # our bug, at import time


def _require(cond: bool, field: str, problem: str) -> None:
    if not cond:
        raise _Invalid(field, problem)


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of all wire messages. `request_id` travels in the frame envelope."""

    TYPE: ClassVar[int] = -1
    BULK_FIELDS: ClassVar[tuple[str, ...]] = ()  # bytes fields decoded as views of the frame, not copies
    request_id: int = 0

    def __post_init__(self) -> None:
        try:
            self._coerce_and_check()
        except _Invalid as e:
            raise LocalProtocolError(f"{type(self).__name__}.{e.field}: {e.problem}") from None

    def _coerce_and_check(self) -> None:
        for name, check in _field_checks(type(self)):
            value = getattr(self, name)
            checked = check(value, name)
            if checked is not value:
                object.__setattr__(self, name, checked)
        _require(0 <= self.request_id < 2**63, "request_id", "must be in [0, 2^63)")
        self.validate()

    def validate(self) -> None:
        """Semantic checks beyond types; subclasses override and call `_require`."""

    def with_request_id(self, request_id: int) -> Message:
        """This message under another request id: a copy, not checked again (its fields were)."""
        if request_id == self.request_id:
            return self
        if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id < 2**63:
            raise LocalProtocolError(f"{type(self).__name__}.request_id: must be an int in [0, 2^63)")
        out = copy.copy(self)
        object.__setattr__(out, "request_id", request_id)
        return out

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "request_id"}

    @classmethod
    def from_fields(cls, fields: dict[str, Any], request_id: int) -> Message:
        """Build from decoded wire fields; unknown fields ignored; raises RemoteProtocolError."""
        known = {}
        for name, required in _wire_fields(cls):
            if name in fields:
                known[name] = fields[name]
            elif required:
                raise RemoteProtocolError("required field is missing", f"{cls.__name__}.{name}")
        try:
            return cls(request_id=request_id, **known)
        except LocalProtocolError as e:
            raise RemoteProtocolError(str(e)) from None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


_FIELD_CHECKS: dict[type, list[tuple[str, Checker]]] = {}
_WIRE_FIELDS: dict[type, list[tuple[str, bool]]] = {}


def _field_checks(cls: type) -> list[tuple[str, Checker]]:
    """Each field of a message class with its check (worked out once per class)."""
    checks = _FIELD_CHECKS.get(cls)
    if checks is None:
        hints = _hints(cls)
        checks = _FIELD_CHECKS[cls] = [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]
    return checks


def _wire_fields(cls: type) -> list[tuple[str, bool]]:
    """The fields a message of `cls` carries on the wire, each with whether it is required."""
    out = _WIRE_FIELDS.get(cls)
    if out is None:
        out = _WIRE_FIELDS[cls] = [
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls) if f.name != "request_id"
        ]
    return out


def message(code: int):
    """Class decorator: make a frozen kw-only dataclass and register it under `code`."""

    def wrap(cls):
        cls = dataclass(frozen=True, kw_only=True)(cls)
        if code in REGISTRY:
            raise TypeError(f"type code {code} used by {REGISTRY[code].__name__} and {cls.__name__}")
        cls.TYPE = code
        REGISTRY[code] = cls
        _hints(cls)  # fail at import time on an unsupported annotation
        for f in dataclasses.fields(cls):
            _check_annotation(_hints(cls)[f.name], f"{cls.__name__}.{f.name}")
        return cls

    return wrap


def _check_annotation(tp: Any, where: str) -> None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, tuple, dict):
        for arg in typing.get_args(tp):
            if arg is not Ellipsis and arg is not type(None):
                _check_annotation(arg, where)
    elif tp not in (int, float, str, bytes, bool, Any):
        raise TypeError(f"unsupported field annotation {tp!r} in {where}")


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


MAX_ID_LEN = 256


# ---------------------------------------------------------------------------------------------
# Session


@message(1)
class Hello(Message):
    """First message on a connection, both ways: who I am and what I want to do."""

    peer_id: str
    swarm_id: str
    software: str = ""
    roles: tuple[str, ...] = ()
    token: bytes | None = None  # a signed join token, for private swarms

    def validate(self) -> None:
        _require(0 < len(self.peer_id) <= MAX_ID_LEN, "peer_id", "must be 1..256 characters")
        _require(len(self.swarm_id) <= MAX_ID_LEN, "swarm_id", "must be at most 256 characters")


ERROR_CODES = ("bad_request", "unauthorized", "overloaded", "not_found", "timeout", "internal", "unsupported")


@message(2)
class Error(Message):
    """A refusal or failure; `request_id` is the request it answers."""

    code: str
    message: str = ""

    def validate(self) -> None:
        _require(self.code in ERROR_CODES, "code", f"must be one of {', '.join(ERROR_CODES)}")


@message(3)
class Ping(Message):
    nonce: int = 0
    sent_at: float = 0.0  # sender's clock, seconds since the epoch


@message(4)
class Pong(Message):
    nonce: int = 0
    sent_at: float = 0.0  # echoed from the ping


@message(5)
class Ack(Message):
    """A generic positive reply; `info` carries small optional details."""

    info: Params = dataclasses.field(default_factory=dict)


@message(9)
class MemberProof(Message):
    """In an owned swarm, a caller's first message to a peer (and after each renewal): its
    membership certificate, signed by the swarm's owner. The peer serves nothing else of the
    caller's before one checks out; answered with Ack, or `unauthorized` and why."""

    certificate: bytes

    def validate(self) -> None:
        _require(0 < len(self.certificate) <= 2048, "certificate", "1..2048 bytes")


# ---------------------------------------------------------------------------------------------
# Membership


@message(10)
class Register(Message):
    """A node asks the coordinator for membership and a role."""

    peer_id: str
    maddrs: tuple[str, ...] = ()
    capabilities: Params = dataclasses.field(default_factory=dict)  # device, memory_gb, tflops, up/down mbps
    token: bytes | None = None
    wanted_role: str | None = None

    def validate(self) -> None:
        _require(0 < len(self.peer_id) <= MAX_ID_LEN, "peer_id", "must be 1..256 characters")
        _require(len(self.maddrs) <= 64, "maddrs", "at most 64 addresses")


@message(11)
class Heartbeat(Message):
    """Periodic liveness report; the reply is a RoleAssignment (the current one, or a new one)."""

    peer_id: str
    step: int = 0
    loss: float | None = None
    samples_per_second: float | None = None
    state_hash: str | None = None
    # the work samples_per_second was measured at ("stage:2"); "": the current assignment's.
    # A rate reported for other work than the coordinator now assigns is not stored
    measured_as: str = ""

    def validate(self) -> None:
        _require(0 < len(self.peer_id) <= MAX_ID_LEN, "peer_id", "must be 1..256 characters")
        _require(len(self.measured_as) <= MAX_ID_LEN, "measured_as", "at most 256 characters")
        _require(self.step >= 0, "step", "must be >= 0")
        _require(_finite(self.loss), "loss", "must be finite")
        _require(_finite(self.samples_per_second), "samples_per_second", "must be finite")


@message(12)
class Deregister(Message):
    peer_id: str
    reason: str = ""


ROLES = ("replica", "stage", "expert", "trainer", "idle")


@message(13)
class RoleAssignment(Message):
    """The coordinator's answer to Register / Heartbeat: what this peer should do, and why."""

    peer_id: str
    role: str
    stage: int | None = None
    expert: str | None = None
    epoch: int = 0  # bumps whenever the plan changes
    reason: str = ""
    config: bytes = b""  # the run's training configuration (JSON), the same for every member
    certificate: bytes = b""  # an owned swarm's: this peer's membership certificate (protocol/tokens.py), new or renewed

    @property
    def label(self) -> str:
        """How member records name this work (protocol/records.py `role_label`)."""
        from .records import role_label

        return role_label(self.role, self.stage if self.stage is not None else self.expert)

    def validate(self) -> None:
        _require(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}")
        _require(len(self.config) <= 65536, "config", "at most 64 KiB")
        _require(len(self.certificate) <= 2048, "certificate", "at most 2048 bytes")
        _require(self.stage is None or self.stage >= 0, "stage", "must be >= 0")


# ---------------------------------------------------------------------------------------------
# Bulk data

MAX_TENSOR_NDIM = 8
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@message(20)
class TensorPart(Message):
    """One chunk of an encoded tensor. Every part repeats the small header so any part can be
    checked on its own; `offset`/`total_size` locate `data` inside the codec payload."""

    BULK_FIELDS = ("data",)

    key: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: Params = dataclasses.field(default_factory=dict)
    index: int = 0
    count: int = 1
    offset: int = 0
    total_size: int = 0
    data: bytes = b""

    def validate(self) -> None:
        _require(len(self.key) <= MAX_ID_LEN, "key", "must be at most 256 characters")
        _require(self.dtype in TENSOR_DTYPES, "dtype", f"unknown dtype {self.dtype!r}")
        _require(len(self.shape) <= MAX_TENSOR_NDIM, "shape", f"at most {MAX_TENSOR_NDIM} dimensions")
        _require(all(d >= 0 for d in self.shape), "shape", "dimensions must be >= 0")
        _require(self.count >= 1, "count", "must be >= 1")
        _require(0 <= self.index < self.count, "index", "must be in [0, count)")
        _require(self.total_size >= 0, "total_size", "must be >= 0")
        _require(0 <= self.offset <= self.total_size, "offset", "must be in [0, total_size]")
        _require(self.offset + len(self.data) <= self.total_size, "data", "runs past total_size")


@message(21)
class StateRequest(Message):
    """Ask for a byte range of a named state blob (a checkpoint file, a replica's state)."""

    name: str
    offset: int = 0
    length: int = 0  # 0: to the end

    def validate(self) -> None:
        _require(len(self.name) <= 1024, "name", "must be at most 1024 characters")
        _require(self.offset >= 0, "offset", "must be >= 0")
        _require(self.length >= 0, "length", "must be >= 0")


@message(22)
class StateChunk(Message):
    """A byte range of a named state blob; `sha256` is the hex digest of the whole blob."""

    BULK_FIELDS = ("data",)

    name: str
    offset: int
    total_size: int
    sha256: str
    data: bytes = b""

    def validate(self) -> None:
        _require(self.total_size >= 0, "total_size", "must be >= 0")
        _require(0 <= self.offset <= self.total_size, "offset", "must be in [0, total_size]")
        _require(self.offset + len(self.data) <= self.total_size, "data", "runs past total_size")
        _require(
            len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256),
            "sha256",
            "must be 64 lowercase hex digits",
        )


MAX_PROBE_BYTES = 8 << 20


@message(6)
class Probe(Message):
    """Bandwidth probe: the receiver answers with a Probe carrying `want` bytes."""

    BULK_FIELDS = ("data",)

    data: bytes = b""
    want: int = 0

    def validate(self) -> None:
        _require(0 <= self.want <= MAX_PROBE_BYTES, "want", f"must be in [0, {MAX_PROBE_BYTES}]")


MAX_DIRECT_ADDRS = 16


@message(7)
class DirectOpen(Message):
    """Sent over libp2p before a direct connection (plain TCP, records sealed with `key`, see
    `protocol/sealing.py`): the dialer presents `ticket` first on the connection, and the
    listener serves it as a stream from the peer that sent this message."""

    ticket: bytes
    key: bytes

    def validate(self) -> None:
        _require(len(self.ticket) == 16, "ticket", "must be 16 bytes")
        _require(len(self.key) == 32, "key", "must be 32 bytes (an AES-256 key)")


@message(8)
class DirectAddress(Message):
    """The reply to DirectOpen: where to connect ("host:port", most likely first)."""

    addrs: tuple[str, ...] = ()

    def validate(self) -> None:
        _require(len(self.addrs) <= MAX_DIRECT_ADDRS, "addrs", f"at most {MAX_DIRECT_ADDRS}")
        for a in self.addrs:
            host, sep, port = a.rpartition(":")
            _require(bool(sep and host) and len(a) <= 64 and port.isdigit() and 0 < int(port) < 65536, "addrs", f"not host:port: {a[:64]!r}")


# ---------------------------------------------------------------------------------------------
# Checkpoints


MAX_MANIFEST_BYTES = 1 << 20


@message(30)
class CheckpointQuery(Message):
    """Ask for a checkpoint's manifest: a given step, or the latest (`step` None); of a pipeline
    stage's checkpoints (`stage`) where the peer keeps them per stage (the coordinator)."""

    step: int | None = None
    stage: int | None = None

    def validate(self) -> None:
        _require(self.stage is None or self.stage >= 0, "stage", "must be >= 0")


@message(31)
class CheckpointManifest(Message):
    """A checkpoint's manifest (JSON bytes: files with sha256 and size, step, model config)."""

    step: int
    manifest: bytes

    def validate(self) -> None:
        _require(self.step >= 0, "step", "must be >= 0")
        _require(len(self.manifest) <= MAX_MANIFEST_BYTES, "manifest", f"at most {MAX_MANIFEST_BYTES} bytes")


@message(32)
class CheckpointOffer(Message):
    """Start of an upload: the manifest, then StateChunk frames (name = file name) for every
    file in it, in manifest order. The reply is an Ack once every hash has been checked."""

    step: int
    manifest: bytes

    def validate(self) -> None:
        _require(self.step >= 0, "step", "must be >= 0")
        _require(len(self.manifest) <= MAX_MANIFEST_BYTES, "manifest", f"at most {MAX_MANIFEST_BYTES} bytes")


# ---------------------------------------------------------------------------------------------
# Averaging (all-reduce among the peers that average the same key)

MAX_GROUP = 256
DEFAULT_NAMESPACE = "avg"  # the averager namespace of a join that names none
AVG_PHASES = ("scatter", "gather")
GROUP_STATUS = ("group", "redirect", "closed")


@message(40)
class AvgJoin(Message):
    """Ask a would-be group leader to take us into the group for `round_key`. Long poll: the
    reply comes when the group is formed (or we are redirected / too late)."""

    round_key: str
    numel: int  # elements of the flattened vector to average; all members must agree
    weight: float = 1.0  # e.g. samples processed since the last round
    bandwidth: float = 0.0  # bytes/s this peer can move; sizes its slice
    codec: str = "none"
    namespace: str = DEFAULT_NAMESPACE  # which of the receiver's averagers this is for (e.g. "replicas", "stage-2")
    # only ask: do not take us in, answer at once whether this key is averaged there (a
    # redirect to its leader), over there ("closed"), or not (yet) known there
    ask_only: bool = False

    def validate(self) -> None:
        _require(0 < len(self.round_key) <= MAX_ID_LEN, "round_key", "must be 1..256 characters")
        _require(len(self.namespace) <= 64, "namespace", "must be at most 64 characters")
        _require(self.numel > 0, "numel", "must be > 0")
        _require(math.isfinite(self.weight) and self.weight > 0, "weight", "must be finite and > 0")
        _require(math.isfinite(self.bandwidth) and self.bandwidth >= 0, "bandwidth", "must be finite and >= 0")


@message(41)
class AvgGroup(Message):
    """The leader's answer: the formed group (members in order, slice bounds), a redirect to
    another leader, or 'closed' (the group formed without you: try the next round)."""

    status: str
    group_id: str = ""
    members: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    bounds: tuple[int, ...] = ()  # slice i of the flat vector is [bounds[i], bounds[i+1])
    codec: str = "none"
    codec_params: Params = dataclasses.field(default_factory=dict)
    gather_codec: str = "none"
    deadline_s: float = 0.0  # seconds the scatter phase may take, derived from measured bandwidth
    redirect: str = ""
    reason: str = ""

    def validate(self) -> None:
        _require(self.status in GROUP_STATUS, "status", f"must be one of {', '.join(GROUP_STATUS)}")
        if self.status != "group":
            return
        n = len(self.members)
        _require(1 <= n <= MAX_GROUP, "members", f"must have 1..{MAX_GROUP} members")
        _require(len(set(self.members)) == n, "members", "must be distinct")
        _require(len(self.weights) == n, "weights", "one per member")
        _require(all(math.isfinite(w) and w > 0 for w in self.weights), "weights", "must be finite and > 0")
        _require(len(self.bounds) == n + 1, "bounds", "must have len(members) + 1 entries")
        _require(self.bounds[0] == 0 and all(a <= b for a, b in zip(self.bounds, self.bounds[1:])), "bounds", "must rise from 0")
        _require(math.isfinite(self.deadline_s) and self.deadline_s > 0, "deadline_s", "must be > 0")


@message(42)
class AvgReport(Message):
    """A member tells the leader how a phase went for it: whom it received valid parts from,
    and whom it blames (with reasons). The reply is the leader's AvgDecision."""

    group_id: str
    phase: str
    ok: bool = True
    received_from: tuple[str, ...] = ()
    blamed: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    def validate(self) -> None:
        _require(self.phase in AVG_PHASES, "phase", f"must be one of {', '.join(AVG_PHASES)}")
        _require(len(self.blamed) == len(self.reasons), "reasons", "one per blamed peer")
        _require(len(self.received_from) <= MAX_GROUP and len(self.blamed) <= MAX_GROUP, "received_from", "too many peers")


@message(43)
class AvgDecision(Message):
    """The leader's decision after a phase. After "scatter": who survives and who owns each
    slice now. After "gather": commit (apply the result) or abort (everyone keeps inputs)."""

    group_id: str
    phase: str
    commit: bool
    survivors: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()  # owner of each slice after failed members' slices were re-owned
    reason: str = ""

    def validate(self) -> None:
        _require(self.phase in AVG_PHASES, "phase", f"must be one of {', '.join(AVG_PHASES)}")


@message(44)
class AvgDecisionQuery(Message):
    """Ask any member for a decision it holds (when the leader cannot be reached)."""

    group_id: str
    phase: str

    def validate(self) -> None:
        _require(self.phase in AVG_PHASES, "phase", f"must be one of {', '.join(AVG_PHASES)}")


# ---------------------------------------------------------------------------------------------
# Pipeline stages (a trainer's calls to a stage server)

STAGE_OPS = ("forward", "backward", "train", "through", "norms")
MAX_ROUTE = 64  # stages after the called one a `through` call may name


def _norms2_ok(norms2: tuple[float, ...]) -> bool:
    return len(norms2) <= MAX_ROUTE + 1 and all(v == -1 or (math.isfinite(v) and v >= 0) for v in norms2)
MAX_DEADLINE_S = 3600.0
MAX_BUNDLE_TENSORS = 4


def _check_bundle(msg: Message, max_tensors: int = MAX_BUNDLE_TENSORS) -> None:
    """A few encoded tensors in one message: a header per tensor (name, dtype, codec, nbytes, and
    the codec's params as `p.<name>`), its shape, and the payloads one after another in `data`."""
    n = len(msg.tensors)
    _require(n <= max_tensors, "tensors", f"at most {max_tensors}")
    _require(len(msg.shapes) == n, "shapes", "one per tensor")
    total, names = 0, set()
    for i, (head, shape) in enumerate(zip(msg.tensors, msg.shapes)):
        name, dtype, codec, nbytes = head.get("name"), head.get("dtype"), head.get("codec"), head.get("nbytes")
        _require(isinstance(name, str) and 0 < len(name) <= 64 and name not in names, f"tensors[{i}].name", "must be a distinct name of 1..64 characters")
        names.add(name)
        _require(dtype in TENSOR_DTYPES, f"tensors[{i}].dtype", f"unknown dtype {dtype!r}")
        _require(isinstance(codec, str) and 0 < len(codec) <= 32, f"tensors[{i}].codec", "must be a codec name")
        _require(isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0, f"tensors[{i}].nbytes", "must be an int >= 0")
        _require(len(shape) <= MAX_TENSOR_NDIM and all(d >= 0 for d in shape), f"shapes[{i}]", f"at most {MAX_TENSOR_NDIM} dimensions, each >= 0")
        total += nbytes
    _require(total == len(msg.data), "data", f"carries {len(msg.data)} bytes, the headers declare {total}")


@message(50)
class StageCall(Message):
    """A trainer's call to a stage server, for one micro-batch.
    - forward: tensor `x` (the stage's input) in; the stage's output `y` back.
    - backward: `x` again and `grad` (of the stage's output) in; the server recomputes forward from
      `x`, accumulates its parameters' gradients and sends back `grad` of `x` (none for the first
      stage, whose input is token ids).
    - train (the last stage): `x` and `targets` (token ids) in; forward, loss and backward in one
      call: the `loss` and `grad` of `x` back.
    - through: `x` and `targets` in, and the rest of the micro-batch's way: `route`, the peer
      to call for each later stage, and `deadlines`, how long each of those calls may take. The
      server runs its forward, calls `route[0]` with the rest of the way, runs its backward with
      the gradient that comes back and answers the `loss`, `grad` of `x` and every stage's
      `times`; the last stage does what `train` does. Activations go stage to stage, not through
      the trainer.
    - norms: no tensors, only `norms2`: a synchronous trainer's word, once a step's micro-batches
      all came back, of every stage's norm of that step; a stage whose step is due takes it
      then, rather than when the next micro-batch reaches it (so stages step side by side).
    Every call may carry `norms2`: for each stage of the cut, the squared norm of its gradient
    at its latest step as the caller last heard it (-1: not heard). A stage clips its next step
    by the norm of all of them together (one global clip, as one process clips the model's);
    a through call hands them on."""

    BULK_FIELDS = ("data",)

    stage: int
    op: str
    micro_batch: str = ""  # the trainer's name for the micro-batch (logs)
    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    route: tuple[str, ...] = ()
    deadlines: tuple[float, ...] = ()
    norms2: tuple[float, ...] = ()

    def validate(self) -> None:
        _require(self.stage >= 0, "stage", "must be >= 0")
        _require(_norms2_ok(self.norms2), "norms2", f"at most {MAX_ROUTE + 1}, each -1 or a finite value >= 0")
        _require(self.op in STAGE_OPS, "op", f"must be one of {', '.join(STAGE_OPS)}")
        _require(len(self.micro_batch) <= MAX_ID_LEN, "micro_batch", "at most 256 characters")
        _require(len(self.route) <= MAX_ROUTE, "route", f"at most {MAX_ROUTE} peers")
        _require(self.op == "through" or not self.route, "route", f"only a through call names a route, not {self.op}")
        _require(self.op != "norms" or (self.norms2 and not self.tensors), "norms2", "a norms call carries norms2 and no tensors")
        _require(all(0 < len(p) <= MAX_ID_LEN for p in self.route), "route", "peer ids of 1..256 characters")
        _require(len(self.deadlines) == len(self.route), "deadlines", "one per peer of the route")
        _require(all(0 < d <= MAX_DEADLINE_S for d in self.deadlines), "deadlines", f"seconds in (0, {MAX_DEADLINE_S:.0f}]")
        _check_bundle(self)


@message(51)
class StageResult(Message):
    """A stage server's answer to a StageCall: tensors (`y` or `grad`), and the loss of a train
    call. A through call's answer also carries `times`: the seconds each stage from the called
    one on spent on the micro-batch itself (queue and compute, not the calls after it). Where a
    later stage's call failed, the answer names that stage and peer (`failed_stage`, `failed`)
    and why, and carries nothing else: the trainer sends the micro-batch again another way.
    `norms2` and `norm_steps` (like `times`, one per stage from the called one on): the squared
    norm of the stage's gradient at its latest step that was due, and how many steps were due
    there until then (0 and -1: none yet); callers hand the norms on in their next calls."""

    BULK_FIELDS = ("data",)

    loss: float | None = None
    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    times: tuple[float, ...] = ()
    failed: str = ""
    failed_stage: int = 0
    reason: str = ""
    norms2: tuple[float, ...] = ()
    norm_steps: tuple[int, ...] = ()

    def validate(self) -> None:
        _require(_finite(self.loss), "loss", "must be finite")
        _require(_norms2_ok(self.norms2), "norms2", f"at most {MAX_ROUTE + 1}, each -1 or a finite value >= 0")
        _require(len(self.norm_steps) == len(self.norms2) and all(n >= 0 for n in self.norm_steps), "norm_steps", "one count >= 0 per value of norms2")
        _require(len(self.times) <= MAX_ROUTE + 1 and all(0 <= t <= MAX_DEADLINE_S for t in self.times), "times", f"at most {MAX_ROUTE + 1}, each in [0, {MAX_DEADLINE_S:.0f}] seconds")
        _require(len(self.failed) <= MAX_ID_LEN, "failed", "at most 256 characters")
        _require(len(self.reason) <= 1024, "reason", "at most 1024 characters")
        _require(self.failed_stage >= 0, "failed_stage", "must be >= 0")
        _require(not self.failed or not self.tensors, "tensors", "a failed through call carries none")
        _check_bundle(self)


# ---------------------------------------------------------------------------------------------
# Experts (a trainer's calls to an expert host)

EXPERT_OPS = ("forward", "backward", "commit")
MAX_CALL_EXPERTS = 64  # experts one call may address (tensors: two per expert at most)


@message(52)
class ExpertCall(Message):
    """A trainer's call to an expert host for one micro-batch of one MoE layer: every expert of
    the host that tokens were routed to, in one call. Tensors are named by expert:
    - forward: `x:<expert>` (its tokens, (n, C)) in; `y:<expert>` back. The host keeps the graph.
    - backward: `grad:<expert>` (of its output) in, and `x:<expert>` again when the host may not
      hold the forward's graph (it recomputes); `grad:<expert>` of the input back, and `norm2`,
      the squared norm of the gradient of the experts' parameters. The host holds that gradient
      until the commit.
    - commit: after the micro-batch's whole backward, its global gradient clip (`scale`: the
      trainer's clip coefficient over every part of the model, 0: drop the gradients, e.g. a
      non-finite norm). `micro_batch` names the micro-batch (no layer); no tensors. The host adds
      the held gradients times `scale` and steps its optimizer when a step is due."""

    BULK_FIELDS = ("data",)

    op: str
    micro_batch: str = ""  # the trainer's name for the micro-batch and layer (keys a kept graph)
    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    scale: float | None = None  # commit only

    def validate(self) -> None:
        _require(self.op in EXPERT_OPS, "op", f"must be one of {', '.join(EXPERT_OPS)}")
        _require(0 < len(self.micro_batch) <= MAX_ID_LEN, "micro_batch", "1..256 characters")
        if self.op == "commit":
            _require(self.scale is not None and math.isfinite(self.scale) and 0.0 <= self.scale <= 1.0, "scale", "a commit's scale must be in [0, 1]")
            _require(not self.tensors, "tensors", "a commit carries none")
        else:
            _require(self.scale is None, "scale", f"only a commit carries one, not a {self.op}")
        _check_bundle(self, 2 * MAX_CALL_EXPERTS)


@message(53)
class ExpertResult(Message):
    """An expert host's answer to an ExpertCall: `y:<expert>` or `grad:<expert>` per expert;
    a backward's answer has `norm2` too (see ExpertCall), a commit's nothing."""

    BULK_FIELDS = ("data",)

    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    norm2: float | None = None

    def validate(self) -> None:
        _require(self.norm2 is None or (math.isfinite(self.norm2) and self.norm2 >= 0.0), "norm2", "must be finite and >= 0")
        _check_bundle(self, 2 * MAX_CALL_EXPERTS)
