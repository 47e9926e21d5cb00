"""Byzantine replicas' lies (node/roles/attacks.py): each what its name says, well formed; what
the aggregators make of them (two liars of eight derail the plain mean, not CenteredClip); and
the evidence a slice's owner draws from them, with the reason a ban will carry."""

import json
import math

import pytest
import torch

from node.averaging.aggregators import FAR, centered_clip, far_parts, mean, trimmed_mean
from node.averaging.decisions import accusations
from node.config import ConfigError, NodeConfig, load_config
from bench.byzantine import _derailed, ban_scores
from bench.byzantine_slots import ban_times, first_micro_batches, slot_result
from node.config import ANSWER_ATTACKS, REPLICA_ATTACKS
from node.roles.attacks import ANSWER_SCALE, DEFAULT_SCALE, Attack


def norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in ts))


def update(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]


def test_each_lie_is_what_its_name_says_and_keeps_the_shapes():
    g = update(0)
    for kind in REPLICA_ATTACKS:
        out = Attack(kind).apply(g)
        assert [t.shape for t in out] == [t.shape for t in g] and all(torch.isfinite(t).all() for t in out), kind
    assert all(torch.equal(a, -1000 * b) for a, b in zip(Attack("sign-flip").apply(g), g))
    assert all(torch.equal(a, 7 * b) for a, b in zip(Attack("scaled", 7.0).apply(g), g))
    assert all(torch.equal(a, -0.1 * b) for a, b in zip(Attack("ipm").apply(g), g))
    # constant: the same direction whatever the update, at scale x its norm
    c1, c2 = Attack("constant").apply(g), Attack("constant").apply(update(1))
    assert norm(c1) == pytest.approx(1000 * norm(g), rel=1e-5)
    assert torch.allclose(torch.cat([t.flatten() for t in c1]) / norm(c1), torch.cat([t.flatten() for t in c2]) / norm(c2))
    # noise: at the honest norm, nearly orthogonal to the update, a new draw every round
    noisy = Attack("noise", seed=3)
    n1, n2 = noisy.apply(g), noisy.apply(g)
    assert norm(n1) == pytest.approx(norm(g), rel=1e-5) and not torch.equal(n1[0], n2[0])
    assert Attack("noise").scale == DEFAULT_SCALE["noise"] == 1.0


def test_a_stale_liar_sends_its_update_of_k_rounds_ago():
    stale = Attack("stale", 2.0)
    sent = [stale.apply([torch.full((3,), float(k))])[0][0].item() for k in range(6)]
    assert sent == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]  # the oldest kept until two were, then two rounds late
    # a fragment's rounds (updates of another shape) keep their own history
    assert stale.apply([torch.full((2, 2), 9.0)])[0].flatten().tolist() == [9.0] * 4


def test_alie_moves_every_coordinate_by_z_times_the_spread_it_saw_and_hides_within_it():
    """The attacker's spread of coordinate j: its last update's distance from that round's
    aggregate. Its first round is honest; from then on, each coordinate z spreads against."""
    gen = torch.Generator().manual_seed(2)
    truth = torch.randn(256, generator=gen) * 0.05
    rounds = [[truth + 0.02 * torch.randn(256, generator=gen) for _ in range(8)] for _ in range(2)]
    alie = [Attack("alie", seed=i) for i in range(2)]
    names = [f"peer{i}" for i in range(8)]
    first = [a.apply([r.clone()])[0] for a, r in zip(alie, rounds[0][6:])]
    assert all(torch.equal(f, r) for f, r in zip(first, rounds[0][6:]))  # nothing seen yet: honest
    agg = centered_clip(rounds[0][:6] + first, torch.ones(8))
    for a in alie:
        a.observe([agg])
    lies = [a.apply([r.clone()])[0] for a, r in zip(alie, rounds[1][6:])]
    for lie, r, was in zip(lies, rounds[1][6:], rounds[0][6:]):
        assert torch.allclose(lie, r - (was - agg).abs())  # z = 1 (its default)
    parts = rounds[1][:6] + lies
    assert far_parts(parts, centered_clip(parts, torch.ones(8)), names) == {}  # within the spread: no distance evidence
    honest_mean = torch.stack(rounds[1][:6]).mean(0)
    against = {name: float((centered_clip(ps, torch.ones(8)) - honest_mean < 0).float().mean()) for name, ps in (("alie", parts), ("clean", rounds[1]))}
    assert against["alie"] > 0.7 and against["clean"] < 0.6, against  # and yet the aggregate moves against, coordinate by coordinate
    assert Attack("alie", 2.0).apply([torch.ones(3)])[0].tolist() == [1.0, 1.0, 1.0]  # a fragment's shape not seen: honest


