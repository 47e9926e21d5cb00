"""The coordinator's membership registry: one SQLite file under its data dir.

Why SQLite: the coordinator must survive being killed at any moment and come back with its
members, their roles and the swarm's progress. SQLite in WAL mode with synchronous=FULL makes
every committed write durable (the WAL is fsynced on commit) and a torn write is rolled back
on the next open, so there is no recovery code here.

Time is always passed in (`now`, seconds since the epoch): the registry never reads a clock,
so the service and the tests decide what time it is.

The service reaches it through `AsyncRegistry`: every call runs on one dedicated thread, in the
order it was made, so a commit's fsync never stalls the event loop and nothing reorders writes.

Tables:
    schema_version  one row: the schema this file was written with
    members         one row per member (peer_id primary key)
    meta            small key/value pairs (JSON values): plan epoch, swarm step, ...
    progress        loss points (step, loss, time, peer_id) for the status page, thinned with age
    throughput      (time, members, samples/s, tokens/s, bytes/s) per interval, thinned with age
    events          joins, leaves, evictions, refusals, failures, checkpoints: the newest kept
(the history tables are journal.py's to fill and read; history.py decides what goes in them)

Schema versions: 2 added members.failed and the throughput and events tables. A version 1
file is migrated when opened: the column and tables are added, and its progress table (a row
per heartbeat) keeps one row per step, the first recorded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .history import Thinning
from .journal import MAX_EVENTS, Journal
from .planner import MemberView

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    peer_id            TEXT PRIMARY KEY,
    maddrs             TEXT NOT NULL,            -- JSON list of multiaddr strings
    capabilities       TEXT NOT NULL,            -- JSON object
    role               TEXT,
    stage              INTEGER,
    expert             TEXT,
    epoch              INTEGER NOT NULL DEFAULT 0,  -- plan epoch of the current assignment
    registered_at      REAL NOT NULL,
    last_seen          REAL NOT NULL,
    step               INTEGER,
    loss               REAL,
    samples_per_second REAL,
    state_hash         TEXT,
    wanted_role        TEXT,
    failed             TEXT                      -- why its role failed (NULL: it did not)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS progress (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    step    INTEGER NOT NULL,
    loss    REAL,
    time    REAL NOT NULL,
    peer_id TEXT
);
CREATE TABLE IF NOT EXISTS throughput (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    time               REAL NOT NULL,
    members            INTEGER NOT NULL,
    samples_per_second REAL NOT NULL,
    tokens_per_second  REAL,
    bytes_per_second   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    time    REAL NOT NULL,
    kind    TEXT NOT NULL,
    peer_id TEXT,
    detail  TEXT NOT NULL
);
"""

_MIGRATIONS = {  # from version -> the statements that bring a file to the next one
    1: (
        "ALTER TABLE members ADD COLUMN failed TEXT",
        "DELETE FROM progress WHERE id NOT IN (SELECT MIN(id) FROM progress GROUP BY step)",
    ),
}

_MEMBER_COLUMNS = (
    "peer_id, maddrs, capabilities, role, stage, expert, epoch, registered_at, last_seen, "
    "step, loss, samples_per_second, state_hash, wanted_role, failed"
)


class RegistryError(Exception):
    """The registry file cannot be opened or written. The message names the file and why."""


@dataclass(frozen=True)
class Member:
    peer_id: str
    maddrs: tuple[str, ...]
    capabilities: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    stage: int | None = None
    expert: str | None = None
    epoch: int = 0  # plan epoch when the current role was assigned
    registered_at: float = 0.0  # seconds since the epoch, first registration
    last_seen: float = 0.0  # seconds since the epoch, last register or heartbeat
    step: int | None = None  # last reported training step
    loss: float | None = None  # last reported loss
    samples_per_second: float | None = None  # last reported throughput
    state_hash: str | None = None  # last reported hash of the peer's model state
    wanted_role: str | None = None
    failed: str | None = None  # why its role failed: it takes no role until it registers again

    def view(self) -> MemberView:
        return MemberView(
            peer_id=self.peer_id,
            last_seen=self.last_seen,
            registered_at=self.registered_at,
            role=self.role,
            stage=self.stage,
            expert=self.expert,
            throughput=self.samples_per_second,
            capabilities=self.capabilities,
            wanted_role=self.wanted_role,
            failed=self.failed,
        )


