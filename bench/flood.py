"""Flooding: a stranger's peer floods one replica of a training swarm; what it costs the swarm.
Real coordinator and replica daemons on loopback (tests/swarm.py); the flooder is this module
run as a process of its own, with its own libp2p host (`python -m bench.flood attack ...`).

    python -m bench.flood --json --kind slowloris --replicas 3 --steps 4

Kinds of flood, each from `--concurrency` streams at once, each stream opened again as soon as
it ends:
    streams    a valid call (Ping) on each stream: thousands of streams
    frames     a frame of the largest size a peer accepts, of garbage
    slowloris  a frame's prefix promising a large frame, then a byte a second
    direct     on the direct data plane (plain TCP, the victim's --direct-port): a connection
               that trickles its 16-byte ticket a byte a second

The bench runs the swarm to its second outer step, times `--steps` outer steps without the
flood, then as many with it, against the replica that leads (the smallest peer id), and
reports the honest pace's ratio, the flooded replica's resident memory, open files and threads
(its daemon and its p2pd) at their peak against before, and the flooder's counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

KINDS = ("streams", "frames", "slowloris", "direct")


# ---- the flooder (python -m bench.flood attack)


async def _one_stream(host, target: str, kind: str, going: asyncio.Event, counts: Counter) -> None:
    """One stream of the flood: opened, sent its kind's bytes, its answer read, closed."""
    from node.net.rpc import RPC_PROTOCOL
    from protocol import Decoder, Error, Ping, encode
    from protocol.framing import DEFAULT_MAX_FRAME_SIZE

    try:
        reader, writer = await asyncio.wait_for(host.open_stream(target, RPC_PROTOCOL), 10)
    except Exception:  # refused, or p2pd's limits: the flood goes on
        counts["open_failed"] += 1
        await asyncio.sleep(0.05)
        return
    counts["opened"] += 1
    try:
        if kind == "streams":
            writer.write(encode(Ping()))
        elif kind == "frames":
            writer.write(DEFAULT_MAX_FRAME_SIZE.to_bytes(4, "big"))
            writer.write(b"\xc1" * DEFAULT_MAX_FRAME_SIZE)  # (0xc1: never valid msgpack)
        else:
            writer.write(DEFAULT_MAX_FRAME_SIZE.to_bytes(4, "big"))
        await writer.drain()
        data = b""
        while going.is_set():
            try:
                data = await asyncio.wait_for(reader.read(1 << 16), 1.0)
                break
            except TimeoutError:
                if kind == "slowloris":  # a byte a second, as long as the stream stays open
                    writer.write(b"\xc1")
                    await writer.drain()
        replies = Decoder().feed(data) if data else []
        if not replies:
            counts["closed_unanswered" if going.is_set() else "open_at_end"] += 1
        for r in replies:
            counts[f"error:{r.code}" if isinstance(r, Error) else "answered"] += 1
    except Exception:
        counts["failed"] += 1
    finally:
        writer.close()


async def _one_direct(address: str, going: asyncio.Event, counts: Counter) -> None:
    """One connection of the flood on the direct plane: its ticket a byte a second, until the
    victim closes it (the listener waits HANDSHAKE_S for a ticket, and holds MAX_HANDSHAKES)."""
    host, port = address.rsplit(":", 1)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
    except Exception:
        counts["open_failed"] += 1
        await asyncio.sleep(0.05)
        return
    counts["opened"] += 1
    t0 = time.monotonic()
    try:
        while going.is_set():
            writer.write(b"\xc1")
            await writer.drain()
            try:
                if not await asyncio.wait_for(reader.read(1), 1.0):
                    break  # closed by the victim
            except TimeoutError:
                continue
        else:
            counts["open_at_end"] += 1
            return
        counts["closed_at_once" if time.monotonic() - t0 < 0.5 else "closed_later"] += 1
    except (ConnectionError, OSError):
        counts["closed_at_once" if time.monotonic() - t0 < 0.5 else "closed_later"] += 1
    finally:
        writer.close()


async def attack(target: str, maddrs: list[str], kind: str, seconds: float, concurrency: int, direct: str = "") -> dict:
    """Flood `target` for `seconds` (kind "direct": its direct plane at `direct`, HOST:PORT):
    the counts of what its streams met."""
    from node.net.host import Host, HostConfig
    from protocol import SigningKey

    host = await Host.start(SigningKey.generate(), HostConfig()) if kind != "direct" else None
    counts: Counter = Counter()
    going = asyncio.Event()
    going.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, going.clear)  # (the bench ends the flood: the counts are printed)
    loop.call_later(seconds, going.clear)
    try:
        if host is not None:
            await host.connect(target, maddrs)
        print("flooding", flush=True)  # (the bench times the flooded steps from here)

        async def streams():
            while going.is_set():
                if host is None:
                    await _one_direct(direct, going, counts)
                else:
                    await _one_stream(host, target, kind, going, counts)

        await asyncio.gather(*(streams() for _ in range(concurrency)))
    finally:
        if host is not None:
            await host.shutdown()
    return {"kind": kind, "seconds": seconds, "concurrency": concurrency, **dict(sorted(counts.items()))}


# ---- the bench


