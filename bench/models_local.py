"""bench/models.py's anchors, each a process of its own that the bench's memory watch samples:

    model_facts(dir, s)       parameters of the model and of each stage of its cut (built on the
                              meta device: no memory, no time)
    run_reference(...)        one plain process: the model and its AdamW, the replica's inner
                              steps (node.models.diloco.InnerTrainer) on the replica's batches
    run_torch_pipelining(...) torch.distributed.pipelining, Schedule1F1B over gloo, one rank per
                              stage, each holding HFStage.cut of the model (the swarm's cut), on the
                              swarm trainer's micro-batches

The children are `python -m bench.models_local reference|rank ...`; each writes one JSON file.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.models_settings import REPORT, ROOT, Settings, child_env
from bench.pipeline import pipelining_module


def _plan(model_dir, s: Settings):
    from node.models.hf_stages import dims_of
    from node.runconfig import RunConfig

    return RunConfig(num_stages=s.stages, stage_blocks=s.stage_blocks).stage_plan(dims_of(model_dir))


def model_facts(path: Path, s: Settings) -> dict:
    """Parameters of the whole model and of each stage of the cut, and the cut (decoder layers)."""
    import torch

    from node.models.hf import build_causal_lm, open_model_dir
    from node.models.hf_stages import HFStage

    d = open_model_dir(path)
    with torch.device("meta"):
        lm = build_causal_lm(d, seed=0, weights=False)
    plan = _plan(d, s)
    stages = [HFStage.cut(copy.deepcopy(lm), i, plan).num_params() for i in range(len(plan))]
    return {"params": lm.num_params(), "stage_params": stages, "stage_layers": [list(p) for p in plan], "config": d.config}


# ---- the children -------------------------------------------------------------------------------------


def reference_main(s: Settings, path: Path, out: Path) -> int:
    """The model and AdamW in this process: one warm-up inner step, then `steps` timed."""
    import torch

    from node.models.data import Batches, load_corpus
    from node.models.diloco import InnerTrainer
    from node.models.hf import build_causal_lm, open_model_dir
    from node.runconfig import RunConfig

    torch.set_num_threads(s.threads)
    model = build_causal_lm(open_model_dir(path), s.seed, weights=False)
    # the replica's own TrainConfig (node/roles/replica.py: run.train_config()), on its batches (shard 0 of 1)
    tc = RunConfig(batch_size=s.batch_size, inner_steps=s.inner_steps, seed=s.seed).train_config()
    inner = InnerTrainer(model, tc, Batches(load_corpus().train, 0, 1, s.batch_size, model.context, s.seed))
    seconds = []
    for _ in range(1 + s.steps):
        t0 = time.perf_counter()
        inner.step()
        seconds.append(time.perf_counter() - t0)
    timed = sum(seconds[1:])
    out.write_text(json.dumps({"params": model.num_params(), "first_step_s": seconds[0], "timed_steps_s": timed,
                               "tokens_per_s": s.steps * s.batch_size * model.context / timed}))  # fmt: skip
    return 0


def rank_main(s: Settings, path: Path, rank: int, port: int, out: Path) -> int:
    """One rank of torch.distributed.pipelining: stage `rank` of the cut, 1F1B over gloo."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from node.models.data import Batches, load_corpus
    from node.models.diloco import adamw, lr_at
    from node.models.hf import open_model_dir
    from node.models.hf_stages import init_hf_stage
    from node.runconfig import RunConfig

    torch.set_num_threads(s.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=s.stages, timeout=datetime.timedelta(seconds=s.timeout_s))
    d = open_model_dir(path)
    stage = init_hf_stage(d, rank, _plan(d, s), s.seed, weights=False)  # what a stage server builds
    last = rank == s.stages - 1
    module = pipelining_module(stage, last)
    m = s.step_micro_batches
    schedule = Schedule1F1B(PipelineStage(module, rank, s.stages, torch.device("cpu")), m,
                            loss_fn=lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)))  # fmt: skip
    tc = RunConfig(batch_size=s.batch_size, seed=s.seed).train_config()
    opt = adamw(module.parameters(), tc)
    batches = Batches(load_corpus().train, 0, 1, s.batch_size, s.seq_len, s.seed)  # the swarm trainer's (shard 0 of 1), in order
    ends, cpus, losses = [], [], []
    for step in range(s.pipeline_micro_batches // m):
        pairs = [batches.next() for _ in range(m)]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        if rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        _clip(module, tc.grad_clip, s.stage_clip, dist)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.time())
        cpus.append(time.process_time())
    out.write_text(json.dumps({"step_ends": ends, "step_cpu_s": cpus, "params": stage.num_params(), "loss": float(losses[-1]) if losses else None}))
    dist.destroy_process_group()
    return 0


