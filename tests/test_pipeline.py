"""Stage servers on real libp2p transports: calls chained through them compute the model's loss and
gradients; malformed calls are refused with the problem named and the server keeps serving.
And the trainer's bookkeeping of stage peers (pure)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time

import pytest
import torch

from node.config import NodeConfig
from node.models.gpt import init_model
from node.net.membership import Progress
from node.net.transport import RemoteError, Transport, TransportConfig
from node.roles.caller import NoSlotPeer, SlotPeers
from node.roles.role import RoleContext, RoleError
from node.roles.stage_calls import MAX_BATCH_SAMPLES
from node.roles.stage_core import ServeTiming
from node.roles.stage_server import StageServer
from node.runconfig import RunConfig
from protocol import RoleAssignment, StageCall, StageResult, decode_tensor, make_codec, pack_tensors, unpack_tensors
from protocol.records import slot_index
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)

NO_SYNC = 1e9  # seconds between syncs (wall-clock boundaries): none during a test, which would move the state on
NO_PENDING = ServeTiming(pending_s=600.0)  # a due step waits for the norms a call brings, never for a timeout, within a test
RUN = RunConfig(model="tiny", num_stages=2, stage_step_samples=10_000, seed=3, stage_sync_every_s=NO_SYNC)
NONE = make_codec("none")


class _Membership:
    """What a role reports through: the daemon's Progress, and a request to publish its record."""

    def __init__(self):
        self.progress = Progress()
        self.published = 0
        self.coordinator = None  # no coordinator: no checkpoints to start from

    def publish_soon(self):
        self.published += 1


def stage(i: int) -> RoleAssignment:
    return RoleAssignment(peer_id="", role="stage", stage=i)


@contextlib.asynccontextmanager
async def stage_servers(tmp_path, run: RunConfig, config: TransportConfig = TransportConfig(), clients: int = 1, timing: ServeTiming = ServeTiming()):
    """One started StageServer per stage, each on its own real host, and client transports."""
    hosts = await start_hosts(run.num_stages + clients)
    transports = [Transport(h, config) for h in hosts]
    servers, tasks = [], []
    try:
        for t in transports:
            await t.start()
        for i in range(run.num_stages):
            s = StageServer(RoleContext(hosts[i], transports[i], _Membership(), NodeConfig(data_dir=str(tmp_path / f"s{i}"), threads=1)), run, stage(i), timing)
            (tmp_path / f"s{i}").mkdir()
            await s.start()
            servers.append(s)
            tasks.append(asyncio.create_task(s.run()))
            s.run_task = tasks[-1]  # (for tests that stop it)
        yield servers, (transports[-1] if clients == 1 else transports[run.num_stages :])
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in servers:
            await s.stop(planned=False)  # (a planned stop of a stage's last peer hands its state over: tests/test_swarm_pipeline.py)
        for t in transports:
            await t.close()
        for h in hosts:
            await h.shutdown()


async def call(client, server, op, stage=None, micro_batch="m", **tensors) -> StageResult:
    enc = {k: NONE.encode(v) for k, v in tensors.items()}
    req = StageCall(stage=server.index if stage is None else stage, op=op, micro_batch=micro_batch, **pack_tensors(enc))
    return await client.send(server.ctx.transport.peer_id, req, timeout=20, reuse=True)


def out(reply: StageResult, name: str) -> torch.Tensor:
    return decode_tensor(unpack_tensors(reply)[name])


def reference():
    """RUN's whole model, a micro-batch of 3 sequences (x, y), and its loss, backward done."""
    cfg = RUN.model_config()
    model = init_model(cfg, RUN.seed)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (3, 16), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (3, 16), generator=gen)
    _, loss = model(x, y)
    loss.backward()
    return model, x, y, loss


