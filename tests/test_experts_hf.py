"""A Hugging Face Mixtral in the experts role, on real libp2p transports: expert hosts hold only
their shard's experts (slices of transformers' fused tensors) and a trainer's dense parts call
them with Mixtral's routing, computing transformers' loss and gradients; a host that goes away is
routed around; bad calls are refused by name; a model the role does not train is refused at
start, on the coordinator and on a node; the coordinator's stores of an experts run."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from node.config import NodeConfig
from node.models.hf import build_causal_lm
from node.net.transport import RemoteError, Transport
from node.roles.expert_client import clip_and_commit, mixtral_forward_loss
from node.roles.expert_host import ExpertHost
from node.roles.expert_model import expert_model
from node.roles.expert_trainer import ExpertTrainer
from node.roles.role import RoleContext, RoleError
from node.runconfig import RunConfig
from node.state.model_files import pack_model_files
from protocol import RemoteProtocolError, make_codec, pack_tensors, unpack_tensors
from protocol.messages import ExpertCall
from tests.test_experts import client_for, expert, expert_hosts
from tests.test_mixtral import tiny_config
from tests.swarm import start_hosts
from tests.test_pipeline import NO_SYNC, _Membership

pytestmark = pytest.mark.timeout(180)

NONE = make_codec("none")
SEED = 3


class _WithFiles(_Membership):
    """A membership whose coordinator is named: the model's files are fetched from it (they are
    packed in each host's data dir beforehand, so none travel)."""

    def __init__(self):
        super().__init__()
        self.coordinator = "packed-beforehand"


def model_dir(tmp_path, family="mixtral", **over):
    """A tiny model directory of `family` (config only); Mixtral's is test_mixtral's."""
    import transformers

    d = tmp_path / f"src-{family}"
    d.mkdir(exist_ok=True)
    if family == "mixtral":
        (d / "config.json").write_text(json.dumps(tiny_config(**over)))
    else:
        transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64, vocab_size=256).save_pretrained(d)  # fmt: skip
    return d


def packed_run(tmp_path, src, hosts: int, **run) -> RunConfig:
    """The run of `src`'s pin, its files packed into the data dirs h0.. of `hosts` hosts."""
    pins = {pack_model_files(src, tmp_path / f"h{i}" / "model") for i in range(hosts)}
    (pin,) = pins
    return RunConfig(model=pin, seed=SEED, stage_step_samples=10**6, stage_sync_every_s=NO_SYNC, **run)


def batch(seed=0, b=2, t=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def dense_of(tmp_path, run: RunConfig):
    """The trainer's part, made as its role makes it (from the packed files)."""
    ctx = RoleContext(None, None, _WithFiles(), NodeConfig(data_dir=str(tmp_path / "h0")))
    spec = asyncio.run(expert_model(run, ctx))
    return spec, spec.make_dense()


def test_mixtral_on_expert_hosts_gives_transformers_loss_and_gradients(tmp_path):
    src = model_dir(tmp_path)
    run = packed_run(tmp_path, src, 2, expert_shards=2)
    reference = build_causal_lm(json.loads((src / "config.json").read_text()), seed=SEED)
    x, y = batch()
    out = reference.hf(input_ids=x, use_cache=False, output_router_logits=True)
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1)) + reference.hf.config.router_aux_loss_coef * out.aux_loss
    want.backward()
    spec, dense = dense_of(tmp_path, run)
    assert spec.layout.experts == 4 and spec.tokenizer is not None  # (bytes: the model has no tokenizer files)

    async def main():
        async with expert_hosts(tmp_path, run, [0, 1], membership=_WithFiles) as (servers, transport):
            client = client_for(transport, servers, run)
            assert client.layout == spec.layout

            def step():
                ce, loss, skipped = mixtral_forward_loss(dense, client, "mb-0", x, y)
                loss.backward()
                scale = clip_and_commit(dense, client, "mb-0", 1e9)
                return loss.item(), skipped, scale

            loss, skipped, scale = await asyncio.to_thread(step)
            await asyncio.sleep(0.2)  # (the commit's gradients land after its answer)
            grads = {f"{s.index}:{n}": p.grad.clone() for s in servers for n, p in s.shard.named_parameters()}
            names = [s.names for s in servers]
            params = [sorted(n for n, _ in s.shard.named_parameters()) for s in servers]
            return loss, skipped, scale, grads, names, params

    loss, skipped, scale, grads, names, params = asyncio.run(main())
    assert skipped == 0 and scale == 1.0
    assert abs(loss - want.item()) < 1e-5
    # each host holds only its shard's experts, named per expert
    assert names == [("layer0.expert0", "layer0.expert2", "layer1.expert0", "layer1.expert2"), ("layer0.expert1", "layer0.expert3", "layer1.expert1", "layer1.expert3")]
    assert params[1] == sorted(f"{n}.{k}" for n in names[1] for k in ("down_proj", "gate_up_proj"))
    ref = dict(reference.named_parameters())
    for n, p in dense.named_parameters():
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    for key, g in grads.items():
        layer, expert_, kind = key.split(":")[1].split(".")
        torch.testing.assert_close(g, ref[f"model.layers.{layer[5:]}.mlp.experts.{kind}"].grad[int(expert_[6:])], rtol=1e-4, atol=1e-6, msg=key)