def _clip(module, max_norm: float, how: str, dist) -> None:
    """global: one norm over every rank's gradients (their squares all_reduced), as the swarm's
    stage servers clip with stage_clip global; stage: each rank its own (pipelining's examples)."""
    import torch

    if how == "stage":
        torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total2 = torch.stack([g.norm() for g in grads]).norm().double().pow(2).reshape(1)
    dist.all_reduce(total2)
    coef = torch.clamp(max_norm / (total2.sqrt().float() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


# ---- the parent's side --------------------------------------------------------------------------------


def _start(s: Settings, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "bench.models_local", *args, "--settings", json.dumps(s.__dict__)], cwd=ROOT, env=child_env(s),
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    from bench.memory import available_mib
    from bench.models_swarm import LOW_MEMORY_MIB

    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if (left := available_mib()) < LOW_MEMORY_MIB:
            raise RuntimeError(f"{what}: stopped: the machine has {left} MiB of memory left")
        failed = [log for p, log in zip(procs, logs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            tail = _tail(failed[0]) if failed else ""
            raise RuntimeError(f"{what}: " + (f"a process failed: {tail}" if failed else f"not done in {timeout:.0f} s"))
        time.sleep(0.2)
    failed = [log for p, log in zip(procs, logs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{what}: a process failed: {_tail(failed[0])}")


def _tail(path: Path, n: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])[-1500:]
    except OSError:
        return ""


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill each process's whole session (its children too), then reap it."""
    from bench.workers import kill_session

    for p in procs:
        kill_session(p.pid)
        if p.poll() is None:
            p.kill()
        p.wait(10)


def run_reference(s: Settings, model_dir: Path, work: Path, watch) -> dict:
    work.mkdir(parents=True)
    log, out = work / "reference.log", work / "reference.json"
    proc = _start(s, ["reference", "--model-dir", str(model_dir), "--out", str(out)], log)
    try:
        watch.watch("reference", proc.pid)
        _wait([proc], [log], s.timeout_s, "the one-process reference")
        memory = watch.forget("reference")
    finally:
        stop([proc])
    return {**json.loads(out.read_text()), "memory": memory}


def run_torch_pipelining(s: Settings, model_dir: Path, work: Path, watch) -> dict:
    """tokens/s from the end of the steps of the first REPORT micro-batches to the end of the
    last: the window the swarm's trainer is timed over."""
    work.mkdir(parents=True)
    port = _free_port()
    logs = [work / f"rank{r}.log" for r in range(s.stages)]
    procs = []
    try:
        for r in range(s.stages):
            procs.append(_start(s, ["rank", "--model-dir", str(model_dir), "--rank", str(r), "--port", str(port), "--out", str(work / f"rank{r}.json")], logs[r]))
            watch.watch(f"rank{r}", procs[-1].pid)
        _wait(procs, logs, s.timeout_s, "torch.distributed.pipelining")
        memory = [watch.forget(f"rank{r}") for r in range(s.stages)]
    finally:
        stop(procs)
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(s.stages)]
    ends = ranks[-1]["step_ends"]
    first = REPORT // s.step_micro_batches - 1  # the step that ends the first REPORT micro-batches
    tokens = (len(ends) - 1 - first) * s.step_micro_batches * s.batch_size * s.seq_len
    cpu = sum(r["step_cpu_s"][-1] - r["step_cpu_s"][first] for r in ranks)  # each rank's own CPU clock, between its own step ends
    window = ends[-1] - ends[first]
    return {"tokens_per_s": tokens / window, "final_loss": ranks[-1]["loss"],
            "cpu_in_window": {"window_s": round(window, 2), "cpu_s": round(cpu, 2), "cores_busy": round(cpu / window, 3), "cpu_s_per_1k_tokens": round(cpu / tokens * 1000, 3),
                              "by_rank": [round(r["step_cpu_s"][-1] - r["step_cpu_s"][first], 2) for r in ranks]},
            "ranks": [{"rank": r, "params": ranks[r]["params"], "memory": memory[r]} for r in range(s.stages)]}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="a child process of bench/models.py")
    p.add_argument("what", choices=["reference", "rank"])
    p.add_argument("--settings", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int)
    p.add_argument("--port", type=int)
    a = p.parse_args(argv)
    s = Settings(**json.loads(a.settings))
    if a.what == "reference":
        return reference_main(s, Path(a.model_dir), Path(a.out))
    return rank_main(s, Path(a.model_dir), a.rank, a.port, Path(a.out))


if __name__ == "__main__":
    sys.exit(main())
