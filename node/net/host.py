"""The only module that imports hivemind: a libp2p host (p2pd + hivemind DHT) behind a small API.

One p2pd per process tree: hivemind's DHT runs in a child process that starts p2pd, and this
process talks to the same daemon through `replicate_p2p`. The p2pd identity is derived from the
node's Ed25519 key, so the libp2p peer id is also the key that signs the node's records.

Process hygiene: a watchdog thread in the DHT child notices when its parent is gone (even after
SIGKILL) and takes p2pd down with it, so a killed node leaves no orphan daemons.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable, Sequence


def _register_hivemind_lightly() -> None:
    """hivemind's package __init__ imports its averaging (with scipy), MoE and optimizer code:
    most of a second of CPU in every process, which needs only its DHT and p2p modules. Register the
    package without running its __init__ (its submodules import as usual); the first time
    anything asks the package for a name (`hivemind.DHT`, `hivemind.moe`...), __init__ runs."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    pkg = importlib.util.module_from_spec(spec)
    loaded = False

    def __getattr__(name: str):
        nonlocal loaded
        if f"hivemind.{name}" in sys.modules:  # a submodule being imported (`import hivemind.p2p.x as y`)
            return sys.modules[f"hivemind.{name}"]
        if loaded or name.startswith("__"):
            raise AttributeError(f"module 'hivemind' has no attribute {name!r}")
        loaded = True
        spec.loader.exec_module(pkg)
        return getattr(pkg, name)

    pkg.__getattr__ = __getattr__
    sys.modules["hivemind"] = pkg


# hivemind's futures share one byte of state each between this process and the DHT's child. Its
# default way (torch's "file_system" sharing) starts a torch_shm_manager process per node, about a
# fifth of an idle node's memory, which may outlive the node; file descriptors need no process.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _register_hivemind_lightly()
    from hivemind.dht import DHT as _HivemindDHT
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, DispatchFailure
    from hivemind.utils import get_dht_time
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.serializer import MSGPackSerializer

from protocol import RemoteProtocolError
from protocol.records import check_stored, coordinator_key, members_key, revoked_key
from protocol.signatures import SigningKey, libp2p_private_key, peer_id_from_public_key

from . import compat
from ..osutil import children_of
from .addresses import split_peer_maddr, tcp_ip4s  # here too: other modules import them from here
from .relay import CIRCUIT, circuit_addr, relay_ids, relay_maddr_problem

log = logging.getLogger(__name__)

StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class HostError(Exception):
    """The libp2p host could not start or reach the swarm; the message says why, in one line."""


class PeerUnreachable(Exception):
    """No stream could be opened to a peer."""


class DHTError(Exception):
    """A DHT get or store failed: the DHT's process is busy, restarting or has no peers yet."""


def dht_time() -> float:
    return get_dht_time()


def _kill_children_and_exit() -> None:
    kids = children_of(os.getpid())
    for pid in kids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while kids and time.monotonic() < deadline:
        kids = [p for p in kids if os.path.exists(f"/proc/{p}") and children_of(os.getpid()).count(p)]
        time.sleep(0.05)
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


class SwarmRecords(RecordValidatorBase):
    """The DHT's check of every value under the swarm's coordinator, members and revocation keys,
    stored or served (protocol/records.py `check_stored`): one that is not a well-formed record of
    this swarm signed by its owner is neither kept nor passed on, so readers take the newest valid
    record. It runs in the DHT's own process: plain, picklable fields only."""

    def __init__(self, swarm_id: str):
        self.swarm_id = swarm_id
        keys = {"coordinator": coordinator_key(swarm_id), "members": members_key(swarm_id), "revoked": revoked_key(swarm_id)}
        self.kinds = {DHTID.generate(source=key).to_bytes(): kind for kind, key in keys.items()}

    def validate(self, record: DHTRecord) -> bool:
        kind = self.kinds.get(record.key)
        if kind is None:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
            if not isinstance(value, bytes) or not (subkey is None or isinstance(subkey, str)):
                raise RemoteProtocolError(f"a {type(value).__name__} value under a {type(subkey).__name__} subkey", kind)
            check_stored(self.swarm_id, kind, value, subkey, record.expiration_time, time.time())
        except Exception as e:  # RemoteProtocolError, or bytes msgpack cannot read
            log.info("refused a value under the swarm's %s key: %s", kind, e)
            return False
        return True


SECURITY = ("tls", "noise+tls")


