"""The swarm's history as the status page shows it: which reports become points, which old
points are thinned away, which events are recorded. Pure decisions of (now, what was reported):
no clock, no SQLite (journal.py stores what these decide), tested by moving time by hand.

    keep_points       which points of a series stay: the newest densely, older ones one per
                      time bucket that widens with age, the first point always; a day of a busy
                      swarm is at most `Thinning.bound()` rows
    ProgressSampler   loss points: one per outer step for replicas (the first report of a step:
                      replicas at one outer step hold the same state, so the same loss), one
                      swarm-wide point per interval for trainers (the mean of the losses reported
                      in it), nothing while nobody trains
    ThroughputMeter   one point per interval: members, samples/s and tokens/s of the members
                      that train end to end (replicas, trainers), bytes/s from the differences of
                      each member's byte totals (a total that went down is a restart)
    EventLimiter      how many events of a kind one peer may add per window (a refused peer
                      retrying every few seconds must not push every other event out)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

INTERVAL_S = 5.0  # seconds per swarm-wide point (trainers' loss, throughput)
ACTIVE_S = 120.0  # a member's rate counts while its step moved at most this long ago
TRAINING_ROLES = ("replica", "trainer")  # each of their samples goes through the whole model
EVENT_KINDS = ("join", "leave", "evict", "revoke", "ban", "role_failed", "round_failed", "checkpoint", "refused")


class ProgressPoint(NamedTuple):
    step: int
    loss: float | None
    time: float  # seconds since the epoch
    peer_id: str | None = None  # who reported it (None: the mean of several members)


class ThroughputPoint(NamedTuple):
    time: float  # seconds since the epoch, the end of the interval
    members: int  # registered members
    samples_per_second: float  # sum over the members that train end to end
    tokens_per_second: float | None  # samples/s × the run's context (None: context unknown)
    bytes_per_second: float  # sent, every member together, over the interval


class Event(NamedTuple):
    time: float
    kind: str  # one of EVENT_KINDS
    peer_id: str | None
    detail: str


# ---- thinning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thinning:
    """How a series thins with age. The newest `dense` points all stay; an older point stays if
    it is the first of its bucket (`bucket_s` wide, aligned to the epoch) in the first tier whose
    `age_s` covers it; points older than the last tier go, except the series' first point."""

    dense: int = 240  # newest points always kept
    # (oldest age in seconds, bucket width in seconds): each width divides the next, so a point
    # kept as the first of a coarse bucket was also the first of its finer one
    tiers: tuple[tuple[float, float], ...] = ((3600.0, 30.0), (6 * 3600.0, 120.0), (86400.0, 600.0), (7 * 86400.0, 3600.0))

    def __post_init__(self) -> None:
        if self.dense < 1:
            raise ValueError(f"dense: at least 1 point, got {self.dense}")
        ages = [a for a, _ in self.tiers]
        if ages != sorted(ages) or any(b <= 0 or a <= 0 for a, b in self.tiers):
            raise ValueError(f"tiers: ages ascending, positive ages and widths, got {self.tiers!r}")

    def bound(self) -> int:
        """The most points a series keeps, whatever arrived: dense, the first, and per tier one
        per bucket its age span covers (a span cuts at most one more bucket than it holds)."""
        total, prev = self.dense + 1, 0.0
        for age, width in self.tiers:
            total += math.ceil((age - prev) / width) + 1
            prev = age
        return total


def keep_points(times: Sequence[float], now: float, policy: Thinning) -> list[bool]:
    """Which points of a series (their times, oldest first) stay (see `Thinning`)."""
    n = len(times)
    first_dense = max(0, n - policy.dense)
    keep = [False] * first_dense + [True] * (n - first_dense)
    tiers, tier = policy.tiers, len(policy.tiers) - 1
    last_bucket: tuple[int, int] | None = None
    for i in range(first_dense):  # oldest first: the age only falls, so the tier only gets finer
        age = now - times[i]
        while tier > 0 and age <= tiers[tier - 1][0]:
            tier -= 1
        if age > tiers[tier][0] and tier == len(tiers) - 1:
            continue  # older than the last tier
        bucket = (tier, math.floor(times[i] / tiers[tier][1]))
        if bucket != last_bucket:  # the first point of its bucket
            last_bucket = bucket
            keep[i] = True
    if n:
        keep[0] = True  # where the run started: the plot's left end
    return keep


# ---- progress ---------------------------------------------------------------------------------


