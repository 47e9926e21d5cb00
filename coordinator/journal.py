"""The swarm's history in the registry file, and the recorder that fills it from what members
report. What becomes a point, what is thinned and what is rate-limited is history.py's to
decide; this module only stores it.

    Journal    the progress, throughput and events tables (their schema is registry.py's, so
               one file opens, migrates and commits them all): append, thin, read
    Recorder   heartbeats, ticks and the service's events -> the Journal; it holds the
               decisions' in-memory state (history.py), so it is used only on the registry's
               thread (a job of AsyncRegistry.run), never on the event loop
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterable
from typing import Any

from protocol import Heartbeat

from .history import (
    EVENT_KINDS, INTERVAL_S, Event, EventLimiter, ProgressPoint, ProgressSampler, Rate, Thinning, ThroughputMeter, ThroughputPoint, keep_points,
)  # fmt: skip

MAX_EVENTS = 1000  # rows of the events table (the newest); of one kind, a quarter of that at most
MAX_DETAIL = 512  # characters of an event's detail
THIN_EVERY = 50  # points appended to a series between two thinning passes over it

_SERIES = {  # table -> its columns after id, in the order of its NamedTuple
    "progress": ("step", "loss", "time", "peer_id"),
    "throughput": ("time", "members", "samples_per_second", "tokens_per_second", "bytes_per_second"),
}


class Journal:
    """The history tables: `db` is the registry's connection, `tx` its transaction (commits on
    exit), `lock` the lock its reads take."""

    def __init__(self, db: sqlite3.Connection, tx: Callable[[], Any], lock: threading.RLock, thinning: Thinning = Thinning(),
                 max_events: int = MAX_EVENTS):  # fmt: skip
        self._db, self._tx, self._lock = db, tx, lock
        self.thinning, self.max_events = thinning, max_events
        # since each series was last thinned (the first append after opening thins: a coordinator
        # restarted more often than THIN_EVERY points must not grow its file)
        self._appended = dict.fromkeys(_SERIES, THIN_EVERY - 1)

    def add_progress(self, point: ProgressPoint) -> None:
        self._append("progress", point, point.time)

    def add_throughput(self, point: ThroughputPoint) -> None:
        self._append("throughput", point, point.time)

    def _append(self, table: str, row: tuple, now: float) -> None:
        columns = _SERIES[table]
        with self._tx():
            self._db.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})", tuple(row))
            self._appended[table] += 1
            if self._appended[table] >= THIN_EVERY:
                self._thin(table, now)

    def thin(self, now: float) -> int:
        """Thin every series now (see history.keep_points); the rows dropped."""
        with self._tx():
            return sum(self._thin(table, now) for table in _SERIES)

    def _thin(self, table: str, now: float) -> int:
        self._appended[table] = 0
        rows = self._db.execute(f"SELECT id, time FROM {table} ORDER BY id").fetchall()
        keep = keep_points([t for _, t in rows], now, self.thinning)
        drop = [(i,) for (i, _), k in zip(rows, keep) if not k]
        self._db.executemany(f"DELETE FROM {table} WHERE id = ?", drop)
        return len(drop)

    def progress(self) -> list[ProgressPoint]:
        """Every point kept, oldest first (ready to plot)."""
        return [ProgressPoint(*r) for r in self._rows("progress")]

    def throughput(self) -> list[ThroughputPoint]:
        return [ThroughputPoint(*r) for r in self._rows("throughput")]

    def _rows(self, table: str) -> list[tuple]:
        with self._lock:
            return self._db.execute(f"SELECT {', '.join(_SERIES[table])} FROM {table} ORDER BY id").fetchall()

    def last_step(self) -> int | None:
        """The highest step in the progress history (None: empty)."""
        with self._lock:
            return self._db.execute("SELECT MAX(step) FROM progress").fetchone()[0]

    def add_event(self, event: Event) -> None:
        """Append an event; the oldest beyond `max_events` go, and the oldest of its kind beyond
        a quarter of that (a checkpoint every few minutes must not push the joins out)."""
        with self._tx():
            self._db.execute(
                "INSERT INTO events (time, kind, peer_id, detail) VALUES (?, ?, ?, ?)", (event.time, event.kind, event.peer_id, event.detail[:MAX_DETAIL])
            )
            self._db.execute(
                "DELETE FROM events WHERE kind = ? AND id <= (SELECT id FROM events WHERE kind = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (event.kind, event.kind, max(1, self.max_events // 4)),
            )
            self._db.execute("DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)", (self.max_events,))

    def events(self, limit: int = MAX_EVENTS) -> list[Event]:
        """The newest `limit` events, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT time, kind, peer_id, detail FROM events ORDER BY id DESC LIMIT ?", (max(0, limit),)).fetchall()
        return [Event(*r) for r in reversed(rows)]


class Recorder:
    """What members report -> the Journal (see the module: registry thread only). `context`:
    the run's tokens per sample (None: unknown, tokens/s are not given)."""

    def __init__(self, journal: Journal, context: int | None, interval_s: float = INTERVAL_S):
        self.journal = journal
        self.sampler = ProgressSampler(journal.last_step(), interval_s)
        self.meter = ThroughputMeter(context, interval_s)
        self.limiter = EventLimiter()

    def event(self, now: float, kind: str, peer_id: str | None, detail: str) -> bool:
        """Record an event unless its kind's limit for this peer is reached; whether it was."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind {kind!r} is not one of {', '.join(EVENT_KINDS)}")
        ok, suppressed = self.limiter.allow(now, kind, peer_id)
        if ok:
            more = f" ({suppressed} more like it since the last one shown)" if suppressed else ""
            self.journal.add_event(Event(now, kind, peer_id, (detail or "-")[: MAX_DETAIL - len(more)] + more))
        return ok

    def heartbeat(self, now: float, req: Heartbeat, role: str | None, failed_before: str | None) -> None:
        """A stored heartbeat of a member whose role is `role`, whose failure was `failed_before`."""
        point = self.sampler.report(now, req.peer_id, role, req.step, req.loss)
        if point is not None:
            self.journal.add_progress(point)
        self.meter.report(now, req.peer_id, req.step, req.bytes_sent)
        if req.failure and req.failure != failed_before:
            self.event(now, "role_failed", req.peer_id, req.failure)
        for note in req.notes:
            self.event(now, "round_failed", req.peer_id, note)
        for ban in req.bans:  # (the event is the banned peer's; the detail says who banned it)
            banned, text = ban.split(" ", 1)
            self.event(now, "ban", banned, f"banned by {req.peer_id} {text}")

    def tick(self, now: float, members: Iterable[Rate]) -> None:
        """Every second or so: the interval points that are due."""
        point = self.sampler.due(now)
        if point is not None:
            self.journal.add_progress(point)
        rate = self.meter.due(now, members)
        if rate is not None:
            self.journal.add_throughput(rate)

    def forget(self, peer_id: str) -> None:
        """A member left: its counters go (it counts from nothing if it comes back)."""
        self.sampler.forget(peer_id)
        self.meter.forget(peer_id)