class Registry:
    """Members, meta values and the swarm's history (`history`, a journal.Journal) in one
    SQLite file.

    Safe to call from several threads (one connection, guarded by a lock); the service calls
    it through `AsyncRegistry`, on one thread of its own. Every method that writes commits
    before returning.
    """

    def __init__(self, path: str | Path, thinning: Thinning = Thinning(), max_events: int = MAX_EVENTS):
        self.path = Path(path)
        self._lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryError(f"cannot open registry at {self.path}: cannot create {self.path.parent}: {e.strerror}") from None
        if self.path.is_dir():
            raise RegistryError(f"cannot open registry at {self.path}: it is a directory")
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a write is one transaction.
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as e:
            raise RegistryError(f"cannot open registry at {self.path}: {e}") from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            with self._tx():
                # statement by statement: executescript() would COMMIT our transaction midway
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
                row = self._db.execute("SELECT version FROM schema_version").fetchone()
                if row is None:
                    self._db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                elif row[0] != SCHEMA_VERSION:
                    self._migrate(row[0])
        except sqlite3.Error as e:
            self._db.close()
            raise RegistryError(f"cannot open registry at {self.path}: {e}") from None
        except RegistryError:
            self._db.close()
            raise
        self.history = Journal(self._db, self._tx, self._lock, thinning, max_events)

    def _migrate(self, version: int) -> None:
        """Bring a file of an older schema to this one (inside the opening transaction)."""
        if version not in _MIGRATIONS and version != SCHEMA_VERSION:
            raise RegistryError(f"cannot open registry at {self.path}: schema version {version}, this code reads version {SCHEMA_VERSION} (and migrates versions from 1)")
        while version < SCHEMA_VERSION:
            for stmt in _MIGRATIONS[version]:
                self._db.execute(stmt)
            version += 1
        self._db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))

    # -- plumbing -------------------------------------------------------------------------------

    def _tx(self) -> _Transaction:
        return _Transaction(self)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _row_to_member(self, row: tuple) -> Member:
        (peer_id, maddrs, caps, role, stage, expert, epoch, registered_at, last_seen,
         step, loss, sps, state_hash, wanted_role, failed) = row
        return Member(
            peer_id=peer_id,
            maddrs=tuple(json.loads(maddrs)),
            capabilities=json.loads(caps),
            role=role,
            stage=stage,
            expert=expert,
            epoch=epoch,
            registered_at=registered_at,
            last_seen=last_seen,
            step=step,
            loss=loss,
            samples_per_second=sps,
            state_hash=state_hash,
            wanted_role=wanted_role,
            failed=failed,
        )

    def _get(self, peer_id: str) -> Member | None:
        row = self._db.execute(f"SELECT {_MEMBER_COLUMNS} FROM members WHERE peer_id = ?", (peer_id,)).fetchone()
        return None if row is None else self._row_to_member(row)

    # -- members --------------------------------------------------------------------------------

    def register(
        self,
        peer_id: str,
        maddrs: Iterable[str],
        capabilities: Mapping[str, Any],
        now: float,
        wanted_role: str | None = None,
    ) -> Member:
        """Add a member, or refresh one that registers again (it keeps its role and epoch, and
        its first registered_at; addresses, capabilities and wanted_role are replaced; a failed
        role is forgotten: registering again is a restart)."""
        maddrs_json = json.dumps([str(a) for a in maddrs])
        try:
            caps_json = json.dumps(dict(capabilities), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"capabilities of {peer_id!r} are not JSON-serializable: {e}") from None
        with self._tx():
            self._db.execute(
                """INSERT INTO members (peer_id, maddrs, capabilities, registered_at, last_seen, wanted_role)
                   VALUES (?, ?, ?, ?, ?, ?)
                   ON CONFLICT (peer_id) DO UPDATE SET
                       maddrs = excluded.maddrs, capabilities = excluded.capabilities,
                       last_seen = excluded.last_seen, wanted_role = excluded.wanted_role, failed = NULL""",
                (peer_id, maddrs_json, caps_json, now, now, wanted_role),
            )
            member = self._get(peer_id)
        if member is None:  # cannot happen: we just wrote it in this transaction
            raise RegistryError(f"registry at {self.path}: {peer_id!r} vanished right after registering")
        return member

    def heartbeat(
        self,
        peer_id: str,
        now: float,
        step: int | None = None,
        loss: float | None = None,
        samples_per_second: float | None = None,
        state_hash: str | None = None,
        failed: str | None = None,
    ) -> Member | None:
        """Mark a member alive at `now` and store what it reported (None = not reported, the old
        value stays; `failed` "": its role did not fail). Returns None for an unknown peer: it
        must register first."""
        for name, value in (("loss", loss), ("samples_per_second", samples_per_second)):
            if value is not None and not math.isfinite(value):
                raise ValueError(f"heartbeat of {peer_id!r}: {name} must be finite, got {value}")
        with self._tx():
            cur = self._db.execute(
                """UPDATE members SET last_seen = ?,
                       step = COALESCE(?, step), loss = COALESCE(?, loss),
                       samples_per_second = COALESCE(?, samples_per_second),
                       state_hash = COALESCE(?, state_hash),
                       failed = CASE WHEN ? IS NULL THEN failed ELSE NULLIF(?, '') END
                   WHERE peer_id = ?""",
                (now, step, loss, samples_per_second, state_hash, failed, failed, peer_id),
            )
            return self._get(peer_id) if cur.rowcount else None

    def remove(self, peer_id: str) -> bool:
        """Forget a member. True if it was there."""
        with self._tx():
            return self._db.execute("DELETE FROM members WHERE peer_id = ?", (peer_id,)).rowcount > 0

    def get(self, peer_id: str) -> Member | None:
        with self._lock:
            return self._get(peer_id)

    def members(self) -> list[Member]:
        """All members, sorted by peer_id."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_MEMBER_COLUMNS} FROM members ORDER BY peer_id").fetchall()
        return [self._row_to_member(r) for r in rows]

    def views(self) -> list[MemberView]:
        """All members as the planner sees them, sorted by peer_id."""
        return [m.view() for m in self.members()]

    def set_assignment(self, peer_id: str, role: str | None, stage: int | None, expert: str | None, epoch: int) -> bool:
        """Store one member's role. False if the peer is unknown (e.g. evicted meanwhile)."""
        with self._tx():
            return self._set_assignment(peer_id, role, stage, expert, epoch)

    def set_assignments(
        self,
        assignments: Iterable[tuple[str, str | None, int | None, str | None]],
        epoch: int,
        meta: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Store several (peer_id, role, stage, expert) and optional meta values in ONE
        transaction, so a crash never leaves half a plan (or a plan without its epoch).
        Returns the peer_ids that were unknown and so not updated."""
        unknown = []
        with self._tx():
            for peer_id, role, stage, expert in assignments:
                if not self._set_assignment(peer_id, role, stage, expert, epoch):
                    unknown.append(peer_id)
            for key, value in (meta or {}).items():
                self._set_meta(key, value)
        return unknown

    def _set_assignment(self, peer_id: str, role: str | None, stage: int | None, expert: str | None, epoch: int) -> bool:
        # a throughput measured in one role (or stage, or expert) says little about another:
        # forgotten when the work changes, until the peer reports it anew
        cur = self._db.execute(
            "UPDATE members SET samples_per_second = CASE WHEN role IS ? AND stage IS ? AND expert IS ? THEN samples_per_second END, "
            "role = ?, stage = ?, expert = ?, epoch = ? WHERE peer_id = ?",
            (role, stage, expert, role, stage, expert, epoch, peer_id),
        )
        return cur.rowcount > 0

    # -- meta -----------------------------------------------------------------------------------

    def get_meta(self, key: str, default: Any = None) -> Any:
        """The JSON value stored under `key`, or `default`."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON-serializable value (int, float, str, bool, None, list, dict)."""
        with self._tx():
            self._set_meta(key, value)

    def _set_meta(self, key: str, value: Any) -> None:
        try:
            encoded = json.dumps(value, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta value for {key!r} is not JSON-serializable: {e}") from None
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, encoded),
        )


