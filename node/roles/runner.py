"""The runner that switches a node between roles (role.py says what a role is).

`RoleRunner` holds at most one role. Each assignment from the coordinator goes to `want()`;
switches run one at a time, in order, and the old role's `stop()` is awaited before the next
role starts, so two roles never hold the same services (the transport and the averaging
service refuse a second owner: a switch that did not wait would fail loudly, not steal).
Assignments that arrive during a switch collapse into the newest. Which role object an
assignment makes is the factory's (registry.py `make_role`).

A role that fails (it cannot be made or started, or its `run()` raises) is not retried: the
same role would most likely fail the same way (training that diverges, a model this node cannot
build), and a coordinator that keeps assigning it would make the node loop. The reason goes to
`on_failure` (the daemon reports it in heartbeats, and the coordinator plans the node idle),
and later assignments are declined until the node is restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from protocol.session import MAX_NOTE_LEN

from protocol import RoleAssignment

from .role import Role, RoleError

log = logging.getLogger(__name__)


def role_key(a: RoleAssignment | None) -> tuple | None:
    """What identifies the work of an assignment (None: no role). The same work under a new
    plan epoch is kept running; a new run configuration restarts it."""
    if a is None or a.role == "idle":
        return None
    return (a.role, a.stage, a.expert, a.config)


RoleFactory = Callable[[RoleAssignment], "Role | None"]

# what a role raises for a reason its message says in full: one line is the whole story. Any
# other exception is a bug: one line too (the node keeps serving), its traceback at DEBUG
EXPECTED_FAILURES = (RoleError, FloatingPointError)


def failure_reason(name: str, e: Exception) -> str:
    """One line for the operator: what failed and why."""
    why = " ".join(str(e).split()) or "no message"
    if isinstance(e, FloatingPointError):
        why = f"training diverged ({why}); is a learning rate too high?"
    elif not isinstance(e, EXPECTED_FAILURES):
        why = f"{type(e).__name__}: {why}"
    return f"the {name} role failed: {why}"[:MAX_NOTE_LEN]


class RoleRunner:
    """At most one role at a time; each switch awaits the old role's teardown first."""

    def __init__(self, factory: RoleFactory, on_failure: Callable[[str], None] | None = None):
        self._factory = factory
        self.on_failure = on_failure  # called with the reason when a role fails
        self.failure = ""  # why a role failed ("": none did): no role is taken again
        self.role: Role | None = None
        self.key: tuple | None = None
        self._wanted: RoleAssignment | None = None
        self._switcher: asyncio.Task | None = None
        self._run_task: asyncio.Task | None = None
        self.switches = 0  # completed switches (for tests and logs)

    def want(self, assignment: RoleAssignment) -> None:
        """The coordinator assigned this (called from membership, on every change)."""
        self._wanted = assignment
        if self._switcher is None or self._switcher.done():
            self._switcher = asyncio.create_task(self._switch(), name="role-switch")

    async def settled(self) -> None:
        """Until no switch is under way."""
        while self._switcher is not None and not self._switcher.done():
            await asyncio.shield(self._switcher)

    async def _switch(self) -> None:
        while self._wanted is not None:
            a, self._wanted = self._wanted, None
            key = role_key(a)
            if key == self.key and self.role is not None:
                continue
            await self._stop_role(planned=True)
            self.switches += 1
            if key is None:
                continue
            if self.failure:
                log.warning("not taking the %s role: %s (restart the node to take a role again)", a.role, self.failure)
                continue
            try:
                role = self._factory(a)
            except Exception as e:
                self._failed(a.role, e)
                continue
            if role is None:
                continue
            try:
                await role.start()
            except Exception as e:
                self._failed(role.name, e)
                await role.stop(planned=False)
                continue
            self.role, self.key = role, key
            self._run_task = asyncio.create_task(self._run(role), name=role.name)

    async def _run(self, role: Role) -> None:
        try:
            await role.run()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failed(role.name, e)
            if self.role is role:  # give its services back
                self.role, self.key, self._run_task = None, None, None
                await role.stop(planned=False)

    def _failed(self, name: str, e: Exception) -> None:
        self.failure = failure_reason(name, e)
        log.error("%s; this node takes no role until it is restarted", self.failure)
        if not isinstance(e, EXPECTED_FAILURES):
            log.debug("the %s role's traceback", name, exc_info=e)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    async def _stop_role(self, planned: bool) -> None:
        role, task = self.role, self._run_task
        self.role, self.key, self._run_task = None, None, None
        if role is None:
            return
        log.info("leaving the %s role", role.name)
        if task is not None:  # the work ends first, then its services go
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await role.stop(planned)

    async def stop(self) -> None:
        """Stop switching and stop the role (planned: the node is leaving)."""
        self._wanted = None
        if self._switcher is not None:
            self._switcher.cancel()
            await asyncio.gather(self._switcher, return_exceptions=True)
        await self._stop_role(planned=True)
