"""Pipeline training side by side: one process, torch.distributed.pipelining, and the swarm.

    python -m bench.pipeline --json [--model small] [--stages 3] [--samples 2048] [--arms a,b,c,d,e]

Every arm trains the same model, cut the same way (node/models/stages.py plan_stages), on the same
micro-batches of the built-in corpus (batch size B sequences), with AdamW stepping every
`step_samples` samples (gradients averaged over the micro-batches in between), until `samples`
samples went through:

  (a) the whole model in one process;
  (a-stage-clip) (a), each stage's gradients clipped to the norm on their own, as (b)'s ranks
      clip (its loss is (b)'s: the same algorithm);
  (a-rounding) (a) with the global norm put together as the swarm's stage servers do (each
      stage's norm, then their squares summed in float64): the same algorithm as (a) up to
      float rounding, to show how far rounding alone moves the final loss;
  (b) torch.distributed.pipelining, Schedule1F1B over gloo, one process per stage, one optimizer
      step per schedule step (step_samples / B micro-batches), each rank clipping its own
      parameters' gradient (clip_grad_norm_ on its module, as pipelining's examples do);
  (b-global-clip) (b), the ranks clipping by one norm of the whole model's gradient (their
      squared norms summed with an all_reduce at every step): (a)'s and (c)'s algorithm;
  (c) the swarm: a coordinator, one stage server per stage, one trainer (real processes, real p2pd);
      synchronous steps (a step's micro-batches in flight, the next step's once they came back,
      as (b) schedules them: the same algorithm);
  (c-stage-clip) (c), each stage clipping by its own gradient's norm (run setting stage_clip
      stage): (b)'s algorithm, with no norms passed between the stages;
  (c-async) (c) with 2 micro-batches in flight and stages stepping as they come (asynchronous);
  (c-relay) (c) with the trainer relaying every activation (stage_routing relay);
  (d) the swarm with two peers per stage and two trainers (the samples are split between them);
  (e) (d) with one stage peer SIGKILLed and started again every `kill_every_s` seconds, the first
      once the trainers are half way at the latest;
  (f) (c) with every process in its own network namespace behind a `rate` link (tbf, both
      directions; root only), once per activation codec: none, fp16, int8;
  (f-relay) (f) with activations none, the trainer relaying them.

With --repeat N, the arms run N times, every other time in reverse order (b, c, c, b, ...), and
the ratios compare each arm's median samples/s and mean final loss over the N runs: this
machine's own speed moves by a fifth between runs, more than most gaps worth measuring.

With --loss-seeds K, arms a, a-rounding, c and f-* run again with seeds seed+1 .. seed+K-1 and
the ratios compare their mean final losses (float rounding alone moves one seed's by a few
percent).

Reported per arm: samples/s (from the end of the first optimizer step, or the trainer's first
report, to the last sample), the training loss over the last window of micro-batches before
`samples`, bytes per sample across stage boundaries, lost micro-batches. Every process gets one
torch thread. Prints one JSON object; exits 1 if an arm failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = 8  # micro-batches per loss report of a trainer (node/roles/stats.py REPORT_EVERY)
WINDOW = 32  # micro-batches the final loss is the mean of (a multiple of REPORT)


@dataclass(frozen=True)
class Settings:
    model: str = "small"
    stages: int = 3
    batch_size: int = 8
    samples: int = 2048
    step_samples: int = 32
    lr: float = 3e-3
    warmup_steps: int = 5
    seed: int = 0
    # micro-batches each trainer keeps in the pipeline: a step's (step_samples / batch_size), with
    # synchronous steps (below) the swarm's trainers run (b)'s algorithm: a step's micro-batches
    # in flight, the next step's once they came back
    in_flight: int = 4
    kill_every_s: float = 30.0
    kill_wait_s: float = 60.0  # (b-kill): how long the bench watches the other ranks after the kill
    activation_codec: str = "none"
    stage_clip: str = "global"  # the swarm's clipping (run setting stage_clip): global | stage
    torch_clip: str = "stage"  # (b)'s ranks: stage (each its own parameters) | global (one norm, all_reduced)
    routing: str = "through"  # the swarm's stage routing (run setting stage_routing): through | relay
    synchronous: bool = True  # the swarm's trainers start a step's micro-batches once the previous step's came back (run setting synchronous_steps)
    rate: str = "100mbit"  # (f): each process's link
    outer_momentum: float = 0.0  # stage syncs (2 peers per stage), outer lr 1: 0 = plain parameter averaging
    sync_every_s: float = 10.0  # stage syncs: seconds between two


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}


# ---- (a) one process -----------------------------------------------------------------------------


def run_single(s: Settings, clip: str = "global") -> dict:
    """(a), clipping by one norm over all parameters; `clip` "stage": each stage's parameters
    clipped to the norm on their own, as (b)'s ranks clip; "stages-global": one global norm put
    together from the stages' as the swarm's stage servers do (node/roles/stage_compute.py clipped_step)."""
    import torch

    from node.models.data import Batches, load_corpus
    from node.models.diloco import TrainConfig, adamw, lr_at
    from node.models.gpt import PRESETS, init_model

    torch.set_num_threads(1)
    cfg = PRESETS[s.model]
    model = init_model(cfg, s.seed)
    tc = TrainConfig(inner_lr=s.lr, warmup_steps=s.warmup_steps)
    opt = adamw(model.parameters(), tc)
    batches = Batches(load_corpus().train, 0, 1, s.batch_size, cfg.context, s.seed)
    per_step = s.step_samples // s.batch_size
    groups = [list(model.parameters())]
    if clip != "global":
        from node.models.stages import Stage, plan_stages

        plan = plan_stages(cfg, s.stages)
        owned = [{n for n, _ in Stage(cfg, i, plan).named_parameters()} for i in range(s.stages)]  # the model's names for them
        groups = [[p for n, p in model.named_parameters() if n in names] for names in owned]
        if sum(map(len, groups)) != len(list(model.parameters())):
            raise RuntimeError("the stages' parameter names do not cover the model's once")
    losses, t_first, steps = [], None, 0
    for i in range(s.samples // s.batch_size):
        x, y = batches.next()
        _, loss = model(x, y)
        (loss / per_step).backward()
        losses.append(loss.item())
        if (i + 1) % per_step == 0:
            for g in opt.param_groups:
                g["lr"] = lr_at(steps, tc)
            if clip == "stages-global":
                owns = [torch.stack([p.grad.norm() for p in g]).norm() for g in groups]
                for j, g in enumerate(groups):
                    others2 = sum(float(o) ** 2 for i, o in enumerate(owns) if i != j)
                    coef = torch.clamp(tc.grad_clip / ((owns[j].double() ** 2 + others2).sqrt().float() + 1e-6), max=1.0)
                    for p in g:
                        p.grad.mul_(coef)
            else:
                for g in groups:
                    torch.nn.utils.clip_grad_norm_(g, tc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
            if t_first is None:
                t_first, first_samples = time.perf_counter(), (i + 1) * s.batch_size
    seconds = time.perf_counter() - t_first
    return {"samples_per_s": (s.samples - first_samples) / seconds, "final_loss": sum(losses[-WINDOW:]) / WINDOW, "bytes_per_sample": 0, "lost": 0}


# ---- (b) torch.distributed.pipelining ------------------------------------------------------------


def _fresh(work: Path) -> Path:
    """An arm's own new directory: `work`, or `work-2`, `work-3`, ... where an earlier run of the
    arm (--repeat) used it. A swarm started in an earlier one's directory resumed from its
    checkpoints and read its stats files: the earlier run's numbers, reported again."""
    path, n = work, 1
    while path.exists():
        n += 1
        path = work.with_name(f"{work.name}-{n}")
    path.mkdir(parents=True)
    return path


