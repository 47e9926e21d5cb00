"""Arm (a) of bench/convergence.py: synchronous data parallelism, gradients all-reduced every step.

    run_sync_arm(settings, warm_path, work_dir)   start N ranks, wait, return the arm's result
    python -m bench.convergence_sync --rank R ...  one rank (started by run_sync_arm)

Every rank is its own OS process in its own session (gloo on loopback, `settings.threads` torch
threads each). Rank r samples Batches(train, r, N, batch_size, context, seed + r): the same shard
and stream as DiLoCo replica r in simulate_diloco. The model is wrapped in DistributedDataParallel,
whose backward all-reduces the gradients and divides by N, so node.models.diloco.InnerTrainer's own step
(AdamW, lr_at schedule, clipping of the averaged gradient) runs unchanged. Rank 0 evaluates the
model every H steps on the same validation windows as the other arms.

Bytes: gloo does not report them; each rank is counted at the ring all-reduce volume,
2(N−1)/N · numel · 4 bytes per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.convergence_settings import (
    Settings,
    free_port,
    ring_allreduce_bytes,
    set_threads,
    thread_env,
    write_json,
)
from bench.workers import kill_session

ROOT = Path(__file__).resolve().parent.parent


class ArmFailed(RuntimeError):
    """An arm's process died, disagreed, or missed its deadline; the message says which and why."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def run_sync_arm(settings: Settings, warm_path: Path, work_dir: Path, timeout: float, log=print) -> dict:
    """Run the N ranks to the end (or fail within `timeout` s); leaves no process behind."""
    n = settings.replicas
    work_dir.mkdir(parents=True, exist_ok=True)
    settings_path = work_dir / "settings.json"
    write_json(settings_path, settings.to_dict())
    port = free_port()
    env = {**thread_env(settings.threads), "GLOO_SOCKET_IFNAME": "lo"}
    procs: list[tuple[subprocess.Popen, Path]] = []
    t0 = time.monotonic()
    try:
        for r in range(n):
            log_path = work_dir / f"rank{r}.log"
            with open(log_path, "wb") as logf:
                p = subprocess.Popen(
                    [sys.executable, "-m", "bench.convergence_sync", "--rank", str(r), "--port", str(port),
                     "--settings", str(settings_path), "--warm-start", str(warm_path), "--out", str(work_dir / f"rank{r}.json")],
                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            procs.append((p, log_path))
        deadline = t0 + timeout
        while any(p.poll() is None for p, _ in procs):
            failed = [(r, p, lp) for r, (p, lp) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:  # the others would wait for it in the next all-reduce until gloo's timeout
                r, p, lp = failed[0]
                raise ArmFailed(f"sync rank {r} exited with {p.returncode}:\n{_tail(lp)}")
            if time.monotonic() > deadline:
                raise ArmFailed(f"sync arm did not finish within {timeout:.0f} s; rank 0 log:\n{_tail(procs[0][1])}")
            time.sleep(0.2)
        for r, (p, lp) in enumerate(procs):
            if p.returncode != 0:
                raise ArmFailed(f"sync rank {r} exited with {p.returncode}:\n{_tail(lp)}")
    finally:
        for p, _ in procs:
            kill_session(p.pid)
            if p.poll() is None:
                p.kill()
            p.wait(10)
    seconds = time.monotonic() - t0
    ranks = [json.loads((work_dir / f"rank{r}.json").read_text()) for r in range(n)]
    hashes = {rk["state_hash"] for rk in ranks}
    if len(hashes) != 1:  # DDP keeps the ranks in lockstep; different weights would be a bug
        raise ArmFailed(f"sync ranks ended with different weights: {sorted(hashes)}")
    steps = settings.steps
    train = [
        {"step": s, "train_loss": sum(rk["train_loss"][i] for rk in ranks) / n}
        for i, s in enumerate(ranks[0]["train_loss_steps"])
    ]
    return {
        "arm": "a",
        "name": f"synchronous data parallel, torch.distributed gloo, {n} processes, all-reduce every step",
        "curve": ranks[0]["history"],
        "train_curve": train,
        "bytes_sent_per_node": [rk["bytes_sent"] for rk in ranks],
        "bytes_source": f"estimate: ring all-reduce 2(N-1)/N·numel·4 per step × {steps} steps",
        "numel": ranks[0]["numel"],
        "state_hash": ranks[0]["state_hash"],
        "seconds": round(seconds, 2),
        "train_seconds": round(max(rk["seconds"] for rk in ranks), 2),
        "cpu_seconds": round(sum(rk["cpu_seconds"] for rk in ranks), 2),  # training loops only, all ranks
    }


# ---- one rank ---------------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """If the bench is SIGKILLed, its ranks are re-parented: notice it and leave (no orphans)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def rank_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one rank of the synchronous data-parallel arm")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--warm-start", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    _exit_with_parent()
    settings = Settings.from_dict(json.loads(Path(args.settings).read_text()))
    set_threads(settings.threads)

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.nn.parallel import DistributedDataParallel

    from node.models.data import Batches, evaluate, load_corpus
    from node.models.diloco import InnerTrainer, state_hash
    from node.models.gpt import GPT

    rank, n = args.rank, settings.replicas
    cfg, mcfg = settings.train_config(), settings.model_config()
    corpus = load_corpus()
    model = GPT(mcfg)
    model.load_state_dict(load_file(args.warm_start))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=600)
    )
    try:
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights (equal anyway) and checks shapes
        inner = InnerTrainer(ddp, cfg, Batches(corpus.train, rank, n, cfg.batch_size, mcfg.context, cfg.seed + rank))
        numel = sum(p.numel() for p in model.parameters())

        def val_loss() -> float:
            return evaluate(model, corpus.val, cfg.batch_size, mcfg.context, settings.eval_batches, settings.eval_seed)

        history = [{"step": 0, "val_loss": val_loss()}] if rank == 0 else []
        losses, train_loss, train_steps = [], [], []
        t0, cpu0 = time.perf_counter(), time.process_time()
        for step in range(1, settings.steps + 1):
            losses.append(inner.step())
            if step % settings.inner_steps == 0:
                train_loss.append(sum(losses) / len(losses))
                train_steps.append(step)
                losses = []
                if rank == 0:
                    history.append({"step": step, "val_loss": val_loss(), "seconds": round(time.perf_counter() - t0, 2)})
                    print(f"[sync] step {step}: val {history[-1]['val_loss']:.4f}", flush=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:  # the final weights, to evaluate them again later (other windows, the whole val split)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, Path(args.out).with_name("final.safetensors"))
    write_json(Path(args.out), {
        "rank": rank,
        "history": history,
        "train_loss": train_loss,
        "train_loss_steps": train_steps,
        "numel": numel,
        "bytes_sent": int(ring_allreduce_bytes(numel, n) * settings.steps),
        "state_hash": state_hash(dict(model.state_dict())),
        "seconds": seconds,
        "cpu_seconds": cpu,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
