"""What bench/faults.py reports of one fault run (a `FaultRun`): which peer the fault hits, and
the run's row — time lost and its parts, rounds, wrong results, the faulty peer's rounds, the
timeline."""

from __future__ import annotations

import itertools
import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.faults import FaultRun, Round

LEAD_S = 0.02  # a round starts this long after its command is sent (every peer at the same time)
SETTLED = 3  # successful rounds in a row, each within 1.5 x healthy, that end the fault's disturbance


def pick_faulty(run: FaultRun, row: dict, last: Round) -> None:
    """Which peer the fault hits: the leader (sigstop_leader), else the member with the largest
    id that does not lead; row gets the peer ids, the faulty peer and the leader."""
    leaders = [r.get("leader") for r in last.replies.values() if r.get("leader")]
    leader = reported = statistics.mode(leaders) if leaders else None
    if run.impl == "swarmtrain":
        if leader != min(run.ids):
            run.notes.append(f"the last healthy round's leader {str(leader)[-8:]} is not the smallest peer id")
        leader = min(run.ids)
    elif leader is None:
        run.notes.append("hivemind did not tell its leader: a member chosen as for ours (smallest peer id) is stopped")
        leader = min(run.ids)
    else:
        seen = {r2.get("leader") for r in run.healthy for r2 in r.replies.values() if r2.get("leader")}
        run.notes.append(f"hivemind has no fixed leader (whoever declared first); {len(seen)} different leader(s) "
                          f"in {len(run.healthy)} healthy rounds; the last one's is the one faulted")
    lead = run.ids.index(leader) if leader in run.ids else 0
    if run.kind == "sigstop_leader":
        run.faulty = lead
    else:
        run.faulty = max((i for i in range(run.n) if i != lead), key=lambda i: run.ids[i])
    row["peer_ids"] = run.ids
    row["faulty_peer"] = {"rank": run.faulty, "peer_id": run.ids[run.faulty], "role": "leader" if run.faulty == lead else "member"}
    row["leader"] = {"rank": lead, "peer_id": leader, "reported_by_last_healthy_round": reported}

def disturbed(run: FaultRun, span: list[Round], healthy: float, outage_end: float):
    """Whether a round of `span` falls while the fault disturbs the rounds: from the fault
    until the survivors run SETTLED successful rounds in a row, each within 1.5 x healthy;
    and (frozen, cut off) from the outage's end until, after the faulty peer is back, they
    do so again. Outside, a slow round is the machine's noise, not the fault's cost."""

    def settled_after(t: float) -> float:
        calm = [r for r in span if r.start >= t]
        for i in range(len(calm) - SETTLED + 1):
            if all(r.ok and r.end - r.start <= 1.5 * healthy for r in calm[i : i + SETTLED]):
                return calm[i].start
        return math.inf

    start = span[0].start if span else math.inf
    windows = [(start, settled_after(start))]
    if run.kind != "sigkill":
        windows.append((outage_end, settled_after(run.back_at) if run.back_at is not None else math.inf))
    return lambda r: any(a <= r.start < b for a, b in windows)


def fill(run: FaultRun, row: dict) -> None:
    """The row of a fault run: time lost and its parts, rounds, wrong results, when the faulty
    peer was back, its rounds, the timeline."""
    a, healthy = run.args, row["healthy_round_s"]
    tol = a.tolerance
    span_start = run.fault_round.start if run.fault_round is not None else run.fault_start
    span = [r for r in run.rounds if r.start >= span_start and r.ok is not None]
    outage_end = run.fault_start + a.outage_s
    ok = [r for r in span if r.ok]
    end = max(r.end for r in span) if span else run.fault_start
    # failed rounds whole, successful ones beyond healthy_round_s while the fault disturbs
    # the rounds, and time no round ran (beyond this process's usual gap between rounds). A
    # round faster than healthy (fewer peers, a frozen peer's CPU free) earns nothing back:
    # `time_lost_net_s` would let it.
    gap = statistics.median(y.start - x.end for x, y in itertools.pairwise(run.healthy)) if len(run.healthy) > 1 else 0.0
    idle = sum(max(0.0, y.start - x.end - gap) for x, y in itertools.pairwise(span))
    failed_s = sum(r.end - r.start for r in span if not r.ok)
    in_disturbance = disturbed(run, span, healthy, outage_end)
    slow_s = sum(max(0.0, r.end - r.start - healthy) for r in ok if in_disturbance(r))
    # the rest: rounds slower than healthy once the survivors were back to steady rounds, as
    # rounds without a fault have them on a loaded machine (shown, not counted)
    steady_s = sum(max(0.0, r.end - r.start - healthy) for r in ok if not in_disturbance(r))
    lost = failed_s + slow_s + idle
    first = run.fault_round or next((r for r in span if r.start >= run.fault_start), None)
    after = next((r for r in span if r.start >= run.fault_start), None)
    wrong, worst = wrong_results(run, tol, span_start)
    row.update(
        fault_offset_s=round(run.fault_start - (run.fault_round.start + LEAD_S), 3) if run.fault_round else None,
        fault_landed=(f"in a round (planned into {run.plans} round(s))" if run.fault_round else "between rounds"),
        outage_s=a.outage_s,
        rounds_during_outage=sum(1 for r in ok if run.fault_start <= r.end <= outage_end),
        rounds_started_during_outage=sum(1 for r in span if run.fault_start <= r.start < outage_end),
        rounds_after_outage=sum(1 for r in span if r.start >= outage_end),
        rounds_ok=len(ok),
        rounds_failed=len(span) - len(ok),
        time_lost_s=round(lost, 3),
        time_lost_parts_s={"failed_rounds": round(failed_s, 3), "slow_rounds": round(slow_s, 3), "idle": round(idle, 3)},
        slow_rounds_steady_s=round(steady_s, 3),
        time_lost_net_s=round((end - span_start) - len(ok) * healthy, 3),
        first_round_s=round(first.end - first.start, 3) if first else None,
        first_round_ok=first.ok if first else None,
        next_round_s=round(after.end - after.start, 3) if after and after is not first else None,
        wrong_results=len(wrong),
        max_abs_error=worst,
        back_after_s=round(run.back_at - run.fault_end, 3) if run.back_at is not None else None,
        target_met=lost <= 2 * healthy + 1.0,
    )
    _faulty_peer_part(run, row, wrong, span, ok, span_start)


