"""bench/models.py's swarm arms: real coordinator and node daemons on loopback (tests/swarm.py
starts them, each in its own session; `Swarm.close` kills what is left of every session).

    run_daemon          a node with no coordinator of its swarm to join: it never gets a role
    run_replica         a coordinator and one replica (min_replicas 1): its inner steps' tokens/s
    run_pipeline_swarm  a coordinator, one stage server per stage, one trainer, synchronous steps
    run_joiner          two replicas train (--joiner-replicas); one more joins: its start to its
                        first outer step, its state download
    run_checkpoint      the coordinator's kept checkpoint written again by CheckpointStore.save,
                        and `swarmtrain-model export` of the coordinator's data dir

Each arm's memory watch samples every daemon's process tree (node, DHT child, p2pd).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.memory import available_mib
from bench.models_settings import REPORT, ROOT, Settings
from tests.swarm import ProcessExited, Swarm, wait_for

POLL_S = 0.05  # how often the joiner's downloads are looked at
LOW_MEMORY_MIB = 1024  # an arm is stopped when the machine has less left


def _node(s: Settings, level: str = "INFO") -> list[str]:
    return ["--threads", str(s.threads), "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "1", "--log-level", level]


def _replicas(s: Settings, min_replicas: int, max_outer: int) -> list[str]:
    """The replica run: no checkpoint upload while timing (the seeded init is checkpoint 0)."""
    return ["--inner-steps", str(s.inner_steps), "--batch-size", str(s.batch_size), "--eval-batches", "1", "--min-replicas", str(min_replicas),
            "--max-outer-steps", str(max_outer), "--checkpoint-every", "100000", "--join-timeout-s", str(s.join_timeout_s),
            "--heartbeat-timeout-s", "120", "--seed", str(s.seed)]  # fmt: skip


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _alive(*procs) -> bool:
    """True while every process runs and the machine has memory left; ProcessExited otherwise (an
    arm whose processes take the machine's last memory is stopped before it swaps or kills)."""
    if (left := available_mib()) < LOW_MEMORY_MIB:
        raise ProcessExited(f"stopped: the machine has {left} MiB of memory left")
    for p in procs:
        if not p.alive():
            raise ProcessExited(f"{p.name} exited: {' | '.join(p.log().strip().splitlines()[-6:])[-1500:]}")
    return True


def _coordinator(sw: Swarm, watch, *run: str) -> tuple:
    coord = sw.coordinator("coordinator", None, None, *run)
    watch.watch("coordinator", coord.proc.popen.pid)
    return coord, coord.wait_ready(120)["maddrs"][0]


def run_daemon(s: Settings, work: Path, watch) -> dict:
    sw = Swarm(_fresh(work))
    try:
        # its way into the DHT: the coordinator of another swarm (a node needs an initial peer),
        # so it finds no coordinator of its own swarm and never gets a role
        elsewhere = sw.coordinator("elsewhere", None, None, "--swarm-id", "bench-elsewhere")
        node = sw.node("daemon", [elsewhere.wait_ready(120)["maddrs"][0]], *_node(s))
        watch.watch("daemon", node.popen.pid)
        wait_for(lambda: _alive(node) and "capabilities:" in node.log(), 120, "the daemon to start")
        t_end = time.monotonic() + s.daemon_window_s  # a measuring window, not a wait for a state
        while time.monotonic() < t_end:
            _alive(node)
            time.sleep(0.5)
        roles = sorted(p.name.removesuffix("-stats.json") for p in (sw.tmp / "daemon").glob("*-stats.json") if p.name != "transport-stats.json")
        return {"memory": watch.forget("daemon"), "sampled_s": s.daemon_window_s, "roles_taken": roles}
    finally:
        sw.close()


def _history(work: Path, name: str) -> list[dict]:
    return _json(work / name / "replica-stats.json").get("history", [])


def run_replica(s: Settings, model_dir: Path, work: Path, watch) -> dict:
    """tokens/s of the replica's timed rounds (all but its first): their inner steps' tokens over
    the inner steps' time, as the replica records each round (node/roles/replica.py)."""
    sw = Swarm(_fresh(work))
    try:
        coord, maddr = _coordinator(sw, watch, "--model", str(model_dir), *_replicas(s, 1, s.rounds))
        # a round of one (min_group_size 1): the replica averages alone, as it would with others
        r = sw.node("replica", [maddr], *_node(s), "--shard-index", "0", "--num-shards", "1", "--min-group-size", "1")
        watch.watch("replica", r.popen.pid)
        wait_for(lambda: _alive(r, coord.proc) and _json(sw.tmp / "replica" / "replica-stats.json").get("outer_step", 0) >= s.rounds,
                 s.timeout_s, f"the replica's {s.rounds} outer steps")  # fmt: skip
        memory, coord_memory = watch.forget("replica"), watch.forget("coordinator")
    finally:
        sw.close()
    rounds = [e for e in _history(sw.tmp, "replica") if e.get("tokens_per_s") and e["outer_step"] > 1]
    if len(rounds) < s.rounds - 1:
        raise RuntimeError(f"{s.rounds - 1 - len(rounds)} of the replica's timed outer steps did not average: {r.log().strip().splitlines()[-3:]}")
    tokens = s.inner_steps * s.batch_size * s.seq_len
    seconds = sum(tokens / e["tokens_per_s"] for e in rounds)
    return {"tokens_per_s": len(rounds) * tokens / seconds, "timed_outer_steps": len(rounds), "memory": memory, "coordinator_memory": coord_memory}


def run_pipeline_swarm(s: Settings, model_dir: Path, work: Path, watch) -> dict:
    """tokens/s between the trainer's first loss report (REPORT micro-batches) and the one after
    the timed steps (node/roles/stats.py LossLog: one history entry every REPORT micro-batches)."""
    sw = Swarm(_fresh(work))
    m = s.step_micro_batches
    run = ["--mode", "pipeline", "--model", str(model_dir), "--num-stages", str(s.stages), "--batch-size", str(s.batch_size),
           "--stage-step-samples", str(m * s.batch_size), "--micro-batches-in-flight", str(m), "--synchronous-steps",
           "--stage-clip", s.stage_clip, "--heartbeat-timeout-s", "120", "--seed", str(s.seed), *(["--stage-blocks", s.stage_blocks] if s.stage_blocks else [])]  # fmt: skip
    names = [f"s{i}" for i in range(s.stages)]
    try:
        coord, maddr = _coordinator(sw, watch, *run)
        servers = [sw.node(n, [maddr], *_node(s, "WARNING")) for n in names]
        # (the trainer waits for a peer of every stage; it is timed from its first loss report on)
        t = sw.node("trainer", [maddr], *_node(s), "--wanted-role", "trainer", "--shard-index", "0", "--num-shards", "1")
        for n, p in [*zip(names, servers), ("trainer", t)]:
            watch.watch(n, p.popen.pid)
        want = s.pipeline_micro_batches
        trainer = lambda: _json(sw.tmp / "trainer" / "trainer-stats.json")  # noqa: E731
        wait_for(lambda: _alive(t, coord.proc, *servers) and trainer().get("micro_batches", 0) >= want, s.timeout_s, f"{want} micro-batches through the pipeline")
        stage_of = lambda n: _json(sw.tmp / n / "stage-stats.json").get("stage")  # noqa: E731
        stats = trainer()
        h = {e["micro_batches"]: e["time"] for e in stats["history"]}
        watch.sample()  # (one sample after the window's end)
        tokens = (want - REPORT) * s.batch_size * s.seq_len
        cpu = _cpu_in_window(watch, [*names, "trainer", "coordinator"], h[REPORT], h[want], tokens)
        memory = {n: watch.forget(n) for n in [*names, "trainer"]}
        stages = {n: stage_of(n) for n in names}
    finally:
        sw.close()
    servers_out = sorted(({"stage": stages[n], "memory": memory[n]} for n in names), key=lambda r: r["stage"])
    return {"tokens_per_s": tokens / (h[want] - h[REPORT]), "final_loss": stats["loss"], "lost_micro_batches": stats["lost"], "retried_calls": stats.get("retries"),
            "cpu_in_window": cpu, "stage_servers": servers_out, "trainer": {"memory": memory["trainer"]}}  # fmt: skip


def _cpu_in_window(watch, names: list[str], t0: float, t1: float, tokens: int) -> dict:
    """CPU seconds every process of the swarm used over the timed window (its trees sampled by the
    watch: the span measured is the samples' around the window, up to a sample interval wider)."""
    got = watch.cpu_between(names, t0, t1)
    span = got["to"] - got["from"]
    return {"window_s": round(t1 - t0, 2), "cpu_s": got["cpu_s"], "sampled_span_s": round(span, 2), "cores_busy": round(got["cpu_s"] / span, 3),
            "cpu_s_per_1k_tokens": round(got["cpu_s"] / (tokens * span / (t1 - t0)) * 1000, 3),
            "by_tree": got["by_tree"], "by_tree_note": "root_cpu_s: the daemon's own process; the rest of a tree's: its DHT child and p2pd"}  # fmt: skip


def _download_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class DownloadClock:
    """The first state download of a node, timed from outside: its downloads directory
    (node/roles/slot_state.py: removed once the state is loaded) watched every POLL_S seconds.
    From the first byte seen to the last byte's arrival."""

    def __init__(self, path: Path):
        self.path, self.first, self.last, self.bytes, self.done = path, None, None, 0, False

    def poll(self) -> None:
        if self.done:
            return
        now, got = time.time(), _download_bytes(self.path)
        if got > self.bytes:
            self.first = self.first or now
            self.bytes, self.last = got, now
        elif self.bytes and got < self.bytes:  # removed: loaded (or failed) — the first download is over
            self.done = True

    def result(self, t0: float) -> dict:
        """What it saw; the download's start in seconds after `t0` (time.time())."""
        if not self.bytes or self.last == self.first:
            return {"state_bytes": self.bytes, "seconds_to_download_start": None, "download_s": None, "download_mb_per_s": None}
        seconds = self.last - self.first
        return {"state_bytes": self.bytes, "seconds_to_download_start": round(self.first - t0, 2), "download_s": round(seconds, 3),
                "download_mb_per_s": round(self.bytes / 1e6 / seconds, 1)}  # fmt: skip


def run_joiner(s: Settings, model_dir: Path, work: Path, watch) -> dict:
    """`joiner_replicas` replicas train; once they finished an outer step together, one more
    starts: the time from its process start to its first outer step averaged with the others (the
    first history entry of a round it took part in: node/roles/replica.py)."""
    sw = Swarm(_fresh(work))
    n = s.joiner_replicas
    shards = ["--num-shards", str(n + 1)]
    alone = ["--min-group-size", "1"] if n == 1 else []  # one replica's rounds before the joiner comes: rounds of one
    try:
        coord, maddr = _coordinator(sw, watch, "--model", str(model_dir), *_replicas(s, n, 0))
        first = [sw.node(f"r{i}", [maddr], *_node(s), "--shard-index", str(i), *shards, *alone) for i in range(n)]
        watch.watch("r0", first[0].popen.pid)
        together = lambda i: any(e.get("members", 0) >= n and e.get("tokens_per_s") for e in _history(sw.tmp, f"r{i}"))  # noqa: E731
        wait_for(lambda: _alive(coord.proc, *first) and all(together(i) for i in range(n)), s.timeout_s, "an outer step of the first replicas together")
        clock = DownloadClock(sw.tmp / "joiner" / "downloads")
        t0 = time.time()
        joiner = sw.node("joiner", [maddr], *_node(s), "--shard-index", str(n), *shards, *alone)
        watch.watch("joiner", joiner.popen.pid)

        def contributed() -> dict | None:
            _alive(joiner, coord.proc, *first)
            clock.poll()
            return next((e for e in _history(sw.tmp, "joiner") if e.get("members", 0) >= 2), None)

        entry = wait_for(contributed, s.timeout_s, "the joiner's first outer step with the others", interval=POLL_S)
        start = next((e for e in _history(sw.tmp, "joiner") if e.get("start")), {})
        took = re.search(r"replica: took outer step (\d+) .* from (\w+)", joiner.log())
        coord_id = coord.status().get("peer_id") or ""
        memory, r0 = watch.forget("joiner"), watch.forget("r0")
    finally:
        sw.close()
    return {
        "seconds_to_first_outer_step": round(entry["time"] - t0, 2), "seconds_to_state_taken": round(start["time"] - t0, 2) if start else None,
        "first_outer_step": entry["outer_step"], "replicas_in_that_step": entry["members"],
        "state_from": None if not took else ("the coordinator" if coord_id and coord_id.endswith(took.group(2)) else "a replica peer"),
        **clock.result(t0), "memory": memory, "first_replica_memory": r0,
    }  # fmt: skip


def run_checkpoint(s: Settings, coordinator_dir: Path, work: Path) -> dict:
    """The newest checkpoint the coordinator kept, loaded (hashes checked), then written again by
    a CheckpointStore in this process (as the coordinator writes one); then exported by the CLI."""
    from coordinator.checkpoints import CheckpointStore
    from node.state.checkpoint_dir import load_checkpoint_dir, read_manifest

    work = _fresh(work)
    latest = max((coordinator_dir / "checkpoints").glob("step-*"))
    manifest = read_manifest(latest)
    state = load_checkpoint_dir(latest)
    store = CheckpointStore(work / "store", keep=1)
    t0 = time.perf_counter()
    info = store.save(manifest["step"], state, manifest.get("model_config"), manifest.get("state_hash"))
    save_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in info.path.iterdir())
    script = Path(sys.executable).parent / "swarmtrain-model"
    t0 = time.perf_counter()
    out = subprocess.run([str(script) if script.exists() else "swarmtrain-model", "export", "--checkpoint", str(coordinator_dir), "--out", str(work / "exported")],
                         cwd=ROOT, capture_output=True, text=True, timeout=s.timeout_s, start_new_session=True)  # fmt: skip
    export_s = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"swarmtrain-model export failed ({out.returncode}): {out.stderr.strip()[-1500:]}")
    exported = sum(f.stat().st_size for f in (work / "exported").iterdir())
    return {"step": manifest["step"], "checkpoint_bytes": size, "save_s": round(save_s, 3), "save_mb_per_s": round(size / 1e6 / save_s, 1),
            "export_s": round(export_s, 3), "exported_bytes": exported}  # fmt: skip


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path