def assert_like_the_model(got_loss: float, grads: dict[str, torch.Tensor], model, loss) -> None:
    assert math.isclose(got_loss, loss.item(), rel_tol=1e-6)
    want = dict(model.named_parameters())
    assert set(grads) == set(want)  # the two stages together hold every parameter, once
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_calls_chained_through_stage_servers_give_the_models_loss_and_gradients(tmp_path):
    model, x, y, loss = reference()

    async def main():
        async with stage_servers(tmp_path, RUN) as ((s0, s1), client):
            h = await call(client, s0, "forward", x=x)
            r = await call(client, s1, "train", x=out(h, "y"), targets=y)
            g = out(r, "grad")
            r0 = await call(client, s0, "backward", x=x, grad=g)
            assert unpack_tensors(r0) == {}  # nothing flows back from the first stage
            return r.loss, {n: p.grad.clone() for s in (s0, s1) for n, p in s.stage.named_parameters()}, s0, s1

    got_loss, grads, s0, s1 = asyncio.run(main())
    assert_like_the_model(got_loss, grads, model, loss)
    assert s0.compute.samples == s1.compute.samples == 3 and s0.compute.steps == 0  # accumulated, no step yet (10 000 samples per step)


async def through(client, server, route, micro_batch="m", deadline=20.0, **tensors) -> StageResult:
    enc = {k: NONE.encode(v) for k, v in tensors.items()}
    req = StageCall(stage=server.index, op="through", micro_batch=micro_batch, route=tuple(route), deadlines=(deadline,) * len(route), **pack_tensors(enc))
    return await client.send(server.ctx.transport.peer_id, req, timeout=30, reuse=True)


def test_a_through_call_hands_activations_stage_to_stage_and_gives_the_models_loss_and_gradients(tmp_path):
    model, x, y, loss = reference()

    async def main():
        async with stage_servers(tmp_path, RUN) as ((s0, s1), client):
            s1_id = s1.ctx.transport.peer_id
            # no member record names s1 a peer of stage 1: s0 sends our activations nowhere, and
            # says which peer of the route it would not call (the trainer picks another way)
            r = await through(client, s0, [s1_id], x=x, targets=y)
            assert r.failed == s1_id and r.failed_stage == 1 and f"{s1_id} serves no stage 1" in r.reason, r
            assert s1.calls["through"] == 0 and s0.calls["forward"] == s0.compute.samples == 0 and not s0.compute.kept
            with pytest.raises(RemoteError, match=r"bad_request: .*names a peer for each of the 1 stages after it, got 2"):
                await through(client, s0, [s1_id, s1_id], x=x, targets=y)
            s0.stage_peers = {1: {s1_id, client.peer_id}}  # what member records naming them would give
            r = await through(client, s0, [s1_id], x=x, targets=y)
            assert unpack_tensors(r) == {} and len(r.times) == 2 and not r.failed  # the first stage sends no gradient back
            assert s0.calls["through"] == s1.calls["through"] == 1 and s0.bytes_sent > 0 and not s0.compute.kept
            grads = {n: p.grad.clone() for s in (s0, s1) for n, p in s.stage.named_parameters()}

            # a later stage that fails: the answer names it, and s0 keeps no graph for it
            failed = await through(client, s0, [client.peer_id], micro_batch="n", x=x, targets=y)  # the client serves no stage calls
            assert failed.failed == client.peer_id and failed.failed_stage == 1 and failed.reason and unpack_tensors(failed) == {}, failed
            assert not s0.compute.kept and s0.calls["failed_after"] == 2 and s0.compute.samples == 3  # (with the first call above); nothing of it accumulated
            return r.loss, grads

    got_loss, grads = asyncio.run(main())
    assert_like_the_model(got_loss, grads, model, loss)


