"""All-reduce benchmark: our compressed averager next to hivemind's DecentralizedAverager and gloo.

    python -m bench.allreduce --json                       # 100 MiB fp32, 4 peers, loopback, none/fp16/int8
    python -m bench.allreduce --size-mb 8 --peers 2        # smaller, human-readable table
    python -m bench.allreduce --netns --rate 100mbit       # peers in network namespaces, shaped links (root)
    python -m bench.allreduce --netns --slow-rate 25mbit   # ... and the last peer behind a slower link

Every peer is its own OS process (`bench/allreduce_peer.py`: one p2pd and one GIL each), started
fresh for each (implementation, codec) pair and commanded by this process over pipes. A round:
every peer resets its tensors to its own N(0, 1) data ("prepare"), then all start at one agreed
monotonic time ("go"). Per row, medians over `--rounds`:
- seconds_per_round: what a caller waits for a round, from the common start until the last peer
  holds the mean, forming the group included;
- allreduce_seconds: the data phase alone; matchmaking_seconds: forming the group.

Implementations:
- swarmtrain: node.averaging's Averager, one `average()` per round (matchmaking included;
  its phases from the report). Bytes: payload bytes_sent from its report. Error
  feedback zeroed in "prepare" (untimed), so each round is measured against its own exact mean;
- hivemind: DecentralizedAverager set up as hivemind's benchmarks/benchmark_averaging.py does,
  with the matching compression (none/fp16/int8 -> NoCompression/Float16Compression/
  Uniform8BitQuantization). One `step()` per round, split at hivemind's own trigger: prepare
  runs its matchmaking, go triggers the all-reduce. Bytes are an estimate, 2(N-1)/N·S·ratio,
  with the ratio measured on one 512 KiB part;
- gloo: torch.distributed all_reduce (fp32 SUM, then divide by N), a static group; bytes =
  2(N-1)/N·S (ring).
A failed round is reported under `failed_rounds` and retried (up to --max-failed-rounds).

rel_error = ‖result − exact mean‖ / ‖exact mean‖ (max over peers and rounds; with independent
inputs ‖mean‖ ≈ ‖x‖/√N, so a codec's error here is ≈ √N times its error on one tensor),
measured by a "check" after every peer has answered "go", outside the timed window.
A peer whose result is far off while the others' are fine is listed under `bad_results`
(hivemind can report success with part of its vector never averaged).

With --netns (root): each peer in its own namespace, links shaped to --rate in both directions
(bench/netns.py), the last peer's to --slow-rate if given; rows also get the bytes each peer
actually put on its link and the ratio of the time to the bandwidth bound. Without root or
`ip netns`, prints why and exits 0. Each peer is told its own link's rate (--declare-bandwidth).

The bound: a reduce-scatter + all-gather in which member i owns the fraction s_i of the vector
(S bytes) makes i upload its other parts, (1 - s_i)·S, and then its aggregated slice to the N-1
others, (N-1)·s_i·S: (1 + (N-2)·s_i)·S in all, and download as much. With both phases
overlapped, the round takes max_i (1 + (N-2)·s_i)·S / B_i; the shares that minimise it give

    bound = max( S / min_i B_i , 2(N-1)·S / Σ_i B_i )

(s_i ∝ B_i·bound/S - 1, none below 0). On equal links that is 2(N-1)/N·S/B. Where one link is so
slow that S/B_min wins, that member owns nothing: it only uploads its vector and downloads the
result, which no all-reduce can do with less (it holds data all others need, and needs theirs).
`bound_even_seconds` is the same all-reduce with equal slices, 2(N-1)/N·S/B_min (a ring's time).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import netns
from bench.workers import Group, PeerFailed, clean_up, exit_code

IMPLS = ("swarmtrain", "hivemind", "gloo")
DEFAULT_PARAMS = {"none": {}, "fp16": {}, "int8": {"block_size": 1024}, "topk": {"ratio": 0.01}, "powersgd": {"rank": 4}, "sparse": {"density": 0.02, "bits": 2, "chunk": 4096}}
HIVEMIND_CODECS = ("none", "fp16", "int8")
MiB = 1 << 20


def parse_codec(text: str) -> tuple[str, dict]:
    """"int8" or "int8:block_size=4096" -> ("int8", {"block_size": 4096})."""
    name, _, rest = text.strip().partition(":")
    if name not in DEFAULT_PARAMS:
        raise argparse.ArgumentTypeError(f"unknown codec {name!r} (one of {', '.join(DEFAULT_PARAMS)})")
    params = dict(DEFAULT_PARAMS[name])
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        params[key] = json.loads(value)
    return name, params


def codec_label(name: str, params: dict) -> str:
    return name + "".join(f"/{k}={v}" for k, v in params.items() if DEFAULT_PARAMS[name].get(k) != v)


def parse_opts(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--averager-opt wants key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_swarmtrain_averager() -> str | None:
    """None if node.averaging can be used, else why not."""
    try:
        if importlib.util.find_spec("node.averaging") is None:
            return "node.averaging cannot be found"
    except ImportError as e:
        return f"node package cannot be imported: {e}"
    return None


def version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


class Bench:
    def __init__(self, args, topo: netns.Topology | None, log_dir: Path):
        self.args, self.topo, self.log_dir = args, topo, log_dir
        self.n = args.peers
        self.numel = int(args.size_mb * MiB) // 4 // 1024 * 1024 or int(args.size_mb * MiB) // 4
        self.size_bytes = self.numel * 4
        self.rates = [netns.parse_rate(topo.rate_of(i)) for i in range(self.n)] if topo else None  # bit/s
        self.dense_bound = bound_seconds(self.size_bytes, self.rates) if topo else None
        self.threads = max(1, (os.cpu_count() or 1) // self.n)
        self.run_id = f"stb{os.getpid()}-{int(time.time())}"
        self.arm_index = 0

    def ip(self, i: int) -> str:
        return self.topo.ip(i) if self.topo else "127.0.0.1"

    def round_timeout(self) -> float:
        if self.args.timeout:
            return self.args.timeout
        return 120.0 + (10 * self.dense_bound if self.topo else 0.0)

    def run_arm(self, impl: str, codec: str, params: dict) -> dict:
        row = self._run_arm(impl, codec, params)
        summary = f"{row['seconds_per_round']:.3f} s/round" if row.get("status") == "ok" else row.get("error", "")[:200]
        print(f"[allreduce] {impl} {row['codec']}: {row.get('status')}: {summary}", file=sys.stderr, flush=True)
        return row

    def _run_arm(self, impl: str, codec: str, params: dict) -> dict:
        row = {"impl": impl, "codec": codec_label(codec, params), "codec_params": params}
        self.arm_index += 1
        timeout = self.round_timeout()
        setup_timeout = self.args.setup_timeout
        group = Group.start(self.n, self.log_dir, self.topo.wrap if self.topo else None, label=f"{impl}-{codec}-p")
        failures: list[dict] = []  # rounds that failed, were reported and retried
        try:
            for w in group.workers:
                w.recv(setup_timeout)  # hello: python and imports are up
            base = {
                "cmd": "setup", "impl": impl, "codec": codec, "codec_params": params, "n_peers": self.n,
                "numel": self.numel, "n_tensors": self.args.tensors, "seed": self.args.seed, "threads": self.threads,
                "timeout": timeout, "run_id": self.run_id,
                "security": self.args.security, "direct": self.args.direct == "on",
                "hivemind_min_matchmaking_time": self.args.hivemind_min_matchmaking_time,
                "hivemind_request_timeout": self.args.hivemind_request_timeout,
                "hivemind_matchmaking_timeout": self.args.hivemind_matchmaking_timeout,
            }
            t0 = time.monotonic()
            if impl == "gloo":
                port = 29500 + self.arm_index if self.topo else free_port()
                msgs = [{**base, **self.peer_opts(i), "rank": i, "ip": self.ip(i), "master_addr": self.ip(0), "master_port": port,
                         "ifname": "eth0" if self.topo else "lo"} for i in range(self.n)]
                setups = group.call_all(msgs, setup_timeout)
            else:
                first = group.call(0, {**base, **self.peer_opts(0), "rank": 0, "ip": self.ip(0), "initial_peers": []}, setup_timeout)
                peers = first["maddrs"]
                msgs = [{**base, **self.peer_opts(i), "rank": i, "ip": self.ip(i), "initial_peers": peers} for i in range(1, self.n)]
                setups = [first, *group.call_all(msgs, setup_timeout, indices=list(range(1, self.n)))]
            row["setup_seconds"] = round(time.monotonic() - t0, 3)
            rounds, attempt = [], 0
            while len(rounds) < self.args.warmup + self.args.rounds:
                if len(failures) > self.args.max_failed_rounds:
                    raise PeerFailed(f"{len(failures)} failed rounds; last: {failures[-1]['errors'][0]}")
                attempt += 1
                preps = group.gather_all([{"cmd": "prepare", "round": attempt}] * self.n, timeout)
                if errors := [str(p) for p in preps if isinstance(p, PeerFailed)]:
                    failures.append({"attempt": attempt, "phase": "prepare", "errors": errors})
                    group.call_all([{"cmd": "abort"}] * self.n, 60)
                    continue
                tx0 = self.topo.tx_bytes() if self.topo else None
                at = time.monotonic() + 0.3
                res = group.gather_all([{"cmd": "go", "round": attempt, "at": at}] * self.n, timeout + 30)
                tx1 = self.topo.tx_bytes() if self.topo else None
                if errors := [str(p) for p in res if isinstance(p, PeerFailed)]:
                    failures.append({"attempt": attempt, "phase": "go", "errors": errors})
                    continue
                # measured once every peer is done: no peer's check runs beside another's round
                checks = group.gather_all([{"cmd": "check"}] * self.n, timeout)
                if errors := [str(c) for c in checks if isinstance(c, PeerFailed)]:
                    failures.append({"attempt": attempt, "phase": "check", "errors": errors})
                    continue
                res = [{**r, **c} for r, c in zip(res, checks)]
                rounds.append(self.summarize_round(impl, res, preps, tx0, tx1))
            self.fill_row(row, impl, setups, rounds[self.args.warmup:])
        except PeerFailed as e:
            row.update(status="failed", error=str(e)[:2000])
            group.kill()
        except BaseException:
            group.kill()
            raise
        finally:
            if failures:
                row["failed_rounds"] = failures
            killed = group.close()
            if killed:
                row["killed_on_exit"] = killed
        return row

    def summarize_round(self, impl: str, res: list[dict], preps: list[dict], tx0, tx1) -> dict:
        """One round, over all peers. `seconds`: what a caller waits, group formation included
        (hivemind: its matchmaking + its triggered all-reduce); `allreduce`: the data phase alone."""
        finish = max(r["seconds"] + r["start_lag"] for r in res)
        if impl == "hivemind":
            matchmaking = max(p["matchmaking_seconds"] for p in preps)
            seconds, allreduce = matchmaking + finish, finish
        elif impl == "swarmtrain":
            matchmaking = max(r["matchmaking_seconds"] for r in res)
            seconds, allreduce = finish, max(r["seconds"] - r["matchmaking_seconds"] for r in res)
        else:  # gloo: the group is static, there is nothing to form
            matchmaking, seconds, allreduce = 0.0, finish, finish
        out = {
            "seconds": seconds,
            "allreduce": allreduce,
            "matchmaking": matchmaking,
            "start_lag": max(r["start_lag"] for r in res),
            "rel_errors": [r["rel_error"] for r in res],
            "members": min(r["members"] for r in res),
        }
        if res[0].get("bytes_sent") is not None:
            out["bytes_sent"] = statistics.mean(r["bytes_sent"] for r in res)
            out["bytes_received"] = statistics.mean(r["bytes_received"] for r in res)
        if res[0].get("phases"):
            out["phases"] = {k: max(r["phases"].get(k, 0.0) for r in res) for k in res[0]["phases"]}
        if res[0].get("cpu"):
            out["cpu"] = {k: sum(r["cpu"][k] for r in res) for k in res[0]["cpu"]}
        if "direct_pipes" in res[0]:
            out["direct_pipes"] = sum(r["direct_pipes"] for r in res)
        if res[0].get("schedule"):
            out["schedule"] = "/".join(sorted({r["schedule"] for r in res}))
        failed = [f for r in res for f in r.get("failed", [])]
        if failed:
            out["failed"] = failed
        if tx0 is not None:
            wire = [b - a for a, b in zip(tx0, tx1)]
            out["wire_bytes"] = statistics.mean(wire)
            out["wire_seconds"] = max(w * 8 / r for w, r in zip(wire, self.rates))  # the busiest link's own traffic at its rate
        return out

    def fill_row(self, row: dict, impl: str, setups: list[dict], rounds: list[dict]) -> None:
        n, s = self.n, self.size_bytes

        def median(key):
            return round(statistics.median(r[key] for r in rounds), 4)

        med = median("seconds")
        errs = [e for r in rounds for e in r["rel_errors"]]
        # A peer whose result is far off while the others are fine got a partial average
        # (hivemind can report success with parts of the vector never averaged).
        outliers = [(i, j, e) for i, r in enumerate(rounds) for j, e in enumerate(r["rel_errors"])
                    if e > max(1e-4, 10 * statistics.median(errs))]
        row.update(
            status="ok",
            seconds_per_round=med,
            allreduce_seconds=median("allreduce"),
            matchmaking_seconds=median("matchmaking"),
            round_seconds=[round(r["seconds"], 4) for r in rounds],
            rel_error=max(errs),
            rel_error_median=statistics.median(errs),
            members=min(r["members"] for r in rounds),
            max_start_lag=round(max(r["start_lag"] for r in rounds), 4),
        )
        if outliers:
            row["bad_results"] = [{"round": i, "peer": j, "rel_error": e} for i, j, e in outliers]
        if impl == "swarmtrain":
            row["bytes_per_peer"] = int(statistics.median(r.get("bytes_sent", 0) for r in rounds))
            row["bytes_received_per_peer"] = int(statistics.median(r.get("bytes_received", 0) for r in rounds))
            row["bytes_source"] = "measured: Averager report (payload bytes_sent, mean over peers)"
            if rounds[0].get("phases"):
                row["phases"] = {k: round(statistics.median(r["phases"].get(k, 0.0) for r in rounds), 4) for k in rounds[0]["phases"]}
                row["round_phases"] = [{k: round(v, 3) for k, v in r["phases"].items()} for r in rounds]  # slowest peer's, per round
            if "direct_pipes" in rounds[0]:  # pipes opened over direct TCP so far, all peers
                row["direct_pipes"] = rounds[-1]["direct_pipes"]
            if rounds[0].get("schedule"):  # how parts left: "paced" or "in turn" (see AveragerConfig.pace)
                row["schedule"] = statistics.mode(r["schedule"] for r in rounds)
            if rounds[0].get("cpu"):  # CPU seconds per round, all peers together
                row["cpu_seconds_per_round"] = {k: round(statistics.median(r["cpu"][k] for r in rounds), 3) for k in rounds[0]["cpu"]}
            failed = [f for r in rounds for f in r.get("failed", [])]
            if failed:
                row["failed_peers"] = failed[:20]
        elif impl == "hivemind":
            ratio = statistics.mean(x["compression_ratio"] for x in setups)
            row["compression_ratio"] = round(ratio, 4)
            row["bytes_per_peer"] = int(2 * (n - 1) / n * s * ratio)
            row["bytes_source"] = "estimate: 2(N-1)/N·S·ratio (ratio of its compression on one 512 KiB part)"
        else:
            row["bytes_per_peer"] = int(2 * (n - 1) / n * s)
            row["bytes_source"] = "estimate: 2(N-1)/N·S (ring all-reduce)"
        if self.topo:
            wire = statistics.median(r["wire_bytes"] for r in rounds)
            row["wire_bytes_per_peer"] = int(wire)
            row["bound_seconds"] = round(self.dense_bound, 4)
            row["ratio_to_bound"] = round(med / self.dense_bound, 3)
            row["allreduce_ratio_to_bound"] = round(row["allreduce_seconds"] / self.dense_bound, 3)
            row["wire_seconds_at_rate"] = round(statistics.median(r["wire_seconds"] for r in rounds), 4)  # the busiest link's traffic at its rate

    def declared_bandwidth(self, i: int) -> float | None:
        """Bytes/s peer i is told its link carries (as a user would declare it), or None."""
        return self.rates[i] / 8 if self.topo and self.args.declare_bandwidth == "on" else None

    def averager_opts(self, i: int) -> dict:
        opts = parse_opts(self.args.averager_opt)
        if self.declared_bandwidth(i) and "bandwidth" not in opts:
            opts["bandwidth"] = self.declared_bandwidth(i)
        return opts

    def peer_opts(self, i: int) -> dict:
        """What peer i's setup says about its own link: our averager's options, hivemind's bandwidth."""
        return {"averager_opts": self.averager_opts(i), "hivemind_bandwidth": self.declared_bandwidth(i)}

    def config(self) -> dict:
        a = self.args
        cfg = {
            "peers": self.n, "size_mb": a.size_mb, "size_bytes": self.size_bytes, "numel": self.numel,
            "tensors": a.tensors, "rounds": a.rounds, "warmup": a.warmup, "codecs": [codec_label(*c) for c in a.codecs], "impls": a.impls,
            "seed": a.seed, "round_timeout_s": self.round_timeout(), "threads_per_peer": self.threads,
            "cpus": os.cpu_count(), "netns": bool(self.topo), "python": sys.version.split()[0],
            "versions": {p: version(p) for p in ("torch", "hivemind", "numpy")},
            "averager_opts": self.averager_opts(0), "security": a.security, "direct": a.direct,
            "declared_bandwidth": self.declared_bandwidth(0),
        }
        if self.topo:
            cfg.update(rate=a.rate, slow_rate=a.slow_rate, rates_bps=self.rates, shaped=a.shape,
                       bound="max(S/min B_i, 2(N-1)·S/ΣB_i)", bound_seconds=round(self.dense_bound, 4),
                       bound_even_seconds=round(even_bound_seconds(self.size_bytes, self.rates), 4))
            if a.slow_rate:
                cfg["declared_bandwidth_slow"] = self.declared_bandwidth(self.n - 1)
        return cfg


