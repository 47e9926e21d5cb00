"""Eviction and role planning: pure functions, time moved by hand, no sleeping."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from coordinator.planner import (
    Assignment,
    MemberView,
    Plan,
    PlannerConfig,
    estimate_throughput,
    evict,
    plan_roles,
)

PIPE3 = PlannerConfig(mode="pipeline", num_stages=3)
EXPERTS = PlannerConfig(mode="experts", experts=("e0", "e1", "e2"))


def member(peer_id: str, tp: float | None = 1.0, role=None, stage=None, expert=None, **kw) -> MemberView:
    return MemberView(peer_id=peer_id, last_seen=0.0, registered_at=0.0, role=role, stage=stage, expert=expert, throughput=tp, **kw)


def apply(members: list[MemberView], plan: Plan) -> list[MemberView]:
    """What the service does after planning: store each member's new assignment."""
    out = []
    for m in members:
        a = plan.assignments[m.peer_id]
        out.append(dataclasses.replace(m, role=a.role, stage=a.stage, expert=a.expert))
    return out


def settle(members: list[MemberView], config: PlannerConfig, max_rounds: int = 50) -> tuple[list[MemberView], int]:
    """Plan and apply until nothing changes; return the members and how many changes it took."""
    total = 0
    for _ in range(max_rounds):
        plan = plan_roles(members, config)
        if not plan.changes:
            return members, total
        total += len(plan.changes)
        members = apply(members, plan)
    raise AssertionError(f"planning did not converge in {max_rounds} rounds")


def slots(members: list[MemberView], config: PlannerConfig) -> dict:
    out: dict = {}
    for m in members:
        key = m.stage if config.mode == "pipeline" else m.expert
        if m.role in ("stage", "expert"):
            out.setdefault(key, []).append(m.peer_id)
    return out


