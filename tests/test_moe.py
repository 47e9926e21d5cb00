"""The mixture-of-experts model: routing over live experts, capacity, the balance loss, training."""

from __future__ import annotations

import pytest
import torch

from node.models.data import Batches, load_corpus
from node.models.gpt import PRESETS, GPTConfig
from node.models.moe import MOE_PRESETS, MoEConfig, MoELayer, Router, combine, expert_name, init_moe_model

pytestmark = pytest.mark.timeout(120)
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, context=16)


def test_same_seed_same_bits_and_every_block_has_e_experts():
    cfg, moe = MOE_PRESETS["tiny-moe"]
    a, b = init_moe_model(cfg, moe, 0), init_moe_model(cfg, moe, 0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.blocks[0].moe.router.gate.weight, init_moe_model(cfg, moe, 1).blocks[0].moe.router.gate.weight)
    assert all(len(block.moe.experts) == moe.num_experts for block in a.blocks)
    assert a.expert(expert_name(1, 3)) is a.blocks[1].moe.experts[3]
    for bad in ("layer2.expert0", "layer0.expert4", "layer-1.expert0", "expert0", "layer0.gate"):
        with pytest.raises(KeyError, match="no expert"):
            a.expert(bad)


def test_each_token_goes_to_its_top_k_live_experts_with_gates_summing_to_one():
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=100.0)
    router = Router(CFG.n_embd, moe)
    x = torch.randn(64, CFG.n_embd)
    r = router(x)
    per_token = torch.zeros(64)
    count = torch.zeros(64)
    for idx, w in zip(r.tokens, r.weights):
        per_token.index_add_(0, idx, w.detach())
        count.index_add_(0, idx, torch.ones(idx.numel()))
    assert torch.all(count == 2) and torch.allclose(per_token, torch.ones(64)) and r.dropped == 0

    # expert 1 dead (its host gone): it takes nothing, the others' gates still sum to one
    dead = router(x, alive=[True, False, True, True])
    assert dead.tokens[1].numel() == 0
    per_token.zero_()
    for idx, w in zip(dead.tokens, dead.weights):
        per_token.index_add_(0, idx, w.detach())
    assert torch.allclose(per_token, torch.ones(64))
    # one live expert left: every token goes to it alone, with gate 1 (k shrinks to what lives)
    alone = router(x, alive=[False, False, True, False])
    assert alone.tokens[2].tolist() == list(range(64)) and torch.allclose(alone.weights[2], torch.ones(64))
    with pytest.raises(ValueError, match="no expert is alive"):
        router(x, alive=[False] * 4)
    with pytest.raises(ValueError, match="alive has 3 entries"):
        router(x, alive=[True] * 3)


def test_an_expert_over_capacity_drops_the_tokens_that_chose_it_last():
    moe = MoEConfig(num_experts=2, top_k=1, capacity_factor=0.5)  # capacity: ceil(0.5 x 8 x 1 / 2) = 2
    router = Router(4, moe)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]))
    x = torch.zeros(8, 4)
    x[:, 0] = 1.0  # every token prefers expert 0
    r = router(x)
    assert r.tokens[0].tolist() == [0, 1] and r.tokens[1].numel() == 0 and r.dropped == 6


def test_the_live_experts_share_the_batch_when_some_are_dead():
    # 4 experts, top 2, capacity factor 1.25: 1.25 x 64 x 2 / 4 = 40 tokens each when all live.
    # With 2 dead, every token goes to both live ones: 64 each, within 1.25 x 64 x 2 / 2 = 80 (a
    # capacity over all 4 experts would drop 24 of each one's 64 tokens)
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25)
    assert (moe.capacity(64), moe.capacity(64, live=2), moe.capacity(64, live=1)) == (40, 80, 80)
    r = Router(8, moe)(torch.randn(64, 8), alive=[True, False, True, False])
    assert r.dropped == 0 and r.tokens[0].numel() == r.tokens[2].numel() == 64 and r.tokens[1].numel() == r.tokens[3].numel() == 0


def test_balance_loss_is_one_when_uniform_and_grows_when_one_expert_takes_all():
    moe = MoEConfig(num_experts=4, top_k=1, capacity_factor=100.0)
    router = Router(4, moe)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4) * 5)
    uniform = router(torch.eye(4).repeat(8, 1))  # a quarter of the tokens prefers each expert
    skewed = router(torch.eye(4)[:1].repeat(32, 1))  # every token prefers expert 0
    assert uniform.aux_loss.item() == pytest.approx(1.0, rel=1e-5)
    assert skewed.aux_loss.item() > 3.0


def test_the_layer_is_route_experts_combine_and_a_skipped_expert_only_loses_its_share():
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=100.0)
    layer = MoELayer(CFG, moe)
    x = torch.randn(2, 8, CFG.n_embd)
    y, aux = layer(x)
    flat = x.reshape(16, CFG.n_embd)
    r = layer.router(flat)
    outs = [e(flat[idx]) for e, idx in zip(layer.experts, r.tokens)]
    assert torch.allclose(combine(outs, r, flat).view_as(y), y, atol=1e-6)
    # the gradient reaches the router through the gates, and every expert that took tokens
    (y.square().sum() + aux).backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0
    assert all(e.c_fc.weight.grad is not None for e, idx in zip(layer.experts, r.tokens) if idx.numel())
    # expert 0 skipped (its call failed): its tokens keep the other expert's output only
    skipped = combine([None, *outs[1:]], r, flat)
    with torch.no_grad():
        assert torch.allclose(skipped, combine([torch.zeros_like(outs[0]), *outs[1:]], r, flat))


def test_bad_moe_settings_are_named():
    for kw, what in [({"num_experts": 0}, "num_experts"), ({"top_k": 5}, "top_k"), ({"capacity_factor": 0.0}, "capacity_factor"), ({"aux_loss_weight": -1.0}, "aux_loss_weight")]:
        with pytest.raises(ValueError, match=what):
            MoEConfig(**kw)


def test_the_moe_model_trains_on_the_corpus():
    torch.manual_seed(0)
    cfg, moe = PRESETS["tiny"], MoEConfig(num_experts=4, top_k=2)
    model = init_moe_model(cfg, moe, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = Batches(load_corpus().train, 0, 1, 8, cfg.context, 0)
    losses = []
    for _ in range(60):
        x, y = batches.next()
        _, loss, aux = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert 0.9 <= aux.item() < 4.0  # E x sum(share x prob): 1 when balanced, at most E
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0, losses[::10]
