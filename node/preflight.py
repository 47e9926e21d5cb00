"""The checks of a node's or a coordinator's settings that need neither torch nor hivemind: the
data dir, the identity, the multiaddrs, the ports to listen on, and the like.

The CLIs run them as soon as the config is loaded, so that such a mistake is one line within a
fraction of a second, not after seconds of imports; `Node.validate` and `Coordinator.validate`
run them too, then the checks that need the heavy modules. Each raises `ConfigError` with one
line, in the words the later check (or the failure it prevents) would use. Imports: the standard
library and light project modules only (no torch, no hivemind, not even through protocol's
torch-using modules), and a module only a given setting needs (numpy for one) only when it is
given.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from protocol.signatures import KeyFileError, SigningKey

from .config import ConfigError, NodeConfig
from .config_checks import check_node_settings
from .net.addresses import split_peer_maddr, tcp_ip4s


def check_data_dir(path: str | os.PathLike) -> Path:
    """Create the data dir if needed and prove it is writable; ConfigError otherwise."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"data dir {p} is not writable: {e.strerror}") from None
    return p


def load_identity(path: Path) -> SigningKey:
    try:
        return SigningKey.load_or_create(path)
    except KeyFileError as e:
        raise ConfigError(f"identity: {e}") from None
    except OSError as e:
        raise ConfigError(f"identity: cannot create {path}: {e.strerror}") from None


# ---- multiaddrs ----------------------------------------------------------------------------------


def announce_warning(announced: Sequence[str], initial_peers: Sequence[str]) -> str | None:
    """What is wrong with announcing `announced` to a swarm joined through `initial_peers`: a
    node whose peers are at public addresses while it announces only loopback or private ones
    (a home LAN address, a container's) cannot be dialled by them. None if nothing is."""
    public_peers = [ip for ip in tcp_ip4s(initial_peers) if ipaddress.ip_address(ip).is_global]
    own = [ip for ip in tcp_ip4s(announced) if ip != "0.0.0.0"]
    if not public_peers or not own or any(ipaddress.ip_address(ip).is_global for ip in own) or any("/p2p-circuit" in a for a in announced):
        return None
    return (f"announcing only {', '.join(own)} (loopback or private) to a swarm at public addresses ({', '.join(public_peers)}): its peers cannot dial us there. "
            "Announce the public address (and forward the port) with --announce-maddrs, be reached through a relay with --relays, or join with --client-mode (no inbound calls)")  # fmt: skip


def _ip4(v: str) -> bool:
    try:
        ipaddress.IPv4Address(v)
        return True
    except ValueError:
        pass
    try:
        socket.inet_aton(v)  # the most lenient reading there is
        return True
    except OSError:
        return False


def _ip6(v: str) -> bool:
    try:
        ipaddress.IPv6Address(v)
        return True
    except ValueError:
        pass
    try:
        socket.inet_pton(socket.AF_INET6, v)
        return True
    except (OSError, ValueError):
        return False


def _port(v: str) -> bool:
    try:
        return 0 <= int(v, 10) < 65536
    except ValueError:
        return False


# the protocols whose values are checked here, and how; hivemind's Multiaddr (node/net/host.py) knows
# more and checks them all when the host starts
_VALUE_CHECKS = {"ip4": _ip4, "ip6": _ip6, "tcp": _port, "udp": _port, "dccp": _port, "sctp": _port}
_NO_VALUE = {"quic", "quic-v1", "http", "https", "tls", "ws", "wss", "utp", "udt", "p2p-circuit"}
_SOME_VALUE = {"p2p", "dns", "dns4", "dns6", "dnsaddr", "ip6zone", "onion", "onion3"}


def is_malformed_maddr(maddr: str) -> bool:
    """True for what hivemind's Multiaddr surely refuses: no leading '/', or a bad value or a
    missing one of a protocol known here. Anything else passes (the host's own check follows)."""
    if not isinstance(maddr, str) or not maddr.startswith("/"):
        return True
    parts = maddr.rstrip("/").split("/")[1:]
    while parts:
        name = parts.pop(0)
        if name in _NO_VALUE:
            continue
        if name not in _VALUE_CHECKS and name not in _SOME_VALUE:
            return False  # not known here: left to hivemind
        if not parts:
            return True  # the protocol needs a value
        value = parts.pop(0)
        if name in _VALUE_CHECKS and not _VALUE_CHECKS[name](value):
            return True
    return False


