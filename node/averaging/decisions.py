"""The averager's decisions, as pure functions of what it knows (and, where time matters, of
`now` passed in): who survives a round, who owns which slice, whether a round commits, when a
leader closes its group and what the group is, whether sends are paced, what was learned about
bandwidth. Each returns its decision with the reason for it, so logs and tests can say why.
No I/O, no clocks, no event loop."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from protocol import AvgDecision, AvgGroup, AvgJoin, AvgReport

from .config import AveragerConfig, wire_bytes

# ---- slices ---------------------------------------------------------------------------------

PIPELINE_SLICES = 16  # slices per owning member when the members' links differ (see `slice_layout`)
MIN_PIPELINE_SLICE = 1 << 16  # elements: a vector too short for slices of this size keeps one per owner


def slice_shares(bandwidths: Sequence[float]) -> list[float]:
    """Relative slice sizes for members with these measured bandwidths. Measurements are noisy
    between rounds on identical links, and a slice over its fair share makes its owner the
    straggler of both phases; so shares move in half-octave steps around the group's median:
    members within ±19% of it get equal slices, a member at 4x the median gets 4x the slice."""
    bws = [max(float(bw), 1.0) for bw in bandwidths]
    med = statistics.median(bws)
    return [2.0 ** (round(2 * math.log2(bw / med)) / 2) for bw in bws]


def bound_shares(bandwidths: Sequence[float]) -> list[float]:
    """The fraction of the vector each member owns so that the round takes least time. Owning
    s_i of a vector of S bytes, member i moves (1 + (N-2)·s_i)·S each way (its other parts
    out, its aggregated slice to the N-1 others), so the round takes max_i (1 + (N-2)·s_i)·S/B_i
    at best. The shares that level that out are s_i = (T·B_i - 1)/(N-2) with one T for all;
    a member so slow that T·B_i < 1 owns nothing (it only sends its parts and receives the
    result: less than that no all-reduce can move). Equal links: 1/N each. Two members move S
    each whatever they own: shares in proportion to bandwidth."""
    top = max(max(bandwidths, default=1.0), 1e-300)
    bws = [max(float(bw) / top, 1e-9) for bw in bandwidths]  # relative: only their ratios matter
    n = len(bws)
    if n <= 2:
        return [bw / sum(bws) for bw in bws]
    owning = set(range(n))
    while True:
        level = (n - 2 + len(owning)) / sum(bws[i] for i in owning)
        slowest = min(owning, key=lambda i: bws[i])
        if level * bws[slowest] >= 1 or len(owning) == 1:
            break
        owning.discard(slowest)  # (one at a time: each removal raises the level for the rest)
    return [max(0.0, (level * bws[i] - 1) / (n - 2)) if i in owning else 0.0 for i in range(n)]


def slice_layout(numel: int, bandwidths: Sequence[float], align: int) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(slice bounds, the member index owning each slice, why): how a group cuts its vector.
    Bandwidths are first rounded to half-octave steps around the median (`slice_shares`), then
    shared out by `bound_shares`. Equal links: one slice per member (owners `()`: slice i is
    member i's). Uneven links: the slowest link is the round's bottleneck both ways, and it can
    receive a slice's result only once its own part of that slice is in; so each owning member
    owns PIPELINE_SLICES slices, interleaved (members a, b, c: a b c a b c ...), which every
    member sends in order: the first results flow back to a slow member while it still sends
    its later parts, instead of after its last."""
    rounded = slice_shares(bandwidths)
    shares = bound_shares(rounded)
    n = len(shares)
    if max(rounded) == min(rounded):
        return slice_bounds(numel, shares, align), (), "equal links: one slice per member"
    owning = [i for i, s in enumerate(shares) if s > 0]
    k = max(1, min(PIPELINE_SLICES, numel // (len(owning) * max(MIN_PIPELINE_SLICE, align))))
    if k == 1 and len(owning) == n:
        return slice_bounds(numel, shares, align), (), "uneven links, a short vector: one slice per member, sized to its link"
    owners = tuple(owning) * k
    bounds = slice_bounds(numel, [shares[i] for i in owners], align)
    idle = n - len(owning)
    why = f"uneven links: {k} slice(s) per owning member, interleaved" + (f"; {idle} member(s) too slow to own any" if idle else "")
    return bounds, owners, why


def slice_bounds(numel: int, bandwidths: Sequence[float], align: int) -> tuple[int, ...]:
    """Cut [0, numel) into len(bandwidths) slices proportional to bandwidth, bounds aligned."""
    total = sum(bandwidths)
    bounds, acc = [0], 0.0
    for bw in bandwidths[:-1]:
        acc += bw
        cut = int(round(numel * acc / total / align)) * align
        bounds.append(min(max(cut, bounds[-1]), numel))
    bounds.append(numel)
    return tuple(bounds)


# ---- matchmaking: the leader's side -----------------------------------------------------------


def close_reason(
    now: float, deadline: float, joined: Collection[str], expected: int | Collection[str] | None, overdue: Collection[str] = ()
) -> str:
    """Why a leader closes its group now ("" : keep it open). `expected`: a count of peers, or
    the peer ids (a peer nobody counted on does not take the place of one still on its way).
    `overdue`: expected peers no longer waited for (silent, or later than they usually are)."""
    if expected:
        if isinstance(expected, int) and len(joined) >= expected:
            return f"{len(joined)} of {expected} expected peers joined"
        if not isinstance(expected, int):
            waiting = set(expected) - set(joined)
            if not waiting:
                return "every expected peer joined"
            if waiting <= set(overdue):
                return f"every expected peer joined but {len(waiting)} overdue ({', '.join(sorted(p[-8:] for p in waiting))})"
    if now >= deadline:
        return "the join window ended"
    return ""


@dataclass
class Arrivals:
    """How late each peer joins the groups we lead: seconds after our group opened (0 when it
    was there before us), its last `keep` joins, whether in time or after the group closed.
    A leader waits for an expected peer `factor` × the median of its recent arrivals +
    `slack_s` (the median: one odd round, such as the first, when replicas start at different
    times, does not set the allowance for the next eight), never longer than the join window;
    for a peer it has not measured, the whole window. So a slow
    but steady peer keeps its place (its lateness is what is measured), a peer that turned
    slower is measured by its late join and waited for in the next round, and one that went
    silent (frozen, cut off, dead) costs the others its allowance, not the window. (The
    matchmaker lets a peer past its allowance go only if it does not answer a probe either:
    one that answers is alive, most likely on its way, and keeps the window.)"""

    keep: int = 8
    factor: float = 2.0
    slack_s: float = 1.0
    seen: dict[str, list[float]] = field(default_factory=dict)

    def arrived(self, peer: str, lateness: float) -> None:
        recent = self.seen.setdefault(peer, [])
        recent.append(max(0.0, lateness))
        del recent[: -self.keep]

    def allowance(self, peer: str, window: float) -> tuple[float, str]:
        """Seconds after the group opened that `peer` is waited for, and why."""
        recent = self.seen.get(peer)
        if not recent:
            return window, "not measured yet: the whole window"
        typical = statistics.median(recent)
        wait = self.factor * typical + self.slack_s
        if wait >= window:
            return window, f"{typical:.1f} s late lately (median): the whole window"
        return wait, f"{typical:.1f} s late (median of its last {len(recent)} joins)"

    def overdue(self, waiting: Collection[str], elapsed: float, window: float) -> set[str]:
        """The peers of `waiting` not waited for any more, `elapsed` s after the group opened."""
        return {p for p in waiting if elapsed >= self.allowance(p, window)[0]}

    def next_overdue(self, waiting: Collection[str], elapsed: float, window: float) -> float:
        """Seconds until the next peer of `waiting` becomes overdue (inf: none will before the window)."""
        left = [a - elapsed for p in waiting if elapsed < (a := self.allowance(p, window)[0]) < window]
        return min(left, default=math.inf)


def form_group(
    joins: Mapping[str, AvgJoin], numel: int, config: AveragerConfig, codec_params: Mapping, group_id: str
) -> tuple[AvgGroup | None, str]:
    """The group a leader announces for these joins (its own included), or None and why not.
    Members in peer id order; slices sized and laid out by bandwidth (`slice_layout`); phase
    deadlines from the slowest member's expected transfer time."""
    members = tuple(sorted(joins))
    if len(members) < config.min_group_size:
        return None, "too few peers for a group"
    bws = [joins[m].bandwidth or config.default_bandwidth for m in members]
    gather = config.resolved_gather_codec
    per_elem = max(wire_bytes(config.codec, dict(codec_params)), wire_bytes(gather, config.gather_codec_params))
    n = len(members)
    moved = 2 * (n - 1) / max(n, 1) * numel * per_elem  # bytes in + out per member, one phase
    expected_s = moved / min(bws)
    deadline_s = config.base_timeout_s + config.timeout_slack * expected_s
    bounds, owners, layout = slice_layout(numel, bws, config.slice_align)
    group = AvgGroup(
        status="group",
        group_id=group_id,
        members=members,
        weights=tuple(joins[m].weight for m in members),
        bounds=bounds,
        slice_owners=owners,
        codec=config.codec,
        codec_params=dict(codec_params),
        gather_codec=gather,
        gather_codec_params=config.gather_codec_params,
        deadline_s=deadline_s,
    )
    return group, f"{n} members; slowest {min(bws) / 1e6:.1f} MB/s: {expected_s:.2f} s per phase expected, deadline {deadline_s:.2f} s; {layout}"


# ---- matchmaking: is the leader we wait on still there? ----------------------------------------


@dataclass
class Liveness:
    """Whether a peer we wait on (a leader holding our join until its group forms) still
    answers, judged from probes (pings) and their measured round trips. A frozen, suspended or
    cut-off peer answers nothing: after `misses` probes in a row go unanswered, it is silent,
    and the follower moves on to the next candidate instead of waiting out the join call's own
    timeout (three join windows: tens of seconds). A probe waits for what the peer's measured
    round trips say (`probe_timeout`), so a slow but steady peer keeps its place."""

    rtt: float | None = None  # seconds, EMA of the answered probes (None: none yet)
    peak: float | None = None  # seconds, the slowest recent answer (decays 10% per answer)
    missed: int = 0  # probes in a row without an answer
    interval_s: float = 0.1  # after an answered probe, until the next (the first goes at once)
    misses: int = 2
    factor: float = 10.0
    peak_factor: float = 3.0
    min_timeout_s: float = 0.3
    max_timeout_s: float = 5.0
    after_miss: float = 0.6

    @classmethod
    def known(cls, rtts: Mapping[str, tuple[float, float]], peer: str) -> Liveness:
        """Seeded with what earlier probes of `peer` measured (see `remember`)."""
        rtt, peak = rtts.get(peer, (None, None))
        return cls(rtt=rtt, peak=peak)

    def remember(self, rtts: dict[str, tuple[float, float]], peer: str) -> None:
        if self.rtt is not None:
            rtts[peer] = (self.rtt, self.peak or self.rtt)

    def probe_timeout(self) -> float:
        """`factor` x the usual round trip, or `peak_factor` x the slowest recent one (a busy
        machine answers late now and then), within [min_timeout_s, max_timeout_s]. The probe
        after a miss waits `after_miss` of that: the peer has already had a whole probe's wait
        to answer, so silence is found in 1.6 waits instead of 2 (a peer stalled for less still
        answers it); its wait stays above what a fresh connection's handshake takes (about 5
        round trips)."""
        if self.rtt is None:
            wait = 2.0
        else:
            wait = min(max(self.factor * self.rtt, self.peak_factor * (self.peak or 0.0), self.min_timeout_s), self.max_timeout_s)
        return max(self.after_miss * wait, self.min_timeout_s) if self.missed else wait

    def next_after(self) -> float:
        """Seconds from a probe's end to the next: `interval_s` after an answer, none after a
        miss (silence is two misses in a row, with no pause between them to wait out)."""
        return 0.0 if self.missed else self.interval_s

    def answered(self, rtt: float) -> None:
        self.missed = 0
        self.rtt = rtt if self.rtt is None else 0.7 * self.rtt + 0.3 * rtt
        self.peak = rtt if self.peak is None else max(rtt, 0.9 * self.peak)

    def unanswered(self) -> None:
        self.missed += 1

    def silent(self) -> str:
        """Why the peer counts as gone ("": it does not)."""
        if self.missed >= self.misses:
            return f"{self.missed} probes in a row unanswered (the last waited {self.probe_timeout():.1f} s)"
        return ""


# ---- after the scatter: who survives, who owns what ------------------------------------------


def decide_survivors(
    members: Sequence[str], reports: Mapping[str, AvgReport], owning: Collection[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """After scatter: who survives, and why the others failed. Members that did not report
    failed. An owner accuses the senders it blamed or never heard from; the accused fail,
    unless their accuser accused at least half of the others and some of that is corroborated
    by no other owner: then the accuser (a broken receiver, or a liar) is the likely culprit.
    So one NaN sender among three is excluded by its two honest receivers, not the reverse.
    `owning`: the members that own a slice (None: all); one that owns none hears no parts, so
    its silence about a sender accuses nobody (what it blames explicitly still counts)."""
    failed: dict[str, str] = {}
    for m in members:
        if m not in reports:
            failed[m] = "no report by the deadline (dead or stalled)"
    accusations: dict[str, dict[str, str]] = {}  # owner -> accused -> why
    for owner in members:
        rep = reports.get(owner)
        if rep is None:
            continue
        acc = {m: f"{why} (reported by {owner[-8:]})" for m, why in zip(rep.blamed, rep.reasons) if m != owner}
        for m in members if owning is None or owner in owning else ():
            if m != owner and m not in failed and m not in rep.received_from and m not in acc:
                acc[m] = f"its part never reached {owner[-8:]}"
        accusations[owner] = acc
    for owner, acc in accusations.items():
        others = len(members) - 1
        uncorroborated = [m for m in acc if m not in failed and not any(m in a for o, a in accusations.items() if o != owner)]
        if others > 1 and len(acc) * 2 >= others and uncorroborated:
            failed.setdefault(owner, f"received from only {others - len(acc)} of {others} members")
    for owner, acc in accusations.items():
        if owner not in failed:
            for m, why in acc.items():
                failed.setdefault(m, why)
    survivors = [m for m in members if m not in failed]
    return survivors, failed


def reassign(members: Sequence[str], survivors: Sequence[str], slice_owners: Sequence[int] = ()) -> tuple[str, ...]:
    """Owner of each slice: its first owner (`slice_owners`: member index per slice; empty:
    slice i is member i's) if it survived, else the surviving owners round-robin (a member too
    slow to own a slice gets none of a failed one's either, unless nobody else survived)."""
    first = [members[i] for i in slice_owners] if slice_owners else list(members)
    heirs = [m for m in survivors if m in first] or list(survivors)
    owners, k = [], 0
    for m in first:
        if m in survivors:
            owners.append(m)
        else:
            owners.append(heirs[k % len(heirs)])
            k += 1
    return tuple(owners)


def decide_scatter(
    group_id: str, members: Sequence[str], reports: Mapping[str, AvgReport], min_group_size: int, slice_owners: Sequence[int] = ()
) -> AvgDecision:
    """The leader's decision after the scatter: the survivors and the owner of every slice, or
    an abort when fewer than `min_group_size` survive. Its `reason` says who failed and why."""
    owning = {members[i] for i in slice_owners} if slice_owners else None
    survivors, failed = decide_survivors(members, reports, owning)
    reason = "; ".join(f"{m[-8:]}: {why}" for m, why in failed.items())
    if len(survivors) < min_group_size:
        return AvgDecision(group_id=group_id, phase="scatter", commit=False, reason=reason or "too few survivors")
    owners = reassign(members, survivors, slice_owners)
    return AvgDecision(group_id=group_id, phase="scatter", commit=True, survivors=tuple(survivors), owners=owners, reason=reason)


def decide_commit(
    group_id: str,
    survivors: Sequence[str],
    owners: Sequence[str],
    expected: Sequence[str],
    reports: Mapping[str, AvgReport],
    silent: Collection[str] = (),
) -> AvgDecision:
    """The leader's decision after the gather: commit only if every expected survivor that
    reported holds every slice, and every one that did not went silent (its probes unanswered:
    frozen, cut off, dead); else abort, saying who is missing what. A silent member's data are
    in the average already, and the others hold all of it: an abort would cost every member
    the round for one that may never come back. The silent member, if it comes back and asks,
    commits only if it holds every slice itself (`RoundDriver.commit`): nobody returns a result
    it does not hold."""
    missing = [m for m in expected if m not in reports and m not in silent]
    not_ok = [m for m, r in reports.items() if not r.ok]
    if missing or not_ok:
        why = [f"{m[-8:]} did not report" for m in missing] + [f"{m[-8:]}: {', '.join(reports[m].reasons)}" for m in not_ok]
        return AvgDecision(group_id=group_id, phase="gather", commit=False, reason="; ".join(why))
    gone = [m for m in expected if m not in reports]
    reason = f"committed without the report of {', '.join(m[-8:] for m in gone)} (silent)" if gone else ""
    return AvgDecision(group_id=group_id, phase="gather", commit=True, survivors=tuple(survivors), owners=tuple(owners), reason=reason)


# ---- sending -----------------------------------------------------------------------------------


def choose_pace(config: AveragerConfig, direct_to_all: bool, pipelined: bool = False) -> tuple[float | None, str]:
    """Bytes/s our paced sends share this round, or None: send in turn (`Sender.in_turn`); and
    why. Pacing needs our upload rate declared (`bandwidth`), below `pace_max_rate`, direct
    pipes to every other member, and a group of equal links (`pipelined`: the group's slices
    are laid out for uneven links, `slice_layout`; their parts must leave in order, one at a
    time, for the first results to come back while the last parts are on their way, and
    pacing to our own rate would flood a slower receiver). Not measured: a paced flow cannot see how much faster the
    link could go, and a flow sent in turn rarely has the link to itself long enough to tell
    (TCP's acknowledged bytes arrive in bursts). And pacing a few % above a link costs more than
    pacing below it: its queue overflows and TCP backs off."""
    rate = config.bandwidth * config.pace_share
    if not config.pace:
        return None, "pacing is off"
    if pipelined:
        return None, "uneven links: parts leave in slice order, one at a time"
    if not rate:
        return None, "no bandwidth declared"
    if rate > config.pace_max_rate:
        return None, f"declared {config.bandwidth / 1e6:.0f} MB/s: above {config.pace_max_rate / 1e6:.0f} MB/s the CPU sets the pace"
    if not direct_to_all:
        return None, "some member is reached over libp2p, which cannot pace"
    return rate, f"{config.pace_share:.0%} of the declared {config.bandwidth / 1e6:.2f} MB/s"


def stagger_patience(overlap: float, prev_bytes: int, flow_rate: float | None, bandwidth: float, declared: float = 0.0) -> float:
    """Seconds after the previous send (in turn) began that the next may start, though the
    previous is still going: `overlap` of its expected time (opening a stream and waiting for
    the receiver's ack leave the link idle otherwise). Expected at the `declared` upload rate
    where there is one: the rate a send in turn measures is no guide then, since the next
    send overlapping its end makes it look slower, and the next patience longer, round after
    round (a 25 Mbit/s link's parts left at 18 Mbit/s so)."""
    return overlap * prev_bytes / (declared or flow_rate or bandwidth / 2)


# ---- learning from finished rounds -------------------------------------------------------------


@dataclass(frozen=True)
class Learned:
    value: float | None
    reason: str


def learn_bandwidth(old: float | None, phases: Mapping[str, float], bytes_moved: int) -> Learned:
    """Bytes/s our transfers achieved, blended into what earlier rounds measured (EMA 0.3):
    deadlines of later rounds follow it. Rounds too short or too small to tell are ignored."""
    busy = phases.get("scatter", 0) + phases.get("gather", 0)
    if busy <= 0.05 or bytes_moved <= (1 << 20):
        return Learned(old, "too little moved to measure")
    bw = bytes_moved / busy
    new = bw if old is None else 0.7 * old + 0.3 * bw
    return Learned(new, f"{bw / 1e6:.1f} MB/s this round")


def learn_flow_rate(old: float | None, nbytes: int, took: float, paced: bool) -> Learned:
    """Bytes/s one unpaced send of at least 1 MiB achieved, blended (EMA 0.3): the patience of
    sends in turn. A paced send says only what it was told."""
    if nbytes < (1 << 20) or took <= 0 or paced:
        return Learned(old, "not a measurable send")
    rate = nbytes / took
    return Learned(rate if old is None else 0.7 * old + 0.3 * rate, f"{rate / 1e6:.1f} MB/s")


def accusations(key: str, evidence: Mapping[int, Mapping[str, float]], me: str, harm: Mapping[str, tuple[int, float]] | None = None) -> dict[str, str]:
    """Who this round's evidence accuses, each with the reason a ban will carry: a member whose
    part was far from the robust aggregate of any slice we own (`evidence`: slice -> member ->
    how many times the group's spread), or whose parts raised the loss of its check batch in
    round after round where the aggregate lowered it (`harm`: member -> (rounds running, this
    round's ratio), from aggregators.HarmRuns). One accusation per member and round (distance
    first, naming its worst slice); never ourselves."""
    reasons = {m: f"round {key}: its parts raised the loss of its own data {n} rounds running, this one by {r:g}x what the aggregate lowered it"
               for m, (n, r) in (harm or {}).items() if m != me}  # fmt: skip
    worst: dict[str, tuple[float, int]] = {}
    for j, far in evidence.items():
        for m, ratio in far.items():
            if m != me and ratio > worst.get(m, (0.0, -1))[0]:
                worst[m] = (ratio, j)
    reasons.update({m: f"round {key}: its part of slice {j} was {ratio:g}x the group's spread from the robust aggregate" for m, (ratio, j) in worst.items()})
    return dict(sorted(reasons.items()))
