"""bench/convergence.py runs arms (a), (b) and (c) end to end at a tiny size and reports sane
numbers: one run of the three (the warm start and the simulation (c) are shared), then --reuse."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(400)


def quick(out_dir, *args: str, timeout: float = 370) -> tuple[dict, str]:
    """`python -m bench.convergence --quick --json --out out_dir *args`, which must exit 0: (its
    JSON, its stderr)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.convergence", "--quick", "--json", "--out", str(out_dir), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return json.loads(out.stdout), out.stderr


@pytest.mark.swarm
def test_convergence_quick_sync_swarm_and_simulation(tmp_path):
    result, _ = quick(tmp_path, "--arms", "a,b,c", "--timeout", "240")
    st = result["settings"]
    assert (st["preset"], st["replicas"], st["inner_steps"]) == ("tiny", 2, 10)
    warm = result["warm_start"]["val_loss"]
    assert math.isfinite(warm) and warm < math.log(256)  # the warm start learned something
    assert (tmp_path / "warm_start.safetensors").exists()

    steps = list(range(0, st["steps"] + 1, st["inner_steps"]))
    for arm in ("a", "c"):
        r = result["arms"][arm]
        assert r["status"] == "ok", r
        assert [p["step"] for p in r["curve"]] == steps
        losses = [p["val_loss"] for p in r["curve"]]
        assert all(math.isfinite(v) for v in losses), losses
        assert losses[0] == pytest.approx(warm)  # both start from the one warm-start checkpoint
        assert losses[-1] < warm, losses  # and train from there
        assert len(r["bytes_sent_per_node"]) == st["replicas"] and r["bytes_per_node"] > 0
        assert json.loads((tmp_path / f"arm_{arm}.json").read_text())["final_val_loss"] == r["final_val_loss"]

    a, c = result["arms"]["a"], result["arms"]["c"]
    # (a): 2(N-1)/N·numel·4 per step; tiny preset ≈ 0.14M params
    assert a["bytes_per_node"] == int(2 * (st["replicas"] - 1) / st["replicas"] * a["numel"] * 4 * st["steps"])
    summary = result["summary"]
    assert summary["bytes_ratio"] == summary["bytes_ratio_a_over_b"] and summary["bytes_ratio_a_over_c"] > 10  # (b) measured, when it ran
    assert summary["final_val_loss"]["a"] == pytest.approx(a["final_val_loss"], abs=1e-5)
    assert summary["final_val_loss"]["c"] == pytest.approx(c["final_val_loss"], abs=1e-5)
    assert "c_vs_a_rel_diff" in summary

    # arm (b), real coordinator + replicas on loopback, against the one-process simulation (c)
    b = result["arms"]["b"]
    assert b["status"] == "ok", b
    # every round averaged every replica, as in (c); the logs of the swarm are in tmp_path/swarm
    assert b["members_per_round"] == [st["replicas"]] * (st["steps"] // st["inner_steps"]), b
    assert [p["step"] for p in b["curve"]] == [p["step"] for p in c["curve"]]
    assert b["final_state_hashes_agree"] and "hash_disagreements" not in b
    assert b["clean_shutdown"], "a swarm process had to be killed"
    assert b["final_val_loss"] < result["warm_start"]["val_loss"]
    assert abs(result["summary"]["b_vs_c_rel_diff"]) < 0.01
    # measured bytes of the butterfly all-reduce vs the simulation's 2(N-1)/N·encoded estimate
    assert b["bytes_per_node"] == pytest.approx(c["bytes_per_node"], rel=0.05)

    # --reuse: finished arms are read back, not run again (the same numbers, in no time)
    reused, stderr = quick(tmp_path, "--arms", "a,c", "--reuse", timeout=120)
    for arm in ("a", "c"):
        assert reused["arms"][arm]["reused"] and reused["arms"][arm]["final_val_loss"] == result["arms"][arm]["final_val_loss"]
    assert "reusing" in stderr


def test_an_outer_lr_sweep_reuses_the_sync_arm_but_not_the_diloco_arms():
    from bench.convergence_settings import Settings

    base, swept = Settings().to_dict(), Settings(outer_lr=1.2, codec="fp16").to_dict()
    assert Settings.comparable(base, "a") == Settings.comparable(swept, "a")
    for arm in ("b", "c"):
        assert Settings.comparable(base, arm) != Settings.comparable(swept, arm)
    # the sync arm's evaluation points follow H: another H is another curve
    assert Settings.comparable(base, "a") != Settings.comparable(Settings(inner_steps=50).to_dict(), "a")


def test_a_sparse_sweep_reuses_the_sync_and_int8_arms_but_not_the_sparse_one():
    from bench.convergence_settings import Settings

    base = Settings().to_dict()
    sparse = Settings(sparse_density=0.01, sparse_inner_steps=20, sparse_outer_momentum=0.0).to_dict()
    for arm in ("a", "b", "c"):
        assert Settings.comparable(base, arm) == Settings.comparable(sparse, arm)
    assert Settings.comparable(base, "s") != Settings.comparable(sparse, "s")
    # an int8 sweep leaves the sparse arm as it was
    assert Settings.comparable(base, "s") == Settings.comparable(Settings(outer_lr=1.2, codec="fp16").to_dict(), "s")
    with pytest.raises(ValueError, match="sparse_inner_steps"):
        Settings(sparse_inner_steps=30)  # 800 steps are not a whole number of its rounds
    with pytest.raises(ValueError, match="sparse bits"):
        Settings(sparse_bits=9)


def test_the_sparse_arm_runs_and_reports_its_bytes(tmp_path):
    s = quick(tmp_path, "--arms", "s", "--sparse-density", "0.01")[0]["arms"]["s"]
    assert s["status"] == "ok" and [p["step"] for p in s["curve"]] == [0, 10, 20, 30, 40]
    assert s["curve"][-1]["val_loss"] < s["curve"][0]["val_loss"]
    # 4 rounds of the tiny model (136,960 values) among 2: per round, one half scattered and
    # one half gathered, at 81 bytes per chunk of 4096 (41 values: scales, 12-bit indices, 2-bit codes)
    assert 4 * 136_960 * 81 / 4096 * 0.95 < min(s["bytes_sent_per_node"]) <= max(s["bytes_sent_per_node"]) < 4 * 136_960 * 81 / 4096 * 1.1


def test_the_uneven_arms_slow_the_last_replica_and_time_the_swarm_to_a_loss(tmp_path):
    from bench.convergence import time_to_loss
    from bench.convergence_settings import Settings
    from bench.convergence_swarm import coordinator_args, node_args
    from coordinator.cli import build_parser

    s = Settings(preset="tiny", steps=40, inner_steps=10, replicas=3, slow_replica=2.0)
    assert [node_args(s, tmp_path, r, "/ip4/127.0.0.1/tcp/1", "x")[-2:] for r in range(3)][2] == ["--fault-slowdown", "2.0"]
    assert all("--fault-slowdown" not in node_args(s, tmp_path, r, "/ip4/127.0.0.1/tcp/1", "x") for r in range(2))
    parsed = build_parser().parse_args(coordinator_args(s, tmp_path, 1, 2, "x", "time"))  # the coordinator's own flags
    assert parsed.inner_phase == "time"
    with pytest.raises(ValueError, match="slow_replica"):
        Settings(slow_replica=0.5)
    # seconds from each arm's first outer step: (a)'s loss reached by neither; both reach 2.5,
    # (b) 30 s after its first outer step, (u) 15 s after its own
    curve = lambda *pts: [{"step": 0, "val_loss": 3.0}] + [{"step": 10 * i, "val_loss": v, "seconds": t} for i, (t, v) in enumerate(pts, 1)]  # noqa: E731
    ok = {"a": {"final_val_loss": 2.0}, "b": {"final_val_loss": 2.5, "curve": curve((40, 2.9), (55, 2.7), (70, 2.5))},
          "u": {"final_val_loss": 2.45, "curve": curve((50, 2.9), (60, 2.6), (65, 2.45))}}  # fmt: skip
    assert time_to_loss(ok) == {"b_seconds_to_a_final_loss": None, "u_seconds_to_a_final_loss": None, "b_seconds_to_both_final_loss": 30,
                                "u_seconds_to_both_final_loss": 15, "seconds_to_both_final_loss_b_over_u": 2.0}  # fmt: skip