def test_a_host_gone_is_routed_around_with_mixtral_routing_and_bad_calls_are_named(tmp_path):
    run = packed_run(tmp_path, model_dir(tmp_path), 2, expert_shards=2)
    _, dense = dense_of(tmp_path, run)
    x, y = batch(1)

    async def main():
        async with expert_hosts(tmp_path, run, [0, 1], membership=_WithFiles) as (servers, transport):
            client = client_for(transport, servers, run)
            good = torch.randn(5, 32)

            async def send(**tensors):
                enc = pack_tensors({k: NONE.encode(v) for k, v in tensors.items()})
                return await transport.send(servers[0].ctx.transport.peer_id, ExpertCall(op="forward", micro_batch="m/0", **enc), timeout=20, reuse=True)

            errors = []
            for tensors in ({"x:layer0.expert0": torch.randn(5, 7)}, {"x:layer2.expert0": good}, {"x:layer0.expert1": good}):
                with pytest.raises(RemoteError) as e:
                    await send(**tensors)
                errors.append((e.value.code, e.value.message))
            served = sorted(unpack_tensors(await send(**{"x:layer1.expert2": good})))
            await servers[1].stop(planned=False)  # shard 1's only host goes away
            gone = await asyncio.to_thread(lambda: mixtral_forward_loss(dense, client, "mb-1", x, y))
            after = await asyncio.to_thread(lambda: mixtral_forward_loss(dense, client, "mb-2", x, y))
            return errors, served, gone, after, client.alive(0.0)

    errors, served, gone, after, alive = asyncio.run(main())
    assert errors[0][0] == "bad_request" and "(5, 7)" in errors[0][1]
    assert errors[1][0] == "bad_request" and "no expert 'layer2.expert0' in this model (2 layers x 4 experts)" in errors[1][1]
    assert errors[2][0] == "not_found" and "does not serve expert layer0.expert1" in errors[2][1]
    assert served == ["y:layer1.expert2"]  # still serving
    assert gone[2] > 0 and torch.isfinite(gone[1])  # its experts skipped once, their gates given to the others
    assert after[2] == 0 and torch.isfinite(after[1])  # then the router gives them no tokens
    assert alive == [True, False, True, False]


def test_a_model_the_experts_role_does_not_train_is_refused_by_name(tmp_path):
    run = packed_run(tmp_path, model_dir(tmp_path, "llama"), 1, expert_shards=1)
    ctx = RoleContext(None, None, _WithFiles(), NodeConfig(data_dir=str(tmp_path / "h0"), threads=1))
    with pytest.raises(RoleError, match="the experts role trains model types mixtral; .* is 'llama'"):
        asyncio.run(ExpertHost(ctx, run, expert("shard0")).start())

    async def trainer() -> str:
        (host,) = await start_hosts(1)
        try:
            t = ExpertTrainer(RoleContext(host, Transport(host), _WithFiles(), NodeConfig(data_dir=str(tmp_path / "h0"), threads=1)), run)
            with pytest.raises(RoleError) as e:
                await t.start()
            await t.stop(planned=False)  # (as the runner does after a refused start)
            return str(e.value)
        finally:
            await host.shutdown()

    assert "the experts role trains model types mixtral" in asyncio.run(trainer())
    too_many = packed_run(tmp_path, model_dir(tmp_path), 1, expert_shards=5)
    with pytest.raises(RoleError, match=re.escape("expert_shards must be in 1..4")):
        asyncio.run(ExpertHost(ctx, too_many, expert("shard0")).start())
    with pytest.raises(RoleError, match=re.escape("expert shard 5 is not a shard of this run (0..4)")):
        ExpertHost(ctx, too_many, expert("shard5"))


