"""Typed configs of the node daemon, and how flags, env vars and a TOML file map onto them.

    NodeConfig         everything a node's user sets, each field with its meaning and unit
    AveragerSettings   [averager] table, SWARMTRAIN_AVERAGER_<NAME>: the averaging a user may tune
    TransportSettings  [transport] table, SWARMTRAIN_TRANSPORT_<NAME>: the RPC transport's limits
    load_config        merge defaults, a TOML file, env vars and flags into one config
    check_fields       the check every config runs on construction: type from its hints, then bounds

Precedence: flag > env var > file > default. Every config is a frozen dataclass that checks
itself on construction, so a bad value is refused with one line that names it and where it came
from, before anything starts. This module imports only the standard library (and node/net/relay.py's
address check, itself standard library only): the CLIs read their config before torch and
hivemind load.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .net.relay import relay_maddr_problem


class ConfigError(Exception):
    """A user-supplied setting is wrong; the message names it. `setting`: the field at fault
    (so the loader can say where its value came from), if one is."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


# ---- checks ------------------------------------------------------------------------------------

# A bounds check: what is wrong with a (well-typed) value, e.g. "must be ≥ 1", or None if nothing.
Check = Callable[[Any], "str | None"]


def at_least(lo: int) -> Check:
    return lambda v: None if v >= lo else f"must be ≥ {lo}"


def between(lo: float, hi: float, what: str = "") -> Check:
    return lambda v: None if lo <= v <= hi else f"must be {what or f'in [{lo}, {hi}]'}"


def one_of(*choices: str) -> Check:
    return lambda v: None if v in choices else f"must be one of {', '.join(map(repr, choices))}"


def positive(v: float) -> str | None:  # NaN fails every comparison, so it is refused too
    return None if 0 < v < math.inf else "must be > 0 and finite"


def swarm_id(v: str) -> str | None:
    from protocol.records import swarm_id_problem  # (light: no torch, no hivemind)

    return swarm_id_problem(v)


def record_ttl(v: float, lives: int = 1) -> str | None:
    """A DHT record's lifetime (`lives` times `v`): positive, within what every node keeps."""
    from protocol.records import MAX_RECORD_TTL_S

    return positive(v) or (None if lives * v <= MAX_RECORD_TTL_S else f"must be at most {MAX_RECORD_TTL_S / lives:.0f}" + (f" (a record lives {lives} of them)" if lives > 1 else ""))


def non_negative(v: float) -> str | None:
    return None if 0 <= v < math.inf else "must be ≥ 0 and finite"


def fraction(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def below_one(v: float) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def non_empty(v: str | tuple) -> str | None:
    return None if v else "must not be empty"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type inside `X | None`, True) or (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    tp, _ = _optional(tp)
    if typing.get_origin(tp) is tuple:
        return "a list of str"
    return getattr(tp, "__name__", str(tp))


def _typed(tp: Any, v: Any) -> tuple[bool, Any]:
    """(whether `v` has type `tp`, v as stored: an int where a float is meant becomes a float)."""
    tp, optional = _optional(tp)
    if v is None:
        return optional, v
    if typing.get_origin(tp) is tuple:
        ok = isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v)
        return ok, tuple(v) if ok else v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False, v
        try:
            return True, float(v)
        except OverflowError:  # an int too large for a float
            return False, v
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), v
    return isinstance(v, tp), v