def _start_ranks(s: Settings, work: Path) -> list[subprocess.Popen]:
    """One process per stage, each in its own session (rank_main below)."""
    port = _free_port()
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(s.stages):
        with open(work / f"rank{r}.log", "wb") as log:
            cmd = [sys.executable, "-m", "bench.pipeline", "--rank", str(r), "--port", str(port), "--settings", json.dumps(asdict(s)), "--out", str(work / f"rank{r}.json")]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    return procs


def run_torch_pipeline(s: Settings, work: Path, timeout: float) -> dict:
    work = _fresh(work)
    procs = _start_ranks(s, work)
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("a rank failed or the arm timed out:\n" + _tail(work / "rank0.log") + "\n" + _tail(work / f"rank{s.stages - 1}.log"))
            time.sleep(0.2)
    finally:
        _stop_all(procs)
    last = json.loads((work / f"rank{s.stages - 1}.json").read_text())
    first = json.loads((work / "rank0.json").read_text())
    return {**last, "samples_per_s": (s.samples - first["first_samples"]) / first["seconds"]}



def pipelining_module(stage, last: bool):
    """`stage` (ours or a Hugging Face model's) as torch.distributed.pipelining takes it: a module
    that hands on one tensor, the last stage its logits. The schedule infers shapes by running each
    stage on uninitialised tensors (torch.empty), which may hold NaN: the stage's own input check
    (for peers' activations) would refuse them, so it is switched off."""
    import torch

    stage.check_input = lambda x, finite=True: None

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            out = self.inner(x)
            return out[0] if last else out

    return Logits(stage)

