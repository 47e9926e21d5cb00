"""Fault benchmark: what a crashed, frozen or cut-off peer costs the survivors of an all-reduce,
ours (node.averaging's Averager) next to hivemind's DecentralizedAverager on the same group.

    python -m bench.faults --json                                  # 4 peers, 1 MiB fp32, outage 30 s
    python -m bench.faults --netns --json                          # + link_down (root: network namespaces)
    python -m bench.faults --peers 3 --size-mb 0.25 --outage-s 6 --kinds sigkill --impls swarmtrain

One row per (fault kind, implementation), each with fresh peer processes (bench/allreduce_peer.py,
one OS process per peer; hivemind's DHT and averager processes and every p2pd stay in that peer's
session). Compression "none" on both sides. A row:

1. `--warmup` + `--healthy-rounds` rounds with every peer; healthy_round_s = their median
   (without the warm-up), each round timed by this process from its command to the last answer.
2. The fault strikes in the next round (`--fault-at`: by default the middle of the data phase,
   from the healthy rounds' phases), at one peer, whole session at once:
   - sigkill: SIGKILL of a member that is not the leader (it stays dead);
   - sigstop_member / sigstop_leader: SIGSTOP of a non-leader member / of the leader for
     `--outage-s`, then SIGCONT;
   - link_down (--netns only): that member's link cut at the bridge (bench/netns.py `cut`) for
     `--outage-s`, then restored.
   The leader: ours, the member with the smallest peer id (`AverageReport.leader` confirms it);
   hivemind, the peer its matchmaking made leader in the last healthy round (hivemind tells
   this only in a debug record; there is no fixed leader: the next round's may differ). The
   member: among the others, the largest peer id.
3. The survivors run rounds back to back. The faulty peer is never commanded nor waited on while
   it is frozen, cut off or dead; its answer to the round the fault hit is taken whenever it
   comes. When the outage ends (sigkill: when `--outage-s` have passed), rounds go on with every
   live peer, until the faulty peer completes a successful round together with all the others
   (back_after_s, from the fault's end) or `--back-deadline-s` passes. A peer that comes free
   while a round it is not in runs (the faulty one back, a survivor late with its last answer)
   joins that round at once, as a peer running its own loop would; no round waits for it.

Every round has a deadline (`--round-timeout`); a round counts as successful only if every
survivor in it returned success by then. Per row:
- time_lost_s: what failed and slow rounds cost the survivors, from the round the fault hit on:
  failed rounds whole, any wait with no round running, and successful rounds beyond
  healthy_round_s while the fault disturbs the rounds: from the fault until the survivors run 3
  successful rounds in a row within 1.5 × healthy_round_s, and from the outage's end until they
  do so again after the faulty peer is back. Slow rounds outside those windows (a loaded
  machine's noise, which over a 30 s outage of 0.3 s rounds adds up to seconds in rows without
  any disturbance) are shown as slow_rounds_steady_s, not counted.
  time_lost_net_s is the plain (wall time − successful rounds × healthy_round_s), where rounds
  faster than healthy (fewer peers; on few cores a frozen peer's CPU is free) earn time back;
- first_round_s: how long that round took; rounds_during_outage: successful rounds the survivors
  completed during the outage; rounds_failed: failed rounds from the fault round on;
- wrong_results: successes whose max abs error against the exact mean of the peers the round
  says took part exceeds `--tolerance` (ours: the report's survivors; hivemind names its group
  only, not whose data its average holds, so the closer of the group's mean and the mean of the
  group without the faulty peer) — a success must never be wrong;
- target_met: time_lost_s <= 2 × healthy_round_s + 1 s;
- link_usable_after_s (link_down): when a plain TCP connect from the restored peer to another
  peer's port first succeeded after the restore (the network's own recovery: ARP, the bridge);
  back_after_s beyond it is libp2p's and ours (go-libp2p refuses to redial an address for 5 s
  and more after a failed dial).

Settings, as stated in the output's config: ours as our node runs it (join_timeout_s 15, the run
default; expected_peers: the peer ids of every peer not killed, frozen and cut-off peers included,
as a replica passes the replicas it knows); hivemind as bench/allreduce.py sets it up after
hivemind's benchmark (min_matchmaking_time 5 s, request_timeout 1 s, matchmaking timeout 30 s),
with hivemind's default min_group_size (2, so survivors can average without the faulty peer) and
next_chunk_timeout = its matchmaking time, as hivemind.Optimizer derives it (without it one dead
sender stalls an all-reduce until allreduce_timeout).

Beside this file: faults_report.py (which peer a run faults, and what its row reports).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import faults_report, netns
from bench.allreduce import _raise_interrupt, have_swarmtrain_averager, version
from bench.faults_report import LEAD_S
from bench.workers import Group, PeerFailed, PeerRefused, clean_up, exit_code
from node.osutil import session_pids

KINDS = ("sigkill", "sigstop_member", "sigstop_leader", "link_down")
IMPLS = ("swarmtrain", "hivemind")
MiB = 1 << 20
TICK_S = 0.005  # how often answers, round deadlines and fault timers are looked at


@dataclass
class Round:
    id: int
    start: float  # monotonic, when its commands went out
    peers: list[int]
    awaited: set[int]  # the peers whose answers complete it (never the faulty one, once it is faulty)
    deadline: float
    replies: dict[int, dict] = field(default_factory=dict)  # ok answers
    errors: dict[int, str] = field(default_factory=dict)
    answered: dict[int, float] = field(default_factory=dict)
    end: float | None = None
    ok: bool | None = None

    def done(self, now: float) -> bool:
        return self.awaited <= self.answered.keys() or now >= self.deadline


class FaultRun:
    """One row: peers started, healthy rounds, the fault, the survivors' rounds, the way back."""

    def __init__(self, bench: Bench, impl: str, kind: str):
        self.b, self.args, self.impl, self.kind = bench, bench.args, impl, kind
        self.n = self.args.peers
        self.group: Group | None = None
        self.ids: list[str] = []
        self.dead: set[int] = set()
        self.busy: dict[int, Round] = {}
        self.rounds: list[Round] = []
        self.healthy: list[Round] = []  # the healthy rounds measured (after the warm-up)
        self.current: Round | None = None
        self.faulty: int | None = None
        self.fault_at: float | None = None  # when it is to strike
        self.fault_offset = 0.0  # seconds into a round (see Bench.fault_offset)
        self.plans = 0  # rounds it was planned into
        self.fault_start = self.fault_end = self.back_at = None
        self.fault_round: Round | None = None  # the round in flight when it struck
        self.active = False  # frozen / cut right now (or dead)
        self.notes: list[str] = []
        self.error_counts: dict[str, int] = {}
        self.maddrs: list[list[str]] = []
        self.link_probe = None  # link_down: a raw TCP connect loop from the restored peer (see end_fault)

    # ---- peers

    def start(self) -> dict:
        b, a = self.b, self.args
        label = f"{self.impl}-{self.kind}-p"
        self.group = Group.start(self.n, b.log_dir, b.topo.wrap if b.topo else None, label=label)
        for w in self.group.workers:
            w.recv(a.setup_timeout)  # hello
        base = {
            "cmd": "setup", "impl": self.impl, "codec": "none", "codec_params": {}, "n_peers": self.n,
            "numel": b.numel, "n_tensors": a.tensors, "seed": a.seed, "threads": b.threads, "timeout": a.round_timeout,
            "run_id": b.run_id, "averager_opts": b.averager_opts(), "hivemind_bandwidth": b.declared_bandwidth(),
            "security": "tls", "direct": True, **b.hivemind_settings(),
        }
        t0 = time.monotonic()

        def leaders(i: int) -> str | None:  # where hivemind's leaders are written down (see allreduce_peer)
            return str(b.log_dir / f"{label}{i}.leaders") if self.impl == "hivemind" else None

        first = self.group.call(0, {**base, "rank": 0, "ip": b.ip(0), "initial_peers": [], "hivemind_leader_log": leaders(0)}, a.setup_timeout)
        msgs = [{**base, "rank": i, "ip": b.ip(i), "initial_peers": first["maddrs"], "hivemind_leader_log": leaders(i)} for i in range(1, self.n)]
        setups = [first, *self.group.call_all(msgs, a.setup_timeout, indices=list(range(1, self.n)))]
        self.ids = [s["peer_id"] for s in setups]
        self.maddrs = [list(s.get("maddrs") or ()) for s in setups]
        return {"setup_seconds": round(time.monotonic() - t0, 3)}

    def signal_session(self, i: int, sig: int) -> None:
        """`sig` to every process of peer i's session (peer, DHT, averager, p2pd), until none is new."""
        done: set[int] = set()
        while pids := [p for p in session_pids(self.group.workers[i].proc.pid) if p not in done]:
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            done.update(pids)

    def inject(self, now: float) -> None:
        i = self.faulty
        if self.kind == "sigkill":
            self.group.workers[i].kill()  # SIGKILL to its whole session, reaped
            self.dead.add(i)
            self.busy.pop(i, None)
        elif self.kind.startswith("sigstop"):
            self.signal_session(i, signal.SIGSTOP)
        else:
            self.b.topo.cut(i)
        self.fault_start, self.active = now, True
        if self.current is not None:
            self.fault_round = self.current
        for r in (self.current, *self.busy.values()):
            if r is not None:
                r.awaited.discard(i)

    def end_fault(self, now: float) -> None:
        if self.kind.startswith("sigstop"):
            self.signal_session(self.faulty, signal.SIGCONT)
        elif self.kind == "link_down":
            self.b.topo.restore(self.faulty)
            self.link_probe = self._probe_link()
        self.fault_end, self.active = now, False

    def _probe_link(self):
        """How long the network itself takes to carry a connection again after the restore
        (ARP, the bridge), apart from libp2p and us: from the restored peer's namespace, a plain
        TCP connect to another peer's libp2p port every 50 ms until one succeeds (at most 30 s).
        Prints the seconds; the libp2p daemon just sees a connection that closes at once."""
        import subprocess

        other = next(i for i in range(self.n) if i != self.faulty)
        port = next((int(m.split("/tcp/")[1].split("/")[0]) for m in self.maddrs[other] if "/tcp/" in m), None)
        if port is None:
            return None
        code = ("import socket,time\nt0=time.monotonic()\nwhile time.monotonic()-t0<30:\n s=socket.socket();s.settimeout(0.05)\n"
                " try:\n  s.connect((%r,%d));print(round(time.monotonic()-t0,3));break\n except OSError:time.sleep(0.05)\n finally:s.close()\n") % (self.b.ip(other), port)
        return subprocess.Popen(self.b.topo.wrap(self.faulty, [sys.executable, "-c", code]), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    # ---- rounds

    def ready(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.dead and i not in self.busy and not (self.active and i == self.faulty)]

    def send_round(self, peers: list[int]) -> Round:
        now = time.monotonic()
        awaited = {i for i in peers if not (self.fault_start is not None and i == self.faulty)}
        rnd = Round(len(self.rounds) + 1, now, [], awaited, now + self.args.round_timeout + 10)
        self.rounds.append(rnd)
        for i in peers:
            self.command(i, rnd, now + LEAD_S)
        return rnd

    def command(self, i: int, rnd: Round, at: float) -> None:
        msg = {
            "cmd": "round", "round": rnd.id, "at": at, "timeout": self.args.round_timeout,
            "ranks": {p: j for j, p in enumerate(self.ids)},
            # ours: the peers it expects by id, as a replica passes the replicas it knows (alive: not killed)
            "expected": [self.ids[j] for j in range(self.n) if j not in self.dead] if self.impl == "swarmtrain" else None,
            # hivemind's results are also measured against the mean without the peer to be faulted
            "suspects": [self.ids[self.faulty]] if self.faulty is not None else [],
            "tolerance": self.args.tolerance,
        }
        rnd.peers.append(i)
        try:
            self.group.workers[i].send(msg)
            self.busy[i] = rnd
        except PeerFailed as e:
            self.died(i, rnd, str(e))

    def join_late(self, now: float) -> None:
        """A peer free while a round it is not in runs (back from a fault, or late with its last
        answer) joins that round at once, as a peer running its own loop would: it never waits
        for the next one, and the round never waits for it."""
        if self.current is not None:
            for i in self.ready():
                if i not in self.current.peers:
                    self.command(i, self.current, now)

    def died(self, i: int, rnd: Round, why: str) -> None:
        self.dead.add(i)
        rnd.errors[i], rnd.answered[i] = f"peer died: {why[:300]}", time.monotonic()
        self.notes.append(f"peer {i} died by itself in round {rnd.id}: {why[:300]}")

    def pump(self) -> None:
        """Take every answer that is waiting (never waits on anyone)."""
        for i, rnd in list(self.busy.items()):
            w = self.group.workers[i]
            if not w.has_answer():
                continue
            del self.busy[i]
            try:
                rnd.replies[i] = w.recv(1.0)
                rnd.answered[i] = time.monotonic()
            except PeerRefused as e:
                rnd.errors[i], rnd.answered[i] = str(e).split(": ", 1)[-1], time.monotonic()
            except PeerFailed as e:
                self.died(i, rnd, str(e))

    def finish(self, rnd: Round) -> None:
        survivors = rnd.awaited
        rnd.ok = all(i in rnd.replies for i in survivors) and bool(survivors)
        rnd.end = max((rnd.answered[i] for i in survivors if i in rnd.answered), default=rnd.deadline)
        if not survivors <= rnd.answered.keys():
            rnd.end = rnd.deadline
            for i in survivors - rnd.answered.keys():
                rnd.errors.setdefault(i, f"no answer within {self.args.round_timeout:.0f} s (+10 s)")

    def drive(self, stop, fault: bool = False) -> None:
        """Rounds back to back among the free peers until `stop(now)` (asked between rounds);
        `fault`: the fault strikes `fault_offset` into the first of them."""
        while True:
            now = time.monotonic()
            if self.fault_at is not None and self.fault_start is None and now >= self.fault_at:
                self.inject(now)
            if self.active and self.kind != "sigkill" and now >= self.fault_start + self.args.outage_s:
                self.end_fault(now)
            self.pump()
            self.check_back()
            self.join_late(now)
            if self.current is not None and self.current.done(now):
                self.finish(self.current)
                self.current = None
            if self.current is None:
                if stop(now):
                    return
                if len(ready := self.ready()) >= 2:
                    self.current = self.send_round(ready)
                    # planned into this round; again into the next if it ended first (a few times)
                    if fault and self.fault_start is None and self.plans < 10:
                        self.plans += 1
                        self.fault_at = self.current.start + LEAD_S + self.fault_offset
            time.sleep(TICK_S)

    def check_back(self) -> None:
        """The faulty peer's first success, after the fault's end, in a group with every live peer."""
        if self.back_at is not None or self.fault_end is None or self.kind == "sigkill":
            return
        alive = {self.ids[i] for i in range(self.n) if i not in self.dead}
        for rnd in self.rounds:
            reply, t = rnd.replies.get(self.faulty), rnd.answered.get(self.faulty, 0.0)
            # a round it was given after the fault's end (not its late answer to the round the fault hit)
            if reply and rnd.start >= self.fault_end and alive <= set(reply.get("members") or reply.get("group") or ()):
                self.back_at = t
                return

    def stop_healthy(self, now: float) -> bool:
        ok = [r for r in self.rounds if r.ok]
        failed = [r for r in self.rounds if r.ok is False]
        if len(failed) > 3:
            raise PeerFailed(f"{len(failed)} healthy rounds failed; last: {self.describe_errors(failed[-1])}")
        return len(ok) >= self.args.warmup + self.args.healthy_rounds

    def stop_faulted(self, now: float) -> bool:
        if self.fault_start is None:
            return False
        if self.kind == "sigkill":
            return now >= self.fault_start + self.args.outage_s
        return self.back_at is not None or (self.fault_end is not None and now >= self.fault_end + self.args.back_deadline_s)

    # ---- the row

    def run(self) -> dict:
        row: dict = {"impl": self.impl, "kind": self.kind}
        try:
            row.update(self.start())
            self.drive(self.stop_healthy)
            self.healthy = healthy = [r for r in self.rounds if r.ok][self.args.warmup:]
            row["healthy_round_s"] = round(statistics.median(r.end - r.start for r in healthy), 4)
            row["healthy_rounds_s"] = [round(r.end - r.start, 3) for r in healthy]
            self.pick_faulty(row, healthy[-1])
            self.fault_offset = self.b.fault_offset(self)
            row["healthy_matchmaking_s"] = round(statistics.median(max(rep.get("matchmaking_seconds", 0.0) for rep in r.replies.values()) for r in healthy), 4)
            row["fault_planned_offset_s"] = round(self.fault_offset, 4)
            self.drive(self.stop_faulted, fault=True)
            self.fill(row)
        except PeerFailed as e:
            row.update(status="failed", error=str(e)[:2000])
        except BaseException:  # Ctrl-C, a bug: nothing may outlive us
            if self.active and self.kind.startswith("sigstop"):
                self.signal_session(self.faulty, signal.SIGCONT)  # a stopped process would not die before it
            if self.group is not None:
                self.group.kill()
            raise
        finally:
            if self.active and self.kind != "sigkill":
                self.end_fault(time.monotonic())
            if self.group is not None:
                busy = sorted(i for i in self.busy if i not in self.dead)
                for i in busy:  # still in a round (its command queue would hold "exit" behind it)
                    self.group.workers[i].kill()
                if busy:
                    row["killed_busy_at_end"] = busy
                if killed := self.group.close():
                    row["killed_on_exit"] = killed
        row.setdefault("status", "ok")
        if self.notes:
            row["notes"] = self.notes
        return row

    def describe_errors(self, rnd: Round) -> str:
        return "; ".join(f"peer {i}: {e}" for i, e in sorted(rnd.errors.items()))[:1000]

    def pick_faulty(self, row: dict, last: Round) -> None:
        faults_report.pick_faulty(self, row, last)

    def fill(self, row: dict) -> None:
        faults_report.fill(self, row)


class Bench:
    def __init__(self, args, topo: netns.Topology | None, log_dir: Path):
        self.args, self.topo, self.log_dir = args, topo, log_dir
        self.numel = int(args.size_mb * MiB) // 4 // 1024 * 1024 or int(args.size_mb * MiB) // 4
        self.threads = max(1, (os.cpu_count() or 1) // args.peers)
        self.run_id = f"stf{os.getpid()}-{int(time.time())}"

    def ip(self, i: int) -> str:
        return self.topo.ip(i) if self.topo else "127.0.0.1"

    def declared_bandwidth(self) -> float | None:
        return netns.parse_rate(self.args.rate) / 8 if self.topo else None

    def averager_opts(self) -> dict:
        opts = {"join_timeout_s": self.args.join_timeout_s}
        if self.declared_bandwidth():
            opts["bandwidth"] = self.declared_bandwidth()
        return opts

    def hivemind_settings(self) -> dict:
        a = self.args
        return {
            "hivemind_min_matchmaking_time": a.hivemind_min_matchmaking_time,
            "hivemind_request_timeout": a.hivemind_request_timeout,
            "hivemind_matchmaking_timeout": a.hivemind_matchmaking_timeout,
            "hivemind_next_chunk_timeout": a.hivemind_next_chunk_timeout or None,
            "hivemind_min_group_size": 2,
        }

    def fault_offset(self, run: FaultRun) -> float:
        """Seconds into the fault round at which the fault strikes."""
        if self.args.fault_at != "data":
            return float(self.args.fault_at)
        # the middle of the data phase, by the healthy rounds: matchmaking, then half the rest
        mm = statistics.median(max(rep.get("matchmaking_seconds", 0.0) for rep in r.replies.values()) for r in run.healthy)
        total = statistics.median(max(rep["seconds"] for rep in r.replies.values()) for r in run.healthy)
        return mm + max(0.0, total - mm) / 2

    def config(self) -> dict:
        a = self.args
        return {
            "peers": a.peers, "size_mb": a.size_mb, "size_bytes": self.numel * 4, "codec": "none", "outage_s": a.outage_s,
            "kinds": a.kinds, "impls": a.impls, "healthy_rounds": a.healthy_rounds, "warmup": a.warmup,
            "round_timeout_s": a.round_timeout, "back_deadline_s": a.back_deadline_s, "fault_at": a.fault_at,
            "tolerance": a.tolerance, "netns": bool(self.topo), "rate": a.rate if self.topo else None,
            "cpus": os.cpu_count(), "threads_per_peer": self.threads, "python": sys.version.split()[0],
            "versions": {p: version(p) for p in ("torch", "hivemind")},
            "settings": {
                "swarmtrain": {
                    **self.averager_opts(), "min_group_size": 2, "codec": "none",
                    "expected_peers": "peer ids of every peer not killed (frozen and cut-off peers stay expected)",
                },
                "hivemind": {
                    "target_group_size": a.peers, "min_group_size": 2, "min_matchmaking_time": a.hivemind_min_matchmaking_time,
                    "request_timeout": a.hivemind_request_timeout, "step_timeout (matchmaking)": a.hivemind_matchmaking_timeout,
                    "allreduce_timeout": a.round_timeout, "next_chunk_timeout": a.hivemind_next_chunk_timeout or None,
                    "compression": "NoCompression", "bandwidth": self.declared_bandwidth(),
                },
            },
        }


def ratios(rows: list[dict]) -> dict:
    """ours / hivemind per fault kind, for each measure both rows have."""
    ok = {(r["impl"], r["kind"]): r for r in rows if r.get("status") == "ok"}
    out: dict = {}
    for kind in KINDS:
        ours, hm = ok.get(("swarmtrain", kind)), ok.get(("hivemind", kind))
        if not (ours and hm):
            continue
        for key in ("healthy_round_s", "time_lost_s", "first_round_s", "back_after_s"):
            if ours.get(key) is not None and hm.get(key):
                out.setdefault(kind, {})[f"{key}_swarmtrain/hivemind"] = round(ours[key] / hm[key], 3)
    return out


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(f"faults: {cfg['peers']} peers, {cfg['size_bytes'] / MiB:g} MiB fp32, outage {cfg['outage_s']:g} s, "
          f"{'netns ' + cfg['rate'] if cfg['netns'] else 'loopback'}, {cfg['cpus']} CPUs")
    print(f"{'kind':<15} {'impl':<11} {'healthy':>8} {'first':>7} {'lost':>7} {'ok/fail':>8} {'outage ok':>9} {'back':>7} {'wrong':>5}  target")
    for r in result["rows"]:
        if r.get("status") != "ok":
            print(f"{r['kind']:<15} {r['impl']:<11} {r.get('status')}: {r.get('reason') or r.get('error', '')[:200]}")
            continue
        back = f"{r['back_after_s']:.1f}" if r["back_after_s"] is not None else "-"
        print(f"{r['kind']:<15} {r['impl']:<11} {r['healthy_round_s']:>8.3f} {r['first_round_s']:>7.2f} {r['time_lost_s']:>7.2f} "
              f"{r['rounds_ok']:>4}/{r['rounds_failed']:<3} {r['rounds_during_outage']:>9} {back:>7} {r['wrong_results']:>5}  "
              f"{'met' if r['target_met'] else 'missed'}")
    for kind, values in result["ratios"].items():
        print(f"{kind}: " + ", ".join(f"{k} {v}" for k, v in values.items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=1.0, help="MiB of fp32 per peer")
    p.add_argument("--outage-s", type=float, default=30.0, help="seconds a peer stays frozen / cut off (sigkill: seconds the survivors run)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--netns", action="store_true", help="peers in network namespaces (root); needed for link_down")
    p.add_argument("--rate", default="100mbit", help="per-peer link rate with --netns (declared to both implementations)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="rounds before the healthy ones")
    p.add_argument("--healthy-rounds", type=int, default=5)
    p.add_argument("--fault-at", default="data", help='"data" (mid data phase, from the healthy rounds) or seconds into the round')
    p.add_argument("--round-timeout", type=float, default=60.0, help="seconds a round may take (also hivemind's allreduce_timeout)")
    p.add_argument("--back-deadline-s", type=float, default=60.0, help="after the fault's end, how long to wait for the faulty peer")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs error of a successful result")
    p.add_argument("--join-timeout-s", type=float, default=15.0, help="ours: AveragerConfig.join_timeout_s (the run default)")
    p.add_argument("--hivemind-min-matchmaking-time", type=float, default=5.0)
    p.add_argument("--hivemind-request-timeout", type=float, default=1.0)
    p.add_argument("--hivemind-matchmaking-timeout", type=float, default=30.0)
    p.add_argument("--hivemind-next-chunk-timeout", type=float, default=5.0, help="0: none (hivemind's bare default)")
    p.add_argument("--setup-timeout", type=float, default=120.0)
    p.add_argument("--timeline", type=int, default=400, help="rounds listed per row in `timeline`")
    p.add_argument("--keep-logs", action="store_true", help="keep the peers' logs (path in the output)")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for k in args.kinds:
        if k not in KINDS:
            p.error(f"unknown kind {k!r}")
    for i in args.impls:
        if i not in IMPLS:
            p.error(f"unknown impl {i!r}")
    if args.peers < 3:
        p.error("--peers must be at least 3 (two survivors average without the faulty one)")
    if args.fault_at != "data":
        try:
            float(args.fault_at)
        except ValueError:
            p.error("--fault-at wants 'data' or seconds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    why_no_netns = None if args.netns else "needs --netns (peers in network namespaces, root)"
    if args.netns:
        try:
            netns.check_available()
            netns.remove_stale()
        except netns.NetnsUnavailable as e:
            why_no_netns = str(e)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="stb-faults-"))
    topo = None
    try:
        if args.netns and why_no_netns is None:
            topo = netns.Topology.create(args.peers, args.rate)
        bench = Bench(args, topo, log_dir)
        config = bench.config()
        rows = []
        for kind in args.kinds:
            for impl in args.impls:
                if kind == "link_down" and topo is None:
                    rows.append({"impl": impl, "kind": kind, "status": "skipped", "reason": why_no_netns})
                elif impl == "swarmtrain" and (why := have_swarmtrain_averager()):
                    rows.append({"impl": impl, "kind": kind, "status": "skipped", "reason": why})
                else:
                    rows.append(row := FaultRun(bench, impl, kind).run())
                    line = (f"lost {row['time_lost_s']} s, first round {row['first_round_s']} s, back {row['back_after_s']}"
                            if row["status"] == "ok" else row.get("error", "")[:300])
                    print(f"[faults] {kind} {impl}: {row['status']}: {line}", file=sys.stderr, flush=True)
        if args.keep_logs:
            config["logs"] = str(log_dir)
        result = {"config": config, "rows": rows, "ratios": ratios(rows)}
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print_table(result)
        sys.stdout.flush()
        return exit_code(rows)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        clean_up(topo, log_dir, args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