class ProgressSampler:
    """Which reported losses become points (see the module). `last_step`: the highest step the
    history already holds (after a restart, replicas' steps up to it are not points again)."""

    def __init__(self, last_step: int | None = None, interval_s: float = INTERVAL_S):
        self.last_step = last_step
        self.interval_s = interval_s
        self._steps: dict[str, int] = {}  # peer -> the step of its last report that counted
        self._pending: dict[str, tuple[int, float]] = {}  # peer -> (step, loss) new in this interval
        self._since: float | None = None  # when the last interval point was made

    def report(self, now: float, peer_id: str, role: str | None, step: int, loss: float | None) -> ProgressPoint | None:
        """A heartbeat's step and loss; the point it makes now (replicas), if any."""
        if loss is None or not math.isfinite(loss) or role not in TRAINING_ROLES:
            return None  # (a member whose role failed is idle, and reports its old loss)
        if role == "replica":
            if self.last_step is not None and step <= self.last_step:
                return None  # seen: this outer step has its point
            self.last_step = step
            return ProgressPoint(step, loss, now, peer_id)
        if self._steps.get(peer_id) == step:
            return None  # the same report again (an idle trainer heartbeats its last loss)
        self._steps[peer_id] = step
        self._pending[peer_id] = (step, loss)
        return None

    def due(self, now: float) -> ProgressPoint | None:
        """The interval's point once `interval_s` passed since the last one and losses arrived."""
        if not self._pending or (self._since is not None and now - self._since < self.interval_s):
            return None
        reports = list(self._pending.items())
        self._pending.clear()
        self._since = now
        peer = reports[0][0] if len(reports) == 1 else None
        return ProgressPoint(max(s for _, (s, _) in reports), sum(loss for _, (_, loss) in reports) / len(reports), now, peer)

    def forget(self, peer_id: str) -> None:
        self._steps.pop(peer_id, None)
        self._pending.pop(peer_id, None)


# ---- throughput -------------------------------------------------------------------------------


class Rate(NamedTuple):
    """A member as the throughput meter reads it at the end of an interval."""

    peer_id: str
    role: str | None
    samples_per_second: float | None


class ThroughputMeter:
    """The swarm's throughput per interval (see the module). `context`: tokens per sample."""

    def __init__(self, context: int | None, interval_s: float = INTERVAL_S, active_s: float = ACTIVE_S):
        self.context, self.interval_s, self.active_s = context, interval_s, active_s
        self._totals: dict[str, int] = {}  # peer -> its last bytes_sent total
        self._moved: dict[str, tuple[int, float]] = {}  # peer -> (step, when it last changed)
        self._bytes = 0  # sent in this interval, every member together
        self._since: float | None = None

    def report(self, now: float, peer_id: str, step: int, bytes_sent: int) -> None:
        last = self._totals.get(peer_id)
        if last is not None:
            # a total below the last one: the node restarted and counts from 0 again; what it
            # sent since then was sent after our last look
            self._bytes += bytes_sent - last if bytes_sent >= last else bytes_sent
        self._totals[peer_id] = bytes_sent
        if self._moved.get(peer_id, (None,))[0] != step:
            self._moved[peer_id] = (step, now)

    def due(self, now: float, members: Iterable[Rate]) -> ThroughputPoint | None:
        """The interval's point once `interval_s` passed (none for an empty swarm)."""
        if self._since is None:
            self._since = now
            return None
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        members = list(members)
        sent, self._bytes, self._since = self._bytes, 0, now
        if not members and not sent:
            return None
        samples = sum(
            m.samples_per_second for m in members
            if m.role in TRAINING_ROLES and m.samples_per_second and now - self._moved.get(m.peer_id, (None, -math.inf))[1] <= self.active_s
        )  # fmt: skip
        tokens = samples * self.context if self.context else None
        return ThroughputPoint(now, len(members), samples, tokens, sent / elapsed)

    def forget(self, peer_id: str) -> None:
        self._totals.pop(peer_id, None)
        self._moved.pop(peer_id, None)


# ---- events -----------------------------------------------------------------------------------

# kind -> (events, seconds): at most that many of this kind per peer per window
PER_PEER = {"refused": (1, 300.0), "round_failed": (10, 300.0)}
# kind -> (events, seconds): ... and for all peers together (peer ids cost nothing to make)
PER_KIND = {"refused": (30, 300.0), "ban": (60, 300.0)}  # (a member may report bans of any ids)
MAX_TRACKED = 4096  # peers whose recent events are remembered


@dataclass
class _Window:
    times: deque = field(default_factory=deque)  # when the recorded events were
    suppressed: int = 0  # events not recorded since the last one that was


class EventLimiter:
    """How many events of a kind a peer may add (PER_PEER, PER_KIND); kinds not named there are
    rare by nature (joins, evictions, checkpoints) and never limited."""

    def __init__(self, per_peer: dict[str, tuple[int, float]] | None = None, per_kind: dict[str, tuple[int, float]] | None = None):
        self.per_peer = PER_PEER if per_peer is None else per_peer
        self.per_kind = PER_KIND if per_kind is None else per_kind
        self._peers: dict[tuple[str, str | None], _Window] = {}  # (kind, peer) -> its window
        self._kinds: dict[str, _Window] = {}

    def allow(self, now: float, kind: str, peer_id: str | None) -> tuple[bool, int]:
        """Whether to record this event, and how many like it from this peer were not recorded
        since the last one that was (to say so in its detail)."""
        windows = []
        if kind in self.per_peer:
            if (kind, peer_id) not in self._peers and len(self._peers) >= MAX_TRACKED:
                del self._peers[next(iter(self._peers))]  # the longest tracked
            windows.append((self._peers.setdefault((kind, peer_id), _Window()), self.per_peer[kind]))
        if kind in self.per_kind:
            windows.append((self._kinds.setdefault(kind, _Window()), self.per_kind[kind]))
        if not windows:
            return True, 0
        for w, (_, span) in windows:
            while w.times and now - w.times[0] >= span:
                w.times.popleft()
        mine = windows[0][0]
        if any(len(w.times) >= n for w, (n, _) in windows):
            mine.suppressed += 1
            return False, 0
        suppressed, mine.suppressed = mine.suppressed, 0
        for w, _ in windows:
            w.times.append(now)
        return True, suppressed