def check_fields(obj: Any, checks: Mapping[str, Check], error: type[ConfigError] = ConfigError) -> None:
    """Check every field of the dataclass `obj` against its type hint, then against its bounds
    check in `checks` (None, "not set", is never bounds-checked). For `__post_init__`."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, stored = _typed(hints[f.name], value)
        if not ok:
            raise error(f"{f.name} must be {_type_name(hints[f.name])}, got {value!r}", f.name)
        if stored is not value:
            object.__setattr__(obj, f.name, stored)
        check = checks.get(f.name)
        problem = check(stored) if check is not None and stored is not None else None
        if problem:
            raise error(f"{f.name} {problem}, got {stored!r}", f.name)


# ---- the node's configs --------------------------------------------------------------------------

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# node/averaging/aggregators.py AGGREGATORS, named here without importing torch (a test keeps them equal)
AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")
# what a Byzantine peer may send (node/roles/attacks.py): a replica in place of its pseudo-gradient,
# a stage server or an expert host in place of the activations and gradients it answers with, or
# ("sync-" and a replica's kind) in place of its pseudo-gradient in its slot's syncs
REPLICA_ATTACKS = ("sign-flip", "scaled", "constant", "noise", "ipm", "stale", "alie", "other-data")
ANSWER_ATTACKS = ("scaled", "noise", "replay", "zero")
SYNC_ATTACKS = tuple(f"sync-{k}" for k in REPLICA_ATTACKS if k != "other-data")  # a slot's peers train on the trainer's data
ATTACKS = tuple(dict.fromkeys(REPLICA_ATTACKS + ANSWER_ATTACKS + SYNC_ATTACKS))
GATHER_CODECS = ("none", "fp16", "int8")  # codecs that can carry averaged slices back


@dataclass(frozen=True)
class AveragerSettings:
    """The averaging settings a user may tune; None: `AveragerConfig`'s own default. The codec
    and the join window are the run's (set on the coordinator); the bandwidth is --bandwidth-mbps."""

    aggregator: str | None = None  # how a slice's owner combines contributions: mean (exact, trusts everyone) | trimmed_mean | centered_clip (both survive some malicious senders)
    trim: int | None = None  # trimmed_mean only: contributions dropped on each side, per value; not set: (group size - 1) // 4
    tau: float | None = None  # centered_clip only: clipping radius around the estimate, in pseudo-gradient units; not set: the group's spread (median distance from the coordinate-wise median)
    gather_codec: str | None = None  # codec of the averaged slices sent back: none | fp16 | int8; not set: the run's codec (fp16 for topk / powersgd)
    min_group_size: int | None = None  # a round left with fewer members than this aborts
    max_abs: float | None = None  # contributions holding a larger absolute value are refused (a poisoning / overflow guard); inf: no limit
    base_timeout_s: float | None = None  # seconds; every phase's deadline is base + slack × its expected transfer time
    timeout_slack: float | None = None  # the factor on a phase's expected transfer time in its deadline
    decision_grace_s: float | None = None  # seconds of extra wait for reports and decisions past a phase's deadline
    pace: bool | None = None  # with a declared --bandwidth-mbps: pace direct sends to it (false: as fast as TCP goes)
    pace_share: float | None = None  # fraction of the declared bandwidth paced sends use, in (0, 1]

    def __post_init__(self) -> None:
        check_fields(self, _AVERAGER_CHECKS)
        for name, aggregator in (("trim", "trimmed_mean"), ("tau", "centered_clip")):
            if getattr(self, name) is not None and self.aggregator != aggregator:
                raise ConfigError(f"{name} applies to aggregator {aggregator!r} only, not {self.aggregator or 'mean'!r}", name)

    def averager_kwargs(self) -> dict[str, Any]:
        """`AveragerConfig` keyword arguments for the settings given; the rest keep its defaults."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("trim", "tau")}
        params = {"trim": self.trim, "tau": self.tau}
        out["aggregator_params"] = {k: v for k, v in params.items() if v is not None}
        return {k: v for k, v in out.items() if v is not None and v != {}}


_AVERAGER_CHECKS: dict[str, Check] = {
    "aggregator": one_of(*AGGREGATORS), "trim": at_least(0), "tau": positive, "gather_codec": one_of(*GATHER_CODECS),
    "min_group_size": at_least(1), "max_abs": lambda v: None if v > 0 else "must be > 0", "base_timeout_s": positive,
    "timeout_slack": non_negative, "decision_grace_s": non_negative, "pace_share": fraction,
}  # fmt: skip


@dataclass(frozen=True)
class TransportSettings:
    """The RPC transport's settings a user may tune; None: `TransportConfig`'s own default."""

    call_timeout_s: float | None = None  # seconds; deadline of an outgoing call that sets none itself
    handler_timeout_s: float | None = None  # seconds; longest a peer's call may run here before it is answered "timeout"
    request_read_timeout_s: float | None = None  # seconds; a peer must deliver each frame of a request within this
    max_concurrent_per_peer: int | None = None  # calls one peer may have open with us at once
    max_bytes_in_flight_per_peer: int | None = None  # bytes of one peer's requests held in memory at once; at least the frame size limit
    ban_score: float | None = None  # a peer whose score falls to this (< 0; a new peer has 0) is refused for ban_s
    ban_s: float | None = None  # seconds of a peer's first ban; each further ban doubles it
    score_window_s: float | None = None  # seconds a penalty counts against a peer (its score recovers with time, never with calls)
    direct_connect_s: float | None = None  # seconds for a whole direct TCP connection attempt
    direct_retry_s: float | None = None  # seconds that a peer's traffic stays on libp2p after a failed direct attempt
    direct_congestion: str | None = None  # TCP congestion control of direct connections (cubic, bbr, ...); "": the kernel's default

    def __post_init__(self) -> None:
        check_fields(self, _TRANSPORT_CHECKS)

    def transport_kwargs(self) -> dict[str, Any]:
        """`TransportConfig` keyword arguments for the settings given; the rest keep its defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


