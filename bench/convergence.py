"""Convergence benchmark: does DiLoCo over the swarm reach synchronous data parallelism's loss
while sending far fewer bytes?

    python -m bench.convergence --json                  # full run: small preset, 600 + 800 steps, 4 replicas
    python -m bench.convergence --quick --arms a,c      # seconds: tiny preset, 40 + 40 steps, H=10, 2 replicas
    python -m bench.convergence --arms b --out DIR      # one arm; arms already in DIR with equal settings join the summary

Arms on the same model, data shards, seeds and samples per replica, all starting from one
shared warm-start checkpoint (`--warmup-steps` of plain synchronous AdamW on one stream; the
DiLoCo paper also starts from a pretrained model), then `--steps` steps each:

  (a) synchronous data parallelism: N torch.distributed (gloo) processes, gradients all-reduced
      every step (bench/convergence_sync.py). Rank r samples Batches(train, r, N, B, T, seed + r).
  (b) this system: a coordinator and N `swarmtrain-node` replicas on loopback
      (bench/convergence_swarm.py).
  (c) the same DiLoCo algorithm simulated in one process, no network:
      node.models.diloco.simulate_diloco, pseudo-gradients through the codec with error feedback.
  (s) DiLoCo with the sparse codec (chunked top-k, low-bit values; `--sparse-density 1`: every
      value, dense low-bit), simulated in one process through the averager's all-reduce as
      arithmetic (node/models/sim_allreduce.py: sender and owner error feedback, the gather
      sparse too), with its own H and outer step (--sparse-*).
  (u) (b) with the run's `--inner-phase time` (node/roles/budget.py): a replica stops its inner
      steps once half of the replicas wait to average, weighed by its samples. With
      `--slow-replica X` (the last replica of (b) and (u) X times slower) the summary gives the
      seconds each swarm arm took to reach (a)'s final loss, and their ratio.

Every arm uses a fresh AdamW with the same schedule (linear warmup over `--lr-warmup-steps`,
cosine decay over `--steps`, node.models.diloco.lr_at) and is evaluated every H = `--inner-steps` steps
on the same validation windows (node.models.data.evaluate, eval seed 1234): (a) its model, (b) and (c)
the outer parameters.

Bytes are what one node sends after the warm start: (a) the ring all-reduce volume
2(N−1)/N·numel·4 per step; (b) measured by each replica's averager; (c) 2(N−1)/N × the encoded
pseudo-gradient per outer step (what a butterfly all-reduce of it sends: each node scatters
(N−1)/N of its vector and gathers as much back); (s) the payload bytes each member sends in
the simulated all-reduce (its scatter parts, its slice's gather to every other member).

Every arm's processes run `--threads` torch threads each (1 by default: 4 processes on 2 cores);
the warm start and (c) run in this process with as many. Artifacts in `--out DIR` (a temporary
directory otherwise, removed at the end): warm_start.safetensors (+ .json), arm_a.json,
arm_b.json, arm_c.json, arm_s.json, result.json, the final weights of (a) and (c) (sync/final.safetensors,
sim/final.safetensors; (b)'s are the coordinator's checkpoints under swarm/coordinator/) and the
processes' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.convergence_settings import (
    Settings,
    ring_allreduce_bytes,
    set_threads,
    write_json,
)

ARMS = ("a", "b", "c", "s", "u")
ARM_NAMES = {"a": "sync DP (gloo)", "b": "swarmtrain", "c": "DiLoCo sim", "s": "sparse sim", "u": "swarm, time"}
QUICK = {"preset": "tiny", "warmup_steps": 40, "steps": 40, "inner_steps": 10, "sparse_inner_steps": 10, "replicas": 2, "eval_batches": 4, "lr_warmup": 5}
TARGETS = {"b_vs_c": 0.01, "b_vs_a": 0.05, "bytes_a_over_b": 150.0, "s_vs_a": 0.01, "bytes_a_over_s": 1000.0}  # from the issues


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- warm start --------------------------------------------------------------------------------


def warm_start(settings: Settings, corpus, out_dir: Path) -> dict:
    """Train (or reuse from out_dir, when made with the same settings and corpus) the shared start."""
    from safetensors.torch import load_file, save_file

    from node.models.data import evaluate
    from node.models.diloco import state_hash, train_sync
    from node.models.gpt import GPT

    path, meta_path = out_dir / "warm_start.safetensors", out_dir / "warm_start.json"
    key = {**settings.warm_key(), "corpus": corpus.fingerprint}
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            state = load_file(path)
            if state_hash(state) == meta["state_hash"]:
                log(f"[warm] reusing {path} (hash {meta['state_hash']})")
                return {**meta, "state": state, "path": str(path), "reused": True}
    mcfg = settings.model_config()
    log(f"[warm] {settings.warmup_steps} synchronous steps, {settings.preset} preset, batch {settings.batch_size}")
    cpu0 = time.process_time()
    res = train_sync(
        mcfg, settings.warm_train_config(), corpus, settings.warmup_steps, eval_every=settings.inner_steps,
        eval_batches=settings.eval_batches, eval_seed=settings.eval_seed,
    )  # fmt: skip
    state = {k: v.contiguous() for k, v in res["state"].items()}
    model = GPT(mcfg)
    model.load_state_dict(state)
    val = evaluate(model, corpus.val, settings.batch_size, mcfg.context, settings.eval_batches, settings.eval_seed)
    save_file(state, path)
    meta = {
        "key": key, "state_hash": res["state_hash"], "val_loss": val, "seconds": round(res["seconds"], 2),
        "cpu_seconds": round(time.process_time() - cpu0, 2),
        "num_params": model.num_params(),
        "curve": [{"step": h["inner_step"], "val_loss": h["val_loss"]} for h in res["history"]],
    }  # fmt: skip
    write_json(meta_path, meta)
    log(f"[warm] done in {res['seconds']:.0f} s: val loss {val:.4f}")
    return {**meta, "state": state, "path": str(path), "reused": False}


# ---- arm (c) -------------------------------------------------------------------------------------


def run_sim_arm(settings: Settings, corpus, warm_state: dict, out_dir: Path) -> dict:
    from safetensors.torch import save_file

    from node.models.diloco import simulate_diloco

    n = settings.replicas
    cpu0 = time.process_time()
    res = simulate_diloco(
        settings.model_config(), settings.train_config(), corpus, n, settings.outer_steps, codec=settings.codec,
        block_size=settings.block_size, warm_start_state=warm_state, eval_every=1, eval_batches=settings.eval_batches,
        eval_seed=settings.eval_seed,
    )  # fmt: skip
    hist = res["history"]
    (out_dir / "sim").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in res["state"].items()}, out_dir / "sim" / "final.safetensors")
    return {
        "arm": "c",
        "name": f"DiLoCo simulated in one process ({n} replicas, {settings.codec} + error feedback, no network)",
        "curve": [{"step": h["inner_step"], "val_loss": h["val_loss"]} for h in hist],
        "train_curve": [{"step": h["inner_step"], "train_loss": h["train_loss"]} for h in hist[1:]],
        "bytes_sent_per_node": [int(ring_allreduce_bytes(1, n, b)) for b in res["bytes_sent"]],
        "payload_bytes_per_node": res["bytes_sent"],
        "bytes_source": "estimate: 2(N-1)/N × encoded pseudo-gradient bytes per outer step (butterfly all-reduce)",
        "state_hash": res["state_hash"],
        "seconds": round(res["seconds"], 2),
        "cpu_seconds": round(time.process_time() - cpu0, 2),
    }


def run_sparse_arm(settings: Settings, corpus, warm_state: dict) -> dict:
    from node.models.diloco import simulate_diloco

    n, h = settings.replicas, settings.sparse_inner_steps
    cpu0 = time.process_time()
    res = simulate_diloco(
        settings.model_config(), settings.sparse_train_config(), corpus, n, settings.steps // h, codec="sparse",
        codec_params=settings.sparse_params(), warm_start_state=warm_state, eval_every=1, eval_batches=settings.eval_batches,
        eval_seed=settings.eval_seed, allreduce=True,
    )  # fmt: skip
    hist = res["history"]
    p = settings.sparse_params()
    return {
        "arm": "s",
        "name": f"sparse DiLoCo simulated in one process ({n} replicas, density {p['density']}, {p['bits']} bits, chunks of {p['chunk']}, "
                f"H={h}, outer lr {settings.sparse_outer_lr} momentum {settings.sparse_outer_momentum}; the all-reduce's arithmetic, no network)",
        "curve": [{"step": h["inner_step"], "val_loss": h["val_loss"]} for h in hist],
        "train_curve": [{"step": h["inner_step"], "train_loss": h["train_loss"]} for h in hist[1:]],
        "bytes_sent_per_node": res["bytes_sent"],
        "bytes_source": "simulated all-reduce: payload bytes each member sends (scatter parts, its slice's gather), no framing",
        "state_hash": res["state_hash"],
        "seconds": round(res["seconds"], 2),
        "cpu_seconds": round(time.process_time() - cpu0, 2),
    }  # fmt: skip


# ---- orchestration -------------------------------------------------------------------------------


def run_arm(arm: str, settings: Settings, corpus, warm: dict, out_dir: Path, timeout: float) -> dict:
    t0 = time.monotonic()
    log(f"[{arm}] {ARM_NAMES[arm]}: {settings.replicas} replicas × {settings.steps} steps")
    try:
        if arm == "a":
            from bench.convergence_sync import run_sync_arm

            result = run_sync_arm(settings, Path(warm["path"]), out_dir / "sync", timeout, log=log)
        elif arm in ("b", "u"):
            from bench.convergence_swarm import run_swarm_arm, unavailable

            why = unavailable()
            if why:
                log(f"[{arm}] skipped: {why}")
                return {"arm": arm, "status": "skipped", "reason": why}
            phase = "time" if arm == "u" else "steps"
            result = run_swarm_arm(settings, warm["state"], warm["val_loss"], out_dir / f"swarm-{phase}", timeout, log=log, inner_phase=phase)
        elif arm == "s":
            result = run_sparse_arm(settings, corpus, warm["state"])
        else:
            result = run_sim_arm(settings, corpus, warm["state"], out_dir)
    except RuntimeError as e:  # ArmFailed, or replicas of the simulation disagreeing
        log(f"[{arm}] failed: {e}")
        return {"arm": arm, "status": "failed", "error": str(e)[-4000:], "seconds": round(time.monotonic() - t0, 2)}
    result["status"] = "ok"
    result["final_val_loss"] = result["curve"][-1]["val_loss"]
    result["bytes_per_node"] = max(result["bytes_sent_per_node"])
    log(f"[{arm}] done in {result['seconds']:.0f} s: final val {result['final_val_loss']:.4f}, "
        f"{result['bytes_per_node'] / 1e6:.2f} MB sent per node")  # fmt: skip
    return result


def previous_arms(out_dir: Path, settings: Settings, warm_hash: str, skip: list[str]) -> dict[str, dict]:
    """Arms of an earlier run in out_dir with the same settings and warm start (for --arms b later)."""
    out = {}
    for arm in ARMS:
        path = out_dir / f"arm_{arm}.json"
        if arm in skip or not path.exists():
            continue
        try:
            r = json.loads(path.read_text())
        except ValueError:
            continue
        if r.get("status") == "ok" and Settings.comparable(r.get("settings") or {}, arm) == Settings.comparable(settings.to_dict(), arm) and r.get("warm_start_hash") == warm_hash:
            out[arm] = {**r, "reused": True}
    return out


def _rel(x: float, y: float) -> float:
    return round((x - y) / y, 5)


def _seconds_to(curve: list[dict], loss: float) -> float | None:
    """Seconds from a swarm arm's first outer step (its start-up left out) until its state first
    reached `loss`; None: never."""
    points = [p for p in curve[1:] if isinstance(p.get("seconds"), (int, float))]
    return next((round(p["seconds"] - points[0]["seconds"], 2) for p in points if p["val_loss"] <= loss), None) if points else None


def time_to_loss(ok: dict[str, dict]) -> dict:
    """How soon the swarm arms (b: H steps each; u: --inner-phase time) reach (a)'s final loss,
    and the loss both of them reach (the higher of their final losses): seconds, and b over u."""
    out = {}
    swarm = [arm for arm in ("b", "u") if arm in ok]
    levels = {"a_final_loss": ok["a"]["final_val_loss"]} if "a" in ok else {}
    if len(swarm) == 2:
        levels["both_final_loss"] = max(ok["b"]["final_val_loss"], ok["u"]["final_val_loss"])
    for level, loss in levels.items():
        seconds = {arm: _seconds_to(ok[arm]["curve"], loss) for arm in swarm}
        out.update({f"{arm}_seconds_to_{level}": s for arm, s in seconds.items()})
        if seconds.get("b") and seconds.get("u"):
            out[f"seconds_to_{level}_b_over_u"] = round(seconds["b"] / seconds["u"], 3)
    return out


def summarize(arms: dict[str, dict], warm: dict) -> dict:
    ok = {k: r for k, r in arms.items() if r.get("status") == "ok"}
    final = {k: round(r["final_val_loss"], 5) for k, r in ok.items()}
    nbytes = {k: r["bytes_per_node"] for k, r in ok.items()}
    s: dict = {"warm_start_val_loss": round(warm["val_loss"], 5), "final_val_loss": final, "bytes_per_node": nbytes}
    for x, y in (("b", "c"), ("b", "a"), ("c", "a"), ("s", "a"), ("s", "c")):
        if x in final and y in final:
            s[f"{x}_vs_{y}_rel_diff"] = _rel(final[x], final[y])  # (x − y) / y; > 0: x ends worse
    for y in ("b", "c", "s"):
        if "a" in nbytes and nbytes.get(y):
            s[f"bytes_ratio_a_over_{y}"] = round(nbytes["a"] / nbytes[y], 2)
    s["bytes_ratio"] = s.get("bytes_ratio_a_over_b", s.get("bytes_ratio_a_over_c"))
    s.update(time_to_loss(ok))
    targets = {}
    if "b_vs_c_rel_diff" in s:
        targets["b_within_1pct_of_c"] = abs(s["b_vs_c_rel_diff"]) <= TARGETS["b_vs_c"]
    if "b_vs_a_rel_diff" in s:
        targets["b_within_5pct_of_a"] = s["b_vs_a_rel_diff"] <= TARGETS["b_vs_a"]
    if "bytes_ratio_a_over_b" in s:
        targets["b_150x_fewer_bytes_than_a"] = s["bytes_ratio_a_over_b"] >= TARGETS["bytes_a_over_b"]
    if "s_vs_a_rel_diff" in s:
        targets["s_within_1pct_of_a"] = s["s_vs_a_rel_diff"] <= TARGETS["s_vs_a"]
    if "bytes_ratio_a_over_s" in s:
        targets["s_1000x_fewer_bytes_than_a"] = s["bytes_ratio_a_over_s"] >= TARGETS["bytes_a_over_s"]
    if "s_vs_c_rel_diff" in s:
        targets["s_no_worse_than_c"] = s["s_vs_c_rel_diff"] <= 0
    if targets:
        s["targets"] = targets  # the targets, meant for the reference settings (the defaults)
    return s


def print_report(result: dict) -> None:
    st, arms, summ = result["settings"], result["arms"], result["summary"]
    ok = [a for a in ARMS if arms.get(a, {}).get("status") == "ok"]
    print(f"convergence: {st['preset']} preset ({result['warm_start']['num_params']:,} params), {st['replicas']} replicas, "
          f"batch {st['batch_size']}/replica, {st['warmup_steps']} warm-start + {st['steps']} steps, H={st['inner_steps']}, "
          f"{st['codec']}, outer lr {st['outer_lr']} momentum {st['outer_momentum']}")  # fmt: skip
    print(f"warm start: val loss {result['warm_start']['val_loss']:.4f} ({result['warm_start']['seconds']:.0f} s)")
    curves = {a: {p["step"]: p["val_loss"] for p in arms[a]["curve"]} for a in ok}
    print(f"{'step':>6} " + " ".join(f"{ARM_NAMES[a]:>15}" for a in ok))
    for step in sorted({s for c in curves.values() for s in c}):
        print(f"{step:>6} " + " ".join(f"{curves[a][step]:>15.4f}" if step in curves[a] else f"{'-':>15}" for a in ok))
    for a in ARMS:
        r = arms.get(a)
        if r is None:
            continue
        if r.get("status") != "ok":
            print(f"({a}) {ARM_NAMES[a]}: {r.get('status')}: {r.get('reason') or r.get('error', '')[:300]}")
            continue
        est = "~" if r["bytes_source"].startswith("estimate") else ""
        print(f"({a}) {ARM_NAMES[a]}: final val {r['final_val_loss']:.4f}, {est}{r['bytes_per_node'] / 1e6:.3f} MB sent per node, "
              f"{r['seconds']:.0f} s{' (reused)' if r.get('reused') else ''}")  # fmt: skip
        if r.get("degraded_rounds"):
            print(f"    rounds averaged by fewer than {st['replicas']} replicas: {r['degraded_rounds']}")
        if r.get("failed_rounds"):
            print(f"    rounds that failed for every replica (no outer step taken): {r['failed_rounds']}")
        if r.get("hash_disagreements") or r.get("missing_outer_steps"):
            print(f"    hash disagreements {r.get('hash_disagreements')}; no loss for outer steps {r.get('missing_outer_steps')}")
    for k, v in summ.items():
        if k not in ("final_val_loss", "bytes_per_node", "warm_start_val_loss"):
            print(f"{k}: {v}")
    print(f"total {result['seconds']:.0f} s; artifacts: {result['out_dir'] or '(temporary, removed)'}")


def parse_args(argv=None) -> tuple[argparse.Namespace, Settings]:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="smoke-test size: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--arms", default="a,b,c", help="comma-separated subset of a (sync DP), b (swarm), c (simulation), s (sparse simulation), u (swarm, --inner-phase time)")
    p.add_argument("--preset", help=f"model preset (default {d.preset})")
    p.add_argument("--warmup-steps", type=int, help=f"steps of the shared synchronous warm start (default {d.warmup_steps})")
    p.add_argument("--steps", type=int, help=f"steps per replica after the warm start (default {d.steps})")
    p.add_argument("--inner-steps", type=int, help=f"H, inner steps per outer step and between evaluations (default {d.inner_steps})")
    p.add_argument("--replicas", type=int, help=f"replicas / ranks (default {d.replicas})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step per replica (default {d.batch_size})")
    p.add_argument("--inner-lr", type=float, help=f"peak AdamW lr of the arms (default {d.inner_lr})")
    p.add_argument("--warm-lr", type=float, help=f"peak AdamW lr of the warm start (default {d.warm_lr})")
    p.add_argument("--lr-warmup-steps", type=int, dest="lr_warmup", help=f"linear lr warmup of each phase (default {d.lr_warmup})")
    p.add_argument("--outer-lr", type=float, help=f"outer Nesterov lr (default {d.outer_lr})")
    p.add_argument("--outer-momentum", type=float, help=f"outer momentum (default {d.outer_momentum})")
    p.add_argument("--codec", choices=["int8", "fp16", "none"], help=f"pseudo-gradient codec of (b) and (c) (default {d.codec})")
    p.add_argument("--block-size", type=int, help=f"int8 absmax block size (default {d.block_size})")
    p.add_argument("--sparse-inner-steps", type=int, help=f"(s): H (default {d.sparse_inner_steps})")
    p.add_argument("--sparse-outer-lr", type=float, help=f"(s): outer Nesterov lr (default {d.sparse_outer_lr})")
    p.add_argument("--sparse-outer-momentum", type=float, help=f"(s): outer momentum (default {d.sparse_outer_momentum})")
    p.add_argument("--sparse-density", type=float, help=f"(s): fraction of each chunk's values sent (default {d.sparse_density})")
    p.add_argument("--sparse-bits", type=int, help=f"(s): bits per sent value (default {d.sparse_bits})")
    p.add_argument("--sparse-chunk", type=int, help=f"(s): elements per chunk (default {d.sparse_chunk})")
    p.add_argument("--eval-batches", type=int, help=f"validation batches per evaluation (default {d.eval_batches})")
    p.add_argument("--seed", type=int, help=f"data seed (default {d.seed})")
    p.add_argument("--threads", type=int, help=f"torch threads per process (default {d.threads})")
    p.add_argument("--slow-replica", type=float, metavar="X", help=f"(b), (u): the last replica's inner steps take X times as long (default {d.slow_replica})")
    p.add_argument("--join-timeout-s", type=float, help=f"(b): seconds a round waits for late replicas (default {d.join_timeout_s})")
    p.add_argument("--timeout", type=float, help="seconds an arm may take before it is failed (default 300 with --quick, else 7200)")
    p.add_argument("--out", metavar="DIR", help="keep artifacts here (default: a temporary directory, removed)")
    p.add_argument("--reuse", action="store_true", help="with --out: arms already finished there with the same settings and warm start are not run again")
    args = p.parse_args(argv)
    names = ("preset", "warmup_steps", "steps", "inner_steps", "replicas", "batch_size", "inner_lr", "warm_lr", "lr_warmup", "outer_lr",
             "outer_momentum", "codec", "block_size", "sparse_inner_steps", "sparse_outer_lr", "sparse_outer_momentum", "sparse_density",
             "sparse_bits", "sparse_chunk", "eval_batches", "seed", "threads", "join_timeout_s", "slow_replica")  # fmt: skip
    values = dict(QUICK) if args.quick else {}
    values.update({k: getattr(args, k) for k in names if getattr(args, k) is not None})
    try:
        settings = Settings(**values)
    except ValueError as e:
        p.error(str(e))
    if args.reuse and not args.out:
        p.error("--reuse needs --out DIR (where the finished arms are)")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or any(a not in ARMS for a in args.arms):
        p.error(f"--arms must be a comma-separated subset of {','.join(ARMS)}, got {','.join(args.arms)!r}")
    args.timeout = args.timeout or (300.0 if args.quick else 7200.0)
    return args, settings


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through every arm's cleanup, like Ctrl-C


def main(argv=None) -> int:
    args, settings = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    set_threads(settings.threads)
    t0 = time.monotonic()
    reference = Settings.comparable(Settings().to_dict())  # the defaults: what the targets are claimed for
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="convergence-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        from node.models.data import load_corpus

        load_before = os.getloadavg()
        corpus = load_corpus()
        warm = warm_start(settings, corpus, out_dir)
        arms: dict[str, dict] = {}
        done = previous_arms(out_dir, settings, warm["state_hash"], skip=[]) if args.reuse else {}
        for arm in ARMS:  # one after another: arms must not compete for the cores they are timed on
            if arm in done and arm in args.arms:
                log(f"[{arm}] reusing {out_dir / f'arm_{arm}.json'}")
                arms[arm] = done[arm]
            elif arm in args.arms:
                r = run_arm(arm, settings, corpus, warm, out_dir, args.timeout)
                r.update(settings=settings.to_dict(), warm_start_hash=warm["state_hash"])
                arms[arm] = r
                if r["status"] == "ok":
                    write_json(out_dir / f"arm_{arm}.json", r)
        if args.out:
            arms.update(previous_arms(out_dir, settings, warm["state_hash"], skip=args.arms))
        arms = {a: arms[a] for a in ARMS if a in arms}
        result = {
            "settings": settings.to_dict(),
            "warm_start": {k: v for k, v in warm.items() if k != "state"},
            "arms": arms,
            "summary": {**summarize(arms, warm), "reference_settings": Settings.comparable(settings.to_dict()) == reference},
            "seconds": round(time.monotonic() - t0, 1),
            "machine": {
                "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "python": sys.version.split()[0], "torch": __import__("torch").__version__,
            },
            "out_dir": str(out_dir) if args.out else None,
        }
        if args.out:
            write_json(out_dir / "result.json", result)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if not args.out:
            shutil.rmtree(out_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)
    return 1 if any(r.get("status") == "failed" for r in result["arms"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