def rank_main(rank: int, port: int, s: Settings, out: Path) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from node.models.data import Batches, load_corpus
    from node.models.diloco import TrainConfig, adamw, lr_at
    from node.models.gpt import PRESETS
    from node.models.stages import init_stage, plan_stages

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=s.stages, timeout=datetime.timedelta(seconds=600))
    cfg = PRESETS[s.model]
    plan = plan_stages(cfg, s.stages)
    stage = init_stage(cfg, rank, plan, s.seed)
    last = rank == s.stages - 1
    module = pipelining_module(stage, last)
    n_micro = s.step_samples // s.batch_size
    pstage = PipelineStage(module, rank, s.stages, torch.device("cpu"))
    losses: list = []

    def loss_fn(logits, target):
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        return loss

    schedule = Schedule1F1B(pstage, n_micro, loss_fn=loss_fn)
    tc = TrainConfig(inner_lr=s.lr, warmup_steps=s.warmup_steps)
    opt = adamw(module.parameters(), tc)
    batches = Batches(load_corpus().train, 0, 1, s.batch_size, cfg.context, s.seed)  # the micro-batches of (a), in order
    steps, t_first, first_samples, done = 0, None, 0, 0
    while done < s.samples:
        pairs = [batches.next() for _ in range(n_micro)]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        for g in opt.param_groups:
            g["lr"] = lr_at(steps, tc)
        if rank == 0:
            schedule.step(x)
        elif last:
            step_losses: list = []
            schedule.step(target=y, losses=step_losses)
            losses.extend(float(v) for v in step_losses)
        else:
            schedule.step()
        if s.torch_clip == "global":  # one norm over every rank's parameters, as clip_grad_norm_ takes it over the whole model
            grads = [q.grad for q in module.parameters() if q.grad is not None]
            total2 = torch.stack([g.norm() for g in grads]).norm().double().pow(2).reshape(1)
            dist.all_reduce(total2)
            coef = torch.clamp(tc.grad_clip / (total2.sqrt().float() + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        else:
            torch.nn.utils.clip_grad_norm_(module.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        done += s.step_samples
        if t_first is None:
            t_first, first_samples = time.perf_counter(), done
    seconds = time.perf_counter() - t_first
    act = s.batch_size * cfg.context * cfg.n_embd * 4
    result = {
        "seconds": seconds, "first_samples": first_samples, "lost": 0,
        "bytes_per_sample": 2 * (s.stages - 1) * act / s.batch_size,  # each boundary: activations forward, their gradient back
    }  # fmt: skip
    if last:
        result["final_loss"] = sum(losses[-WINDOW:]) / WINDOW
    out.write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def run_torch_pipeline_killed(s: Settings, work: Path, kill_after_s: float = 8.0) -> dict:
    """(b) with its middle rank SIGKILLed once, `kill_after_s` into the run: what the others do
    in the `s.kill_wait_s` after it."""
    wait_s = s.kill_wait_s
    from bench.workers import kill_session

    work = _fresh(work)
    procs = _start_ranks(s, work)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < kill_after_s and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        victim = s.stages // 2
        if all(p.poll() is not None for p in procs):  # a run shorter than kill_after_s: nothing left to kill
            return {"samples_per_s": 0.0, "lost": 0, "outcome": f"every rank exited (codes {[p.poll() for p in procs]}) before the kill, {kill_after_s:g} s in"}
        kill_session(procs[victim].pid)
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait_s and any(p.poll() is None for i, p in enumerate(procs) if i != victim):
            time.sleep(0.2)
        others = {i: p.poll() for i, p in enumerate(procs) if i != victim}
        finished = [i for i in others if (work / f"rank{i}.json").exists()]
        outcome = (
            f"rank {victim} killed {kill_after_s:g} s in; " + ", ".join(
                f"rank {i} " + (f"exited with {c} after {time.monotonic() - t0:.0f} s" if c is not None else f"still waiting {wait_s:g} s later (stopped by the bench)")
                for i, c in others.items()
            ) + ("" if not finished else f"; ranks {finished} had finished")
        )  # fmt: skip
        last_error = next((line for i in others for line in reversed(_tail(work / f"rank{i}.log", 40).splitlines()) if "Error" in line), "")
        return {"samples_per_s": 0.0, "lost": "the run (no checkpoint, no rerouting)", "outcome": outcome, "error_seen": last_error[:300]}
    finally:
        _stop_all(procs)


# ---- main ---------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _stop_all(procs) -> None:
    from bench.workers import kill_session

    for p in procs:
        kill_session(p.pid)
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (the default output)")
    p.add_argument("--arms", default="a,b,c,d", help="which arms to run, e.g. a,b,c,d,e,f (f: root, network namespaces)")
    p.add_argument("--work-dir", default="", help="where each run's logs go, in a new directory of its own (default: the system's temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each arm may take")
    p.add_argument(
        "--loss-seeds", type=int, default=1,
        help="run arms a, a-rounding, c and f-* (those asked for) with this many seeds (seed, seed+1, ...) and compare their mean final losses",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="run the arms N times, every other time in reverse order; ratios compare medians (samples/s) and means (loss)")
    for f in Settings.__dataclass_fields__.values():
        kind = (lambda v: v.lower() in ("1", "true", "yes", "on")) if isinstance(f.default, bool) else type(f.default)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _refusal(args: argparse.Namespace, s: Settings) -> str | None:
    if s.step_samples % s.batch_size or s.samples % (2 * s.step_samples):
        return "--step-samples must be a multiple of --batch-size, and --samples of 2 x --step-samples"
    if args.loss_seeds < 1:
        return "--loss-seeds must be at least 1"
    if args.repeat < 1:
        return "--repeat must be at least 1"
    return None


def _arms(s: Settings, args: argparse.Namespace, work: Path):
    """(every arm: key -> (its name, how to run it), the arms --loss-seeds runs with settings st)."""
    from bench.pipeline_swarm import run_swarm

    def seedable(st: Settings) -> dict:
        """The arms whose final losses --loss-seeds compares, run with settings `st`."""
        tag = "" if st.seed == s.seed else f"-seed{st.seed}"
        return {
            "a": lambda: run_single(st),
            "a-rounding": lambda: run_single(st, "stages-global"),
            "c": lambda: run_swarm(st, work / f"c{tag}", 1, 1, False, args.timeout),
            **{  # (f): each codec's final loss against none's, over seeds (one seed's moves 1-2% with rounding alone)
                f"f-{codec}": lambda codec=codec: run_swarm(dataclasses.replace(st, activation_codec=codec), work / f"f-{codec}{tag}", 1, 1, False, args.timeout, shaped=True)
                for codec in ("none", "fp16", "int8")
            },
        }

    base = seedable(s)
    arms = {
        "a": ("the model in one process", base["a"]),
        "a-stage-clip": ("(a), each stage's gradients clipped on their own, as (b)'s ranks clip", lambda: run_single(s, "stage")),
        "a-rounding": ("(a), its global norm put together from the stages' norms as the swarm's stage servers do (float rounding apart, (a))", base["a-rounding"]),
        "b": ("torch.distributed.pipelining 1F1B over gloo, one process per stage", lambda: run_torch_pipeline(s, work / "b", args.timeout)),
        "b-global-clip": ("(b), its ranks clipping by one norm of the whole model's gradient (all_reduce): (a)'s algorithm",
                          lambda: run_torch_pipeline(dataclasses.replace(s, torch_clip="global"), work / "b-global-clip", args.timeout)),
        "b-kill": ("(b) with its middle stage's process SIGKILLed once", lambda: run_torch_pipeline_killed(s, work / "b-kill")),
        "c": ("swarm: 1 peer per stage, 1 trainer", base["c"]),
        "d": ("swarm: 2 peers per stage, 2 trainers", lambda: run_swarm(s, work / "d", 2, 2, False, args.timeout)),
        "e": (f"swarm (d), a stage peer SIGKILLed and restarted every {s.kill_every_s:g} s (the first by half way)", lambda: run_swarm(s, work / "e", 2, 2, True, args.timeout)),
    }
    # 2 in flight, asynchronous: on 2 cores 1 / 2 / 3 / 4 in flight gave 58 / 109 / 110 / 110
    # samples/s (arm c, an earlier machine), and every one more is staleness (loss 2.50 / 2.53 /
    # 2.63 / 2.79 against (a)'s 2.55)
    own = dataclasses.replace(s, stage_clip="stage")
    arms["c-stage-clip"] = ("swarm (c), each stage clipping by its own norm (stage_clip stage): (b)'s algorithm", lambda: run_swarm(own, work / "c-stage-clip", 1, 1, False, args.timeout))
    free = dataclasses.replace(s, synchronous=False, in_flight=2)
    arms["c-async"] = ("swarm (c), asynchronous steps: 2 micro-batches in flight, stages stepping as they come", lambda: run_swarm(free, work / "c-async", 1, 1, False, args.timeout))
    relay = dataclasses.replace(s, routing="relay")
    arms["c-relay"] = ("swarm (c), the trainer relaying every activation (stage_routing relay)", lambda: run_swarm(relay, work / "c-relay", 1, 1, False, args.timeout))
    arms["f-relay"] = (
        f"swarm (c), each process behind a {s.rate} link (netns), activations none, the trainer relaying them",
        lambda: run_swarm(relay, work / "f-relay", 1, 1, False, args.timeout, shaped=True),
    )
    for codec in ("none", "fp16", "int8"):
        arms[f"f-{codec}"] = (f"swarm (c), each process behind a {s.rate} link (netns), activations {codec}", base[f"f-{codec}"])
    return arms, seedable


def _run_all(runs: list) -> list[dict]:
    """Each (key, name, fn) in turn: its row (a failed arm's says why; the others go on)."""
    rows = []
    for key, name, fn in runs:
        t0 = time.monotonic()
        try:
            row = {"arm": key, "name": name, "status": "ok", **fn()}
        except Exception as e:  # one arm failing must not hide the others' results
            row = {"arm": key, "name": name, "status": "failed", "error": f"{type(e).__name__}: {e}"}
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    args = _parse(argv)
    if args.rank is not None:
        return rank_main(args.rank, args.port, Settings(**json.loads(args.settings)), Path(args.out))
    s = Settings(**{k: getattr(args, k) for k in Settings.__dataclass_fields__})
    if why := _refusal(args, s):
        print(f"error: {why}", file=sys.stderr)
        return 2
    import tempfile

    # a new directory for every run: an arm started in an earlier run's directory resumed that
    # run's swarm from its checkpoints and read its stats files, and reported them as its own
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-", dir=args.work_dir or None))
    arms, seedable = _arms(s, args, work)
    wanted = [k for a in args.arms.split(",") for k in (["f-none", "f-fp16", "f-int8"] if a == "f" else [a])]
    unknown = [k for k in wanted if k not in arms]
    if unknown:
        print(f"error: unknown arm(s) {', '.join(unknown)}; known: {', '.join(arms)} (f: all three f-*)", file=sys.stderr)
        return 2
    # the same arms with more seeds: a final loss moves by a few percent with float rounding
    # alone (a-rounding against a), more than the gap a swarm must stay within; the mean over
    # seeds tells a real gap from that noise
    runs = [(key, *arms[key]) for key in wanted]
    for r in range(2, args.repeat + 1):  # every other run in reverse: an arm is not always the one after the same other
        runs += [(f"{key}@run{r}", f"{arms[key][0]}, run {r}", arms[key][1]) for key in (wanted[::-1] if r % 2 == 0 else wanted)]
    for k in range(1, args.loss_seeds):
        other = dataclasses.replace(s, seed=s.seed + k)
        runs += [(f"{key}@seed{other.seed}", f"{arms[key][0]}, seed {other.seed}", fn) for key, fn in seedable(other).items() if key in wanted]
    rows = _run_all(runs)
    ratios = _ratios(rows, wanted, s, args)
    print(json.dumps({"settings": asdict(s), "arms": rows, "ratios": ratios, "work_dir": str(work)}, indent=1))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _ratios(rows: list[dict], wanted: list[str], s: Settings, args: argparse.Namespace) -> dict:
    """The arms side by side: samples/s and final losses over each other."""
    ok = {r["arm"]: r for r in rows if r["status"] == "ok"}

    def runs_of(key: str) -> list[str]:
        """The row keys of an arm's --repeat runs, in order."""
        return [key, *(f"{key}@run{r}" for r in range(2, args.repeat + 1))]

    # an arm's row for the ratios: its samples/s the median, its final loss the mean over --repeat runs
    by = {}
    for key in wanted:
        got = [ok[k] for k in runs_of(key) if k in ok]
        if key in ok:
            losses = [g.get("final_loss") for g in got]  # (b-kill: none)
            by[key] = {**ok[key], "samples_per_s": statistics.median(g["samples_per_s"] for g in got),
                       "final_loss": None if None in losses else sum(losses) / len(losses)}  # fmt: skip
    by.update({k: v for k, v in ok.items() if "@seed" in k})
    ratios = {}
    # the swarm against torch's pipeline: as each runs by default, and each pair running one algorithm
    # (global clip: (a)'s; each stage clipping alone: what (b)'s ranks do by default)
    for num, den in (("c", "b"), ("c-async", "b"), ("c-stage-clip", "b"), ("c", "b-global-clip")):
        key = f"{num.replace('-', '_')}_over_{den.replace('-', '_')}_samples_per_s"
        if num in by and den in by:
            ratios[key] = round(by[num]["samples_per_s"] / by[den]["samples_per_s"], 3)
            if args.repeat > 1 and num != "c-async":
                pairs = [(ok.get(n), ok.get(d)) for n, d in zip(runs_of(num), runs_of(den))]
                ratios[f"{key}_each_run"] = [round(n["samples_per_s"] / d["samples_per_s"], 3) for n, d in pairs if n and d]
    for arm in ("c", "c-async", "a-rounding", "a-stage-clip", "b", "b-global-clip"):
        if arm in by and "a" in by:
            ratios[f"{arm.replace('-', '_')}_loss_over_a"] = round(by[arm]["final_loss"] / by["a"]["final_loss"], 4)
    for arm in ("c-stage-clip", "a-stage-clip"):  # (b)'s algorithm
        if arm in by and "b" in by:
            ratios[f"{arm.replace('-', '_')}_loss_over_b"] = round(by[arm]["final_loss"] / by["b"]["final_loss"], 4)
    for arm in ("c", "f-none"):
        other = "c-relay" if arm == "c" else "f-relay"
        if arm in by and other in by:  # through routing against relay, the same swarm otherwise
            ratios[f"{arm.replace('-', '_')}_over_relay_samples_per_s"] = round(by[arm]["samples_per_s"] / by[other]["samples_per_s"], 3)
    if "d" in by and "e" in by:
        ratios["e_over_d_samples_per_s"] = round(by["e"]["samples_per_s"] / by["d"]["samples_per_s"], 3)
    ratios.update(_seed_ratios(by, s, args.loss_seeds))
    return ratios


def _seed_ratios(by: dict, s: Settings, seeds: int) -> dict:
    """The codecs' losses over none's; with several seeds, every ratio of mean losses over seeds."""

    def mean_loss(arm: str) -> float | None:
        """The arm's final loss over every seed; None unless each seed's run succeeded."""
        got = [by[k]["final_loss"] for k in [arm, *(f"{arm}@seed{s.seed + i}" for i in range(1, seeds))] if k in by]
        return sum(got) / len(got) if len(got) == seeds else None

    ratios = {}
    if seeds > 1 and (mean_a := mean_loss("a")) is not None:
        for arm in ("c", "a-rounding"):
            if (mean := mean_loss(arm)) is not None:
                ratios[f"{arm.replace('-', '_')}_loss_over_a_mean_of_{seeds}_seeds"] = round(mean / mean_a, 4)
    for codec in ("fp16", "int8"):
        if "f-none" in by and f"f-{codec}" in by:
            ratios[f"f_{codec}_over_none_samples_per_s"] = round(by[f"f-{codec}"]["samples_per_s"] / by["f-none"]["samples_per_s"], 3)
            ratios[f"f_{codec}_loss_over_none"] = round(by[f"f-{codec}"]["final_loss"] / by["f-none"]["final_loss"], 4)
            if seeds > 1 and (mean := mean_loss(f"f-{codec}")) is not None and (none := mean_loss("f-none")) is not None:
                ratios[f"f_{codec}_loss_over_none_mean_of_{seeds}_seeds"] = round(mean / none, 4)
    return ratios


if __name__ == "__main__":
    sys.exit(main())
