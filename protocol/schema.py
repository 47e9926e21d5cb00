"""The machinery of wire messages: the `Message` base, the checks of its fields, the registry.

Every message validates its fields on construction (a bad value from our own code raises
`LocalProtocolError`) and on decode (a bad value from a peer raises `RemoteProtocolError`
naming the field). Unknown fields in a decoded message are ignored, so later versions can add
optional fields; unknown type codes are refused.

Field types understood by the validator: int, float, str, bytes, bool, `X | None`,
`tuple[X, ...]`, `dict[str, X]` and unions of scalars. `bool` is never accepted for `int`.

The messages themselves are in session.py, bulk.py, averaging.py and calls.py; import them from
messages.py, which loads every family (REGISTRY is complete only once it has).
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