def _faulty_peer_part(run: FaultRun, row: dict, wrong: list[dict], span: list[Round], ok: list[Round], span_start: float) -> None:
    """The row's rest: the link's recovery, wrong results, when and how the faulty peer was back,
    its rounds, the survivors' groups, the errors, the timeline."""
    a = run.args
    if run.link_probe is not None:
        try:
            out = run.link_probe.communicate(timeout=35)[0].strip()
        except Exception:  # (it stops itself within 30 s)
            run.link_probe.kill()
            out = ""
        row["link_usable_after_s"] = float(out) if out else None  # the network's own recovery, see _probe_link
    if wrong:
        row["wrong"] = wrong[:10]
    if run.kind == "sigkill":
        row["back_note"] = "killed: stays dead"
    elif run.back_at is None:
        row["back_note"] = f"the faulty peer did not complete a round with all the others within {a.back_deadline_s:.0f} s of the fault's end"
    faulty_answer = run.fault_round and (run.fault_round.replies.get(run.faulty) or run.fault_round.errors.get(run.faulty))
    if faulty_answer:
        row["faulty_peer"]["fault_round_answer"] = "ok" if isinstance(faulty_answer, dict) else faulty_answer[:300]
    # the faulty peer's rounds from the fault round on: [round, start, answered (s after the
    # fault's start), "ok" or the error, its group size, its result's max abs error]
    row["faulty_rounds"] = [
        [r.id, round(r.start - run.fault_start, 2), round(r.answered[run.faulty] - run.fault_start, 2),
         "ok" if (rep := r.replies.get(run.faulty)) else r.errors.get(run.faulty, "")[:200],
         len((rep or {}).get("members") or (rep or {}).get("group") or ()),
         min(((rep or {}).get("errors") or {}).values(), default=None)]
        for r in run.rounds if r.start >= span_start and run.faulty in r.answered
    ]
    row["survivors_group_sizes"] = sorted({min(len(rep.get("members") or rep.get("group") or ()) for rep in r.replies.values()) for r in ok})
    row["errors"] = dict(sorted(run.error_counts.items(), key=lambda kv: -kv[1])[:8])
    # the rounds from the fault round on (the first `--timeline`): [start after the fault (s),
    # seconds, ok, smallest group]
    row["timeline"] = [
        [round(r.start - run.fault_start, 2), round(r.end - r.start, 2), r.ok,
         min((len(rep.get("members") or rep.get("group") or ()) for rep in r.replies.values()), default=0)]
        for r in span[: a.timeline]
    ]


def wrong_results(run: FaultRun, tol: float, span_start: float) -> tuple[list[dict], float]:
    """Results off the exact mean by more than `tol` (which round, when, which peer), the largest
    error of any result; every round's errors counted into run.error_counts."""
    wrong, worst = [], 0.0
    for r in run.rounds:
        for i, rep in r.replies.items():
            errs = rep.get("errors") or {}
            err = errs["members"] if "members" in errs else min(errs.values(), default=float("nan"))
            worst = max(worst, err)
            if not err <= tol:
                when = "healthy" if r.start < span_start else "fault round" if r is run.fault_round else "after the fault's start"
                wrong.append({"round": r.id, "when": when, "peer": i, "max_abs_error": err, "errors": errs,
                              "group_size": len(rep.get("group") or ()), "blocks": rep.get("blocks")})
        for e in r.errors.values():
            key = e[:160]
            run.error_counts[key] = run.error_counts.get(key, 0) + 1
    return wrong, worst
