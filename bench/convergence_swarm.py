"""Arm (b) of bench/convergence.py: this system, a coordinator and N replica nodes as real processes.

    run_swarm_arm(settings, warm_state, warm_val_loss, work_dir, timeout)   -> the arm's result
    unavailable()                                                            -> None, or why (b) cannot run here

How a run goes: the warm-start weights are written into the coordinator's data dir as checkpoint
0 before it starts (every replica downloads that one, as a joiner would); the coordinator gets the
run config on its command line (`--min-replicas N`, so nobody starts averaging alone); N
`swarmtrain-node` replicas join it on loopback, replica r reading shard r of N with seed + r, as
in the other arms. Each replica rewrites `<its data dir>/replica-stats.json` after every outer
step; we poll those files until every replica has reached the last outer step, then stop
everything (SIGTERM, then SIGKILL of whatever is left in each process's session).

The curve is replica 0's validation loss of the outer parameters after each outer step (node/
replica.py evaluates with the same windows as the other arms: batch_size, eval_batches, seed
1234); all replicas must report the same state hash at every outer step. Bytes are what each
replica's averager reports having sent (payload and framing of its all-reduce rounds; the
checkpoint download at the start is not counted: it is part of the warm start).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.convergence_settings import Settings, free_port, thread_env
from bench.convergence_sync import ArmFailed, _tail
from bench.workers import kill_session, session_pids

ROOT = Path(__file__).resolve().parent.parent
EVAL_SEED = 1234  # node/roles/replica.py's EVAL_SEED: the windows the replicas evaluate on
CHECKPOINT_EVERY = 4  # outer steps between the coordinator's checkpoints (not on the measured path)


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _help(script: str) -> str:
    try:
        out = subprocess.run([_script(script), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"<{e}>"
    return out.stdout + out.stderr


def unavailable() -> str | None:
    """Why arm (b) cannot run in this checkout (None: it can): the run-config flags must exist."""
    coord, node = _help("swarmtrain-coordinator"), _help("swarmtrain-node")
    missing = [f for f in ("--inner-steps", "--max-outer-steps", "--min-replicas", "--eval-batches") if f not in coord]
    missing += [f for f in ("--shard-index", "--num-shards", "--threads") if f not in node]
    if missing:
        return f"the coordinator/node CLI lacks {', '.join(missing)}"
    return None


class _Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.log_path = name, log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float) -> bool:
        """SIGTERM, wait up to `timeout` s; then SIGKILL the session. True if it left by itself."""
        clean = True
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                clean = False
        if session_pids(self.popen.pid):
            clean = False
        kill_session(self.popen.pid)
        if self.alive():
            self.popen.kill()
        self.popen.wait(10)
        return clean


def _status(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
        return json.loads(r.read())


def _read_stats(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet (or, without an atomic rename, half-written)
        return None


def write_warm_checkpoint(data_dir: Path, settings: Settings, warm_state: dict) -> None:
    """The warm start as the run's checkpoint 0, exactly where the coordinator will look."""
    from coordinator.checkpoints import CheckpointStore

    CheckpointStore(data_dir / "checkpoints").save(0, {"model": warm_state}, model_config=settings.model_config().to_dict())


def coordinator_args(settings: Settings, data_dir: Path, port: int, http_port: int, swarm_id: str, inner_phase: str = "steps") -> list[str]:
    s = settings
    return [
        "--data-dir", str(data_dir), "--swarm-id", swarm_id, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
        "--http", f"127.0.0.1:{http_port}",
        "--model", s.preset, "--inner-steps", str(s.inner_steps), "--batch-size", str(s.batch_size),
        "--inner-lr", repr(s.inner_lr), "--warmup-steps", str(s.lr_warmup), "--total-steps", str(s.steps),
        "--outer-lr", repr(s.outer_lr), "--outer-momentum", repr(s.outer_momentum), "--codec", s.codec,
        "--block-size", str(s.block_size), "--max-outer-steps", str(s.outer_steps),
        "--checkpoint-every", str(CHECKPOINT_EVERY), "--eval-batches", str(s.eval_batches), "--seed", str(s.seed),
        "--min-replicas", str(s.replicas), "--join-timeout-s", repr(s.join_timeout_s), "--inner-phase", inner_phase,
    ]  # fmt: skip


