"""Fault-tolerant compressed all-reduce among the peers that average the same key.

One round, as each member sees it:

1. **Matchmaking.** Publish a signed record under the round's DHT key, then join the group of
   the smallest peer id that wants the same key (it leads; a leader that sees a smaller id
   later hands its joiners over; a joiner follows such redirects). The leader closes the group
   when `expected_peers` have joined or its join window ends, and tells everyone the members,
   their order, the slice bounds (sized by bandwidth, in half-octave steps), the codec, and
   phase deadlines derived from bandwidth. A peer that arrives after the group closed is told
   so and waits for the next round.
2. **Scatter.** The flat vector is cut into one slice per member. Every member sends each owner
   its part, compressed with error feedback (encoded while matchmaking still waits on the
   network, where the codec allows), streamed in chunks: with a declared bandwidth, all parts
   at once, each paced to its share of it (`_send_paced`); else one owner at a time starting
   after its own index, so each link carries one flow at a time (`_send_in_turn`). An owner's
   own part never travels and counts exactly.
3. **Decision.** Every member reports to the leader whose parts it received intact and whom it
   blames (dead, late, NaN, wrong shape). The leader decides who survives (an accuser of half
   the group whom nobody corroborates is the one excluded); a failed member's contribution is
   dropped everywhere and its slice is re-owned by a survivor (its part is re-sent there).
   Fewer survivors than `min_group_size`: the round aborts.
4. **Aggregate + gather.** Owners aggregate their slices over the survivors (mean, or a robust
   aggregator) and send the result to every survivor, as in the scatter; the owner
   keeps the decoded copy of what it sent, so every member holds the same bits. An owner that
   holds every member's part does not wait for the decision: it aggregates over all members
   and sends at once ("early" slices). If the decision then excludes nobody, those are the
   gather; if it excludes someone, they are void everywhere and sent again over the survivors
   (a per-slice lock makes the post-decision copy the one that stays in the result).
5. **Commit.** Members report that they hold every slice; the leader commits only if all
   survivors do, else aborts. Only on commit is the result applied.

First error latches: any failure ends the round for a member as `AveragingFailed`; its inputs
and its error-feedback state are left as they were before the round. A member that cannot
reach the leader asks the other members for the leader's decision before giving up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import statistics
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from protocol import (
    Ack,
    AvgDecision,
    AvgDecisionQuery,
    AvgGroup,
    AvgJoin,
    AvgReport,
    EncodedTensor,
    Message,
    RemoteProtocolError,
    TensorAssembler,
    TensorPart,
    decode_tensor,
    make_codec,
    split,
)
from protocol.codecs import decode_own, finite_max_abs
from protocol.records import MemberRecord

from . import aggregators
from .faults import Faults
from .p2p import Host, PeerUnreachable
from .transport import CallContext, CallTimeout, RemoteError, RPCError, Transport

log = logging.getLogger(__name__)

MAX_EARLY_KEYS = 1024  # keys joins may wait on at once (see `early_join_wait_s`); beyond, they are answered at once
# bytes per element each codec puts on the wire, to size deadlines before anything is sent
_WIRE_BYTES = {"none": 4.0, "fp16": 2.0, "int8": 1.01, "topk": 0.08, "powersgd": 0.05}
_NET_ERRORS = (PeerUnreachable, CallTimeout, RemoteError, ConnectionError, RemoteProtocolError, OSError)


@dataclass(frozen=True)
class AveragerConfig:
    swarm_id: str = "swarmtrain"  # records of other swarms are ignored
    prefix: str = "avg"  # DHT namespace of round keys, e.g. "replicas"
    codec: str = "none"  # scatter codec: none | fp16 | int8 | topk | powersgd
    codec_params: dict = field(default_factory=dict)  # e.g. {"block_size": 1024}
    gather_codec: str | None = None  # codec of averaged slices; None: same as `codec` (without topk/powersgd: fp16)
    aggregator: str = "mean"  # mean | trimmed_mean | centered_clip
    aggregator_params: dict = field(default_factory=dict)
    join_timeout_s: float = 5.0  # how long a leader keeps its group open
    early_join_wait_s: float = 0.5  # a join for a key we are not averaging (yet) waits this long for us to start
    min_group_size: int = 2  # fewer survivors than this: the round aborts
    bandwidth: float = 0.0  # bytes/s this peer can move each way, declared (sizes slices, paces sends); 0: learned from past rounds, no pacing
    default_bandwidth: float = 25e6  # bytes/s assumed before anything was measured
    base_timeout_s: float = 3.0  # every phase deadline: base + slack × expected transfer time
    timeout_slack: float = 4.0
    chunk_bytes: int = 4 << 20  # payload bytes per TensorPart frame
    max_abs: float = math.inf  # parts with larger values are refused (a poisoning / overflow guard)
    slice_align: int = 1024  # slice bounds are multiples of this (int8 blocks stay whole)
    decision_grace_s: float = 2.0  # extra wait for reports / decisions beyond a phase deadline
    reuse_streams: bool = True  # parts travel on pipes kept open between sends (see Transport.send)
    staggered: bool = True  # send a phase's parts one receiver at a time (see `_send_in_turn`)
    stagger_overlap: float = 0.9  # the next send starts when the previous one is this far along (by its expected time; 0.9 with pipes, 0.7 without)
    optimistic_gather: bool = True  # an owner holding every part sends its slice before the decision
    # pacing (see `_send_paced`): with a declared `bandwidth` below `pace_max_rate`, over direct
    # links, a phase's parts leave at once, each paced to its share of pace_share x bandwidth
    pace: bool = True
    pace_share: float = 0.92  # the rest is left for TCP/IP headers and a link a little slower than declared
    pace_max_rate: float = 100e6  # faster links: the CPU, not the link, sets the pace
    gather_feedback: bool = True  # a lossy gather codec's error is carried into the owner's next round

    def __post_init__(self):
        make_codec(self.codec, **self.codec_params)  # fail early on a bad codec
        aggregators.get(self.aggregator)
        if self.min_group_size < 1:
            raise ValueError("min_group_size must be >= 1")

    @property
    def resolved_gather_codec(self) -> str:
        if self.gather_codec:
            return self.gather_codec
        return self.codec if self.codec in ("none", "fp16", "int8") else "fp16"


@dataclass
class AverageReport:
    key: str
    ok: bool = False
    reason: str = ""
    group_id: str = ""
    leader: str = ""
    members: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (peer id, why)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    bounds: tuple[int, ...] = ()  # slice bounds of the flat vector
    late: bool = False  # failed because the group formed without us (others may still be averaging)
    early_used: int = 0  # slices received before the decision and kept (optimistic gather)
    early_discarded: int = 0  # slices received before a decision that excluded someone: sent again
    schedule: str = ""  # how our parts left: "paced" (all at once, each at its share) or "in turn"
    pace: float = 0.0  # bytes/s our paced sends shared


class AveragingFailed(Exception):
    """The round failed for this member; its inputs are unchanged. `.report` says why."""

    def __init__(self, report: AverageReport):
        super().__init__(f"averaging {report.key} failed: {report.reason}")
        self.report = report


class _Fail(Exception):
    """Internal: ends a round with a reason. `late`: the group formed without us (or nobody
    came): the others may well be averaging right now."""

    def __init__(self, reason: str, late: bool = False):
        super().__init__(reason)
        self.late = late


# ---------------------------------------------------------------------------------------------
# Pure helpers


def slice_shares(bandwidths: Sequence[float]) -> list[float]:
    """Relative slice sizes for members with these measured bandwidths. Measurements are noisy
    (±15% between rounds on identical links), and a slice 10% over its fair share makes its owner
    the straggler of both phases; so shares move in half-octave steps around the group's median:
    members within ±19% of it get equal slices, a member at 4x the median gets 4x the slice."""
    bws = [max(float(bw), 1.0) for bw in bandwidths]
    med = statistics.median(bws)
    return [2.0 ** (round(2 * math.log2(bw / med)) / 2) for bw in bws]


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


def decide_survivors(members: Sequence[str], reports: dict[str, AvgReport]) -> tuple[list[str], dict[str, str]]:
    """After scatter: who survives, and why the others failed. Members that did not report
    failed. An owner accuses the senders it blamed or never heard from; the accused fail,
    unless their accuser accused at least half of the others and some of that is corroborated
    by no other owner: then the accuser (a broken receiver, or a liar) is the likely culprit.
    So one NaN sender among three is excluded by its two honest receivers, not the reverse."""
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
        for m in members:
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


def reassign(members: Sequence[str], survivors: Sequence[str]) -> tuple[str, ...]:
    """Owner of each slice: its member if it survived, else survivors round-robin."""
    owners, k = [], 0
    for m in members:
        if m in survivors:
            owners.append(m)
        else:
            owners.append(survivors[k % len(survivors)])
            k += 1
    return tuple(owners)


def _viewable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `_flatten` can view the input instead of copying it."""
    return len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].device.type == "cpu" and tensors[0].is_contiguous()


