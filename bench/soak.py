"""The soak: a replica swarm trained for a long time with a fault every few minutes, every
process's resident memory, open files and threads and every data directory's disk use sampled
all along. Real coordinator and replica daemons on loopback (tests/swarm.py).

    python -m bench.soak --json --minutes 120 --fault-every-s 120 --replicas 4

Faults, in turn, each on a replica drawn at random (never two at once):
    kill      SIGKILL, and the replica started again on its data directory 10 s later
    stop      SIGSTOP for `--outage-s`, then SIGCONT (a closed lid)
    link      its p2pd alone stopped for `--outage-s`: the daemon runs, its link is down

The summary per process kind (coordinator, replica): the most one process grew in resident
memory from the end of the warm-up (`--warmup-minutes`) to the end, the most open files and
threads; the most disk a data directory used; the outer steps taken and whether the replicas held one hash at every step
more than one of them recorded.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.flood import _history, _proc_sample

FAULTS = ("kill", "stop", "link")


def _disk_mib(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / (1 << 20), 1) if path.exists() else 0.0


def _p2pd(pids: list[int]) -> list[int]:
    """The p2pd processes among `pids`."""
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
                out.append(pid)
        except OSError:
            continue
    return out


def summarize(samples: list[dict], warmup_s: float) -> dict:
    """Per kind of process: the most any one of them grew in resident memory from the warm-up's
    end to the end (its numbers then and at the end), the most open files and threads any had.
    Pure. (A replica killed and started again after the warm-up is compared across its lives.)"""
    out = {}
    for kind in ("coordinator", "replica"):
        series: dict[str, list[tuple[float, dict]]] = {}
        for s in samples:
            for name, v in s["procs"].items():
                if name.startswith(kind[0]) and v["rss_mib"]:
                    series.setdefault(name, []).append((s["t"], v))
        if not series:
            continue
        growth = {}
        for name, rows in series.items():
            after = [v for t, v in rows if t >= warmup_s] or [v for _, v in rows]
            growth[name] = (after[-1]["rss_mib"] / after[0]["rss_mib"] - 1, after[0]["rss_mib"], after[-1]["rss_mib"])
        worst = max(growth, key=lambda n: growth[n][0])
        rows = [v for r in series.values() for _, v in r]
        out[kind] = {
            "rss_growth": round(growth[worst][0], 3), "rss_mib_after_warmup": growth[worst][1], "rss_mib_at_end": growth[worst][2], "grew_most": worst,
            "open_files_max": max(v["open_files"] for v in rows), "threads_max": max(v["threads"] for v in rows),
        }  # fmt: skip
    out["disk_mib_max"] = max((max(s["disk"].values()) for s in samples if s["disk"]), default=0.0)
    return out


def run(args: argparse.Namespace, work: Path) -> dict:
    from tests.swarm import Swarm, node_peer_id, wait_for

    rng = random.Random(args.seed)
    sw = Swarm(work)
    try:
        runcfg = ["--model", "tiny", "--inner-steps", str(args.inner_steps), "--checkpoint-every", "5", "--eval-batches", "2",
                  "--heartbeat-timeout-s", "15", "--min-replicas", "2"]  # fmt: skip
        coord = sw.coordinator("coordinator", None, None, *runcfg)
        maddr = coord.wait_ready(120)["maddrs"][0]
        names = [f"r{i}" for i in range(args.replicas)]
        node = lambda n, i: sw.node(n, [maddr], "--threads", "1", "--heartbeat-interval-s", "1", "--num-shards", str(args.replicas), "--shard-index", str(i))  # noqa: E731
        procs = {n: node(n, i) for i, n in enumerate(names)}
        for p in procs.values():
            node_peer_id(p)
        t0, samples, faults, next_fault, k = time.monotonic(), [], [], time.monotonic() + args.fault_every_s, 0
        while (now := time.monotonic()) - t0 < args.minutes * 60:
            samples.append({"t": round(now - t0, 1), "procs": {"coordinator": _proc_sample(coord.proc.leftovers()),
                            **{n: _proc_sample(p.leftovers()) for n, p in procs.items()}},
                            "disk": {n: _disk_mib(work / n) for n in ["coordinator", *names]}})  # fmt: skip
            if now >= next_fault:
                kind, victim = FAULTS[k % len(FAULTS)], rng.choice(names)
                faults.append({"t": round(now - t0, 1), "fault": kind, "replica": victim})
                k += 1
                if kind == "kill":
                    procs[victim].kill()
                    time.sleep(10)
                    procs[victim] = node(victim, names.index(victim))
                else:
                    pids = procs[victim].leftovers() if kind == "stop" else _p2pd(procs[victim].leftovers())
                    for pid in pids:
                        subprocess.run(["kill", "-STOP", str(pid)], check=False)
                    time.sleep(args.outage_s)
                    for pid in pids:
                        subprocess.run(["kill", "-CONT", str(pid)], check=False)
                next_fault = time.monotonic() + args.fault_every_s
            time.sleep(args.sample_s)
        wait_for(lambda: all(_history(work, n) for n in names), 60, "every replica's history")
        hashes = {n: {e["outer_step"]: e["state_hash"] for e in _history(work, n) if "start" not in e} for n in names}
        shared = [s for s in set().union(*hashes.values()) if sum(s in h for h in hashes.values()) > 1]
        split = sorted(s for s in shared if len({h[s] for h in hashes.values() if s in h}) > 1)
        return {
            "minutes": args.minutes, "replicas": args.replicas, "faults": faults,
            "outer_steps": max(max(h, default=0) for h in hashes.values()), "steps_with_two_hashes": split,
            **summarize(samples, args.warmup_minutes * 60),
        }  # fmt: skip
    finally:
        sw.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--minutes", type=float, default=120.0)
    p.add_argument("--warmup-minutes", type=float, default=10.0, help="memory growth counts from here")
    p.add_argument("--fault-every-s", type=float, default=120.0)
    p.add_argument("--outage-s", type=float, default=30.0, help="how long a stop or a link fault lasts")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.replicas < 2 or args.minutes <= 0 or args.fault_every_s <= args.outage_s:
        p.error("--replicas at least 2, --minutes above 0, --fault-every-s above --outage-s")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ctrl-c ends it, even started in the background,
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # and so does a SIGTERM: the swarm is stopped either way
    with tempfile.TemporaryDirectory(prefix="swarmtrain-soak-") as tmp:
        result = run(args, Path(tmp))
    print(json.dumps(result, indent=1) if args.json else result)
    return 0 if not result["steps_with_two_hashes"] else 1


if __name__ == "__main__":
    sys.exit(main())
