"""The node daemon: a libp2p host, the RPC transport, membership, and (in later layers) a role.

`Node.start()` validates everything a user can get wrong before anything is started, so a bad
setting is one clear line, never a half-started daemon. `Node.stop()` deregisters, cancels
every task it created, and shuts p2pd down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from protocol import Hello, LocalProtocolError, RoleAssignment, SigningKey
from protocol.records import owner_of

from . import capabilities
from .activity import Activity
from .config import ConfigError, NodeConfig, averager_config, transport_config
from .net.membership import Membership, Refused
from .osutil import write_json
from .net.host import Host, HostConfig
from .net.gate import MemberGate
from .progress_line import ProgressLine
from .preflight import announce_warning, check_data_dir, check_node, load_identity  # noqa: F401 (check_data_dir, load_identity: imported from here too)
from .roles.registry import make_role
from .roles.role import Role, RoleContext
from .roles.runner import RoleRunner
from .net.transport import CallContext, Transport

log = logging.getLogger(__name__)

SOFTWARE = "swarmtrain/0.1"


class Node:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.host: Host | None = None
        self.transport: Transport | None = None
        self.membership: Membership | None = None
        self._tasks: list[asyncio.Task] = []
        self.roles = RoleRunner(self._make_role, self._role_failed)
        self.fatal: asyncio.Future | None = None  # set to the error that ends the daemon (the coordinator refused us): serve() stops it
        self.activity = Activity()  # what the roles do: /metrics, /status, the progress line
        self.software = SOFTWARE
        self.started_at = time.time()
        self.http = None  # --http: /metrics and /status (node/metrics.py)

    def validate(self) -> tuple[SigningKey, bytes | None]:
        """Everything checkable before starting: raises ConfigError with one clear line. (Each
        value's type and bounds were checked when the NodeConfig was made; the checks that need
        neither torch nor hivemind are node/preflight.py's, which the CLI runs first.)"""
        c = self.config
        key, token = check_node(c)
        reason = capabilities.check_device(c.device)
        if reason:
            raise ConfigError(reason)
        if c.data:
            from .models.data import DataError, load_corpus

            try:
                load_corpus(c.data, text_field=c.text_field)  # what the roles train on: missing, empty or unreadable data ends here
            except (DataError, OSError) as e:
                raise ConfigError(f"--data: {e}") from None
        transport_config(c)
        try:
            averager_config(c)
        except (ValueError, LocalProtocolError) as e:  # AveragerConfig's own checks, should they refuse what ours let through
            raise ConfigError(f"[averager] settings: {e}") from None
        return key, token

    async def start(self) -> None:
        key, token = self.validate()
        c = self.config
        # before any thread computes: a thread takes torch's thread count when it first
        # computes and keeps it; set_num_threads later changes only the caller's and new threads'
        torch.set_num_threads(c.torch_threads())
        self.host = await Host.start(key, HostConfig(c.initial_peers, c.host_maddrs, c.announce_maddrs, swarm_id=c.swarm_id, client_mode=c.client_mode, relays=c.relays))
        self.transport = Transport(self.host, transport_config(c))
        if owner_of(c.swarm_id) is not None:  # an owned swarm: members only (node/net/gate.py)
            self.transport.use_gate(MemberGate(c.swarm_id))
        self.transport.on(Hello, self._on_hello)
        await self.transport.start()
        announced = await self.host.visible_maddrs()
        log.info("peer id %s, listening on %s", self.host.peer_id, " ".join(announced) or "nothing (client mode)")
        warning = announce_warning(announced, c.initial_peers)
        if warning:
            log.warning(warning)
        caps = await asyncio.get_running_loop().run_in_executor(None, capabilities.measure, c.device)
        caps["software"] = SOFTWARE  # for the operator's member list
        if c.client_mode:
            caps["client_mode"] = 1  # the coordinator gives it a role that only calls out
        if c.relays:
            caps["relayed"] = 1  # reached through a relay (for the operator's member list)
        log.info("capabilities: %s", ", ".join(f"{k}={v}" for k, v in caps.items()))
        self.membership = Membership(self.host, self.transport, c, caps, token)
        self.transport.scores.on_ban = self.membership.progress.banned  # the coordinator's operator sees our bans
        self.membership.on_assignment = self.roles.want
        if c.http:
            from .metrics import http_app
            from .net.http import serve_http

            self.http = await serve_http(http_app(self), c.http)
            log.info("metrics at http://%s/metrics, status at /status", self.http.address)
        self.fatal = asyncio.get_running_loop().create_future()
        membership = asyncio.create_task(self.membership.run(), name="membership")
        membership.add_done_callback(self._membership_ended)
        self._tasks += [
            membership,
            asyncio.create_task(self.membership.publish_records(), name="member-records"),
            asyncio.create_task(self.host.keep_joined(self.membership.known_peers, on_rejoined=self.membership.publish_soon), name="dht-rejoin"),
            asyncio.create_task(self._write_transport_stats(), name="transport-stats"),
            asyncio.create_task(ProgressLine(self.activity).run(), name="progress-line"),
        ]
        if c.relays:
            self._tasks.append(asyncio.create_task(self.transport.keep_relays(c.relays), name="relays"))

    async def _write_transport_stats(self, every_s: float = 2.0) -> None:
        """The transport's counters (calls, pipes, relayed bytes...) in DATA_DIR/transport-stats.json."""
        path = Path(self.config.data_dir) / "transport-stats.json"
        while True:
            await asyncio.sleep(every_s)
            write_json(path, dict(self.transport.stats))

    def _membership_ended(self, task: asyncio.Task) -> None:
        """The coordinator refused us (the only way membership ends by itself): the node stops."""
        if not task.cancelled() and isinstance(task.exception(), Refused) and not self.fatal.done():
            self.fatal.set_exception(task.exception())

    def _make_role(self, assignment: RoleAssignment) -> Role:
        """The role object for an assignment (node/roles/registry.py); RoleError if this node cannot take it."""
        self.activity.begin(assignment.label)
        return make_role(RoleContext(self.host, self.transport, self.membership, self.config, self.activity), assignment)

    def _role_failed(self, reason: str) -> None:
        """Tell the coordinator now: it plans this node idle and shows why."""
        if self.membership is not None:
            self.membership.progress.failure = reason
            self.membership.heartbeat_soon()

    async def _on_hello(self, ctx: CallContext) -> Hello:
        return Hello(peer_id=self.transport.peer_id, swarm_id=self.config.swarm_id, software=SOFTWARE)

    async def stop(self) -> None:
        await self.roles.stop()
        if self.membership is not None:
            await self.membership.deregister()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.http is not None:
            await self.http.stop()
        if self.transport is not None:
            await self.transport.close()
        if self.host is not None:
            await self.host.shutdown()
