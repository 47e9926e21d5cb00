"""The evidence against each kind of lie, side by side: how often a liar's part of a slice lies far
from the robust aggregate (aggregators.far_parts), how often it harms a check batch, and how often
a run of harm accuses it (HarmRuns), against the same for honest parts. In this process, no
network: eight replicas of the tiny model, each on the data shard its (made-up) peer id picks,
train `--inner-steps` from one θ; six send honest updates, and each lie in turn takes the seventh
place (replica 6's update made into that lie; other-data: replica 7, which trains on mirrored
tokens). The outer step applies the honest mean, so every kind is judged on the same path.

    python -m bench.byzantine_judge --json --inner-steps 10 --outer-steps 16 --seed 0

Two check batches per judgement: `own` (node/roles/check_batch.py: each member on its own
shard's data) and `val` (one validation batch for everyone), the one the judge does not use.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys

import torch

from node.averaging.aggregators import FAR, HARM, HarmRuns, centered_clip, far_parts, harm_ratios
from node.models.data import Batches, load_corpus, shard_of
from node.models.diloco import InnerTrainer, OuterOptimizer, TrainConfig, copy_into
from node.models.gpt import GPT, PRESETS
from node.roles.attacks import Attack
from node.roles.check_batch import CheckBatch

N = 8
KINDS = ("honest", "ipm", "alie", "stale", "noise", "other-data")


def _ids(seed: int) -> list[str]:
    """Made-up peer ids, the i-th on shard i of N."""
    return [next(f"peer-{seed}-{k}" for k in range(10**6) if shard_of(f"peer-{seed}-{k}", N) == i) for i in range(N)]


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # (small tensors; beside a busy machine, more threads only wait on each other)
    corpus, mc, cfg = load_corpus(), PRESETS["tiny"], TrainConfig(seed=args.seed)
    ids = _ids(args.seed)
    base = GPT(mc)
    models = [copy.deepcopy(base) for _ in range(N)]
    inners = [InnerTrainer(m, cfg, Batches(corpus.train, i, N, cfg.batch_size, mc.context, cfg.seed + i)) for i, m in enumerate(models)]
    inners[7].batches = Attack("other-data").data(inners[7].batches, corpus.vocab_size)
    outer = OuterOptimizer(base.parameters(), cfg.outer_lr, cfg.outer_momentum)
    checks = {"own": CheckBatch(base, corpus.train, N, cfg.batch_size, mc.context, cfg.outer_lr, args.seed + 99)}
    checks["val"] = CheckBatch(base, corpus.val, 1, cfg.batch_size, mc.context, cfg.outer_lr, args.seed + 99)  # one shard: everyone on one batch
    attacks = {k: Attack(k, seed=args.seed) for k in ("ipm", "alie", "stale", "noise")}
    numel = sum(p.numel() for p in base.parameters())
    bounds = [round(numel * j / N) for j in range(N + 1)]
    runs = {(c, k, j): HarmRuns() for c in checks for k in KINDS for j in range(N)}  # one per owner of slice j
    tally = {c: {k: {"harm": 0, "accused": 0, "honest_harm": 0, "honest_accused": 0} for k in KINDS} for c in checks}
    far: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.outer_steps):
        ups = []
        for m, inner in zip(models, inners):
            copy_into(m.parameters(), outer.params)
            for _ in range(args.inner_steps):
                inner.step()
            ups.append(torch.cat([t.flatten() for t in outer.pseudo_gradient(m.parameters())]))
        lies = {"honest": ups[6], **{k: a.apply([ups[6].clone()])[0] for k, a in attacks.items()}, "other-data": ups[7]}
        judges = {c: ch.judge(outer.params, range(len(outer.params))) for c, ch in checks.items()}
        for k, lie in lies.items():
            names = [*ids[:6], ids[7] if k == "other-data" else ids[6]]
            for j in range(N):
                parts = [u[bounds[j] : bounds[j + 1]] for u in (*ups[:6], lie)]
                agg = centered_clip(parts, torch.ones(len(parts)))
                far[k].append(far_parts(parts, agg, names, far=0.0)[names[-1]])
                for c, judge in judges.items():
                    ratios, t = harm_ratios(judge(bounds[j], bounds[j + 1], parts, agg, names), names), tally[c][k]
                    accused = runs[c, k, j].add({j: ratios})
                    t["harm"] += ratios.get(names[-1], -1.0) > HARM
                    t["accused"] += names[-1] in accused
                    t["honest_harm"] += sum(ratios.get(n, -1.0) > HARM for n in names[:6])
                    t["honest_accused"] += sum(n in accused for n in names[:6])
        honest_mean = torch.stack(ups[:6]).mean(0)
        for a in attacks.values():
            a.observe([honest_mean])
        outer.apply([t.view_as(p) for t, p in zip(torch.split(honest_mean, [p.numel() for p in outer.params]), outer.params)])
    judged = args.outer_steps * N
    return {
        "config": {**vars(args), "judgements_per_kind": judged, "far": FAR, "harm": HARM},
        "far": {k: {"over_far": sum(x > FAR for x in v), "median_x_spread": round(statistics.median(v), 2)} for k, v in far.items()},
        "check": tally,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.byzantine_judge", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--outer-steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.inner_steps < 1 or args.outer_steps < 1:
        p.error("--inner-steps and --outer-steps must be at least 1")
    json_flag = args.json
    del args.json
    result = run(args)
    print(json.dumps(result, indent=1) if json_flag else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