class _DHT(_HivemindDHT):
    """hivemind.DHT whose process dies with its parent and takes p2pd along."""

    security = "tls"  # see HostConfig.security

    def __init__(self, *args: Any, **kwargs: Any):
        self.parent_pid = os.getpid()  # the node that creates it (set first: start=True forks at once)
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        if self.security == "tls":  # hivemind exposes no switch for Noise: add it to p2pd's flags
            compat.add_p2pd_flags(P2P, noise=False)
        # Our own process group: a Ctrl-C in the terminal reaches the node, which then stops the
        # DHT and p2pd in order (deregistering first), instead of killing p2pd under its feet.
        os.setpgid(0, 0)
        parent = self.parent_pid

        def watchdog():
            while os.getppid() == parent:
                time.sleep(0.2)
            _kill_children_and_exit()

        threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: _kill_children_and_exit())
        super().run()


@dataclass(frozen=True)
class HostConfig:
    initial_peers: tuple[str, ...] = ()  # multiaddrs of running peers ("/ip4/1.2.3.4/tcp/31337/p2p/12D3...")
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where p2pd listens; 0.0.0.0 for real deployments
    announce_maddrs: tuple[str, ...] = ()  # addresses others should dial (public IP / port forwarding)
    startup_timeout_s: float = 20.0  # p2pd + DHT start and bootstrap
    # channel security p2pd offers. "tls": TLS 1.3 only (AES-GCM: with AES instructions the daemons
    # spend less CPU per byte than with Noise's ChaCha20-Poly1305). "noise+tls": p2pd's default. Either side of a connection may
    # choose: the dialer proposes its first, the listener accepts any it has.
    security: str = "tls"
    # the swarm whose records this host's DHT keeps and serves only when valid (SwarmRecords); "": no check
    swarm_id: str = ""
    # listen nowhere (p2pd opens no listener) and serve no DHT: only outbound connections,
    # which carry calls both ways once open (a node behind a NAT or firewall)
    client_mode: bool = False
    # relays we keep a connection to and announce `<relay>/p2p-circuit` through (node/net/relay.py):
    # callers that cannot dial us reach us through them
    relays: tuple[str, ...] = ()