_TRANSPORT_CHECKS: dict[str, Check] = {
    "call_timeout_s": positive, "handler_timeout_s": positive, "request_read_timeout_s": positive,
    "max_concurrent_per_peer": at_least(1), "max_bytes_in_flight_per_peer": at_least(1),
    "ban_score": lambda v: None if -math.inf < v < 0 else "must be < 0 and finite", "ban_s": non_negative,
    "score_window_s": positive, "direct_connect_s": positive, "direct_retry_s": non_negative,
    "direct_congestion": lambda v: None if re.fullmatch(r"[A-Za-z0-9_-]{0,15}", v) else "must be a congestion control name like cubic or bbr",
}  # fmt: skip


@dataclass(frozen=True)
class NodeConfig:
    swarm_id: str = ""  # which swarm to join; records of other swarms are ignored. Empty: the join token's swarm, else DEFAULT_SWARM
    initial_peers: tuple[str, ...] = ()  # multiaddrs of running peers, each with /p2p/<peer id>
    identity: str = ""  # Ed25519 key file (PEM); created if missing so restarts keep the peer id. Default: <data_dir>/identity.pem
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where to listen
    announce_maddrs: tuple[str, ...] = ()  # where others should dial us
    client_mode: bool = False  # accept no inbound connections (behind a NAT or firewall): dial out only, serve no DHT; takes roles that only call out (a pipeline's or experts' trainer)
    relays: tuple[str, ...] = ()  # relays to be reached through when nobody can dial us (behind a NAT): each a relay's multiaddr with /p2p/<its peer id>
    serve_relay: bool = False  # carry streams for peers behind NATs that announce us as their relay
    direct_port: int = 0  # TCP port for bulk transfers over direct sealed TCP (forward it behind NAT); 0: any free port; -1: off, all over libp2p
    device: str = "cpu"  # torch device for training: cpu, cuda, cuda:1, mps
    data_dir: str = "swarmtrain-node"  # working directory for identity, state, logs
    coordinator: str = ""  # coordinator multiaddr (with /p2p/); empty: find it in the DHT
    token: str = ""  # join token (text form) for private swarms
    wanted_role: str = ""  # ask the coordinator for this role; empty: let it decide
    heartbeat_interval_s: float = 2.0  # seconds between two reports to the coordinator
    record_ttl_s: float = 30.0  # seconds our membership record lives in the DHT
    rpc_timeout_s: float = 5.0  # seconds; deadline of a membership call to the coordinator
    max_backoff_s: float = 10.0  # seconds; longest wait between attempts to reach the coordinator
    bandwidth_mbps: float = 0.0  # Mbit/s, the link's up/down bandwidth: reported, and averaging paces its sends to it; 0: measure against the coordinator, no pacing
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR
    data: str = ""  # text file or directory to train on; empty: the built-in corpus (Python's stdlib sources)
    text_field: str = "text"  # the field of a JSON line, or the column of a table or data set, that holds the text
    shard_index: int = -1  # which data shard this replica reads, in [0, num_shards); -1: derived from the peer id
    num_shards: int = 8  # how many shards the data is cut into
    threads: int = 0  # torch threads for training; 0: cores - 1 (p2pd and the DHT need the rest)
    fault_delay_parts_s: float = 0.0  # chaos drills and tests only: hold each averaging part this long (seconds) before sending
    fault_slowdown: float = 1.0  # chaos drills and tests only: each inner step takes this many times as long (a slower machine)
    # chaos drills, tests and benches only: a replica sends this lie in place of its pseudo-gradient,
    # a stage server or an expert host in place of its answers' tensors, or with "sync-" in place
    # of its pseudo-gradient in its slot's syncs (node/roles/attacks.py)
    fault_attack: str = ""
    fault_attack_scale: float = 0.0  # how strong the lie is (its factor, its multiple of the honest norm, or its rounds of staleness); 0: the attack's default
    http: str = ""  # HOST:PORT of this node's /metrics (Prometheus) and /status (JSON); port 0 picks a free one; "": none
    averager: AveragerSettings = field(default_factory=AveragerSettings)  # [averager] in the config file
    transport: TransportSettings = field(default_factory=TransportSettings)  # [transport] in the config file

    def torch_threads(self) -> int:
        """How many threads torch computes with: `threads`, or cores - 1 when it is 0."""
        return self.threads or max(1, (os.cpu_count() or 2) - 1)

    def __post_init__(self) -> None:
        if isinstance(self.swarm_id, str) and isinstance(self.token, str):
            object.__setattr__(self, "swarm_id", _swarm_of(self.swarm_id, self.token))
        check_fields(self, _NODE_CHECKS)
        if self.shard_index >= self.num_shards:
            raise ConfigError(f"shard_index must be < num_shards ({self.num_shards}), got {self.shard_index}", "shard_index")

    def resolved_identity(self) -> Path:
        return Path(self.identity) if self.identity else Path(self.data_dir) / "identity.pem"


