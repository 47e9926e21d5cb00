"""`python -m node.demo`: a whole local swarm on this machine — a coordinator and N replica nodes
training the built-in model on the built-in corpus on CPU — that shows validation loss falling
and stops by itself. `--mode pipeline`: the model cut into stages instead, stage servers and
trainers; it shows the training loss falling and each stage's hash. `--mode experts`: the
mixture-of-experts model, its experts in shards on expert hosts, trainers calling them; it shows
the training loss falling and each shard's hash. `--model DIR`: the replicas (or the pipeline's
stages) train a Hugging Face model directory (e.g. examples/tiny-gpt2) instead, and the demo ends
by exporting the trained model and printing a sample of it.

Every process is a real daemon started from its console script, talking over real libp2p on
loopback; this script only starts them, watches the coordinator's /status, and stops them
(SIGTERM, then whatever is left of their sessions). Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from node.runconfig import MODEL_PRESETS

CHECKPOINT_EVERY = 4  # outer steps between two kept checkpoints of a replica demo
LAST_CHECKPOINT_WAIT_S = 30.0  # how long the demo waits for the checkpoints it exports (see `kept`) before it exports the newest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


class Procs:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "wb")
        p = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append((name, p))
        return p

    def stop(self, timeout: float = 20.0, nodes_only: bool = False) -> None:
        """Nodes first (they deregister with the coordinator), then the coordinator (`nodes_only`:
        not yet: the model is taken out of its checkpoints, and the coordinator tells which)."""
        groups = [self.procs[1:]] if nodes_only else [self.procs[1:], self.procs[:1]]
        for group in groups:
            for _, p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for _, p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for _, p in (p for group in groups for p in group):  # whatever is left of each session (daemon, DHT child, p2pd)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.poll() is None:
                p.wait(5)


def get_status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def start_coordinator(procs: Procs, run_dir: Path, http: int, p2p: int, t0: float, *run: str) -> str:
    """Start the coordinator with the run's flags and wait for its /status; its multiaddr."""
    procs.start(
        "coordinator", script("swarmtrain-coordinator"),
        "--data-dir", str(run_dir / "coordinator"), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{p2p}", "--http", f"127.0.0.1:{http}", *run,
    )  # fmt: skip
    status = None
    while status is None:
        if time.monotonic() - t0 > 120:
            raise SystemExit(f"the coordinator did not start; see {run_dir}/coordinator.log")
        time.sleep(0.5)
        status = get_status(http)
    print(f"coordinator up: dashboard at http://127.0.0.1:{http}/ (JSON at /status)")
    return status["maddrs"][0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--outer-steps", type=int, default=12, help="outer steps to train before stopping")
    ap.add_argument("--inner-steps", type=int, default=25, help="H: inner steps per outer step")
    ap.add_argument("--model", default="", help="a preset: tiny (replicas' default), small (pipeline's), tiny-moe (experts'), small-moe; "
                    "or a Hugging Face model directory (replicas or pipeline), e.g. examples/tiny-gpt2: the demo ends with a sample of the exported model")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--run-dir", default="", help="where logs and data go (default runs/demo-<time>)")
    ap.add_argument("--timeout-s", type=float, default=900, help="give up after this long")
    pipe = ap.add_argument_group("--mode pipeline")
    ap.add_argument("--mode", default="replica", choices=["replica", "pipeline", "experts"], help="replicas (DiLoCo), a pipeline of stages, or expert hosts")
    pipe.add_argument("--stages", type=int, default=3, help="stages the model is cut into (--mode experts: shards of the experts, default 2)")
    pipe.add_argument("--peers-per-stage", type=int, default=1, help="peers per stage (--mode experts: hosts per shard)")
    pipe.add_argument("--trainers", type=int, default=1)
    pipe.add_argument("--micro-batches", type=int, default=320, help="micro-batches (of 8 sequences) each trainer sends before stopping")
    pipe.add_argument("--activation-codec", default="none", choices=["none", "fp16", "int8"])
    args = ap.parse_args(argv)
    if args.replicas < 1 or args.outer_steps < 1:
        ap.error("--replicas and --outer-steps must be at least 1")
    if args.model not in ("", *MODEL_PRESETS):
        args.model = model_dir_arg(ap, args)
    if args.mode == "experts":
        args.model = args.model or "tiny-moe"
        if not args.model.endswith("-moe"):
            ap.error(f"--mode experts trains a mixture-of-experts model (tiny-moe | small-moe), not {args.model}")
        if "--stages" not in (argv if argv is not None else sys.argv):
            args.stages = 2
        from node.models.moe import MOE_PRESETS

        experts = MOE_PRESETS[args.model][1].num_experts
        if not 1 <= args.stages <= experts or min(args.peers_per_stage, args.trainers, args.micro_batches) < 1:
            ap.error(f"--stages (shards) must be in 1..{experts}; --peers-per-stage, --trainers and --micro-batches at least 1")
        return main_pipeline(args)
    if args.mode == "pipeline":
        if min(args.stages, args.peers_per_stage, args.trainers, args.micro_batches) < 1:
            ap.error("--stages, --peers-per-stage, --trainers and --micro-batches must be at least 1")
        if args.model.endswith("-moe"):
            ap.error(f"--model {args.model} is a mixture of experts: run it with --mode experts")
        blocks = model_blocks(args.model or "small")
        if args.stages > blocks:
            ap.error(f"--stages {args.stages}: the {args.model or 'small'} model has {blocks} blocks, and every stage holds at least one")
        return main_pipeline(args)
    args.model = args.model or "tiny"

    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    http, p2p = free_port(), free_port()
    procs = Procs(run_dir)
    t0 = time.monotonic()
    print(f"swarmtrain demo: a coordinator and {args.replicas} replicas on this machine; logs in {run_dir}/")
    try:
        maddr = start_coordinator(
            procs, run_dir, http, p2p, t0,
            "--model", args.model, "--inner-steps", str(args.inner_steps), "--max-outer-steps", str(args.outer_steps),
            "--checkpoint-every", str(CHECKPOINT_EVERY), "--codec", args.codec, "--min-replicas", str(args.replicas), "--warmup-steps", "20",
            "--total-steps", str(args.outer_steps * args.inner_steps), "--join-timeout-s", "20",
        )  # fmt: skip
        for i in range(args.replicas):
            procs.start(
                f"replica{i}", script("swarmtrain-node"),
                "--data-dir", str(run_dir / f"replica{i}"), "--initial-peers", maddr, "--threads", "1",
                "--shard-index", str(i), "--num-shards", str(args.replicas), "--bandwidth-mbps", "1000",
            )
        done = watch(http, args, run_dir, t0, procs)
        if done == 0 and args.model not in MODEL_PRESETS:
            return take_out(http, args, run_dir, procs)
        return done
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm")
        return 130
    finally:
        procs.stop()
        print(f"all processes stopped ({time.monotonic() - t0:.0f} s in all)")


def model_dir_arg(ap, args) -> str:
    """--model as a Hugging Face model directory, checked (ap.error otherwise); its absolute path."""
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: neither a preset ({', '.join(MODEL_PRESETS)}) nor a Hugging Face model directory (with a config.json)")
    if args.mode == "experts":
        ap.error(f"--model {args.model}: the demo trains a Hugging Face model on replicas or in a pipeline (--mode replica | pipeline)")
    return str(Path(args.model).resolve())


def model_blocks(model: str) -> int:
    """The blocks (decoder layers) a pipeline cuts: a preset's, or a model directory's."""
    if model in MODEL_PRESETS:
        from node.models.gpt import PRESETS

        return PRESETS[model].n_layer
    from node.models.hf import ModelDirError, open_model_dir
    from node.models.hf_stages import dims_of

    try:
        return dims_of(open_model_dir(model)).n_layer
    except ModelDirError as e:
        raise SystemExit(f"--model: {e}") from None


def take_out(http: int, args, run_dir: Path, procs: Procs) -> int:
    """The run's model out: its newest kept checkpoint exported as a Hugging Face directory, and
    a sample of it (as `swarmtrain-model export` and `sample` do). The nodes stop first: trainers
    of a pipeline train on until stopped, and neither their compute nor newer checkpoints should
    come between the export and what it reads."""
    from node.model_cli import main as model_cli

    deadline = time.monotonic() + LAST_CHECKPOINT_WAIT_S
    while not kept(get_status(http) or {}, args) and time.monotonic() < deadline:
        time.sleep(0.5)
    procs.stop(nodes_only=True)
    out = run_dir / "model"
    if model_cli(["export", "--checkpoint", str(run_dir / "coordinator"), "--out", str(out)]) != 0:
        return 1
    print(f"a sample of it (swarmtrain-model sample --model {out}):", flush=True)
    return model_cli(["sample", "--model", str(out), "--prompt", "def ", "--max-new-tokens", "120", "--seed", "0"])


def kept(status: dict, args) -> bool:
    """Whether the coordinator keeps what the demo exports: the last outer step's checkpoint
    (replicas), or a checkpoint of every stage after its first sync (a pipeline)."""
    if args.mode == "pipeline":
        stages = status.get("stages", {})
        return len(stages) == args.stages and all(any(c["step"] > 0 for c in v["checkpoints"]) for v in stages.values())
    return args.outer_steps in [c["step"] for c in status.get("checkpoints", [])]


def replica_histories(run_dir: Path) -> dict[str, dict[int, dict]]:
    """replica name -> outer step -> what it recorded there (state hash; val loss, unless it took
    that step's state from a peer), from each replica's stats file; replicas whose files are not
    there yet are left out."""
    out: dict[str, dict[int, dict]] = {}
    for stats in run_dir.glob("replica*/replica-stats.json"):
        try:
            history = json.loads(stats.read_text())["history"]
        except (OSError, ValueError, KeyError):
            continue
        out[stats.parent.name] = {e["outer_step"]: e for e in history if "state_hash" in e}
    return out


def step_row(step: int, replicas: int, recorded: list[dict]) -> tuple[float, str] | None:
    """The demo's line for an outer step every replica has reached, from what the replicas
    recorded at it; None until one recorded its validation loss there."""
    losses = [e["val_loss"] for e in recorded if e.get("val_loss") is not None]
    if not losses:
        return None
    hashes = [e["state_hash"] for e in recorded]
    if len(set(hashes)) > 1:
        same = f"{len(set(hashes))} different"
    elif len(hashes) == replicas:
        same = "identical"
    else:
        same = f"identical in the {len(hashes)} replicas seen at this step"
    return losses[0], f"{step:>10} {losses[0]:>9.4f} {replicas:>8}  {hashes[0]} ({same})"


def watch(http: int, args, run_dir: Path, t0: float, procs: Procs) -> int:
    """A line per outer step (every one, however quick: from the replicas' own records, which
    the coordinator's heartbeats may skip), until the run's last."""
    shown, first_loss = -1, None
    print(f"{'outer step':>10} {'val loss':>9} {'replicas':>8}  outer-state hash")
    while time.monotonic() - t0 < args.timeout_s:
        for name, p in procs.procs:
            if p.poll() is not None:
                print(f"{name} exited with code {p.returncode}; see {run_dir}/{name}.log")
                return 1
        status = get_status(http)
        time.sleep(0.25)
        replicas = [m for m in status["members"] if m["role"] == "replica"] if status else []
        if not replicas:
            continue
        histories = replica_histories(run_dir)
        reached = min(m["step"] or 0 for m in replicas)
        for step in range(shown + 1, reached + 1):
            recorded = [h[step] for h in histories.values() if step in h]
            # every replica's record of it, or what there is once the swarm is two steps on
            row = step_row(step, len(replicas), recorded) if len(recorded) >= len(replicas) or reached >= step + 2 else None
            if row is None:
                break  # not on disk yet: the next look
            loss, line = row
            first_loss = loss if first_loss is None else first_loss
            print(line, flush=True)
            shown = step
            if step >= args.outer_steps:
                deadline = time.monotonic() + LAST_CHECKPOINT_WAIT_S
                while not kept(status, args) and time.monotonic() < deadline:  # its upload may trail the step
                    time.sleep(0.25)
                    status = get_status(http) or status
                ckpts = [c["step"] for c in status["checkpoints"]]
                print(
                    f"done: validation loss {first_loss:.3f} -> {loss:.3f} after {step} outer steps "
                    f"({step * args.inner_steps} inner steps per replica, {len(replicas)} replicas, "
                    f"{time.monotonic() - t0:.0f} s); checkpoints kept at steps {ckpts}"
                )
                return 0
    print(f"gave up after {args.timeout_s:.0f} s; see the logs in {run_dir}/")
    return 1


def main_pipeline(args) -> int:
    """Coordinator, stage servers or expert hosts (placed by the coordinator), then trainers;
    stops once every trainer sent its micro-batches."""
    run_dir = Path(args.run_dir or f"runs/demo-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    http, p2p = free_port(), free_port()
    procs = Procs(run_dir)
    t0 = time.monotonic()
    model = args.model or "small"
    servers = args.stages * args.peers_per_stage
    experts = args.mode == "experts"
    kind, slots = ("expert-host", "expert_shards") if experts else ("stage-server", "stages")
    what = f"{args.stages} shards of the {model} model's experts" if experts else f"{args.stages} stages of the {model} model"
    print(f"swarmtrain demo: a coordinator, {servers} {kind}s ({what}) and {args.trainers} trainer(s); logs in {run_dir}/")
    split = ["--mode", "experts", "--expert-shards", str(args.stages)] if experts else ["--mode", "pipeline", "--num-stages", str(args.stages)]
    try:
        maddr = start_coordinator(
            procs, run_dir, http, p2p, t0,
            *split, "--model", model, "--batch-size", "8", "--stage-step-samples", "32", "--checkpoint-every", "1",
            "--warmup-steps", "5", "--stage-sync-every-s", "5", "--activation-codec", args.activation_codec, "--codec", args.codec,
        )  # fmt: skip
        node = ["--initial-peers", maddr, "--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "1"]
        for i in range(servers):
            procs.start(f"{kind}{i}", script("swarmtrain-node"), "--data-dir", str(run_dir / f"{kind}{i}"), *node)
        while sum(len(v["peers"]) for v in (get_status(http) or {}).get(slots, {}).values()) < servers:
            if time.monotonic() - t0 > 180:
                raise SystemExit(f"the {kind}s did not all get a {'shard' if experts else 'stage'}; see {run_dir}/")
            time.sleep(0.5)
        for i in range(args.trainers):
            procs.start(
                f"trainer{i}", script("swarmtrain-node"), "--data-dir", str(run_dir / f"trainer{i}"), *node,
                "--wanted-role", "trainer", "--shard-index", str(i), "--num-shards", str(args.trainers),
            )  # fmt: skip
        done = watch_pipeline(http, args, run_dir, t0, procs)
        if done == 0 and model not in MODEL_PRESETS:
            return take_out(http, args, run_dir, procs)
        return done
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm")
        return 130
    finally:
        procs.stop()
        print(f"all processes stopped ({time.monotonic() - t0:.0f} s in all)")


def watch_pipeline(http: int, args, run_dir: Path, t0: float, procs: Procs) -> int:
    def trainer_stats() -> list[dict]:
        out = []
        for i in range(args.trainers):
            try:
                out.append(json.loads((run_dir / f"trainer{i}" / "trainer-stats.json").read_text()))
            except (OSError, ValueError):
                out.append({})
        return out

    slots = "expert_shards" if args.mode == "experts" else "stages"
    print(f"{'micro-batches':>13} {'train loss':>10} {'samples/s':>9}  {'shards' if args.mode == 'experts' else 'stages'} (peers: hashes)")
    shown, first_loss, every = 0, None, max(8, args.micro_batches // 10 // 8 * 8)
    while time.monotonic() - t0 < args.timeout_s:
        for name, p in procs.procs:
            if p.poll() is not None:
                print(f"{name} exited with code {p.returncode}; see {run_dir}/{name}.log")
                return 1
        time.sleep(0.5)
        stats, status = trainer_stats(), get_status(http)
        if status is None or not all(st.get("history") for st in stats):
            continue
        done = min(st["micro_batches"] for st in stats)
        if done < shown + every and done < args.micro_batches:
            continue
        shown = done
        loss = sum(st["loss"] for st in stats) / len(stats)
        if first_loss is None:  # the trainers' first report (the first row shown may come later)
            firsts = [st.get("first_loss") for st in stats]
            first_loss = sum(firsts) / len(firsts) if None not in firsts else loss
        rate = sum(st.get("samples_per_second") or 0 for st in stats)
        stages = "  ".join(
            f"{s}: {len(v['peers'])} {'/'.join(h[:8] for h in v['state_hashes']) or '-'}"
            for s, v in sorted(status[slots].items(), key=lambda kv: int(kv[0].removeprefix("shard")))
        )
        print(f"{done:>13} {loss:>10.4f} {rate:>9.1f}  {stages}", flush=True)
        if done >= args.micro_batches:
            lost = sum(st.get("lost", 0) for st in stats)
            gone = f"{lost} lost" if args.mode == "pipeline" else f"{sum(st.get('skipped_experts', 0) for st in stats)} experts skipped"
            print(f"done: training loss {first_loss:.3f} -> {loss:.3f} after {done} micro-batches per trainer ({gone}, {time.monotonic() - t0:.0f} s)")
            return 0
    print(f"gave up after {args.timeout_s:.0f} s; see the logs in {run_dir}/")
    return 1


if __name__ == "__main__":
    sys.exit(main())
