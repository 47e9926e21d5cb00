"""Checks across a daemon's settings, and of the environment they are read from: pure functions
of a loaded config (the machine's cores and the environment passed in), each refusing a setting
that cannot work with one line (`ConfigError`) that names the flags at fault. The per-field
bounds are node/config.py's; the run's are node/runconfig.py's; this module holds what needs two
settings at once. Standard library only (the CLIs run it before torch and hivemind load).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from .config import ConfigError, NodeConfig

MIN_HEARTBEAT_TIMEOUT_S = 2.0  # the coordinator's: nodes heartbeat every 2 s by default (and at most a third of the timeout)
COORDINATOR_ENV_PREFIX = "SWARMTRAIN_COORDINATOR_"


def check_node_settings(c: NodeConfig, cores: int) -> None:
    """What no node can run with, across its settings; ConfigError naming the flags."""
    if c.client_mode and c.serve_relay:
        raise ConfigError("--serve-relay carries streams for peers that dial this node, and --client-mode accepts no inbound connection: give one or the other")
    if c.record_ttl_s < c.heartbeat_interval_s:
        raise ConfigError(f"--record-ttl-s {c.record_ttl_s:g} is shorter than --heartbeat-interval-s {c.heartbeat_interval_s:g}: "
                          "peers would lose this node's member record between two of its heartbeats; give a record TTL of a few heartbeats")  # fmt: skip
    if c.threads > cores:
        raise ConfigError(f"--threads {c.threads}: this process may run on {cores} cores, and torch threads beyond them only wait on each other "
                          f"(and on p2pd and the DHT): give at most {cores} (0: cores - 1)")  # fmt: skip
    if not c.initial_peers and not c.coordinator:
        raise ConfigError("no --initial-peers: give the multiaddr of a running peer of the swarm, e.g. the coordinator's "
                          "(/ip4/HOST/tcp/PORT/p2p/12D3KooW..., as its log and its /status show it), or --coordinator with it")  # fmt: skip


def token_swarm(token: str) -> str | None:
    """The swarm a join token (text form) admits to; None when it is not one (check_node says why)."""
    from protocol.errors import RemoteProtocolError
    from protocol.tokens import JoinToken

    try:
        return JoinToken.from_text(token).swarm_id
    except RemoteProtocolError:
        return None


def unknown_env_var(env: Mapping[str, str], prefix: str, known: Collection[str]) -> str | None:
    """Why a variable of `env` that starts with `prefix` but names no setting (of `known`, the
    setting variables) is refused: one that nearly names one (a misspelling, surely), with that
    name. None when there is none. Other tools' names that share the prefix and name nothing
    close (compose's SWARMTRAIN_IMAGE) are left alone, as are the coordinator's own variables
    when a node reads its settings."""
    for var in sorted(env):
        if not var.startswith(prefix) or var in known or (prefix != COORDINATOR_ENV_PREFIX and var.startswith(COORDINATOR_ENV_PREFIX)):
            continue
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.8)
        if close:
            return f"env {var} is no setting: did you mean {close[0]}?"
    return None
