"""The expert role: one shard of a MoE model's experts (expert e of every layer with e mod
expert_shards == its shard), served to the trainers that run the rest of the model.

An expert host is a `SlotServer` as a stage server is (slot_server.py: its shard's hosts average
in namespace "experts-<shard>" and hold bitwise-identical experts afterwards; the coordinator keeps
the shard's checkpoints), serving one call at a time (its graphs are kept per expert), with
`ExpertCompute` for the arithmetic. The model is the run's (expert_model.py): a MoE preset's
experts, or slices of a Hugging Face Mixtral's fused expert tensors.

One ExpertCall carries all tokens of all this shard's experts a trainer's micro-batch routed here,
for one layer. The host keeps the forward's graph, so the backward sends only the gradient; a
host that lost it (restarted) recomputes from the tokens when they are sent again. Gradients are
clipped by one global norm over the whole model, as one process clips them: a backward's answer
carries the squared norm of its experts' gradients, which the host holds; after the
micro-batch's backward the trainer sends each host the clip coefficient (op "commit"), and the
host adds its held gradients times it. Gradients never committed are dropped after SAVED_S. The
host steps its AdamW every `stage_step_samples` samples of committed micro-batches.
"""

from __future__ import annotations

import logging
import time

import torch

from protocol import RemoteProtocolError, RoleAssignment, pack_tensors, unpack_tensors
from protocol.messages import ExpertCall, ExpertResult
from protocol.records import role_label, slot_index

from ..models.diloco import TrainConfig, adamw, lr_at
from ..models.stages import StageInputError
from ..net.transport import RPCError
from ..runconfig import RunConfig
from .activations import activation_codec, decode_checked, encode_floats
from .attacks import answer_attack
from .expert_model import ExpertModel, expert_model, preset_model
from .role import Role, RoleContext, RoleError
from .serving import Pending
from .slot_server import SlotName, SlotServer
from .stage_compute import MAX_SAVED, SAVED_S, WeightStash, clipped_step
from .stage_core import KeptGraphs, ServeTiming, StepSchedule
from .stats import ComputeRate
from .weights import SlotWeights

log = logging.getLogger(__name__)

MAX_CALL_TOKENS = 1 << 16  # tokens one call may carry per expert


def shard_of_label(label: str) -> int | None:
    """The shard of a member record's role label ("expert:shard2" -> 2), None for other roles."""
    return slot_index(label, "expert", "shard")


