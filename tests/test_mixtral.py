"""A Hugging Face Mixtral cut for the experts role (node/models/mixtral.py): the trainer's dense
parts with every expert called through the swarm's routing compute what transformers'
MixtralForCausalLM computes (logits, loss with its router loss, gradients); shards are slices of
the fused expert tensors whose union puts them back; Mixtral's routing routes around dead experts."""

from __future__ import annotations

import pytest
import torch
import transformers

from node.models.hf import build_causal_lm
from node.models.mixtral import MixtralExpertShard, forward_loss, fuse_experts, local_experts, mixtral_layout, mixtral_routing, split_experts
from node.models.moe import ExpertLayout, expert_name

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SEED = 5


def tiny_config(**over) -> dict:
    """A tiny Mixtral's config.json: 2 layers, width 32, 4 experts, top-2, bytes as tokens."""
    settings = dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, vocab_size=256, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip
    cfg = transformers.MixtralConfig(**{**settings, **over})
    return cfg.to_dict()



def swarm_parts(config: dict, shards: int):
    """(the trainer's dense model, the shards' experts), all from one seed,
    each built as its role builds it."""
    layout = mixtral_layout(build_causal_lm(config, seed=SEED).hf.config)
    parts = [MixtralExpertShard(build_causal_lm(config, seed=SEED), layout.shard(s, shards)) for s in range(shards)]
    dense = build_causal_lm(config, seed=SEED)
    split_experts(dense)
    return dense, parts


def batch(seed=0, b=2, t=12, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def test_the_dense_parts_with_every_expert_compute_transformers_mixtral():
    config = tiny_config()
    reference = build_causal_lm(config, seed=SEED)
    dense, shards = swarm_parts(config, 2)
    x, y = batch()
    out = reference.hf(input_ids=x, use_cache=False, output_router_logits=True)
    want_ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))
    want_loss = want_ce + reference.hf.config.router_aux_loss_coef * out.aux_loss
    logits, ce, loss = forward_loss(dense, local_experts(shards), x, y)
    assert (logits - out.logits).abs().max() < 1e-5
    assert abs(ce.item() - want_ce.item()) < 1e-5 and abs(loss.item() - want_loss.item()) < 1e-5
    assert loss.item() != ce.item()  # the router's loss is in (output_router_logits)
    # gradients: the dense parts' are the reference's, each expert's a slice of the fused one's
    want_loss.backward()
    loss.backward()
    ref = dict(reference.named_parameters())
    names = {n for n, _ in dense.named_parameters()}
    assert names == {n for n in ref if ".mlp.experts." not in n}  # the dense parts are all but the experts, by transformers' names
    for n, p in dense.named_parameters():
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    for shard in shards:
        for name, p in shard.named_parameters():
            layer, expert, kind = name.split(".")
            fused = ref[f"model.layers.{layer[5:]}.mlp.experts.{kind}"].grad[int(expert[6:])]
            torch.testing.assert_close(p.grad, fused, rtol=1e-4, atol=1e-6, msg=name)


def test_without_output_router_logits_the_loss_is_the_cross_entropy():
    config = tiny_config(output_router_logits=False)
    dense, shards = swarm_parts(config, 1)
    _, ce, loss = forward_loss(dense, local_experts(shards), *batch(1))
    assert loss.item() == ce.item()


def test_shards_are_slices_named_per_expert_and_their_union_is_the_fused_tensors():
    config = tiny_config()
    reference = build_causal_lm(config, seed=SEED)
    layout = mixtral_layout(reference.hf.config)
    assert layout == ExpertLayout(layers=2, experts=4, top_k=2, width=32)
    shards = [MixtralExpertShard(build_causal_lm(config, seed=SEED), layout.shard(s, 3)) for s in range(3)]
    assert shards[1].names == ("layer0.expert1", "layer1.expert1")  # 4 experts on 3 shards: 0 and 3, 1, 2
    assert sorted(n for n, _ in shards[0].named_parameters()) == sorted(f"{e}.{k}" for e in layout.shard(0, 3) for k in ("gate_up_proj", "down_proj"))
    assert shards[0]["layer1.expert3"].gate_up_proj.shape == (96, 32) and shards[0]["layer1.expert3"].down_proj.shape == (32, 48)
    union = {n: p.detach() for s in shards for n, p in s.named_parameters()}
    fused = fuse_experts(union, layout)
    state = reference.state_dict()
    assert sorted(fused) == sorted(n for n in state if ".mlp.experts." in n)
    assert all(torch.equal(fused[n], state[n]) for n in fused)
    del union["layer1.expert2.down_proj"]
    with pytest.raises(KeyError, match="expert 2 of layer 1"):
        fuse_experts(union, layout)
    with pytest.raises(KeyError, match="no expert 'layer2.expert0'"):
        MixtralExpertShard(reference, [expert_name(2, 0)])


def test_routing_is_mixtrals_and_a_dead_expert_takes_no_tokens():
    logits = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    r = mixtral_routing(logits, 2)
    probs = torch.softmax(logits, dim=-1)
    top_p, top_e = probs.topk(2, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    for e in range(4):
        want = (top_e == e).any(-1).nonzero(as_tuple=True)[0]
        assert torch.equal(r.tokens[e], want)
        torch.testing.assert_close(r.weights[e], (gates * (top_e == e)).sum(-1)[want])
    assert sum(t.numel() for t in r.tokens) == 100 and r.dropped == 0  # no capacity: every pair served
    dead = mixtral_routing(logits, 2, [True, False, True, True])
    assert dead.tokens[1].numel() == 0 and sum(t.numel() for t in dead.tokens) == 100
    per_token = torch.zeros(50)
    for idx, w in zip(dead.tokens, dead.weights):
        per_token.index_add_(0, idx, w)
    torch.testing.assert_close(per_token, torch.ones(50))
    one = mixtral_routing(logits, 2, [False, False, True, False])  # fewer live than top-k: all to the one
    assert one.tokens[2].numel() == 50 and torch.allclose(one.weights[2], torch.ones(50))
    with pytest.raises(ValueError, match="at least one alive"):
        mixtral_routing(logits, 2, [False] * 4)