T = TypeVar("T")


class AsyncRegistry:
    """A `Registry` for an event loop: each call runs on the registry's own thread (one, so
    SQLite is used by a single thread and calls run one at a time, in the order they were made),
    and the caller awaits it. With synchronous=FULL a commit waits for an fsync: on the loop,
    every heartbeat would stall all other handlers for that long.

    `run(fn, ...)` runs `fn(registry, ...)` there as one job, so a read-decide-write sequence
    in one job sees no other call's writes in between. A caller cancelled while its call waits
    or runs does not cancel the call: it still completes (and commits) in its turn."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, self.registry, *args, **kwargs))

    async def _call(self, method: str, *args: Any) -> Any:
        return await self.run(lambda registry: getattr(registry, method)(*args))

    async def register(self, peer_id: str, maddrs: Iterable[str], capabilities: Mapping[str, Any], now: float, wanted_role: str | None = None) -> Member:
        return await self._call("register", peer_id, maddrs, capabilities, now, wanted_role)

    async def heartbeat(self, peer_id: str, now: float, step: int | None = None, loss: float | None = None,
                        samples_per_second: float | None = None, state_hash: str | None = None, failed: str | None = None) -> Member | None:
        return await self._call("heartbeat", peer_id, now, step, loss, samples_per_second, state_hash, failed)

    async def remove(self, peer_id: str) -> bool:
        return await self._call("remove", peer_id)

    async def get(self, peer_id: str) -> Member | None:
        return await self._call("get", peer_id)

    async def members(self) -> list[Member]:
        return await self._call("members")

    async def get_meta(self, key: str, default: Any = None) -> Any:
        return await self._call("get_meta", key, default)

    async def close(self) -> None:
        """Close the file after the calls already made, then stop the thread."""
        try:
            await self._call("close")
        finally:
            self._executor.shutdown(wait=False)


class _Transaction:
    """BEGIN IMMEDIATE .. COMMIT under the registry's lock; ROLLBACK on any exception; SQLite
    errors become RegistryError naming the file."""

    def __init__(self, registry: Registry):
        self.r = registry

    def __enter__(self) -> None:
        self.r._lock.acquire()
        try:
            self.r._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            self.r._lock.release()
            raise RegistryError(f"registry at {self.r.path}: cannot start a transaction: {e}") from None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        try:
            if exc_type is None:
                try:
                    self.r._db.execute("COMMIT")
                except sqlite3.Error as e:
                    self.r._db.execute("ROLLBACK")
                    raise RegistryError(f"registry at {self.r.path}: commit failed: {e}") from None
                return False
            self.r._db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise RegistryError(f"registry at {self.r.path}: {exc}") from exc
            return False
        finally:
            self.r._lock.release()