def node_args(settings: Settings, data_dir: Path, rank: int, coordinator_maddr: str, swarm_id: str) -> list[str]:
    return [
        "--data-dir", str(data_dir), "--swarm-id", swarm_id, "--initial-peers", coordinator_maddr,
        "--shard-index", str(rank), "--num-shards", str(settings.replicas), "--threads", str(settings.threads),
        "--bandwidth-mbps", "1000", "--wanted-role", "replica",
        *(["--fault-slowdown", repr(settings.slow_replica)] if rank == settings.replicas - 1 and settings.slow_replica > 1 else []),
    ]  # fmt: skip


def _coordinator_maddr(coord: _Proc, http_port: int, deadline: float) -> str:
    """The coordinator's multiaddr, from its /status once it answers (ArmFailed: it exited, or
    did not answer by `deadline`)."""
    while True:
        if not coord.alive():
            raise ArmFailed(f"the coordinator exited with {coord.popen.returncode}:\n{_tail(coord.log_path)}")
        if time.monotonic() > deadline:
            raise ArmFailed(f"the coordinator's /status did not answer within 120 s:\n{_tail(coord.log_path)}")
        try:
            return _status(http_port)["maddrs"][0]
        except (urllib.error.URLError, ConnectionError, OSError, ValueError, KeyError, IndexError):
            time.sleep(0.2)


