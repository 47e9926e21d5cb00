"""Overlap: the streaming outer step (fragments, each averaged while the inner steps go on)
against today's (the whole pseudo-gradient averaged while training waits), behind shaped links.

    python -m bench.overlap --json [--fragments 4] [--steps 400] [--rate 100mbit]

Both arms train the same run from the same warm start (bench/convergence.py's: `--warmup-steps`
synchronous steps on one stream, the coordinator's checkpoint 0): a coordinator and `--replicas`
replicas, every process in its own network namespace behind a `rate` link (bench/netns.py), the
convergence bench's settings (small model, H=40, int8, outer lr 1.0, momentum 0.8), `--steps`
inner steps per replica; they differ only in fragments: 1 (today) and `--fragments`. Arms run one
after the other, so they do not compete for the cores.

Reported per arm, from the replicas' own records (replica-stats.json) between the end of their
first outer step and their last (the first holds the start: processes starting, everyone joining):
  utilisation           time in inner steps over wall time, per replica and their mean
  utilisation_no_eval   the same with the evaluation after every outer step left out of the wall
                        time (a bench's evaluation, not training's)
  seconds_per_outer_step, wait_s (time training waited on a fragment's round past its period)
  bytes_per_round       the largest averaging round's bytes of an outer step (what one sync
                        sends at its peak), and bytes_per_outer_step (all its rounds)
  final_val_loss        validation loss of the outer state after the last outer step (every
                        replica at one hash, checked)
and the fragment arm over today's: utilisation, final loss (relative), bytes per round. Root only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.convergence_settings import Settings

NODE = ["--threads", "1", "--heartbeat-interval-s", "1", "--wanted-role", "replica"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _history(work: Path, name: str) -> list[dict]:
    try:
        return json.loads((work / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return []


def _trained(h: list[dict]) -> list[dict]:
    return [e for e in h if "start" not in e and "caught_up_from" not in e and "inner_s" in e]


def replica_summary(h: list[dict], last: int) -> dict:
    """Utilisation and the rest (see the module's docstring) of one replica's history."""
    t = [e for e in _trained(h) if e["outer_step"] <= last]
    if len(t) < 2:
        raise RuntimeError(f"fewer than two outer steps recorded: {[e['outer_step'] for e in h]}")
    a, b = t[0], t[-1]
    wall, inner, ev = b["time"] - a["time"], b["inner_s"] - a["inner_s"], b["eval_s"] - a["eval_s"]
    return {
        "outer_steps": b["outer_step"] - a["outer_step"], "utilisation": round(inner / wall, 4),
        "utilisation_no_eval": round(inner / (wall - ev), 4), "seconds_per_outer_step": round(wall / (b["outer_step"] - a["outer_step"]), 3),
        "wait_s": round(b.get("wait_s", 0.0) - a.get("wait_s", 0.0), 2), "bytes_per_round": max(e["sync_bytes"] for e in t[1:]),
        "bytes_per_outer_step": round((b["bytes_sent"] - a["bytes_sent"]) / (b["outer_step"] - a["outer_step"])),
        "failed_fragments": sum(len(e.get("failed_fragments", [])) for e in t), "members": min(e["members"] for e in t),
    }  # fmt: skip


def run_arm(settings: Settings, fragments: int, warm: dict, rate: str, work: Path, timeout: float) -> dict:
    from bench import netns
    from bench.convergence_swarm import coordinator_args, node_args, write_warm_checkpoint
    from bench.convergence_settings import thread_env
    from tests.swarm import ProcessExited, Swarm, wait_for

    n, last = settings.replicas, settings.outer_steps
    netns.remove_stale()
    topo = netns.Topology.create(n + 1, rate)
    sw = Swarm(work)
    env = {k: v for k, v in thread_env(settings.threads).items() if k.endswith("_NUM_THREADS")}
    swarm_id = f"overlap-{os.getpid()}-{fragments}"
    try:
        write_warm_checkpoint(work / "coordinator", settings, warm["state"])
        args = coordinator_args(settings, work / "coordinator", 0, 0, swarm_id)
        coord = sw.start("coordinator", "swarmtrain-coordinator", *args, "--host-maddrs", f"/ip4/{topo.ip(0)}/tcp/0", "--http", "",
                         "--fragments", str(fragments), "--heartbeat-timeout-s", "30", prefix=topo.wrap(0, []), env=env)  # fmt: skip
        def address():
            if not coord.alive():
                raise ProcessExited(f"the coordinator exited: {coord.log()[-2000:]}")
            return re.search(rf"/ip4/{re.escape(topo.ip(0))}/tcp/\d+/p2p/\w+", coord.log())

        maddr = wait_for(address, 120, "the coordinator's address").group(0)
        names = [f"node{r}" for r in range(n)]
        mbps = str(int(netns.parse_rate(rate) / 1e6))
        for r, name in enumerate(names):
            argv = node_args(settings, work / name, r, maddr, swarm_id)
            sw.start(name, "swarmtrain-node", *argv, *NODE, "--bandwidth-mbps", mbps, "--host-maddrs", f"/ip4/{topo.ip(r + 1)}/tcp/0", prefix=topo.wrap(r + 1, []), env=env)
        t0 = time.monotonic()
        reported = [0]

        def done() -> bool:
            steps = min(max((e["outer_step"] for e in _history(work, name)), default=-1) for name in names)
            if steps > reported[0]:
                reported[0] = steps
                log(f"[fragments={fragments}] outer step {steps}/{last} on every replica ({time.monotonic() - t0:.0f} s)")
            for p in sw.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.log()[-3000:]}")
            return steps >= last

        wait_for(done, timeout, f"{last} outer steps on every replica", interval=1.0)
        histories = {name: _history(work, name) for name in names}
        at_last = {name: next(e for e in h if e["outer_step"] == last) for name, h in histories.items()}
        hashes = {e["state_hash"] for e in at_last.values()}
        if len(hashes) != 1:
            raise RuntimeError(f"the replicas disagree at outer step {last}: {sorted(hashes)}")
        per = {name: replica_summary(h, last) for name, h in histories.items()}
        val = next((e["val_loss"] for e in at_last.values() if "val_loss" in e), None)
        mean = {k: round(sum(p[k] for p in per.values()) / n, 4) for k in ("utilisation", "utilisation_no_eval", "seconds_per_outer_step", "wait_s")}
        return {"fragments": fragments, "final_val_loss": val, "state_hash": hashes.pop(), **mean,
                "bytes_per_round": max(p["bytes_per_round"] for p in per.values()),
                "bytes_per_outer_step": max(p["bytes_per_outer_step"] for p in per.values()), "replicas": per,
                "wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    finally:
        orphans = sw.close()
        topo.destroy()
        if orphans:
            log(f"[fragments={fragments}] left behind: {orphans}")


def main(argv=None) -> int:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="(the output is JSON either way)")
    p.add_argument("--fragments", type=int, default=4, help="fragments of the streaming arm (default 4)")
    p.add_argument("--steps", type=int, default=400, help="inner steps per replica after the warm start (default 400)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help=f"synchronous warm-start steps (default {d.warmup_steps})")
    p.add_argument("--inner-steps", type=int, default=d.inner_steps, help=f"H (default {d.inner_steps})")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--rate", default="100mbit", help="every peer's link, both ways (tc tbf)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds an arm may take")
    p.add_argument("--out", metavar="DIR", help="keep the warm start and the arms' logs here (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    from bench import netns

    try:
        settings = Settings(preset=args.preset, steps=args.steps, warmup_steps=args.warmup_steps, inner_steps=args.inner_steps,
                            sparse_inner_steps=args.inner_steps, replicas=args.replicas, eval_batches=args.eval_batches)  # fmt: skip (no sparse arm here)
        if not 2 <= args.fragments <= settings.inner_steps:
            raise ValueError(f"--fragments must be in 2..{settings.inner_steps} (H), got {args.fragments}")
        netns.check_available()
    except (ValueError, netns.NetnsUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from bench.convergence import warm_start
    from bench.convergence_settings import set_threads
    from node.models.data import load_corpus

    set_threads(settings.threads)  # the warm start's, in this process: the replicas get theirs by flag

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    try:
        warm = warm_start(settings, load_corpus(), out)
        for fragments in (1, args.fragments):
            arm = f"fragments_{fragments}"
            work = out / arm
            shutil.rmtree(work, ignore_errors=True)
            try:
                rows[arm] = {"status": "ok", **run_arm(settings, fragments, warm, args.rate, work, args.timeout)}
            except Exception as e:  # one arm failing must not hide the other's result
                rows[arm] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            log(json.dumps({arm: {k: v for k, v in rows[arm].items() if k != "replicas"}}))
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    compared = {}
    base, streamed = rows.get("fragments_1", {}), rows.get(f"fragments_{args.fragments}", {})
    if base.get("status") == streamed.get("status") == "ok":
        compared = {
            "utilisation": [base["utilisation"], streamed["utilisation"]],
            "utilisation_no_eval": [base["utilisation_no_eval"], streamed["utilisation_no_eval"]],
            "final_val_loss_rel": round(streamed["final_val_loss"] / base["final_val_loss"] - 1, 5),
            "bytes_per_round_ratio": round(base["bytes_per_round"] / streamed["bytes_per_round"], 3),
            "seconds_per_outer_step_ratio": round(streamed["seconds_per_outer_step"] / base["seconds_per_outer_step"], 3),
        }  # fmt: skip
    settings_out = {**settings.to_dict(), "fragments": args.fragments, "rate": args.rate, "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    print(json.dumps({"settings": settings_out, "warm_start_val_loss": warm["val_loss"], "arms": rows, "compared": compared}, indent=1))
    return 0 if all(r["status"] == "ok" for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