def loads(members: list[MemberView], config: PlannerConfig) -> dict:
    names = range(config.num_stages) if config.mode == "pipeline" else config.experts
    out = {s: 0.0 for s in names}
    for m in members:
        if m.role in ("stage", "expert"):
            out[m.stage if config.mode == "pipeline" else m.expert] += estimate_throughput(m, config)
    return out


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "ring"}, "mode"),
        ({"mode": "pipeline", "num_stages": 0}, "num_stages"),
        ({"num_stages": -1}, "num_stages"),
        ({"mode": "experts"}, "experts"),
        ({"mode": "experts", "experts": ("a", "a")}, "experts"),
        ({"mode": "experts", "experts": ("a", "")}, "experts"),
        ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s"),
        ({"heartbeat_timeout_s": math.inf}, "heartbeat_timeout_s"),
        ({"rebalance_ratio": 0.5}, "rebalance_ratio"),
        ({"rebalance_ratio": math.nan}, "rebalance_ratio"),
        ({"samples_per_tflop": 0}, "samples_per_tflop"),
        ({"default_throughput": -1}, "default_throughput"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        PlannerConfig(**kwargs)


# -- eviction ----------------------------------------------------------------------------------


def test_evict_exactly_at_the_timeout_keeps_just_after_evicts():
    cfg = PlannerConfig(heartbeat_timeout_s=15.0)
    ms = [MemberView("p", last_seen=100.0, registered_at=50.0)]
    assert evict(100.0, ms, cfg) == []
    assert evict(115.0, ms, cfg) == []  # exactly at the boundary: still alive
    gone = evict(115.001, ms, cfg)
    assert [e.peer_id for e in gone] == ["p"]
    assert evict(116.2, ms, cfg)[0].reason == "no heartbeat for 16.2 s (timeout 15.0 s)"


def test_evict_sorted_and_clock_going_back_is_not_silence():
    cfg = PlannerConfig(heartbeat_timeout_s=10.0)
    ms = [
        MemberView("c", last_seen=0.0, registered_at=0.0),
        MemberView("a", last_seen=5.0, registered_at=0.0),
        MemberView("b", last_seen=100.0, registered_at=0.0),  # seen "in the future"
        MemberView("d", last_seen=19.0, registered_at=0.0),
    ]
    assert [e.peer_id for e in evict(20.0, ms, cfg)] == ["a", "c"]
    assert [e.peer_id for e in evict(20.0, list(reversed(ms)), cfg)] == ["a", "c"]


# -- throughput estimate -----------------------------------------------------------------------


def test_throughput_estimate_measured_then_tflops_then_default():
    cfg = PlannerConfig(samples_per_tflop=10.0, default_throughput=2.0)
    assert estimate_throughput(member("a", tp=7.5, capabilities={"tflops": 100.0}), cfg) == 7.5
    assert estimate_throughput(member("a", tp=None, capabilities={"tflops": 3.0}), cfg) == 30.0
    assert estimate_throughput(member("a", tp=None), cfg) == 2.0


@pytest.mark.parametrize("bogus", [math.nan, math.inf, -1.0, 0.0, True, "fast", None])
def test_throughput_estimate_ignores_bogus_remote_values(bogus):
    cfg = PlannerConfig(default_throughput=2.0)
    assert estimate_throughput(member("a", tp=bogus if not isinstance(bogus, str) else None), cfg) == 2.0
    assert estimate_throughput(member("a", tp=None, capabilities={"tflops": bogus}), cfg) == 2.0


# -- replica mode ------------------------------------------------------------------------------


def test_replica_mode_everyone_is_a_replica():
    ms = [
        member("new"),
        member("old", role="replica"),
        member("was-stage", role="stage", stage=1),
        member("trainer-wanted", wanted_role="trainer"),
    ]
    plan = plan_roles(ms, PlannerConfig())
    assert {p: a.role for p, a in plan.assignments.items()} == dict.fromkeys(
        ["new", "old", "trainer-wanted", "was-stage"], "replica"
    )
    assert all(a.stage is None and a.expert is None for a in plan.assignments.values())
    assert plan.assignments["old"].reason == "kept"
    assert plan.assignments["new"].reason.startswith("new member")
    assert "was stage 1" in plan.assignments["was-stage"].reason
    assert plan.changes == ["new", "trainer-wanted", "was-stage"]
    assert plan.empty == ()


def test_empty_swarm_plans_nothing():
    for cfg in (PlannerConfig(), PIPE3, EXPERTS):
        plan = plan_roles([], cfg)
        assert plan.assignments == {} and plan.changes == []
    assert plan_roles([], PIPE3).empty == (0, 1, 2)


def test_duplicate_peer_ids_are_our_bug():
    with pytest.raises(ValueError, match="duplicate member 'a'"):
        plan_roles([member("a"), member("a")], PIPE3)


# -- pipeline: newcomers -----------------------------------------------------------------------


def test_newcomers_fill_stages_by_least_throughput():
    plan = plan_roles([member(f"p{i}") for i in range(6)], PIPE3)
    by_stage = {}
    for pid, a in plan.assignments.items():
        assert a.role == "stage" and a.expert is None
        by_stage.setdefault(a.stage, []).append(pid)
    assert sorted(len(v) for v in by_stage.values()) == [2, 2, 2]
    assert plan.changes == [f"p{i}" for i in range(6)]
    assert plan.assignments["p0"].reason == "new member: stage 0 had the least throughput (0.0)"
    assert plan.empty == ()


def test_newcomer_goes_to_the_weakest_stage_with_reason():
    ms = [
        member("a", tp=10, role="stage", stage=0),
        member("b", tp=4, role="stage", stage=1),
        member("c", tp=7, role="stage", stage=2),
        member("new", tp=1),
    ]
    plan = plan_roles(ms, PIPE3)
    assert plan.assignments["new"] == Assignment("stage", stage=1, reason="new member: stage 1 had the least throughput (4.0)")
    assert plan.changes == ["new"]
    assert all(plan.assignments[p].reason == "kept" for p in "abc")


def test_strongest_newcomers_are_placed_first():
    # Largest-first greedy: a 9 and three 3s over two stages -> {9} vs {3, 3, 3}.
    ms = [member("big", tp=9), member("s1", tp=3), member("s2", tp=3), member("s3", tp=3)]
    plan = plan_roles(ms, PlannerConfig(mode="pipeline", num_stages=2))
    assert plan.assignments["big"].stage == 0
    assert {plan.assignments[p].stage for p in ("s1", "s2", "s3")} == {1}


def test_unmeasured_newcomer_uses_tflops():
    cfg = PlannerConfig(mode="pipeline", num_stages=2, samples_per_tflop=10.0)
    ms = [
        member("a", tp=None, capabilities={"tflops": 2.0}, role="stage", stage=0),  # 20 samples/s
        member("b", tp=5.0, role="stage", stage=1),
        member("new", tp=None),
    ]
    assert plan_roles(ms, cfg).assignments["new"].stage == 1


# -- pipeline: stability, empty stages, rebalancing ---------------------------------------------


def test_imbalance_of_exactly_the_ratio_keeps_everyone():
    ms = [
        member("a", tp=19, role="expert", expert="e0"),
        member("b", tp=1, role="expert", expert="e0"),  # movable (0 < 1 < gap 10), but 20 vs 10 is not > 2x
        member("c", tp=10, role="expert", expert="e1"),
    ]
    plan = plan_roles(ms, PlannerConfig(mode="experts", experts=("e0", "e1"), rebalance_ratio=2.0))
    assert plan.changes == []
    assert all(a.reason == "kept" for a in plan.assignments.values())
    ms[0] = member("a", tp=19.5, role="expert", expert="e0")  # 20.5 vs 10: now b moves
    assert plan_roles(ms, PlannerConfig(mode="experts", experts=("e0", "e1"), rebalance_ratio=2.0)).changes == ["b"]


def test_pipeline_moves_a_peer_only_when_that_raises_the_slowest_stage():
    cfg = PlannerConfig(mode="pipeline", num_stages=2)
    three_one = [member(f"a{i}", tp=10, role="stage", stage=0) for i in range(3)] + [member("b", tp=10, role="stage", stage=1)]
    plan = plan_roles(three_one, cfg)
    assert len(plan.changes) == 1 and plan.assignments[plan.changes[0]].stage == 1
    assert plan.assignments[plan.changes[0]].reason == "rebalanced from stage 0 to the slowest, stage 1: 10.0 -> 20.0 samples/s"
    settled, n = settle(three_one, cfg)
    assert n == 1 and sorted(loads(settled, cfg).values()) == [20.0, 20.0]
    # 2 + 1 peers: moving one would leave stage 0 at 10: the pipeline would not get faster
    assert plan_roles(three_one[1:], cfg).changes == []
    # nor a move that lifts the slowest stage by less than the margin (20%)
    ms = [member("a", tp=10, role="stage", stage=0), member("b", tp=1.5, role="stage", stage=0), member("c", tp=10, role="stage", stage=1)]
    assert plan_roles(ms, cfg).changes == []


def test_pipeline_rebalancing_counts_a_moved_peer_by_the_stages_costs():
    # stage 0 costs twice stage 1 per sample: a peer doing 20 samples/s on stage 1 does 10 on stage 0
    cfg = PlannerConfig(mode="pipeline", num_stages=2, stage_costs=(2.0, 1.0))
    ms = [member(f"a{i}", tp=5, role="stage", stage=0) for i in range(2)] + [member(f"b{i}", tp=20, role="stage", stage=1) for i in range(3)]
    plan = plan_roles(ms, cfg)
    assert len(plan.changes) == 1 and plan.changes[0].startswith("b")
    assert plan.assignments[plan.changes[0]].reason == "rebalanced from stage 1 to the slowest, stage 0: 10.0 -> 20.0 samples/s"
    with pytest.raises(ValueError, match="stage_costs: one positive cost per stage"):
        PlannerConfig(mode="pipeline", num_stages=2, stage_costs=(1.0,))


def test_rebalance_moves_one_peer_per_call_towards_the_weakest():
    cfg = PlannerConfig(mode="experts", experts=("e0", "e1"), rebalance_ratio=2.0)
    ms = [member(f"s0-{i}", tp=10, role="expert", expert="e0") for i in range(4)] + [member("s1", tp=10, role="expert", expert="e1")]
    plan = plan_roles(ms, cfg)
    assert len(plan.changes) == 1
    moved = plan.assignments[plan.changes[0]]
    assert moved.expert == "e1"
    assert moved.reason == "rebalanced from expert 'e0' to expert 'e1': 40.0 vs 10.0 samples/s exceeded ratio 2"
    settled, n = settle(ms, cfg)
    assert n == 1  # 30 vs 20 is within ratio: one move was enough
    assert sorted(loads(settled, cfg).values()) == [20.0, 30.0]


def test_experts_are_not_rebalanced_before_every_host_is_measured():
    # a host that has not reported a rate yet counts as 1 sample/s: its shard looks 40x weaker
    cfg = PlannerConfig(mode="experts", experts=("e0", "e1"), rebalance_ratio=2.0)
    ms = [member("a", tp=40, role="expert", expert="e0"), member("b", tp=40, role="expert", expert="e0"), member("c", tp=None, role="expert", expert="e1")]
    assert plan_roles(ms, cfg).changes == []
    ms[2] = member("c", tp=10, role="expert", expert="e1")  # measured: 80 vs 10
    assert plan_roles(ms, cfg).changes in (["a"], ["b"])


def test_rebalance_picks_the_peer_that_best_halves_the_gap():
    cfg = PlannerConfig(mode="experts", experts=("e0", "e1"), rebalance_ratio=1.5)
    ms = [
        member("a", tp=1, role="expert", expert="e0"),
        member("b", tp=8, role="expert", expert="e0"),
        member("c", tp=5, role="expert", expert="e0"),
        member("d", tp=4, role="expert", expert="e1"),
    ]
    # 14 vs 4, gap 10: moving c (5) makes it 9 vs 9.
    plan = plan_roles(ms, cfg)
    assert plan.changes == ["c"] and plan.assignments["c"].expert == "e1"


def test_no_move_that_would_not_lower_the_imbalance():
    # e0 = {a: 100, b: 0.5}, e1 = {c: 1}. b is the only candidate (0 < 0.5 < 99.5);
    # after moving it: 100 vs 1.5, still imbalanced, but a (100) can never move (100 >= gap),
    # and e0 then has one peer: the plan must come to rest, not oscillate.
    cfg = PlannerConfig(mode="experts", experts=("e0", "e1"))
    ms = [member("a", tp=100, role="expert", expert="e0"), member("b", tp=0.5, role="expert", expert="e0"), member("c", tp=1, role="expert", expert="e1")]
    settled, n = settle(ms, cfg)
    assert n == 1
    assert slots(settled, cfg) == {"e0": ["a"], "e1": ["b", "c"]}


def test_a_peer_leaving_its_stage_empty_is_replaced_by_one_move():
    ms = [member(f"a{i}", role="stage", stage=0) for i in range(3)] + [
        member("b0", tp=2, role="stage", stage=1),
        member("c0", role="stage", stage=2),
        member("c1", role="stage", stage=2),
    ]
    assert plan_roles(ms, PIPE3).changes == []
    left = [m for m in ms if m.peer_id != "b0"]
    plan = plan_roles(left, PIPE3)
    assert len(plan.changes) == 1
    moved = plan.changes[0]
    assert moved.startswith("a")  # from stage 0: it has the most peers
    assert plan.assignments[moved] == Assignment("stage", stage=1, reason="moved from stage 0 (3 peers) to fill empty stage 1")
    assert plan.empty == ()
    assert plan_roles(apply(left, plan), PIPE3).changes == []


def test_empty_stage_stays_empty_when_no_stage_can_spare_a_peer():
    ms = [member("a", role="stage", stage=0), member("c", role="stage", stage=2)]
    plan = plan_roles(ms, PIPE3)
    assert plan.changes == [] and plan.empty == (1,)


def test_all_empty_stages_are_filled_in_one_call_after_the_config_grows():
    ms = [member(f"p{i}", role="stage", stage=0) for i in range(4)] + [member(f"q{i}", role="stage", stage=1) for i in range(4)]
    cfg = PlannerConfig(mode="pipeline", num_stages=4)
    plan = plan_roles(ms, cfg)
    assert len(plan.changes) == 2 and plan.empty == ()
    assert all("to fill empty stage" in plan.assignments[p].reason for p in plan.changes)
    settled, _ = settle(apply(ms, plan), cfg)
    assert sorted(len(v) for v in slots(settled, cfg).values()) == [2, 2, 2, 2]


def test_stages_out_of_range_after_config_change_are_reassigned():
    ms = [member(f"p{i}", role="stage", stage=i % 4) for i in range(8)]
    cfg = PlannerConfig(mode="pipeline", num_stages=2)
    plan = plan_roles(ms, cfg)
    assert set(plan.changes) == {"p2", "p3", "p6", "p7"}
    assert plan.assignments["p3"].reason.startswith("stage 3 is out of range (num_stages=2): stage ")
    assert all(plan.assignments[p].reason == "kept" for p in ("p0", "p1", "p4", "p5"))
    assert sorted(len(v) for v in slots(apply(ms, plan), cfg).values()) == [4, 4]


def test_inconsistent_or_foreign_assignments_are_reassigned_with_a_reason():
    ms = [
        member("a", role="replica"),
        member("b", role="stage", stage=None),
        member("c", role="stage", stage=0, expert="x"),
        member("d", role="expert", expert="e1"),
        member("e", role="trainer"),  # no longer wants to be a trainer
    ]
    plan = plan_roles(ms, PIPE3)
    reasons = {p: a.reason for p, a in plan.assignments.items()}
    assert reasons["a"].startswith("role 'replica' is not used in pipeline mode: ")
    assert reasons["b"].startswith("had no stage: ")
    assert reasons["c"].startswith("inconsistent assignment (stage 0 with expert 'x'): ")
    assert reasons["d"].startswith("role 'expert' is not used in pipeline mode: ")
    assert reasons["e"].startswith("no longer wants the trainer role: ")
    assert all(a.role == "stage" and a.stage in (0, 1, 2) for a in plan.assignments.values())
    assert plan.changes == ["a", "b", "c", "d", "e"]


def test_trainers_are_not_stage_hosts():
    ms = [member("t", wanted_role="trainer"), member("t2", wanted_role="trainer", role="trainer"), member("s")]
    plan = plan_roles(ms, PIPE3)
    assert plan.assignments["t"] == Assignment("trainer", reason="wanted the trainer role")
    assert plan.assignments["t2"] == Assignment("trainer", reason="kept")
    assert plan.assignments["s"].role == "stage"
    assert plan.changes == ["s", "t"]
    assert plan.empty == (1, 2)  # trainers never count as hosts


# -- experts mode ------------------------------------------------------------------------------


def test_experts_newcomer_goes_to_the_expert_with_fewest_hosts():
    ms = [
        member("a", tp=1, role="expert", expert="e0"),
        member("b", tp=1, role="expert", expert="e0"),
        member("c", tp=50, role="expert", expert="e1"),  # one host, but a strong one
        member("d", tp=1, role="expert", expert="e2"),
        member("n", tp=1),
    ]
    plan = plan_roles(ms, EXPERTS)
    # e1 and e2 have one host each; e2 has less throughput
    assert plan.assignments["n"] == Assignment("expert", expert="e2", reason="new member: expert 'e2' had the fewest hosts (1)")
    assert plan.changes == ["n"]


def test_experts_unknown_expert_is_reassigned_and_empty_filled():
    ms = [
        member("a", role="expert", expert="e0"),
        member("b", role="expert", expert="e0"),
        member("c", role="expert", expert="e1"),
        member("z", role="expert", expert="retired"),
    ]
    plan = plan_roles(ms, EXPERTS)
    assert plan.assignments["z"] == Assignment(
        "expert", expert="e2", reason="expert 'retired' is not in the expert list: expert 'e2' had the fewest hosts (0)"
    )
    assert plan.changes == ["z"] and plan.empty == ()
    without_z = plan_roles([m for m in ms if m.peer_id != "z"], EXPERTS)
    assert without_z.changes == ["a"]  # e2 left empty again: filled from e0, the expert with most hosts
    assert without_z.assignments["a"].reason == "moved from expert 'e0' (2 peers) to fill empty expert 'e2'"


def test_experts_empty_expert_filled_by_moving_one_host():
    ms = [member(f"a{i}", role="expert", expert="e0") for i in range(3)] + [member("c", role="expert", expert="e2")]
    plan = plan_roles(ms, EXPERTS)
    assert len(plan.changes) == 1
    assert plan.assignments[plan.changes[0]].reason == "moved from expert 'e0' (3 peers) to fill empty expert 'e1'"


# -- determinism and churn ---------------------------------------------------------------------


def random_swarm(rng: random.Random, config: PlannerConfig, n: int) -> list[MemberView]:
    """A mix of newcomers, valid, invalid and trainer members with varied throughput."""
    out = []
    for i in range(n):
        tp = rng.choice([None, 0.5, 1.0, 2.0, 3.0, 10.0, rng.uniform(0.1, 20)])
        caps = rng.choice([{}, {"tflops": rng.choice([0.05, 1.0, 40.0])}])
        kind = rng.random()
        kw: dict = {}
        if kind < 0.3:
            pass  # newcomer
        elif kind < 0.9:
            if config.mode == "pipeline":
                kw = {"role": "stage", "stage": rng.randrange(config.num_stages + 1)}  # sometimes out of range
            else:
                kw = {"role": "expert", "expert": rng.choice([*config.experts, "gone"])}
        elif kind < 0.95:
            kw = {"wanted_role": "trainer"}
        else:
            kw = {"role": "replica"}
        out.append(member(f"peer-{i:03d}", tp=tp, capabilities=caps, **kw))
    return out


@pytest.mark.parametrize("config", [PIPE3, PlannerConfig(mode="pipeline", num_stages=5), EXPERTS, PlannerConfig()])
def test_plans_do_not_depend_on_input_order(config):
    rng = random.Random(1234)
    for trial in range(40):
        ms = random_swarm(rng, config, rng.randrange(0, 25))
        expected = plan_roles(ms, config)
        for _ in range(3):
            shuffled = ms[:]
            rng.shuffle(shuffled)
            assert plan_roles(shuffled, config) == expected, f"trial {trial}"


@pytest.mark.parametrize("config", [PIPE3, PlannerConfig(mode="pipeline", num_stages=4, rebalance_ratio=1.5), EXPERTS])
def test_random_swarms_converge_and_every_move_lowers_the_imbalance(config):
    rng = random.Random(99)
    for _ in range(30):
        ms = random_swarm(rng, config, rng.randrange(1, 30))
        ms, _ = settle(ms, config)  # first bring everyone to a valid assignment
        # from here on, only fills and rebalancing: each must strictly lower the sum of squares
        # (or fill an empty slot), which is why planning can never oscillate
        prev = sum(v * v for v in loads(ms, config).values())
        for _ in range(50):
            plan = plan_roles(ms, config)
            if not plan.changes:
                break
            assert len(plan.changes) == 1
            ms = apply(ms, plan)
            now = sum(v * v for v in loads(ms, config).values())
            assert now < prev
            prev = now
        else:
            raise AssertionError("did not converge")


@pytest.mark.parametrize("config", [PIPE3, PlannerConfig(mode="pipeline", num_stages=4), EXPERTS])
def test_churn_equal_peers_leave_moves_at_most_one_join_moves_none(config):
    rng = random.Random(7)
    ms, _ = settle([member(f"p{i:03d}") for i in range(9)], config)
    next_id = 100
    for _ in range(150):
        if len(ms) > 2 and rng.random() < 0.5:
            gone = rng.choice(ms).peer_id
            ms = [m for m in ms if m.peer_id != gone]
            ms, changes = settle(ms, config)
            assert changes <= 1, f"{gone} leaving caused {changes} moves"
        else:
            ms.append(member(f"p{next_id}"))
            next_id += 1
            ms, changes = settle(ms, config)
            assert changes == 1  # only the newcomer itself
        sizes = [len(v) for v in slots(ms, config).values()]
        if len(ms) >= (config.num_stages or len(config.experts)):
            assert len(sizes) == (config.num_stages or len(config.experts))  # no slot left empty


@pytest.mark.parametrize("config", [PIPE3, EXPERTS])
def test_churn_mixed_peers_one_event_moves_at_most_one_existing_member_per_call(config):
    rng = random.Random(2024)
    ms, _ = settle(random_swarm(rng, config, 12), config)
    next_id = 500
    for _ in range(150):
        if len(ms) > 1 and rng.random() < 0.5:
            gone = rng.choice(ms).peer_id
            ms = [m for m in ms if m.peer_id != gone]
            newcomer = None
        else:
            newcomer = f"peer-{next_id}"
            next_id += 1
            ms.append(member(newcomer, tp=rng.choice([None, 0.5, 1.0, 5.0, 20.0])))
        plan = plan_roles(ms, config)
        moved = [p for p in plan.changes if p != newcomer]
        assert len(moved) <= 1, moved
        ms, _ = settle(apply(ms, plan), config)


def test_a_client_mode_node_trains_in_a_pipeline_and_idles_among_replicas():
    """A node that accepts no inbound connections takes the one role that only calls out."""
    client = member("c", capabilities={"client_mode": 1})
    pipe = plan_roles([member("a"), member("b"), client], PlannerConfig(mode="pipeline", num_stages=2))
    assert pipe.assignments["c"].role == "trainer" and "client mode" in pipe.assignments["c"].reason
    assert {pipe.assignments[p].stage for p in "ab"} == {0, 1}  # the others serve the stages
    replicas = plan_roles([member("a"), client], PlannerConfig(mode="replica"))
    assert replicas.assignments["a"].role == "replica"
    assert replicas.assignments["c"].role == "idle" and "inbound connections" in replicas.assignments["c"].reason


def test_a_member_never_gets_a_role_its_join_token_does_not_allow():
    only = lambda *roles: {"token_roles": ",".join(roles)}  # noqa: E731 (as the coordinator stores a token's roles)
    trainer, stage, replica, anyone = (member(p, capabilities=caps) for p, caps in
                                       (("t", only("trainer")), ("s", only("stage")), ("r", only("replica")), ("x", {})))  # fmt: skip
    # replica mode: a trainer-only or stage-only token has no place there
    plan = plan_roles([trainer, stage, replica, anyone], PlannerConfig())
    assert {p: a.role for p, a in plan.assignments.items()} == {"t": "idle", "s": "idle", "r": "replica", "x": "replica"}
    assert plan.assignments["t"].reason == "its join token allows only trainer: replica mode has no place for that"
    # a pipeline: a trainer-only token trains as a trainer, a replica-only one idles
    plan = plan_roles([trainer, stage, replica, anyone], PIPE3)
    assert {p: a.role for p, a in plan.assignments.items()} == {"t": "trainer", "s": "stage", "r": "idle", "x": "stage"}
    assert plan.assignments["t"].reason == "its join token allows the trainer role, not the stage role"
    assert plan.assignments["r"].reason == "its join token allows only replica: pipeline mode has no place for that"
    # experts: the same rule for its expert hosts
    plan = plan_roles([trainer, member("e", capabilities=only("expert", "trainer"))], EXPERTS)
    assert (plan.assignments["t"].role, plan.assignments["e"].role) == ("trainer", "expert")
    # a client-mode node (trainers only) whose token allows stages only: nothing it may do
    plan = plan_roles([member("c", capabilities={"client_mode": 1, **only("stage")})], PIPE3)
    assert plan.assignments["c"].role == "idle"
    # and its assignment stays put over repeated planning
    settled, _ = settle([trainer, stage, replica, anyone], PIPE3)
    assert {m.peer_id: m.role for m in settled} == {"t": "trainer", "s": "stage", "r": "idle", "x": "stage"}


@pytest.mark.parametrize("config", [PlannerConfig(), PIPE3, EXPERTS], ids=["replica", "pipeline", "experts"])
def test_a_member_whose_role_failed_is_idle_and_covers_no_slot(config):
    role = {"replica": "replica", "pipeline": "stage", "experts": "expert"}[config.mode]
    slot = {"replica": {}, "pipeline": {"stage": 0}, "experts": {"expert": "e0"}}[config.mode]
    others = [member(f"p{i}", role=None) for i in range(1, 4)]
    failed = member("p0", role=role, failed="the replica role failed: training diverged", **slot)
    plan = plan_roles([failed, *others], config)
    assert plan.assignments["p0"] == Assignment("idle", reason="its role failed: the replica role failed: training diverged; it takes a role again once restarted")
    assert "p0" in plan.changes
    working = apply([failed, *others], plan)[1:]
    if config.mode != "replica":  # its slot is covered by the working members, as if it were not there
        assert plan.empty == () and plan_roles(others, config).assignments == {p: plan.assignments[p] for p in ("p1", "p2", "p3")}
        assert sorted(slots(working, config)) == sorted(range(3) if config.mode == "pipeline" else config.experts)
    restarted = dataclasses.replace(failed, role="idle", stage=None, expert=None, failed=None)  # it registered again
    assert plan_roles([restarted, *working], config).assignments["p0"].role == role