def test_other_data_trains_honestly_on_every_token_mirrored():
    from node.models.data import Batches

    data = torch.arange(200, dtype=torch.int64) % 256
    plain, mirrored = Batches(data, 0, 1, 2, 8, seed=5), Attack("other-data").data(Batches(data, 0, 1, 2, 8, seed=5), 256)
    for _ in range(3):
        (x, y), (mx, my) = plain.next(), mirrored.next()
        assert torch.equal(mx, 255 - x) and torch.equal(my, 255 - y)
    assert Attack("sign-flip").data(plain, 256) is plain  # every other lie trains on the swarm's data
    g = update(4)
    assert all(torch.equal(a, b) for a, b in zip(Attack("other-data").apply(g), g))  # the update itself: honest


def test_two_liars_of_eight_derail_the_mean_not_centered_clip():
    """Per slice: eight members' parts, two of them lies; the honest mean is what training needs."""
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(64, generator=gen) * 0.05
    honest = [truth + 0.02 * torch.randn(64, generator=gen) for _ in range(6)]
    honest_mean = torch.stack(honest).mean(0)
    weights = torch.ones(8)
    for kind in ("sign-flip", "scaled", "constant"):
        liars = [Attack(kind, seed=i).apply([h.clone()])[0] for i, h in enumerate(honest[:2])]
        parts = honest + liars
        off = {name: float((agg(parts, weights) - honest_mean).norm() / honest_mean.norm()) for name, agg in (("mean", mean), ("cc", centered_clip), ("tm", trimmed_mean))}
        assert off["mean"] > 10 and off["tm"] > 10, (kind, off)  # the liars own the average (trimmed_mean's default trim: 1 of 8)
        assert off["cc"] < 0.2, (kind, off)  # robust: close to the honest mean
        assert float((trimmed_mean(parts, weights, trim=2) - honest_mean).norm() / honest_mean.norm()) < 0.2, kind


def test_bad_attack_settings_are_named():
    with pytest.raises(ValueError, match="fault_attack must be one of sign-flip"):
        Attack("flip")
    with pytest.raises(ValueError, match="fault_attack_scale"):
        Attack("scaled", float("nan"))
    with pytest.raises(ConfigError, match="fault_attack"):
        load_config({"fault_attack": "shout"}, None)
    assert load_config({"fault_attack": "ipm", "fault_attack_scale": 0.5}, None).fault_attack == "ipm"
    assert NodeConfig().fault_attack == ""


def test_a_liars_part_far_from_the_robust_aggregate_is_evidence_with_its_reason():
    gen = torch.Generator().manual_seed(1)
    truth = torch.randn(256, generator=gen) * 0.05
    names = [f"peer{i}" for i in range(8)]
    honest = [truth + 0.02 * torch.randn(256, generator=gen) for _ in range(6)]
    clean = centered_clip(honest + [truth + 0.02 * torch.randn(256, generator=gen) for _ in range(2)], torch.ones(8))
    assert far_parts(honest + [truth, truth], clean, names) == {}  # honest parts, however they spread: nobody
    skewed = honest + [truth + 0.12 * torch.randn(256, generator=gen) for _ in range(2)]  # two on data of their own: six times the others' spread
    assert far_parts(skewed, centered_clip(skewed, torch.ones(8)), names) == {}
    for kind in ("sign-flip", "scaled", "constant", "noise"):
        scale = 10.0 if kind == "noise" else 0.0  # noise at the honest norm hides; ten times it does not
        parts = honest + [Attack(kind, scale, seed=i).apply([h.clone()])[0] for i, h in enumerate(honest[:2])]
        far = far_parts(parts, centered_clip(parts, torch.ones(8)), names)
        assert set(far) == {"peer6", "peer7"} and min(far.values()) > FAR, (kind, far)
    assert far_parts(parts[:2], parts[0], names[:2]) == {}  # two parts: no majority to measure against
    reasons = accusations("outer-7-abc", {0: {"peer6": 25.0, "me": 30.0}, 3: {"peer6": 80.5, "peer7": 5.0}}, me="me", harm={"peer5": (5, 0.12), "peer6": (6, 0.3)})
    assert reasons == {
        "peer5": "round outer-7-abc: its parts raised the loss of its own data 5 rounds running, this one by 0.12x what the aggregate lowered it",
        "peer6": "round outer-7-abc: its part of slice 3 was 80.5x the group's spread from the robust aggregate",
        "peer7": "round outer-7-abc: its part of slice 3 was 5x the group's spread from the robust aggregate",
    }


