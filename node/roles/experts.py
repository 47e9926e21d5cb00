"""Expert-parallel roles: expert hosts serve shards of a MoE model's experts, trainers run the rest.

    ExpertHost      the "expert" role: one shard of the experts (expert e of every layer with
                    e mod expert_shards == its shard) and their optimizer; serves ExpertCall
    ExpertTrainer   the "trainer" role of a MoE run: holds the data and the dense parts of the
                    model (embeddings, attention, routers, head), calls the experts remotely
    ExpertClient    a trainer's calls to the hosts of a layer's experts, with deadlines

One MoE layer of one micro-batch costs one call per expert shard it routed tokens to, for the
forward and one for the backward, whatever the number of tokens and experts: all tokens of all
the shard's experts travel in one ExpertCall (hivemind's RemoteMixtureOfExperts makes a call per
(sample, expert) pair). The host keeps the forward's graph, so the backward sends only the
gradient; a host that lost it (restarted) recomputes from the tokens when they are sent again.

Gradients are clipped by one global norm over the whole model, as one process clips them: a
host's backward answer carries the squared norm of its experts' gradients, which it holds; after
the micro-batch's backward the trainer adds its own parts' norm and sends each of those hosts
the clip coefficient (op "commit", see `ExpertClient.commit`); the host adds its held gradients
times it and steps when a step is due. (Each part clipping itself measured +1.8 % and +3.3 %
training loss on tiny-moe, two seeds.) Gradients never committed are dropped after SAVED_S.

Replicas of a shard (several hosts serving it) stay in step as a pipeline stage's peers do
(node/roles/pipeline.py, whose server this one extends): every `stage_sync_every_s` they average their
parameters in averager namespace "experts-<shard>", compressed with the run's codec, and hold
bitwise-identical experts afterwards. A host that joins or restarts downloads its shard's state
from a replica, hash-verified.

A trainer never waits on the DHT or past a deadline: which hosts serve a shard is refreshed in
the background; a call's deadline is the host's measured call time times 8 (2 s at least, 10 s
for a host never measured). A host that fails, times out or answers garbage is left alone for a
backoff (1 s, doubling); its experts' tokens that micro-batch get the other chosen experts'
share (gates renormalised), and while no host of a shard can be called, the router gives its
experts no tokens at all. The trainers average their dense parts among themselves every
`stage_sync_every_s`, in namespace "dense", weighted by the steps each has trained (a trainer
that joins late takes the others' dense parts at its first sync).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protocol import RemoteProtocolError, pack_tensors, unpack_tensors
from protocol.messages import ExpertCall, ExpertResult

from ..averaging import AveragingFailed, NamespaceTaken
from ..models.diloco import adamw, lr_at, state_hash
from ..net.membership import read_members
from ..osutil import write_json
from ..models.moe import MoEGPT, Routing, expert_name, init_moe_model
from .pipeline import (
    MAX_SAVED,
    SAVED_S,
    NoStagePeer,
    StagePeers,
    StageServer,
    _Pending,
    _same,
    _short,
    decode_checked,
    encode_floats,
    sync_averager,
    trainer_batches,
)
from protocol.records import parse_role_label, role_label

from .runner import Role, RoleError
from ..runconfig import RunConfig, RunConfigError
from ..models.stages import StageInputError
from ..net.transport import NETWORK_ERRORS, RemoteError, RPCError

log = logging.getLogger(__name__)

MAX_CALL_TOKENS = 1 << 16  # tokens one call may carry per expert
REPORT_EVERY = 8  # micro-batches per entry of a trainer's loss history
PEERS_REFRESH_S = 2.0


def shard_of_label(label: str) -> int | None:
    """The shard of a member record's role label ("expert:shard2" -> 2), None for other roles."""
    role, slot = parse_role_label(label)
    return int(slot[5:]) if role == "expert" and slot.startswith("shard") and slot[5:].isdigit() else None


def shard_names(run: RunConfig) -> tuple[str, ...]:
    """The planner's slots of an experts run: "shard0", "shard1", ..."""
    return tuple(f"shard{i}" for i in range(run.expert_shards))


