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


@pytest.mark.swarm
def test_convergence_quick_sync_swarm_and_simulation(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.convergence", "--quick", "--arms", "a,b,c", "--json", "--out", str(tmp_path), "--timeout", "240"],
        cwd=ROOT, capture_output=True, text=True, timeout=370, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    result = json.loads(out.stdout)
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
    again = subprocess.run(
        [sys.executable, "-m", "bench.convergence", "--quick", "--arms", "a,c", "--json", "--out", str(tmp_path), "--reuse"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    reused = json.loads(again.stdout)
    for arm in ("a", "c"):
        assert reused["arms"][arm]["reused"] and reused["arms"][arm]["final_val_loss"] == result["arms"][arm]["final_val_loss"]
    assert "reusing" in again.stderr


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
    out = subprocess.run(
        [sys.executable, "-m", "bench.convergence", "--quick", "--arms", "s", "--json", "--out", str(tmp_path), "--sparse-density", "0.01"],
        cwd=ROOT, capture_output=True, text=True, timeout=370, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    s = json.loads(out.stdout)["arms"]["s"]
    assert s["status"] == "ok" and [p["step"] for p in s["curve"]] == [0, 10, 20, 30, 40]
    assert s["curve"][-1]["val_loss"] < s["curve"][0]["val_loss"]
    # 4 rounds of the tiny model (136,960 values) among 2: per round, one half scattered and
    # one half gathered, at 81 bytes per chunk of 4096 (41 values: scales, 12-bit indices, 2-bit codes)
    assert 4 * 136_960 * 81 / 4096 * 0.95 < min(s["bytes_sent_per_node"]) <= max(s["bytes_sent_per_node"]) < 4 * 136_960 * 81 / 4096 * 1.1