def _flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat fp32 CPU vector (read-only use: a single fp32 CPU tensor is viewed, not copied),
    written into `out` if given and a copy is needed."""
    if _viewable(tensors):
        return tensors[0].detach().reshape(-1)
    return torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors], out=out)


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[pos : pos + n].view(t.shape).to(t.dtype))
        pos += n
    return out


# ---------------------------------------------------------------------------------------------
# Per-round state


@dataclass
class _Prepared:
    """A round's input, ready before its group is known (see `Averager._prepare`)."""

    flat: torch.Tensor
    residual: torch.Tensor | None = None  # error feedback of earlier rounds (lossy codecs)
    new_residual: torch.Tensor | None = None  # where this round's goes
    encoded: list[tuple[int, int, EncodedTensor]] = field(default_factory=list)  # (a, b, flat[a:b] + residual encoded): cut into parts


@dataclass
class _Batch:
    """Paced sends that left together (see `Averager._send_paced`)."""

    started: asyncio.Future  # loop time they began
    seconds: float  # how long they take at their pace
    tasks: list[asyncio.Task] = field(default_factory=list)


@dataclass
class _Round:
    group: AvgGroup
    me: str
    leader: str
    started: float
    report: AverageReport
    received: dict[tuple[str, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # (phase, slice) -> sender -> part
    blamed: dict[str, str] = field(default_factory=dict)  # sender -> reason
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
    state_key: str = ""
    tail: tuple | _Batch | None = None  # our last queued send(s) (see `_send_in_turn`, `_send_paced`): the next follow
    pace: float | None = None  # bytes/s our sends share, paced (None: sent in turn)
    done: bool = False  # returned or failed: parts that still arrive are refused, never written
    gather_residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # owned slice -> this round's gather error

    @property
    def members(self) -> tuple[str, ...]:
        return self.group.members

    def slice_len(self, j: int) -> int:
        return self.group.bounds[j + 1] - self.group.bounds[j]

    def lock(self, j: int) -> asyncio.Lock:
        return self.locks.setdefault(j, asyncio.Lock())


@dataclass
class _Matchmaking:
    """What this peer is doing about one round key."""

    key: str
    numel: int
    codec: str
    window: float  # seconds this peer, as leader, keeps the group open
    mode: str = "candidate"  # candidate | leader | follower | closed
    following: str = ""
    pending: dict[str, tuple[AvgJoin, asyncio.Future]] = field(default_factory=dict)
    group: AvgGroup | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class Averager:
    """One per node; serves any number of concurrent rounds (different keys)."""

    def __init__(self, host: Host, transport: Transport, config: AveragerConfig = AveragerConfig(), faults: Faults = Faults()):
        self.host, self.transport, self.config, self.faults = host, transport, config, faults
        self.peer_id = host.peer_id
        self.codec = make_codec(config.codec, **config.codec_params)
        self._matchmaking: dict[str, _Matchmaking] = {}
        self._closed_keys: dict[str, float] = {}  # round keys we finished recently -> when
        self._key_started: dict[str, asyncio.Event] = {}  # keys joins wait for us to start averaging
        self._rounds: dict[str, _Round] = {}
        self._round_ready: dict[str, asyncio.Event] = {}
        self._residuals: dict[str, torch.Tensor] = {}  # state_key -> error-feedback residual (flat)
        self._spare_residuals: dict[str, torch.Tensor | None] = {}  # where the next round writes its residual
        self._spare_flats: dict[int, list[torch.Tensor]] = {}  # numel -> flattened-input buffers free for reuse
        self._codec_state: dict[tuple, dict] = {}
        self._gather_residuals: dict[tuple[str, int, int], torch.Tensor] = {}  # (state_key, a, b) -> what the gather lost
        self._measured_bandwidth: float | None = None
        self._flow_rate: float | None = None  # bytes/s one send achieved lately
        self._last_members: tuple[str, ...] = ()  # the last group we completed a round with
        self._last_own: dict[int, tuple[int, int]] = {}  # vector length -> the slice we owned in the last such round
        self.on_phase = None  # optional callable(key, phase): progress for logs and tests
        self._tasks: set[asyncio.Task] = set()
        self._replies_to_lose = faults.lose_decision_replies
        self._joins_to_lose = faults.lose_join_replies

    async def start(self) -> None:
        for msg_type, handler in [
            (AvgJoin, self._on_join),
            (TensorPart, self._on_part),
            (AvgReport, self._on_report),
            (AvgDecisionQuery, self._on_decision_query),
        ]:
            self.transport.on(msg_type, handler)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def reset_feedback(self, state_key: str | None = None) -> None:
        """Zero the error feedback of `state_key` (None: of every key), in place: its buffers
        are kept for the next round (fresh memory costs a page fault per 4 KiB on first touch)."""
        for k, r in self._residuals.items():
            if state_key is None or k == state_key:
                r.zero_()
        for k, r in self._gather_residuals.items():
            if state_key is None or k[0] == state_key:
                r.zero_()
        for k in [k for k in self._codec_state if state_key is None or k[0] == state_key]:
            del self._codec_state[k]

    def _phase(self, key: str, phase: str) -> None:
        log.debug("averaging %s: %s", key, phase)
        if self.on_phase is not None:
            self.on_phase(key, phase)

    @property
    def bandwidth(self) -> float:
        return self.config.bandwidth or self._measured_bandwidth or self.config.default_bandwidth

    def _dht_key(self, key: str) -> str:
        return f"swarmtrain/{self.config.swarm_id}/{self.config.prefix}/{key}"

    # ---- public API ----------------------------------------------------------------------------

    async def average(
        self,
        key: str,
        tensors: Sequence[torch.Tensor],
        weight: float = 1.0,
        expected_peers: int | Collection[str] | None = None,
        state_key: str | None = None,
        join_timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], AverageReport]:
        """Average `tensors` with the peers averaging the same `key`. Returns new tensors and a
        report, or raises AveragingFailed (inputs and error-feedback state untouched).
        `state_key` names the error-feedback residual that carries over between rounds;
        `join_timeout_s` overrides the config's wait for late peers for this round.
        `expected_peers`: a leader closes its group early once this many peers joined, or, given
        peer ids, once every one of them joined (a peer nobody counted on does not take the
        place of one that is still on its way)."""
        t0 = time.monotonic()
        report = AverageReport(key=key)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"averaging {key}: weight must be finite and > 0, got {weight}")
        state_key = state_key or self.config.prefix
        numel = sum(t.numel() for t in tensors)
        # flattening, checking and snapshotting (seconds for big models) overlap matchmaking.
        # With a lossy codec nothing refers to the flat copy once the round is over (what we
        # send is encoded apart from it), so the next round reuses its memory: fresh memory
        # costs a page fault per 4 KiB, ~0.05 s per round at 100 MB here.
        reuse = self.codec.lossy and not _viewable(tensors)
        spares = self._spare_flats.setdefault(numel, []) if reuse else []
        spare = spares.pop() if spares else None
        feedback = self._feedback_buffers(state_key, numel) if self.codec.lossy else None
        own = self._last_own.get(numel, (0, 0))  # the slice we owned last time: likely ours again
        prepare = asyncio.get_running_loop().run_in_executor(None, self._prepare, key, tensors, spare, feedback, own)
        try:
            window = self.config.join_timeout_s if join_timeout_s is None else join_timeout_s
            group = await self._matchmake(key, numel, weight, expected_peers, report, window)
            report.phases["matchmaking"] = time.monotonic() - t0
            prepared = await prepare
            result, new_residual = await self._run_round(group, prepared, state_key, report)
        except (_Fail, *_NET_ERRORS) as e:
            # the residual of earlier rounds is untouched (this round wrote into a spare)
            report.ok, report.reason = False, str(e) or type(e).__name__
            report.late = getattr(e, "late", False)
            report.seconds = time.monotonic() - t0
            await asyncio.gather(prepare, return_exceptions=True)
            raise AveragingFailed(report) from None
        except BaseException:
            await asyncio.gather(prepare, return_exceptions=True)
            raise
        finally:
            self._forget_key_later(key)
            if reuse and prepare.done() and not prepare.cancelled() and prepare.exception() is None and len(spares) < 2:
                spares.append(prepare.result().flat)
        if new_residual is not None:  # commit this round's error feedback; the old one becomes the spare
            self._spare_residuals[state_key] = self._residuals.get(state_key)
            self._residuals[state_key] = new_residual
        report.ok, report.seconds = True, time.monotonic() - t0
        self._learn_bandwidth(report)
        self._last_members = tuple(report.survivors)
        if self.peer_id in report.members:
            i = report.members.index(self.peer_id)
            self._last_own[numel] = (report.bounds[i], report.bounds[i + 1])
        return _unflatten(result, tensors), report

    def _feedback_buffers(self, state_key: str, numel: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(residual of earlier rounds, spare buffer for this round's), None where there is
        none of the right size yet (`_prepare` allocates it)."""
        residual = self._residuals.get(state_key)
        spare = self._spare_residuals.pop(state_key, None)
        return (
            residual if residual is not None and residual.numel() == numel else None,
            spare if spare is not None and spare.numel() == numel else None,
        )

    def _prepare(self, key: str, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None, feedback=None, own=(0, 0)) -> _Prepared:
        """The flat fp32 vector to average (written into `out` when given and a copy is needed)
        and, with a lossy codec, its error-feedback buffers. A codec whose encoding can be cut
        (`Codec.cut`) encodes the vector here, while matchmaking waits on the network: once the
        group is known the first part can leave at once, instead of after the CPU burst of
        every member encoding at the same moment. Except the slice `own` [a, b): the one we
        owned last round, which never travels if we own it again."""
        t0 = time.monotonic()
        flat = _flatten(tensors, out)
        if not math.isfinite(finite_max_abs(flat)):
            raise ValueError(f"averaging {key}: local tensors contain NaN or Inf")
        t1 = time.monotonic()
        prepared = _Prepared(flat)
        if feedback is not None:
            residual, new_residual = feedback
            prepared.residual = residual if residual is not None else torch.zeros_like(flat)
            prepared.new_residual = new_residual if new_residual is not None else torch.empty_like(flat)
            if self.codec.cut_align and self.config.slice_align % self.codec.cut_align == 0:
                for a, b in ((0, own[0]), (own[1], flat.numel())) if own[1] > own[0] else ((0, flat.numel()),):
                    if b > a:
                        enc = self.codec.encode_with_feedback(flat[a:b], prepared.residual[a:b], out=prepared.new_residual[a:b], keep_decoded=False)[0]
                        prepared.encoded.append((a, b, enc))
        log.debug("prepared in %.3f s (flatten+check %.3f)", time.monotonic() - t0, t1 - t0)
        return prepared

    def _learn_bandwidth(self, report: AverageReport) -> None:
        """Deadlines of later rounds follow what the transfers of this one achieved."""
        busy = report.phases.get("scatter", 0) + report.phases.get("gather", 0)
        moved = report.bytes_sent + report.bytes_received
        if busy > 0.05 and moved > (1 << 20):
            bw = moved / busy
            old = self._measured_bandwidth
            self._measured_bandwidth = bw if old is None else 0.7 * old + 0.3 * bw

    # ---- matchmaking ---------------------------------------------------------------------------

    async def _matchmake(self, key: str, numel: int, weight: float, expected: int | Collection[str] | None, report: AverageReport, window: float) -> AvgGroup:
        if key in self._matchmaking or key in self._closed_keys:
            raise _Fail(f"round {key} was already averaged or is in progress here")
        mm = _Matchmaking(key, numel, self.config.codec, window)
        self._matchmaking[key] = mm
        started = self._key_started.pop(key, None)
        if started is not None:  # joins that came before we did are waiting for this
            started.set()
        me = self.peer_id
        join = AvgJoin(round_key=key, numel=numel, weight=weight, bandwidth=self.bandwidth, codec=self.config.codec)
        deadline = time.monotonic() + window
        rec = MemberRecord(self.config.swarm_id, me, (), "averaging", 0, time.time()).sign(self.host.key)
        # announced in the background: peers that know the group from the last round do not
        # need the DHT at all, and the others find us there a moment later
        self._spawn(self.host.dht_store(self._dht_key(key), rec.to_bytes(), time.time() + window + 60, subkey=me))
        excluded: set[str] = set()
        redirects, failures = 0, {}
        # the leader of the last round is most likely the leader of this one
        target: str | None = min(self._last_members) if me in self._last_members else None
        predicted = target is not None
        while True:
            if target is None:
                candidates = sorted((await self._candidates(key)) - excluded | {me})
                target = candidates[0]
            log.debug("matchmaking %s: target %s%s", key, target[-8:], " (predicted)" if predicted else "")
            if target == me:
                mm.mode = "leader"
                smaller = await self._lead(mm, join, deadline, expected, excluded)
                if mm.group is not None:
                    report.leader = me
                    return mm.group
                target, predicted = smaller, False  # a smaller peer wants this key: hand over to it
                continue
            mm.mode, mm.following = "follower", target
            self._redirect_pending(mm, target)
            try:
                # a leader answers by the end of its own window, which may be longer than ours
                reply = await self.transport.call(target, join, timeout=3 * window + 2 * self.config.decision_grace_s)
            except _NET_ERRORS as e:
                log.debug("matchmaking %s: %s unusable as leader: %s", key, target[-8:], e)
                failures[target] = failures.get(target, 0) + 1
                if failures[target] == 1 and not isinstance(e, CallTimeout) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)  # one retry: a stream can close under load
                    continue
                excluded.add(target)
                target, predicted = None, False
                if time.monotonic() > deadline:
                    raise _Fail("no leader could be reached before the join deadline") from None
                continue
            log.debug("matchmaking %s: %s answered %s %s %s", key, target[-8:], getattr(reply, "status", reply), getattr(reply, "redirect", "")[-8:], getattr(reply, "reason", ""))
            if not isinstance(reply, AvgGroup):
                excluded.add(target)
                target, predicted = None, False
                continue
            if reply.status == "group":
                self._check_group(reply, numel)
                report.leader = target
                mm.group = reply
                return reply
            if reply.status == "redirect":
                if reply.redirect and reply.redirect != target and redirects < 16:
                    # the redirect names the peer the others follow: worth another try even if
                    # an earlier call to it failed (a stream closed under load, say)
                    redirects += 1
                    excluded.discard(reply.redirect)
                    target, predicted = reply.redirect, False
                    continue
                # a redirect we cannot follow (to nowhere, back to the same peer, or in circles)
                # says nothing about a group: look again in the DHT
                excluded.add(target)
                target, predicted = None, False
                if time.monotonic() > deadline:
                    raise _Fail("no usable leader before the join deadline", late=True)
                await asyncio.sleep(0.05)
                continue
            if reply.reason == "not averaging this key":
                if not predicted:  # found in the DHT, yet not averaging: finished or restarted
                    excluded.add(target)
                target, predicted = None, False  # a predicted leader may just not have arrived yet
                await asyncio.sleep(0.05)
                if time.monotonic() > deadline:
                    raise _Fail("no group formed before the join deadline", late=True)
                continue
            raise _Fail(f"too late for round {key}: {target[-8:]} answered {reply.status}: {reply.reason or 'the group formed without us'}", late=True)

    async def _candidates(self, key: str) -> set[str]:
        raw = await self.host.dht_get(self._dht_key(key))
        out = set()
        if isinstance(raw, dict):
            for subkey, value in raw.items():
                try:
                    rec = MemberRecord.from_bytes(value, self.config.swarm_id)
                except RemoteProtocolError:
                    continue
                if rec.peer_id == subkey:
                    out.add(rec.peer_id)
        return out

    async def _lead(self, mm: _Matchmaking, own: AvgJoin, deadline: float, expected: int | Collection[str] | None, excluded: set[str]) -> str | None:
        """Lead until the window closes (form the group) or a smaller peer shows up (return it)."""
        while True:
            if self._all_joined(mm, expected):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            mm.changed.clear()
            try:
                await asyncio.wait_for(mm.changed.wait(), timeout=min(0.3, left))
            except TimeoutError:
                pass
            if self._all_joined(mm, expected):
                break
            try:  # a slow DHT must not hold the group past the window: joiners stop waiting
                found = await asyncio.wait_for(self._candidates(mm.key), timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                found = set()
            smaller = sorted(c for c in found - excluded if c < self.peer_id)
            if smaller:
                return smaller[0]
        mm.mode = "closed"
        joins = {self.peer_id: own, **{p: j for p, (j, _) in mm.pending.items()}}
        members = tuple(sorted(joins))
        if len(members) < self.config.min_group_size:
            for _, fut in mm.pending.values():
                if not fut.done():
                    fut.set_result(AvgGroup(status="closed", reason="too few peers for a group"))
            raise _Fail(f"too late or alone: no other peer joined {mm.key} within {mm.window:.1f} s", late=True)
        bws = [joins[m].bandwidth or self.config.default_bandwidth for m in members]
        gather = self.config.resolved_gather_codec
        per_elem = max(_WIRE_BYTES.get(self.config.codec, 4.0), _WIRE_BYTES.get(gather, 4.0))
        n = len(members)
        moved = 2 * (n - 1) / max(n, 1) * own.numel * per_elem  # bytes in + out per member, one phase
        expected_s = moved / min(bws)
        group = AvgGroup(
            status="group",
            group_id=secrets.token_hex(8),
            members=members,
            weights=tuple(joins[m].weight for m in members),
            bounds=slice_bounds(own.numel, slice_shares(bws), self.config.slice_align),
            codec=self.config.codec,
            codec_params=dict(self.codec.__dict__) if self.config.codec != "none" else {},
            gather_codec=gather,
            deadline_s=self.config.base_timeout_s + self.config.timeout_slack * expected_s,
        )
        mm.group = group
        for _, fut in mm.pending.values():
            if not fut.done():
                fut.set_result(group)
        log.debug("matchmaking %s: formed group %s of %s", mm.key, group.group_id, ", ".join(m[-8:] for m in members))
        return None

    def _all_joined(self, mm: _Matchmaking, expected: int | Collection[str] | None) -> bool:
        if not expected:
            return False
        joined = {self.peer_id, *mm.pending}
        return len(joined) >= expected if isinstance(expected, int) else joined >= set(expected)

    def _redirect_pending(self, mm: _Matchmaking, target: str) -> None:
        for _, fut in mm.pending.values():
            if not fut.done():
                fut.set_result(AvgGroup(status="redirect", redirect=target))
        mm.pending.clear()

    def _check_group(self, g: AvgGroup, numel: int) -> None:
        if self.peer_id not in g.members:
            raise RemoteProtocolError("we are not in the group we were given", "members")
        if g.bounds[-1] != numel:
            raise RemoteProtocolError(f"bounds cover {g.bounds[-1]} elements, we have {numel}", "bounds")
        if g.codec != self.config.codec:
            raise RemoteProtocolError(f"group codec {g.codec} differs from ours ({self.config.codec})", "codec")

    async def _on_join(self, ctx: CallContext) -> AvgGroup:
        req: AvgJoin = ctx.request
        mm = self._matchmaking.get(req.round_key)
        if mm is None and req.round_key not in self._closed_keys and len(self._key_started) < MAX_EARLY_KEYS:
            # a peer that predicted us as leader may be a few ms ahead of our own call for this
            # key: wait a little rather than send it looking for another leader
            started = self._key_started.setdefault(req.round_key, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started.wait(), timeout=self.config.early_join_wait_s)
            mm = self._matchmaking.get(req.round_key)
            if mm is None and self._key_started.get(req.round_key) is started:
                del self._key_started[req.round_key]
        if mm is None:
            if req.round_key in self._closed_keys:
                return AvgGroup(status="closed", reason="this round is over here")
            return AvgGroup(status="closed", reason="not averaging this key")
        if mm.mode == "follower":
            return AvgGroup(status="redirect", redirect=mm.following)
        if mm.group is not None and ctx.peer_id in mm.group.members:
            return mm.group  # a member asking again: our first answer was lost on the way
        if mm.mode == "closed" or mm.group is not None:
            return AvgGroup(status="closed", reason="the group already formed")
        if req.numel != mm.numel:
            raise RPCError("bad_request", f"vector has {req.numel} elements, this group averages {mm.numel}")
        if req.codec != mm.codec:
            raise RPCError("bad_request", f"codec {req.codec} differs from this group's {mm.codec}")
        fut = asyncio.get_running_loop().create_future()
        old = mm.pending.get(ctx.peer_id)
        if old and not old[1].done():
            old[1].set_result(AvgGroup(status="closed", reason="superseded by a newer join"))
        mm.pending[ctx.peer_id] = (req, fut)
        mm.changed.set()
        try:
            answer = await asyncio.wait_for(asyncio.shield(fut), timeout=mm.window + self.config.decision_grace_s)
        except TimeoutError:
            mm.pending.pop(ctx.peer_id, None)
            return AvgGroup(status="closed", reason="the leader did not form a group in time")
        if answer.status == "group" and self._joins_to_lose > 0:  # fault injection: the answer never arrives
            self._joins_to_lose -= 1
            raise ConnectionError("fault injection: join reply lost")
        return answer

    def _forget_key_later(self, key: str) -> None:
        self._matchmaking.pop(key, None)
        now = time.monotonic()
        self._closed_keys[key] = now
        for k, t in list(self._closed_keys.items()):
            if now - t > 600:
                del self._closed_keys[k]

    # ---- the round -----------------------------------------------------------------------------

    async def _run_round(self, group: AvgGroup, prepared: _Prepared, state_key: str, report: AverageReport) -> torch.Tensor:
        me, flat = self.peer_id, prepared.flat
        rnd = _Round(group=group, me=me, leader=report.leader, started=time.monotonic(), report=report, state_key=state_key)
        rnd.result = torch.empty_like(flat)  # gathered slices are decoded straight into it
        report.group_id, report.members, report.bounds = group.group_id, list(group.members), group.bounds
        self._phase(report.key, "matched")
        self._rounds[group.group_id] = rnd
        self._round_ready.setdefault(group.group_id, asyncio.Event()).set()
        try:
            result = await self._phases(rnd, prepared)
            if self.faults.replay_gather_s:
                self._spawn(self._replay_gather(rnd))
            return result
        finally:
            # after a commit every survivor holds every slice, so nothing still in flight is
            # needed; after a failure nothing is. Either way: stop sending.
            rnd.done = True
            for lock in list(rnd.locks.values()):  # a slice still being decoded into the result
                async with lock:
                    pass
            await _settle(rnd.sends, time.monotonic())
            # the round stays a minute for members asking for its decisions: without its tensors
            # (kept, they pinned every round's parts for that minute: GBs in a tight loop, and
            # each new round faulted in fresh pages instead of reusing freed ones)
            rnd.received.clear()
            rnd.gather_residuals.clear()
            rnd.result = None
            rnd.sends.clear()
            rnd.early_sends.clear()
            self._schedule_cleanup(group.group_id)

    async def _phases(self, rnd: _Round, prepared: _Prepared) -> torch.Tensor:
        g, me, report, state_key = rnd.group, rnd.me, rnd.report, rnd.state_key
        t = time.monotonic()
        loop = asyncio.get_running_loop()
        codec = make_codec(g.codec, **g.codec_params)
        gather_codec = make_codec(g.gather_codec)
        my_index = g.members.index(me)

        # -- scatter: every part encoded with error feedback (what earlier rounds' compression
        # lost, per element), mostly before the group was known; each sent to its owner
        flat, residual, new_residual = prepared.flat, prepared.residual, prepared.new_residual
        pieces = prepared.encoded if repr(codec) == repr(self.codec) else []  # encoded before the group was known
        encoded, sends, prev = {}, [], None
        n = len(g.members)
        rnd.pace = self._pace_for(rnd)
        report.schedule, report.pace = ("paced", rnd.pace) if rnd.pace is not None else ("in turn", 0.0)
        log.debug("scatter %s%s", report.schedule, f" at {rnd.pace / 1e6:.2f} MB/s" if rnd.pace else "")
        order = [(my_index + 1 + k) % n for k in range(n - 1)]  # each member starts with a different owner
        for j in order:
            t_enc = time.monotonic()
            encoded[j] = _cut_from(pieces, codec, g.bounds[j], g.bounds[j + 1])
            if encoded[j] is None:  # not encoded yet (this split is not the one we expected)
                encoded[j] = await loop.run_in_executor(
                    None, self._encode_part, codec, flat, residual, new_residual, state_key, g.bounds[j], g.bounds[j + 1]
                )
            log.debug("encoded scatter %d in %.3f s", j, time.monotonic() - t_enc)
            if rnd.pace is None:  # staggered: sending starts while the next part is being encoded
                prev = self._send_in_turn(rnd, prev, "scatter", j, encoded[j], g.members[j])
                sends.append(prev[0])
        if rnd.pace is not None:
            prev = self._send_paced(rnd, None, "scatter", [(j, encoded[j], g.members[j], None) for j in order])
            sends += prev.tasks
        # our own part never travels (the decision never moves a survivor's slice), so it counts
        # exactly, without the codec's error
        own = await loop.run_in_executor(None, self._own_part, flat, residual, new_residual, g.bounds[my_index], g.bounds[my_index + 1])
        rnd.received.setdefault(("scatter", my_index), {})[me] = own
        rnd.tail = prev  # our gather sends queue up behind these, not beside them
        rnd.sends += sends  # they finish in the background; the owners report what arrived
        deadline = rnd.started + g.deadline_s
        await self._wait_parts(rnd, [("scatter", my_index)], g.members, deadline)
        weights = {m: w for m, w in zip(g.members, g.weights)}
        # while the leader decides, aggregate our slice assuming nobody failed (the usual case)
        # and start sending it: the decision costs a round trip and the slowest member's scatter
        early = None
        if all(m in rnd.received.get(("scatter", my_index), {}) for m in g.members):
            early = asyncio.create_task(self._early_gather(rnd, my_index, weights, gather_codec))
        report.phases["scatter"] = time.monotonic() - t
        self._phase(report.key, "scattered")
        t = time.monotonic()

        # -- decision: who survives, who owns what
        got = rnd.received.get(("scatter", my_index), {})
        scatter_report = AvgReport(
            group_id=g.group_id,
            phase="scatter",
            received_from=tuple(m for m in g.members if m in got and m != me),
            blamed=tuple(rnd.blamed),
            reasons=tuple(rnd.blamed.values()),
        )
        try:
            if self.faults.active:
                await self.faults.before_report()
            decision = await self._decide(rnd, "scatter", scatter_report, deadline)
        except BaseException:
            if early is not None:
                await asyncio.gather(early, return_exceptions=True)
            raise
        self._phase(report.key, "decided")
        if decision.commit and tuple(decision.survivors) == g.members:
            rnd.early_ok = True
        else:  # slices aggregated before the decision include a failed member: void
            await self._discard_early(rnd, early)
            early = None
        if not decision.commit:
            raise _Fail(f"round aborted after scatter: {decision.reason}")
        rnd.survivors, rnd.owners = decision.survivors, decision.owners
        report.survivors = list(decision.survivors)
        report.failed = [(m, decision.reason) for m in g.members if m not in decision.survivors] if decision.reason else []
        if me not in rnd.survivors:
            if rnd.leader == me:  # excluded, but the others still need our commit decision
                await self._decide(rnd, "gather", None, time.monotonic() + 2 * g.deadline_s)
            raise _Fail(f"excluded from the round: {decision.reason}")
        # re-send our parts of slices whose owner failed to their new owners
        resend = [
            asyncio.create_task(self._send_part(rnd, "scatter", j, encoded[j], rnd.owners[j]))
            for j in range(len(g.members))
            if rnd.owners[j] != g.members[j] and rnd.owners[j] != me
        ]
        mine = [j for j in range(len(g.members)) if rnd.owners[j] == me]
        for j in mine:
            if g.members[j] != me:  # re-owned: our own part counts too, as the failed owner would have decoded it
                rnd.received.setdefault(("scatter", j), {})[me] = await loop.run_in_executor(None, decode_own, encoded[j])
        rnd.sends += resend
        deadline = time.monotonic() + g.deadline_s
        await self._wait_parts(rnd, [("scatter", j) for j in mine], rnd.survivors, deadline)
        for j in mine:
            missing = [m for m in rnd.survivors if m not in rnd.received.get(("scatter", j), {})]
            if missing:
                raise _Fail(f"slice {j}: no part from {', '.join(m[-8:] for m in missing)} after the decision")

        # -- aggregate owned slices, gather everything
        result = rnd.result
        for j in mine:
            if j == my_index and early is not None:
                enc, sent = await early
                if sent:
                    continue  # on its way since before the decision
            else:
                async with rnd.lock(j):
                    enc = await loop.run_in_executor(None, self._aggregate_encode, rnd, j, weights, rnd.survivors, gather_codec)
                    rnd.final.add(j)
            self._send_gather(rnd, "gather", j, enc, rnd.survivors)
        report.phases["aggregate"] = time.monotonic() - t
        t = time.monotonic()
        others = [j for j in range(len(g.members)) if rnd.owners[j] != me]
        deadline = time.monotonic() + g.deadline_s
        await self._wait_parts(rnd, [("gather", j) for j in others], None, deadline)
        missing = [j for j in others if rnd.owners[j] not in rnd.received.get(("gather", j), {})]
        report.phases["gather"] = time.monotonic() - t
        report.early_used = len(rnd.early_got)  # kept: a decision that excluded someone emptied it
        self._phase(report.key, "gathered")

        # -- commit: the leader applies the round only if every survivor holds every slice
        done = AvgReport(
            group_id=g.group_id,
            phase="gather",
            ok=not missing,
            blamed=tuple(rnd.owners[j] for j in missing),
            reasons=tuple(f"slice {j} never arrived" for j in missing),
        )
        decision = await self._decide(rnd, "gather", done, deadline)
        if not decision.commit:
            raise _Fail(f"round aborted after gather: {decision.reason}")
        # what this round's gather lost, per slice we own now (slices we no longer own: dropped)
        for k in [k for k in self._gather_residuals if k[0] == state_key]:
            del self._gather_residuals[k]
        for j, r in rnd.gather_residuals.items():
            self._gather_residuals[(state_key, g.bounds[j], g.bounds[j + 1])] = r
        return result, new_residual

    async def _early_gather(self, rnd: _Round, j: int, weights: dict[str, float], codec) -> tuple[object, bool]:
        """Our slice aggregated over every member and, unless a decision already excluded
        someone, sent as an "early" gather: (encoded slice, whether it was sent)."""
        enc = await asyncio.get_running_loop().run_in_executor(None, self._aggregate_encode, rnd, j, weights, rnd.group.members, codec)
        if not self.config.optimistic_gather or rnd.early_ok is False:
            return enc, False
        rnd.early_sends += self._send_gather(rnd, "early", j, enc, rnd.group.members)
        return enc, True

    async def _discard_early(self, rnd: _Round, early: asyncio.Task | None) -> None:
        """The decision excluded someone: stop our early sends, forget the early slices we got
        (their owners send them again, aggregated over the survivors). A slice still being
        decoded holds its lock, so whatever is written after it is the right one."""
        rnd.early_ok = False
        if early is not None:
            await asyncio.gather(early, return_exceptions=True)
        for task in rnd.early_sends:
            task.cancel()
        for j, sender in rnd.early_got:
            if j not in rnd.final:
                rnd.received.get(("gather", j), {}).pop(sender, None)
        rnd.report.early_discarded = len(rnd.early_got)
        rnd.early_got.clear()

    def _send_gather(self, rnd: _Round, phase: str, j: int, enc, members: Sequence[str]) -> list[asyncio.Task]:
        """Send slice j to every other of `members`, in turn, from the slice's next member on
        (as in the scatter)."""
        parts = self._parts(rnd, phase, j, enc)
        n, owner = len(members), rnd.group.members[j]
        start = members.index(owner) if owner in members else 0
        prev, tasks = rnd.tail, []  # after our scatter sends: an early gather must not race them
        receivers = [m for m in (members[(start + k) % n] for k in range(1, n + 1)) if m != rnd.me]
        if rnd.pace is not None:
            prev = self._send_paced(rnd, prev, phase, [(j, enc, m, parts) for m in receivers])
            tasks = prev.tasks
        else:
            for m in receivers:
                prev = self._send_in_turn(rnd, prev, phase, j, enc, m, parts)
                tasks.append(prev[0])
        rnd.tail = prev
        rnd.sends += tasks
        return tasks

    async def _replay_gather(self, rnd: _Round) -> None:
        """Fault injection: after the round, send the slices we own again, zeroed."""
        await asyncio.sleep(self.faults.replay_gather_s)
        for j in [j for j, owner in enumerate(rnd.owners) if owner == rnd.me]:
            enc = EncodedTensor("float32", (rnd.slice_len(j),), rnd.group.gather_codec, bytes(4 * rnd.slice_len(j)))
            parts = self._parts(rnd, "gather", j, enc)
            for peer in rnd.survivors:
                if peer != rnd.me:
                    with contextlib.suppress(*_NET_ERRORS):
                        await self.transport.send(peer, parts[0], parts[1:], timeout=10)
        self._phase(rnd.report.key, "replayed")

    @staticmethod
    def _own_part(flat, residual, new_residual, a, b) -> torch.Tensor:
        """Our contribution to the slice we own: exact, with what compression lost in earlier
        rounds (when other members owned these elements) added back, so nothing is lost."""
        if residual is None:
            return flat[a:b]
        new_residual[a:b].zero_()
        return flat[a:b] + residual[a:b]

    def _encode_part(self, codec, flat, residual, new_residual, state_key, a, b):
        """The encoded part; this round's residual goes to `new_residual`. What its owner will
        decode is not kept (needed only if we inherit the slice, and then decoded again)."""
        if residual is None:  # lossless
            return codec.encode(flat[a:b])
        state = self._codec_state.setdefault((state_key, a, b), {})
        return codec.encode_with_feedback(flat[a:b], residual[a:b], state, out=new_residual[a:b], keep_decoded=False)[0]

    def _aggregate_encode(self, rnd: _Round, j: int, weights: dict[str, float], members: Sequence[str], codec):
        """Slice j aggregated over `members` (in member order: the same sum, bit for bit, on any
        owner) and encoded for the gather; the owner's result gets exactly what receivers decode."""
        parts = rnd.received[("scatter", j)]
        w = torch.tensor([weights[m] for m in members], dtype=torch.float64)
        agg = aggregators.get(self.config.aggregator)
        avg = agg([parts[m] for m in members], w, **self.config.aggregator_params).contiguous()
        a, b = rnd.group.bounds[j], rnd.group.bounds[j + 1]
        if not codec.lossy:
            enc, decoded = codec.encode(avg), avg
        elif not self.config.gather_feedback:
            enc, decoded = codec.encode_with_error(avg)
        else:  # error feedback at the owner: what earlier gathers of this slice lost is sent now
            carry = self._gather_residuals.get((rnd.state_key, a, b))
            if carry is None or carry.numel() != avg.numel():
                carry = torch.zeros_like(avg)
            rnd.gather_residuals[j] = torch.empty_like(avg)  # kept only if the round commits
            return codec.encode_with_feedback(avg, carry, out=rnd.gather_residuals[j], decoded=rnd.result[a:b])[0]
        rnd.result[a:b] = decoded
        return enc

    def _parts(self, rnd: _Round, phase: str, j: int, enc) -> list[TensorPart]:
        return split(enc, f"{rnd.group.group_id}|{phase}|{j}", self.config.chunk_bytes)

    def _pace_for(self, rnd: _Round) -> float | None:
        """Bytes/s our paced sends share this round, or None: send in turn (`_send_in_turn`).
        Pacing needs our upload rate declared (`bandwidth`), below `pace_max_rate`, and direct
        pipes to every other member. Not measured: a paced flow cannot see how much faster the
        link could go, and a flow sent in turn rarely has the link to itself long enough to
        tell (from TCP's acknowledged bytes, 4 peers on 100 Mbit links: estimates ranged from
        0.35x the link for 1.6 MB parts to 1.25x for 6.5 MB ones, acks arriving in bursts).
        And pacing a few % above a link costs more than pacing below it: its queue overflows
        and TCP backs off (12.9 MB/s paced on 12 MB/s: rounds took 1.3x as long)."""
        cfg = self.config
        rate = cfg.bandwidth * cfg.pace_share
        if not cfg.pace or not rate or rate > cfg.pace_max_rate:
            return None
        if not all(self.transport.paces(m) for m in rnd.members if m != rnd.me):
            return None
        return rate

    def _send_paced(self, rnd: _Round, prev, phase: str, items: list[tuple]) -> _Batch:
        """Send every (slice, encoded, peer, frames) item at once, once `prev` (the sends before)
        is done or should be, each flow paced by the kernel to its share of `rnd.pace` by size.
        Flows that keep to their shares neither queue at our uplink nor at a receiver's
        downlink (each receiver gets one such flow from every sender), so a member that starts
        late slows only its own flows. Measured with raw TCP, 4 peers exchanging 1.6 MB parts over
        100 Mbit token buckets: 1.12-1.16x the bound paced, 1.24-1.40x one receiver at a time."""
        loop = asyncio.get_running_loop()
        total = sum(enc.nbytes for _, enc, _, _ in items) or 1
        batch = _Batch(started=loop.create_future(), seconds=total / rnd.pace)

        async def go(j, enc, peer, parts) -> None:
            if not batch.started.done():
                if prev is not None:
                    await self._after(prev)
                if not batch.started.done():
                    batch.started.set_result(loop.time())
            await self._send_part(rnd, phase, j, enc, peer, parts, pace=rnd.pace * enc.nbytes / total)

        batch.tasks = [asyncio.create_task(go(*item)) for item in items]
        return batch

    async def _after(self, prev) -> None:
        """Until the sends of `prev` (a `_Batch` or a `_send_in_turn` triple) are done, or a
        paced batch has had the time its size and rate need."""
        if isinstance(prev, _Batch):
            started = await asyncio.shield(prev.started)
            left = started + prev.seconds - asyncio.get_running_loop().time()
            if left > 0:
                await asyncio.wait(prev.tasks, timeout=left)
        else:
            await asyncio.wait([prev[0]])

    def _send_in_turn(self, rnd: _Round, prev: tuple | None, phase: str, j: int, enc, peer: str, parts=None):
        """(task, bytes, started): a task sending a part once `prev` (the send before it, its
        size, when it started) is done, or has run longer than it should have. Every member
        sends its parts in the order of member indices starting after its own, so at any
        moment each peer uploads to one receiver and each receiver downloads from one sender:
        on a shaped link, N-1 concurrent flows per peer fight in both bottlenecks (measured:
        ~1.3x the bound for raw TCP all-to-all vs ~1.05x one flow at a time). A receiver that
        stalls holds the next send up for less than one part's time."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()  # when this send began (for the patience of the next)

        async def go() -> None:
            try:
                if prev is not None and self.config.staggered:
                    prev_task, prev_bytes, prev_started = prev
                    # the next send starts a little before the previous should end: opening a
                    # stream and waiting for the receiver's ack leave the link idle otherwise.
                    # Patience counts from when the previous send began, not from now.
                    await asyncio.wait([prev_started, prev_task], return_when=asyncio.FIRST_COMPLETED)
                    since = prev_started.result() if prev_started.done() and not prev_started.cancelled() else loop.time()
                    patience = self.config.stagger_overlap * prev_bytes / (self._flow_rate or self.bandwidth / 2)
                    left = since + patience - loop.time()
                    if left > 0 and not prev_task.done():
                        await asyncio.wait([prev_task], timeout=left)
            finally:
                if not started.done():
                    started.set_result(loop.time())
            await self._send_part(rnd, phase, j, enc, peer, parts)

        return asyncio.create_task(go()), enc.nbytes, started

    async def _send_part(self, rnd: _Round, phase: str, j: int, enc, peer: str, parts: list[TensorPart] | None = None, pace: float | None = None) -> None:
        if self.faults.active:
            await self.faults.before_send()
            enc, parts = self.faults.outgoing(enc, peer), None
        parts = parts or self._parts(rnd, phase, j, enc)
        rnd.report.bytes_sent += enc.nbytes
        log.debug("send %s %d to %s: %d bytes", phase, j, peer[-6:], enc.nbytes)
        timeout = max(1.0, rnd.group.deadline_s)
        t0 = time.monotonic()
        await self.transport.send(peer, parts[0], parts[1:], timeout=timeout, reuse=self.config.reuse_streams, pace=pace)
        took = time.monotonic() - t0
        log.debug("sent %s %d to %s in %.3f s", phase, j, peer[-6:], took)
        if enc.nbytes >= (1 << 20) and took > 0 and not pace:  # one flow's rate, for the patience of staggered sends
            rate = enc.nbytes / took
            self._flow_rate = rate if self._flow_rate is None else 0.7 * self._flow_rate + 0.3 * rate

    async def _wait_parts(self, rnd: _Round, slots: list[tuple[str, int]], senders: Sequence[str] | None, deadline: float) -> None:
        """Until every slot has a part from every sender (None: from the slot's owner) or the deadline."""

        def complete() -> bool:
            for phase, j in slots:
                got = rnd.received.get((phase, j), {})
                need = senders if senders is not None else [rnd.owners[j]]
                if any(s not in got and s not in rnd.blamed for s in need):
                    return False
            return True

        while not complete():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            rnd.arrived.clear()
            try:
                await asyncio.wait_for(rnd.arrived.wait(), timeout=left)
            except TimeoutError:
                return

    async def _decide(self, rnd: _Round, phase: str, mine: AvgReport | None, phase_deadline: float) -> AvgDecision:
        """Report to the leader and get its decision (leading: collect reports and decide;
        `mine` is None when the leader was excluded and only coordinates)."""
        grace = self.config.decision_grace_s
        if rnd.leader == rnd.me:
            if mine is not None:
                rnd.reports[phase][rnd.me] = mine
            expected = rnd.members if phase == "scatter" else rnd.survivors
            wait_until = max(phase_deadline, time.monotonic()) + grace
            while set(expected) - set(rnd.reports[phase]):
                left = wait_until - time.monotonic()
                if left <= 0:
                    break
                rnd.reported[phase].clear()
                try:
                    await asyncio.wait_for(rnd.reported[phase].wait(), timeout=left)
                except TimeoutError:
                    break
            decision = self._make_decision(rnd, phase, expected)
            rnd.decisions[phase] = decision
            rnd.decided[phase].set()
            return decision
        try:
            reply = await self.transport.call(rnd.leader, mine, timeout=max(phase_deadline - time.monotonic(), 0) + 3 * grace)
            if isinstance(reply, AvgDecision) and reply.group_id == rnd.group.group_id and reply.phase == phase:
                rnd.decisions[phase] = reply
                rnd.decided[phase].set()
                return reply
            raise RemoteProtocolError("the leader's reply is not this round's decision", "decision")
        except _NET_ERRORS as e:
            leader_error = e
        # the leader is gone, confused, or its reply was lost: ask it once more (it keeps its
        # decisions for a minute), then the other members, who may have it
        for peer in [rnd.leader, *(m for m in rnd.members if m not in (rnd.me, rnd.leader))]:
            try:
                reply = await self.transport.call(peer, AvgDecisionQuery(group_id=rnd.group.group_id, phase=phase), timeout=grace)
            except _NET_ERRORS:
                continue
            if isinstance(reply, AvgDecision) and reply.group_id == rnd.group.group_id and reply.phase == phase:
                rnd.decisions[phase] = reply
                rnd.decided[phase].set()
                return reply
        raise _Fail(f"no decision for {phase}: leader {rnd.leader[-8:]} unreachable ({leader_error})")

    def _make_decision(self, rnd: _Round, phase: str, expected: Sequence[str]) -> AvgDecision:
        g = rnd.group
        reports = rnd.reports[phase]
        if phase == "scatter":
            survivors, failed = decide_survivors(g.members, reports)
            reason = "; ".join(f"{m[-8:]}: {why}" for m, why in failed.items())
            if len(survivors) < self.config.min_group_size:
                return AvgDecision(group_id=g.group_id, phase=phase, commit=False, reason=reason or "too few survivors")
            return AvgDecision(
                group_id=g.group_id, phase=phase, commit=True, survivors=tuple(survivors), owners=reassign(g.members, survivors), reason=reason
            )
        missing = [m for m in expected if m not in reports]
        not_ok = [m for m, r in reports.items() if not r.ok]
        if missing or not_ok:
            why = [f"{m[-8:]} did not report" for m in missing] + [f"{m[-8:]}: {', '.join(reports[m].reasons)}" for m in not_ok]
            return AvgDecision(group_id=g.group_id, phase=phase, commit=False, reason="; ".join(why))
        return AvgDecision(group_id=g.group_id, phase=phase, commit=True, survivors=rnd.survivors, owners=rnd.owners)

    # ---- handlers ------------------------------------------------------------------------------

    async def _round_for(self, group_id: str, wait_s: float = 5.0) -> _Round:
        rnd = self._rounds.get(group_id)
        if rnd is not None:
            return rnd
        ev = self._round_ready.setdefault(group_id, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout=wait_s)
        except TimeoutError:
            self._round_ready.pop(group_id, None)
            raise RPCError("not_found", f"no round {group_id} here") from None
        return self._rounds[group_id]

    async def _on_part(self, ctx: CallContext) -> Ack:
        first: TensorPart = ctx.request
        try:
            group_id, phase, j_text = first.key.split("|")
            j = int(j_text)
        except ValueError:
            raise RemoteProtocolError("expected <group>|<phase>|<slice>", "key") from None
        if len(group_id) > 64:
            raise RemoteProtocolError("group id too long", "key")
        rnd = await self._round_for(group_id)
        g, sender = rnd.group, ctx.peer_id
        if sender not in g.members:
            raise RPCError("unauthorized", "not a member of this group")
        if rnd.done:
            raise RPCError("not_found", f"round {group_id} is over here")
        if phase not in ("scatter", "gather", "early") or not 0 <= j < len(g.members):
            raise RemoteProtocolError(f"no slice {phase} {j} in this group", "key")
        if phase == "early" and sender != g.members[j]:
            raise RPCError("unauthorized", f"slice {j} is not this sender's to send")
        n = rnd.slice_len(j)
        expected_codec = g.codec if phase == "scatter" else g.gather_codec
        asm = TensorAssembler(max_total_size=max(64, n * 8 + 4096))
        part: Message = first
        try:
            while True:
                if not isinstance(part, TensorPart) or part.key != first.key:
                    raise RemoteProtocolError("expected the next part of the same tensor", "part")
                enc = asm.add(part)
                if enc is not None:
                    break
                part = await ctx.receive()
            if enc.codec != expected_codec:
                raise RemoteProtocolError(f"codec {enc.codec}, this group uses {expected_codec}", "codec")
            if enc.dtype != "float32" or enc.shape != (n,):
                raise RemoteProtocolError(f"expected float32 of shape ({n},), got {enc.dtype} {enc.shape}", "shape")
            if phase == "scatter":  # kept per sender until the slice is aggregated
                tensor = await asyncio.get_running_loop().run_in_executor(None, self._decode_checked, enc)
            elif not await self._decode_slice(rnd, phase, j, sender, enc):
                return Ack()  # an early slice the decision voided: its owner sends it again
        except RemoteProtocolError as e:
            if phase != "early":  # a broken early slice is just not used: the commit says if it is missing
                rnd.blamed.setdefault(sender, f"bad {phase} part: {e}")
                rnd.arrived.set()
            raise
        if phase == "scatter":
            rnd.received.setdefault((phase, j), {})[sender] = tensor
        rnd.report.bytes_received += enc.nbytes
        log.debug("got %s %d from %s: %d bytes", phase, j, sender[-6:], enc.nbytes)
        rnd.arrived.set()
        return Ack()

    async def _decode_slice(self, rnd: _Round, phase: str, j: int, sender: str, enc) -> bool:
        """Decode an averaged slice straight into the result; whether it counts. A gather slice
        comes from the slice's owner after the decision; an early one from its first owner
        before it, and counts only if the decision excluded nobody."""
        g = rnd.group
        if phase == "gather":
            decided = rnd.decisions.get("scatter")
            if decided is None:  # who owns what is not known here yet: wait for the decision
                try:
                    await asyncio.wait_for(rnd.decided["scatter"].wait(), timeout=g.deadline_s + 2 * self.config.decision_grace_s)
                except TimeoutError:
                    raise RPCError("timeout", "no decision here in time for this slice") from None
                decided = rnd.decisions["scatter"]
            if not decided.commit or sender != decided.owners[j]:
                raise RPCError("unauthorized", f"slice {j} is not this sender's to send")
        async with rnd.lock(j):
            if rnd.done or (phase == "early" and (rnd.early_ok is False or j in rnd.final)):
                return False
            out = rnd.result[g.bounds[j] : g.bounds[j + 1]]
            await asyncio.get_running_loop().run_in_executor(None, self._decode_checked, enc, out)
            if phase == "gather":
                rnd.final.add(j)
            elif rnd.early_ok is False:  # voided while decoding: what comes after overwrites it
                return False
            else:
                rnd.early_got.add((j, sender))
        rnd.received.setdefault(("gather", j), {})[sender] = out
        return True

    def _decode_checked(self, enc, out=None) -> torch.Tensor:
        """Decode a part; refuse NaN, Inf and values beyond `max_abs` (a poisoning guard)."""
        return decode_tensor(enc, max_abs=self.config.max_abs, out=out).reshape(-1)

    async def _on_report(self, ctx: CallContext) -> AvgDecision:
        rep: AvgReport = ctx.request
        rnd = await self._round_for(rep.group_id)
        if rnd.leader != rnd.me:
            raise RPCError("bad_request", "not the leader of this round")
        if ctx.peer_id not in rnd.members:
            raise RPCError("unauthorized", "not a member of this group")
        rnd.reports[rep.phase][ctx.peer_id] = rep
        rnd.reported[rep.phase].set()
        try:
            await asyncio.wait_for(rnd.decided[rep.phase].wait(), timeout=rnd.group.deadline_s + 4 * self.config.decision_grace_s)
        except TimeoutError:
            raise RPCError("timeout", "no decision in time") from None
        if self._replies_to_lose > 0:  # fault injection: the member never hears back from us
            self._replies_to_lose -= 1
            raise ConnectionError("fault injection: decision reply lost")
        return rnd.decisions[rep.phase]

    async def _on_decision_query(self, ctx: CallContext) -> AvgDecision:
        q: AvgDecisionQuery = ctx.request
        rnd = self._rounds.get(q.group_id)
        if rnd is None or q.phase not in rnd.decisions or ctx.peer_id not in rnd.members:
            raise RPCError("not_found", "no such decision here")
        return rnd.decisions[q.phase]

    def _schedule_cleanup(self, group_id: str) -> None:
        async def later():
            await asyncio.sleep(60)  # keep decisions around for members that ask late
            self._rounds.pop(group_id, None)
            self._round_ready.pop(group_id, None)

        self._spawn(later())

    def _spawn(self, coro) -> None:
        """A background task we keep a reference to (and cancel on close)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _cut_from(pieces: list[tuple[int, int, EncodedTensor]], codec, a: int, b: int) -> EncodedTensor | None:
    """The encoding of elements [a, b), cut from a piece (start, end, encoding) that covers
    them at the codec's alignment; None if none does."""
    for start, end, enc in pieces:
        if start <= a and b <= end and (a - start) % codec.cut_align == 0 and (b == end or (b - start) % codec.cut_align == 0):
            return codec.cut(enc, a - start, b - start)
    return None


async def _settle(tasks, deadline: float) -> None:
    """Wait for send tasks until the deadline; cancel the rest. Errors are the receivers' to report."""
    tasks = list(tasks)
    if not tasks:
        return
    left = max(0.0, deadline - time.monotonic())
    done, pending = await asyncio.wait(tasks, timeout=left)
    for t in pending:
        t.cancel()
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.debug("a send failed: %s", t.exception(), exc_info=t.exception())
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)

