"""bench/experts.py runs end to end at a tiny size: the one-process arm and the swarm's report
their layer throughput and latency and a finite training loss, hivemind's arm its throughput,
and nothing is left behind."""

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.test_bench_allreduce_smoke import leftovers

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(150)

LAYER = ("samples_per_s", "token_expert_pairs_per_s", "tokens_without_expert", "latency_p50_s", "latency_p99_s", "calls", "calls_ok", "token_expert_pairs_per_call", "exceptions", "nonfinite_calls", "skipped_experts")


def run_bench(tmp_path, *args: str) -> dict:
    marker = uuid.uuid4().hex
    argv = [sys.executable, "-m", "bench.experts", "--json", "--min-seconds", "0", "--work-dir", str(tmp_path), "--timeout", "90", *args]
    env = {**os.environ, "STB_TEST_MARKER": marker}
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=140)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    assert proc.returncode == 0, stderr[-3000:] + stdout[-3000:]
    assert leftovers(marker) == []
    return json.loads(stdout)


def test_experts_bench_json_one_process_and_swarm(tmp_path):
    result = run_bench(
        tmp_path, "--arms", "a,c", "--tokens", "64", "--steps", "6", "--warmup", "2",
        "--train-micro-batches", "32", "--batch-size", "2", "--warmup-steps", "2",
    )  # fmt: skip
    assert result["settings"]["tokens"] == 64 and result["settings"]["hosts"] == 2
    arms = {r["arm"]: r for r in result["arms"]}
    assert set(arms) == {"a", "c"}
    for key, row in arms.items():
        assert row["status"] == "ok", row
        assert not set(LAYER) - set(row), (key, set(LAYER) - set(row))
        assert row["samples_per_s"] > 0 and row["calls"] == row["calls_ok"] == 6, row
        assert 0 < row["latency_p50_s"] <= row["latency_p99_s"], row
        # top-2 of 4 experts, capacity 1.25 x fair share: at most every token twice
        assert 0 < row["token_expert_pairs_per_call"] <= 2 * 64, row
        assert row["exceptions"] == row["nonfinite_calls"] == 0, row
        assert math.isfinite(row["final_loss"]) and 0 < row["final_loss"] < 10, row
        assert row["train_micro_batches"] == 32, row
    assert arms["c"]["skipped_experts"] == 0 and arms["c"]["train_skipped_experts"] == 0, arms["c"]
    assert arms["c"]["expert_rpcs"] > 0
    ratios = result["ratios"]
    assert ratios["c_loss_over_a"] > 0 and ratios["c_over_a_samples_per_s"] > 0
    assert "c_over_b_samples_per_s" not in ratios  # (b) did not run


def test_experts_bench_json_hivemind(tmp_path):
    result = run_bench(tmp_path, "--arms", "b", "--tokens", "16", "--steps", "3", "--warmup", "1")
    (row,) = result["arms"]
    assert row["arm"] == "b" and row["status"] == "ok", row
    assert not set(LAYER) - {"skipped_experts"} - set(row), set(LAYER) - set(row)
    assert row["samples_per_s"] > 0 and row["calls"] == row["calls_ok"] == 3, row
    assert row["token_expert_pairs_per_call"] == 2 * 16  # no capacity limit: every token to its top 2
    assert row["exceptions"] == row["nonfinite_calls"] == row["failed_expert_calls"] == 0, row


def test_experts_bench_refuses_bad_settings():
    out = subprocess.run([sys.executable, "-m", "bench.experts", "--arms", "a,z", "--train-micro-batches", "12"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "unknown arm(s) z" in out.stderr and "--train-micro-batches must be 0 or a multiple of 8" in out.stderr