class ExpertShard(nn.Module):
    """The experts of one shard, by swarm name, with the one-process model's initial values."""

    first = last = False  # (what a stage server asks of its module)

    def __init__(self, model: MoEGPT, names: tuple[str, ...]):
        super().__init__()
        self.names = names
        self.experts = nn.ModuleDict({n.replace(".", "_"): model.expert(n) for n in names})

    def __getitem__(self, name: str) -> nn.Module:
        return self.experts[name.replace(".", "_")]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class ExpertHost(StageServer):
    """The expert role: serves ExpertCall for the experts of shard `slot` ("shard<i>")."""

    name = "expert"
    CALL = ExpertCall
    COORDINATOR_KEEPS = False  # a shard's state lives on its replicas
    CLIP_ACROSS = False  # the trainer's global clip comes with each micro-batch's commit (ExpertClient.commit)

    def __init__(self, host, transport, membership, node_config, run: RunConfig, slot: str | None):
        index = shard_of_label(f"expert:{slot}") if slot else None
        try:
            if index is None:
                raise RunConfigError(f"expert slot {slot!r} is not a shard name (shard<i>)")
            self.names = run.expert_shard(index)
            self.gpt_config, self.moe_config = run.moe_preset()
        except RunConfigError as e:
            raise RoleError(str(e)) from None
        self.plan = ()
        self._setup(host, transport, membership, node_config, run, index, "expert", f"expert shard {index}", f"experts-{index}", role_label("expert", slot))
        self.all_experts = {expert_name(li, e) for li in range(self.gpt_config.n_layer) for e in range(self.moe_config.num_experts)}
        self.max_numel = MAX_CALL_TOKENS * self.model_config.n_embd
        self._acc_mbs: set[tuple[str, str]] = set()  # (caller, micro-batch) of the gradients accumulated since the last step
        # (caller, micro-batch) -> (when its first backward came, its experts' parameter
        # gradients): held until the trainer's commit says how much of them to apply
        self._held: dict[tuple[str, str], tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._done_mbs = 0
        self.calls.update(tokens=0, commit=0, uncommitted=0)

    def _describe(self) -> str:
        return f"experts {', '.join(self.names)}"

    def _same_slot(self, label: str) -> bool:
        return shard_of_label(label) == self.index

    def _build(self):
        model = init_moe_model(self.gpt_config, self.moe_config, self.run_config.seed)
        return self._with_optimizer(ExpertShard(model, self.names))

    def _meta(self) -> dict[str, Any]:
        return {**self.model_config.to_dict(), "moe": self.moe_config.to_dict(), "expert_shard": self.index, "experts": list(self.names)}

    def _slot_stats(self) -> dict[str, Any]:
        return {"expert_shard": self.index, "experts": list(self.names)}

    def _step_due(self) -> bool:
        return self._done_mbs * self.run_config.batch_size >= self.run_config.stage_step_samples

    def _step(self) -> None:
        self._acc_calls = len(self._acc_mbs)  # gradients are averaged over the micro-batches they came from
        super()._step()
        self._acc_mbs, self._done_mbs = set(), 0

    def _take_batch(self) -> list[_Pending]:
        return [self._queue.popleft()]  # a call is its own batch: its graph is kept per expert

    # ---- serving

    async def _on_call(self, ctx) -> ExpertResult:
        req: ExpertCall = ctx.request
        try:
            x, grad = self._expert_inputs(req)
        except (RemoteProtocolError, StageInputError) as e:
            self.calls["refused"] += 1
            raise RemoteProtocolError(f"{self.what} {req.op}: {e}") from None  # bad_request; the sender is scored down
        p = _Pending(req.op, x, req.scale if req.op == "commit" else grad, (ctx.peer_id, req.micro_batch))
        self._queue.append(p)
        self._wake.set()
        self.membership.progress.extra["load"] = len(self._queue)  # announced with our record
        norm2, outs = await p.done
        self.calls[req.op] += 1
        prefix = "y" if req.op == "forward" else "grad"
        return ExpertResult(norm2=norm2, **pack_tensors({f"{prefix}:{n}": encode_floats(self.codec, t) for n, t in outs.items()}))

    def _expert_inputs(self, req: ExpertCall) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The tokens (`x:<expert>`) and gradients (`grad:<expert>`) a call carries, checked
        before any compute: names of experts this host serves, float32 (n, C), finite."""
        if req.op == "commit":
            return {}, {}
        encoded = unpack_tensors(req, self.max_numel)
        x, grad = {}, {}
        C = self.model_config.n_embd
        for key, enc in encoded.items():
            kind, _, name = key.partition(":")
            if kind not in ("x", "grad") or (kind == "grad" and req.op == "forward"):
                raise StageInputError(f"a {req.op} carries x:<expert>{' and grad:<expert>' if req.op == 'backward' else ''} tensors, got {key!r}")
            if name not in self.all_experts:
                raise StageInputError(f"no expert {name!r} in this model ({self.gpt_config.n_layer} layers x {self.moe_config.num_experts} experts)")
            if name not in self.names:  # a real expert of another shard: a stale view, not garbage
                raise RPCError("not_found", f"{self.what} does not serve expert {name} (it serves {', '.join(self.names)})")
            t = decode_checked(enc, self.max_numel, key)
            if t.dtype != torch.float32 or t.dim() != 2 or t.size(1) != C or t.size(0) > MAX_CALL_TOKENS:
                raise StageInputError(f"{key} must be float32 (tokens <= {MAX_CALL_TOKENS}, {C}), got {t.dtype} {tuple(t.shape)}")
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

    # ---- compute (on the host's thread)

    def _run_batch(self, batch: list[_Pending]):
        p = batch[0]
        t0 = time.thread_time()
        caller, mb = p.key
        if p.op == "commit":
            return [(None, self._commit((caller, mb), p.extra))]
        batch_mb = (caller, mb.rpartition("/")[0] or mb)  # the micro-batch, whichever layer
        if p.op == "forward":
            now = time.monotonic()
            self._expire_saved(now)
            for key in [k for k, (when, _) in self._held.items() if now - when > SAVED_S]:
                del self._held[key]  # its trainer never committed it (gone, or its commit failed)
                self.calls["uncommitted"] += 1
                log.debug("%s: micro-batch %s of %s never committed; its gradients dropped", self.what, key[1], key[0][-8:])
            limit = MAX_SAVED * max(1, len(self.names))
            self._param_storages = {q.untyped_storage().data_ptr() for q in self.stage.parameters()}
            outs = {}
            for name, x in p.x.items():
                self._make_room(limit)
                x = x.detach().requires_grad_(True)
                with torch.autograd.graph.saved_tensors_hooks(self._stash_weights, _same):
                    y = self.stage[name](x)
                self._saved[(caller, mb, name)] = (now, x, y)
                outs[name] = y.detach()
                self.calls["tokens"] += x.size(0)
            self._rate.append((time.thread_time() - t0, 0))
            return [(None, outs)]
        outs, tokens, norm2, held = {}, 0, 0.0, []
        for name, g in p.extra.items():
            if name in p.x:  # recompute: this host may not hold the forward
                self._saved.pop((caller, mb, name), None)
                x = p.x[name].detach().requires_grad_(True)
                y = self.stage[name](x)
            else:
                kept = self._saved.pop((caller, mb, name), None)
                if kept is None:
                    raise RPCError("not_found", f"no forward of {name} for micro-batch {mb!r} kept here: send its tokens")
                _, x, y = kept
                if g.shape != y.shape:
                    raise RemoteProtocolError(f"{self.what} backward: grad:{name} has shape {tuple(g.shape)}, the forward gave {tuple(y.shape)}")
            params = list(self.stage[name].parameters())
            grads = torch.autograd.grad(y, [x, *params], g)
            outs[name] = grads[0]
            held.extend(zip(params, grads[1:]))
            norm2 += float(sum(t.square().sum() for t in grads[1:]))
            tokens += x.size(0)
        # (held only once the whole call computed: a refused one leaves nothing to expire)
        self._held.setdefault(batch_mb, (time.monotonic(), []))[1].extend(held)
        self._accumulated(tokens, 0, t0)
        return [(norm2, outs)]

    def _commit(self, key: tuple[str, str], scale: float) -> dict:
        """The trainer's global clip for micro-batch `key`: its held gradients, times `scale`,
        join the next step's (scale 0: dropped)."""
        held = self._held.pop(key, None)
        if held is None:
            raise RPCError("not_found", f"no gradients of micro-batch {key[1]!r} held here (expired, or its backward went elsewhere)")
        if scale > 0.0:
            for param, grad in held[1]:
                if param.grad is None:
                    param.grad = grad.mul_(scale)
                else:
                    param.grad.add_(grad, alpha=scale)
            self._acc_mbs.add(key)
            self._done_mbs += 1
        return {}


# ---- the trainer's side ----------------------------------------------------------------------


class ExpertClient:
    """A trainer's calls to expert hosts, from its compute thread (blocking on the event loop),
    with deadlines and backoff per host (StagePeers, keyed by shard)."""

    def __init__(self, transport, loop: asyncio.AbstractEventLoop, run: RunConfig, codec, max_numel: int):
        self.transport, self.loop, self.run, self.codec, self.max_numel = transport, loop, run, codec, max_numel
        self.gpt_config, self.moe_config = run.moe_preset()
        self.shards = run.expert_shards
        self.peers = StagePeers()
        self.skipped = 0  # expert calls given up (failed, timed out, refused, garbage)
        self.calls = 0
        self.bytes_sent = self.bytes_received = 0
        self.latencies: deque[float] = deque(maxlen=2000)  # seconds per layer (all its calls, forward or backward)
        # micro-batch -> {host: the squared norm of its experts' gradients}: who holds gradients
        # of it until the commit (see `commit`)
        self.held: dict[str, dict[str, float]] = {}

    def shard(self, expert: int) -> int:
        return expert % self.shards

    def alive(self, now: float) -> list[bool]:
        """Per expert of a layer: whether a host of its shard can be called now."""
        ok = []
        for s in range(self.shards):
            try:
                self.peers.choose(s, now)
                ok.append(True)
            except NoStagePeer:
                ok.append(False)
        return [ok[self.shard(e)] for e in range(self.moe_config.num_experts)]

    def _all(self, calls, layer: bool = True) -> list:
        """The calls' results, run together on the event loop (from the compute thread); the
        time they took together is the layer's latency (`layer`; a commit's is not)."""
        calls = list(calls)
        if not calls:
            return []

        async def together():
            return await asyncio.gather(*calls)

        t0 = time.monotonic()
        results = asyncio.run_coroutine_threadsafe(together(), self.loop).result()
        if layer:
            self.latencies.append(time.monotonic() - t0)
        return results

    async def _call(self, peer: str, request: ExpertCall, want: dict[str, tuple[int, ...]], prefix: str) -> tuple[dict[str, torch.Tensor], float | None] | None:
        """(the tensors `want` names, decoded and checked; the host's norm2), or None: failed."""
        st = self.peers.peers[peer]
        st.inflight += 1
        t0 = time.monotonic()
        self.calls += 1
        try:
            reply = await self.transport.send(peer, request, timeout=self.peers.timeout(peer), reuse=True)
            if not isinstance(reply, ExpertResult):
                raise RemoteProtocolError(f"answered an ExpertCall with {type(reply).__name__}")
            encoded = unpack_tensors(reply, self.max_numel)
            if set(encoded) != {f"{prefix}:{n}" for n in want}:
                raise RemoteProtocolError(f"{request.op} reply carries {sorted(encoded)}, expected {sorted(want)}")
            outs = {}
            for name, shape in want.items():
                t = decode_checked(encoded[f"{prefix}:{name}"], self.max_numel, f"{prefix}:{name}")
                if tuple(t.shape) != shape or t.dtype != torch.float32:
                    raise RemoteProtocolError(f"{prefix}:{name} is {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
                outs[name] = t
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:
            self.skipped += request.op != "commit"
            if not (isinstance(e, RemoteError) and e.code == "not_found" and request.op != "forward"):
                ban = self.peers.failed(peer, time.monotonic())
                log.info("expert %s on %s failed (%s); its experts skipped, %s left alone for %.0f s", request.op, peer[-8:], _short(e), peer[-8:], ban)
            return None
        finally:
            st.inflight -= 1
        if request.op != "commit":  # (a commit carries no work: its time says nothing of the host's calls)
            self.peers.succeeded(peer, time.monotonic() - t0)
        self.bytes_sent += len(request.data)
        self.bytes_received += len(reply.data)
        return outs, reply.norm2

    def forward(self, mb: str, layer: int, flat: torch.Tensor, routing: Routing) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Each shard's experts on their tokens, one call per shard: {expert: output} of the
        experts that answered, and {expert: the host that ran it}."""
        now = time.monotonic()
        calls = []
        for s in range(self.shards):
            experts = [e for e in range(s, self.moe_config.num_experts, self.shards) if routing.tokens[e].numel()]
            if not experts:
                continue
            try:
                peer = self.peers.choose(s, now)
            except NoStagePeer:
                continue  # (routing already avoided it, unless it was banned just now)
            named = {expert_name(layer, e): flat[routing.tokens[e]] for e in experts}
            request = ExpertCall(op="forward", micro_batch=f"{mb}/{layer}", **pack_tensors({f"x:{n}": encode_floats(self.codec, t) for n, t in named.items()}))
            want = {n: (t.size(0), t.size(1)) for n, t in named.items()}
            calls.append((experts, peer, self._call(peer, request, want, "y")))

        results = self._all(c for _, _, c in calls)
        outs, hosts = {}, {}
        for (experts, peer, _), got in zip(calls, results):
            if got is None:
                continue
            for e in experts:
                outs[e] = got[0][expert_name(layer, e)]
                hosts[e] = peer
        return outs, hosts

    def backward(self, mb: str, layer: int, grads: dict[int, torch.Tensor], hosts: dict[int, str]) -> dict[int, torch.Tensor]:
        """The gradients of the experts' inputs from the hosts that ran their forward (only the
        output gradients travel); an expert whose host does not answer in time gets none."""
        by_host: dict[str, list[int]] = {}
        for e in grads:
            by_host.setdefault(hosts[e], []).append(e)
        calls = []
        for peer, experts in sorted(by_host.items()):
            named = {expert_name(layer, e): grads[e] for e in experts}
            request = ExpertCall(op="backward", micro_batch=f"{mb}/{layer}", **pack_tensors({f"grad:{n}": encode_floats(self.codec, g) for n, g in named.items()}))
            want = {n: tuple(g.shape) for n, g in named.items()}
            calls.append((experts, peer, self._call(peer, request, want, "grad")))

        results = self._all(c for _, _, c in calls)
        out = {}
        held = self.held.setdefault(mb, {})
        for (experts, peer, _), got in zip(calls, results):
            if got is not None:
                for e in experts:
                    out[e] = got[0][expert_name(layer, e)]
                held[peer] = held.get(peer, 0.0) + (got[1] or 0.0)
        return out

    def commit(self, mb: str, dense_norm2: float, max_norm: float) -> float:
        """After micro-batch `mb`'s whole backward: the clip coefficient of one global gradient
        norm, as one process's `clip_grad_norm_(model.parameters(), max_norm)` takes it, over the
        caller's own gradients (`dense_norm2`, squared) and every expert the micro-batch ran
        (the norms its hosts reported), sent to each of those hosts, which apply their held
        gradients times it. Clipping each host's experts on their own would let each part take
        a norm of up to max_norm: measured +1.9 % training loss on tiny-moe. Returns the
        coefficient (max_norm 0: 1, no clipping; 0 for a non-finite norm: the hosts drop the
        micro-batch's gradients, the caller must too)."""
        held = self.held.pop(mb, {})
        for old in list(self.held)[:-64]:  # micro-batches whose caller never committed (an exception mid-step)
            del self.held[old]
        total = math.sqrt(dense_norm2 + sum(held.values()))
        if not math.isfinite(total):
            scale = 0.0
        elif max_norm > 0:
            scale = min(1.0, max_norm / (total + 1e-6))
        else:
            scale = 1.0
        self._all((self._call(peer, ExpertCall(op="commit", micro_batch=mb, scale=scale), {}, "") for peer in sorted(held)), layer=False)
        return scale


class _RemoteExperts(torch.autograd.Function):
    """One MoE layer's experts, run remotely: (N, C) tokens in, the experts' outputs of the
    routed tokens back, concatenated expert by expert (zeros for an expert that did not answer)."""

    @staticmethod
    def forward(ctx, flat, client: ExpertClient, mb: str, layer: int, routing: Routing, answered: list):
        outs, hosts = client.forward(mb, layer, flat.detach(), routing)
        answered.extend(sorted(outs))
        ctx.client, ctx.mb, ctx.layer, ctx.routing, ctx.hosts, ctx.n = client, mb, layer, routing, hosts, flat.size(0)
        C = flat.size(1)
        pieces = [outs[e] if e in outs else flat.new_zeros(routing.tokens[e].numel(), C) for e in range(len(routing.tokens))]
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad_out):
        routing = ctx.routing
        sizes = [t.numel() for t in routing.tokens]
        parts = grad_out.split(sizes)
        grads = {e: parts[e].contiguous() for e in ctx.hosts}
        got = ctx.client.backward(ctx.mb, ctx.layer, grads, ctx.hosts)
        grad_flat = grad_out.new_zeros(ctx.n, grad_out.size(1))
        for e, g in got.items():
            grad_flat.index_add_(0, routing.tokens[e], g)
        return grad_flat, None, None, None, None, None


class NoExpertAlive(Exception):
    """Every expert host is down or left alone for its backoff: the micro-batch waits."""


def remote_moe(flat: torch.Tensor, router, client: ExpertClient, mb: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A MoE layer whose experts are remote: (output (N, C), balance loss, experts skipped).
    With every expert answering it computes what `moe.combine` computes; the tokens of an expert
    that did not answer get the other chosen experts' gates, renormalised."""
    alive = client.alive(time.monotonic())
    if not any(alive):
        raise NoExpertAlive(f"no host of any expert of layer {layer} can be called now")
    routing = router(flat, alive)
    answered: list[int] = []
    cat = _RemoteExperts.apply(flat, client, mb, layer, routing, answered)
    sizes = [t.numel() for t in routing.tokens]
    outs = cat.split(sizes)
    lost = flat.new_zeros(flat.size(0))  # per token: the gate weight of its experts that did not answer
    skipped = 0
    for e, idx in enumerate(routing.tokens):
        if idx.numel() and e not in answered:
            lost = lost.index_add(0, idx, routing.weights[e])
            skipped += 1
    scale = 1.0 / (1.0 - lost).clamp_min(1e-6) if skipped else None
    y = torch.zeros_like(flat)
    for e in answered:
        idx = routing.tokens[e]
        w = routing.weights[e] if scale is None else routing.weights[e] * scale[idx]
        y = y.index_add(0, idx, outs[e] * w.unsqueeze(-1))
    return y, routing.aux_loss, skipped


def clip_and_commit(model: nn.Module, client: ExpertClient, mb: str, max_norm: float) -> float:
    """After micro-batch `mb`'s backward through `model` (its experts remote): its gradients
    clipped by one global norm with the remote experts' (ExpertClient.commit), here and on the
    hosts. Returns the clip coefficient (0: non-finite; nothing may be applied)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    own = float(sum(g.square().sum() for g in grads)) if grads else 0.0
    scale = client.commit(mb, own, max_norm)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return scale


def forward_loss(model: MoEGPT, client: ExpertClient, mb: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """MoEGPT.forward with its experts remote: (cross-entropy, the training loss with the balance
    loss added, experts skipped). `model`'s own experts are not used."""
    skipped = 0
    T = x.size(1)
    h = model.drop(model.wte(x) + model.wpe(torch.arange(T)))
    aux = h.new_zeros(())
    for li, block in enumerate(model.blocks):
        h = h + block.attn(block.ln_1(h))
        B, T, C = h.shape
        flat = block.ln_2(h).reshape(B * T, C)
        out, a, s = remote_moe(flat, block.moe.router, client, mb, li)
        h = h + out.view(B, T, C)
        aux, skipped = aux + a, skipped + s
    aux = aux / len(model.blocks)
    logits = model.lm_head(model.ln_f(h))
    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    return ce, ce + model.moe_config.aux_loss_weight * aux, skipped


class ExpertTrainer(Role):
    """The trainer role of an experts run: micro-batches of `batch_size` sequences, one at a
    time, through the dense model here and the experts on their hosts; an AdamW step on the
    dense parts after each. Dense parts are averaged with the other trainers' periodically."""

    name = "trainer"

    def __init__(self, host, transport, membership, node_config, run: RunConfig):
        try:
            self.gpt_config, self.moe_config = run.moe_preset()
            run.expert_shard(0)  # the shards fit the model
        except RunConfigError as e:
            raise RoleError(str(e)) from None
        self.host, self.transport, self.membership, self.node_config, self.run_config = host, transport, membership, node_config, run
        self.train_config = run.train_config()
        from .pipeline import activation_codec

        self.codec = activation_codec(run, self.gpt_config.n_embd)
        self.max_numel = MAX_CALL_TOKENS * self.gpt_config.n_embd
        self.stats_path = Path(node_config.data_dir) / "trainer-stats.json"
        self.model: MoEGPT | None = None
        self.opt = None
        self.client: ExpertClient | None = None
        self.micro_batches = 0
        self.steps = 0
        self.syncs = 0
        self.skipped_experts = 0
        self.history: list[dict[str, Any]] = []
        self._losses: list[float] = []
        self._known = asyncio.Event()
        self._t0 = time.monotonic()
        self._lock = asyncio.Lock()  # held while a micro-batch or a sync uses the dense parameters
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer", initializer=torch.set_num_threads, initargs=(node_config.torch_threads(),))
        self.averager = sync_averager(host, transport, node_config, run, "dense")

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _build(self) -> None:
        model = init_moe_model(self.gpt_config, self.moe_config, self.run_config.seed)
        for block in model.blocks:
            block.moe.experts = nn.ModuleList()  # they live on the expert hosts
        self.model = model
        self.opt = adamw(model.parameters(), self.train_config)

    async def start(self) -> None:
        await self._compute(self._build)
        self.client = ExpertClient(self.transport, asyncio.get_running_loop(), self.run_config, self.codec, self.max_numel)
        try:
            await self.averager.start()
        except NamespaceTaken as e:
            raise RoleError(str(e)) from None

    async def stop(self, planned: bool = True) -> None:
        await self.averager.close()
        self._pool.shutdown(wait=False)

    async def run(self) -> None:
        batches, shard, nshards = await trainer_batches(self.host, self.node_config, self.run_config, self.gpt_config.context)
        tasks = [asyncio.create_task(self._refresh_peers(), name="expert-hosts"), asyncio.create_task(self._sync_forever(), name="dense-sync")]
        try:
            await self._known.wait()
            log.info("trainer: %d layers x %d experts (top %d) on %d shards, micro-batches of %d, activations %s, data shard %d/%d",
                     self.gpt_config.n_layer, self.moe_config.num_experts, self.moe_config.top_k, self.run_config.expert_shards,
                     self.run_config.batch_size, self.codec.name, shard, nshards)  # fmt: skip
            self._t0 = time.monotonic()
            n, waiting = 0, False
            while True:
                x, y = batches.next()
                async with self._lock:
                    loss, skipped = await self._compute(self._train_step, f"{self.host.peer_id[-6:]}-{n}", x, y)
                n += 1
                if skipped < 0:  # no expert can be called now: the batch waits for a host (never a crash)
                    if not waiting:
                        log.warning("trainer: no expert host can be called; waiting for one")
                    waiting = True
                    await asyncio.sleep(0.2)
                    continue
                waiting = False
                self.skipped_experts += skipped
                if loss is not None:
                    self._record(loss)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _train_step(self, mb: str, x: torch.Tensor, y: torch.Tensor) -> tuple[float | None, int]:
        """One micro-batch: forward (the experts remote), backward, an AdamW step. On the compute thread."""
        try:
            ce, loss, skipped = forward_loss(self.model, self.client, mb, x, y)
        except NoExpertAlive:
            return None, -1
        if not torch.isfinite(loss):
            log.warning("micro-batch %s: non-finite loss; skipped", mb)
            return None, skipped
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        cfg = self.train_config
        if clip_and_commit(self.model, self.client, mb, cfg.grad_clip) == 0.0:
            log.warning("micro-batch %s: non-finite gradient norm; its gradients dropped here and on the hosts", mb)
            return None, skipped
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.steps, cfg)
        self.opt.step()
        self.steps += 1
        return ce.item(), skipped

    async def _refresh_peers(self) -> None:
        """Which hosts serve which shard, from the DHT's member records, in the background."""
        while True:
            try:
                members = await read_members(self.host, self.node_config.swarm_id)
            except Exception as e:  # the DHT may be briefly unreachable
                log.debug("could not read member records: %s", e)
                members = {}
            shards: dict[int, list[str]] = {}
            trainers = []
            self.client.peers.announced = {peer: rec.load for peer, rec in members.items()}
            for peer, rec in members.items():
                if time.time() - rec.issued_at >= self.node_config.record_ttl_s:
                    continue
                s = shard_of_label(rec.role)
                if s is not None and s < self.run_config.expert_shards:
                    shards.setdefault(s, []).append(peer)
                elif rec.role == "trainer" and peer != self.host.peer_id:
                    trainers.append(peer)
            if members:
                self.client.peers.update(shards)
                self._trainers = sorted(trainers)
            if any(shards.values()):
                self._known.set()
            await asyncio.sleep(PEERS_REFRESH_S if self._known.is_set() else 0.5)

    _trainers: list[str] = []

    async def _sync_forever(self) -> None:
        """Average the dense parts with the other trainers every stage_sync_every_s (the same
        wall-clock boundaries everywhere), each weighted by the steps it has trained. What a
        trainer learned while the round ran is kept: its parameters become the average plus its
        own progress since the snapshot."""
        period = self.run_config.stage_sync_every_s
        while True:
            n = math.floor(time.time() / period) + 1
            await asyncio.sleep(max(0.0, n * period - time.time()))
            if not self._trainers:
                continue
            async with self._lock:
                snap = [p.detach().clone() for p in self.model.parameters()]
            try:
                # weighted by the steps each has trained: a trainer that just joined (its dense
                # parts at their initial values) takes the others' instead of pulling them back
                avg, report = await self.averager.average(f"dense-{n}", snap, weight=float(max(1, self.steps)), expected_peers=self._trainers)
            except AveragingFailed as e:
                log.warning("dense sync %d failed (%s); training on", n, e.report.reason)
                continue
            async with self._lock:
                with torch.no_grad():
                    for p, s, a in zip(self.model.parameters(), snap, avg):
                        p.add_(a - s)
            self.syncs += 1
            log.info("dense sync %d with %d trainers in %.2f s", n, len(report.members), report.seconds)

    def dense_hash(self) -> str:
        return state_hash(dict(self.model.named_parameters()))

    def _record(self, loss: float) -> None:
        self.micro_batches += 1
        self._losses.append(loss)
        if len(self._losses) < REPORT_EVERY:
            return
        mean = sum(self._losses) / len(self._losses)
        self._losses.clear()
        elapsed = time.monotonic() - self._t0
        rate = self.micro_batches * self.run_config.batch_size / elapsed if elapsed > 0 else None
        lat = sorted(self.client.latencies)
        p50 = lat[len(lat) // 2] if lat else None
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None
        self.history.append({"micro_batches": self.micro_batches, "loss": mean, "time": time.time(), "skipped_experts": self.skipped_experts})
        del self.history[:-500]
        log.info("trainer | %d micro-batches | loss %.4f | %.1f samples/s | %d expert calls skipped", self.micro_batches, mean, rate or 0, self.client.skipped)
        p = self.membership.progress
        p.step, p.loss, p.samples_per_second = self.micro_batches, mean, rate
        stats = {
            "micro_batches": self.micro_batches, "samples": self.micro_batches * self.run_config.batch_size, "loss": mean,
            "samples_per_second": rate, "skipped_calls": self.client.skipped, "calls": self.client.calls,
            "skipped_experts": self.skipped_experts, "syncs": self.syncs, "layer_latency_p50_s": p50, "layer_latency_p99_s": p99,
            "bytes_sent": self.client.bytes_sent, "bytes_received": self.client.bytes_received, "history": self.history,
        }  # fmt: skip
        write_json(self.stats_path, stats)