DEFAULT_SWARM = "swarmtrain"
MAX_HEARTBEAT_INTERVAL_S = 300.0  # a coordinator evicts a member silent for its heartbeat timeout (15 s by default)
MIN_RECORD_TTL_S = 3.0  # DHT expirations are wall-clock times checked with a 3 s tolerance: a shorter life may be over on arrival


def _swarm_of(swarm: str, token: str) -> str:
    """The swarm a node joins: the one given, else its join token's, else DEFAULT_SWARM; a token
    of another swarm than the one given is refused."""
    from .config_checks import token_swarm

    named = token_swarm(token) if token else None
    if swarm and named and named != swarm:
        raise ConfigError(f"--token is a join token of swarm {named!r}, not of --swarm-id {swarm!r}: give the token's swarm (or leave --swarm-id out)", "swarm_id")
    return swarm or named or DEFAULT_SWARM


_NODE_CHECKS: dict[str, Check] = {
    "swarm_id": swarm_id, "host_maddrs": non_empty, "device": non_empty, "data_dir": non_empty,
    "direct_port": between(-1, 65535, "a TCP port (0: any free one, -1: off)"),
    "heartbeat_interval_s": lambda v: positive(v) or (None if v <= MAX_HEARTBEAT_INTERVAL_S else f"must be at most {MAX_HEARTBEAT_INTERVAL_S:g} s (a coordinator evicts members silent for its heartbeat timeout, 15 s by default)"),
    "record_ttl_s": lambda v: record_ttl(v) or (None if v >= MIN_RECORD_TTL_S else f"must be at least {MIN_RECORD_TTL_S:g} s (DHT expirations are checked with a {MIN_RECORD_TTL_S:g} s clock tolerance)"),
    "rpc_timeout_s": positive, "max_backoff_s": positive,
    "bandwidth_mbps": non_negative, "log_level": one_of(*LOG_LEVELS), "shard_index": at_least(-1), "num_shards": at_least(1), "text_field": non_empty,
    "threads": at_least(0), "fault_delay_parts_s": non_negative,
    "fault_slowdown": lambda v: None if 1.0 <= v <= 100.0 else "must be in [1, 100]",
    "fault_attack": lambda v: None if v in ("", *ATTACKS) else f"must be one of {', '.join(ATTACKS)}",
    "fault_attack_scale": non_negative,
    "relays": lambda v: next(filter(None, map(relay_maddr_problem, v)), None),
}  # fmt: skip


def transport_config(c: NodeConfig):
    """The daemon's `TransportConfig`: the [transport] settings, and --direct-port."""
    from .net.transport import TransportConfig

    tc = TransportConfig(direct=c.direct_port >= 0, direct_port=max(c.direct_port, 0), relay_service=c.serve_relay, **c.transport.transport_kwargs())
    if tc.max_bytes_in_flight_per_peer < tc.max_frame_size:
        n, limit = tc.max_bytes_in_flight_per_peer, tc.max_frame_size
        raise ConfigError(f"[transport] max_bytes_in_flight_per_peer must be at least the frame size limit ({limit} bytes), got {n}")
    return tc


def averager_config(c: NodeConfig, **fixed: Any):
    """An `AveragerConfig` from the [averager] settings; `fixed` (the run's codec and join
    window, the namespace) wins over them."""
    from .averaging import AveragerConfig

    return AveragerConfig(**{**c.averager.averager_kwargs(), **fixed})


# ---- loading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Setting:
    path: tuple[str, ...]  # attribute path in the config, e.g. ("averager", "aggregator")
    hint: Any  # its type
    table: str  # its TOML table ("" for top-level keys); also the middle of its env var name
    key: str  # its key in that table; also its flag (--key-with-dashes) and the end of its env var name

    @property
    def cli_key(self) -> str:  # the argparse dest that sets it
        return f"{self.table}.{self.key}" if self.table else self.key

    def env_var(self, prefix: str) -> str:
        return prefix + (f"{self.table}_" if self.table else "").upper() + self.key.upper()