def bound_seconds(size_bytes: int, rates: list[float]) -> float:
    """The least time a reduce-scatter + all-gather of `size_bytes` takes over links of `rates`
    (bit/s, each way), slices sized to the links: max(S/min B, 2(N-1)·S/ΣB) (see the docstring)."""
    bits, n = size_bytes * 8, len(rates)
    return max(bits / min(rates), 2 * (n - 1) * bits / sum(rates))


def even_bound_seconds(size_bytes: int, rates: list[float]) -> float:
    """The same with equal slices: 2(N-1)/N·S over the slowest link."""
    n = len(rates)
    return 2 * (n - 1) / n * size_bytes * 8 / min(rates)


def ratios(rows: list[dict], topo: bool, target: float = 1.1) -> dict:
    ok = {(r["impl"], r["codec"]): r for r in rows if r.get("status") == "ok"}
    out: dict = {}

    def add(name, codec, num, den):
        if num and den:
            out.setdefault(name, {})[codec] = round(num / den, 3)

    gloo = next((r for (impl, _), r in ok.items() if impl == "gloo"), None)
    for (impl, codec), r in ok.items():
        hm = ok.get(("hivemind", codec))
        if impl == "swarmtrain":
            add("swarmtrain/hivemind", codec, r["seconds_per_round"], hm and hm["seconds_per_round"])
            add("swarmtrain/hivemind_allreduce_only", codec, r["allreduce_seconds"], hm and hm["allreduce_seconds"])
            add("swarmtrain/gloo", codec, r["seconds_per_round"], gloo and gloo["seconds_per_round"])
        if impl == "hivemind":
            add("hivemind/gloo", codec, r["seconds_per_round"], gloo and gloo["seconds_per_round"])
    ours_none, ours_int8 = ok.get(("swarmtrain", "none")), ok.get(("swarmtrain", "int8"))
    if ours_none and ours_int8:
        out["swarmtrain_int8_speedup_vs_none"] = round(ours_none["seconds_per_round"] / ours_int8["seconds_per_round"], 3)
    if not topo:  # the loopback targets: fp32 at most hivemind's fp32 time; fp16 and int8 at most half its fp16 time
        hm_none, hm_fp16 = ok.get(("hivemind", "none")), ok.get(("hivemind", "fp16"))
        for codec in ("fp16", "int8"):
            if (ours := ok.get(("swarmtrain", codec))) and hm_fp16:
                add("swarmtrain/hivemind_fp16", codec, ours["seconds_per_round"], hm_fp16["seconds_per_round"])
                out[f"target_{codec}_within_0.5x_hivemind_fp16"] = out["swarmtrain/hivemind_fp16"][codec] <= 0.5
        if ours_none and hm_none:
            out["target_none_within_1.0x_hivemind"] = out["swarmtrain/hivemind"]["none"] <= 1.0
    if topo:
        out["ratio_to_bound"] = {f"{impl}:{codec}": r["ratio_to_bound"] for (impl, codec), r in ok.items()}
        if ours_none:
            out[f"target_none_within_{target}x_bound"] = ours_none["ratio_to_bound"] <= target
        if ours_none and ours_int8:
            out["target_int8_3x_faster_than_none"] = out["swarmtrain_int8_speedup_vs_none"] >= 3.0
    return out


