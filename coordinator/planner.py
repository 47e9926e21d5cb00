"""Eviction and role planning: pure decisions of the coordinator.

Every function here is a pure function of (now, members, config): no clock, no I/O, no hidden
state. Each returns its decision *and* a human-readable reason, so the service can log and
show why a peer was evicted or moved, and tests can move time by hand instead of sleeping.

A member whose join token names roles (`allowed_roles`) never gets another one: where the mode
has no place for any role it allows, it is idle, and its reason says why.

Planning rules, in order (pipeline and experts modes; replica mode makes everyone a replica):
  0. A member whose role failed is idle (and counts for no slot) until it registers again.
  1. A member that asked for the trainer role gets it (so does a client-mode member, and one
     whose token allows the trainer role but not the mode's stage or expert role).
  2. Every other member keeps its current assignment while that is still valid (stability under
     churn: a peer joining or leaving must not reshuffle the swarm).
  3. Newcomers and members whose assignment became invalid (stage out of range after a config
     change, unknown expert, role of another mode) go where they help most: pipeline, the stage
     with the least total throughput (a pipeline runs at the pace of its slowest stage);
     experts, the expert with the fewest hosts (an expert with one host dies with it), then the
     least throughput.
  4. A slot still empty is filled by moving one peer from the slot with the most peers (>= 2).
  5. Only if step 4 moved nobody, and only once every slot's peers have a measured throughput,
     at most one move per call towards the weakest slot:
     experts, when a slot has more than `rebalance_ratio` times the throughput of the weakest
     (each such move strictly lowers the sum of squared slot loads); pipeline, when the move
     raises the slowest stage's throughput (the pipeline's) by at least `rebalance_margin`
     and leaves the donor stage above that too (the minimum never drops and each move lifts a
     stage off it), and only once every stage peer has a measured throughput (the registry
     forgets a peer's measurement when its assignment changes: a moved peer is measured at its
     new stage before anything else moves). Repeated planning converges and never oscillates.

In pipeline mode a peer's measured samples/s are those of its current stage; with
`stage_costs` (the relative compute per sample of each stage, e.g. its blocks) a peer moved from
stage d to stage w counts for tp·cost[d]/cost[w] there.

Input order never matters: members are sorted by peer_id first, and every tie is broken by a
fixed key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MODES = ("replica", "pipeline", "experts")


@dataclass(frozen=True)
class MemberView:
    """What the planner knows about one member."""

    peer_id: str
    last_seen: float  # seconds since the epoch, coordinator clock
    registered_at: float  # seconds since the epoch, coordinator clock
    role: str | None = None  # current role (one of protocol.messages.ROLES), None = never assigned
    stage: int | None = None  # current stage, pipeline mode
    expert: str | None = None  # current expert name, experts mode
    throughput: float | None = None  # measured work rate, samples/s; None = unknown
    capabilities: Mapping[str, int | float | str | bool] = field(default_factory=dict)
    wanted_role: str | None = None  # what the peer asked for at registration
    failed: str | None = None  # why its role failed: it takes no role (idle) until it registers again


@dataclass(frozen=True)
class PlannerConfig:
    """How the coordinator plans roles and evicts silent members."""

    # "replica": data parallel, every member a full replica; "pipeline": the model is cut into
    # `num_stages` stages, each served by one or more peers; "experts": MoE expert hosts.
    mode: str = "replica"
    # pipeline mode: number of stages the model is cut into (stages are 0 .. num_stages-1)
    num_stages: int = 0
    # experts mode: the expert names, in a fixed order (the order breaks ties)
    experts: tuple[str, ...] = ()
    # seconds without a heartbeat after which a member is evicted (strictly more than this)
    heartbeat_timeout_s: float = 15.0
    # move a peer only when a slot has more than this many times the throughput of the weakest
    # slot (dimensionless, >= 1); higher = fewer moves, lower = better balance
    rebalance_ratio: float = 2.0
    # pipeline: a move by throughput must raise the slowest stage's throughput by this fraction
    rebalance_margin: float = 0.2
    # pipeline: relative compute per sample of each stage (e.g. its number of blocks); () = equal
    stage_costs: tuple[float, ...] = ()
    # samples/s assumed per TFLOP/s of capabilities["tflops"] for a member not yet measured
    samples_per_tflop: float = 1.0
    # samples/s assumed for a member with neither a measurement nor a usable "tflops"
    default_throughput: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "pipeline" and self.num_stages < 1:
            raise ValueError(f"num_stages: pipeline mode needs at least 1 stage, got {self.num_stages}")
        if self.num_stages < 0:
            raise ValueError(f"num_stages: must be >= 0, got {self.num_stages}")
        if self.mode == "experts" and not self.experts:
            raise ValueError("experts: experts mode needs at least one expert name")
        if len(set(self.experts)) != len(self.experts):
            raise ValueError(f"experts: names must be unique, got {self.experts!r}")
        if any(not isinstance(e, str) or not e for e in self.experts):
            raise ValueError("experts: every name must be a non-empty string")
        if not (self.heartbeat_timeout_s > 0 and math.isfinite(self.heartbeat_timeout_s)):
            raise ValueError(f"heartbeat_timeout_s: must be a positive number of seconds, got {self.heartbeat_timeout_s}")
        if not (self.rebalance_ratio >= 1 and math.isfinite(self.rebalance_ratio)):
            raise ValueError(f"rebalance_ratio: must be a finite number >= 1, got {self.rebalance_ratio}")
        if not (self.rebalance_margin > 0 and math.isfinite(self.rebalance_margin)):
            raise ValueError(f"rebalance_margin: must be a positive fraction, got {self.rebalance_margin}")
        if self.stage_costs and (len(self.stage_costs) != self.num_stages or not all(c > 0 and math.isfinite(c) for c in self.stage_costs)):
            raise ValueError(f"stage_costs: one positive cost per stage ({self.num_stages}), got {self.stage_costs!r}")
        if not (self.samples_per_tflop > 0 and math.isfinite(self.samples_per_tflop)):
            raise ValueError(f"samples_per_tflop: must be positive, got {self.samples_per_tflop}")
        if not (self.default_throughput > 0 and math.isfinite(self.default_throughput)):
            raise ValueError(f"default_throughput: must be positive, got {self.default_throughput}")


# ---------------------------------------------------------------------------------------------
# Eviction


@dataclass(frozen=True)
class Eviction:
    peer_id: str
    reason: str


def evict(now: float, members: Sequence[MemberView], config: PlannerConfig) -> list[Eviction]:
    """Members silent for strictly more than `heartbeat_timeout_s`, sorted by peer_id.

    Exactly at the timeout a member is still kept: a peer whose heartbeat period equals the
    timeout must not flap. A `last_seen` in the future (clock stepped back) counts as fresh.
    """
    out = []
    for m in sorted(members, key=lambda m: m.peer_id):
        silent = now - m.last_seen
        if silent > config.heartbeat_timeout_s:
            out.append(Eviction(m.peer_id, f"no heartbeat for {silent:.1f} s (timeout {config.heartbeat_timeout_s:.1f} s)"))
    return out


# ---------------------------------------------------------------------------------------------
# Role planning


@dataclass(frozen=True)
class Assignment:
    role: str  # one of protocol.messages.ROLES
    stage: int | None = None
    expert: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class Plan:
    # every member's assignment, keyed by peer_id
    assignments: dict[str, Assignment]
    # peer_ids whose (role, stage, expert) differs from their current one, sorted
    changes: list[str]
    # stages (int) or experts (str) that no member serves after this plan, in config order
    empty: tuple[int | str, ...] = ()


def estimate_throughput(member: MemberView, config: PlannerConfig) -> float:
    """samples/s: the measurement if there is a usable one, else from "tflops", else a default.

    Values come from remote peers, so anything not a finite positive number is ignored rather
    than trusted. A measured 0 is also ignored: a stage host of a stalled pipeline measures 0
    through no fault of its own, and planning on that would herd everyone onto it.
    """
    t = member.throughput
    if _positive_number(t):
        return float(t)
    tflops = member.capabilities.get("tflops")
    if _positive_number(tflops):
        return float(tflops) * config.samples_per_tflop
    return config.default_throughput


def _positive_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def plan_roles(members: Sequence[MemberView], config: PlannerConfig) -> Plan:
    """Assign every member a role (and stage or expert); see the module docstring for rules."""
    ordered = sorted(members, key=lambda m: m.peer_id)
    for a, b in zip(ordered, ordered[1:]):
        if a.peer_id == b.peer_id:
            raise ValueError(f"duplicate member {a.peer_id!r} given to plan_roles")
    if config.mode == "replica":
        assignments = {m.peer_id: _replica(m) for m in ordered}
        empty: tuple[int | str, ...] = ()
    else:  # a member whose role failed holds no slot: the others cover its stage or shard
        assignments, empty = _SlotPlanner([m for m in ordered if not m.failed], config).plan()
        assignments.update({m.peer_id: _failed(m) for m in ordered if m.failed})
    changes = [
        m.peer_id
        for m in ordered
        if (m.role, m.stage, m.expert) != _key(assignments[m.peer_id])
    ]
    return Plan(assignments=assignments, changes=changes, empty=empty)


def _key(a: Assignment) -> tuple[str, int | None, str | None]:
    return (a.role, a.stage, a.expert)


TOKEN_ROLES = "token_roles"  # the capability the coordinator stores a member's token's roles under (comma-separated); absent: any role


def allowed_roles(m: MemberView) -> frozenset[str] | None:
    """The roles the member's join token allows; None: any (no token, or one naming no role)."""
    roles = m.capabilities.get(TOKEN_ROLES)
    if not isinstance(roles, str):
        return None
    return frozenset(r for r in roles.split(",") if r) or None