def test_the_coordinator_takes_a_mixtral_in_experts_mode_and_refuses_what_does_not_fit(tmp_path):
    from coordinator.config import CoordinatorConfig, check_model
    from coordinator.service import Coordinator
    from node.config import ConfigError

    mixtral = model_dir(tmp_path)
    c = Coordinator(CoordinatorConfig(mode="experts", data_dir=str(tmp_path / "coord"), run=RunConfig(model=str(mixtral), expert_shards=3)))
    assert c.planner.experts == ("shard0", "shard1", "shard2")
    check_model(c.config)
    with_weights = tmp_path / "weighted"
    build_causal_lm(json.loads((mixtral / "config.json").read_text()), seed=0).hf.save_pretrained(with_weights)
    for mode, model, shards, why in [
        ("experts", model_dir(tmp_path, "llama"), 2, "the experts role trains model types mixtral"),
        ("experts", mixtral, 5, "expert_shards must be in 1..4 (the experts per layer of"),
        ("experts", mixtral, 0, "experts mode needs --expert-shards"),
        ("experts", with_weights, 2, "experts mode trains a Hugging Face model from its config for now"),
    ]:
        config = CoordinatorConfig(mode=mode, data_dir=str(tmp_path / "coord"), run=RunConfig(model=str(model), expert_shards=shards))
        with pytest.raises(ConfigError, match=re.escape(why)):
            Coordinator(config)
            check_model(config)


def test_the_coordinator_keeps_each_shard_and_the_dense_parts_on_their_reports(tmp_path):
    from coordinator.expert_stores import DENSE, ExpertStores, slot_of
    from coordinator.planner import checkpoint_quorum
    from coordinator.registry import Member

    stores = ExpertStores(tmp_path, shards=2, keep=2, signing_key=None)
    assert slot_of("expert", "shard1") == "shard1" and slot_of("trainer", None) == DENSE and slot_of("replica", None) is None
    assert stores.store_for({"model_config": {"model": "hf:x", "expert_shard": 1, "experts": []}}) == ("shard1", stores.shards[1])
    assert stores.store_for({"model_config": {"model": "hf:x", "dense": True}}) == (DENSE, stores.dense)
    for bad in ({"model_config": {"expert_shard": 2}}, {"model_config": {"expert_shard": True}}, {"model_config": {}}, {"model_config": {"stage": 0}}, []):
        with pytest.raises(RemoteProtocolError, match=r"names its shard \(expert_shard 0..1\) or the dense parts"):
            stores.store_for(bad)
    members = [Member("a", (), role="expert", expert="shard0"), Member("b", (), role="expert", expert="shard0"), Member("t", (), role="trainer"), Member("r", (), role="replica")]
    stores.report("a", "expert", "shard0", 7, "h1")
    stores.report("t", "trainer", None, 7, "d1")
    stores.report("r", "replica", None, 7, "x")  # not a slot of the run: not counted anywhere
    holders, reports = stores.reported("shard0", 7, members)
    assert (holders, reports) == (2, {"a": "h1"}) and not checkpoint_quorum(7, "h1", reports, holders)[0]  # one of the two hosts
    stores.report("b", "expert", "shard0", 7, "h1")
    assert checkpoint_quorum(7, "h1", *reversed(stores.reported("shard0", 7, members)))[0]
    assert checkpoint_quorum(7, "d1", *reversed(stores.reported(DENSE, 7, members)))[0]  # a lone trainer
    assert stores.listed() == {"shard0": [], "shard1": [], DENSE: []}
    assert stores.by_index() == {0: stores.shards[0], 1: stores.shards[1], 2: stores.dense}  # as nodes ask for them