class Host:
    """A running libp2p host: DHT access and binary streams to peers."""

    def __init__(self, key: SigningKey, dht: _HivemindDHT, p2p: P2P, keyfile_dir: str, config: HostConfig = HostConfig()):
        self.key = key
        self.dht = dht
        self.p2p = p2p
        self.peer_id = peer_id_from_public_key(key.public_key)
        self._keyfile_dir = keyfile_dir
        self._closed = False
        self.config = config
        self.revoked: frozenset[str] = frozenset()  # an owned swarm's revocation list, as last read: member records of these are not trusted
        self.routes: dict[str, tuple[str, ...]] = {}  # peer -> the relays it announced (node/net/relay.py), from member records
        self._dht_calls: set[asyncio.Task] = set()  # the DHT's replies on their way (see `_dht_call`)

    @classmethod
    async def start(cls, key: SigningKey, config: HostConfig) -> Host:
        """Start p2pd and the DHT; join `initial_peers` (HostError if none answers)."""
        for maddr in (*config.initial_peers, *config.host_maddrs, *config.announce_maddrs, *config.relays):
            try:
                Multiaddr(maddr)
            except Exception:
                raise HostError(f"not a multiaddr: {maddr!r}") from None
        if config.security not in SECURITY:
            raise HostError(f"security must be one of {', '.join(SECURITY)}, not {config.security!r}")
        for maddr in config.initial_peers:
            if "/p2p/" not in maddr:
                raise HostError(f"initial peer {maddr} lacks its /p2p/<peer id> part")
        for maddr in config.relays:
            if problem := relay_maddr_problem(maddr):
                raise HostError(problem)
        keyfile_dir = tempfile.mkdtemp(prefix="swarmtrain-id-")
        keyfile = os.path.join(keyfile_dir, "p2pd.key")
        fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(libp2p_private_key(key))
        validators = []
        if config.swarm_id:
            validators.append(SwarmRecords(config.swarm_id))
        dht = _DHT(
            record_validators=validators,
            # a node nobody can dial (client mode, or reached through relays) serves no DHT:
            # peers that put it in their routing tables would wait on it until their timeouts
            **({"client_mode": True, "no_listen": True} if config.client_mode else {"client_mode": True} if config.relays else {}),
            initial_peers=list(config.initial_peers) or None,
            host_maddrs=list(config.host_maddrs),
            announce_maddrs=list(config.announce_maddrs) or None,
            identity_path=keyfile,
            check_if_identity_free=False,
            start=False,
        )
        dht.security = config.security
        loop = asyncio.get_running_loop()
        try:
            dht.start()
            await loop.run_in_executor(None, dht.wait_until_ready, config.startup_timeout_s)
            p2p = await dht.replicate_p2p()
        except BaseException as e:
            _stop_dht(dht)
            _remove_dir(keyfile_dir)
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
                raise
            reason = str(e).split("\n")[0] or type(e).__name__
            if "bootstrap" in reason or "initial_peers" in reason:
                raise HostError(f"none of the initial peers answered: {', '.join(config.initial_peers)}") from None
            raise HostError(f"libp2p host failed to start: {reason}") from None
        _remove_dir(keyfile_dir)  # p2pd has read it: a key must not outlive a process killed before its shutdown
        return cls(key, dht, p2p, keyfile_dir, config)

    def listen_ips(self) -> list[str]:
        """The IPv4 addresses p2pd listens on over TCP (from host_maddrs: 127.0.0.1, 0.0.0.0, ...)."""
        return [] if self.config.client_mode else tcp_ip4s(self.config.host_maddrs)

    async def visible_maddrs(self) -> list[str]:
        """Where others reach us: p2pd's addresses (none in client mode: it listens nowhere),
        then a circuit address through each of our relays."""
        own = [] if self.config.client_mode else [str(m) for m in await self.p2p.get_visible_maddrs()]
        return own + [circuit_addr(r) for r in self.config.relays]

    def learn_routes(self, peer_id: str, maddrs: Sequence[str]) -> None:
        """Remember the relays a peer announced (its member record's addresses)."""
        relays = relay_ids(maddrs)
        if relays:
            self.routes[peer_id] = relays
        else:
            self.routes.pop(peer_id, None)

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None:
        """Tell p2pd where a peer is (it may also find out through the libp2p DHT)."""
        # p2pd wants transport addresses: hivemind's encoding of a /p2p/<id> suffix is refused
        addrs = [Multiaddr(m.split("/p2p/")[0]) for m in maddrs if CIRCUIT not in m]
        try:
            await compat.p2pd_connect(self.p2p, PeerID.from_base58(peer_id), addrs)
        except (ControlFailure, DispatchFailure, OSError, ValueError) as e:
            raise PeerUnreachable(f"cannot connect to {peer_id}: {e}") from None

    async def disconnect(self, peer_id: str) -> None:
        """Close p2pd's connections to a peer that went silent (best effort): the next stream
        to it dials afresh instead of queueing on a connection a dead link left stuck."""
        try:
            await asyncio.wait_for(compat.p2pd_disconnect(self.p2p, PeerID.from_base58(peer_id)), 5.0)
        except (ControlFailure, DispatchFailure, OSError, ValueError, TimeoutError, compat.CompatError) as e:
            log.debug("disconnect %s: %s", peer_id[-8:], e)

    async def add_stream_handler(self, name: str, handler: StreamHandler) -> None:
        async def adapter(info, reader, writer):
            try:
                await handler(info.peer_id.to_base58(), reader, writer)
            except asyncio.CancelledError:
                # shutting down. Python 3.11's stream server logs a handler that ends cancelled
                # as an "Exception in callback" traceback; one that ends quietly is not
                writer.close()

        await self.p2p.add_binary_stream_handler(name, adapter)

    async def open_stream(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        except (ControlFailure, DispatchFailure, OSError, ValueError) as e:
            raise PeerUnreachable(f"cannot open a stream to {peer_id}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return reader, writer

    async def _dht_call(self, future: Any) -> Any:
        """What a call to the DHT's process (its future) returns. A caller that stops waiting (a
        timeout, a cancelled watch) does not drop the call while its reply is on the way: the
        call is kept here until it ends. Dropped, its future would be collected with the task
        awaiting it, at any moment and on any thread: asyncio logged "Task was destroyed but it
        is pending!" for every read given up, and the DHT's reader thread touched this event
        loop when the last reference went there (a replica polling the DHT crashed so)."""
        task = asyncio.ensure_future(future)
        self._dht_calls.add(task)
        task.add_done_callback(self._dht_call_ended)
        return await asyncio.shield(task)

    def _dht_call_ended(self, task: asyncio.Task) -> None:
        self._dht_calls.discard(task)
        if not task.cancelled():
            task.exception()  # (read: a failure nobody waits for any more is not logged as unread)

    async def dht_store(self, key: str, value: bytes, expiration: float, subkey: str | None = None) -> bool:
        """DHTError if the store failed."""
        try:
            return bool(await self._dht_call(self.dht.store(key, value, expiration, subkey=subkey, return_future=True)))
        except Exception as e:  # whatever hivemind's DHT process raised: one named error for every caller
            raise DHTError(f"DHT store failed: {e or type(e).__name__}") from e

    async def dht_get(self, key: str) -> Any:
        """The value (bytes) or {subkey: bytes} stored under key, None if absent or expired;
        DHTError if the read failed."""
        try:
            found = await self._dht_call(self.dht.get(key, latest=True, return_future=True))
        except Exception as e:  # whatever hivemind's DHT process raised: one named error for every caller
            raise DHTError(f"DHT get failed: {e or type(e).__name__}") from e
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict):
            return {k: v.value for k, v in value.items()}
        return value

    async def dht_neighbours(self) -> int:
        """How many peers the DHT's routing table holds now."""
        return await self._dht_call(self.dht.run_coroutine(_routing_table_size, return_future=True))

    async def rejoin_dht(self, peers: dict[str, Sequence[str]], timeout: float = 10.0) -> int:
        """Ping `peers` (peer id -> multiaddrs) from the DHT, then look up our own id there:
        how a DHT that lost every neighbour (a link that was down: every request failed, each
        failure took a neighbour out of the routing table) gets back in. Returns how many answered."""
        for peer_id, maddrs in peers.items():
            if not maddrs:  # p2pd may still know where it is
                continue
            try:
                await asyncio.wait_for(self.connect(peer_id, maddrs), timeout)
            except (PeerUnreachable, TimeoutError) as e:
                log.debug("rejoin: %s: %s", peer_id[-8:], e)
        return await self._dht_call(self.dht.run_coroutine(partial(_rejoin, peers=list(peers), timeout=timeout), return_future=True))

    async def keep_joined(self, extra: Callable[[], dict[str, Sequence[str]]] = dict, interval: float = 2.0,
                          on_rejoined: Callable[[], None] | None = None) -> None:
        """Forever: when the DHT has no neighbour left, join again through the initial peers
        and `extra()` (e.g. the coordinator), then call `on_rejoined()`. hivemind's DHT
        bootstraps only at start; a node whose link went down for longer than its requests'
        timeouts would stay alone."""
        alone_since: float | None = None
        while True:
            await asyncio.sleep(interval)
            try:
                if await self.dht_neighbours():
                    alone_since = None
                    continue
                alone_since = alone_since or time.monotonic()
                peers = {split_peer_maddr(m)[1]: [m] for m in self.config.initial_peers}
                peers.update(extra())
                peers.pop(self.peer_id, None)
                for peer_id in peers:  # connections our link's outage left stuck: dial afresh
                    await self.disconnect(peer_id)
                answered = await self.rejoin_dht(peers, timeout=3.0) if peers else 0
                if answered:
                    log.info("DHT: no neighbour left for %.0f s; joined again through %d of %d peers", time.monotonic() - alone_since, answered, len(peers))
                    alone_since = None
                    if on_rejoined is not None:
                        on_rejoined()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT process may be busy or restarting; next time
                log.debug("DHT rejoin check failed: %s", e)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.p2p.shutdown()
        except Exception as e:  # the replica's sockets may already be gone; shutting down anyway
            log.debug("p2p replica shutdown: %s", e)
        await asyncio.get_running_loop().run_in_executor(None, _stop_dht, self.dht)
        _remove_dir(self._keyfile_dir)


async def _routing_table_size(_dht, node) -> int:  # runs in the DHT's process
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _rejoin(_dht, node, peers: list[str], timeout: float) -> int:  # runs in the DHT's process
    pings = [node.protocol.call_ping(PeerID.from_base58(p), validate=False, strict=False) for p in peers]
    try:
        answers = await asyncio.wait_for(asyncio.gather(*pings, return_exceptions=True), timeout)
    except TimeoutError:
        return 0
    answered = sum(1 for a in answers if a is not None and not isinstance(a, BaseException))
    if answered:  # the routing table has them again; fill it further from theirs
        await asyncio.wait([asyncio.ensure_future(node.find_nearest_nodes([node.node_id]))], timeout=timeout)
    return answered


def _stop_dht(dht: _HivemindDHT) -> None:
    if dht.is_alive():
        dht.shutdown()
    if dht.is_alive():
        dht.terminate()
        dht.join(3)


def _remove_dir(path: str) -> None:
    if not os.path.isdir(path):
        return  # removed already
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)
