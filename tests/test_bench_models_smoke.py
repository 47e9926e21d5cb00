"""bench/models.py runs end to end on tiny configs of its two models (the same code paths as the
real sizes): every arm reports its numbers under the keys the results are read by, every target
its measured value, and nothing it started is left behind."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.test_bench_allreduce_smoke import leftovers

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--inner-steps", "1", "--stages", "2", "--daemon-window-s", "1",
        "--join-timeout-s", "5", "--timeout", "60"]  # fmt: skip
MEMORY = {"rss_mib", "pss_mib", "pss_mib_last", "peak_pss_at_s", "processes", "samples"}


def run_bench(tmp_path, *args: str, timeout: float = 110) -> dict:
    marker = uuid.uuid4().hex
    argv = [sys.executable, "-m", "bench.models", "--json", *TINY, "--work-dir", str(tmp_path), *args]
    with subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "STB_TEST_MARKER": marker}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the bench stops every process it started on SIGTERM
            proc.communicate(timeout=30)
            raise
    assert leftovers(marker) == []
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


def check_memory(memory: dict, daemon: bool = True) -> None:
    assert set(memory) == MEMORY and 0 < memory["pss_mib"] <= memory["rss_mib"], memory
    if daemon:  # a node's tree: the node, its DHT child and p2pd
        assert memory["processes"].count("p2pd") == 1 and len(memory["processes"]) >= 3, memory


@pytest.mark.timeout(130)
def test_a_model_less_daemon_one_process_and_a_pipeline_swarm_against_torch_pipelining(tmp_path):
    # (one bench run: each run starts its processes anew, and the suite's minutes are few; the
    # joiner's test runs the replicas)
    result = run_bench(tmp_path, "--models", "llama", "--arms", "daemon,reference,pipeline,torch-pipeline")
    assert [r["arm"] for r in result["arms"]] == ["daemon", "llama/reference", "llama/pipeline", "llama/torch-pipeline"]
    m = result["models"]["llama"]
    assert m["params"] == m["reference"]["params"] and m["config"]["max_position_embeddings"] == m["context_tokens"] == 32
    assert m["stage_layers"] == [[0, 2], [2, 4]] and len(m["stage_params"]) == 2 and m["reference"]["tokens_per_s"] > 0
    check_memory(m["reference"]["memory"], daemon=False)
    check_memory(result["daemon"]["memory"])
    assert result["daemon"]["roles_taken"] == []
    by = {t["target"]: t for t in result["targets"]}
    assert set(by) == {"llama_stage_server_memory", "llama_pipeline_tokens_per_s", "daemon_memory", "joiner_time"}
    assert by["daemon_memory"]["measured"] == result["daemon"]["memory"]["pss_mib"] and by["daemon_memory"]["met"] == (by["daemon_memory"]["measured"] <= 350)
    assert by["joiner_time"]["measured"] is None and by["joiner_time"]["met"] is False  # an arm not run meets nothing
    assert [r["params"] for r in m["torch_pipeline"]["ranks"]] == m["stage_params"]
    assert m["pipeline"]["tokens_per_s"] > 0 and m["torch_pipeline"]["tokens_per_s"] > 0
    for part in (*m["pipeline"]["stage_servers"], m["pipeline"]["trainer"]):
        check_memory(part["memory"])
    for rank in m["torch_pipeline"]["ranks"]:
        check_memory(rank["memory"], daemon=False)
    assert [st["stage"] for st in m["pipeline"]["stage_servers"]] == [0, 1] and m["pipeline"]["lost_micro_batches"] == 0
    for part in (m["pipeline"], m["torch_pipeline"]):  # the CPU both spent over their timed windows
        cpu = part["cpu_in_window"]
        assert cpu["cpu_s"] > 0 and cpu["window_s"] > 0 and cpu["cores_busy"] > 0 and cpu["cpu_s_per_1k_tokens"] > 0, cpu
    assert m["ratios"]["pipeline_over_torch_pipelining_cpu_s_per_token"] > 0
    ratio = m["ratios"]["pipeline_over_torch_pipelining_tokens_per_s"]
    assert ratio == round(m["pipeline"]["tokens_per_s"] / m["torch_pipeline"]["tokens_per_s"], 3)
    assert {t["target"]: t["measured"] for t in result["targets"]}["llama_pipeline_tokens_per_s"] == ratio


def test_ratios_and_targets_read_the_arms_as_they_report():
    from bench.models import _ratios, targets

    mem = lambda pss: {"memory": {"pss_mib": pss}}  # noqa: E731
    m = {"params": 100, "stage_params": [40, 60], "reference": {"tokens_per_s": 100.0, **mem(1000.0)}, "replica": {"tokens_per_s": 80.0, **mem(2000.0)},
         "pipeline": {"tokens_per_s": 50.0, "stage_servers": [mem(600.0), mem(800.0)]}, "torch_pipeline": {"tokens_per_s": 40.0, "ranks": [mem(300.0), mem(400.0)]}}  # fmt: skip
    m["ratios"] = _ratios(m)
    assert m["ratios"] == {"replica_over_reference_tokens_per_s": 0.8, "replica_over_reference_pss": 2.0, "pipeline_over_torch_pipelining_tokens_per_s": 1.25,
                           "stage_server_over_torch_rank_pss": [2.0, 2.0], "stage_server_over_replica_pss": [0.3, 0.4], "stage_params_over_model_params": [0.4, 0.6]}  # fmt: skip
    got = {t["target"]: (t["measured"], t["met"]) for t in targets({"models": {"x": m}, "daemon": mem(349.0), "joiner": {"seconds_to_first_outer_step": 61.0}})}
    assert got == {"x_stage_server_memory": (0.4, False), "x_pipeline_tokens_per_s": (1.25, True), "daemon_memory": (349.0, True), "joiner_time": (61.0, False)}


def test_the_joiner_is_skipped_where_its_replicas_cannot_fit_in_memory():
    from bench.models import Settings, Skipped, _check_room

    _check_room(Settings(), None)  # no replica arm: nothing to go by
    with pytest.raises(Skipped, match=r"3 replicas of 1000000000 MiB RSS each .* need 3000000000 MiB, this machine has \d+ MiB available"):
        _check_room(Settings(), {"memory": {"rss_mib": 1e9}})


@pytest.mark.timeout(130)
def test_a_joiner_and_the_kept_checkpoint(tmp_path):
    result = run_bench(tmp_path, "--models", "gpt2", "--arms", "joiner,checkpoint", "--joiner-replicas", "1")
    joiner, ckpt = result["joiner"], result["checkpoint"]
    assert joiner["model"] == ckpt["model"] == "gpt2" and joiner["replicas_before_join"] == 1 and joiner["replicas_in_that_step"] >= 2 and joiner["state_from"] in ("a replica peer", "the coordinator")
    assert 0 < joiner["seconds_to_state_taken"] <= joiner["seconds_to_first_outer_step"]
    check_memory(joiner["memory"])
    assert ckpt["checkpoint_bytes"] > ckpt["exported_bytes"] > 0 and ckpt["save_s"] > 0 and ckpt["export_s"] > 0  # the state holds the outer momentum too
    assert result["models"]["gpt2"]["params"] == 60096 and "reference" not in result["models"]["gpt2"]


@pytest.mark.timeout(60)
def test_refusals_are_one_line_and_exit_2():
    for args, words in ((["--device", "cuda"], "--device cuda: "), (["--steps", "3"], "multiple of --inner-steps"), (["--arms", "nope"], "unknown arm")):
        out = subprocess.run([sys.executable, "-m", "bench.models", "--json", *args], cwd=ROOT, capture_output=True, text=True, timeout=50)
        assert out.returncode == 2 and out.stdout == "" and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr)
