"""The node daemon: a libp2p host, the RPC transport, membership, and (in later layers) a role.

`Node.start()` validates everything a user can get wrong before anything is started, so a bad
setting is one clear line, never a half-started daemon. `Node.stop()` deregisters, cancels
every task it created, and shuts p2pd down.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from protocol import Hello, JoinToken, KeyFileError, RemoteProtocolError, RoleAssignment, SigningKey

from . import capabilities
from .config import ConfigError, NodeConfig
from .membership import Membership, split_peer_maddr
from .p2p import Host, HostConfig
from .transport import CallContext, Transport, TransportConfig

log = logging.getLogger(__name__)

SOFTWARE = "swarmtrain/0.1"


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


class Node:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.host: Host | None = None
        self.transport: Transport | None = None
        self.membership: Membership | None = None
        self._tasks: list[asyncio.Task] = []
        self.replica = None
        self._role_task: asyncio.Task | None = None

    def validate(self) -> tuple[SigningKey, bytes | None]:
        """Everything checkable before starting: raises ConfigError with one clear line."""
        c = self.config
        reason = capabilities.check_device(c.device)
        if reason:
            raise ConfigError(reason)
        if not -1 <= c.direct_port <= 65535:
            raise ConfigError(f"--direct-port must be a TCP port (0: any free one, -1: off), not {c.direct_port}")
        check_data_dir(c.data_dir)
        key = load_identity(c.resolved_identity())
        if c.coordinator:
            try:
                split_peer_maddr(c.coordinator)
            except ValueError as e:
                raise ConfigError(f"--coordinator: {e}") from None
        token = None
        if c.token:
            try:
                token = JoinToken.from_text(c.token).to_bytes()
            except RemoteProtocolError as e:
                raise ConfigError(f"--token is not a join token: {e}") from None
        return key, token

    async def start(self) -> None:
        key, token = self.validate()
        c = self.config
        self.host = await Host.start(key, HostConfig(c.initial_peers, c.host_maddrs, c.announce_maddrs))
        self.transport = Transport(self.host, TransportConfig(direct=c.direct_port >= 0, direct_port=max(c.direct_port, 0)))
        self.transport.on(Hello, self._on_hello)
        await self.transport.start()
        log.info("peer id %s, listening on %s", self.host.peer_id, " ".join(await self.host.visible_maddrs()))
        caps = await asyncio.get_running_loop().run_in_executor(None, capabilities.measure, c.device)
        log.info("capabilities: %s", ", ".join(f"{k}={v}" for k, v in caps.items()))
        self.membership = Membership(self.host, self.transport, c, caps, token)
        self.membership.on_assignment = self._on_assignment
        self._tasks += [
            asyncio.create_task(self.membership.run(), name="membership"),
            asyncio.create_task(self.membership.publish_records(), name="member-records"),
        ]

    def _on_assignment(self, assignment: RoleAssignment) -> None:
        """Start (or stop) the work of a role. Roles other than replica come in later layers."""
        if assignment.role == "replica" and self.replica is None:
            from .replica import Replica, RunConfigError, run_config_of

            try:
                run = run_config_of(assignment)
            except RunConfigError as e:
                log.error("cannot take the replica role: %s", e)
                return
            self.replica = Replica(self.host, self.transport, self.membership, self.config, run)
            self._role_task = asyncio.create_task(self._run_role(self.replica), name="replica")
        elif assignment.role != "replica" and self.replica is not None:
            log.info("leaving the replica role")
            task, self.replica = self._role_task, None
            task.cancel()

    async def _run_role(self, replica) -> None:
        try:
            await replica.run_forever()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the replica role failed")
        finally:
            await replica.stop()

    async def _on_hello(self, ctx: CallContext) -> Hello:
        return Hello(peer_id=self.transport.peer_id, swarm_id=self.config.swarm_id, software=SOFTWARE)

    async def stop(self) -> None:
        if self._role_task is not None:
            if self.replica is not None:
                self.replica._stop = True  # lets the training thread return between inner steps
            self._role_task.cancel()
            await asyncio.gather(self._role_task, return_exceptions=True)
        if self.membership is not None:
            await self.membership.deregister()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.transport is not None:
            await self.transport.close()
        if self.host is not None:
            await self.host.shutdown()
