"""Byzantine stage servers and expert hosts (`python -m bench.byzantine --role stage|expert`): a
pipeline of two stages (or experts in two shards) with two peers each, one of them answering
with lies (node setting fault_attack), and one trainer whose checks (run setting
audit_fraction) must catch it. Real coordinator, servers and trainer on loopback.

Arms, each its own swarm, the trainer's same data shard, to the same micro-batch count:
    clean      four honest peers, the trainer checking
    attacked   a liar among them, the trainer checking
    unchecked  the liar, the trainer not checking (audit_fraction 0): the defence's worth
Each arm reports the trainer's training loss at the end (the mean of its last reports), who it
banned, and for the liar the seconds from the trainer's first micro-batch to the ban.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from tests.swarm import Swarm, node_peer_id, wait_for

SLOT_ARMS = ("clean", "attacked", "unchecked")
LAST_REPORTS = 4  # the trainer's reports (every 8 micro-batches) its final loss is the mean of

MODES = {
    "stage": ["--mode", "pipeline", "--num-stages", "2", "--model", "tiny", "--batch-size", "4", "--stage-step-samples", "16",
              "--micro-batches-in-flight", "4", "--warmup-steps", "5", "--stage-sync-every-s", "2"],
    "expert": ["--mode", "experts", "--model", "tiny-moe", "--expert-shards", "2", "--batch-size", "4", "--stage-step-samples", "8",
               "--warmup-steps", "5", "--stage-sync-every-s", "2"],
}  # fmt: skip


def _trainer(work: Path) -> dict:
    try:
        return json.loads((work / "t" / "trainer-stats.json").read_text())
    except (OSError, ValueError):
        return {}


def _clock(line: str) -> float | None:
    """Seconds since midnight of a log line's HH:MM:SS."""
    m = re.match(r"(\d\d):(\d\d):(\d\d)", line)
    return int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) if m else None


def ban_times(log: str) -> dict[str, float]:
    """peer id -> when (seconds since midnight) the log first names its ban. Pure."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        if m := re.search(r"banned (\S+) for \d+ s", line):
            out.setdefault(m[1], _clock(line))
    return out


def first_micro_batches(log: str) -> float | None:
    """When (seconds since midnight) the trainer's log first reports micro-batches done. Pure."""
    return next((_clock(line) for line in log.splitlines() if re.search(r"trainer \| \d+ micro-batches", line)), None)


def run_slot_arm(arm: str, args: argparse.Namespace, work: Path) -> dict:
    work.mkdir(parents=True)
    sw = Swarm(work)
    t0 = time.monotonic()
    try:
        audit = args.audit_fraction if arm != "unchecked" else 0.0
        coord = sw.coordinator("coordinator", None, None, *MODES[args.role], "--seed", str(args.seed), "--audit-fraction", str(audit), "--heartbeat-timeout-s", "30")
        maddr = coord.wait_ready(120)["maddrs"][0]
        attack = ["--fault-attack", args.attack] + (["--fault-attack-scale", str(args.scale)] if args.scale else [])
        node = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "1"]
        servers = {f"s{i}": sw.node(f"s{i}", [maddr], *node, *(attack if i == 0 and arm != "clean" else [])) for i in range(4)}
        trainer = sw.node("t", [maddr], *node, "--wanted-role", "trainer", "--shard-index", "0")
        ids = {n: node_peer_id(p) for n, p in servers.items()}
        wait_for(lambda: _trainer(work).get("micro_batches", 0) >= args.micro_batches, args.timeout, f"{args.micro_batches} micro-batches ({arm})")
        st = _trainer(work)
        losses = [e["loss"] for e in st["history"] if e["micro_batches"] <= args.micro_batches][-LAST_REPORTS:]
        log = trainer.log()
        bans, start = ban_times(log), first_micro_batches(log)
        liar = ids["s0"] if arm != "clean" else None
        return {
            "arm": arm, "audit_fraction": audit, "seconds": round(time.monotonic() - t0, 1), "micro_batches": st["micro_batches"],
            "loss": round(sum(losses) / len(losses), 4), "checks": st.get("checks"),
            "caught": ["s0"] if liar in bans else [], "honest_banned": sorted(n for n in servers if ids[n] in bans and ids[n] != liar),
            "seconds_to_ban": (bans[liar] - start) if liar in bans and start is not None else None,
        }  # fmt: skip
    except Exception as e:  # an arm that fails is a row that says why; the others still run
        return {"arm": arm, "status": "failed", "reason": str(e).splitlines()[0][:300]}
    finally:
        sw.close()


def slot_result(rows: list[dict]) -> dict:
    """The arms' comparison: the losses over the clean arm's, and the bans as precision and
    recall against the one liar. Pure."""
    by = {r["arm"]: r for r in rows if "loss" in r}
    out: dict = {"ratios": {f"{a}_loss_over_clean": round(by[a]["loss"] / by["clean"]["loss"], 4) for a in ("attacked", "unchecked") if a in by and "clean" in by}}
    if "attacked" in by:
        a = by["attacked"]
        banned = len(a["caught"]) + len(a["honest_banned"])
        out.update(loss_over_clean=out["ratios"].get("attacked_loss_over_clean"), seconds_to_ban=a["seconds_to_ban"],
                   precision=round(len(a["caught"]) / banned, 3) if banned else 0.0, recall=float(len(a["caught"])))  # fmt: skip
    if "clean" in by:
        out["honest_banned"] = by["clean"]["honest_banned"]
    return out