def test_a_backward_through_the_graph_its_forward_kept_gives_the_same_gradients_without_the_input(tmp_path):
    run = RunConfig(model="tiny", num_stages=2, stage_step_samples=3, seed=3, stage_sync_every_s=NO_SYNC)  # a step after b's 3 samples, none after a's 2
    cfg = run.model_config()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, cfg.vocab_size, (n, 16), generator=gen) for n in (2, 3)]

    async def main():
        async with stage_servers(tmp_path, run) as ((s0, s1), client):
            # micro-batch a's forward, then b's whole round trip (s0 steps on b's gradients), then
            # a's backward through its kept graph: it must use the weights a's forward saw
            before = {n: p.detach().clone() for n, p in s0.stage.named_parameters()}
            ya = out(await call(client, s0, "forward", x=xs[0], micro_batch="a"), "y")
            yb = out(await call(client, s0, "forward", x=xs[1], micro_batch="b"), "y")
            gb = out(await call(client, s1, "train", x=yb, targets=xs[1]), "grad")
            await call(client, s0, "backward", grad=gb, micro_batch="b")
            for _ in range(100):
                if s0.compute.steps:
                    break
                await asyncio.sleep(0.05)
            assert s0.compute.steps == 1 and s0.calls["kept"] == 1
            ga = out(await call(client, s1, "train", x=ya, targets=xs[0]), "grad")
            r = await call(client, s0, "backward", grad=ga, micro_batch="a")
            assert unpack_tensors(r) == {} and s0.calls["kept"] == 2
            assert s0.calls["stale"] == 1  # a's forward ran on the weights before the step (b's backward came before it)
            got = {n: p.grad.clone() for n, p in s0.stage.named_parameters()}
            with pytest.raises(RemoteError, match=r"not_found: no forward of micro-batch 'a' kept here"):
                await call(client, s0, "backward", grad=ga, micro_batch="a")  # used up
            return before, got, ga

    before, got, ga = asyncio.run(main())
    # what a's gradients are with the weights before the step
    model = init_model(cfg, 3)
    stage0 = {n: p for n, p in model.named_parameters() if n in before}
    with torch.no_grad():
        for n, p in stage0.items():
            p.copy_(before[n])
    from node.models.stages import Stage

    ref = Stage.from_gpt(model, 0, RUN.stage_plan())
    ref(xs[0]).backward(ga)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_a_stage_server_steps_after_its_samples_and_reports_a_new_hash(tmp_path):
    run = RunConfig(model="tiny", num_stages=2, stage_step_samples=4, seed=3, stage_sync_every_s=NO_SYNC)
    x = torch.randint(0, 256, (2, 16))

    async def main():
        async with stage_servers(tmp_path, run) as ((s0, s1), client):
            h0 = s1.hash
            y = out(await call(client, s0, "forward", x=x), "y")
            await call(client, s1, "train", x=y, targets=x)
            assert s1.compute.steps == 0 and s1.hash == h0  # 2 of 4 samples
            await call(client, s1, "train", x=y, targets=x)
            for _ in range(50):  # the step runs right after the call's reply
                if s1.compute.steps:
                    break
                await asyncio.sleep(0.05)
            assert s1.compute.steps == 1 and s1.hash != h0
            # what it reports is the state of its last sync (the same on every peer of the stage): still the start
            assert (s1.ctx.membership.progress.step, s1.ctx.membership.progress.state_hash) == (0, h0) == (s1.state.step, s1.state.hash)
            assert s1.ctx.membership.published == 1  # announced itself once, on start

    asyncio.run(main())


def test_a_stage_server_waiting_for_the_norms_stops_when_cancelled_as_a_call_wakes_it(tmp_path):
    """The role runner stops a stage server by cancelling its run. A server whose step is due
    waits for the next call (it brings the other stages' norms) with a timeout; a call that wakes
    it just as the cancel comes must not swallow the cancel (asyncio.wait_for on Python 3.11
    does: the node then serves on and a SIGTERM never ends it)."""
    run = dataclasses.replace(RUN, stage_step_samples=3)  # a step due after one micro-batch of 3
    _, x, y, _ = reference()

    async def main():
        async with stage_servers(tmp_path, run) as ((s0, s1), client):
            act = out(await call(client, s0, "forward", x=x), "y")
            await call(client, s1, "train", x=act, targets=y)
            assert s1.schedule.due and s1.compute.steps == 0  # waiting for the norms of the stage before it
            await asyncio.sleep(0.05)
            s1.queue.wake.set()  # a call comes ...
            s1.run_task.cancel()  # ... as the runner stops the role
            done, _ = await asyncio.wait({s1.run_task}, timeout=10)
            return bool(done) and s1.run_task.cancelled()

    assert asyncio.run(main())


