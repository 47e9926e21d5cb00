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

    def __init__(self, log, fail: Exception | None = None):
        self.log, self.fail = log, fail

    async def start(self):
        self.log.append("start")

    async def run(self):
        if self.fail is not None:
            raise self.fail
        await asyncio.Event().wait()

    async def stop(self, planned):
        self.log.append(f"stop planned={planned}")


async def until(cond) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the runner did not get there")


def test_a_failed_role_is_stopped_unplanned_reported_once_and_no_role_is_taken_after_it(caplog):
    async def main():
        log, reported = [], []
        kinds = {"replica": lambda: Work(log, fail=FloatingPointError("non-finite gradient norm at inner step 1 (loss nan)")), "stage": lambda: Work(log)}
        runner = RoleRunner(lambda a: kinds[a.role](), on_failure=reported.append)
        runner.want(assignment("replica"))
        await runner.settled()
        await until(lambda: "stop planned=False" in log)
        assert log == ["start", "stop planned=False"] and runner.role is None
        reason = "the work role failed: training diverged (non-finite gradient norm at inner step 1 (loss nan)); is a learning rate too high?"
        assert reported == [reason] and runner.failure == reason
        runner.want(assignment("stage"))  # declined until the node restarts, with one line saying why
        await runner.settled()
        runner.want(assignment("idle"))
        await runner.settled()
        assert log == ["start", "stop planned=False"] and runner.role is None and reported == [reason]
        await runner.stop()

    with caplog.at_level("DEBUG", logger="node.roles.runner"):
        asyncio.run(main())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [m for lvl, m in lines if lvl == "ERROR"] == [
        "the work role failed: training diverged (non-finite gradient norm at inner step 1 (loss nan)); is a learning rate too high?; "
        "this node takes no role until it is restarted"
    ]
    assert sum("not taking the stage role" in m for _, m in lines) == 1
    assert not any(r.exc_info for r in caplog.records)  # an expected failure: no traceback, even at DEBUG


def test_a_role_that_cannot_be_made_or_started_or_fails_unexpectedly_is_a_failure_too(caplog):
    async def main():
        def factory(a):
            raise RoleError(f"no {a.role} here")

        reported = []
        runner = RoleRunner(factory, on_failure=reported.append)
        runner.want(assignment("expert"))
        await runner.settled()
        assert reported == ["the expert role failed: no expert here"] and runner.role is None

        log = []
        runner = RoleRunner(lambda a: Work(log, fail=KeyError("weight")), on_failure=reported.append)
        runner.want(assignment("stage"))
        await runner.settled()
        await until(lambda: len(reported) == 2)
        assert reported[1] == "the work role failed: KeyError: 'weight'" and log == ["start", "stop planned=False"]
        await runner.stop()

    with caplog.at_level("DEBUG", logger="node.roles.runner"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and not any(r.exc_info for r in errors)  # one line each
    assert [r.getMessage() for r in caplog.records if r.exc_info] == ["the work role's traceback"]  # a bug's, at DEBUG only
    assert all(r.levelname == "DEBUG" for r in caplog.records if r.exc_info)


def test_a_replicas_failed_round_is_noted_and_the_coordinator_records_it_as_an_event(tmp_path):
    from coordinator.config import CoordinatorConfig
    from coordinator.service import Coordinator
    from node.averaging.config import AverageReport
    from node.net.transport import CallContext, Transport
    from node.roles.replica import Replica
    from protocol import Heartbeat, Register

    async def main():
        (host,) = await start_hosts(1)
        transport = Transport(host)
        coord = Coordinator(CoordinatorConfig(data_dir=str(tmp_path / "coordinator"), http=""))
        coord.validate()
        try:
            config = NodeConfig(data_dir=str(tmp_path / "node"))
            (tmp_path / "node").mkdir()
            membership = Membership(host, transport, config, {})
            replica = Replica(RoleContext(host, transport, membership, config), RunConfig(min_replicas=1))
            failed = AverageReport(key="outer-0-abcdef12", reason="too late or alone")
            try:
                await replica._round_failed(failed, moved_on=False, wait_s=0.0)  # alone: nobody got further
            finally:
                await replica.stop(planned=True)
            p = membership.progress
            assert list(p.notes) == ["outer step 0: averaging failed (too late or alone)"] and p.step == 1
            # what the next heartbeat carries, as the coordinator gets it
            async def receive():
                raise AssertionError("one frame")

            peer = host.peer_id
            await coord.on_register(CallContext(peer, Register(peer_id=peer), receive))
            await coord.on_heartbeat(CallContext(peer, Heartbeat(peer_id=peer, step=p.step, notes=tuple(p.notes)), receive))
            events = (await coord.status())["events"]
            assert [(e["kind"], e["peer_id"], e["detail"]) for e in events] == [("round_failed", peer, "outer step 0: averaging failed (too late or alone)")]
        finally:
            await coord.stop()
            await transport.close()
            await host.shutdown()

    asyncio.run(main())