def _proc_sample(pids: list[int]) -> dict:
    """Resident memory (MiB), open files and threads of these processes together."""
    rss = fds = threads = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss += int(re.search(r"VmRSS:\s+(\d+)", status)[1]) // 1024
            threads += int(re.search(r"Threads:\s+(\d+)", status)[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, TypeError):
            continue
    return {"rss_mib": rss, "open_files": fds, "threads": threads}


def _peak(samples: list[dict]) -> dict:
    return {k: max(s[k] for s in samples) for k in samples[0]} if samples else {}


def run_bench(args: argparse.Namespace, work: Path) -> dict:
    from tests.swarm import Swarm, free_port, node_peer_id, wait_for

    sw = Swarm(work)
    try:
        run = ["--model", "tiny", "--inner-steps", str(args.inner_steps), "--min-replicas", str(args.replicas), "--checkpoint-every", "100000",
               "--eval-batches", "2", "--warmup-steps", "5", "--heartbeat-timeout-s", "30"]  # fmt: skip
        maddr = sw.coordinator("coordinator", None, None, *run).wait_ready(120)["maddrs"][0]
        names = [f"r{i}" for i in range(args.replicas)]
        ports = {n: free_port() for n in names}
        procs = {n: sw.node(n, [maddr], "--threads", "1", "--heartbeat-interval-s", "1", "--num-shards", str(args.replicas), "--shard-index", str(i),
                            "--direct-port", str(ports[n])) for i, n in enumerate(names)}  # fmt: skip
        ids = {n: node_peer_id(p) for n, p in procs.items()}
        victim = min(names, key=lambda n: ids[n])
        others = [n for n in names if n != victim]
        step = lambda n: (h := _history(work, n)) and h[-1]["outer_step"] or 0  # noqa: E731
        wait_for(lambda: min(step(n) for n in names) >= 2, args.timeout, "two outer steps")

        def timed(flooding: subprocess.Popen | None) -> tuple[float, list[dict]]:
            start, t0, samples = max(step(n) for n in others), time.monotonic(), []
            while min(step(n) for n in others) < start + args.steps:
                samples.append(_proc_sample(procs[victim].leftovers()))
                if time.monotonic() - t0 > args.timeout:
                    raise TimeoutError(f"{args.steps} outer steps took over {args.timeout} s ({'flooded' if flooding else 'clean'})")
                time.sleep(0.5)
            return (time.monotonic() - t0) / args.steps, samples

        clean_s, before = timed(None)
        maddrs = re.search(r"listening on (\S+)", procs[victim].log())[1]
        flooder = subprocess.Popen([sys.executable, "-m", "bench.flood", "attack", "--target", ids[victim], "--maddr", maddrs, "--kind", args.kind,
                                    "--seconds", str(args.timeout), "--concurrency", str(args.concurrency), "--direct", f"127.0.0.1:{ports[victim]}"],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            if flooder.stdout.readline().strip() != "flooding":
                raise RuntimeError(f"the flooder did not start (exit status {flooder.wait(timeout=60)})")
            flooded_s, during = timed(flooder)
        finally:
            flooder.terminate()
            out, _ = flooder.communicate(timeout=60)
        hashes = {n: {e["outer_step"]: e["state_hash"] for e in _history(work, n)} for n in names}
        common = set.intersection(*(set(h) for h in hashes.values()))
        return {
            "kind": args.kind, "replicas": args.replicas, "steps": args.steps,
            "clean_s_per_step": round(clean_s, 2), "flooded_s_per_step": round(flooded_s, 2), "pace_ratio": round(flooded_s / clean_s, 3),
            "victim_before": _peak(before), "victim_peak_flooded": _peak(during),
            "one_hash_at_common_steps": all(len({h[k] for h in hashes.values()}) == 1 for k in common),
            "flooder": json.loads(out.strip().splitlines()[-1]) if out.strip() else None,
        }  # fmt: skip
    finally:
        sw.close()


def _history(work: Path, name: str) -> list[dict]:
    try:
        return json.loads((work / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return []


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    a = sub.add_parser("attack", help="flood one peer (the flooder's own process)")
    a.add_argument("--target", required=True, help="the peer id to flood")
    a.add_argument("--maddr", required=True, action="append", help="its multiaddr (repeatable)")
    a.add_argument("--kind", choices=KINDS, default="slowloris")
    a.add_argument("--seconds", type=float, default=30.0)
    a.add_argument("--concurrency", type=int, default=64)
    a.add_argument("--direct", default="", metavar="HOST:PORT", help="the target's direct plane (kind direct)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--kind", choices=KINDS, default="slowloris")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="outer steps timed without the flood, then with it")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=64, help="the flooder's streams at once")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if min(args.replicas - 1, args.steps, args.concurrency) < 1:
        p.error("--replicas must be at least 2, --steps and --concurrency at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "attack":
        print(json.dumps(asyncio.run(attack(args.target, args.maddr, args.kind, args.seconds, args.concurrency, args.direct))), flush=True)
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ctrl-c or SIGTERM, even started in the background:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the swarm is stopped, nothing left behind
    with tempfile.TemporaryDirectory(prefix="swarmtrain-flood-") as tmp:
        result = run_bench(args, Path(tmp))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
