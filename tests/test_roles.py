"""The role runner: one role at a time, each switch awaiting the old role's teardown. With real
Replica roles on a real host (p2pd) and transport: a second replica could not even start while
the first one still held its averaging namespace and checkpoint service."""

import asyncio

import pytest

from node.averaging import AveragingService
from node.config import NodeConfig
from node.net.membership import Membership
from node.roles.role import Role, RoleContext, RoleError
from node.roles.runner import RoleRunner
from node.runconfig import RunConfig
from protocol import AvgJoin, CheckpointQuery, RoleAssignment
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)


def assignment(role: str) -> RoleAssignment:
    return RoleAssignment(peer_id="p", role=role, config=RunConfig(min_replicas=1).to_json() if role == "replica" else b"")


def test_replica_idle_replica_awaits_the_old_roles_teardown(tmp_path):
    async def main():
        from node.roles.replica import Replica
        from node.net.transport import Transport

        (host,) = await start_hosts(1)
        transport = Transport(host)
        await transport.start()
        config = NodeConfig(data_dir=str(tmp_path))
        membership = Membership(host, transport, config, {})
        events: list[tuple[str, int]] = []  # (what, which replica)
        made: list = []
        stopping = asyncio.Event()

        def factory(a: RoleAssignment):
            assert a.role == "replica"
            replica = Replica(RoleContext(host, transport, membership, config), RunConfig.from_json(a.config), a)
            k = len(made)
            made.append(replica)
            start, stop = replica.start, replica.stop

            async def started():
                live = [e for e in events if e[0] == "start"], [e for e in events if e[0] == "stopped"]
                events.append(("alive before start", len(live[0]) - len(live[1])))
                await start()
                events.append(("start", k))

            async def stopped(planned):
                stopping.set()
                await asyncio.sleep(0.3)  # a slow teardown: the next role must wait for it
                await stop(planned)
                events.append(("stopped", k))

            replica.start, replica.stop = started, stopped
            return replica

        runner = RoleRunner(factory)
        try:
            runner.want(assignment("replica"))
            await runner.settled()
            assert runner.role is made[0]
            assert AveragingService.of(transport).averagers["replicas"] is made[0].averager
            runner.want(assignment("idle"))
            await stopping.wait()
            runner.want(assignment("replica"))  # while the first replica is being torn down
            await runner.settled()
            assert [e for e in events if e[0] != "alive before start"] == [("start", 0), ("stopped", 0), ("start", 1)]
            assert all(n == 0 for what, n in events if what == "alive before start")  # never two alive
            assert runner.role is made[1] and len(made) == 2
            assert made[0].averager.service is None  # the first gave its namespace back...
            assert AveragingService.of(transport).averagers["replicas"] is made[1].averager  # ...the second holds it
            assert CheckpointQuery in transport.handlers and AvgJoin in transport.handlers
            runner.want(assignment("idle"))
            await runner.settled()
            assert runner.role is None and events[-1] == ("stopped", 1)
            assert CheckpointQuery not in transport.handlers and AvgJoin not in transport.handlers
        finally:
            await runner.stop()
            await transport.close()
            await host.shutdown()

    asyncio.run(main())


class Work(Role):
    """A role for the runner's own rules: it records what happens to it."""

    name = "work"

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    async def start(self):
        self.log.append("start")

    async def run(self):
        if self.fail:
            raise RuntimeError("boom")
        await asyncio.Event().wait()

    async def stop(self, planned):
        self.log.append(f"stop planned={planned}")


def test_a_failed_role_is_stopped_unplanned_and_an_unknown_role_is_refused():
    async def main():
        log = []
        kinds = {"replica": lambda: Work(log, fail=True), "stage": lambda: Work(log)}

        def factory(a):
            if a.role not in kinds:
                raise RoleError(f"no {a.role} here")
            return kinds[a.role]()

        runner = RoleRunner(factory)
        runner.want(assignment("replica"))
        await runner.settled()
        for _ in range(100):
            if "stop planned=False" in log:
                break
            await asyncio.sleep(0.01)
        assert log == ["start", "stop planned=False"] and runner.role is None
        runner.want(assignment("expert"))  # refused: nothing runs, nothing breaks
        await runner.settled()
        assert runner.role is None
        runner.want(assignment("stage"))
        await runner.settled()
        runner.want(RoleAssignment(peer_id="p", role="stage", epoch=5))  # the same work: kept
        await runner.settled()
        assert log == ["start", "stop planned=False", "start"]
        await runner.stop()
        assert log[-1] == "stop planned=True" and runner.role is None

    asyncio.run(main())
