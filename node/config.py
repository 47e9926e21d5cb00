"""One typed config for the node daemon. CLI flags, SWARMTRAIN_* env vars and a TOML config
file all map onto `NodeConfig`; precedence: flag > env var > file > default."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """A user-supplied setting is wrong; the message names it."""


@dataclass(frozen=True)
class NodeConfig:
    swarm_id: str = "swarmtrain"  # which swarm to join; records of other swarms are ignored
    initial_peers: tuple[str, ...] = ()  # multiaddrs of running peers, each with /p2p/<peer id>
    identity: str = ""  # Ed25519 key file (PEM); created if missing so restarts keep the peer id. Default: <data_dir>/identity.pem
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where to listen
    announce_maddrs: tuple[str, ...] = ()  # where others should dial us
    direct_port: int = 0  # TCP port for bulk transfers over direct sealed TCP (forward it behind NAT); 0: any free port; -1: off, all over libp2p
    device: str = "cpu"  # torch device for training: cpu, cuda, cuda:1, mps
    data_dir: str = "swarmtrain-node"  # working directory for identity, state, logs
    coordinator: str = ""  # coordinator multiaddr (with /p2p/); empty: find it in the DHT
    token: str = ""  # join token (text form) for private swarms
    wanted_role: str = ""  # ask the coordinator for this role; empty: let it decide
    heartbeat_interval_s: float = 2.0  # how often to report to the coordinator
    record_ttl_s: float = 30.0  # lifetime of our membership record in the DHT
    rpc_timeout_s: float = 5.0  # deadline of a membership call to the coordinator
    max_backoff_s: float = 10.0  # longest wait between attempts to reach the coordinator
    bandwidth_mbps: float = 0.0  # the link's up/down bandwidth: reported, and averaging paces its sends to it; 0: measure against the coordinator, no pacing
    log_level: str = "INFO"
    data: str = ""  # text file or directory to train on; empty: the built-in corpus (Python's stdlib sources)
    shard_index: int = -1  # which data shard this replica reads; -1: derived from the peer id
    num_shards: int = 0  # how many shards the data is cut into; 0: 8
    threads: int = 0  # torch threads for training; 0: cores - 1 (p2pd and the DHT need the rest)
    fault_delay_parts_s: float = 0.0  # chaos drills and tests only: hold each averaging part this long before sending

    def resolved_identity(self) -> Path:
        return Path(self.identity) if self.identity else Path(self.data_dir) / "identity.pem"


def _coerce(name: str, tp: Any, value: Any, source: str) -> Any:
    origin = typing.get_origin(tp)
    try:
        if origin is tuple:
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return tuple(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (ValueError, TypeError):
        pass
    raise ConfigError(f"{source}: {name} must be {getattr(tp, '__name__', str(tp))}, got {value!r}")


def load_config(cli: dict[str, Any], config_file: str | None, env: dict[str, str] | None = None, cls=NodeConfig, env_prefix: str = "SWARMTRAIN_"):
    """Merge defaults, a TOML file, env vars and CLI values (None = not given) into `cls`."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {config_file} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {config_file} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {config_file}: {e.strerror}") from None
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ConfigError(f"config file {config_file}: unknown setting {key!r}")
            values[name] = _coerce(name, hints[name], value, f"config file {config_file}")
    for name in names:
        var = env_prefix + name.upper()
        if var in env:
            values[name] = _coerce(name, hints[name], env[var], f"env {var}")
    for name, value in cli.items():
        if value is not None and name in names:
            values[name] = _coerce(name, hints[name], value, f"--{name.replace('_', '-')}")
    return cls(**values)


