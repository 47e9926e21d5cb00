"""One round, once its group is known: scatter → decide → gather → commit, each its own step.

`Round` is the round's state (what arrived, who is blamed, the decisions) and its driver. The
RPC handlers (handlers.py) write into the same state as parts and reports arrive. First error
latches: any failure raises `RoundFailed` and the averager leaves its inputs and error
feedback as they were."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from protocol import AvgDecision, AvgDecisionQuery, AvgGroup, AvgReport, EncodedTensor, RemoteProtocolError, decode_tensor, make_codec
from protocol.codecs import decode_own

from . import aggregators
from ..net.transport import NETWORK_ERRORS, CallTimeout
from .buffers import Prepared, cut_from
from .config import AverageReport, RoundFailed
from .decisions import accusations, choose_pace, decide_commit, decide_scatter
from .schedule import Batch, InTurn, settle

# the caller's check batches (Averager.average's `judge`): for slice [a, b), the members' parts
# of it, their aggregate and the members, per member the loss of its check batch at θ, with the
# aggregate's slice, with its part's slice
Judge = Callable[[int, int, Sequence[torch.Tensor], torch.Tensor, Sequence[str]], list[tuple[float, float, float]]]

log = logging.getLogger(__name__)

EVIDENCE_PENALTY = 2.0  # per round a member's part was far from the robust aggregate: five such rounds in the score window ban it (TransportConfig.ban_score)

TICK_S = 0.25  # how often a wait on peers looks at their probes
PAUSED_S = 3.0  # a wait that woke this much later than it asked to was paused (SIGSTOP, suspend): the round is given up


@dataclass
class Round:
    group: AvgGroup
    me: str
    leader: str
    report: AverageReport
    state_key: str
    started: float = field(default_factory=time.monotonic)
    received: dict[tuple[str, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # (phase, slice) -> sender -> part
    blamed: dict[str, str] = field(default_factory=dict)  # sender -> reason
    refused: set[str] = field(default_factory=set)  # senders whose bad input this round already scored down
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    reports: dict[str, dict[str, AvgReport]] = field(default_factory=lambda: {"scatter": {}, "gather": {}})
    reported: dict[str, asyncio.Event] = field(default_factory=lambda: {"scatter": asyncio.Event(), "gather": asyncio.Event()})
    decisions: dict[str, AvgDecision] = field(default_factory=dict)
    decided: dict[str, asyncio.Event] = field(default_factory=lambda: {"scatter": asyncio.Event(), "gather": asyncio.Event()})
    survivors: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()
    sends: list[asyncio.Task] = field(default_factory=list)  # our outgoing parts, finishing in the background
    result: torch.Tensor | None = None  # the averaged flat vector being assembled
    # optimistic gather: slices sent before the decision, over every member
    early_ok: bool | None = None  # None: no decision yet; True: nobody failed, early slices count
    early_got: set[tuple[int, str]] = field(default_factory=set)  # (slice, sender) kept before the decision
    early_sends: list[asyncio.Task] = field(default_factory=list)
    final: set[int] = field(default_factory=set)  # slices written from their post-decision source
    locks: dict[int, asyncio.Lock] = field(default_factory=dict)  # one writer of a result slice at a time
    tail: InTurn | Batch | None = None  # our last queued send(s): the next follow
    pace: float | None = None  # bytes/s our sends share, paced (None: sent in turn)
    done: bool = False  # returned or failed: parts that still arrive are refused, never written
    gather_residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # owned slice -> this round's gather error
    evidence: dict[int, dict[str, float]] = field(default_factory=dict)  # owned slice -> members whose part was far from the robust aggregate
    judge: Judge | None = None  # the caller's check batches: per member, losses with its part of a slice we own applied alone
    harm: dict[int, dict[str, float]] = field(default_factory=dict)  # owned slice -> member -> its part's harm to the check batch (aggregators.harm_ratios)

    @property
    def members(self) -> tuple[str, ...]:
        return self.group.members

    def slice_len(self, j: int) -> int:
        return self.group.bounds[j + 1] - self.group.bounds[j]

    def lock(self, j: int) -> asyncio.Lock:
        return self.locks.setdefault(j, asyncio.Lock())

    def decoded(self, enc, max_abs: float, out=None) -> torch.Tensor:
        """Decode a part; refuse NaN, Inf and values beyond `max_abs` (a poisoning guard)."""
        return decode_tensor(enc, max_abs=max_abs, out=out).reshape(-1)


class RoundDriver:
    """Runs one `Round` for an averager (its config, transport, sender, buffers, faults)."""

    def __init__(self, avg, rnd: Round, prepared: Prepared):
        self.avg, self.rnd, self.prepared = avg, rnd, prepared
        self.config, self.sender, self.buffers = avg.config, avg.sender, avg.buffers
        g = rnd.group
        self.codec = make_codec(g.codec, **g.codec_params)
        self.gather_codec = make_codec(g.gather_codec, **g.gather_codec_params)
        self.my_index = g.members.index(rnd.me)
        self.weights = dict(zip(g.members, g.weights))
        self.encoded: dict[int, EncodedTensor] = {}
        self.early: dict[int, asyncio.Task] = {}  # slice -> its early aggregation (and send)
        self.first_mine = [j for j in range(g.n_slices) if g.first_owner(j) == rnd.me]  # the slices the group gave us
        self.mine: list[int] = []  # the slices we own after the decision
        self.owned = dict.fromkeys(g.members, 0)  # elements each member owns, as the group was formed
        for j in range(g.n_slices):
            self.owned[g.first_owner(j)] += g.bounds[j + 1] - g.bounds[j]
        self.probes = avg.matchmaker.probes()  # the peers we wait on: silent ones are not waited for

    async def wait_on(self, event: asyncio.Event, missing, deadline: float, what: str) -> None:
        """Until `missing()` (peers we still wait for) is empty, the deadline, or every peer
        still missing is silent: its last two probes went unanswered (dead, frozen, cut off;
        one slow answer on a busy machine is no reason to drop a member from a round).
        Waiting for it to the deadline would only cost the others that time; one that answers
        is alive and waited for (a slow link, a starved CPU)."""
        while peers := missing() - {self.rnd.me}:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.probes.silent(peers, misses=2) >= peers:
                self.rnd.report.silent = sorted(set(self.rnd.report.silent) | peers)  # (the probes marked them: no next round waits for them either)
                log.debug("round %s: not waiting for %s any more (%s): no answer to a probe", self.rnd.group.group_id, ", ".join(p[-8:] for p in peers), what)
                return
            event.clear()
            self.probes.changed.clear()
            until = time.monotonic() + min(left, TICK_S)
            await self.probes.wait(event, min(left, TICK_S))
            if (late := time.monotonic() - until) > PAUSED_S:  # we were stopped (a closed lid, SIGSTOP): the others moved on
                raise RoundFailed(f"this process was paused for about {late:.0f} s during the round ({what})")

    async def run(self) -> torch.Tensor:
        """The averaged flat vector (on commit), or RoundFailed."""
        rnd, report = self.rnd, self.rnd.report
        t = time.monotonic()
        await self.scatter()
        report.phases["scatter"] = time.monotonic() - t
        self.avg.phase(report.key, "scattered")
        t = time.monotonic()
        await self.decide_scatter()
        await self.aggregate()
        report.phases["aggregate"] = time.monotonic() - t
        t = time.monotonic()
        missing = await self.gather()
        report.phases["gather"] = time.monotonic() - t
        report.early_used = len(rnd.early_got)  # kept: a decision that excluded someone emptied it
        self.avg.phase(report.key, "gathered")
        await self.commit(missing)
        self.accuse()
        return rnd.result

    def accuse(self) -> None:
        """Score down the members whose parts this committed round found far from the robust
        aggregate of a slice we own: repeated, the evidence bans them (with its reason) here."""
        now = time.monotonic()
        harm = self.avg.harm_runs.add(self.rnd.harm) if self.rnd.harm else {}
        for peer, why in accusations(self.rnd.report.key, self.rnd.evidence, self.rnd.me, harm).items():
            log.info("round %s: %s: %s", self.rnd.group.group_id, peer[-8:], why)
            self.avg.transport.scores.penalize(peer, EVIDENCE_PENALTY, now, why)

    # ---- scatter ----

    async def scatter(self) -> None:
        """Every part encoded with error feedback (what earlier rounds' compression lost, per
        element), mostly before the group was known; each sent to its owner. Then wait for the
        parts of our own slices; start aggregating each early once every member's part is in."""
        rnd, g, prepared = self.rnd, self.rnd.group, self.prepared
        loop = asyncio.get_running_loop()
        report, me = rnd.report, rnd.me
        pieces = prepared.encoded if self.codec == self.buffers.codec else []  # encoded before the group was known
        sends, prev = [], None
        n = len(g.members)
        rnd.pace, why = choose_pace(self.config, all(self.avg.transport.paces(m) for m in g.members if m != me), bool(g.slice_owners))
        report.schedule, report.pace = ("paced", rnd.pace) if rnd.pace is not None else ("in turn", 0.0)
        log.debug("scatter %s (%s)", report.schedule, why)
        if g.slice_owners:  # laid out for uneven links: in slice order, so slices fill up one after another
            order = [j for j in range(g.n_slices) if g.first_owner(j) != me]
        else:  # one slice each: each member starts with a different owner
            order = [(self.my_index + 1 + k) % n for k in range(n - 1)]
        for j in order:
            t_enc = time.monotonic()
            self.encoded[j] = cut_from(pieces, self.codec, g.bounds[j], g.bounds[j + 1])
            if self.encoded[j] is None:  # not encoded yet (this split is not the one we expected)
                self.encoded[j] = await loop.run_in_executor(None, self.buffers.encode_part, self.codec, prepared, rnd.state_key, g.bounds[j], g.bounds[j + 1])
            log.debug("encoded scatter %d in %.3f s", j, time.monotonic() - t_enc)
            if rnd.pace is None:  # staggered: sending starts while the next part is being encoded
                prev = self.sender.in_turn(rnd, prev, "scatter", j, self.encoded[j], g.first_owner(j))
                sends.append(prev.task)
        if rnd.pace is not None:
            prev = self.sender.paced(rnd, None, "scatter", [(j, self.encoded[j], g.first_owner(j), None) for j in order])
            sends += prev.tasks
        # our own parts never travel (the decision never moves a survivor's slice), so they
        # count exactly, without the codec's error
        for j in self.first_mine:
            own = await loop.run_in_executor(None, self.buffers.own_part, prepared, g.bounds[j], g.bounds[j + 1])
            rnd.received.setdefault(("scatter", j), {})[me] = own
        # our gather sends queue up behind these, not beside them; except on uneven links, where
        # a slice's result is what the slowest member waits for, and our scatter sends would
        # hold it up until the last of them (a fast member's link has room for both)
        rnd.tail = None if g.slice_owners else prev
        rnd.sends += sends  # they finish in the background; the owners report what arrived
        await self.early_gathers(rnd.started + g.deadline_s)

    async def early_gathers(self, deadline: float) -> None:
        """Until every member's parts of our slices are in (or the deadline, or the missing
        senders went silent). While the leader decides, each slice whose parts are all in is
        aggregated assuming nobody failed (the usual case) and starts on its way at once: the
        decision costs a round trip and the slowest member's scatter, and with several slices
        each one's result leaves while the parts of the next are still coming."""
        rnd, g = self.rnd, self.rnd.group

        def complete(j: int) -> bool:
            got = rnd.received.get(("scatter", j), {})
            return all(m in got for m in g.members)

        pending = list(self.first_mine)
        while True:
            for j in [j for j in pending if complete(j)]:
                self.early[j] = asyncio.create_task(self.early_gather(j))
                pending.remove(j)
            if not pending:
                return

            def missing() -> set[str]:
                if any(complete(j) for j in pending):
                    return set()  # one more slice to start on
                return {m for j in pending for m in g.members if m not in rnd.received.get(("scatter", j), {}) and m not in rnd.blamed}

            await self.wait_on(rnd.arrived, missing, deadline, "parts")
            if not any(complete(j) for j in pending):
                return  # the deadline, or the rest blamed or silent: the decision says

    async def wait_parts(self, slots: list[tuple[str, int]], senders: Sequence[str] | None, deadline: float) -> None:
        """Until every slot has a part from every sender (None: from the slot's owner) or the deadline."""
        rnd = self.rnd

        def missing() -> set[str]:
            out = set()
            for phase, j in slots:
                got = rnd.received.get((phase, j), {})
                need = senders if senders is not None else [rnd.owners[j]]
                out |= {s for s in need if s not in got and s not in rnd.blamed}
            return out

        await self.wait_on(rnd.arrived, missing, deadline, "parts")

    # ---- decision ----

    async def decide_scatter(self) -> None:
        """Who survives and who owns what; re-send our parts of re-owned slices and wait for
        the parts of slices we now own."""
        rnd, g, me, report = self.rnd, self.rnd.group, self.rnd.me, self.rnd.report
        got = [rnd.received.get(("scatter", j), {}) for j in self.first_mine]
        scatter_report = AvgReport(
            group_id=g.group_id,
            phase="scatter",
            received_from=tuple(m for m in g.members if m != me and all(m in parts for parts in got)),
            blamed=tuple(rnd.blamed),
            reasons=tuple(rnd.blamed.values()),
        )
        try:
            if self.avg.faults.active:
                await self.avg.faults.before_report()
            decision = await self.decide("scatter", scatter_report, rnd.started + g.deadline_s)
        except BaseException:
            await asyncio.gather(*self.early.values(), return_exceptions=True)
            raise
        self.avg.phase(report.key, "decided")
        if decision.commit and tuple(decision.survivors) == g.members:
            rnd.early_ok = True
        else:  # slices aggregated before the decision include a failed member: void
            await self.discard_early()
        if not decision.commit:
            raise RoundFailed(f"round aborted after scatter: {decision.reason}")
        rnd.survivors, rnd.owners = decision.survivors, decision.owners
        report.survivors = list(decision.survivors)
        report.failed = [(m, decision.reason) for m in g.members if m not in decision.survivors] if decision.reason else []
        if me not in rnd.survivors:
            if rnd.leader == me:  # excluded, but the others still need our commit decision
                await self.decide("gather", None, time.monotonic() + 2 * g.deadline_s)
            raise RoundFailed(f"excluded from the round: {decision.reason}")
        # re-send our parts of slices whose owner failed to their new owners
        resend = [
            asyncio.create_task(self.sender.send_part(rnd, "scatter", j, self.encoded[j], rnd.owners[j]))
            for j in range(g.n_slices)
            if rnd.owners[j] != g.first_owner(j) and rnd.owners[j] != me
        ]
        self.mine = [j for j in range(g.n_slices) if rnd.owners[j] == me]
        loop = asyncio.get_running_loop()
        for j in self.mine:
            if g.first_owner(j) != me:  # re-owned: our own part counts too, as the failed owner would have decoded it
                rnd.received.setdefault(("scatter", j), {})[me] = await loop.run_in_executor(None, decode_own, self.encoded[j])
        rnd.sends += resend
        await self.wait_parts([("scatter", j) for j in self.mine], rnd.survivors, time.monotonic() + g.deadline_s)
        for j in self.mine:
            missing = [m for m in rnd.survivors if m not in rnd.received.get(("scatter", j), {})]
            if missing:
                raise RoundFailed(f"slice {j}: no part from {', '.join(m[-8:] for m in missing)} after the decision")

    def is_decision(self, reply, phase: str) -> bool:
        """Whether a reply is this round's decision of `phase`: survivors among the members and,
        after the scatter, one owner (a survivor) per slice; anything else is not taken."""
        g = self.rnd.group
        if not (isinstance(reply, AvgDecision) and reply.group_id == g.group_id and reply.phase == phase):
            return False
        if not reply.commit or phase != "scatter":
            return True
        return set(reply.survivors) <= set(g.members) and len(reply.owners) == g.n_slices and set(reply.owners) <= set(reply.survivors)

    async def decide(self, phase: str, mine: AvgReport | None, phase_deadline: float) -> AvgDecision:
        """Report to the leader and get its decision (leading: collect reports and decide;
        `mine` is None when the leader was excluded and only coordinates)."""
        rnd, transport = self.rnd, self.avg.transport
        grace = self.config.decision_grace_s
        if rnd.leader == rnd.me:
            if mine is not None:
                rnd.reports[phase][rnd.me] = mine
            expected = rnd.members if phase == "scatter" else rnd.survivors
            wait_until = max(phase_deadline, time.monotonic()) + grace

            def missing() -> set[str]:
                reports = rnd.reports[phase]
                if phase == "gather" and any(not r.ok for r in reports.values()):
                    return set()  # a survivor lacks a slice: the round aborts whoever else reports
                return set(expected) - set(reports)

            await self.wait_on(rnd.reported[phase], missing, wait_until, f"{phase} reports")
            g = rnd.group
            if phase == "scatter":
                decision = decide_scatter(g.group_id, g.members, rnd.reports[phase], self.config.min_group_size, g.slice_owners)
            else:
                decision = decide_commit(g.group_id, rnd.survivors, rnd.owners, expected, rnd.reports[phase], rnd.report.silent)
            rnd.decisions[phase] = decision
            rnd.decided[phase].set()
            return decision
        silent = False
        try:
            if rnd.leader in self.avg.matchmaker.recently_silent():  # (found out while we waited for its parts)
                raise CallTimeout(f"{rnd.leader[-8:]} went silent during the round")
            # probed while we wait: a leader that went silent is not waited for to the deadline
            reply = await self.avg.matchmaker.call_alive(rnd.leader, mine, timeout=max(phase_deadline - time.monotonic(), 0) + 3 * grace)
            if self.is_decision(reply, phase):
                rnd.decisions[phase] = reply
                rnd.decided[phase].set()
                return reply
            raise RemoteProtocolError("the leader's reply is not this round's decision", "decision")
        except NETWORK_ERRORS as e:
            leader_error, silent = e, rnd.leader in self.avg.matchmaker.silent and isinstance(e, CallTimeout)
        # the leader is gone, confused, or its reply was lost: ask it once more (it keeps its
        # decisions for a minute; not if it went silent), then the other members, who may have it
        for peer in [*([] if silent else [rnd.leader]), *(m for m in rnd.members if m not in (rnd.me, rnd.leader))]:
            try:
                reply = await transport.call(peer, AvgDecisionQuery(group_id=rnd.group.group_id, phase=phase), timeout=grace)
            except NETWORK_ERRORS:
                continue
            if self.is_decision(reply, phase):
                rnd.decisions[phase] = reply
                rnd.decided[phase].set()
                return reply
        raise RoundFailed(f"no decision for {phase}: leader {rnd.leader[-8:]} unreachable ({leader_error})")

    # ---- aggregate + gather ----

    async def aggregate(self) -> None:
        """Aggregate the slices we own over the survivors and send them to every survivor."""
        rnd = self.rnd
        loop = asyncio.get_running_loop()
        for j in self.mine:
            if j in self.early:
                enc, sent = await self.early[j]
                if sent:
                    continue  # on its way since before the decision
            else:
                async with rnd.lock(j):
                    enc = await loop.run_in_executor(None, self.aggregate_encode, j, rnd.survivors)
                    rnd.final.add(j)
            self.send_gather("gather", j, enc, rnd.survivors)

    async def gather(self) -> list[int]:
        """Wait for every slice we do not own; the ones still missing at the deadline."""
        rnd = self.rnd
        others = [j for j in range(rnd.group.n_slices) if rnd.owners[j] != rnd.me]
        self.gather_deadline = time.monotonic() + rnd.group.deadline_s
        await self.wait_parts([("gather", j) for j in others], None, self.gather_deadline)
        return [j for j in others if rnd.owners[j] not in rnd.received.get(("gather", j), {})]

    async def early_gather(self, j: int) -> tuple[object, bool]:
        """Our slice aggregated over every member and, unless a decision already excluded
        someone, sent as an "early" gather: (encoded slice, whether it was sent)."""
        rnd = self.rnd
        enc = await asyncio.get_running_loop().run_in_executor(None, self.aggregate_encode, j, rnd.group.members)
        if not self.config.optimistic_gather or rnd.early_ok is False:
            return enc, False
        rnd.early_sends += self.send_gather("early", j, enc, rnd.group.members)
        return enc, True

    async def discard_early(self) -> None:
        """The decision excluded someone: stop our early sends, forget the early slices we got
        (their owners send them again, aggregated over the survivors). A slice still being
        decoded holds its lock, so whatever is written after it is the right one."""
        rnd = self.rnd
        rnd.early_ok = False
        await asyncio.gather(*self.early.values(), return_exceptions=True)
        self.early = {}
        for task in rnd.early_sends:
            task.cancel()
        for j, sender in rnd.early_got:
            if j not in rnd.final:
                rnd.received.get(("gather", j), {}).pop(sender, None)
        rnd.report.early_discarded = len(rnd.early_got)
        rnd.early_got.clear()

    def send_gather(self, phase: str, j: int, enc, members: Sequence[str]) -> list[asyncio.Task]:
        """Send slice j to every other of `members`, from the slice's next member on (as in
        the scatter), after our sends before it."""
        rnd = self.rnd
        parts = self.sender.parts(rnd.group.group_id, phase, j, enc)
        n, owner = len(members), rnd.group.first_owner(j)
        start = members.index(owner) if owner in members else 0
        prev, tasks = rnd.tail, []  # after our scatter sends: an early gather must not race them
        receivers = [m for m in (members[(start + k) % n] for k in range(1, n + 1)) if m != rnd.me]
        if rnd.group.slice_owners:  # uneven links: the slowest first (it owns least), its download is the round's bottleneck
            receivers.sort(key=self.owned.__getitem__)
        if rnd.pace is not None:
            prev = self.sender.paced(rnd, prev, phase, [(j, enc, m, parts) for m in receivers])
            tasks = prev.tasks
        else:
            for m in receivers:
                prev = self.sender.in_turn(rnd, prev, phase, j, enc, m, parts)
                tasks.append(prev.task)
        rnd.tail = prev
        rnd.sends += tasks
        return tasks

    def aggregate_encode(self, j: int, members: Sequence[str]):
        """Slice j aggregated over `members` (in member order: the same sum, bit for bit, on any
        owner) and encoded for the gather; the owner's result gets exactly what receivers decode."""
        rnd, codec = self.rnd, self.gather_codec
        parts = rnd.received[("scatter", j)]
        w = torch.tensor([self.weights[m] for m in members], dtype=torch.float64)
        agg = aggregators.get(self.config.aggregator)
        ours = [parts[m] for m in members]
        avg = agg(ours, w, **self.config.aggregator_params).contiguous()
        a, b = rnd.group.bounds[j], rnd.group.bounds[j + 1]
        if self.config.aggregator != "mean" and self.config.accuse:  # a robust aggregate: what lies far from it is evidence
            rnd.evidence[j] = aggregators.far_parts(ours, avg, members)
            if rnd.judge is not None:  # and what harms where the aggregate helps
                rnd.harm[j] = self.judged(j, a, b, ours, avg, members)  # (judged once the round commits: accuse)
        if not codec.lossy:
            enc, decoded = codec.encode(avg), avg
        elif not self.config.gather_feedback:
            enc, decoded = codec.encode_with_error(avg)
        else:  # error feedback at the owner: what earlier gathers of this slice lost is sent now
            carry = self.buffers.gather_carry(rnd.state_key, a, b, avg)
            rnd.gather_residuals[j] = torch.empty_like(avg)  # kept only if the round commits
            return codec.encode_with_feedback(avg, carry, out=rnd.gather_residuals[j], decoded=rnd.result[a:b])[0]
        rnd.result[a:b] = decoded
        return enc

    def judged(self, j: int, a: int, b: int, parts: list[torch.Tensor], avg: torch.Tensor, members: Sequence[str]) -> dict[str, float]:
        """How much each member's part of slice j harms its check batch (the caller's judge
        measures, aggregators.harm_ratios compares). A judge that fails judges nobody: the round
        goes on."""
        try:
            losses = self.rnd.judge(a, b, parts, avg, members)
        except Exception as e:  # noqa: BLE001 (a check of ours must never fail the round)
            log.warning("round %s: the check of slice %d failed: %s", self.rnd.group.group_id, j, e)
            return {}
        return aggregators.harm_ratios(losses, members)

    # ---- commit ----

    async def commit(self, missing: list[int]) -> None:
        """The leader applies the round only if every survivor holds every slice."""
        rnd, g = self.rnd, self.rnd.group
        done = AvgReport(
            group_id=g.group_id,
            phase="gather",
            ok=not missing,
            blamed=tuple(rnd.owners[j] for j in missing),
            reasons=tuple(f"slice {j} never arrived" for j in missing),
        )
        decision = await self.decide("gather", done, self.gather_deadline)
        if not decision.commit:
            raise RoundFailed(f"round aborted after gather: {decision.reason}")
        if missing:  # committed without us (our report came too late): we do not hold the average
            raise RoundFailed(f"the others committed, but slice(s) {', '.join(map(str, missing))} never reached us")

    def gather_feedback(self) -> dict[tuple[int, int], torch.Tensor]:
        """(a, b) -> what this committed round's gather lost, per slice we own."""
        g = self.rnd.group
        return {(g.bounds[j], g.bounds[j + 1]): r for j, r in self.rnd.gather_residuals.items()}

    async def finish(self) -> None:
        """After a commit every survivor holds every slice, so nothing still in flight is needed;
        after a failure nothing is. Either way: stop sending, and drop the round's tensors (the
        round itself stays a minute for members asking for its decisions; kept, the tensors
        pinned every round's parts for that minute: GBs in a tight loop, and each new round
        faulted in fresh pages instead of reusing freed ones)."""
        rnd = self.rnd
        rnd.done = True
        await self.probes.close()
        for lock in list(rnd.locks.values()):  # a slice still being decoded into the result
            async with lock:
                pass
        await settle(rnd.sends, time.monotonic())
        rnd.received.clear()
        rnd.gather_residuals.clear()
        rnd.result = None
        rnd.sends.clear()
        rnd.early_sends.clear()

    async def replay_gather(self, delay_s: float) -> None:
        """Fault injection: after the round, send the slices we own again, zeroed."""
        rnd = self.rnd
        await asyncio.sleep(delay_s)
        for j in [j for j, owner in enumerate(rnd.owners) if owner == rnd.me]:
            enc = EncodedTensor("float32", (rnd.slice_len(j),), rnd.group.gather_codec, bytes(4 * rnd.slice_len(j)))
            parts = self.sender.parts(rnd.group.group_id, "gather", j, enc)
            for peer in rnd.survivors:
                if peer != rnd.me:
                    with contextlib.suppress(*NETWORK_ERRORS):
                        await self.avg.transport.send(peer, parts[0], parts[1:], timeout=10)
        self.avg.phase(rnd.report.key, "replayed")
