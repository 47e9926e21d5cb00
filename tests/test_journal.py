"""The swarm's history in a real registry file (SQLite in tmp_path), filled by the coordinator's
own registry jobs (coordinator/service.py `_heartbeat`, `_tick`): time is moved by hand through a
day of heartbeats from several members."""

from __future__ import annotations

import sqlite3

import pytest

from coordinator.history import Event, ProgressPoint, Thinning
from coordinator.journal import Recorder
from coordinator.registry import SCHEMA_VERSION, Registry
from coordinator.service import _heartbeat, _tick
from protocol import Heartbeat
from protocol.errors import LocalProtocolError

pytestmark = pytest.mark.timeout(300)

DAY = 86400.0
T0 = 1_800_000_000.0  # a run that started at this time (seconds since the epoch)


def members(reg: Registry, role: str, *peers: str) -> None:
    for p in peers:
        reg.register(p, [], {"device": "cpu"}, now=T0)
        reg.set_assignment(p, role, None, None, epoch=1)


def test_a_day_of_a_replica_swarm_keeps_one_point_per_outer_step_thinned_to_a_bounded_history(tmp_path):
    with Registry(tmp_path / "r.sqlite") as reg:
        rec = Recorder(reg.history, context=64)
        peers = ("a", "b", "c")
        members(reg, "replica", *peers)
        sent = dict.fromkeys(peers, 0)
        t, beats = T0, 0
        while t <= T0 + DAY + 3600:  # each replica heartbeats every 30 s; an outer step takes 90 s
            for i, p in enumerate(peers):
                step = int((t - T0) // 90)
                sent[p] += 1_000_000
                _heartbeat(reg, rec, Heartbeat(peer_id=p, step=step, loss=5.0 / (1 + step), samples_per_second=2.0, bytes_sent=sent[p]), t + i)
                beats += 1
            _tick(reg, rec, t + 10)
            t += 30.0
        last_step = int((t - 30.0 - T0) // 90)
        progress, throughput = reg.history.progress(), reg.history.throughput()

    policy = Thinning()
    assert beats > 8000 and last_step > 900
    assert len(progress) <= policy.bound() and len(throughput) <= policy.bound()
    assert len(progress) < 700 and len(throughput) < 700  # a day: the newest densely, older ones by the hour's tiers
    assert progress[0] == ProgressPoint(0, 5.0, T0, "a")  # the first point: where the run started
    assert progress[-1].step == last_step and progress[-1].loss == pytest.approx(5.0 / (1 + last_step))
    steps = [p.step for p in progress]
    assert steps == sorted(set(steps))  # one point per outer step, in order
    assert steps[-policy.dense:] == list(range(last_step - policy.dense + 1, last_step + 1))  # the newest: every step
    assert max(b.time - a.time for a, b in zip(progress, progress[1:])) <= 3600  # the whole day, no hole wider than its tier
    # throughput: three replicas at 2 samples/s, 64 tokens a sample; 3 MB sent every 30 s
    newest = throughput[-1]
    assert (newest.members, newest.samples_per_second, newest.tokens_per_second) == (3, 6.0, 384.0)
    assert newest.bytes_per_second == pytest.approx(3_000_000 / 30.0)
    assert throughput[0].time <= T0 + 3600 and throughput[-1].time > T0 + DAY


def test_trainers_make_interval_points_for_a_day_and_none_while_they_idle(tmp_path):
    with Registry(tmp_path / "r.sqlite", thinning=Thinning(dense=100)) as reg:
        rec = Recorder(reg.history, context=None, interval_s=5.0)
        members(reg, "trainer", "t1", "t2")
        t = T0
        while t <= T0 + DAY:  # heartbeats every 120 s, 8 more micro-batches each time
            for i, p in enumerate(("t1", "t2")):
                n = 8 * int((t - T0) // 120 + 1)
                _heartbeat(reg, rec, Heartbeat(peer_id=p, step=n, loss=2.0 + i, samples_per_second=1.0), t)
            _tick(reg, rec, t + 1)
            t += 120.0
        trained = reg.history.progress()
        while t <= T0 + DAY + 3600:  # an hour idle: the same step and loss again
            for p in ("t1", "t2"):
                _heartbeat(reg, rec, Heartbeat(peer_id=p, step=n, loss=2.5, samples_per_second=1.0), t)
            _tick(reg, rec, t + 1)
            t += 120.0
        assert reg.history.progress() == trained
        assert reg.history.throughput()[-1].samples_per_second == 0.0  # idle over ACTIVE_S: not counted

    assert len(trained) <= Thinning(dense=100).bound() and len(trained) < 500
    assert all(p.loss == 2.5 and p.peer_id is None for p in trained)  # the mean of both trainers
    assert trained[0].step == 8 and trained[-1].step == 8 * (int(DAY // 120) + 1)


def test_events_are_bounded_newest_last_and_a_flood_of_notes_or_refusals_is_limited(tmp_path):
    with Registry(tmp_path / "r.sqlite", max_events=40) as reg:
        rec = Recorder(reg.history, context=None)
        members(reg, "replica", "a")
        for i in range(30):
            assert rec.event(T0 + i, "join", f"p{i}", f"join {i}")
        assert [e.detail for e in reg.history.events()] == [f"join {i}" for i in range(20, 30)]  # of one kind: a quarter
        assert reg.history.events(limit=2) == [Event(T0 + 28, "join", "p28", "join 28"), Event(T0 + 29, "join", "p29", "join 29")]
        for kind in ("checkpoint", "leave", "evict", "revoke", "checkpoint"):  # the newest 40 of all, whatever kinds pour in
            for i in range(10):
                rec.event(T0 + 40 + i, kind, "p", f"{kind} {i}")
        assert [e.detail for e in reg.history.events()] == [f"{kind} {i}" for kind in ("leave", "evict", "revoke", "checkpoint") for i in range(10)]
        for i in range(100):  # a refused peer retrying every 2 s
            rec.event(T0 + 100 + 2 * i, "refused", "x", "join token refused: expired")
        failing = Heartbeat(peer_id="a", failure="the replica role failed: boom", notes=("outer step 3: averaging failed (alone)",) * 16)
        for i in range(3):  # the failure is told once; the notes up to the limit
            _heartbeat(reg, rec, failing, T0 + 500 + i)
        kinds = [e.kind for e in reg.history.events()]
        assert kinds.count("refused") == 1 and kinds.count("role_failed") == 1 and kinds.count("round_failed") == 10
        rec.event(T0 + 1000, "refused", "x", "join token refused: expired")
        assert reg.history.events()[-1].detail == "join token refused: expired (99 more like it since the last one shown)"
        assert reg.get("a").failed == "the replica role failed: boom"


def test_a_members_bans_are_events_of_the_banned_peer_naming_who_banned_it_and_why(tmp_path):
    with Registry(tmp_path / "r.sqlite", max_events=40) as reg:
        rec = Recorder(reg.history, context=None)
        members(reg, "trainer", "t")
        ban = "liar for 60 s (ban 1): 1 offence in 600 s, the last: a wrong answer (stage 0 forward), caught by a check: it answered twice"
        _heartbeat(reg, rec, Heartbeat(peer_id="t", bans=(ban,)), T0)
        (event,) = [e for e in reg.history.events() if e.kind == "ban"]
        assert event.peer_id == "liar" and event.detail == "banned by t for 60 s (ban 1): 1 offence in 600 s, the last: a wrong answer (stage 0 forward), caught by a check: it answered twice"
    with pytest.raises(LocalProtocolError, match="bans"):  # a ban that names no peer and no reason
        Heartbeat(peer_id="t", bans=("liar",)).validate()


_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE TABLE members (peer_id TEXT PRIMARY KEY, maddrs TEXT NOT NULL, capabilities TEXT NOT NULL, role TEXT, stage INTEGER,
    expert TEXT, epoch INTEGER NOT NULL DEFAULT 0, registered_at REAL NOT NULL, last_seen REAL NOT NULL, step INTEGER, loss REAL,
    samples_per_second REAL, state_hash TEXT, wanted_role TEXT);
INSERT INTO members (peer_id, maddrs, capabilities, role, registered_at, last_seen) VALUES ('a', '[]', '{}', 'replica', 1.0, 2.0);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('epoch', '4');
CREATE TABLE progress (id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, loss REAL, time REAL NOT NULL, peer_id TEXT);
INSERT INTO progress (step, loss, time, peer_id) VALUES (0, 5.0, 10.0, 'a'), (0, 5.0, 10.5, 'b'), (0, 5.0, 12.0, 'a'),
    (1, 4.0, 40.0, 'b'), (1, 4.0, 41.0, 'a');
"""


def test_a_version_1_registry_is_migrated_when_opened(tmp_path):
    path = tmp_path / "r.sqlite"
    db = sqlite3.connect(path)
    db.executescript(_V1)
    db.close()
    with Registry(path) as reg:
        assert reg.get("a").role == "replica" and reg.get("a").failed is None and reg.get_meta("epoch") == 4
        # the old history: a row per heartbeat became one point per step, the first recorded
        assert reg.history.progress() == [ProgressPoint(0, 5.0, 10.0, "a"), ProgressPoint(1, 4.0, 40.0, "b")]
        reg.heartbeat("a", now=3.0, failed="the replica role failed: boom")
        reg.history.add_event(Event(3.0, "role_failed", "a", "boom"))
        assert Recorder(reg.history, context=None).sampler.last_step == 1  # a restart does not make step 1 a point again
    with Registry(path) as reg:
        assert reg.get("a").failed == "the replica role failed: boom" and len(reg.history.events()) == 1
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        db.close()
