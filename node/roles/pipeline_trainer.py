"""The trainer role of a pipeline run: holds the data, sends micro-batches through the stages.

It keeps `micro_batches_in_flight` micro-batches in the pipeline (trainer_loop.py) and picks, per
stage, the peer with the least expected completion time (caller.py `SlotPeers`). With
`stage_routing` "through" one call to the first stage carries a micro-batch all the way (see
stage_server.py); a call that fails on the way names the peer, which is left alone for its
backoff, and the micro-batch goes again another way. With "relay" each stage is called in turn;
a backward whose forward peer is gone or kept no graph is recomputed on another peer of the
stage. A micro-batch is given up only when peers refuse what we send as ours to fix.

With the global clip every call carries each stage's latest gradient norm the trainer heard
(stage_core.py `NormBook`); with `synchronous_steps` the trainer hands a step's norms to the
later stages as soon as the step's micro-batches all came back (a norms call), so the stages
step side by side.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path

import torch

from protocol import RemoteProtocolError, RoleAssignment, StageCall, StageResult, pack_tensors, unpack_tensors

from ..net.transport import NETWORK_ERRORS
from ..runconfig import RunConfig, RunConfigError
from .activations import TOKENS, activation_codec, decode_checked, encode_floats
from .audit import Auditor
from .caller import NO_PEER_WAIT_S, REFUSALS_TO_GIVE_UP, CallFailed, GiveUp, NoSlotPeer, PeerCaller, short
from .role import Role, RoleContext, RoleError
from .run_model import RunModel, builtin_model, run_model
from .stage_calls import MAX_BATCH_SAMPLES
from .stage_core import NormBook
from .stats import LossLog
from .trainer_loop import micro_batch_loop, trainer_batches
from .view import Members, SwarmView

log = logging.getLogger(__name__)


class PipelineTrainer(Role):
    """The trainer role of a pipeline run (see the module's docstring)."""

    name = "trainer"

    def __init__(self, ctx: RoleContext, run: RunConfig, assignment: RoleAssignment | None = None):
        c = ctx.node_config
        self.ctx, self.run_config = ctx, run
        self.model: RunModel | None = None
        self._stopping = False
        if not run.is_hf:  # (a Hugging Face model's cut is known once its files are here: at start)
            self._cut(builtin_model(run))
        self.caller = PeerCaller(ctx.transport)
        self.audit = Auditor(run.audit_fraction, ctx.transport.scores, "trainer")
        self.view = SwarmView(ctx.host, c.swarm_id, c.record_ttl_s)
        self.losses = LossLog(Path(c.data_dir), ctx.membership, run.batch_size, stats=self._stats, line=lambda: f"{self.caller.retries} retries, {self.losses.lost} lost",
                              activity=ctx.activity)  # fmt: skip
        self._known = asyncio.Event()
        self._telling: set[asyncio.Task] = set()

    def _stats(self) -> dict:
        return {"retries": self.caller.retries, "bytes_sent": self.caller.bytes_sent, "bytes_received": self.caller.bytes_received, "checks": self.audit.counts}

    def _cut(self, model: RunModel) -> None:
        try:
            self.plan = self.run_config.stage_plan(model.dims)
        except RunConfigError as e:
            raise RoleError(str(e)) from None
        self.model, self.dims = model, model.dims
        self.codec = activation_codec(self.run_config, self.dims.n_embd)
        self.max_numel = MAX_BATCH_SAMPLES * self.dims.context * max(self.dims.n_embd, 1)
        self.norms = NormBook(len(self.plan))

    async def start(self) -> None:
        if self.model is None:
            self._cut(await run_model(self.ctx, self.run_config, lambda: self._stopping, role="pipeline"))

    async def stop(self, planned: bool = True) -> None:
        self._stopping = True
        self.view.close()

    async def run(self) -> None:
        batches, shard, nshards = await trainer_batches(self.ctx, self.run_config, self.dims.context, self.model.tokenizer)
        follow = asyncio.create_task(self.view.follow(self._peers, self._known), name="stage-peers")
        run = self.run_config
        try:
            await self._known.wait()
            log.info("trainer: %d stages, micro-batches of %d, %d in flight, activations %s, data shard %d/%d",
                     len(self.plan), run.batch_size, run.micro_batches_in_flight, self.codec.name, shard, nshards)  # fmt: skip
            self.losses.start()
            send = self._relay if run.stage_routing == "relay" else self._through_or_checked
            # synchronous_steps: the micro-batches of one stage step in flight at a time
            window = run.stage_step_samples // run.batch_size if run.synchronous_steps else 0
            on_window = self._tell_norms if run.stage_clip == "global" else None
            await micro_batch_loop(self.ctx.host.peer_id[-6:], batches, send, self.losses, run.micro_batches_in_flight, window, on_window)
        finally:
            for t in (follow, *self._telling):
                t.cancel()
            await asyncio.gather(follow, *self._telling, return_exceptions=True)

    def _peers(self, members: Members) -> bool:
        """Who serves which stage, from a read of the member records; True once every stage has a peer."""
        stages = members.numbered("stage", below=len(self.plan))
        self.caller.peers.update(stages)
        return all(stages.get(s) for s in range(len(self.plan)))

    # ---- the global clip's norms

    def _tell_norms(self) -> None:
        """A step's micro-batches all came back, and with them every stage's norm of the step: the
        peers of the later stages hear them now (the first stage, with the next micro-batch)."""
        norms2, peers = self.norms.to_tell()
        for stage, peer in peers:
            task = asyncio.create_task(self._send_norms(stage, peer, norms2))
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)

    async def _send_norms(self, stage: int, peer: str, norms2: tuple[float, ...]) -> None:
        try:
            await self.ctx.transport.send(peer, StageCall(stage=stage, op="norms", norms2=norms2), timeout=self.caller.peers.timeout(peer), reuse=True)
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:  # only a hint: the next micro-batch brings the norms too
            log.debug("norms to stage %d peer %s: %s", stage, peer[-8:], short(e))

    def _heard(self, peers: list[str], first: int, reply: StageResult) -> None:
        self.norms.heard(peers, first, reply.norm_steps, reply.norms2)

    # ---- stage_routing "through"

    async def _through_or_checked(self, name: str, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """A micro-batch through the stages; the audit's fraction of them relayed instead, each
        stage's call checked on a second peer (a lie told to the next stage is told to us too)."""
        if self.audit.due():
            return await self._relay(name, x, y, check=True)
        return await self._through(name, x, y)

    async def _through(self, name: str, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One micro-batch sent through every stage in one call to the first: its loss, or None
        if it was given up."""
        stages, peers = len(self.plan), self.caller.peers
        encoded = pack_tensors({"x": TOKENS.encode(x), "targets": TOKENS.encode(y)})
        tried: set[str] = set()
        refused: list[str] = []
        while True:
            try:
                route = self.caller.route(stages, tried)
            except NoSlotPeer:
                await asyncio.sleep(NO_PEER_WAIT_S)
                continue
            waits = [peers.timeout(p) for p in route]
            deadlines = [sum(waits[i:]) for i in range(stages)]  # each call waits for the stages after it too
            request = StageCall(stage=0, op="through", micro_batch=name, route=tuple(route[1:]), deadlines=tuple(deadlines[1:]), norms2=self.norms.norms2(), **encoded)
            try:
                reply = await self.caller.call(route[0], request, lambda r: self._through_reply(r, route), timeout=deadlines[0], timed=False, route=tuple(route))
            except CallFailed as e:
                blame, why = route[0], e.reason
                if e.refused:
                    refused.append(e.message)
                    if len(refused) >= REFUSALS_TO_GIVE_UP:  # peers refuse what we send: it is ours to fix
                        log.error("micro-batch %s given up: refused by %d peers: %s", name, REFUSALS_TO_GIVE_UP, e.message)
                        return None
            else:
                if not reply.failed:
                    for p, seconds in zip(route, reply.times):
                        peers.succeeded(p, seconds)
                    self._heard(route, 0, reply)
                    return reply.loss
                blame, why = reply.failed, reply.reason
            tried.add(blame)
            ban = self.caller.fail(blame)
            self.caller.retries += 1
            log.info("micro-batch %s through stage %d on %s failed (%s); sending it again another way, %s left alone for %.0f s",
                     name, route.index(blame), blame[-8:], why, blame[-8:], ban)  # fmt: skip

    def _through_reply(self, reply, route: list[str]) -> StageResult:
        if not isinstance(reply, StageResult):
            raise RemoteProtocolError(f"answered a StageCall with {type(reply).__name__}")
        stages = len(self.plan)
        if reply.failed:
            if reply.failed in route[1:] and route.index(reply.failed) == reply.failed_stage:
                return reply
            raise RemoteProtocolError(f"reports a failure of {reply.failed[-8:]} at stage {reply.failed_stage}, not on its route")  # its own failure
        if reply.loss is None or len(reply.times) != stages or len(reply.norms2) != stages or reply.tensors:
            raise RemoteProtocolError(f"a through answer needs a loss, {stages} stage times and norms and no tensors, got {reply.loss}, {len(reply.times)}, {len(reply.norms2)}, {len(reply.tensors)}")
        return reply

    # ---- stage_routing "relay"

    async def _relay(self, name: str, x: torch.Tensor, y: torch.Tensor, check: bool = False) -> float | None:
        """One micro-batch through every stage and back via this trainer; its loss, or None if it
        was given up. Forward and train calls are checked on a second peer of their stage: each
        with the audit's fraction, or all of them (`check`)."""
        last = len(self.plan) - 1
        try:
            inputs, forward_peers = [x], []
            for s in range(last):
                (out,), _, peer = await self._call(s, "forward", name, {"x": inputs[-1]}, ("y",), check)
                inputs.append(out)
                forward_peers.append(peer)
            outs, loss, _ = await self._call(last, "train", name, {"x": inputs[-1], "targets": y}, ("grad",) if last else (), check)
            grad = outs[0] if last else None
            for s in range(last - 1, -1, -1):
                want = ("grad",) if s > 0 else ()
                outs = await self._backward_kept(s, forward_peers[s], name, grad, want, inputs[s].shape[:2])
                if outs is None:  # that peer is gone or kept no graph: recompute, on any peer of the stage
                    outs, _, _ = await self._call(s, "backward", name, {"x": inputs[s], "grad": grad}, want)
                grad = outs[0] if want else None
            return loss
        except GiveUp as e:
            log.error("micro-batch %s given up: %s", name, e)
            return None

    async def _backward_kept(self, stage: int, peer: str, name: str, grad: torch.Tensor, want: tuple[str, ...], bt: torch.Size):
        """The backward on the peer that ran the forward, through the graph it kept: only the
        gradient travels. None when that does not work out (the caller recomputes elsewhere)."""
        request = StageCall(stage=stage, op="backward", micro_batch=name, norms2=self.norms.norms2(), **pack_tensors({"grad": encode_floats(self.codec, grad)}))
        st = self.caller.peers.peers.get(peer)
        if st is None or st.banned_until > time.monotonic():
            return None
        try:
            outs, reply = await self.caller.call(peer, request, lambda r: (self._outputs(r, want, bt, "backward"), r))
        except CallFailed as e:
            if e.code != "not_found":  # not_found: it dropped the graph, nothing wrong
                self.caller.fail(peer)
                self.caller.retries += 1
                log.info("stage %d backward of %s on %s failed (%s); recomputing elsewhere", stage, name, peer[-8:], e.reason)
            return None
        self._heard([peer], stage, reply)
        return outs

    async def _call(self, stage: int, op: str, name: str, tensors: dict[str, torch.Tensor], want: tuple[str, ...], check: bool = False):
        """One stage call, retried on other peers of the stage until one answers well, and checked
        on a second peer (`check`, or the audit's fraction of forward and train calls); (tensors
        wanted, loss, the peer whose answer stands)."""
        encoded = {k: (TOKENS.encode(t) if not t.is_floating_point() else encode_floats(self.codec, t)) for k, t in tensors.items()}
        request = StageCall(stage=stage, op=op, micro_batch=name, norms2=self.norms.norms2(), **pack_tensors(encoded))
        bt = tensors["x"].shape[:2]
        parse = lambda r: (self._outputs(r, want, bt, op), r)  # noqa: E731
        (outs, reply), peer = await self.caller.call_any(stage, request, parse, f"stage {stage} {op} of {name}")
        if op != "backward" and (check or self.audit.due()):
            peer, (outs, reply) = await self._check(stage, op, request, parse, peer, (outs, reply), tensors["x"])
        self._heard([peer], stage, reply)
        return outs, reply.loss, peer

    async def _check(self, stage: int, op: str, request: StageCall, parse, peer: str, got, x: torch.Tensor):
        """`peer`'s answer checked on another peer of the stage (audit.py): (the peer whose
        answer stands, its (tensors, reply))."""
        first = {peer: got}

        def given(outs, reply) -> tuple[list[torch.Tensor], int]:
            return ([*outs, torch.tensor([reply.loss])] if op == "train" else list(outs)), reply.weights

        async def ask(p: str):
            try:
                outs, reply = await self.caller.call(p, request, parse)
            except CallFailed:
                return None
            first.setdefault(p, (outs, reply))
            return given(outs, reply)

        peers = self.caller.peers.slots.get(stage, [])
        chosen, _ = await self.audit.check(f"stage {stage} {op}", peers, peer, given(*got), x, ask)
        return chosen, first[chosen]

    def _outputs(self, reply, want: tuple[str, ...], bt: torch.Size, op: str) -> list[torch.Tensor]:
        """The tensors of a stage's reply, checked: a peer that sends garbage is treated as failed."""
        if not isinstance(reply, StageResult):
            raise RemoteProtocolError(f"answered a StageCall with {type(reply).__name__}")
        encoded = unpack_tensors(reply, self.max_numel)
        if set(encoded) != set(want):
            raise RemoteProtocolError(f"{op} reply carries {sorted(encoded)}, expected {sorted(want)}")
        outs = [decode_checked(encoded[k], self.max_numel, k) for k in want]
        shape = (*bt, self.dims.n_embd)
        for k, t in zip(want, outs):
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise RemoteProtocolError(f"{op} reply's {k} is {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
        if op == "train" and (reply.loss is None or not math.isfinite(reply.loss)):
            raise RemoteProtocolError("train reply without a finite loss")
        return outs
