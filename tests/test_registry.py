"""The SQLite membership registry: real files in tmp_path, a real SIGKILL, no mocks."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.planner import MemberView, PlannerConfig, plan_roles
from coordinator.history import ProgressPoint
from coordinator.registry import AsyncRegistry, Member, Registry, RegistryError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "registry.sqlite")
    yield r
    r.close()


def test_register_get_members_sorted(reg):
    m = reg.register("peer-b", ["/ip4/1.2.3.4/tcp/1"], {"device": "cpu", "tflops": 0.05}, now=100.0)
    assert m == Member(
        peer_id="peer-b",
        maddrs=("/ip4/1.2.3.4/tcp/1",),
        capabilities={"device": "cpu", "tflops": 0.05},
        registered_at=100.0,
        last_seen=100.0,
    )
    reg.register("peer-a", [], {}, now=101.0, wanted_role="trainer")
    assert [m.peer_id for m in reg.members()] == ["peer-a", "peer-b"]
    assert reg.get("peer-a").wanted_role == "trainer"
    assert reg.get("nobody") is None


def test_reregistration_keeps_role_and_first_registration_time(reg):
    reg.register("p", ["/ip4/1.1.1.1/tcp/1"], {"tflops": 1.0}, now=10.0)
    assert reg.set_assignment("p", "stage", 2, None, epoch=7)
    reg.heartbeat("p", now=12.0, step=5, loss=2.5)
    m = reg.register("p", ["/ip4/2.2.2.2/tcp/2"], {"tflops": 2.0}, now=20.0, wanted_role="stage")
    assert (m.role, m.stage, m.expert, m.epoch) == ("stage", 2, None, 7)
    assert m.registered_at == 10.0 and m.last_seen == 20.0
    assert m.maddrs == ("/ip4/2.2.2.2/tcp/2",) and m.capabilities == {"tflops": 2.0}
    assert m.wanted_role == "stage" and m.step == 5


def test_heartbeat_updates_reported_values_and_keeps_unreported_ones(reg):
    assert reg.heartbeat("ghost", now=1.0) is None  # unknown peers must register first
    reg.register("p", [], {}, now=1.0)
    m = reg.heartbeat("p", now=2.0, step=10, loss=3.0, samples_per_second=40.0, state_hash="abc")
    assert (m.last_seen, m.step, m.loss, m.samples_per_second, m.state_hash) == (2.0, 10, 3.0, 40.0, "abc")
    m = reg.heartbeat("p", now=3.0, step=11)
    assert (m.last_seen, m.step, m.loss, m.samples_per_second, m.state_hash) == (3.0, 11, 3.0, 40.0, "abc")


@pytest.mark.parametrize("field", ["loss", "samples_per_second"])
def test_heartbeat_refuses_non_finite_numbers(reg, field):
    reg.register("p", [], {}, now=1.0)
    with pytest.raises(ValueError, match=f"{field} must be finite"):
        reg.heartbeat("p", now=2.0, **{field: float("nan")})
    assert reg.get("p").last_seen == 1.0


def test_register_refuses_capabilities_that_are_not_json(reg):
    with pytest.raises(ValueError, match="capabilities of 'p' are not JSON-serializable"):
        reg.register("p", [], {"tflops": float("inf")}, now=1.0)
    with pytest.raises(ValueError, match="not JSON-serializable"):
        reg.register("p", [], {"blob": object()}, now=1.0)
    assert reg.members() == []


def test_remove(reg):
    reg.register("p", [], {}, now=1.0)
    assert reg.remove("p") is True
    assert reg.remove("p") is False
    assert reg.get("p") is None


def test_assignments_in_one_transaction_with_meta(reg):
    for p in ("a", "b"):
        reg.register(p, [], {}, now=1.0)
    unknown = reg.set_assignments([("a", "stage", 0, None), ("b", "stage", 1, None), ("gone", "stage", 2, None)], epoch=3, meta={"epoch": 3})
    assert unknown == ["gone"]
    assert [(m.role, m.stage, m.epoch) for m in reg.members()] == [("stage", 0, 3), ("stage", 1, 3)]
    assert reg.get_meta("epoch") == 3
    assert reg.set_assignment("gone", "stage", 0, None, epoch=4) is False


def test_a_failing_batch_leaves_nothing_half_written(reg):
    reg.register("a", [], {}, now=1.0)
    with pytest.raises(ValueError, match="meta value for 'bad' is not JSON-serializable"):
        reg.set_assignments([("a", "expert", None, "e1")], epoch=9, meta={"epoch": 9, "bad": object()})
    m = reg.get("a")
    assert (m.role, m.expert, m.epoch) == (None, None, 0)
    assert reg.get_meta("epoch") is None
    reg.register("b", [], {}, now=2.0)  # the registry still works after the rollback
    assert len(reg.members()) == 2


def test_views_feed_the_planner(reg):
    reg.register("a", [], {"tflops": 2.0}, now=1.0)
    reg.register("b", [], {}, now=2.0, wanted_role="trainer")
    reg.set_assignment("a", "stage", 0, None, epoch=1)
    reg.heartbeat("a", now=5.0, samples_per_second=12.5)
    views = reg.views()
    assert views[0] == MemberView(
        peer_id="a", last_seen=5.0, registered_at=1.0, role="stage", stage=0, throughput=12.5, capabilities={"tflops": 2.0}
    )
    plan = plan_roles(views, PlannerConfig(mode="pipeline", num_stages=2))
    assert plan.assignments["a"].reason == "kept" and plan.assignments["b"].role == "trainer"
    reg.set_assignment("a", "stage", 0, None, epoch=2)  # the same work under a new plan: still measured
    assert reg.get("a").samples_per_second == 12.5
    reg.set_assignment("a", "stage", 1, None, epoch=3)  # another stage: measured anew
    assert reg.get("a").samples_per_second is None
    reg.heartbeat("a", now=6.0)  # a report without a rate keeps none
    assert reg.get("a").samples_per_second is None


def test_meta_values_round_trip_as_json(reg):
    assert reg.get_meta("missing") is None
    assert reg.get_meta("missing", default=0) == 0
    for value in (42, 1.5, "text", True, None, [1, 2], {"k": "v"}):
        reg.set_meta("key", value)
        assert reg.get_meta("key") == value


def test_everything_survives_close_and_reopen_in_wal_full_mode(tmp_path):
    path = tmp_path / "r.sqlite"
    with Registry(path) as reg:
        reg.register("p", ["/ip4/1"], {"tflops": 1.0}, now=1.0)
        reg.set_assignment("p", "replica", None, None, epoch=2)
        reg.set_meta("swarm_step", 17)
        reg.history.add_progress(ProgressPoint(17, 1.25, 3.0, "p"))
    with Registry(path) as reg:
        assert reg.get("p").role == "replica" and reg.get("p").epoch == 2
        assert reg.get_meta("swarm_step") == 17
        assert reg.history.progress() == [ProgressPoint(17, 1.25, 3.0, "p")]
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_the_registry_is_usable_from_several_threads(reg):
    def work(t: int) -> None:
        for i in range(20):
            reg.register(f"t{t}-{i:02d}", [], {}, now=float(i))
            reg.heartbeat(f"t{t}-{i:02d}", now=float(i) + 1, step=i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert len(reg.members()) == 80
    assert all(m.last_seen == m.registered_at + 1 for m in reg.members())


# -- bad paths ---------------------------------------------------------------------------------


def test_path_that_is_a_directory(tmp_path):
    with pytest.raises(RegistryError, match=r"cannot open registry at .*: it is a directory"):
        Registry(tmp_path)


def test_parent_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RegistryError, match=r"cannot open registry at .*file/r\.sqlite: cannot create"):
        Registry(tmp_path / "file" / "r.sqlite")


def test_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "r.sqlite"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(RegistryError, match=r"cannot open registry at .*r\.sqlite: file is not a database"):
        Registry(path)
    assert path.read_bytes().startswith(b"this is not sqlite")  # never overwritten


def test_file_from_a_newer_version(tmp_path):
    path = tmp_path / "r.sqlite"
    Registry(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(RegistryError, match="schema version 99, this code reads version 2"):
        Registry(path)


def test_missing_parent_directories_are_created(tmp_path):
    with Registry(tmp_path / "a" / "b" / "r.sqlite") as reg:
        reg.register("p", [], {}, now=1.0)
    assert (tmp_path / "a" / "b" / "r.sqlite").is_file()


# -- crash safety ------------------------------------------------------------------------------

# Writes members forever, printing how many are committed after each commit.
_WRITER = r"""
import sys
from coordinator.registry import Registry
reg = Registry(sys.argv[1])
i = 0
while True:
    reg.register(f"peer-{i:05d}", ["/ip4/127.0.0.1/tcp/1"], {"tflops": 1.0}, now=float(i))
    reg.set_assignment(f"peer-{i:05d}", "replica", None, None, epoch=i)
    reg.set_meta("written", i + 1)
    i += 1
    print(i, flush=True)
