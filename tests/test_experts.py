"""Expert hosts on real libp2p transports: a MoE model whose experts run on them computes the
one-process model's loss and gradients; a host that dies or stalls costs a deadline and its
experts are routed around; malformed calls are refused with the problem named and the host
keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time

import pytest
import torch

from node.config import NodeConfig
from node.roles.expert_client import ExpertClient, clip_and_commit, forward_loss
from node.roles.expert_host import ExpertHost, shard_of_label
from node.models.moe import init_moe_model
from node.roles.role import RoleContext, RoleError
from node.runconfig import RunConfig, RunConfigError
from node.net.transport import RemoteError, Transport, TransportConfig
from protocol import RoleAssignment, make_codec, pack_tensors, unpack_tensors
from protocol.messages import ExpertCall
from tests.swarm import start_hosts
from tests.test_pipeline import NO_SYNC, _Membership

pytestmark = pytest.mark.timeout(120)

RUN = RunConfig(model="tiny-moe", expert_shards=2, stage_step_samples=10**6, seed=3, stage_sync_every_s=NO_SYNC)
NONE = make_codec("none")


def expert(slot: str) -> RoleAssignment:
    return RoleAssignment(peer_id="", role="expert", expert=slot)


@contextlib.asynccontextmanager
async def expert_hosts(tmp_path, run: RunConfig, shards: list[int], config: TransportConfig = TransportConfig(), data_dirs: dict | None = None,
                       membership=_Membership):  # fmt: skip
    """One started ExpertHost per entry of `shards` (its shard), each on its own real host, and
    a client transport. `membership()` makes each host's membership."""
    hosts = await start_hosts(len(shards) + 1)
    transports = [Transport(h, config) for h in hosts]
    servers, tasks = [], []
    try:
        for t in transports:
            await t.start()
        for i, shard in enumerate(shards):
            d = (data_dirs or {}).get(i) or tmp_path / f"h{i}"
            d.mkdir(exist_ok=True)
            s = ExpertHost(RoleContext(hosts[i], transports[i], membership(), NodeConfig(data_dir=str(d), threads=1)), run, expert(f"shard{shard}"))
            await s.start()
            servers.append(s)
            tasks.append(asyncio.create_task(s.run()))
        yield servers, transports[-1]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in servers:
            await s.stop(planned=False)
        for t in transports:
            await t.close()
        for h in hosts:
            await h.shutdown()


def client_for(transport, servers, run=RUN) -> ExpertClient:
    client = ExpertClient(transport, asyncio.get_running_loop(), run, NONE, 1 << 24, servers[0].layout)
    shards: dict[int, list[str]] = {}
    for s in servers:
        shards.setdefault(s.index, []).append(s.ctx.transport.peer_id)
    client.peers.update(shards)
    return client


def batch(seed=0, b=3, t=16):
    gen = torch.Generator().manual_seed(seed)
    cfg = RUN.model_config()
    return torch.randint(0, cfg.vocab_size, (b, t), generator=gen), torch.randint(0, cfg.vocab_size, (b, t), generator=gen)


