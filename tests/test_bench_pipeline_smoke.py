"""The pipeline benchmark runs end to end on a tiny setting and reports comparable arms."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm import require_netns

pytestmark = pytest.mark.timeout(300)


def tiny_run(tmp_path, *args: str, samples: int = 128) -> dict:
    """The bench's JSON for `args` on the tiny model cut in 2 stages (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--json", *args, "--model", "tiny", "--stages", "2", "--samples", str(samples),
         "--batch-size", "4", "--step-samples", "16", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def mean_of_two_seeds(by: dict, arm: str) -> float:
    return (by[arm]["final_loss"] + by[f"{arm}@seed1"]["final_loss"]) / 2


def test_pipeline_bench_runs_one_process_and_torch_pipelining_on_the_same_micro_batches(tmp_path):
    result = tiny_run(tmp_path, "--arms", "a,b,b-kill", "--repeat", "2", "--kill-wait-s", "3")  # (the ranks left wait on the dead one: 3 s shows it)
    a, b, kill, kill2, b2, a2 = result["arms"]  # --repeat 2: the second time in reverse order
    assert [r["arm"] for r in (a, b, kill, kill2, b2, a2)] == ["a", "b", "b-kill", "b-kill@run2", "b@run2", "a@run2"] and b2["status"] == a2["status"] == "ok"
    assert kill["samples_per_s"] == kill2["samples_per_s"] == 0.0 and "final_loss" not in kill and kill["outcome"]  # no loss to average (this tiny run may end before the kill: the outcome says which)
    mean = lambda x, y: (x["final_loss"] + y["final_loss"]) / 2  # noqa: E731
    assert result["ratios"]["b_loss_over_a"] == round(mean(b, b2) / mean(a, a2), 4)  # the ratios take every run
    assert a["status"] == b["status"] == "ok" and a["samples_per_s"] > 0 and b["samples_per_s"] > 0
    # both trained the same model on the same micro-batches from the same weights: close losses
    assert abs(a["final_loss"] - b["final_loss"]) < 0.25 * a["final_loss"], (a, b)
    assert b["bytes_per_sample"] == 2 * 1 * 4 * 64 * 64 * 4 / 4  # one boundary: activations and their gradients, fp32
    # every run gets a directory of its own: one that ran in an earlier run's read that run's files
    again = subprocess.run([sys.executable, "-m", "bench.pipeline", "--json", "--arms", "a", "--model", "tiny", "--samples", "128", "--batch-size", "4",
                            "--step-samples", "16", "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=240, check=True)  # fmt: skip
    first, second = Path(result["work_dir"]), Path(json.loads(again.stdout)["work_dir"])
    assert first.parent == second.parent == tmp_path and first != second
    assert (first / "b" / "rank0.json").is_file() and (first / "b-2" / "rank0.json").is_file()  # each run of an arm in its own directory


def test_pipeline_bench_pairs_each_arm_with_the_other_systems_run_of_its_algorithm(tmp_path):
    """(b-global-clip): torch's pipeline clipping by the whole model's norm runs (a)'s algorithm;
    (c-stage-clip): the swarm's stages clipping alone run (b)'s. Each pair ends at one loss."""
    result = tiny_run(tmp_path, "--arms", "a,b,b-global-clip,c-stage-clip")
    by, ratios = {r["arm"]: r for r in result["arms"]}, result["ratios"]
    assert all(r["status"] == "ok" for r in by.values()), result["arms"]
    assert by["c-stage-clip"]["steps_clipped"]["global"] == 0 and by["c-stage-clip"]["steps_clipped"]["alone"] > 0  # the run setting reached the stages
    # one algorithm, one loss (to float rounding); the two algorithms end apart by more than that
    assert abs(ratios["b_global_clip_loss_over_a"] - 1) <= 1e-4 and abs(ratios["c_stage_clip_loss_over_b"] - 1) <= 1e-4, ratios
    assert abs(ratios["b_loss_over_a"] - 1) > 3e-4, ratios
    assert ratios["c_stage_clip_over_b_samples_per_s"] > 0 and "c_over_b_global_clip_samples_per_s" not in ratios  # (no (c) in this run)


def test_pipeline_bench_refuses_settings_that_do_not_divide():
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--samples", "100", "--arms", "a"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--samples of 2 x --step-samples" in out.stderr


def test_pipeline_bench_compares_mean_losses_over_seeds(tmp_path):
    result = tiny_run(tmp_path, "--arms", "a,a-rounding", "--loss-seeds", "2")
    by = {r["arm"]: r for r in result["arms"]}
    assert sorted(by) == ["a", "a-rounding", "a-rounding@seed1", "a@seed1"] and all(r["status"] == "ok" for r in by.values())
    assert by["a"]["final_loss"] != by["a@seed1"]["final_loss"]  # another seed: other weights, other micro-batches
    assert result["ratios"]["a_rounding_loss_over_a_mean_of_2_seeds"] == round(mean_of_two_seeds(by, "a-rounding") / mean_of_two_seeds(by, "a"), 4)


def test_pipeline_bench_runs_the_shaped_link_arms_and_compares_codecs(tmp_path):
    """(Means over seeds are the same code for every arm: test_pipeline_bench_compares_mean_losses_over_seeds.)"""
    from bench import netns

    require_netns()
    before = set(netns.list_namespaces())
    result = tiny_run(tmp_path, "--arms", "f-none,f-int8", samples=64)
    by = {r["arm"]: r for r in result["arms"]}
    assert sorted(by) == ["f-int8", "f-none"] and all(r["status"] == "ok" for r in by.values()), by
    assert all(r["lost"] == 0 and r["samples_per_s"] > 0 for r in by.values())
    assert by["f-int8"]["bytes_per_sample"] < 0.4 * by["f-none"]["bytes_per_sample"]  # int8 codes and a scale per token, against float32
    assert result["ratios"]["f_int8_loss_over_none"] == round(by["f-int8"]["final_loss"] / by["f-none"]["final_loss"], 4)
    # each arm removed its namespaces (those of a process still running, another test's, may be there)
    assert [ns for ns in set(netns.list_namespaces()) - before if (m := netns._NAME.match(ns)) and not netns.pid_alive(int(m.group(1)))] == []


def test_pipeline_bench_refuses_fewer_than_one_seed_or_one_run():
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--loss-seeds", "0", "--arms", "a"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--loss-seeds must be at least 1" in out.stderr
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--repeat", "0", "--arms", "a"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--repeat must be at least 1" in out.stderr


def test_a_swarm_arm_whose_coordinator_refuses_the_cut_fails_with_its_reason_not_a_timeout(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--json", "--arms", "c", "--model", "tiny", "--stages", "3", "--samples", "128",
         "--batch-size", "4", "--step-samples", "16", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    (row,) = json.loads(out.stdout)["arms"]
    assert row["status"] == "failed" and "coordinator exited" in row["error"] and "exceeds the model's 2 blocks" in row["error"], row
    assert "timed out" not in row["error"], row  # it stopped waiting when the coordinator exited


def test_codec_ratios_take_the_mean_loss_over_every_seed_and_only_when_each_seed_ran():
    from bench.pipeline import Settings, _seed_ratios

    s = Settings()
    row = lambda loss, rate=10.0: {"final_loss": loss, "samples_per_s": rate}  # noqa: E731
    by = {"f-none": row(2.0), "f-none@seed1": row(4.0), "f-int8": row(2.2, 8.0), "f-int8@seed1": row(3.8)}
    ratios = _seed_ratios(by, s, 2)
    assert ratios["f_int8_loss_over_none"] == 1.1 and ratios["f_int8_over_none_samples_per_s"] == 0.8  # the first seed's own
    assert ratios["f_int8_loss_over_none_mean_of_2_seeds"] == 1.0  # (2.2 + 3.8) / (2.0 + 4.0)
    del by["f-int8@seed1"]  # a seed's run failed: no mean that leaves it out
    assert "f_int8_loss_over_none_mean_of_2_seeds" not in _seed_ratios(by, s, 2)
    assert "f_int8_loss_over_none_mean_of_2_seeds" not in _seed_ratios({k: v for k, v in by.items() if "@" not in k}, s, 1)