def _allows(m: MemberView, role: str) -> bool:
    allowed = allowed_roles(m)
    return allowed is None or role in allowed


def _not_allowed(m: MemberView, mode: str) -> Assignment:
    return Assignment("idle", reason=f"its join token allows only {', '.join(sorted(allowed_roles(m) or ()))}: {mode} mode has no place for that")


def client_mode(m: MemberView) -> bool:
    """A node that accepts no inbound connections (`--client-mode`): it can only take a role that calls out."""
    return m.capabilities.get("client_mode") in (1, True)


def _failed(m: MemberView) -> Assignment:
    return Assignment("idle", reason=f"its role failed: {m.failed}; it takes a role again once restarted")


def _replica(m: MemberView) -> Assignment:
    if m.failed:
        return _failed(m)
    if not _allows(m, "replica"):
        return _not_allowed(m, "replica")
    if client_mode(m):
        return Assignment("idle", reason="client mode: a replica's averaging needs inbound connections; client-mode nodes train as pipeline or expert trainers")
    if (m.role, m.stage, m.expert) == ("replica", None, None):
        return Assignment("replica", reason="kept")
    if m.role is None:
        return Assignment("replica", reason="new member: replica mode, every member is a replica")
    return Assignment("replica", reason=f"replica mode: was {_describe(m)}, every member is a replica")


