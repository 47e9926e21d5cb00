"""A trainer's side of expert parallelism: a MoE model whose experts run on expert hosts.

    ExpertClient     calls to the hosts of a layer's experts, from the trainer's compute thread:
                     one call per shard a micro-batch's tokens went to (all the tokens of all its
                     experts together: hivemind's RemoteMixtureOfExperts makes a call per
                     (sample, expert) pair), deadlines and backoff per host (caller.py)
    remote_moe       a MoE layer with remote experts: route here, the experts there, combine here
    forward_loss     MoEGPT.forward with its experts remote
    mixtral_forward_loss  a Hugging Face Mixtral's forward (its dense parts here) with its experts remote
    clip_and_commit  the micro-batch's gradients clipped by one global norm, here and on the hosts

A trainer never waits on the DHT or past a deadline: a host that fails, times out or answers
garbage is left alone for a backoff; its experts' tokens that micro-batch get the other chosen
experts' share (gates renormalised), and while no host of a shard can be called, the router gives
its experts no tokens at all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from protocol import RemoteProtocolError, pack_tensors, unpack_tensors
from protocol.messages import ExpertCall, ExpertResult

from ..models import mixtral
from ..models.moe import ExpertLayout, MoEGPT, Routing, expert_name
from ..runconfig import RunConfig
from .activations import decode_checked, encode_floats
from .audit import Auditor
from .caller import CallFailed, PeerCaller, SlotPeers

log = logging.getLogger(__name__)


class ExpertClient:
    """A trainer's calls to expert hosts, from its compute thread (blocking on the event loop),
    with deadlines and backoff per host (SlotPeers, keyed by shard)."""

    def __init__(self, transport, loop: asyncio.AbstractEventLoop, run: RunConfig, codec, max_numel: int, layout: ExpertLayout | None = None):
        """`layout`: the model's experts (default: the run's MoE preset's)."""
        self.loop, self.run, self.codec, self.max_numel = loop, run, codec, max_numel
        self.layout = layout or ExpertLayout.of_preset(*run.moe_preset())
        self.shards = run.expert_shards
        self.caller = PeerCaller(transport)
        self.audit = Auditor(run.audit_fraction, transport.scores, "trainer")
        self.skipped = 0  # expert calls given up (failed, timed out, refused, garbage)
        self.calls = 0
        self.latencies: deque[float] = deque(maxlen=2000)  # seconds per layer (all its calls, forward or backward)
        # micro-batch -> {host: the squared norm of its experts' gradients}: who holds gradients
        # of it until the commit (see `commit`)
        self.held: dict[str, dict[str, float]] = {}

    @property
    def peers(self) -> SlotPeers:
        return self.caller.peers

    def shard(self, expert: int) -> int:
        return expert % self.shards

    def alive(self, now: float) -> list[bool]:
        """Per expert of a layer: whether a host of its shard can be called now."""
        ok = [self.peers.callable(s, now) for s in range(self.shards)]
        return [ok[self.shard(e)] for e in range(self.layout.experts)]

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

    async def _call(self, peer: str, request: ExpertCall, want: dict[str, tuple[int, ...]], prefix: str) -> tuple[dict[str, torch.Tensor], float | None, int] | None:
        """(the tensors `want` names, decoded and checked; the host's norm2; its weights' version),
        or None: failed."""
        self.calls += 1
        try:
            # (a commit carries no work: its time says nothing of the host's calls)
            return await self.caller.call(peer, request, lambda r: self._checked(r, request.op, want, prefix), timed=request.op != "commit")
        except CallFailed as e:
            self.skipped += request.op != "commit"
            if not (e.code == "not_found" and request.op != "forward"):
                ban = self.caller.fail(peer)
                log.info("expert %s on %s failed (%s); its experts skipped, %s left alone for %.0f s", request.op, peer[-8:], e.reason, peer[-8:], ban)
            return None

    def _checked(self, reply, op: str, want: dict[str, tuple[int, ...]], prefix: str) -> tuple[dict[str, torch.Tensor], float | None, int]:
        if not isinstance(reply, ExpertResult):
            raise RemoteProtocolError(f"answered an ExpertCall with {type(reply).__name__}")
        encoded = unpack_tensors(reply, self.max_numel)
        if set(encoded) != {f"{prefix}:{n}" for n in want}:
            raise RemoteProtocolError(f"{op} reply carries {sorted(encoded)}, expected {sorted(want)}")
        outs = {}
        for name, shape in want.items():
            t = decode_checked(encoded[f"{prefix}:{name}"], self.max_numel, f"{prefix}:{name}")
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise RemoteProtocolError(f"{prefix}:{name} is {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
            outs[name] = t
        return outs, reply.norm2, reply.weights

    def forward(self, mb: str, layer: int, flat: torch.Tensor, routing: Routing) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Each shard's experts on their tokens, one call per shard: {expert: output} of the
        experts that answered, and {expert: the host that ran it}."""
        now = time.monotonic()
        calls = []
        for s in range(self.shards):
            experts = [e for e in range(s, self.layout.experts, self.shards) if routing.tokens[e].numel()]
            if not experts or not self.peers.callable(s, now):
                continue  # (routing already avoided it, unless it was banned just now)
            peer = self.peers.choose(s, now)
            named = {expert_name(layer, e): flat[routing.tokens[e]] for e in experts}
            request = ExpertCall(op="forward", micro_batch=f"{mb}/{layer}", **pack_tensors({f"x:{n}": encode_floats(self.codec, t) for n, t in named.items()}))
            want = {n: (t.size(0), t.size(1)) for n, t in named.items()}
            calls.append((experts, self._forward(s, layer, peer, request, want, torch.cat(list(named.values())))))

        results = self._all(c for _, c in calls)
        outs, hosts = {}, {}
        for (experts, _), (peer, got) in zip(calls, results):
            if got is None:
                continue
            for e in experts:
                outs[e] = got[0][expert_name(layer, e)]
                hosts[e] = peer
        return outs, hosts

    async def _forward(self, shard: int, layer: int, peer: str, request: ExpertCall, want: dict[str, tuple[int, ...]], x: torch.Tensor):
        """A shard's forward call, checked on another host of the shard with the audit's
        fraction (audit.py): (the host whose answer stands, its answer or None: failed)."""
        got = await self._call(peer, request, want, "y")
        if got is None or not self.audit.due():
            return peer, got
        names, first = sorted(want), {peer: got}

        async def ask(p: str):
            try:
                answer = await self.caller.call(p, request, lambda r: self._checked(r, "forward", want, "y"))
            except CallFailed:
                return None
            first.setdefault(p, answer)
            return [answer[0][n] for n in names], answer[2]

        given = ([got[0][n] for n in names], got[2])
        chosen, _ = await self.audit.check(f"layer {layer} experts", self.peers.slots.get(shard, []), peer, given, x, ask)
        return chosen, first[chosen]

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
        gradients times it. Returns the coefficient (max_norm 0: 1, no clipping; 0 for a
        non-finite norm: the hosts drop the micro-batch's gradients, the caller must too)."""
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
    outs = cat.split([t.numel() for t in routing.tokens])
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


def mixtral_forward_loss(model: nn.Module, client: ExpertClient, mb: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A Hugging Face Mixtral's forward (node/models/mixtral.py: its MoE blocks' experts dropped)
    with its experts remote, routed as Mixtral routes: (cross-entropy, the training loss with
    Mixtral's router loss where its config asks for it, experts skipped)."""
    skipped = 0

    def call(flat: torch.Tensor, route, layer: int) -> torch.Tensor:
        nonlocal skipped
        out, _, s = remote_moe(flat, route, client, mb, layer)
        skipped += s
        return out

    _, ce, loss = mixtral.forward_loss(model, call, x, y)
    return ce, loss, skipped
