"""Swarm tests of pipeline training: a real coordinator, stage servers and trainers on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.swarm import Swarm, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

# the "small" preset has 4 blocks: 3 stages of 2, 1 and 1 blocks (the first also holds the
# embeddings, the last the head and the loss)
RUN = [
    "--mode", "pipeline", "--num-stages", "3", "--stage-blocks", "2,1,1", "--model", "small", "--batch-size", "4",
    "--stage-step-samples", "16", "--micro-batches-in-flight", "4", "--warmup-steps", "5", "--inner-lr", "3e-3",
    "--heartbeat-timeout-s", "10", "--stage-sync-every-s", "3",
]  # fmt: skip
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5"]


def stats(swarm: Swarm, name: str, kind: str) -> dict:
    try:
        return json.loads((Path(swarm.tmp) / name / f"{kind}-stats.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def common_syncs(swarm, names) -> dict[int, list[str]]:
    """sync round -> the hash each of `names` held after it, for rounds all of them took part in."""
    seen = [{e["sync"]: e["state_hash"] for e in stats(swarm, n, "stage").get("history", []) if "sync" in e} for n in names]
    return {k: [s[k] for s in seen] for k in set.intersection(*(set(s) for s in seen))}


def micro_batches(swarm, name) -> int:
    return stats(swarm, name, "trainer").get("micro_batches", 0)


def test_stage_servers_and_trainers_train_through_a_killed_and_a_frozen_stage_peer(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    servers = {f"s{i}": swarm.node(f"s{i}", [maddr], *NODE) for i in range(6)}
    # stage servers first, so the planner spreads them over the stages before the trainers come
    wait_for(lambda: sorted(m.get("stage") for m in coord.status()["members"] if m.get("role") == "stage") == [0, 0, 1, 1, 2, 2], 120, "two peers per stage")
    trainers = {f"t{i}": swarm.node(f"t{i}", [maddr], *NODE, "--wanted-role", "trainer", "--shard-index", str(i)) for i in range(2)}

    # both trainers push micro-batches through; every stage server holds only its own layers
    wait_for(lambda: min(micro_batches(swarm, t) for t in trainers) >= 48, 300, "48 micro-batches per trainer")
    by_stage: dict[int, list[str]] = {}
    for name in servers:
        st = stats(swarm, name, "stage")
        by_stage.setdefault(st["stage"], []).append(name)
    assert sorted(len(v) for v in by_stage.values()) == [2, 2, 2], by_stage
    shown = coord.status()["stages"]  # /status per stage: its peers, their hashes, throughput
    assert sorted(shown) == ["0", "1", "2"] and all(len(v["peers"]) == 2 and v["state_hashes"] and v["samples_per_second"] > 0 for v in shown.values()), shown
    want = {0: {"wte", "wpe", "blocks.0", "blocks.1"}, 1: {"blocks.2"}, 2: {"blocks.3", "ln_f", "lm_head"}}
    for s, names in by_stage.items():
        for name in names:
            st = stats(swarm, name, "stage")
            groups = {p.split(".")[0] if not p.startswith("blocks.") else ".".join(p.split(".")[:2]) for p in st["params"]}
            assert groups == want[s], (name, s, groups)
            assert st["steps"] > 0 and st["calls"]["refused"] == 0, st
    assert sum(stats(swarm, n, "stage")["calls"]["train"] for n in by_stage[2]) >= 96
    # the two peers of each stage synchronise every 3 s and hold the same parameters afterwards
    wait_for(lambda: all(len(common_syncs(swarm, names)) >= 2 for names in by_stage.values()), 120, "two common syncs in every stage")
    for names in by_stage.values():
        for n, hashes in common_syncs(swarm, names).items():
            assert len(set(hashes)) == 1, (names, n, hashes)

    # SIGKILL one peer of the middle stage mid-run: its calls go to the other one, nothing is lost
    victim = by_stage[1][0]
    done_before = {t: micro_batches(swarm, t) for t in trainers}
    servers[victim].kill()
    wait_for(lambda: all(micro_batches(swarm, t) >= done_before[t] + 48 for t in trainers), 300, "48 more micro-batches per trainer after the kill")
    assert not servers[victim].leftovers()

    # SIGSTOP one peer of the last stage: calls to it pass their deadline (from its measured call
    # times) and go to the other peer; after SIGCONT it serves calls again
    frozen = by_stage[2][0]
    done_before = {t: micro_batches(swarm, t) for t in trainers}
    servers[frozen].stall()
    try:
        wait_for(lambda: all(micro_batches(swarm, t) >= done_before[t] + 32 for t in trainers), 300, "32 more micro-batches per trainer while a peer is frozen")
    finally:
        servers[frozen].resume()
    served = stats(swarm, frozen, "stage")["calls"]["train"]
    wait_for(lambda: stats(swarm, frozen, "stage")["calls"]["train"] > served + 16, 120, "the frozen peer to serve calls again after SIGCONT")
    for t in trainers:
        log = trainers[t].log()
        deadlines = [float(w.split(" s)")[0]) for w in log.split("timed out after ")[1:]]
        assert deadlines and max(deadlines) < 10.0, deadlines  # from measured times, not the 10 s of a peer never measured
        st = stats(swarm, t, "trainer")
        assert st["lost"] == 0, st
        h = st["history"]
        assert h[-1]["loss"] < h[0]["loss"] - 0.3, [(e["micro_batches"], round(e["loss"], 3)) for e in h]