def test_remote_experts_give_the_one_process_models_loss_and_globally_clipped_gradients(tmp_path):
    gpt, moe = RUN.moe_preset()
    reference = init_moe_model(gpt, moe, RUN.seed)
    x, y = batch()
    _, want_loss, _ = reference(x, y)
    want_loss.backward()
    grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    total = float(torch.stack([g.norm() for g in grads.values()]).norm())
    max_norm = total / 2  # the clip bites: every gradient is halved, wherever it lives
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    # what clipping each part on its own (the trainer's dense parts, each host's experts) would give instead
    parts = [[n for n in grads if ".experts." not in n]] + [[n for n in grads if f".experts.{e}." in n and e % 2 == s] for s in (0, 1) for e in range(moe.num_experts)]
    split = {}
    for names in [p for p in parts if p]:
        norm = float(torch.stack([grads[n].norm() for n in names]).norm())
        split.update({n: grads[n] * min(1.0, max_norm / norm) for n in names})
    dense = init_moe_model(gpt, moe, RUN.seed)  # the trainer's copy: its experts unused

    async def main():
        async with expert_hosts(tmp_path, RUN, [0, 1]) as (servers, transport):
            client = client_for(transport, servers)

            def step():
                ce, loss, skipped = forward_loss(dense, client, "mb-0", x, y)
                loss.backward()
                held = [s.calls["commit"] for s in servers]
                scale = clip_and_commit(dense, client, "mb-0", max_norm)
                return loss.item(), skipped, scale, held

            loss, skipped, scale, held = await asyncio.to_thread(step)
            assert held == [0, 0]  # the hosts' gradients wait for the commit
            assert scale == pytest.approx(0.5, rel=1e-4)
            hosts_grads = {}
            for s in servers:
                for name in s.names:  # "layer1.expert2" -> the model's blocks.1.moe.experts.2
                    layer, expert = (int(part.rstrip("0123456789") and part[len(part.rstrip("0123456789")):]) for part in name.split("."))
                    for pn, p in s.shard[name].named_parameters():
                        hosts_grads[f"blocks.{layer}.moe.experts.{expert}.{pn}"] = p.grad.clone()
            return loss, skipped, hosts_grads, client.calls, [s.calls for s in servers]

    loss, skipped, hosts_grads, calls, server_calls = asyncio.run(main())
    assert skipped == 0
    assert math.isclose(loss, want_loss.item(), rel_tol=1e-5)
    # the dense parts' gradients (embeddings, attention, routers, head) are the one-process model's
    ref = dict(reference.named_parameters())
    for n, p in dense.named_parameters():
        if ".experts." in n:
            assert p.grad is None  # never used: the experts ran on the hosts
            continue
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    # every expert's gradient arrived on the host that serves it
    assert len(hosts_grads) == sum(1 for n in ref if ".experts." in n)
    for key, g in hosts_grads.items():
        torch.testing.assert_close(g, ref[key].grad, rtol=1e-4, atol=1e-6, msg=key)
    assert any(not torch.allclose(split[n], ref[n].grad, rtol=1e-3) for n in split)  # (per-part clipping is not that)
    # one call per (layer, shard) each way: 2 layers x 2 shards x (forward + backward), and a commit per host
    assert calls == 10
    assert all(c["forward"] == 2 and c["backward"] == 2 and c["commit"] == 1 for c in server_calls)


def test_a_host_steps_once_per_micro_batch_whatever_the_layers_it_serves(tmp_path):
    # stage_step_samples = batch size: a step after each micro-batch, at its commit, which comes
    # after the backward of every layer (one backward call per layer: counted per call, it stepped twice)
    run = RunConfig(model="tiny-moe", expert_shards=2, stage_step_samples=3, seed=3, stage_sync_every_s=NO_SYNC, batch_size=3)
    gpt, moe = run.moe_preset()
    dense = init_moe_model(gpt, moe, run.seed)

    async def main():
        async with expert_hosts(tmp_path, run, [0, 1]) as (servers, transport):
            client = client_for(transport, servers, run)
            for i in range(3):
                x, y = batch(i)
                await asyncio.to_thread(lambda: forward_loss(dense, client, f"mb-{i}", x, y)[1].backward())
                await asyncio.sleep(0.2)
                assert [s.compute.steps for s in servers] == [i, i]  # no step before the commit
                await asyncio.to_thread(clip_and_commit, dense, client, f"mb-{i}", 1.0)
                await asyncio.sleep(0.2)  # the host's step comes after the commit's answer
            return [s.compute.steps for s in servers], [s.calls["backward"] for s in servers]

    steps, backwards = asyncio.run(main())
    assert backwards == [6, 6]  # 3 micro-batches x 2 layers
    assert steps == [3, 3]