"""


def test_committed_writes_survive_sigkill_mid_write(tmp_path):
    path = tmp_path / "r.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        committed = 0
        while committed < 30:  # the child prints after every commit; EOF means it died
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"writer exited early: {proc.stderr.read()}")
            committed = int(line)
        os.kill(proc.pid, signal.SIGKILL)  # while it keeps writing
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    with Registry(path) as reg:
        members = reg.members()
        assert len(members) >= committed  # everything reported as committed is there
        assert [m.peer_id for m in members] == [f"peer-{i:05d}" for i in range(len(members))]
        written = reg.get_meta("written")
        assert written >= committed
        # each member's three writes are separate commits: at most the last one is partial
        assert all(m.role == "replica" for m in members[: written])
        reg.register("after", [], {}, now=1e6)  # and it is writable again
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()


# -- AsyncRegistry: the event loop's side ------------------------------------------------------


def test_async_registry_writes_off_the_loop_on_one_thread_in_call_order(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    heartbeat_threads = set()
    real_heartbeat = reg.heartbeat

    def heartbeat(*args, **kwargs):  # the real write, noting the thread it runs on
        heartbeat_threads.add(threading.get_ident())
        return real_heartbeat(*args, **kwargs)

    reg.heartbeat = heartbeat

    async def main():
        areg = AsyncRegistry(reg)
        try:
            await areg.register("p", ["/ip4/1.2.3.4/tcp/1"], {}, now=1.0)
            # calls made back to back, none awaited before the next: each job sees every write
            # made before it and none made after it
            calls = []
            for i in range(40):
                calls.append(areg.heartbeat("p", now=2.0 + i, step=i))
                calls.append(areg.run(lambda r: (threading.get_ident(), r.get("p").step)))
            results = await asyncio.gather(*calls)
            seen = results[1::2]
            assert [step for _, step in seen] == list(range(40))
            assert heartbeat_threads == {t for t, _ in seen}  # one thread for all of them...
            assert threading.get_ident() not in heartbeat_threads  # ...and not the loop's
            assert (await areg.get("p")).last_seen == 41.0
        finally:
            await areg.close()

    asyncio.run(main())
    with Registry(tmp_path / "r.sqlite") as again:  # committed, as before
        assert again.get("p").step == 39


def test_async_registry_keeps_the_loop_free_while_a_write_waits(tmp_path):
    async def main():
        areg = AsyncRegistry(Registry(tmp_path / "r.sqlite"))
        gate = threading.Event()
        try:
            await areg.register("p", [], {}, now=1.0)
            busy = asyncio.ensure_future(areg.run(lambda r: gate.wait(30)))  # holds the registry thread
            write = asyncio.ensure_future(areg.heartbeat("p", now=2.0, step=5))
            done, _ = await asyncio.wait([busy, write], timeout=0.2)  # the loop runs meanwhile
            assert not done  # the heartbeat waits its turn behind the job before it
            gate.set()
            assert await busy and (await write).step == 5
        finally:
            gate.set()
            await areg.close()

    asyncio.run(main())


def test_async_registry_passes_errors_through(tmp_path):
    async def main():
        areg = AsyncRegistry(Registry(tmp_path / "r.sqlite"))
        try:
            with pytest.raises(ValueError, match="loss must be finite"):
                await areg.heartbeat("p", now=1.0, loss=float("nan"))
            assert await areg.heartbeat("nobody", now=1.0) is None
        finally:
            await areg.close()

    asyncio.run(main())


def test_a_rate_measured_at_other_work_than_the_current_assignment_is_not_stored(reg):
    from coordinator.journal import Recorder
    from coordinator.service import _heartbeat
    from protocol import Heartbeat

    rec = Recorder(reg.history, context=None)
    reg.register("a", [], {}, now=1.0)
    reg.set_assignment("a", "stage", 1, None, epoch=1)
    # the node has not switched yet: its rate is the old stage's
    assert _heartbeat(reg, rec, Heartbeat(peer_id="a", samples_per_second=50.0, measured_as="stage:0"), 2.0)[0].samples_per_second is None
    assert _heartbeat(reg, rec, Heartbeat(peer_id="a", samples_per_second=70.0, measured_as="stage:1"), 3.0)[0].samples_per_second == 70.0
    assert _heartbeat(reg, rec, Heartbeat(peer_id="a", samples_per_second=80.0), 4.0)[0].samples_per_second == 80.0  # no label: as before
    assert _heartbeat(reg, rec, Heartbeat(peer_id="nobody"), 5.0) == (None, False)


def test_a_failed_role_is_stored_until_the_member_registers_again(reg):
    reg.register("a", [], {}, now=1.0)
    assert reg.heartbeat("a", now=2.0, failed="the replica role failed: boom").failed == "the replica role failed: boom"
    assert reg.heartbeat("a", now=3.0).failed == "the replica role failed: boom"  # not reported: kept
    assert reg.views()[0].failed == "the replica role failed: boom"  # the planner sees it
    assert reg.register("a", [], {}, now=4.0).failed is None  # registering again is a restart
    reg.heartbeat("a", now=5.0, failed="again")
    assert reg.heartbeat("a", now=6.0, failed="").failed is None  # "": its role runs
