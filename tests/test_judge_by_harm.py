"""The judge by harm (node/averaging aggregators.harm_ratios, HarmRuns; node/roles/check_batch.py):
a part that lies near the others but points the wrong way raises the loss of its sender's own
data where the robust aggregate lowers it. One check batch is noisy, so only a run of such
rounds accuses. Measured on the tiny model's real updates, through real rounds of averagers
over libp2p."""

import asyncio
import copy
import time

import pytest
import torch

from node.averaging.aggregators import HARM, HARM_RUN, HarmRuns, centered_clip, harm_ratios
from node.models.data import Batches, load_corpus, shard_of
from node.models.diloco import InnerTrainer, OuterOptimizer, TrainConfig
from node.models.gpt import GPT, PRESETS
from node.roles.attacks import Attack
from node.roles.check_batch import CheckBatch
from tests.swarm import averagers

pytestmark = pytest.mark.timeout(180)


def test_harm_is_measured_against_what_the_aggregate_gained_on_the_same_batch_and_only_a_run_of_it_accuses():
    losses = [(5.0, 4.0, 4.2), (3.0, 2.0, 3.5), (5.0, 4.0, 3.9)]  # per member: at θ, with the aggregate, with its part
    assert harm_ratios(losses, ["a", "b", "c"]) == {"a": -0.8, "b": 0.5, "c": -1.1}
    assert harm_ratios([(5.0, 5.1, 6.0), *losses[1:]], ["a", "b", "c"]) == {"b": 0.5, "c": -1.1}  # the aggregate did not help a's batch: a not judged
    assert harm_ratios(losses[:2], ["a", "b"]) == {}  # no majority
    assert harm_ratios([(5.0, 4.0, float("nan")), *losses[1:]], ["a", "b", "c"]) == {"b": 0.5, "c": -1.1}
    runs = HarmRuns()
    for k in range(HARM_RUN - 1):  # "liar" harms every round; "noisy" harms, then once not
        assert runs.add({0: {"liar": 0.2, "noisy": 3.0 if k != 2 else -1.0, "honest": -1.0}}) == {}
    assert runs.add({0: {"liar": 0.2, "noisy": 5.0, "honest": -1.0}}) == {"liar": (HARM_RUN, 0.2)}
    assert runs.add({}) == {} and runs.runs["liar"] == HARM_RUN  # a round that did not judge it: its run goes on
    assert runs.add({3: {"liar": 0.01}, 5: {"liar": HARM / 2}}) == {} and runs.runs["liar"] == 0  # within the noise: the run ends
    assert runs.add({1: {"liar": -0.5}, 2: {"liar": 0.3}}) == {} and runs.runs["liar"] == 1  # the worst of its slices counts


def _tiny_updates(steps: int = 4):
    """θ of the tiny model and two honest pseudo-gradients, of replicas on the data shards their
    peer ids pick; the peer ids."""
    corpus, cfg = load_corpus(), TrainConfig(seed=0)
    base = GPT(PRESETS["tiny"])
    outer = OuterOptimizer(base.parameters(), cfg.outer_lr, cfg.outer_momentum)
    names = [n for n in (f"12D3peer{k}" for k in range(64)) if shard_of(n, 8) in (2, 5)]
    names = [next(n for n in names if shard_of(n, 8) == s) for s in (2, 5)]
    updates = []
    for n in names:
        m = copy.deepcopy(base)
        inner = InnerTrainer(m, cfg, Batches(corpus.train, shard_of(n, 8), 8, cfg.batch_size, PRESETS["tiny"].context, 7))
        for _ in range(steps):
            inner.step()
        updates.append(torch.cat([t.flatten() for t in outer.pseudo_gradient(m.parameters())]))
    return corpus, cfg, base, outer, updates, names


def test_the_check_batch_finds_a_small_step_against_the_update_harmful_and_honest_ones_not():
    corpus, cfg, base, outer, (g0, g1), names = _tiny_updates()
    check = CheckBatch(base, corpus.train, 8, cfg.batch_size, PRESETS["tiny"].context, cfg.outer_lr, seed=3)
    judge = check.judge(outer.params, range(len(outer.params)))
    n = g0.numel()
    ipm = Attack("ipm").apply([g0.clone()])[0]
    members = [*names, names[0]]  # the liar: g0's sender, its own update reversed and shrunk
    for a, b in ((0, n // 2), (n // 3, n)):  # two slices, across several tensors each
        parts = [g0[a:b], g1[a:b], ipm[a:b]]
        losses = judge(a, b, parts, centered_clip(parts, torch.ones(3)), members)
        ratios = list(harm_ratios(losses, ["h0", "h1", "ipm"]).values())
        assert len(ratios) == 3 and ratios[0] < 0 and ratios[1] < 0 and ratios[2] > HARM, ratios
        assert losses[0][:2] == losses[2][:2]  # one batch per shard and round: the same θ and aggregate losses
    # θ is back after each slice: the next round's judge of a fragment (its tensors only) starts from it
    part = range(2, 6)
    frag = torch.cat([outer.params[i].flatten() for i in part]).numel()
    again = check.judge(outer.params, part)
    for at_theta, with_agg, with_part in again(0, frag, [torch.zeros(frag)] * 3, torch.zeros(frag), members):
        assert at_theta == with_agg == with_part  # nothing moved: every loss the same
    assert all(torch.equal(p, o) for p, o in zip(check.model.parameters(), outer.params))


def test_rounds_with_a_judge_accuse_the_sender_of_harmful_parts_after_a_run_and_ban_it():
    """Four averagers (real rounds over libp2p, CenteredClip); every member's loss is
    ||θ - target||² and θ = 0, so an honest part (near the target) lowers it and the liar's (a tenth of the target,
    reversed) raises it, from within the group's spread. A judge that fails judges nobody."""
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(4096, generator=gen)

    def loss(v: torch.Tensor, a: int, b: int) -> float:
        return float((target[:a].pow(2).sum() + (target[a:b] - v).pow(2).sum() + target[b:].pow(2).sum()))

    def judge(a, b, parts, agg, members):
        return [(loss(torch.zeros(b - a), a, b), loss(agg, a, b), loss(p, a, b)) for p in parts]

    def broken(a, b, parts, agg, members):
        raise RuntimeError("out of memory")

    async def main():
        async with averagers(4, aggregator="centered_clip", join_timeout_s=10) as avgs:
            liar = avgs[3].host.peer_id
            for r in range(HARM_RUN + 6):
                parts = [target + 0.3 * torch.randn(4096, generator=gen) for _ in range(3)] + [-0.1 * target]
                judges = [broken if r == 0 else judge] * 3 + [None]  # the liar judges nobody
                outs = await asyncio.gather(*(a.average(f"r{r}", [p], expected_peers=4, judge=j) for a, p, j in zip(avgs, parts, judges)))
                assert all(rep.ok for _, rep in outs)
                banned = [liar in a.transport.scores.banned_now(time.monotonic()) for a in avgs[:3]]
                if all(banned):
                    break
            assert all(banned), r
            assert r >= HARM_RUN + 4  # not before a run of harmful rounds (from round 1), then five such rounds
            for a in avgs[:3]:
                (ban,) = a.transport.scores.bans(time.monotonic())
                assert ban["peer_id"] == liar and "raised the loss of its own data" in ban["reason"], ban
                assert a.harm_runs.runs[liar] >= HARM_RUN and all(a.harm_runs.runs[h.host.peer_id] == 0 for h in avgs[:3] if h is not a)

    asyncio.run(main())