def test_a_stalled_host_costs_one_deadline_and_its_experts_are_routed_around_until_it_answers(tmp_path):
    gpt, moe = RUN.moe_preset()
    dense = init_moe_model(gpt, moe, RUN.seed)
    x, y = batch(1)

    async def main():
        async with expert_hosts(tmp_path, RUN, [0, 1]) as (servers, transport):
            client = client_for(transport, servers)
            client.peers.min_timeout_s = 1.0
            run = lambda mb: asyncio.to_thread(lambda: forward_loss(dense, client, mb, x, y))  # noqa: E731
            for i in range(3):  # measured: deadlines from the hosts' call times
                _, loss, skipped = await run(f"warm-{i}")
                assert skipped == 0
            stalled = servers[1]
            # its compute stalls (swap, a stuck driver): calls reach it, no answer comes
            await stalled.slot.weights.busy.acquire()
            try:
                t0 = time.monotonic()
                _, loss, skipped = await run("frozen-0")
                first = time.monotonic() - t0
                assert math.isfinite(loss.item()) and skipped > 0  # its experts skipped, gates renormalised
                assert client.alive(time.monotonic()) == [True, False, True, False]  # shard 1: experts 1 and 3
                t0 = time.monotonic()
                _, loss, skipped = await run("frozen-1")
                routed_around = time.monotonic() - t0
                assert skipped == 0 and math.isfinite(loss.item())  # the router gave shard 1 no tokens
            finally:
                stalled.slot.weights.busy.release()
            deadline = client.peers.timeout(stalled.ctx.transport.peer_id)
            # after its ban the host is called again and answers
            await asyncio.sleep(client.peers.peers[stalled.ctx.transport.peer_id].banned_until - time.monotonic() + 0.1)
            answered = False
            for i in range(20):
                _, loss, skipped = await run(f"back-{i}")
                if skipped == 0 and client.alive(time.monotonic())[1]:
                    answered = stalled.calls["forward"] > 0
                    break
                await asyncio.sleep(0.5)
            return first, routed_around, deadline, answered

    first, routed_around, deadline, answered = asyncio.run(main())
    assert first < 2 * (deadline + 1.0)  # one deadline (forward), not a wait on the frozen host
    assert routed_around < first
    assert answered


def test_bad_calls_are_refused_naming_the_problem_and_the_host_keeps_serving(tmp_path):
    bad_requests = 6  # each scores the sender down by 2 at the host; a 7th would ban it
    config = TransportConfig(ban_score=-2.0 * (bad_requests + 1))

    async def main():
        async with expert_hosts(tmp_path, RUN, [0], config) as ((host,), client):
            pid = host.ctx.transport.peer_id
            good = torch.randn(5, RUN.model_config().n_embd)

            async def send(op, **tensors):
                enc = {k: NONE.encode(v) for k, v in tensors.items()}
                extra = {"scale": 0.5} if op == "commit" else {}
                return await client.send(pid, ExpertCall(op=op, micro_batch="m/0", **extra, **pack_tensors(enc)), timeout=20, reuse=True)

            errors = {}
            for case, op, tensors in [
                ("unknown expert", "forward", {"x:layer9.expert0": good}),
                ("other shard", "forward", {"x:layer0.expert1": good}),
                ("NaN", "forward", {"x:layer0.expert0": torch.full((5, good.size(1)), float("nan"))}),
                ("wrong width", "forward", {"x:layer0.expert0": torch.randn(5, 7)}),
                ("wrong dtype", "forward", {"x:layer0.expert0": torch.ones(5, good.size(1), dtype=torch.int64)}),
                ("grad in a forward", "forward", {"grad:layer0.expert0": good}),
                ("backward without a forward", "backward", {"grad:layer0.expert2": good}),
                ("commit without a backward", "commit", {}),
                ("no tensors", "forward", {}),
            ]:
                with pytest.raises(RemoteError) as e:
                    await send(op, **tensors)
                errors[case] = (e.value.code, e.value.message)
            reply = await send("forward", **{"x:layer0.expert0": good, "x:layer1.expert2": good[:2]})
            outs = unpack_tensors(reply)
            return errors, sorted(outs), host.calls, host.ctx.transport.scores.score(client.peer_id)

    errors, names, calls, score = asyncio.run(main())
    assert score == -2.0 * bad_requests  # scored down for garbage, not for asking the wrong host

    assert errors["unknown expert"][0] == "bad_request" and "no expert 'layer9.expert0'" in errors["unknown expert"][1]
    assert errors["other shard"][0] == "not_found" and "does not serve expert layer0.expert1" in errors["other shard"][1]
    assert errors["NaN"][0] == "bad_request" and "NaN" in errors["NaN"][1]
    assert errors["wrong width"][0] == "bad_request" and "(5, 7)" in errors["wrong width"][1]
    assert errors["wrong dtype"][0] == "bad_request" and "int64" in errors["wrong dtype"][1]
    assert errors["grad in a forward"][0] == "bad_request"
    assert errors["backward without a forward"][0] == "not_found" and "send its tokens" in errors["backward without a forward"][1]
    assert errors["no tensors"][0] == "bad_request"
    assert errors["commit without a backward"][0] == "not_found" and "no gradients of micro-batch 'm/0' held" in errors["commit without a backward"][1]
    assert names == ["y:layer0.expert0", "y:layer1.expert2"]  # still serving
    assert calls["refused"] == bad_requests and calls["forward"] == 1


