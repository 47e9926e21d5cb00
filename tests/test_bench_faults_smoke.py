"""bench/faults.py runs end to end at a tiny size: every row has its fields, no success is wrong,
the survivors keep averaging through the outage, and nothing is left behind."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.test_bench_allreduce_smoke import leftovers

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)

FIELDS = (
    "healthy_round_s", "rounds_during_outage", "rounds_failed", "time_lost_s", "first_round_s",
    "wrong_results", "back_after_s", "target_met", "faulty_peer", "leader", "timeline",
)


def test_faults_bench_json_swarmtrain():
    marker = uuid.uuid4().hex
    argv = [
        sys.executable, "-m", "bench.faults", "--json", "--peers", "3", "--size-mb", "0.25", "--outage-s", "8",
        "--kinds", "sigkill,link_down", "--impls", "swarmtrain", "--back-deadline-s", "20",
        "--round-timeout", "30",
    ]
    env = {**os.environ, "STB_TEST_MARKER": marker}
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=170)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    assert proc.returncode == 0, stderr[-3000:] + stdout[-3000:]
    result = json.loads(stdout)
    assert result["config"]["settings"]["swarmtrain"]["join_timeout_s"] == 15.0
    rows = {r["kind"]: r for r in result["rows"] if r["impl"] == "swarmtrain"}
    assert set(rows) == {"sigkill", "link_down"}

    row = rows["sigkill"]
    assert row["status"] == "ok", row
    assert not set(FIELDS) - set(row), set(FIELDS) - set(row)
    assert row["wrong_results"] == 0, row.get("wrong")
    # the survivors kept averaging (a member killed mid-round costs them that round, ~1 s)
    assert row["rounds_during_outage"] > 0, row["timeline"]
    assert row["faulty_peer"]["role"] == "member" and isinstance(row["target_met"], bool)
    # ours: the leader is the smallest peer id, as its report says
    assert row["leader"]["peer_id"] == min(row["peer_ids"]) == row["leader"]["reported_by_last_healthy_round"]
    assert row["faulty_peer"]["peer_id"] != row["leader"]["peer_id"]
    assert rows["sigkill"]["back_after_s"] is None and rows["sigkill"]["back_note"]
    # no --netns: the link_down row says why it did not run
    assert rows["link_down"]["status"] == "skipped" and rows["link_down"]["reason"]
    assert leftovers(marker) == []


def _rounds(durations: list[float], t0: float = 0.0) -> list:
    from bench.faults import Round

    out, t = [], t0
    for i, d in enumerate(durations):
        ok = d > 0
        out.append(Round(id=i, start=t, peers=[], awaited=set(), deadline=t + 60, end=t + abs(d), ok=ok))
        t += abs(d)
    return out


def _disturbed(kind: str, span: list, healthy: float, outage_end: float, back_at: float | None):
    from bench.faults import FaultRun
    from bench.faults_report import disturbed

    run = object.__new__(FaultRun)  # only the fields `disturbed` reads
    run.kind, run.back_at = kind, back_at
    return disturbed(run, span, healthy, outage_end)


def test_slow_rounds_count_while_the_fault_disturbs_the_rounds_not_after_they_settle():
    # a failed round (negative: not ok), two slow ones, three calm ones, then a noise spike
    span = _rounds([-1.0, 0.9, 0.6, 0.3, 0.3, 0.3, 0.3, 0.9, 0.3])
    inside = _disturbed("sigkill", span, 0.3, outage_end=100.0, back_at=None)
    assert [inside(r) for r in span] == [True, True, True, False, False, False, False, False, False]
    # a frozen peer: after the outage's end (the spike's round starts there) until it is back and
    # the rounds settle again
    spike = span[7]
    again = _disturbed("sigstop_member", span, 0.3, outage_end=spike.start, back_at=spike.start)
    assert again(spike) and not again(span[4])
    # never settling: everything from the fault on counts
    unsettled = _rounds([0.9, 0.3, 0.9, 0.3, 0.9])
    assert all(map(_disturbed("sigkill", unsettled, 0.3, 100.0, None), unsettled))