def one_process(run: RunConfig, mbs, per_stage: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The parameters after a step every 2 micro-batches of `mbs`, in one process, clipping the
    whole model's gradient by its norm or (per_stage) each stage's by its own; each step's
    global norm before clipping."""
    from node.models.diloco import adamw, lr_at
    from node.models.stages import Stage

    cfg, tc = run.model_config(), run.train_config()
    owned = [{n for n, _ in Stage(cfg, i, run.stage_plan()).named_parameters()} for i in range(run.num_stages)]
    model = init_model(cfg, run.seed)
    opt, named = adamw(model.parameters(), tc), dict(model.named_parameters())
    groups = [[named[n] for n in names] for names in owned] if per_stage else [list(model.parameters())]
    norms = []
    for step in range(len(mbs) // 2):
        for x, y in mbs[2 * step : 2 * step + 2]:
            (model(x, y)[1] / 2).backward()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), float("inf"))))  # (the global norm, nothing clipped)
        for group in groups:
            torch.nn.utils.clip_grad_norm_(group, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}, norms


def test_stages_clip_their_steps_by_one_global_norm_as_one_process_clips_the_model(tmp_path):
    """Synchronous steps as a trainer makes them: a step's micro-batches, then the next step's,
    each call carrying the norms the last answers brought. The first stage steps once the
    backward that completes its step is done (the answer brought the later stages' norms); the
    later stage waits for the norms of the first: from the next call, or at the last step from a
    norms call (PipelineTrainer._tell_norms), before any next micro-batch. After two steps the stages
    hold what one process's clip_grad_norm_ over the whole model gives, not what clipping each
    stage alone does."""
    run = RunConfig(model="tiny", num_stages=2, stage_step_samples=6, seed=3, warmup_steps=1, stage_sync_every_s=NO_SYNC)  # a step every 2 micro-batches of 3
    cfg = run.model_config()
    gen = torch.Generator().manual_seed(2)
    mbs = [(torch.randint(0, cfg.vocab_size, (3, 16), generator=gen), torch.randint(0, cfg.vocab_size, (3, 16), generator=gen)) for _ in range(5)]

    async def main():
        async with stage_servers(tmp_path, run, timing=NO_PENDING) as ((s0, s1), client):
            s0.stage_peers = {1: {s1.ctx.transport.peer_id}}  # what member records naming s1 would give
            norms2, heard = [-1.0, -1.0], []
            for i, (x, y) in enumerate(mbs):
                enc = {k: NONE.encode(v) for k, v in (("x", x), ("targets", y))}
                req = StageCall(stage=0, op="through", micro_batch=f"m{i}", route=(s1.ctx.transport.peer_id,), deadlines=(20.0,), norms2=tuple(norms2), **pack_tensors(enc))
                r = await client.send(s0.ctx.transport.peer_id, req, timeout=30, reuse=True)
                assert not r.failed and len(r.norms2) == len(r.norm_steps) == 2, r
                norms2 = list(r.norms2)
                heard.append(r.norm_steps)
                if i == 3:  # step 2 is due at both stages: a norms call steps s1 now
                    r = await client.send(s1.ctx.transport.peer_id, StageCall(stage=1, op="norms", norms2=tuple(norms2)), timeout=30, reuse=True)
                    assert r.norm_steps == (2,) and s1.calls["norms"] == 1, r
                    deadline = time.monotonic() + 20
                    while (s0.compute.steps, s1.compute.steps) != (2, 2) and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    assert (s0.compute.steps, s1.compute.steps) == (2, 2)  # both stepped before the next micro-batch
            assert heard == [(0, 0), (1, 1), (1, 1), (2, 2), (2, 2)]  # a step was due after the 2nd and 4th micro-batch, at both stages
            assert s0.compute.steps == s1.compute.steps == 2 and s0.compute.clips == s1.compute.clips == {"global": 2, "alone": 0}  # both steps clipped by every stage's norm
            return {n: p.detach().clone() for s in (s0, s1) for n, p in s.stage.named_parameters()}, norms2

    got, norms2 = asyncio.run(main())
    want, norms = one_process(run, mbs, per_stage=False)
    assert min(norms) > run.train_config().grad_clip  # the clip is at work in both steps
    assert math.isclose(math.sqrt(sum(norms2)), norms[1], rel_tol=1e-4)  # the stages' norms of step 2 make the model's
    alone, _ = one_process(run, mbs, per_stage=True)
    assert set(got) == set(want)
    for n in got:  # (atol: Adam turns the float noise of near-zero gradients, such as the attention's key bias, into updates of ~1e-6)
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5, msg=n)
    assert min((alone[n] - want[n]).abs().max().item() for n in want) > 4e-5  # clipping each stage alone moves every weight further


def test_with_stage_clip_each_stage_steps_by_its_own_norm_once_its_share_of_the_step_is_in(tmp_path):
    """Run setting stage_clip "stage": a stage clips by its own gradient's norm, as
    torch.distributed.pipelining's ranks do, and steps right after the batch that completes its
    step, with no norms from the other stages to wait for (and none asked for). After two steps
    the stages hold what one process clipping each stage's parameters alone gives."""
    run = RunConfig(model="tiny", num_stages=2, stage_step_samples=6, seed=3, warmup_steps=1, stage_sync_every_s=NO_SYNC, stage_clip="stage")
    cfg = run.model_config()
    gen = torch.Generator().manual_seed(2)
    mbs = [(torch.randint(0, cfg.vocab_size, (3, 16), generator=gen), torch.randint(0, cfg.vocab_size, (3, 16), generator=gen)) for _ in range(4)]

    async def main():
        async with stage_servers(tmp_path, run, timing=NO_PENDING) as ((s0, s1), client):
            s0.stage_peers = {1: {s1.ctx.transport.peer_id}}
            for i, (x, y) in enumerate(mbs):
                enc = {k: NONE.encode(v) for k, v in (("x", x), ("targets", y))}
                req = StageCall(stage=0, op="through", micro_batch=f"m{i}", route=(s1.ctx.transport.peer_id,), deadlines=(20.0,), **pack_tensors(enc))
                r = await client.send(s0.ctx.transport.peer_id, req, timeout=30, reuse=True)
                assert not r.failed, r
                deadline = time.monotonic() + 20
                while (s0.compute.steps, s1.compute.steps) != ((i + 1) // 2,) * 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert (s0.compute.steps, s1.compute.steps) == ((i + 1) // 2,) * 2, i  # a step after every 2nd micro-batch, at once, at both stages
            assert s0.compute.clips == s1.compute.clips == {"global": 0, "alone": 2} and s0.calls["norms"] == s1.calls["norms"] == 0
            return {n: p.detach().clone() for s in (s0, s1) for n, p in s.stage.named_parameters()}

    got = asyncio.run(main())
    alone, norms = one_process(run, mbs, per_stage=True)
    assert min(norms) > run.train_config().grad_clip  # the clip is at work in both steps
    assert set(got) == set(alone)
    for n in got:
        torch.testing.assert_close(got[n], alone[n], rtol=1e-5, atol=1e-5, msg=n)
    want, _ = one_process(run, mbs, per_stage=False)
    assert min((alone[n] - want[n]).abs().max().item() for n in want) > 4e-5  # (what the global clip would have given differs)


BAD = [
    # (stage, op, tensors, what the refusal names)
    (1, "train", {"x": torch.full((2, 8, 64), float("nan")), "targets": torch.zeros(2, 8, dtype=torch.int64)}, "NaN or Inf"),
    (1, "train", {"x": torch.zeros(2, 8, 32), "targets": torch.zeros(2, 8, dtype=torch.int64)}, "activations must be (batch, time, 64)"),
    (1, "train", {"x": torch.zeros(2, 8, 64, dtype=torch.float64), "targets": torch.zeros(2, 8, dtype=torch.int64)}, "must be float32"),
    (1, "train", {"x": torch.zeros(2, 8, 64), "targets": torch.full((2, 8), 999, dtype=torch.int64)}, "targets must be token ids in [0, 256)"),
    (1, "train", {"x": torch.zeros(2, 8, 64)}, "carries tensors ['targets', 'x']"),
    (1, "forward", {"x": torch.zeros(2, 8, 64)}, "the last stage takes train calls"),
    (0, "train", {"x": torch.zeros(2, 8, dtype=torch.int64), "targets": torch.zeros(2, 8, dtype=torch.int64)}, "train goes to the last stage"),
    (0, "forward", {"x": torch.full((2, 8), 300, dtype=torch.int64)}, "token ids must be in [0, 256)"),
    (0, "forward", {"x": torch.zeros(2, 200, dtype=torch.int64)}, "exceeds the model's context 64"),
    (0, "forward", {"x": torch.zeros(MAX_BATCH_SAMPLES + 1, 8, dtype=torch.int64)}, f"at most {MAX_BATCH_SAMPLES}"),
    (0, "backward", {"x": torch.zeros(2, 8, dtype=torch.int64), "grad": torch.zeros(2, 8, 65)}, "grad must be float32 (2, 8, 64)"),
]


def test_malformed_calls_are_refused_with_the_problem_named_and_the_server_keeps_serving(tmp_path):
    # each refused call scores its sender down by 2 at that server; at stage 0's, the last one bans it
    config = TransportConfig(ban_score=-2.0 * (sum(1 for stage, *_ in BAD if stage == 0) + 1))

    async def main():
        async with stage_servers(tmp_path, RUN, config, clients=2) as ((s0, s1), (client, other)):
            servers = (s0, s1)
            for stage, op, tensors, named in BAD:
                with pytest.raises(RemoteError) as e:
                    await call(client, servers[stage], op, **tensors)
                assert e.value.code == "bad_request" and named in e.value.message, (op, e.value.message)
            # a stage number this peer does not serve
            with pytest.raises(RemoteError, match=r"not_found: this peer serves stage 0, not 1"):
                await call(client, s0, "forward", stage=1, x=torch.zeros(2, 8, dtype=torch.int64))
            # a header that lies about its payload's size never reaches the server's handler
            good = pack_tensors({"x": NONE.encode(torch.zeros(2, 8, dtype=torch.int64))})
            with pytest.raises(RemoteError, match=r"bad_request: .*data: carries 128 bytes, the headers declare 64"):
                head = dict(good["tensors"][0], nbytes=64)
                await client.call(s0.ctx.transport.peer_id, unchecked(StageCall, stage=0, op="forward", tensors=(head,), shapes=((2, 8),), data=good["data"]), 10)
            assert s0.calls["refused"] + s1.calls["refused"] == len(BAD)
            # the sender is banned, and told what earned it: its offences, the last one named
            with pytest.raises(RemoteError, match=r"unauthorized: banned for 60 more seconds after \d+ offences in 600 s, the last: bad input: .*data: carries 128 bytes"):
                await call(client, s0, "forward", x=torch.zeros(2, 8, dtype=torch.int64))
            assert [b["peer_id"] for b in s0.ctx.transport.scores.bans(time.monotonic())] == [client.peer_id]
            assert s1.ctx.transport.scores.banned(client.peer_id, time.monotonic()) > 0  # its 6 refusals there, too
            # and the servers still serve everyone else
            x = torch.randint(0, 256, (2, 8))
            r = await call(other, s1, "train", x=out(await call(other, s0, "forward", x=x), "y"), targets=x)
            assert math.isfinite(r.loss) and out(r, "grad").shape == (2, 8, 64)

    asyncio.run(main())


def unchecked(cls, **values):
    """A message built without its checks: what a buggy or hostile peer may send."""
    msg = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(msg, f.name, values.get(f.name, f.default))
    return msg


def test_a_node_cannot_take_a_stage_outside_the_cut_or_a_cut_that_does_not_fit(tmp_path):
    cfg = NodeConfig(data_dir=str(tmp_path))
    with pytest.raises(RoleError, match=r"stage 2 is not a stage of this run's cut \(0..1\)"):
        StageServer(RoleContext(None, None, _Membership(), cfg), RUN, stage(2))
    with pytest.raises(RoleError, match=r"num_stages \(3\) exceeds the model's 2 blocks"):
        StageServer(RoleContext(None, None, _Membership(), cfg), RunConfig(model="tiny", num_stages=3), stage(0))
    with pytest.raises(RoleError, match=r"stage block counts \[1, 2\] add up to 3, the model has 2 blocks"):
        StageServer(RoleContext(None, None, _Membership(), cfg), RunConfig(model="tiny", num_stages=2, stage_blocks="1,2"), stage(0))


# ---- the trainer's view of stage peers -----------------------------------------------------------


def test_stage_peers_pick_by_expected_completion_and_try_new_peers_at_once():
    peers = SlotPeers()
    peers.update({0: ["a", "b"], 1: ["c"]})
    peers.succeeded("a", 0.1)
    assert peers.choose(0, now=0) == "b"  # never measured: tried at once
    peers.succeeded("b", 0.3)
    assert peers.choose(0, now=0) == "a"
    peers.peers["a"].inflight = 3  # 0.1 s x 4 calls > 0.3 s x 1
    assert peers.choose(0, now=0) == "b"
    assert peers.choose(0, now=0, avoid={"b"}) == "a"  # a call retried elsewhere
    assert peers.choose(1, now=0, avoid={"c"}) == "c"  # ... unless there is nowhere else
    with pytest.raises(NoSlotPeer, match="no peer serves stage 2"):
        peers.choose(2, now=0)


def test_a_peer_that_measured_slow_gets_a_call_again_after_reprobe_s():
    # b measured slow once (it was starting): by expected time it would never be chosen again,
    # its time never corrected, and the planner would never see its rate
    peers = SlotPeers(reprobe_s=5.0)
    peers.update({0: ["a", "b"]})
    assert [peers.choose(0, now=0.0, avoid={"b"}), peers.choose(0, now=0.0, avoid={"a"})] == ["a", "b"]
    peers.succeeded("a", 0.01)
    peers.succeeded("b", 2.0)
    assert [peers.choose(0, now=t) for t in (1.0, 2.0, 4.9)] == ["a", "a", "a"]
    assert peers.choose(0, now=5.1) == "b"  # not chosen for over 5 s: its turn, once
    assert peers.choose(0, now=5.2) == "a"
    peers.peers["b"].inflight = 1  # a call to it still runs: no second one
    assert peers.choose(0, now=20.0) == "a"


def test_stage_peers_ban_failing_peers_with_backoff_and_derive_deadlines_from_measured_times():
    peers = SlotPeers(min_timeout_s=2.0, first_timeout_s=10.0, timeout_factor=8.0, max_backoff_s=30.0)
    peers.update({0: ["a", "b"]})
    assert peers.timeout("a") == 10.0  # never measured
    peers.succeeded("a", 0.5)
    assert peers.timeout("a") == 4.0
    peers.succeeded("b", 0.01)
    assert peers.timeout("b") == 2.0  # the floor
    assert peers.failed("a", now=100) == 1
    assert peers.failed("a", now=100.5) == 0.5  # a call that was in flight with the first: the same failure
    assert [peers.failed("a", now=t) for t in (101, 103, 107, 115, 131, 161)] == [2, 4, 8, 16, 30, 30]
    assert peers.choose(0, now=170) == "b"
    with pytest.raises(NoSlotPeer, match="every peer of stage 0 failed lately"):
        peers.failed("b", now=170)
        peers.choose(0, now=170.5)
    assert peers.choose(0, now=171.1) == "b"  # its 1-s ban is over: tried again (a's lasts until 191)
    assert peers.choose(0, now=191.1, avoid={"b"}) == "a"
    peers.succeeded("a", 0.5)
    assert peers.failed("a", now=300) == 1  # a success clears the backoff


def test_role_labels_name_the_stage():
    assert [slot_index(r, "stage") for r in ("stage:0", "stage:12", "replica", "stage:", "stage:x", "expert:e1")] == [0, 12, None, None, None, None]
