"""Real model sizes in the swarm's roles, side by side with one process and torch's pipeline.

    python -m bench.models --json [--models gpt2,llama] [--stages 4] [--device cpu] [--seq-len 256]
                           [--batch-size 2] [--steps 4] [--arms daemon,reference,...] [--tiny]

Two models, built from their configs with a random init (nothing downloaded; bench/models_settings.py):
GPT-2 small (GPT2Config's defaults: 12 layers, 768 wide, vocabulary 50257; n_positions set to
--seq-len) and a Llama-style model (768 wide, 10 layers, MLP 2048, 12 heads, vocabulary 32000,
tied embeddings). For each, in one run:

  reference       one plain process: the model and AdamW, a replica's inner steps on its batches;
  replica         a coordinator and one replica (AdamW, DiLoCo outer state): tokens/s of its inner steps;
  pipeline        a coordinator, one stage server per stage of the cut, one trainer, synchronous steps
                  (bench/pipeline.py's arm c);
  torch-pipeline  torch.distributed.pipelining, Schedule1F1B over gloo, one rank per stage holding
                  the same cut (HFStage.cut), on the trainer's micro-batches;

and once: daemon (a node with no coordinator to join: it never gets a role), joiner (GPT-2, or
the first model: --joiner-replicas replicas train, one more joins; its start to its first outer
step and its state download), checkpoint (that swarm's kept checkpoint written again by
CheckpointStore.save, and `swarmtrain-model export` of the coordinator's data dir).

Memory is each process tree's (the process, its DHT child, its p2pd, anything else it started)
peak over the arm, as summed RSS and summed PSS (bench/memory.py); the targets use PSS. Every
process trains with --threads torch threads (default 1). The joiner is skipped where the replica
arm's peak says its replicas cannot fit in memory, and an arm is stopped when the machine has
less than 1 GiB left (a shared machine must not swap or kill). Arms run one after another; prints one
JSON object; exits 1 if an arm failed, 2 on settings it refuses (--device cuda among them: the
roles keep their models on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.memory import available_mib
from bench.models_settings import Settings, child_env, make_model_dir

ARMS = ("daemon", "reference", "replica", "pipeline", "torch-pipeline", "joiner", "checkpoint")
TARGETS = {"stage_over_replica_pss": 0.35, "daemon_pss_mib": 350.0, "pipeline_over_torch_tokens_per_s": 0.9, "joiner_s": 60.0}
CONFIG_KEYS = ("n_layer", "n_embd", "n_head", "n_positions", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings")  # fmt: skip
MEMORY_NOTE = ("memory: each role's process tree (the process, its DHT child, its p2pd, any other process it started), the peak over the arm "
               "of the summed RSS (rss_mib: shared pages counted once per process) and of the summed PSS (pss_mib: /proc/PID/smaps_rollup, "
               "shared pages split among the processes mapping them: what the tree costs); the targets use PSS")  # fmt: skip


def device_problem(device: str) -> str | None:
    """Why the bench cannot run on `device`, in one line; None for the CPU."""
    if device == "cpu":
        return None
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}: CUDA is not available on this machine (torch {torch.__version__})"
    if device.startswith("cuda"):
        return (f"--device {device}: the roles cannot take a device: a node checks and measures --device, but the replica, the stage "
                "servers and the trainer build, train and send their models and activations on the CPU")  # fmt: skip
    return f"--device {device}: only cpu (and cuda, once the roles can take it) are measured"


class Skipped(Exception):
    """An arm not run, for the reason its message gives."""


def _row(rows: list, key: str, fn) -> dict | None:
    """Run one arm; its row (status, wall time, error) in `rows`; its result, None if it failed."""
    t0 = time.monotonic()
    try:
        got = fn()
        row = {"arm": key, "status": "ok"}
    except Skipped as e:
        got, row = None, {"arm": key, "status": "skipped", "reason": str(e)}
    except Exception as e:  # one arm failing must not hide the others' results
        got, row = None, {"arm": key, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    row["wall_s"] = round(time.monotonic() - t0, 1)
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return got


def run_family(family: str, s: Settings, arms: list[str], work: Path, watch, rows: list) -> dict:
    from bench import models_local as local
    from bench import models_swarm as swarm

    model_dir = make_model_dir(family, s, work)
    facts = local.model_facts(model_dir, s)
    out = {"params": facts["params"], "stage_params": facts["stage_params"], "stage_layers": facts["stage_layers"],
           "config": {k: facts["config"][k] for k in CONFIG_KEYS if k in facts["config"]},
           "context_tokens": s.seq_len, "context_note": "the model's context (GPT-2 n_positions, Llama max_position_embeddings) set to --seq-len",
           "model_dir": str(model_dir)}  # fmt: skip
    steps = {
        "reference": lambda: local.run_reference(s, model_dir, work / f"{family}-reference", watch),
        "replica": lambda: swarm.run_replica(s, model_dir, work / f"{family}-replica", watch),
        "pipeline": lambda: swarm.run_pipeline_swarm(s, model_dir, work / f"{family}-pipeline", watch),
        "torch-pipeline": lambda: local.run_torch_pipelining(s, model_dir, work / f"{family}-torch-pipeline", watch),
    }
    for arm, fn in steps.items():
        if arm in arms:
            got = _row(rows, f"{family}/{arm}", fn)
            if got is not None:
                out[arm.replace("-", "_")] = got
    for st in out.get("pipeline", {}).get("stage_servers", []):
        st.update(params=facts["stage_params"][st["stage"]], layers=facts["stage_layers"][st["stage"]])
    out["ratios"] = _ratios(out)
    return out


def _pss(part: dict | None) -> float | None:
    memory = (part or {}).get("memory")
    return memory["pss_mib"] if memory else None


def _ratios(m: dict) -> dict:
    r = {}
    ref, rep, pipe, torch_ = (m.get(k) for k in ("reference", "replica", "pipeline", "torch_pipeline"))
    if ref and rep:
        r["replica_over_reference_tokens_per_s"] = round(rep["tokens_per_s"] / ref["tokens_per_s"], 3)
        if _pss(ref) and _pss(rep):
            r["replica_over_reference_pss"] = round(_pss(rep) / _pss(ref), 3)
    if pipe and torch_:
        r["pipeline_over_torch_pipelining_tokens_per_s"] = round(pipe["tokens_per_s"] / torch_["tokens_per_s"], 3)
        r["stage_server_over_torch_rank_pss"] = [round(_pss(a) / _pss(b), 3) for a, b in zip(pipe["stage_servers"], torch_["ranks"]) if _pss(a) and _pss(b)]
    if pipe and torch_ and "cpu_in_window" in pipe and "cpu_in_window" in torch_:
        r["pipeline_over_torch_pipelining_cpu_s_per_token"] = round(pipe["cpu_in_window"]["cpu_s_per_1k_tokens"] / torch_["cpu_in_window"]["cpu_s_per_1k_tokens"], 3)
    if pipe and _pss(rep):
        r["stage_server_over_replica_pss"] = [round(_pss(st) / _pss(rep), 3) if _pss(st) else None for st in pipe["stage_servers"]]
        last = lambda part: (part.get("memory") or {}).get("pss_mib_last")  # noqa: E731  (while training, at the arm's end)
        if last(rep) and all(last(st) for st in pipe["stage_servers"]):
            r["stage_server_over_replica_pss_at_end"] = [round(last(st) / last(rep), 3) for st in pipe["stage_servers"]]
        r["stage_params_over_model_params"] = [round(p / m["params"], 3) for p in m["stage_params"]]
    return r


def targets(result: dict) -> list[dict]:
    out = []

    def add(name: str, what: str, limit: float, measured, at_most: bool) -> None:
        met = measured is not None and (measured <= limit if at_most else measured >= limit)
        out.append({"target": name, "what": what, ("at_most" if at_most else "at_least"): limit, "measured": measured, "met": met})

    for family, m in result["models"].items():
        stages = m["ratios"].get("stage_server_over_replica_pss") or []
        worst = max(stages) if stages and None not in stages else None
        add(f"{family}_stage_server_memory", "the largest stage server's PSS over the replica's (every stage server of the cut)", TARGETS["stage_over_replica_pss"], worst, True)
        add(f"{family}_pipeline_tokens_per_s", "the pipeline swarm's tokens/s over torch.distributed.pipelining's", TARGETS["pipeline_over_torch_tokens_per_s"],
            m["ratios"].get("pipeline_over_torch_pipelining_tokens_per_s"), False)  # fmt: skip
    daemon = result.get("daemon")
    add("daemon_memory", "a node with no model (node, DHT child, p2pd): PSS MiB", TARGETS["daemon_pss_mib"], _pss(daemon), True)
    joiner = result.get("joiner")
    n = result.get("settings", {}).get("joiner_replicas", 2)
    add("joiner_time", f"a replica joining {n} training: seconds from its process start to its first outer step", TARGETS["joiner_s"],
        joiner["seconds_to_first_outer_step"] if joiner else None, True)  # fmt: skip
    return out


def run(s: Settings, arms: list[str], work: Path) -> dict:
    from bench import models_swarm as swarm
    from bench.memory import MemoryWatch

    rows: list[dict] = []
    result: dict = {"settings": dataclasses.asdict(s), "memory_note": MEMORY_NOTE, "models": {}}
    with MemoryWatch(1.0) as watch:
        if "daemon" in arms:
            result["daemon"] = _row(rows, "daemon", lambda: swarm.run_daemon(s, work / "daemon", watch))
        for family in s.families:
            result["models"][family] = run_family(family, s, arms, work, watch, rows)
        big = "gpt2" if "gpt2" in s.families else s.families[0]  # the joiner's and the checkpoint's model
        model_dir = Path(result["models"][big]["model_dir"])
        if "joiner" in arms:
            def joiner() -> dict:
                _check_room(s, result["models"][big].get("replica"))
                return {"model": big, "replicas_before_join": s.joiner_replicas, **swarm.run_joiner(s, model_dir, work / "joiner", watch)}

            result["joiner"] = _row(rows, "joiner", joiner)
        if "checkpoint" in arms:
            # the joiner's coordinator, else the replica arm's: each keeps its run's checkpoint 0 (the seeded init)
            coord = next((p for p in (work / "joiner" / "coordinator", work / f"{big}-replica" / "coordinator") if (p / "checkpoints").is_dir()), None)
            result["checkpoint"] = _row(rows, "checkpoint", lambda: {"model": big, **swarm.run_checkpoint(s, _need(coord), work / "checkpoint")})
    result["targets"] = targets(result)
    result["arms"] = rows
    return result


def _check_room(s: Settings, replica: dict | None) -> None:
    """Skipped when the joiner's replicas would not fit in this machine's memory, going by the
    replica arm's peak RSS (a shared machine swaps or kills when they do not): the arm's own
    replicas hold averaging buffers on top, so this is the least they need."""
    if not replica or not replica.get("memory"):
        return
    each = replica["memory"]["rss_mib"]
    need = (s.joiner_replicas + 1) * each
    available = available_mib()
    if need > available:
        raise Skipped(f"{s.joiner_replicas + 1} replicas of {each:.0f} MiB RSS each (the replica arm's peak) need {need:.0f} MiB, this machine has {available} MiB available; "
                      f"--joiner-replicas {max(1, available // int(each) - 1)} fits")  # fmt: skip


def _need(coord: Path | None) -> Path:
    if coord is None:
        raise RuntimeError("no coordinator kept a checkpoint: the checkpoint arm needs the joiner or the replica arm in the same run")
    return coord


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (the only output)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"which arms to run (default all: {','.join(ARMS)})")
    p.add_argument("--work-dir", default="", help="keep every arm's logs, stats and checkpoints here (default: a temporary directory, removed at the end)")
    for f in dataclasses.fields(Settings):
        flag = f"--{f.name.replace('_', '-')}".replace("--timeout-s", "--timeout")
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", default=f.default)
        else:
            p.add_argument(flag, dest=f.name, type=type(f.default), default=f.default)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    s = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    arms = [a for a in args.arms.split(",") if a]
    problem = s.problem() or device_problem(s.device)
    if not problem and (unknown := [a for a in arms if a not in ARMS]):
        problem = f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}"
    if problem:
        print(f"bench.models: error: {problem}", file=sys.stderr)
        return 2
    os.environ.update(child_env(s))  # every daemon the harness starts inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM unwinds like Ctrl-C: every arm's `finally` stops its processes
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-models-", dir=args.work_dir or None))
    try:
        result = run(s, arms, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    for m in result["models"].values():
        m.pop("model_dir", None)
    print(json.dumps(result, indent=1))
    return 0 if all(r["status"] in ("ok", "skipped") for r in result["arms"]) else 1


if __name__ == "__main__":
    sys.exit(main())