def _describe(m: MemberView) -> str:
    if m.role == "stage":
        return f"stage {m.stage}"
    if m.role == "expert":
        return f"expert {m.expert!r}"
    return f"role {m.role!r}"


class _SlotPlanner:
    """One planning pass over the slots (stages or experts). Internal to plan_roles; a class
    only to share the bookkeeping (hosts and load per slot) between the steps."""

    def __init__(self, ordered: Sequence[MemberView], config: PlannerConfig):
        self.config = config
        self.members = ordered
        self.pipeline = config.mode == "pipeline"
        self.role = "stage" if self.pipeline else "expert"
        self.slots: list[int | str] = list(range(config.num_stages)) if self.pipeline else list(config.experts)
        self.index = {s: i for i, s in enumerate(self.slots)}
        self.hosts: dict[int | str, list[str]] = {s: [] for s in self.slots}
        self.load: dict[int | str, float] = {s: 0.0 for s in self.slots}
        self.tp = {m.peer_id: estimate_throughput(m, config) for m in ordered}
        self.by_id = {m.peer_id: m for m in ordered}
        self.slot_of: dict[str, int | str] = {}
        self.speed: dict[str, float] = {}  # throughput × cost of the slot it was measured at
        self.out: dict[str, Assignment] = {}

    def label(self, s: int | str) -> str:
        return f"stage {s}" if self.pipeline else f"expert {s!r}"

    def put(self, peer_id: str, s: int | str, reason: str) -> None:
        # a peer's rate was measured where it is first put (its current slot, if still valid):
        # elsewhere it counts by the two slots' costs
        self.speed.setdefault(peer_id, self.tp[peer_id] * self.cost(s))
        self.hosts[s].append(peer_id)
        self.load[s] += self.speed[peer_id] / self.cost(s)
        self.slot_of[peer_id] = s
        self.out[peer_id] = self.assignment(s, reason)

    def take(self, peer_id: str) -> None:
        s = self.slot_of.pop(peer_id)
        self.hosts[s].remove(peer_id)
        self.load[s] -= self.speed[peer_id] / self.cost(s)

    def assignment(self, s: int | str, reason: str) -> Assignment:
        if self.pipeline:
            return Assignment("stage", stage=int(s), reason=reason)
        return Assignment("expert", expert=str(s), reason=reason)

    def current_slot(self, m: MemberView) -> tuple[int | str | None, str]:
        """The member's current slot if still valid, else None and why not."""
        if m.role is None:
            return None, "new member"
        if m.role == "trainer":
            return None, "no longer wants the trainer role"
        if m.role != self.role:
            return None, f"role {m.role!r} is not used in {self.config.mode} mode"
        if self.pipeline:
            if m.expert is not None:
                return None, f"inconsistent assignment (stage {m.stage} with expert {m.expert!r})"
            if m.stage is None:
                return None, "had no stage"
            if m.stage not in self.index:
                return None, f"stage {m.stage} is out of range (num_stages={self.config.num_stages})"
            return m.stage, "kept"
        if m.stage is not None:
            return None, f"inconsistent assignment (expert {m.expert!r} with stage {m.stage})"
        if m.expert not in self.index:
            return None, f"expert {m.expert!r} is not in the expert list"
        return m.expert, "kept"

    def best_slot(self) -> tuple[int | str, str]:
        """Where a newcomer helps most, and the phrase that says why."""
        if self.pipeline:
            s = min(self.slots, key=lambda s: (self.load[s], len(self.hosts[s]), self.index[s]))
            return s, f"{self.label(s)} had the least throughput ({self.load[s]:.1f})"
        s = min(self.slots, key=lambda s: (len(self.hosts[s]), self.load[s], self.index[s]))
        return s, f"{self.label(s)} had the fewest hosts ({len(self.hosts[s])})"

    def plan(self) -> tuple[dict[str, Assignment], tuple[int | str, ...]]:
        unplaced: list[tuple[MemberView, str]] = []
        for m in self.members:
            if m.wanted_role == "trainer" or client_mode(m) or not _allows(m, self.role):
                kept = (m.role, m.stage, m.expert) == ("trainer", None, None)
                why = (
                    "wanted the trainer role" if m.wanted_role == "trainer"
                    else "client mode: no inbound connections, and a trainer only calls out" if client_mode(m)
                    else f"its join token allows the trainer role, not the {self.role} role"
                )  # fmt: skip
                self.out[m.peer_id] = Assignment("trainer", reason="kept" if kept else why) if _allows(m, "trainer") else _not_allowed(m, self.config.mode)
                continue
            s, why = self.current_slot(m)
            if s is None:
                unplaced.append((m, why))
            else:
                self.put(m.peer_id, s, "kept")

        # Strongest first (then peer_id): greedy largest-first gives the tightest balance.
        unplaced.sort(key=lambda x: (-self.tp[x[0].peer_id], x[0].peer_id))
        placed_now = set()
        for m, why in unplaced:
            s, where = self.best_slot()
            self.put(m.peer_id, s, f"{why}: {where}")
            placed_now.add(m.peer_id)

        moved = self.fill_empty()
        if not moved:
            if self.pipeline:
                self.raise_bottleneck(exclude=placed_now)
            else:
                self.rebalance(exclude=placed_now)
        empty = tuple(s for s in self.slots if not self.hosts[s])
        return {pid: self.out[pid] for pid in sorted(self.out)}, empty

    def cost(self, s: int | str) -> float:
        costs = self.config.stage_costs
        return float(costs[int(s)]) if self.pipeline and costs else 1.0

    def tp_at(self, peer_id: str, s: int | str) -> float:
        """What the peer adds to slot `s`, in samples/s."""
        return self.speed[peer_id] / self.cost(s)

    def raise_bottleneck(self, exclude: set[str]) -> None:
        """Pipeline: raise the slowest stage (a pipeline runs at its pace) by moving one peer
        there, if the stage rises by at least `rebalance_margin` and the donor stays at least as
        far above the old minimum. So the minimum never drops, and each move lifts one of the
        stages at it: repeated planning comes to rest. Of the moves that qualify, the one that
        leaves the two stages most even."""
        if not all(_positive_number(self.by_id[p].throughput) for p in self.slot_of):
            return  # a peer not measured yet (new, or just moved): its stage's load is a guess; wait
        weak = min(self.slots, key=lambda s: (self.load[s], len(self.hosts[s]), self.index[s]))
        before = self.load[weak]
        floor = (1 + self.config.rebalance_margin) * before
        best = None
        for d in self.slots:
            if d == weak or len(self.hosts[d]) < 2:
                continue
            for p in self.hosts[d]:
                if p in exclude or self.speed[p] <= 0:
                    continue
                donor, raised = self.load[d] - self.tp_at(p, d), before + self.tp_at(p, weak)
                if donor >= floor and raised >= floor and (best is None or (-min(donor, raised), p) < (-best[0], best[1])):
                    best = (min(donor, raised), p, d, raised)
        if best is not None:
            _, p, d, raised = best
            reason = f"rebalanced from {self.label(d)} to the slowest, {self.label(weak)}: {before:.1f} -> {raised:.1f} samples/s"
            self.take(p)
            self.put(p, weak, reason)

    def split_choice(self, candidates: list[str], gap: float) -> str:
        """The peer whose move best halves `gap` between two slots (ties: peer_id)."""
        return min(candidates, key=lambda p: (abs(gap - 2 * self.tp[p]), p))

    def fill_empty(self) -> bool:
        """Give each empty slot one peer from the slot with the most peers, while one has >= 2."""
        moved = False
        for e in self.slots:
            if self.hosts[e]:
                continue
            donor = min(self.slots, key=lambda s: (-len(self.hosts[s]), -self.load[s], self.index[s]))
            n = len(self.hosts[donor])
            if n < 2:
                break  # no slot can spare a peer; the remaining empty slots stay empty
            p = self.split_choice(self.hosts[donor], self.load[donor])
            self.take(p)
            self.put(p, e, f"moved from {self.label(donor)} ({n} peers) to fill empty {self.label(e)}")
            moved = True
        return moved

    def rebalance(self, exclude: set[str]) -> None:
        """At most one move from a heavy slot to the weakest one, if the imbalance is too big.

        Only peers with 0 < t < (heavy - weak) are moved: then the sum of squared loads strictly
        drops, which is what rules out ping-pong between calls.
        """
        if not all(_positive_number(self.by_id[p].throughput) for p in self.slot_of):
            return  # a host not measured yet counts as the default rate: its slot looks weak; wait
        ratio = self.config.rebalance_ratio
        weak = min(self.slots, key=lambda s: (self.load[s], len(self.hosts[s]), self.index[s]))
        donors = sorted(
            (s for s in self.slots if s != weak and len(self.hosts[s]) >= 2),
            key=lambda s: (-self.load[s], -len(self.hosts[s]), self.index[s]),
        )
        for d in donors:
            if not self.load[d] > ratio * self.load[weak]:
                return  # donors are sorted heaviest first: none further is imbalanced either
            gap = self.load[d] - self.load[weak]
            candidates = [p for p in self.hosts[d] if p not in exclude and 0 < self.tp[p] < gap]
            if candidates:
                p = self.split_choice(candidates, gap)
                reason = (
                    f"rebalanced from {self.label(d)} to {self.label(weak)}: {self.load[d]:.1f} vs "
                    f"{self.load[weak]:.1f} samples/s exceeded ratio {ratio:g}"
                )
                self.take(p)
                self.put(p, weak, reason)
                return


# ---------------------------------------------------------------------------------------------
# Checkpoint quorum


def checkpoint_quorum(step: int, state_hash: str | None, reports: Mapping[str, str], replicas: int) -> tuple[bool, str]:
    """Accept a checkpoint of `step` whose state hashes to `state_hash` only if at least two
    replicas reported that hash for that step (one, when the swarm has a single replica), and no
    other hash was reported by more of them. `reports`: peer id -> hash reported for `step`."""
    if step == 0:
        return True, "the initial state: the first upload defines it"
    if not state_hash:
        return False, "the checkpoint carries no state hash"
    need = 1 if replicas <= 1 else 2
    votes: dict[str, int] = {}
    for h in reports.values():
        votes[h] = votes.get(h, 0) + 1
    mine = votes.get(state_hash, 0)
    rival = max((n for h, n in votes.items() if h != state_hash), default=0)
    if mine < need:
        return False, f"{mine} of the {need} replicas needed reported hash {state_hash[:8]} for step {step}"
    if rival > mine:
        return False, f"more replicas ({rival}) reported another hash for step {step}"
    return True, f"{mine} replicas reported hash {state_hash[:8]} for step {step}"