def check_expert_call(req: ExpertCall, host: ExpertHost) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tokens (`x:<expert>`) and gradients (`grad:<expert>`) a call carries, checked before
    any compute: names of experts this host serves, float32 (n, C), finite."""
    if req.op == "commit":
        return {}, {}
    names, n_embd, layout = host.names, host.layout.width, host.layout
    max_numel = MAX_CALL_TOKENS * n_embd
    x, grad = {}, {}
    for key, enc in unpack_tensors(req, max_numel).items():
        kind, _, name = key.partition(":")
        if kind not in ("x", "grad") or (kind == "grad" and req.op == "forward"):
            raise StageInputError(f"a {req.op} carries x:<expert>{' and grad:<expert>' if req.op == 'backward' else ''} tensors, got {key!r}")
        if name not in host.all_experts:
            raise StageInputError(f"no expert {name!r} in this model ({layout.layers} layers x {layout.experts} experts)")
        if name not in names:  # a real expert of another shard: a stale view, not garbage
            raise RPCError("not_found", f"{host.what} does not serve expert {name} (it serves {', '.join(names)})")
        t = decode_checked(enc, max_numel, key)
        if t.dtype != torch.float32 or t.dim() != 2 or t.size(1) != n_embd or t.size(0) > MAX_CALL_TOKENS:
            raise StageInputError(f"{key} must be float32 (tokens <= {MAX_CALL_TOKENS}, {n_embd}), got {t.dtype} {tuple(t.shape)}")
        (x if kind == "x" else grad)[name] = t
    if req.op == "forward" and not x:
        raise StageInputError("a forward carries at least one x:<expert>")
    if req.op == "backward":
        if not grad:
            raise StageInputError("a backward carries at least one grad:<expert>")
        for name, t in x.items():
            if name not in grad:
                raise StageInputError(f"x:{name} without grad:{name}")
            if t.shape != grad[name].shape:
                raise StageInputError(f"grad:{name} has shape {tuple(grad[name].shape)}, x:{name} {tuple(t.shape)}")
    return x, grad


class ExpertCompute:
    """An expert host's arithmetic, on the event loop's thread under the weights' lock."""

    def __init__(self, weights: SlotWeights, schedule: StepSchedule, train_config: TrainConfig, batch_size: int, calls: dict[str, int], what: str, kept: int):
        self.weights, self.schedule, self.train_config, self.batch_size, self.calls, self.what = weights, schedule, train_config, batch_size, calls, what
        self.kept = KeptGraphs(kept, SAVED_S)  # (caller, micro-batch/layer, expert) -> (x, y)
        self.stash = WeightStash(weights)
        self.rate = ComputeRate()
        # (caller, micro-batch) -> (when its first backward came, its experts' parameter
        # gradients): held until the trainer's commit says how much of them to apply
        self.held: dict[tuple[str, str], tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.steps = self.samples = 0
        self.clips = {"global": 0, "alone": 0}
        self.last_norm = (-1.0, -1.0)

    def run_batch(self, batch: list[Pending]) -> list[tuple[float | None, dict]]:
        p = batch[0]  # a call is its own batch
        caller, mb = p.key
        if p.op == "commit":
            return [(None, self._commit((caller, mb), p.extra))]
        t0 = time.thread_time()
        if p.op == "forward":
            return [(None, self._forward(caller, mb, p.x, t0))]
        return [self._backward(caller, mb, p, t0)]

    def _forward(self, caller: str, mb: str, xs: dict[str, torch.Tensor], t0: float) -> dict[str, torch.Tensor]:
        now = time.monotonic()
        for key in [k for k, (when, _) in self.held.items() if now - when > SAVED_S]:
            del self.held[key]  # its trainer never committed it (gone, or its commit failed)
            self.calls["uncommitted"] += 1
            log.debug("%s: micro-batch %s of %s never committed; its gradients dropped", self.what, key[1], key[0][-8:])
        shard, outs = self.weights.module, {}
        for name, x in xs.items():
            x = x.detach().requires_grad_(True)
            with self.stash.hooks(shard):
                y = shard[name](x)
            self.kept.keep((caller, mb, name), now, (x, y))
            outs[name] = y.detach()
            self.calls["tokens"] += x.size(0)
        self.rate.add(time.thread_time() - t0, 0)
        return outs

    def _backward(self, caller: str, mb: str, p: Pending, t0: float) -> tuple[float, dict[str, torch.Tensor]]:
        outs, tokens, norm2, held = {}, 0, 0.0, []
        for name, g in p.extra.items():
            if name in p.x:  # recompute: this host may not hold the forward
                self.kept.drop((caller, mb, name))
                x = p.x[name].detach().requires_grad_(True)
                y = self.weights.module[name](x)
            else:
                kept = self.kept.take((caller, mb, name))
                if kept is None:
                    raise RPCError("not_found", f"no forward of {name} for micro-batch {mb!r} kept here: send its tokens")
                x, y = kept
                if g.shape != y.shape:
                    raise RemoteProtocolError(f"{self.what} backward: grad:{name} has shape {tuple(g.shape)}, the forward gave {tuple(y.shape)}")
            params = list(self.weights.module[name].parameters())
            grads = torch.autograd.grad(y, [x, *params], g)
            outs[name] = grads[0]
            held.extend(zip(params, grads[1:]))
            norm2 += float(sum(t.square().sum() for t in grads[1:]))
            tokens += x.size(0)
        # (held only once the whole call computed: a refused one leaves nothing to expire)
        self.held.setdefault((caller, mb.rpartition("/")[0] or mb), (time.monotonic(), []))[1].extend(held)
        self.samples += tokens
        self.rate.add(time.thread_time() - t0, tokens)
        return norm2, outs

    def _commit(self, key: tuple[str, str], scale: float) -> dict:
        """The trainer's global clip for micro-batch `key`: its held gradients, times `scale`,
        join the next step's (scale 0: dropped)."""
        held = self.held.pop(key, None)
        if held is None:
            raise RPCError("not_found", f"no gradients of micro-batch {key[1]!r} held here (expired, or its backward went elsewhere)")
        if scale > 0.0:
            for param, grad in held[1]:
                if param.grad is None:
                    param.grad = grad.mul_(scale)
                else:
                    param.grad.add_(grad, alpha=scale)
            self.schedule.accumulated(self.batch_size, 1)  # gradients are averaged over the micro-batches they came from
        return {}

    def step(self) -> None:
        stepped, norms = clipped_step(self.weights.opt, self.schedule.acc_calls, self.train_config.grad_clip, lr_at(self.steps, self.train_config))
        if norms is not None:
            self.last_norm = norms
            self.clips["alone"] += 1
        if stepped:
            self.weights.changed()
            self.steps += 1
        else:
            log.warning("%s: non-finite gradient norm; dropping its micro-batches' gradients", self.what)


class ExpertHost(Role):
    """The expert role: serves ExpertCall for the experts of shard `assignment.expert` ("shard<i>").
    A Hugging Face model's files are fetched at start, before its shard is known and built."""

    name = "expert"

    def __init__(self, ctx: RoleContext, run: RunConfig, assignment: RoleAssignment, timing: ServeTiming = ServeTiming()):
        slot = assignment.expert
        index = shard_of_label(role_label("expert", slot)) if slot else None
        if index is None:
            raise RoleError(f"expert slot {slot!r} is not a shard name (shard<i>)")
        if not 0 <= index < run.expert_shards:
            raise RoleError(f"expert shard {index} is not a shard of this run (0..{run.expert_shards - 1})")
        self.ctx, self.run_config, self.index, self.slot_label, self.timing, self.what = ctx, run, index, slot, timing, f"expert shard {index}"
        self.calls = {"forward": 0, "backward": 0, "refused": 0, "tokens": 0, "commit": 0, "uncommitted": 0}
        self.slot: SlotServer | None = None
        self._stopping = False
        self.attack = answer_attack(ctx.node_config)  # a Byzantine expert host (tests, drills, benches)
        if not run.is_hf:  # a preset's shard is known now (a run that does not fit it is refused here)
            self._hold(preset_model(run))

    def _hold(self, model: ExpertModel) -> None:
        """The shard of `model` this host serves, and the parts that serve it."""
        run, index = self.run_config, self.index
        self.model, self.layout = model, model.layout
        self.names = model.shard(run, index)
        self.codec = activation_codec(run, self.layout.width)
        self.all_experts = self.layout.names()
        # the trainer's global clip comes with each micro-batch's commit: a step clips by the shard's own norm only
        self.schedule = StepSchedule(run.stage_step_samples, 1, 0, False, self.timing.pending_s, self.timing.report_s)
        meta = {**model.meta, "expert_shard": index, "experts": list(self.names)}
        # the coordinator keeps each shard's checkpoints (coordinator_slot: the shard), once its hosts reported their hash
        name = SlotName("expert", self.what, "expert", self.slot_label, f"experts-{index}", coordinator_slot=index)
        self.slot = SlotServer(self.ctx, run, name, meta, self.schedule, self._compute, self._stats)
        self.compute, self.queue = self.slot.compute, self.slot.queue

    @property
    def shard(self):
        return self.slot.weights.module

    @property
    def hash(self) -> str:
        return self.slot.weights.hash

    @property
    def state(self):
        return self.slot.state

    def _build(self):
        shard = self.model.make_shard(self.names)
        return shard, adamw(shard.parameters(), self.run_config.train_config())

    def _compute(self, weights: SlotWeights) -> ExpertCompute:
        kept = MAX_SAVED * max(1, len(self.names))  # graphs are kept per expert
        return ExpertCompute(weights, self.schedule, self.run_config.train_config(), self.run_config.batch_size, self.calls, self.what, kept)

    def _describe(self) -> str:
        return f"{self.model.source}: experts {', '.join(self.names)}, {self.shard.num_params()} params, activations {self.codec.name}"

    def _stats(self) -> dict:
        return {"expert_shard": self.index, "experts": list(self.names), "calls": self.calls, "bytes_sent": 0, "bytes_received": 0}

    async def start(self) -> None:
        if self.slot is None:
            self._hold(await expert_model(self.run_config, self.ctx, lambda: self._stopping))
        await self.slot.start(self._build, {ExpertCall: self._on_call}, self._describe)

    async def run(self) -> None:
        await self.slot.serve(lambda q: [q.popleft()])  # a call is its own batch: its graphs are kept per expert

    async def stop(self, planned: bool = True) -> None:
        self._stopping = True
        if self.slot is not None:
            await self.slot.stop(planned)

    async def _on_call(self, ctx) -> ExpertResult:
        req: ExpertCall = ctx.request
        try:
            x, grad = check_expert_call(req, self)
        except (RemoteProtocolError, StageInputError) as e:
            self.calls["refused"] += 1
            raise RemoteProtocolError(f"{self.what} {req.op}: {e}") from None  # bad_request; the sender is scored down
        self.ctx.membership.progress.extra["load"] = len(self.queue) + 1  # announced with our record
        version = self.slot.weights.version
        norm2, outs = await self.queue.submit(Pending(req.op, x, req.scale if req.op == "commit" else grad, (ctx.peer_id, req.micro_batch)))
        version = self.slot.weights.answered_from(version)
        self.calls[req.op] += 1
        prefix = "y" if req.op == "forward" else "grad"
        if self.attack is not None:  # a Byzantine host (tests, drills, benches)
            outs = {n: self.attack.apply(f"{prefix}:{n}", t) for n, t in outs.items()}
        return ExpertResult(norm2=norm2, weights=version, **pack_tensors({f"{prefix}:{n}": encode_floats(self.codec, t) for n, t in outs.items()}))