def _nested(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _settings(cls: type, prefix: tuple[str, ...] = (), table: str = "") -> list[_Setting]:
    """Every leaf setting of `cls`. A dataclass field is a TOML table of its own, unless its
    metadata says `flatten` (then its fields are top-level settings like the others)."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        sub = _nested(tp)
        if sub is None:
            out.append(_Setting(prefix + (f.name,), tp, table, f.name))
        elif f.metadata.get("flatten"):
            out += _settings(sub, prefix + (f.name,), table)
        else:
            out += _settings(sub, prefix + (f.name,), f.name)
    return out


def _coerce(name: str, tp: Any, value: Any, source: str, strict: bool = False) -> Any:
    """A value from a file, an env var (a string) or a flag, as type `tp`; ConfigError otherwise.
    `strict` (a file's value, typed by TOML): a string is only ever a string."""
    inner, _ = _optional(tp)
    origin = typing.get_origin(inner)
    try:
        if strict and isinstance(value, str) and inner is not str:
            raise ValueError
        if origin is tuple:
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return tuple(value)
        if inner is bool:
            if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.strip().lower() in ("1", "true", "yes", "on")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if inner is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if inner is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if inner is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (ValueError, TypeError, OverflowError):
        pass
    raise ConfigError(f"{source}: {name} must be {_type_name(tp)}, got {value!r}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def _build(cls: type, values: dict[tuple[str, ...], Any], sources: dict[tuple[str, ...], str], prefix: tuple[str, ...] = ()):
    kwargs = {}
    for f in dataclasses.fields(cls):
        path, sub = prefix + (f.name,), _nested(_hints(cls)[f.name])
        if sub is not None:
            kwargs[f.name] = _build(sub, values, sources, path)
        elif path in values:
            kwargs[f.name] = values[path]
    try:
        return cls(**kwargs)
    except ConfigError as e:
        source = sources.get(prefix + (e.setting,)) if e.setting else None
        if source is None:
            raise
        raise ConfigError(f"{source}: {e}") from None


def load_config(cli: dict[str, Any], config_file: str | None, env: Mapping[str, str] | None = None, cls=NodeConfig, env_prefix: str = "SWARMTRAIN_"):
    """Merge defaults, a TOML file, env vars and CLI values (None = not given) into `cls`.

    A nested config (NodeConfig.averager) is a table of the file ([averager]) and its env vars
    carry the table's name (SWARMTRAIN_AVERAGER_MIN_GROUP_SIZE); its flags' argparse dests are
    "averager.min_group_size". A nested config marked `flatten` (the coordinator's run) reads
    like top-level settings."""
    env = os.environ if env is None else env
    settings = _settings(cls)
    by_key = {(s.table, s.key): s for s in settings}
    tables = {s.table for s in settings if s.table}
    values: dict[tuple[str, ...], Any] = {}
    sources: dict[tuple[str, ...], str] = {}

    def put(s: _Setting, value: Any, source: str) -> None:
        values[s.path] = _coerce(s.key, s.hint, value, source, strict=source.startswith("config file"))
        sources[s.path] = source

    if config_file:
        where = f"config file {config_file}"
        for key, value in _read_toml(config_file).items():
            name = key.replace("-", "_")
            if name in tables:
                if not isinstance(value, dict):
                    raise ConfigError(f"{where}: {key} must be a table ([{key}]), got {value!r}")
                for sub_key, sub_value in value.items():
                    s = by_key.get((name, sub_key.replace("-", "_")))
                    if s is None:
                        raise ConfigError(f"{where}: unknown setting {sub_key!r} in [{key}]")
                    put(s, sub_value, f"{where} [{name}]")
            elif (s := by_key.get(("", name))) is not None:
                put(s, value, where)
            else:
                raise ConfigError(f"{where}: unknown setting {key!r}")
    for s in settings:
        var = s.env_var(env_prefix)
        if var in env and not (env[var] == "" and _optional(s.hint)[1]):  # empty: not set
            put(s, env[var], f"env {var}")
    from .config_checks import unknown_env_var

    if problem := unknown_env_var(env, env_prefix, {s.env_var(env_prefix) for s in settings}):
        raise ConfigError(problem)
    by_cli = {s.cli_key: s for s in settings}
    for name, value in cli.items():
        if value is not None and name in by_cli:
            put(by_cli[name], value, f"--{by_cli[name].key.replace('_', '-')}")
    return _build(cls, values, sources)