def test_the_byzantine_bench_scores_bans_by_the_honest_majority():
    honest, liars = {"h1", "h2", "h3"}, {"x"}
    # x banned by two of three honest replicas: caught; h3 banned by one: not caught, but counted
    scores = ban_scores({"h1": {"x"}, "h2": {"x", "h3"}, "h3": set()}, liars, honest)
    assert scores == {"caught": ["x"], "precision": 1.0, "recall": 1.0, "honest_banned": ["h3"]}
    assert ban_scores({"h1": set(), "h2": set()}, liars, honest) == {"caught": [], "precision": 0.0, "recall": 0.0, "honest_banned": []}
    assert ban_scores({"h1": set(), "h2": set()}, set(), honest)["precision"] == 1.0  # a clean run: nothing to catch, nobody caught
    assert ban_scores({"h1": {"h2"}, "h2": {"h1"}, "h3": {"h1"}}, set(), honest)["caught"] == ["h1"]  # a majority's wrong ban is caught, and wrong


def test_the_slot_bench_reads_bans_and_times_from_the_trainers_log_and_compares_arms():
    log = ("10:00:01 INFO node.roles.stats: trainer | 8 micro-batches | loss 5.4 | 16.9 samples/s\n"
           "10:00:05 WARN node.net.rpc: banned 12D3KooWliar for 60 s (ban 1): 1 offence in 600 s, the last: a wrong answer\n"
           "10:01:09 WARN node.net.rpc: banned 12D3KooWliar for 120 s (ban 2): 1 offence in 600 s, the last: a wrong answer\n")  # fmt: skip
    assert ban_times(log) == {"12D3KooWliar": 36005} and first_micro_batches(log) == 36001
    rows = [{"arm": "clean", "loss": 2.0, "caught": [], "honest_banned": []}, {"arm": "attacked", "loss": 2.02, "caught": ["s0"], "honest_banned": [], "seconds_to_ban": 4},
            {"arm": "unchecked", "loss": 3.0, "caught": [], "honest_banned": []}]  # fmt: skip
    out = slot_result(rows)
    assert out["ratios"] == {"attacked_loss_over_clean": 1.01, "unchecked_loss_over_clean": 1.5}
    assert (out["precision"], out["recall"], out["seconds_to_ban"], out["honest_banned"]) == (1.0, 1.0, 4, [])
    rows[1].update(caught=[], honest_banned=["s2"])  # an honest peer banned, the liar not
    assert (slot_result(rows)["precision"], slot_result(rows)["recall"]) == (0.0, 0.0)


def test_the_byzantine_bench_stops_an_arm_whose_loss_derailed(tmp_path):
    for name, losses in {"a": [5.5, 4.0, 3.5], "b": [5.5, 80.0, float("nan")]}.items():
        (tmp_path / name).mkdir()
        history = [{"outer_step": k, "val_loss": v} for k, v in enumerate(losses)]
        (tmp_path / name / "replica-stats.json").write_text(json.dumps({"history": history}))
    assert _derailed(tmp_path, ["a"]) is None
    assert _derailed(tmp_path, ["a", "b"]) == {"derailed_at_step": 1, "derailed_val_loss": 80.0}


def test_every_kind_a_node_setting_names_has_its_default_strength():
    assert tuple(DEFAULT_SCALE) == REPLICA_ATTACKS and tuple(ANSWER_SCALE) == ANSWER_ATTACKS


def test_a_slot_peer_lies_either_in_its_answers_or_in_its_syncs_and_a_replica_only_as_a_replica():
    from node.roles.attacks import answer_attack, replica_attack, sync_attack
    from node.roles.role import RoleError

    syncs = load_config({"fault_attack": "sync-sign-flip"}, None)
    assert answer_attack(syncs) is None  # it answers honestly
    lie = sync_attack(syncs)
    assert (lie.kind, lie.scale) == ("sign-flip", 1000.0)
    assert all(torch.equal(a, -1000 * b) for a, b in zip(lie.apply(update(0)), update(0)))
    answers = load_config({"fault_attack": "noise"}, None)
    assert sync_attack(answers) is None and answer_attack(answers).kind == "noise"
    assert sync_attack(NodeConfig()) is answer_attack(NodeConfig()) is replica_attack(NodeConfig()) is None
    with pytest.raises(RoleError, match="a replica's fault_attack must be one of sign-flip, .*, got 'sync-sign-flip'"):
        replica_attack(syncs)
    with pytest.raises(ConfigError, match="fault_attack must be one of .*sync-alie, got .sync-replay."):
        load_config({"fault_attack": "sync-replay"}, None)  # a sync carries a pseudo-gradient: replica kinds only
