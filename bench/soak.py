"""The soak: a replica swarm trained for a long time with a fault every few minutes, every
process's resident memory, open files and threads and every data directory's disk use sampled
all along. Real coordinator and replica daemons on loopback (tests/swarm.py).

    python -m bench.soak --json --minutes 120 --fault-every-s 120 --replicas 4 --against-clean

Faults, in turn, each on a replica drawn at random (never two at once):
    kill      SIGKILL, and the replica started again on its data directory 10 s later
    stop      SIGSTOP for `--outage-s`, then SIGCONT (a closed lid)
    link      its p2pd alone stopped for `--outage-s`: the daemon runs, its link is down

The summary per process kind (coordinator, replica): the most one process grew in resident
memory from the end of the warm-up (`--warmup-minutes`) to the end, the most open files and
threads; the most disk a data directory used; the outer steps taken and whether the replicas held one hash at every step
more than one of them recorded. With `--against-clean`, a second swarm of the same settings runs
alongside without faults (the machine's load falls on both alike), and the faulted swarm's
validation loss is compared with the clean one's at equal samples.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.flood import _history, _proc_sample

FAULTS = ("kill", "stop", "link")
STOP = threading.Event()  # set on ctrl-c or SIGTERM: every arm's loop ends and stops its swarm


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


def loss_curve(histories: list[list[dict]]) -> list[tuple[int, float]]:
    """(inner steps trained into the shared state so far, summed over replicas; the validation
    loss after that outer step) for every outer step some replica averaged. Pure. A round's
    samples count once it is averaged: work lost to a failed round or a kill is not counted."""
    by_step: dict[int, list[dict]] = {}
    for h in histories:
        for e in h:
            if "start" not in e and "caught_up_from" not in e and "val_loss" in e:
                by_step.setdefault(e["outer_step"], []).append(e)
    curve, total = [], 0
    for k in sorted(by_step):
        total += sum(e.get("inner_steps", 0) for e in by_step[k])
        curve.append((total, sum(e["val_loss"] for e in by_step[k]) / len(by_step[k])))
    return curve


def loss_at_equal_samples(faulted: list[tuple[int, float]], clean: list[tuple[int, float]]) -> float | None:
    """The faulted swarm's loss over the clean one's at the same samples (the clean curve
    interpolated), the mean over the second half of the faulted curve where the clean one
    reaches (one point's validation loss is noisy). Pure; None where they do not overlap."""
    ratios = []
    for n, loss in faulted[len(faulted) // 2 :]:
        below = [(m, v) for m, v in clean if m <= n]
        above = [(m, v) for m, v in clean if m >= n]
        if not below or not above:
            continue
        (m0, v0), (m1, v1) = below[-1], above[0]
        ref = v0 if m1 == m0 else v0 + (v1 - v0) * (n - m0) / (m1 - m0)
        ratios.append(loss / ref)
    return round(sum(ratios) / len(ratios), 4) if ratios else None


def run(args: argparse.Namespace, work: Path, faults_on: bool = True) -> dict:
    from tests.swarm import Swarm, node_peer_id, wait_for

    rng = random.Random(args.seed)
    work.mkdir(parents=True, exist_ok=True)
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
        while (now := time.monotonic()) - t0 < args.minutes * 60 and not STOP.is_set():
            samples.append({"t": round(now - t0, 1), "procs": {"coordinator": _proc_sample(coord.proc.leftovers()),
                            **{n: _proc_sample(p.leftovers()) for n, p in procs.items()}},
                            "disk": {n: _disk_mib(work / n) for n in ["coordinator", *names]}})  # fmt: skip
            if faults_on and now >= next_fault:
                kind, victim = args.faults[k % len(args.faults)], rng.choice(names)
                faults.append({"t": round(now - t0, 1), "fault": kind, "replica": victim})
                k += 1
                if kind == "kill":
                    procs[victim].kill()
                    STOP.wait(10)
                    procs[victim] = node(victim, names.index(victim))
                else:
                    pids = procs[victim].leftovers() if kind == "stop" else _p2pd(procs[victim].leftovers())
                    for pid in pids:
                        subprocess.run(["kill", "-STOP", str(pid)], check=False)
                    STOP.wait(args.outage_s)
                    for pid in pids:
                        subprocess.run(["kill", "-CONT", str(pid)], check=False)
                next_fault = time.monotonic() + args.fault_every_s
            STOP.wait(args.sample_s)
        if STOP.is_set():
            raise KeyboardInterrupt
        wait_for(lambda: all(_history(work, n) for n in names), 60, "every replica's history")
        hashes = {n: {e["outer_step"]: e["state_hash"] for e in _history(work, n) if "start" not in e} for n in names}
        shared = [s for s in set().union(*hashes.values()) if sum(s in h for h in hashes.values()) > 1]
        split = sorted(s for s in shared if len({h[s] for h in hashes.values() if s in h}) > 1)
        return {
            "minutes": args.minutes, "replicas": args.replicas, "faults": faults,
            "outer_steps": max(max(h, default=0) for h in hashes.values()), "steps_with_two_hashes": split,
            "loss_curve": loss_curve([_history(work, n) for n in names]),
            **summarize(samples, args.warmup_minutes * 60),
        }  # fmt: skip
    finally:
        sw.close()


def both(args: argparse.Namespace, work: Path) -> dict:
    """The faulted swarm and a clean one side by side, each in a thread of its own: the faulted
    one's result, the clean one's loss curve and outer steps, the loss at equal samples."""
    out: dict[str, dict] = {}
    errors: list[BaseException] = []

    def arm(name: str, faults_on: bool) -> None:
        try:
            out[name] = run(args, work / name, faults_on)
        except BaseException as e:  # noqa: BLE001 (raised again below, in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=arm, args=a, daemon=True) for a in (("faulted", True), ("clean", False))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(1.0)  # (a bare join would not let ctrl-c in)
    finally:  # ctrl-c: each arm's loop ends and stops its own swarm
        STOP.set()
        for t in threads:
            t.join(120)
    if errors:
        raise errors[0]
    result, clean = out["faulted"], out["clean"]
    result["clean"] = {k: clean[k] for k in ("outer_steps", "steps_with_two_hashes", "loss_curve")}
    result["loss_over_clean_at_equal_samples"] = loss_at_equal_samples(result["loss_curve"], clean["loss_curve"])
    return result


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
    p.add_argument("--faults", default=",".join(FAULTS), help=f"the faults taken in turn, of {', '.join(FAULTS)}")
    p.add_argument("--against-clean", action="store_true", help="a swarm without faults alongside, to compare the loss with")
    args = p.parse_args(argv)
    args.faults = tuple(f for f in args.faults.split(",") if f)
    if args.replicas < 2 or args.minutes <= 0 or args.fault_every_s <= args.outage_s:
        p.error("--replicas at least 2, --minutes above 0, --fault-every-s above --outage-s")
    if not args.faults or set(args.faults) - set(FAULTS):
        p.error(f"--faults: one or more of {', '.join(FAULTS)}, comma-separated; got {','.join(args.faults) or 'none'}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ctrl-c ends it, even started in the background,
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # and so does a SIGTERM: the swarm is stopped either way
    with tempfile.TemporaryDirectory(prefix="swarmtrain-soak-") as tmp:
        result = both(args, Path(tmp)) if args.against_clean else run(args, Path(tmp))
    print(json.dumps(result, indent=1) if args.json else result)
    return 0 if not result["steps_with_two_hashes"] else 1


if __name__ == "__main__":
    sys.exit(main())
