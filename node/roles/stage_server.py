"""The stage role: one slot of a pipeline run (a stage of the model's cut), served to trainers.

A stage server holds only its stage's layers and AdamW state. It is a `SlotServer` (its weights,
states, syncs with the stage's other peers, call queue, stats: slot_server.py) with a
`StepSchedule` (when a step is due and taken, the global clip's waiting: stage_core.py) and a
`StageCompute` (batches, kept graphs, clipped steps: stage_compute.py), and it serves StageCall.

How a micro-batch travels is the run's `stage_routing`:
- "through" (the default): the trainer makes one call to the first stage's peer naming a peer for
  each later stage (op `through`). Each stage runs its forward, calls the next one itself (only a
  peer the member records name a peer of the next stage), runs its backward with the gradient that
  comes back, and answers the loss, its input's gradient and every stage's own time. A call that
  fails on the way comes back naming that peer; the stages before it drop its graphs, nothing of
  it was accumulated, and the trainer sends it again another way.
- "relay": stage by stage through the trainer: forward on stages 0..S-2, `train` on the last
  (forward, loss and backward in one call), then backward on S-2..0 to the peer that ran the
  forward, with only the gradient; where that peer is gone, with the stage's input again to any
  peer of the stage, which recomputes the forward.

Everything a peer sends is checked before any compute (stage_calls.py): bad input is refused with
`bad_request` naming the problem, the sender is scored down, everyone else is served on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from protocol import RemoteProtocolError, RoleAssignment, StageCall, StageResult, pack_tensors

from ..models.diloco import adamw
from ..models.stages import Stage, StageInputError
from ..net.transport import NETWORK_ERRORS, RPCError
from ..runconfig import RunConfig, RunConfigError
from .activations import TOKENS, activation_codec, encode_floats
from .attacks import answer_attack
from .caller import short
from .role import Role, RoleContext, RoleError
from .run_model import RunModel, builtin_model, model_meta, run_model
from .serving import Pending
from .slot_server import SlotName, SlotServer
from .stage_calls import MAX_BATCH_SAMPLES, StageCut, check_call, check_through_answer
from .stage_compute import StageCompute
from .stage_core import ServeTiming, StepSchedule, take_batch
from .weights import SlotWeights

log = logging.getLogger(__name__)

PEERS_REFRESH_S = 2.0  # at most this often a through call's unknown next peer makes us read the member records again


class StageServer(Role):
    """The stage role (see the module's docstring). Its state (the stage's outer parameters and
    momentum, after the last sync) is kept in DATA_DIR/stage-state and served to peers that take
    the stage later."""

    name = "stage"

    def __init__(self, ctx: RoleContext, run: RunConfig, assignment: RoleAssignment, timing: ServeTiming = ServeTiming()):
        self.ctx, self.run_config, self.index, self.what, self.timing = ctx, run, assignment.stage, f"stage {assignment.stage}", timing
        # kept: backwards through a kept graph (stale: of a forward on older weights than now); failed_after: through calls whose later stage failed
        self.calls = {"forward": 0, "backward": 0, "train": 0, "through": 0, "refused": 0, "batched": 0, "kept": 0, "stale": 0, "failed_after": 0, "norms": 0}
        self.stage_peers: dict[int, set[str]] = {}  # the peers of each stage as the member records name them (through calls go only to them)
        self.bytes_sent = self.bytes_received = 0  # of through calls to the next stage
        self.slot: SlotServer | None = None
        self._stopping = False
        self.attack = answer_attack(ctx.node_config)  # a Byzantine stage server (tests, drills, benches)
        if not run.is_hf:  # (a Hugging Face model's cut is known once its files are here: at start)
            self._cut(builtin_model(run))

    def _cut(self, model: RunModel) -> None:
        """This stage of the run's cut, and the slot that serves it; RoleError when the cut does
        not fit the model or has no such stage."""
        run, index = self.run_config, self.index
        try:
            self.plan = run.stage_plan(model.dims)
        except RunConfigError as e:
            raise RoleError(str(e)) from None
        if index is None or not 0 <= index < len(self.plan):
            raise RoleError(f"stage {index} is not a stage of this run's cut (0..{len(self.plan) - 1})")
        self.model = model
        self.cut = StageCut(index, len(self.plan), model.dims)
        self.codec = activation_codec(run, model.dims.n_embd)
        self.schedule = StepSchedule(run.stage_step_samples, len(self.plan), index, run.stage_clip == "global", self.timing.pending_s, self.timing.report_s)
        meta = {**model_meta(run), "stage": index, "blocks": list(self.plan[index]), "num_stages": len(self.plan)}
        name = SlotName("stage", self.what, "stage", str(index), f"stage-{index}", coordinator_slot=index)
        self.slot = SlotServer(self.ctx, run, name, meta, self.schedule, self._compute, self._stats)
        self.compute, self.queue = self.slot.compute, self.slot.queue

    @property
    def stage(self) -> Stage:
        return self.slot.weights.module

    @property
    def hash(self) -> str:
        return self.slot.weights.hash

    @property
    def state(self):
        return self.slot.state

    def _build(self):
        stage = self.model.stage(self.index, self.plan, self.run_config.seed)
        return stage, adamw(stage.parameters(), self.run_config.train_config())

    def _compute(self, weights: SlotWeights) -> StageCompute:
        return StageCompute(weights, self.schedule, self.run_config.train_config(), self.calls, self.what)

    def _describe(self) -> str:
        first, last = self.plan[self.index]
        return (f"{len(self.plan)} stages, blocks {first}..{last - 1}{' + embeddings' if self.cut.first else ''}{' + head' if self.cut.last else ''}, "
                f"{self.stage.num_params()} params, activations {self.codec.name}")  # fmt: skip

    def _stats(self) -> dict[str, Any]:
        return {"stage": self.index, "num_stages": len(self.plan), "blocks": list(self.plan[self.index]), "calls": self.calls,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}  # fmt: skip

    async def start(self) -> None:
        if self.slot is None:
            self._cut(await run_model(self.ctx, self.run_config, lambda: self._stopping, role="pipeline"))
        await self.slot.start(self._build, {StageCall: self._on_call}, self._describe)

    async def run(self) -> None:
        await self.slot.serve(self._take)

    async def stop(self, planned: bool = True) -> None:
        self._stopping = True
        if self.slot is not None:
            await self.slot.stop(planned)

    # ---- serving

    def _take(self, queue) -> list[Pending]:
        batch, _ = take_batch(queue, MAX_BATCH_SAMPLES)
        if len(batch) > 1:
            self.calls["batched"] += len(batch)
        return batch

    def _result(self, later: StageResult | None = None, **fields: Any) -> StageResult:
        """An answer, with this stage's norm of its latest step due (see StepSchedule) and, on a
        through call's way back, the later stages' from their answer."""
        steps, norm2 = self.schedule.due_norm
        if later is not None:
            return StageResult(norms2=(norm2, *later.norms2), norm_steps=(steps, *later.norm_steps), **fields)
        return StageResult(norms2=(norm2,), norm_steps=(steps,), **fields)

    def _heard(self, norms2: tuple[float, ...]) -> None:
        if self.schedule.heard(norms2):
            self.queue.wake.set()  # a step waiting for them is taken now

    async def _on_call(self, ctx) -> StageResult:
        req: StageCall = ctx.request
        if req.stage != self.index:
            raise RPCError("not_found", f"this peer serves stage {self.index}, not {req.stage}")
        self._heard(req.norms2)
        if req.op == "norms":
            self.calls["norms"] += 1
            return self._result()
        try:
            x, extra = check_call(req, self.cut, self.stage)
        except (RemoteProtocolError, StageInputError) as e:
            self.calls["refused"] += 1
            raise RemoteProtocolError(f"stage {self.index} {req.op}: {e}") from None  # bad_request; the sender is scored down
        if req.op == "through":
            return await self._through(ctx.peer_id, req, x, extra)
        keep = req.micro_batch and (req.op == "forward" or (req.op == "backward" and x is None))
        version = self.slot.weights.version
        loss, out = await self.queue.submit(Pending(req.op, x, extra, (ctx.peer_id, req.micro_batch) if keep else None))
        version = self.slot.weights.answered_from(version)
        self.calls[req.op] += 1
        self.calls["kept"] += req.op == "backward" and x is None
        name = "y" if req.op == "forward" else "grad"
        tensors = {} if out is None else {name: encode_floats(self.codec, self._lie(name, out))}
        return self._result(loss=loss, weights=version, **pack_tensors(tensors))

    def _lie(self, name: str, t):
        """What this stage answers with in place of `t`: `t`, unless it is a Byzantine one."""
        return t if self.attack is None else self.attack.apply(name, t)

    async def _through(self, caller: str, req: StageCall, x, targets) -> StageResult:
        """A micro-batch on its way through this and the later stages (see StageCall): forward
        here, the next stage's call, backward here with the gradient it sends back."""
        t0 = time.monotonic()
        if self.cut.last:
            loss, gx = await self.queue.submit(Pending("train", x, targets))
            self.calls["through"] += 1
            return self._result(loss=loss, times=(time.monotonic() - t0,), **pack_tensors({"grad": encode_floats(self.codec, self._lie("grad", gx))}))
        nxt, later = req.route[0], self.index + 1
        if not await self._serves(nxt, later):  # (or its record has not reached us yet: not the caller's fault)
            self.calls["failed_after"] += 1
            return StageResult(failed=nxt, failed_stage=later, reason=f"{nxt} serves no stage {later} in the member records stage {self.index}'s peer {self.ctx.host.peer_id} reads")
        key = (caller, f"through:{req.micro_batch}")
        _, y = await self.queue.submit(Pending("forward", x, None, key))
        own = time.monotonic() - t0
        call = StageCall(stage=later, op="through", micro_batch=req.micro_batch, route=req.route[1:], deadlines=req.deadlines[1:], norms2=req.norms2,
                         **pack_tensors({"x": encode_floats(self.codec, self._lie("y", y)), "targets": TOKENS.encode(targets)}))  # fmt: skip
        try:
            reply = await self.ctx.transport.send(nxt, call, timeout=req.deadlines[0], reuse=True)
            grad = check_through_answer(reply, self.cut, tuple(y.shape))
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:
            reply = StageResult(failed=nxt, failed_stage=later, reason=short(e))
        self.bytes_sent += len(call.data)
        if reply.failed:  # the trainer sends the micro-batch again another way
            self.compute.kept.drop(key)
            self.calls["failed_after"] += 1
            return StageResult(failed=reply.failed, failed_stage=reply.failed_stage, reason=reply.reason)
        self.bytes_received += len(reply.data)
        t1 = time.monotonic()
        _, gx = await self.queue.submit(Pending("backward", None, grad, key))
        if self.schedule.answer_completes(reply.norm_steps):  # step now, not when the next call brings the later stages' norms
            self._heard((self.schedule.due_norm[1], *reply.norms2))
        self.calls["through"] += 1
        self.calls["kept"] += 1
        tensors = {} if gx is None or self.cut.first else {"grad": encode_floats(self.codec, self._lie("grad", gx))}
        return self._result(reply, loss=reply.loss, times=(own + time.monotonic() - t1, *reply.times), **pack_tensors(tensors))

    async def _serves(self, peer: str, stage: int) -> bool:
        """Whether the member records name `peer` a peer of `stage`. A peer not in our view makes
        us read them again, once for all callers waiting, at most every PEERS_REFRESH_S (a peer
        that just joined is named by a trainer that read them later)."""
        if peer not in self.stage_peers.get(stage, ()):
            members = await self.slot.view.read_shared(PEERS_REFRESH_S)
            if members.ok:
                self.stage_peers = {s: set(ps) for s, ps in members.numbered("stage").items()}
        return peer in self.stage_peers.get(stage, ())
