"""bench/pipeline.py's swarm arms — (c), (d), (e), (f): a coordinator in pipeline mode, stage
servers and trainers as real daemons (in network namespaces behind shaped links for (f)), driven
until every trainer has its samples, with a stage peer killed and restarted now and then for
(e); the row: samples/s, final loss, bytes per sample, lost micro-batches, kills, clips."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from bench.pipeline import REPORT, WINDOW, Settings, _fresh


def run_swarm(s: Settings, work: Path, peers_per_stage: int, trainers: int, kill: bool, timeout: float, shaped: bool = False) -> dict:
    from tests.swarm import Swarm, wait_for

    work = _fresh(work)
    sw = Swarm(work)
    topo = None
    if shaped:  # (f): every process in its own namespace, behind its own shaped link
        from bench import netns

        netns.check_available()
        netns.remove_stale()
        topo = netns.Topology.create(n_peers=1 + s.stages * peers_per_stage + trainers, rate=s.rate)

    def where(i: int) -> tuple[list[str], list[str]]:
        """(argv prefix, --host-maddrs) of process i (0: the coordinator)."""
        if topo is None:
            return [], []
        return topo.wrap(i, []), ["--host-maddrs", f"/ip4/{topo.ip(i)}/tcp/0"]

    node = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "1", "--log-level", "WARNING"]
    try:
        maddr = _coordinator(sw, s, work, topo, where)
        n_servers = s.stages * peers_per_stage

        def server(i: int):
            return sw.node(f"s{i}", [maddr], *node, *where(1 + i)[1], prefix=where(1 + i)[0])  # (restarted: the same data dir and identity)

        servers = {f"s{i}": server(i) for i in range(n_servers)}
        wait_for(lambda: {_stage_of(work, n) for n in servers} == set(range(s.stages)), 120, "every stage served")
        names = [f"t{i}" for i in range(trainers)]
        # one trainer reads the micro-batches (a) and (b) read, in the same order; two split the data
        shards = ["--num-shards", str(trainers)]
        procs = {
            n: sw.node(n, [maddr], *node, "--wanted-role", "trainer", "--shard-index", str(i), *shards, *where(1 + n_servers + i)[1], prefix=where(1 + n_servers + i)[0])
            for i, n in enumerate(names)
        }
        kills = _train(s, work, names, procs, servers, server if kill else None, timeout)
        return {**_report(s, work, names, servers), "kills": kills}
    finally:
        sw.close()
        if topo is not None:
            topo.destroy()


def _coordinator(sw, s: Settings, work: Path, topo, where) -> str:
    """Start the pipeline run's coordinator; its multiaddr."""
    from tests.swarm import wait_for

    run = [
        "--mode", "pipeline", "--num-stages", str(s.stages), "--model", s.model, "--batch-size", str(s.batch_size),
        "--stage-step-samples", str(s.step_samples), "--micro-batches-in-flight", str(s.in_flight), "--inner-lr", str(s.lr),
        "--warmup-steps", str(s.warmup_steps), "--seed", str(s.seed), "--activation-codec", s.activation_codec,
        "--stage-routing", s.routing, "--stage-clip", s.stage_clip, *(["--synchronous-steps"] if s.synchronous else []),
        "--heartbeat-timeout-s", "10",  # (the coordinator logs at INFO: its address, its plans)
        "--stage-outer-momentum", str(s.outer_momentum), "--stage-sync-every-s", str(s.sync_every_s),
    ]  # fmt: skip
    if topo is None:
        coord = sw.coordinator("coordinator", None, None, *run)
        return coord.wait_ready()["maddrs"][0]
    # the coordinator's status page is inside its namespace: its address comes from its log
    prefix, host = where(0)
    coord = sw.start("coordinator", "swarmtrain-coordinator", "--data-dir", str(work / "coordinator"), *host, "--http", "", *run, prefix=prefix)
    found = wait_for(lambda: re.search(rf"/ip4/{re.escape(topo.ip(0))}/tcp/\d+/p2p/\w+", coord.log()), 60, "the coordinator's address")
    return found.group(0)


def _stats(work: Path, name: str, kind: str = "trainer") -> dict:
    try:
        return json.loads((work / name / f"{kind}-stats.json").read_text())
    except (OSError, ValueError):
        return {}


def _stage_of(work: Path, name: str) -> int | None:
    return _stats(work, name, "stage").get("stage")


def _train(s: Settings, work: Path, names: list[str], procs: dict, servers: dict, restart, timeout: float) -> int:
    """Until every trainer has its samples; with `restart` (e), a stage peer is SIGKILLed and
    started again every kill_every_s. The kills made."""
    per_trainer = s.samples // len(names)
    kills, next_kill, victim_i = 0, time.monotonic() + s.kill_every_s, 0
    deadline = time.monotonic() + timeout
    while min(done := [_stats(work, n).get("samples", 0) for n in names]) < per_trainer:
        if time.monotonic() > deadline or not all(p.alive() for p in procs.values()):
            raise RuntimeError(f"the swarm arm did not reach {per_trainer} samples per trainer in {timeout:.0f} s: {done}")
        # (e): every kill_every_s, and the first by half way at the latest: a run shorter than
        # kill_every_s (a fast machine) would otherwise see no kill at all and measure (d)
        if restart and (time.monotonic() >= next_kill or (kills == 0 and min(done) >= per_trainer // 2)):
            name = f"s{victim_i % len(servers)}"
            victim_i += 1
            servers[name].kill()
            servers[name].wait(30)
            servers[name] = restart(int(name[1:]))
            kills += 1
            next_kill = time.monotonic() + s.kill_every_s
        time.sleep(0.5)
    return kills


def _report(s: Settings, work: Path, names: list[str], servers: dict) -> dict:
    """The arm's row from the trainers' and stage servers' stats files."""
    per_trainer = s.samples // len(names)
    rates, losses, lost, nbytes, samples = [], [], 0, 0, 0
    for n in names:
        st = _stats(work, n)
        h = [e for e in st["history"] if e["micro_batches"] * s.batch_size <= per_trainer] or st["history"]
        first, end = st["history"][0], h[-1]
        span = end["time"] - first["time"]
        rates.append((end["micro_batches"] - first["micro_batches"]) * s.batch_size / span if span > 0 else 0.0)
        tail = h[-(WINDOW // REPORT) :]
        losses.append(sum(e["loss"] for e in tail) / len(tail))
        lost += st["lost"]
        nbytes += st["bytes_sent"] + st["bytes_received"]
        samples += st["samples"]
    clips, stale = {"global": 0, "alone": 0}, 0
    # through routing: what each stage's peers sent the next stage (their calls and the
    # answers), per sample that stage trained: bytes and samples from one write of its stats
    # file, which trails the trainers' by up to REPORT_S (a tiny run is over by then)
    by_stage: dict[int, list[int]] = {}
    for n in servers:
        st = _stats(work, n, "stage")
        if not st:
            continue
        got = by_stage.setdefault(st["stage"], [0, 0])
        got[0] += st.get("bytes_sent", 0) + st.get("bytes_received", 0)
        got[1] += st["samples"]
        stale += st["calls"]["stale"]
        for k in clips:
            clips[k] += st["clips"][k]
    per_sample = nbytes / max(samples, 1) + sum(b / n for b, n in by_stage.values() if n)
    return {"samples_per_s": sum(rates), "final_loss": sum(losses) / len(losses), "bytes_per_sample": per_sample, "lost": lost,
            "stale_backwards": stale, "steps_clipped": clips}  # fmt: skip