def print_table(result: dict) -> None:
    cfg = result["config"]
    where = f"netns, {cfg['rate']} per link" if cfg["netns"] else "loopback"
    if cfg.get("slow_rate"):
        where += f", the last peer's {cfg['slow_rate']}"
    print(f"all-reduce of {cfg['size_bytes'] / MiB:g} MiB fp32 across {cfg['peers']} peers ({where}), "
          f"median of {cfg['rounds']} rounds, {cfg['cpus']} CPUs")
    if "link_goodput_mbit" in cfg:
        print(f"link check: {cfg['link_goodput_mbit']} Mbit/s TCP payload from peer 0 to peer 1")
    if cfg["netns"]:
        print(f"bound {cfg['bound']} = {cfg['bound_seconds']} s; with equal slices {cfg['bound_even_seconds']} s")
    head = f"{'impl':<11} {'codec':<14} {'s/round':>8} {'MiB/peer':>9} {'rel_error':>10}"
    head += f" {'wireMiB':>8} {'x bound':>8}" if cfg["netns"] else ""
    print(head + "  notes")
    for r in result["rows"]:
        if r.get("status") != "ok":
            print(f"{r['impl']:<11} {r['codec']:<14} {r.get('status', '?')}: {r.get('error') or r.get('reason')}")
            continue
        est = "~" if r["bytes_source"].startswith("estimate") else " "
        line = (f"{r['impl']:<11} {r['codec']:<14} {r['seconds_per_round']:>8.3f} {est}{r['bytes_per_peer'] / MiB:>8.2f}"
                f" {r['rel_error']:>10.2e}")
        if cfg["netns"]:
            line += f" {r['wire_bytes_per_peer'] / MiB:>8.2f} {r['ratio_to_bound']:>8.2f}"
        notes = []
        if r["matchmaking_seconds"]:
            notes.append(f"incl. {r['matchmaking_seconds']:.2f} s matchmaking")
        if r.get("members", cfg["peers"]) < cfg["peers"]:
            notes.append(f"only {r['members']} peers averaged")
        if r.get("bad_results"):
            notes.append(f"{len(r['bad_results'])} peer-round(s) far from the mean (median rel_error {r['rel_error_median']:.1e})")
        if r.get("failed_rounds"):
            notes.append(f"{len(r['failed_rounds'])} failed round(s) retried")
        if r.get("failed_peers"):
            notes.append(f"failed: {len(r['failed_peers'])}")
        print(line + "  " + ", ".join(notes))
    print("~ = estimated from the compression ratio, not measured")
    for name, value in result["ratios"].items():
        print(f"{name}: {value}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--peers", type=int, default=4, help="number of peers (processes)")
    p.add_argument("--size-mb", type=float, default=None, help="MiB of fp32 per peer (default 100; 25 with --netns)")
    p.add_argument("--tensors", type=int, default=8, help="the data is split into this many tensors")
    p.add_argument("--codecs", default="none,fp16,int8", help="comma-separated; params as int8:block_size=4096")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per arm (median reported)")
    p.add_argument("--warmup", type=int, default=0, help="untimed rounds before them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-failed-rounds", type=int, default=2, help="per arm: failed rounds are reported and retried, up to this many")
    p.add_argument("--timeout", type=float, default=None, help="seconds a round may take (default 120, +10x the bound with --netns)")
    p.add_argument("--setup-timeout", type=float, default=120.0, help="seconds for peers to start and connect")
    p.add_argument("--averager-opt", action="append", default=[], metavar="KEY=VALUE", help="extra AveragerConfig field for our arm (JSON value)")
    p.add_argument("--security", choices=("tls", "noise+tls"), default="tls", help="our hosts' libp2p channel security (hivemind's arm keeps its default, Noise)")
    p.add_argument("--direct", choices=("on", "off"), default="on", help="our pipes over direct sealed TCP where reachable (on), or over libp2p only (off)")
    p.add_argument("--hivemind-min-matchmaking-time", type=float, default=5.0)
    p.add_argument("--hivemind-request-timeout", type=float, default=1.0)
    p.add_argument("--hivemind-matchmaking-timeout", type=float, default=30.0)
    p.add_argument("--netns", action="store_true", help="peers in network namespaces with shaped links (root)")
    p.add_argument("--rate", default="100mbit", help="per-peer link rate with --netns (tc units: kbit, mbit, gbit)")
    p.add_argument("--slow-rate", default=None, help="with --netns: the last peer's link at this rate instead (the others at --rate)")
    p.add_argument("--shape", choices=("both", "upload"), default="both", help="shape each peer's upload only, or both directions")
    p.add_argument(
        "--declare-bandwidth", choices=("on", "off"), default="on",
        help="with --netns: tell each peer its link rate, as a user would (ours paces its sends to it; hivemind balances by it)",
    )
    p.add_argument("--no-link-check", action="store_true", help="skip the TCP goodput check of the shaped link")
    p.add_argument("--keep-logs", action="store_true", help="keep the peers' logs (path in the output)")
    args = p.parse_args(argv)
    try:
        args.codecs = [parse_codec(c) for c in args.codecs.split(",") if c.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in args.impls:
        if impl not in IMPLS:
            p.error(f"unknown impl {impl!r}")
    if args.size_mb is None:
        args.size_mb = 25.0 if args.netns else 100.0
    if args.peers < 2:
        p.error("--peers must be at least 2")
    for flag, rate in (("--rate", args.rate), ("--slow-rate", args.slow_rate)):
        try:
            rate is None or netns.parse_rate(rate)
        except ValueError as e:
            p.error(f"{flag}: {e}")
    if args.slow_rate and not args.netns:
        p.error("--slow-rate shapes links: it needs --netns")
    return args


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    sys.stdout.flush()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.netns:
        try:
            netns.check_available()
        except netns.NetnsUnavailable as e:
            skipped = {"skipped": str(e), "config": {"netns": True, "rate": args.rate}}
            print(json.dumps(skipped) if args.json else f"skipped: {e}")
            return 0
        netns.remove_stale()
    # SIGINT too: a process started with it ignored (a parent's setting, inherited) keeps
    # Python from installing its own KeyboardInterrupt handler, and ctrl-c would do nothing
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="stb-allreduce-"))
    topo = None
    try:
        if args.netns:
            slow = {args.peers - 1: args.slow_rate} if args.slow_rate else None
            topo = netns.Topology.create(args.peers, args.rate, shape_download=args.shape == "both", rates=slow)
        bench = Bench(args, topo, log_dir)
        config = bench.config()
        if topo and not args.no_link_check:
            config["link_goodput_mbit"] = round(netns.measure_goodput(topo, sys.executable) / 1e6, 2)
        rows = []
        why_not_ours = have_swarmtrain_averager()
        if "gloo" in args.impls:
            rows.append(bench.run_arm("gloo", "none", {}))
        for codec, params in args.codecs:
            if "swarmtrain" in args.impls:
                if why_not_ours:
                    rows.append({"impl": "swarmtrain", "codec": codec_label(codec, params), "status": "skipped", "reason": why_not_ours})
                else:
                    rows.append(bench.run_arm("swarmtrain", codec, params))
            if "hivemind" in args.impls:
                if codec in HIVEMIND_CODECS and params == DEFAULT_PARAMS[codec]:
                    rows.append(bench.run_arm("hivemind", codec, params))
                else:
                    rows.append({"impl": "hivemind", "codec": codec_label(codec, params), "status": "skipped",
                                 "reason": "no matching hivemind compression"})
        if args.keep_logs:
            config["logs"] = str(log_dir)
        # the targets: 1.1x the bound on equal links, 1.2x with one slower link
        target = 1.2 if args.slow_rate else 1.1
        emit({"config": config, "rows": rows, "ratios": ratios(rows, bool(topo), target)}, args.json)
        return exit_code(rows)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        clean_up(topo, log_dir, args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
