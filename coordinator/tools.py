"""`swarmtrain-coordinator init | token | revoke`: the swarm owner's key and what it signs, from
the command line. One line on stderr and exit 2 for a bad input.

    init    create the owner key (the coordinator's identity) if missing; print the swarm id,
            "<name>@<owner peer id>", that nodes join with and that only this key may coordinate
    token   print a join token for a private swarm (peer-bound or for any peer, roles, expiry)
    revoke  add peers to the swarm's revocation list (DATA_DIR/revoked), which the running
            coordinator publishes, signed, within one record refresh; every peer then refuses
            them, and the coordinator registers them no more; --list prints it
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

from node.cli import _Parser
from node.config import ConfigError
from protocol.messages import ROLES as PROTOCOL_ROLES
from protocol.records import owner_of, swarm_id_problem
from protocol.signatures import KeyFileError, SigningKey, peer_id_from_public_key, public_key_from_peer_id

TOOLS = {  # each with its own --help
    "init": "create the owner key (the coordinator's identity) and print the swarm id nodes join with",
    "token": "print a join token for a private swarm (for one peer or any, roles, expiry)",
    "revoke": "add peers to the swarm's revocation list (--list prints it)",
}
ROLES = tuple(r for r in PROTOCOL_ROLES if r != "idle")  # what a token may allow
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _identity(args) -> Path:
    return Path(args.identity) if args.identity else Path(args.data_dir) / "identity.pem"


def _owner_key(args) -> SigningKey:
    path = _identity(args)
    if not path.exists():
        raise ConfigError(f"no owner key at {path}: run `swarmtrain-coordinator init` first (or give --identity)")
    try:
        return SigningKey.load(path)
    except KeyFileError as e:
        raise ConfigError(str(e)) from None


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0 or not math.isfinite(float(m.group(1))):
        raise ConfigError(f"--expires-in {text!r}: a positive duration such as 3600, 90m, 12h or 30d")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def revocation_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / "revoked"


def read_revoked(path: Path) -> list[str]:
    """Peer ids in a revocation file (one per line, '#' comments); ConfigError names a bad line."""
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"revocation list {path}: {e}") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        peer = line.split("#", 1)[0].strip()
        if not peer:
            continue
        if public_key_from_peer_id(peer) is None:
            raise ConfigError(f"{path} line {i}: {peer!r} is not a peer id (12D3KooW...)")
        out.append(peer)
    return out


def tools_help() -> str:
    """What `swarmtrain-coordinator --help` says of the owner's tools."""
    lines = [f"  swarmtrain-coordinator {name:<7} {what}" for name, what in TOOLS.items()]
    return "the swarm owner's tools (each with its own --help):\n" + "\n".join(lines)


def _parser(tool: str) -> _Parser:
    p = _Parser(prog=f"swarmtrain-coordinator {tool}", description=TOOLS[tool][0].upper() + TOOLS[tool][1:] + ".")
    p.add_argument("--data-dir", default="swarmtrain-coordinator", help="the coordinator's data dir (default ./swarmtrain-coordinator)")
    p.add_argument("--identity", help="the owner key file (default DATA_DIR/identity.pem)")
    if tool == "init":
        p.add_argument("--name", default="swarmtrain", help="the swarm's name, the part of its id before '@' (default swarmtrain)")
    elif tool == "token":
        p.add_argument("--swarm-id", required=True, help="the swarm the token admits to (name@<owner peer id>, as init printed it)")
        p.add_argument("--peer", metavar="PEER_ID", help="the one peer that may use it (default: any peer)")
        p.add_argument("--roles", default="", help=f"roles it allows, comma-separated ({', '.join(ROLES)}; default: any)")
        p.add_argument("--expires-in", default="30d", help="how long it is good for: seconds, or 90m, 12h, 30d (default 30d)")
    else:
        p.add_argument("peers", nargs="*", metavar="PEER_ID", help="peers to revoke")
        p.add_argument("--list", action="store_true", help="print the revoked peers")
    return p


