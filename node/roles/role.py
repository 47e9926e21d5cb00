"""The role interface: what every role is, and what it is given.

A role is one object with three steps:
- `start()`: take the role's services (its averager namespace, its RPC handlers); raise
  `RoleError` if the node cannot take it (nothing is left registered then);
- `run()`: the work, until it ends or is cancelled (a role whose work runs in threads tells
  them to return when it is cancelled);
- `stop(planned)`: give everything back: cancel its tasks, unregister its services.
  `planned` is True when the node leaves the role by plan (a new assignment, Ctrl-C): a role
  with something to hand over (a stage's parameters, an expert shard) hands it over first;
  False after a failure.

Every role is built as `Cls(ctx, run, assignment)` (node/roles/registry.py makes it).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from ..activity import Activity


class RoleError(Exception):
    """This node cannot take the role it was assigned (the message says why)."""


@dataclass(frozen=True)
class RoleContext:
    """What the daemon gives every role: its libp2p host, its RPC transport, its membership (the
    progress it reports, the coordinator it knows), the node's settings, and the node's activity
    (what the role counts as it works: its steps, rounds, queues; node/activity.py)."""

    host: Any  # node.net.host.Host
    transport: Any  # node.net.transport.Transport
    membership: Any  # node.net.membership.Membership
    node_config: Any  # node.config.NodeConfig
    activity: Activity = field(default_factory=Activity)


class Role(abc.ABC):
    name: str = "role"

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def run(self) -> None: ...

    @abc.abstractmethod
    async def stop(self, planned: bool) -> None: ...
