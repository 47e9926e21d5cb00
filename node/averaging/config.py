"""What an averager is told (`AveragerConfig`) and what it tells back (`AverageReport`,
`AveragingFailed`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from protocol import make_codec
from protocol.messages import DEFAULT_NAMESPACE

from . import aggregators

MAX_EARLY_KEYS = 1024  # keys joins may wait on at once (see `early_join_wait_s`); beyond, they are answered at once
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# bytes per element each codec puts on the wire, to size deadlines before anything is sent
# (sparse: its own, from its params)
WIRE_BYTES = {"none": 4.0, "fp16": 2.0, "int8": 1.01, "topk": 0.08, "powersgd": 0.05}
SELF_GATHERING = ("none", "fp16", "int8", "sparse")  # codecs that carry averaged slices back too (the others: fp16)


def wire_bytes(codec: str, params: dict) -> float:
    """Bytes per element `codec` with `params` puts on the wire (an estimate for deadlines)."""
    if codec == "sparse":
        return make_codec(codec, **params).bytes_per_element()
    return WIRE_BYTES.get(codec, 4.0)


@dataclass(frozen=True)
class AveragerConfig:
    swarm_id: str = "swarmtrain"  # records of other swarms are ignored
    # which peers this averager rounds with: its DHT keys, its joins and its rounds. One
    # averager per namespace in a process (e.g. "replicas", "stage-2", "expert-l1-e3"); averagers
    # of other namespaces never see its traffic
    namespace: str = DEFAULT_NAMESPACE
    codec: str = "none"  # scatter codec: none | fp16 | int8 | topk | powersgd | sparse
    codec_params: dict = field(default_factory=dict)  # e.g. {"block_size": 1024}
    gather_codec: str | None = None  # codec of averaged slices; None: same as `codec`, with its params (topk/powersgd: fp16)
    aggregator: str = "mean"  # mean | trimmed_mean | centered_clip
    aggregator_params: dict = field(default_factory=dict)
    # a robust aggregator's far parts are evidence against their senders (repeated, a ban). Off
    # where honest parts differ in size by design: in a slot's syncs each peer sends the steps it
    # took since the last one, and trainers call a slot's fastest peer most, so its update is the
    # far one beside partners that took few steps or none (the aggregate still clips every part)
    accuse: bool = True
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
    staggered: bool = True  # send a phase's parts one receiver at a time (see `Sender.in_turn`)
    stagger_overlap: float = 0.9  # the next send starts when the previous one is this far along (by its expected time; 0.9 with pipes, 0.7 without)
    optimistic_gather: bool = True  # an owner holding every part sends its slice before the decision
    # pacing (see `Sender.paced`): with a declared `bandwidth` below `pace_max_rate`, over direct
    # links, a phase's parts leave at once, each paced to its share of pace_share x bandwidth
    pace: bool = True
    pace_share: float = 0.92  # the rest is left for TCP/IP headers and a link a little slower than declared
    pace_max_rate: float = 100e6  # faster links: the CPU, not the link, sets the pace
    gather_feedback: bool = True  # a lossy gather codec's error is carried into the owner's next round

    def __post_init__(self):
        make_codec(self.codec, **self.codec_params)  # fail early on a bad codec
        if self.gather_codec is not None:
            make_codec(self.gather_codec)
        aggregators.get(self.aggregator)
        if not NAMESPACE_RE.fullmatch(self.namespace):
            raise ValueError(f"namespace must be 1-64 of A-Z a-z 0-9 _ . -, got {self.namespace!r}")
        if self.min_group_size < 1:
            raise ValueError("min_group_size must be >= 1")
        for name in ("join_timeout_s", "early_join_wait_s", "decision_grace_s", "base_timeout_s", "timeout_slack", "bandwidth"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("default_bandwidth", "pace_max_rate"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)!r}")
        if not (self.max_abs > 0):
            raise ValueError(f"max_abs must be > 0, got {self.max_abs!r}")
        if not 0 < self.pace_share <= 1:
            raise ValueError(f"pace_share must be in (0, 1], got {self.pace_share!r}")
        if not 0 <= self.stagger_overlap <= 1:
            raise ValueError(f"stagger_overlap must be in [0, 1], got {self.stagger_overlap!r}")
        if self.chunk_bytes < 1024 or self.slice_align < 1:
            raise ValueError("chunk_bytes must be >= 1024 and slice_align >= 1")

    @property
    def resolved_gather_codec(self) -> str:
        if self.gather_codec:
            return self.gather_codec
        return self.codec if self.codec in SELF_GATHERING else "fp16"

    @property
    def gather_codec_params(self) -> dict:
        """The gather codec's params: the scatter's when it is the same codec (a sparse gather
        sends as few values as the scatter), else its defaults."""
        return dict(self.codec_params) if self.resolved_gather_codec == self.codec else {}


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
    silent: list[str] = field(default_factory=list)  # members not waited for to a deadline: their probes went unanswered
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    bounds: tuple[int, ...] = ()  # slice bounds of the flat vector
    slice_owners: tuple[int, ...] = ()  # member index that owned each slice as the group formed (empty: slice i is member i's)
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


class RoundFailed(Exception):
    """Internal: ends a round with a reason. `late`: the group formed without us (or nobody
    came): the others may well be averaging right now."""

    def __init__(self, reason: str, late: bool = False):
        super().__init__(reason)
        self.late = late