def run_tool(tool: str, argv: list[str]) -> int:
    args = _parser(tool).parse_args(argv)
    try:
        if tool == "init":
            return _init(args)
        if tool == "token":
            return _token(args)
        return _revoke(args)
    except ConfigError as e:
        print(f"swarmtrain-coordinator {tool}: error: {e}", file=sys.stderr)
        return 2


def _init(args) -> int:
    problem = "must not hold '@' (init adds @<owner peer id>)" if "@" in args.name else swarm_id_problem(args.name)
    if problem:
        raise ConfigError(f"--name {args.name!r} {problem}")
    path = _identity(args)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = SigningKey.load_or_create(path)
    except (KeyFileError, OSError) as e:
        raise ConfigError(f"owner key {path}: {e}") from None
    owner = peer_id_from_public_key(key.public_key)
    swarm_id = f"{args.name}@{owner}"
    print(f"owner key: {path} ({'existing' if existed else 'created'}; keep it secret: it signs the swarm's coordinator record, join tokens and member certificates)")
    print(f"owner public key: {key.public_key.hex()}")
    print(f"swarm id: {swarm_id}")
    print(f"coordinator: swarmtrain-coordinator --data-dir {args.data_dir}{'' if not args.identity else f' --identity {args.identity}'} --swarm-id {swarm_id} [--private]")
    print(f"nodes: swarmtrain-node --swarm-id {swarm_id} --initial-peers <the coordinator's address> [--token <swarmtrain-coordinator token ...>]")
    return 0


def _token(args) -> int:
    from protocol.tokens import ANY_PEER, issue_token

    problem = swarm_id_problem(args.swarm_id)
    if problem:
        raise ConfigError(f"--swarm-id {args.swarm_id!r} {problem}")
    key = _owner_key(args)
    me = peer_id_from_public_key(key.public_key)
    owner = owner_of(args.swarm_id)
    if owner is not None and owner != me:
        raise ConfigError(f"swarm {args.swarm_id} is owned by {owner}, and {_identity(args)} is {me}: its tokens would be refused")
    if args.peer is not None and public_key_from_peer_id(args.peer) is None:
        raise ConfigError(f"--peer {args.peer!r} is not a peer id (12D3KooW..., as a node logs it on start)")
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    if args.roles.strip() and not roles:  # (a token naming no role allows every role)
        raise ConfigError(f"--roles {args.roles!r} names no role: name some ({', '.join(ROLES)}), or leave --roles out for a token that allows any role")
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ConfigError(f"--roles: unknown role(s) {', '.join(unknown)}; known: {', '.join(ROLES)}")
    token = issue_token(key, args.swarm_id, args.peer or ANY_PEER, roles, time.time() + _duration(args.expires_in))
    print(token.to_text())
    return 0


def _revoke(args) -> int:
    path = revocation_file(args.data_dir)
    revoked = read_revoked(path)
    if args.list or not args.peers:
        print("\n".join(revoked) if revoked else "(no peer is revoked)")
        return 0
    for peer in args.peers:
        if public_key_from_peer_id(peer) is None:
            raise ConfigError(f"{peer!r} is not a peer id (12D3KooW..., as a node logs it on start)")
    if _identity(args).exists():  # the owner's key: its peer id is the coordinator's, which serves the swarm
        owner = peer_id_from_public_key(_owner_key(args).public_key)
        if owner in args.peers:
            raise ConfigError(f"{owner} is this coordinator's own peer id (its key {_identity(args)}, the swarm owner's): it cannot revoke itself")
    new = [p for p in dict.fromkeys(args.peers) if p not in revoked]
    if not Path(args.data_dir).is_dir():
        raise ConfigError(f"no coordinator data dir {args.data_dir}: give --data-dir")
    with path.open("a") as f:
        for peer in new:
            f.write(f"{peer}  # revoked {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    print(f"revoked {len(new)} peer(s) ({len(args.peers) - len(new)} already were); the running coordinator publishes the list within one record refresh")
    return 0
