"""The overlap benchmark: what it reads from a replica's records, its refusals, and (as root) one
small run of both arms in network namespaces."""

import json
import subprocess
import sys

import pytest

from bench.overlap import replica_summary
from tests.swarm import require_netns


def _entry(step, t, inner, ev, sent, sync, **extra):
    return {"outer_step": step, "time": t, "inner_s": inner, "eval_s": ev, "bytes_sent": sent, "sync_bytes": sync, "members": 4, "state_hash": "h", **extra}


def test_utilisation_is_inner_time_over_wall_time_after_the_first_outer_step():
    history = [
        {"outer_step": 0, "start": True, "time": 0.0, "state_hash": "h"},
        _entry(1, 10.0, 5.0, 1.0, 100, 100),  # the first step: processes starting, left out
        _entry(2, 20.0, 13.0, 2.0, 200, 100, wait_s=0.5),
        _entry(3, 30.0, 21.0, 3.0, 300, 100, wait_s=1.5, failed_fragments=[2]),
        _entry(4, 40.0, 29.0, 4.0, 400, 100, wait_s=1.5),
    ]
    s = replica_summary(history, last=3)
    assert s["outer_steps"] == 2 and s["utilisation"] == 0.8 and s["utilisation_no_eval"] == round(16 / 18, 4)
    assert s["seconds_per_outer_step"] == 10.0 and s["wait_s"] == 1.5 and s["bytes_per_outer_step"] == 100 and s["failed_fragments"] == 1
    with pytest.raises(RuntimeError, match="fewer than two outer steps"):
        replica_summary(history[:2], last=3)


@pytest.mark.parametrize("args, message", [(["--fragments", "1"], "--fragments must be in 2..40"), (["--steps", "30"], "multiple of inner_steps")])
def test_bad_settings_are_refused_in_one_line(args, message):
    out = subprocess.run([sys.executable, "-m", "bench.overlap", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.swarm
@pytest.mark.timeout(900)
def test_both_arms_run_behind_shaped_links(tmp_path):
    require_netns()
    argv = ["--preset", "tiny", "--warmup-steps", "10", "--steps", "60", "--inner-steps", "10", "--replicas", "2", "--fragments", "2",
            "--eval-batches", "2", "--timeout", "400", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "bench.overlap", *argv], capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    one, two = result["arms"]["fragments_1"], result["arms"]["fragments_2"]
    for arm in (one, two):
        assert arm["status"] == "ok" and 0 < arm["utilisation"] <= arm["utilisation_no_eval"] <= 1 and arm["final_val_loss"] > 0
    # a round of the fragment arm carries about half the model
    assert 1.5 < result["compared"]["bytes_per_round_ratio"] < 2.7, result["compared"]
