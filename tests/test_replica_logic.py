"""Pure decisions of the replica role and the coordinator's checkpoint quorum."""

import json

import pytest

from coordinator.planner import checkpoint_quorum
from node.models.data import shard_of
from node.roles.replica import lone_replica
from node.roles.slot_state import choose_state
from node.runconfig import RunConfig, RunConfigError


def test_choose_state_prefers_the_majority_at_the_highest_round():
    peers = {"a": (5, "h5"), "b": (5, "h5"), "c": (5, "x5"), "d": (4, "h4")}
    assert choose_state(None, peers) == (5, "h5")
    assert choose_state((4, "h4"), peers) == (5, "h5")  # behind: catch up
    assert choose_state((5, "h5"), peers) is None  # already there
    assert choose_state((5, "x5"), peers) == (5, "h5")  # same round, outvoted: take the majority
    assert choose_state((6, "h6"), peers) is None  # ahead of everyone: keep ours
    assert choose_state((3, "h3"), {}) is None


def test_choose_state_at_our_round_votes_and_ties_go_to_the_smaller_hash():
    assert choose_state((5, "mine"), {"a": (5, "other")}) is None  # 1 vs 1: "mine" < "other", keep
    assert choose_state((5, "other"), {"a": (5, "mine")}) == (5, "mine")  # the other side of that tie
    assert choose_state((5, "mine"), {"a": (5, "other"), "b": (5, "mine")}) is None  # 2 vs 1
    assert choose_state((5, "aaa"), {"a": (5, "zzz"), "b": (5, "zzz")}) == (5, "zzz")  # outvoted


def test_choose_state_breaks_ties_deterministically():
    peers = {"a": (2, "bbb"), "b": (2, "aaa")}
    assert choose_state(None, peers) == (2, "aaa")
    assert choose_state(None, dict(reversed(list(peers.items())))) == (2, "aaa")


def test_checkpoint_quorum():
    assert checkpoint_quorum(0, None, {}, 5)[0]  # the initial state
    ok, why = checkpoint_quorum(7, "h", {"a": "h"}, 3)
    assert not ok and "1 of the 2" in why
    assert checkpoint_quorum(7, "h", {"a": "h", "b": "h"}, 3)[0]
    assert checkpoint_quorum(7, "h", {"a": "h"}, 1)[0]  # the only replica
    ok, why = checkpoint_quorum(7, "h", {"a": "h", "b": "h", "c": "x", "d": "x", "e": "x"}, 5)
    assert not ok and "another hash" in why
    assert not checkpoint_quorum(7, None, {"a": "h"}, 1)[0]


def test_run_config_parsing():
    cfg = RunConfig.from_json(json.dumps({"model": "small", "inner_steps": 7, "outer_lr": 1, "future_knob": 3}).encode())
    assert cfg.model == "small" and cfg.inner_steps == 7 and cfg.outer_lr == 1.0
    assert cfg.train_config().inner_steps == 7 and cfg.model_config().n_layer == 4
    assert RunConfig.from_json(b"") == RunConfig()
    for bad, match in [
        (b"not json", "not JSON"),
        (b"[1]", "object"),
        (json.dumps({"model": "huge"}).encode(), "unknown model"),
        (json.dumps({"inner_steps": "7"}).encode(), "inner_steps"),
        (json.dumps({"inner_steps": 0}).encode(), "inner_steps"),
        (json.dumps({"inner_steps": True}).encode(), "inner_steps"),
    ]:
        with pytest.raises(RunConfigError, match=match):
            RunConfig.from_json(bad)


def test_shards_are_stable_and_spread():
    ids = [f"12D3KooW{i:04d}" for i in range(400)]
    shards = [shard_of(p, 8) for p in ids]
    assert shards == [shard_of(p, 8) for p in ids]
    assert set(shards) == set(range(8))


def test_a_replica_steps_alone_only_as_the_swarm_s_only_replica():
    lone, why = lone_replica("me", {"me"}, set(), min_replicas=1)
    assert lone and "only replica" in why
    # another replica in the records (late, slow, or just dead: its record outlives it a while)
    assert lone_replica("me", {"me", "b"}, set(), 1) == (False, "1 other replica(s) in the member records: averaging with them")
    # none in the records, but one of our last round still answers (our DHT lost sight of it)
    lone, why = lone_replica("me", {"me"}, {"b"}, 1)
    assert not lone and "1 of the last round answer" in why
    # a run that asked for two replicas never trains on one
    lone, why = lone_replica("me", {"me"}, set(), 2)
    assert not lone and "needs 2" in why