def run_swarm_arm(settings: Settings, warm_state: dict, warm_val_loss: float, work_dir: Path, timeout: float, log=print, inner_phase: str = "steps") -> dict:
    """Run the swarm until every replica has done settings.outer_steps outer steps (or fail
    within `timeout` s); leaves no process behind. `inner_phase`: the run's (arm u: "time")."""
    if settings.eval_seed != EVAL_SEED:
        raise ArmFailed(f"replicas evaluate with seed {EVAL_SEED}; eval_seed {settings.eval_seed} would compare other windows")
    n, last = settings.replicas, settings.outer_steps
    shutil.rmtree(work_dir, ignore_errors=True)  # a stale stats file must not look like progress
    work_dir.mkdir(parents=True)
    coord_dir = work_dir / "coordinator"
    write_warm_checkpoint(coord_dir, settings, warm_state)
    swarm_id = f"convergence-{os.getpid()}-{int(time.time())}"
    port, http_port = free_port(), free_port()
    env = thread_env(settings.threads)
    procs: list[_Proc] = []
    seen: list[dict[int, dict]] = [{} for _ in range(n)]  # replica -> outer step -> its history entry
    latest: list[dict] = [{} for _ in range(n)]  # replica -> its last stats file
    t0, started = time.monotonic(), time.time()
    deadline = t0 + timeout
    clean = True
    progress: list = []
    try:
        coord = _Proc("coordinator", [_script("swarmtrain-coordinator"), *coordinator_args(settings, coord_dir, port, http_port, swarm_id, inner_phase)],
                      work_dir / "coordinator.log", env)  # fmt: skip
        procs.append(coord)
        maddr = _coordinator_maddr(coord, http_port, t0 + 120)
        log(f"[swarm] coordinator up at {maddr}; starting {n} replicas")
        node_dirs = [work_dir / f"node{r}" for r in range(n)]
        for r in range(n):
            argv = [_script("swarmtrain-node"), *node_args(settings, node_dirs[r], r, maddr, swarm_id)]
            procs.append(_Proc(f"node{r}", argv, work_dir / f"node{r}.log", env))
        reported = -1
        while True:
            for r in range(n):
                stats = _read_stats(node_dirs[r] / "replica-stats.json")
                if not isinstance(stats, dict):
                    continue
                latest[r] = stats
                for entry in stats.get("history") or [stats]:  # history: every step so far; else the latest
                    if isinstance(entry, dict) and isinstance(entry.get("outer_step"), int):
                        seen[r].setdefault(entry["outer_step"], entry)
            done = min((max(s, default=-1) for s in seen), default=-1)
            if done > reported and done > 0:
                reported = done
                v = _val_at(seen, done)
                log(f"[swarm] outer step {done}/{last} on every replica ({time.monotonic() - t0:.0f} s), val {v}")
            if done >= last:
                break
            for p in procs:
                if not p.alive():
                    raise ArmFailed(f"{p.name} exited with {p.popen.returncode} at outer step {done}:\n{_tail(p.log_path)}")
            if time.monotonic() > deadline:
                raise ArmFailed(f"the swarm reached outer step {done} of {last} in {timeout:.0f} s; node0 log:\n{_tail(procs[1].log_path)}")
            time.sleep(0.2)
        seconds = time.monotonic() - t0
        try:
            progress = _status(http_port).get("progress", [])
        except (urllib.error.URLError, ConnectionError, OSError, ValueError):
            progress = []
    finally:
        for p in procs[1:]:  # replicas first (they leave the swarm), then the coordinator
            clean &= p.stop(30)
        if procs:
            clean &= procs[0].stop(15)

    result = _result(settings, seen, latest, warm_val_loss, progress, seconds, clean)
    for point in result["curve"][1:]:  # when each outer step was reached, from the start of the arm
        entry = next((sn[point["step"] // settings.inner_steps] for sn in seen if point["step"] // settings.inner_steps in sn), {})
        if isinstance(entry.get("time"), (int, float)):
            point["seconds"] = round(entry["time"] - started, 2)
    if inner_phase != "steps":
        result.update(arm="u", name=result["name"] + f", inner phase {inner_phase}")
    return result


def _val_at(seen: list[dict[int, dict]], k: int) -> float | None:
    """Validation loss of the outer state after step k: replica 0's, or the first replica's that
    evaluated it (one that caught up by downloading the state records no loss for that step)."""
    for s in seen:
        v = s.get(k, {}).get("val_loss")
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _result(settings: Settings, seen: list[dict[int, dict]], latest: list[dict], warm_val_loss: float,
            progress: list, seconds: float, clean: bool) -> dict:  # fmt: skip
    n, last, h = settings.replicas, settings.outer_steps, settings.inner_steps
    start = _val_at(seen, 0)
    curve = [{"step": 0, "val_loss": warm_val_loss if start is None else start}]
    missing, disagree, degraded, caught_up, failed = [], [], [], [], []
    members_per_round = []
    for k in range(1, last + 1):
        entries = {r: s[k] for r, s in enumerate(seen) if k in s}
        if not entries:  # a round that failed for everyone: the replicas moved on without an outer step
            failed.append(k)
        hashes = {e.get("state_hash") for e in entries.values()}
        if len(hashes) > 1:
            disagree.append({"outer_step": k, "hashes": sorted(map(str, hashes))})
        members = [e["members"] for e in entries.values() if isinstance(e.get("members"), int)]
        members_per_round.append(min(members, default=0))
        if members and min(members) < n:
            degraded.append({"outer_step": k, "members": min(members)})
        caught_up += [{"outer_step": k, "replica": r} for r, e in entries.items() if "caught_up_from" in e]
        v = _val_at(seen, k)
        if v is None:
            missing.append(k)
        else:
            curve.append({"step": k * h, "val_loss": v})

    def sent(r: int) -> int:  # cumulative: the largest count any of its entries carries
        counts = [e.get("bytes_sent") for e in [latest[r], *seen[r].values()]]
        return max((int(c) for c in counts if isinstance(c, (int, float))), default=0)

    final_hashes = {latest[r].get("state_hash") for r in range(n)}
    train = [{"step": k * h, "train_loss": e["train_loss"]} for k, e in sorted(seen[0].items())
             if k > 0 and isinstance(e.get("train_loss"), (int, float))]  # fmt: skip
    result = {
        "arm": "b",
        "name": f"swarmtrain: coordinator + {n} swarmtrain-node replicas on loopback (DiLoCo, {settings.codec})",
        "curve": curve,
        "train_curve": train,
        "bytes_sent_per_node": [sent(r) for r in range(n)],
        "bytes_source": "measured: each replica's averager report (bytes_sent), summed over its rounds",
        "state_hash": latest[0].get("state_hash"),
        "final_state_hashes_agree": len(final_hashes) == 1,
        "members_per_round": members_per_round,  # 0: failed for everyone, or only catch-ups recorded
        "coordinator_progress": progress[-(4 * last):],
        "seconds": round(seconds, 2),
        "clean_shutdown": clean,
    }
    for key, value in (("missing_outer_steps", missing), ("failed_rounds", failed), ("hash_disagreements", disagree),
                       ("degraded_rounds", degraded), ("caught_up", caught_up)):  # fmt: skip
        if value:
            result[key] = value
    return result
