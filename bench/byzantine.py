"""Byzantine replicas: a swarm of M replicas of which N lie in every round (node setting
fault_attack), against the same swarm with nobody lying, and against the liars with the plain
mean (the defence's worth). Real coordinator and replica daemons on loopback (tests/swarm.py).

    python -m bench.byzantine --json --attack sign-flip --attackers 1 --replicas 4 --seed 0
    python -m bench.byzantine --json --role stage --attack noise     (bench/byzantine_slots.py)

Arms, each its own swarm, the same outer steps (so the honest replicas train equal samples):
    clean     M honest replicas, the robust aggregator (--aggregator, default centered_clip)
    attacked  M - N honest, N liars, the robust aggregator
    mean      M - N honest, N liars, the plain mean
Each arm reports the honest replicas' validation loss at the last outer step, who banned whom
(from the honest replicas' logs), and the bans' precision and recall against the liars: a liar
counts as caught when a majority of the honest replicas banned it. An arm whose honest loss
goes past DERAILED times where it started, or stops being a number, is stopped there and
reported derailed (the plain mean's arm, mostly: its rounds then take the join timeout each).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from node.config import ANSWER_ATTACKS, REPLICA_ATTACKS
from tests.swarm import Swarm, node_peer_id, wait_for

from .byzantine_slots import SLOT_ARMS, run_slot_arm, slot_result

ARMS = ("clean", "attacked", "mean")
DERAILED = 10.0  # an honest validation loss this many times its first one


def _history(work: Path, name: str) -> list[dict]:
    try:
        return json.loads((work / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return []


def _step(work: Path, name: str) -> int:
    h = _history(work, name)
    return h[-1]["outer_step"] if h else -1


def _derailed(work: Path, names: list[str]) -> dict | None:
    """The first honest replica whose validation loss went past DERAILED times its first one,
    or is not a number: where and how far (None: none did)."""
    for n in names:
        losses = [(e["outer_step"], e["val_loss"]) for e in _history(work, n) if "val_loss" in e]
        for step, loss in losses[1:]:
            if not (loss is not None and math.isfinite(loss) and loss < DERAILED * losses[0][1]):
                return {"derailed_at_step": step, "derailed_val_loss": loss if loss is None or math.isfinite(loss) else str(loss)}
    return None


def ban_scores(bans: dict[str, set[str]], liars: set[str], honest: set[str]) -> dict:
    """Precision and recall of the bans against `liars`. `bans`: honest replica -> the peers it
    banned. A peer is caught when a majority of the honest replicas banned it. Pure."""
    votes = {p: sum(p in b for b in bans.values()) for p in set().union(*bans.values())} if bans else {}
    caught = {p for p, n in votes.items() if n > len(bans) / 2}
    return {
        "caught": sorted(caught),
        "precision": round(len(caught & liars) / len(caught), 3) if caught else (1.0 if not liars else 0.0),
        "recall": round(len(caught & liars) / len(liars), 3) if liars else 1.0,
        "honest_banned": sorted(set(votes) & honest),  # by any honest replica, majority or not
    }


def run_arm(arm: str, args: argparse.Namespace, work: Path) -> dict:
    """One swarm to its last outer step: the honest replicas' loss there, and the bans."""
    work.mkdir(parents=True)
    liars = 0 if arm == "clean" else args.attackers
    aggregator = "mean" if arm == "mean" else args.aggregator
    sw = Swarm(work)
    t0 = time.monotonic()
    try:
        run = ["--model", "tiny", "--inner-steps", str(args.inner_steps), "--max-outer-steps", str(args.outer_steps), "--min-replicas", str(args.replicas),
               "--checkpoint-every", "100000", "--eval-batches", "4", "--warmup-steps", "5", "--join-timeout-s", "15", "--heartbeat-timeout-s", "60",
               "--seed", str(args.seed)]  # fmt: skip
        coord = sw.coordinator("coordinator", None, None, *run)
        maddr = coord.wait_ready(120)["maddrs"][0]
        names = [f"r{i}" for i in range(args.replicas)]
        attack = ["--fault-attack", args.attack] + (["--fault-attack-scale", str(args.scale)] if args.scale else [])
        node = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "1", "--num-shards", str(args.replicas), "--aggregator", aggregator]
        procs = {n: sw.node(n, [maddr], *node, "--shard-index", str(i), *(attack if i >= args.replicas - liars else [])) for i, n in enumerate(names)}
        ids = {n: node_peer_id(p) for n, p in procs.items()}
        honest = names[: args.replicas - liars]
        wait_for(lambda: min(_step(work, n) for n in honest) >= args.outer_steps or _derailed(work, honest), args.timeout,
                 f"{args.outer_steps} outer steps of the honest replicas ({arm})")  # fmt: skip
        if derailed := _derailed(work, honest):
            return {"arm": arm, "aggregator": aggregator, "liars": liars, "status": "derailed", "seconds": round(time.monotonic() - t0, 1), **derailed}
        bans = {n: set(re.findall(r"banned (\S+) for \d+ s", procs[n].log())) for n in honest}
        last = {n: next(e for e in reversed(_history(work, n)) if "val_loss" in e) for n in honest}
        row = {
            "arm": arm, "aggregator": aggregator, "liars": liars, "seconds": round(time.monotonic() - t0, 1),
            "val_loss": round(sum(e["val_loss"] for e in last.values()) / len(last), 4),
            "hashes_at_end": len({e["state_hash"] for e in last.values()}),
            **ban_scores(bans, {ids[n] for n in names[len(honest):]}, {ids[n] for n in honest}),
        }  # fmt: skip
        row["honest_banned"] = [n for n in honest if ids[n] in row["honest_banned"]]
        row["caught"] = [n for n in names if ids[n] in row["caught"]]
        return row
    except Exception as e:  # an arm that fails is a row that says why; the others still run
        return {"arm": arm, "status": "failed", "reason": str(e).splitlines()[0][:300]}
    finally:
        sw.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.byzantine", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--role", choices=("replica", "stage", "expert"), default="replica", help="whose lies: replicas', or one stage server's or expert host's of two")
    p.add_argument("--attack", choices=sorted(set(REPLICA_ATTACKS) | set(ANSWER_ATTACKS)), default=None, help=f"replicas: {', '.join(REPLICA_ATTACKS)} (default sign-flip); stage, expert: {', '.join(ANSWER_ATTACKS)} (default noise)")
    p.add_argument("--audit-fraction", type=float, default=0.05, help="stage, expert: the trainer's checked fraction of calls")
    p.add_argument("--micro-batches", type=int, default=400, help="stage, expert: each arm's trainer's micro-batches")
    p.add_argument("--attackers", type=int, default=1)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=0.0, help="the attack's strength (0: its default)")
    p.add_argument("--aggregator", choices=("centered_clip", "trimmed_mean"), default="centered_clip")
    p.add_argument("--outer-steps", type=int, default=12)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--arms", help=f"comma-separated, of {', '.join(ARMS)} (replicas) or {', '.join(SLOT_ARMS)} (stage, expert); default: all")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds an arm may take")
    p.set_defaults(arms=None)
    args = p.parse_args(argv)
    known = ARMS if args.role == "replica" else SLOT_ARMS
    kinds = REPLICA_ATTACKS if args.role == "replica" else ANSWER_ATTACKS
    args.attack = args.attack or kinds[0 if args.role == "replica" else 1]
    if args.attack not in kinds:
        p.error(f"--attack {args.attack}: a {args.role}'s attacks are {', '.join(kinds)}")
    arms = (args.arms or ",".join(known)).split(",")
    if bad := [a for a in arms if a not in known]:
        p.error(f"--arms: unknown {', '.join(bad)}; known: {', '.join(known)}")
    if not 0 <= args.attackers < args.replicas or args.replicas - args.attackers < 2:
        p.error("--attackers must leave at least two honest replicas of --replicas")
    if args.outer_steps < 1 or args.inner_steps < 1:
        p.error("--outer-steps and --inner-steps must be at least 1")
    args.arms = arms
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ctrl-c or SIGTERM, even started in the background:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the arm's swarm is stopped, nothing left behind
    work = Path(tempfile.mkdtemp(prefix="stb-byzantine-"))
    if args.role != "replica":
        rows = [run_slot_arm(a, args, work / a) for a in args.arms]
        result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "arms": rows, **slot_result(rows)}
        print(json.dumps(result, indent=1) if args.json else result)
        return 0 if all("loss" in r for r in rows) else 1
    rows = [run_arm(a, args, work / a) for a in args.arms]
    by = {r["arm"]: r for r in rows if "val_loss" in r}
    ratios = {f"{a}_loss_over_clean": round(by[a]["val_loss"] / by["clean"]["val_loss"], 4) for a in ("attacked", "mean") if a in by and "clean" in by}
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "arms": rows, "ratios": ratios}
    if "attacked" in by:
        result["loss_over_clean"] = ratios.get("attacked_loss_over_clean")
        result["precision"], result["recall"] = by["attacked"]["precision"], by["attacked"]["recall"]
    if "clean" in by:
        result["honest_banned"] = by["clean"]["honest_banned"]
    print(json.dumps(result, indent=1) if args.json else result)
    return 0 if all("val_loss" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