def check_maddrs(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str]) -> None:
    """The multiaddrs the libp2p host is given, checked as Host.start checks them."""
    for maddr in (*initial_peers, *host_maddrs, *announce_maddrs):
        if is_malformed_maddr(maddr):
            raise ConfigError(f"not a multiaddr: {maddr!r}")
    for maddr in initial_peers:
        if "/p2p/" not in maddr:
            raise ConfigError(f"initial peer {maddr} lacks its /p2p/<peer id> part")


# ---- ports ---------------------------------------------------------------------------------------


def _bind_all(addresses: Iterable[tuple[int, tuple]]) -> None:
    """Bind (and close again) a TCP socket to each (family, sockaddr), as asyncio's create_server
    binds its listeners (SO_REUSEADDR; IPv6 sockets IPv6 only); OSError as create_server words it."""
    sockets = []
    try:
        for family, sa in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
            try:
                sock.bind(sa)
            except OSError as err:
                raise OSError(err.errno, f"error while attempting to bind on address {sa!r}: {(err.strerror or str(err)).lower()}") from None
    finally:
        for sock in sockets:
            sock.close()


def check_direct_port(c: NodeConfig) -> None:
    """A fixed --direct-port must be free on the addresses the direct listener will take (the
    IPv4 ones of host_maddrs), in the words of Transport.start."""
    ips = tcp_ip4s(c.host_maddrs)
    if c.direct_port <= 0 or not ips:
        return
    try:
        _bind_all((socket.AF_INET, (ip, c.direct_port)) for ip in ips)
    except OSError as e:
        raise ConfigError(f"cannot listen for direct connections on {'/'.join(ips)} port {c.direct_port}: {os.strerror(e.errno) if e.errno else e}") from None


def parse_http(text: str) -> tuple[str, int]:
    """--http HOST:PORT, the node's and the coordinator's (node/net/http.py serves it)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http must be HOST:PORT, got {text!r}")
    return host, int(port)


def check_http(address: str) -> None:
    """--http must be HOST:PORT, and that address free to listen on (ConfigError worded as
    node/net/http.py `serve_http` words it)."""
    try:
        host, port = parse_http(address)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        if not infos:
            raise OSError(f"getaddrinfo({host!r}) returned empty list")
        _bind_all(dict.fromkeys((family, sa) for family, _, _, _, sa in infos))
    except OSError as e:
        raise ConfigError(f"--http {address}: cannot listen: {e.strerror or e}") from None


# ---- the daemons' settings -----------------------------------------------------------------------


def check_node(c: NodeConfig) -> tuple[SigningKey, bytes | None]:
    """A node's light checks, in the order Node.validate and the host's start find them; creates
    the data dir and the identity if missing. Returns the identity and the join token's bytes."""
    if c.wanted_role:
        from protocol.messages import ROLES

        if c.wanted_role not in ROLES:
            raise ConfigError(f"--wanted-role must be one of {', '.join(ROLES)}, got {c.wanted_role!r}")
    if c.data:  # Node.validate then reads it (node.models.data.load_corpus: the same words)
        p = Path(c.data)
        if not p.exists():
            raise ConfigError(f"--data: data path does not exist: {p}")
        if not p.is_file() and not p.is_dir():
            raise ConfigError(f"--data: data path is neither a file nor a directory: {p}")
    n = c.transport.max_bytes_in_flight_per_peer  # node.config.transport_config's check
    if n is not None:
        from protocol.framing import DEFAULT_MAX_FRAME_SIZE  # the transport's frame size limit

        if n < DEFAULT_MAX_FRAME_SIZE:
            raise ConfigError(f"[transport] max_bytes_in_flight_per_peer must be at least the frame size limit ({DEFAULT_MAX_FRAME_SIZE} bytes), got {n}")
    check_data_dir(c.data_dir)
    key = load_identity(c.resolved_identity())
    if c.coordinator:
        try:
            split_peer_maddr(c.coordinator)
        except ValueError as e:
            raise ConfigError(f"--coordinator: {e}") from None
    token = None
    if c.token:
        from protocol.errors import RemoteProtocolError
        from protocol.tokens import JoinToken

        try:
            token = JoinToken.from_text(c.token).to_bytes()
        except RemoteProtocolError as e:
            raise ConfigError(f"--token is not a join token: {e}") from None
    check_maddrs(c.initial_peers, c.host_maddrs, c.announce_maddrs)
    check_direct_port(c)
    check_node_settings(c, usable_cores())
    if c.http:
        check_http(c.http)
    return key, token


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 1
