"""The soak: a swarm trained for a long time with a fault every few minutes, every process's
resident memory, open files and threads and every data directory's disk use sampled all along.
Real coordinator and node daemons on loopback (tests/swarm.py).

    python -m bench.soak --json --mode replicas --minutes 120 --fault-every-s 120 --against-clean

Swarms (`--mode`): `--replicas` replicas; or a pipeline of two stages, or experts in two shards,
each slot with two peers, and a trainer (the settings of bench/byzantine_slots.py). Faults, in
turn, each on a replica or a slot's peer drawn at random (never two at once):
    kill      SIGKILL, and the node started again on its data directory 10 s later
    stop      SIGSTOP for `--outage-s`, then SIGCONT (a closed lid)
    link      its p2pd alone stopped for `--outage-s`: the daemon runs, its link is down

The summary per kind of process (coordinator, replica, server, trainer): the most one process
grew in resident memory from the end of the warm-up (`--warmup-minutes`) to the end, the most
open files and threads; the most disk a data directory used; the rounds whose peers recorded
more than one hash (`split`: a failed round returned as a success); the loss curve (replicas:
validation loss against the inner steps averaged in; slots: the trainer's loss against its
micro-batches). With `--against-clean`, a second swarm of the same settings runs alongside
without faults (the machine's load falls on both alike), and the faulted swarm's loss is
compared with the clean one's at equal samples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.byzantine_slots import MODES as SLOT_MODES
from bench.flood import _proc_sample
from bench.soak_record import Record, loss_at_equal_samples, summarize

FAULTS = ("kill", "stop", "link")
MODES = ("replicas", "pipeline", "experts")
STOP = threading.Event()  # set on ctrl-c or SIGTERM: every arm's loop ends and stops its swarm


def _disk_mib(path: Path) -> float:
    """MiB of the files under `path` now. The node prunes old checkpoints while we count: a file
    or folder gone on the way counts as gone (it crashed a two-hour soak after 35 minutes)."""
    total = 0
    for folder, _, files in os.walk(path):  # (a folder that vanished is skipped by os.walk)
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, f), follow_symlinks=False).st_size
    return round(total / (1 << 20), 1)


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


def _swarm(args: argparse.Namespace, sw) -> tuple[object, dict[str, Callable[[], object]], list[str]]:
    """The coordinator of `args.mode`, and how to start each node (again, after a kill): (the
    coordinator, name -> start, the names faults fall on)."""
    beat = ["--threads", "1", "--heartbeat-interval-s", "1"]
    if args.mode == "replicas":
        runcfg = ["--model", "tiny", "--inner-steps", str(args.inner_steps), "--checkpoint-every", "5", "--eval-batches", "2", "--min-replicas", "2"]
        names = [f"r{i}" for i in range(args.replicas)]
        extra = {n: ["--num-shards", str(args.replicas), "--shard-index", str(i)] for i, n in enumerate(names)}
        victims = names
    else:  # two stages or two expert shards, two peers each (bench/byzantine_slots.py), and a trainer
        runcfg = [*SLOT_MODES["stage" if args.mode == "pipeline" else "expert"], "--checkpoint-every", "5"]
        victims = [f"s{i}" for i in range(4)]
        names = [*victims, "t"]
        extra = {**{n: ["--bandwidth-mbps", "1000"] for n in victims}, "t": ["--bandwidth-mbps", "1000", "--wanted-role", "trainer", "--shard-index", "0"]}
    coord = sw.coordinator("coordinator", None, None, *runcfg, "--heartbeat-timeout-s", "15", "--seed", str(args.seed))
    maddr = coord.wait_ready(120)["maddrs"][0]
    return coord, {n: (lambda n=n: sw.node(n, [maddr], *beat, *extra[n])) for n in names}, victims


def _fault(kind: str, proc, start: Callable[[], object], outage_s: float):
    """Take one fault on a node: the process serving it afterwards."""
    if kind == "kill":
        proc.kill()
        STOP.wait(10)
        return start()
    pids = proc.leftovers() if kind == "stop" else _p2pd(proc.leftovers())
    for pid in pids:
        subprocess.run(["kill", "-STOP", str(pid)], check=False)
    STOP.wait(outage_s)
    for pid in pids:
        subprocess.run(["kill", "-CONT", str(pid)], check=False)
    return proc


def run(args: argparse.Namespace, work: Path, faults_on: bool = True) -> dict:
    from tests.swarm import Swarm, node_peer_id

    rng = random.Random(args.seed)
    work.mkdir(parents=True, exist_ok=True)
    sw = Swarm(work)
    try:
        coord, start, victims = _swarm(args, sw)
        procs = {n: go() for n, go in start.items()}
        for p in procs.values():
            node_peer_id(p)
        record = Record()
        t0, samples, faults, next_fault, k = time.monotonic(), [], [], time.monotonic() + args.fault_every_s, 0
        while (now := time.monotonic()) - t0 < args.minutes * 60 and not STOP.is_set():
            samples.append({"t": round(now - t0, 1), "procs": {"coordinator": _proc_sample(coord.proc.leftovers()),
                            **{n: _proc_sample(p.leftovers()) for n, p in procs.items()}},
                            "disk": {n: _disk_mib(work / n) for n in ["coordinator", *procs]}})  # fmt: skip
            for n in procs:
                record.read(work, n)
            if faults_on and now >= next_fault:
                kind, victim = args.faults[k % len(args.faults)], rng.choice(victims)
                faults.append({"t": round(now - t0, 1), "fault": kind, "node": victim})
                k += 1
                procs[victim] = _fault(kind, procs[victim], start[victim], args.outage_s)
                next_fault = time.monotonic() + args.fault_every_s
            STOP.wait(args.sample_s)
        if STOP.is_set():
            raise KeyboardInterrupt
        for n in procs:
            record.read(work, n)
        return {
            "mode": args.mode, "minutes": args.minutes, "faults": faults, **record.progress(),
            "split": record.split(), "loss_curve": record.loss_curve(), **summarize(samples, args.warmup_minutes * 60),
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
    result["clean"] = {k: v for k, v in clean.items() if k in ("outer_steps", "micro_batches", "split", "loss_curve")}
    result["loss_over_clean_at_equal_samples"] = loss_at_equal_samples(result["loss_curve"], clean["loss_curve"])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--minutes", type=float, default=120.0)
    p.add_argument("--warmup-minutes", type=float, default=10.0, help="memory growth counts from here")
    p.add_argument("--fault-every-s", type=float, default=120.0)
    p.add_argument("--outage-s", type=float, default=30.0, help="how long a stop or a link fault lasts")
    p.add_argument("--mode", choices=MODES, default="replicas", help="the swarm: replicas, or two stages or two expert shards of two peers each and a trainer")
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
    return 0 if not result["split"] and not result.get("clean", {}).get("split") else 1


if __name__ == "__main__":
    sys.exit(main())