def test_a_shard_holds_expert_e_of_every_layer_with_e_mod_shards_equal_to_it():
    run = RunConfig(model="tiny-moe", expert_shards=2)
    assert run.expert_shard(0) == ("layer0.expert0", "layer0.expert2", "layer1.expert0", "layer1.expert2")
    assert run.expert_shard(1) == ("layer0.expert1", "layer0.expert3", "layer1.expert1", "layer1.expert3")
    assert shard_of_label("expert:shard1") == 1 and shard_of_label("stage:1") is None and shard_of_label("expert:x") is None
    with pytest.raises(RunConfigError, match="expert_shards must be in 1..4"):
        RunConfig(model="tiny-moe", expert_shards=5).expert_shard(0)
    with pytest.raises(RunConfigError, match="has no experts"):
        RunConfig(model="tiny", expert_shards=1).expert_shard(0)
    with pytest.raises(RoleError, match="not a shard"):
        ExpertHost(RoleContext(None, None, None, NodeConfig()), run, expert("layer0"))


def test_the_coordinator_plans_experts_mode_only_for_a_moe_model_split_into_shards():
    from coordinator.config import CoordinatorConfig
    from coordinator.service import Coordinator
    from node.config import ConfigError

    c = Coordinator(CoordinatorConfig(mode="experts", run=RunConfig(model="tiny-moe", expert_shards=2)))
    assert c.planner.mode == "experts" and c.planner.experts == ("shard0", "shard1")
    for mode, run, why in [
        ("experts", RunConfig(model="tiny-moe"), "experts mode needs --expert-shards"),
        ("experts", RunConfig(model="tiny", expert_shards=2), "model 'tiny' has no experts"),
        ("experts", RunConfig(model="tiny-moe", expert_shards=5), "expert_shards must be in 1..4"),
        ("replica", RunConfig(model="tiny-moe"), "it trains in experts mode (--mode experts), not replica mode"),
        ("pipeline", RunConfig(model="small-moe", num_stages=2), "not pipeline mode"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            Coordinator(CoordinatorConfig(mode=mode, run=run))


def test_a_restarted_host_with_no_replica_takes_the_state_it_saved_not_the_initial_one(tmp_path):
    run = RunConfig(model="tiny-moe", expert_shards=1, stage_step_samples=3, seed=3, stage_sync_every_s=1.0, batch_size=3)
    gpt, moe = run.moe_preset()
    dense = init_moe_model(gpt, moe, run.seed)

    async def first():
        async with expert_hosts(tmp_path, run, [0]) as ((host,), transport):
            client = client_for(transport, [host], run)
            initial = host.hash
            for i in range(2):
                x, y = batch(i)
                await asyncio.to_thread(lambda: forward_loss(dense, client, f"mb-{i}", x, y)[1].backward())
                await asyncio.to_thread(clip_and_commit, dense, client, f"mb-{i}", 1.0)
            deadline = time.monotonic() + 30
            while not (host.compute.steps >= 2 and host.state.step > 0 and host.state.hash == host.hash) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # its next sync (alone) makes the trained experts its saved state
            return initial, host.state.hash, host.state.step

    async def again():
        (tmp_path / "h0").rename(tmp_path / "keep")  # the same data dir, started again
        async with expert_hosts(tmp_path, run, [0], data_dirs={0: tmp_path / "keep"}) as ((host,), _):
            return host.state.source, host.state.step, [e for e in host.slot.stats.history if e.get("start")][-1]["state_hash"]

    initial, saved, step = asyncio.run(first())
    assert saved != initial and step > 0
    state_from, state_step, started = asyncio.run(again())
    assert (state_from, state_step, started) == ("disk", step, saved)
