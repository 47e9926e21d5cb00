"""Averaging messages: joining a group, its leader's answer, members' reports and the
leader's decisions (node/averaging/ runs the protocol)."""

from __future__ import annotations

import dataclasses
import math

from .schema import MAX_ID_LEN, Message, Params, _require, message

# ---------------------------------------------------------------------------------------------
# Averaging (all-reduce among the peers that average the same key)

MAX_GROUP = 256
MAX_SLICES = 4 * MAX_GROUP  # slices a group's vector may be cut into
DEFAULT_NAMESPACE = "avg"  # the averager namespace of a join that names none
AVG_PHASES = ("scatter", "gather")
GROUP_STATUS = ("group", "redirect", "closed")


@message(40)
class AvgJoin(Message):
    """Ask a would-be group leader to take us into the group for `round_key`. Long poll: the
    reply comes when the group is formed (or we are redirected / too late)."""

    round_key: str
    numel: int  # elements of the flattened vector to average; all members must agree
    weight: float = 1.0  # e.g. samples processed since the last round
    bandwidth: float = 0.0  # bytes/s this peer can move; sizes its slice
    codec: str = "none"
    namespace: str = DEFAULT_NAMESPACE  # which of the receiver's averagers this is for (e.g. "replicas", "stage-2")
    # only ask: do not take us in, answer at once whether this key is averaged there (a
    # redirect to its leader), over there ("closed"), or not (yet) known there
    ask_only: bool = False

    def validate(self) -> None:
        _require(0 < len(self.round_key) <= MAX_ID_LEN, "round_key", "must be 1..256 characters")
        _require(len(self.namespace) <= 64, "namespace", "must be at most 64 characters")
        _require(self.numel > 0, "numel", "must be > 0")
        _require(math.isfinite(self.weight) and self.weight > 0, "weight", "must be finite and > 0")
        _require(math.isfinite(self.bandwidth) and self.bandwidth >= 0, "bandwidth", "must be finite and >= 0")


@message(41)
class AvgGroup(Message):
    """The leader's answer: the formed group (members in order, slice bounds and who owns each
    slice), a redirect to another leader, or 'closed' (the group formed without you: try the
    next round)."""

    status: str
    group_id: str = ""
    members: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    bounds: tuple[int, ...] = ()  # slice i of the flat vector is [bounds[i], bounds[i+1])
    # member index owning each slice; empty: one slice per member, slice i is member i's. A
    # member may own several slices (sent in turn, its aggregated ones come back while later
    # ones are still on their way) or none (a slow link: it only sends and receives)
    slice_owners: tuple[int, ...] = ()
    codec: str = "none"
    codec_params: Params = dataclasses.field(default_factory=dict)
    gather_codec: str = "none"
    gather_codec_params: Params = dataclasses.field(default_factory=dict)  # e.g. the sparse codec's density, bits, chunk
    deadline_s: float = 0.0  # seconds the scatter phase may take, derived from measured bandwidth
    redirect: str = ""
    reason: str = ""

    def validate(self) -> None:
        _require(self.status in GROUP_STATUS, "status", f"must be one of {', '.join(GROUP_STATUS)}")
        if self.status != "group":
            return
        n = len(self.members)
        _require(1 <= n <= MAX_GROUP, "members", f"must have 1..{MAX_GROUP} members")
        _require(len(set(self.members)) == n, "members", "must be distinct")
        _require(len(self.weights) == n, "weights", "one per member")
        _require(all(math.isfinite(w) and w > 0 for w in self.weights), "weights", "must be finite and > 0")
        if self.slice_owners:
            _require(len(self.slice_owners) <= MAX_SLICES, "slice_owners", f"at most {MAX_SLICES} slices")
            _require(all(0 <= i < n for i in self.slice_owners), "slice_owners", "must be member indices")
            _require(len(self.bounds) == len(self.slice_owners) + 1, "bounds", "must have len(slice_owners) + 1 entries")
        else:
            _require(len(self.bounds) == n + 1, "bounds", "must have len(members) + 1 entries")
        _require(self.bounds[0] == 0 and all(a <= b for a, b in zip(self.bounds, self.bounds[1:])), "bounds", "must rise from 0")
        _require(math.isfinite(self.deadline_s) and self.deadline_s > 0, "deadline_s", "must be > 0")

    @property
    def n_slices(self) -> int:
        return len(self.bounds) - 1

    def first_owner(self, j: int) -> str:
        """The member that owns slice j unless a decision re-owns it."""
        return self.members[self.slice_owners[j] if self.slice_owners else j]


@message(42)
class AvgReport(Message):
    """A member tells the leader how a phase went for it: whom it received valid parts from,
    and whom it blames (with reasons). The reply is the leader's AvgDecision."""

    group_id: str
    phase: str
    ok: bool = True
    received_from: tuple[str, ...] = ()
    blamed: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    def validate(self) -> None:
        _require(self.phase in AVG_PHASES, "phase", f"must be one of {', '.join(AVG_PHASES)}")
        _require(len(self.blamed) == len(self.reasons), "reasons", "one per blamed peer")
        _require(len(self.received_from) <= MAX_GROUP and len(self.blamed) <= MAX_GROUP, "received_from", "too many peers")


@message(43)
class AvgDecision(Message):
    """The leader's decision after a phase. After "scatter": who survives and who owns each
    slice now. After "gather": commit (apply the result) or abort (everyone keeps inputs)."""

    group_id: str
    phase: str
    commit: bool
    survivors: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()  # owner of each slice after failed members' slices were re-owned
    reason: str = ""

    def validate(self) -> None:
        _require(self.phase in AVG_PHASES, "phase", f"must be one of {', '.join(AVG_PHASES)}")


@message(44)
class AvgDecisionQuery(Message):
    """Ask any member for a decision it holds (when the leader cannot be reached)."""

    group_id: str
    phase: str

    def validate(self) -> None:
        _require(self.phase in AVG_PHASES, "phase", f"must be one of {', '.join(AVG_PHASES)}")
