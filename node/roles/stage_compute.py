"""A stage server's arithmetic: batches of forwards, backwards and train calls; kept graphs; steps.

Runs on the event loop's thread under the weights' lock (serving.py says why). The peer that ran
a forward keeps its autograd graph for the backward (`KeptGraphs`). Optimizer steps do not wait
for the graphs kept: a kept graph saves a copy of the weights it used (one copy per parameter
between two steps, PipeDream's weight stashing), so its backward computes the gradient of the
forward it ran. Gradients of every backward accumulate; a step averages them per micro-batch and
clips them (`clipped_step`) by this stage's norm or, with the other stages' norms, by the whole
model's as one process does.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn.functional as F

from protocol import RemoteProtocolError

from ..models.diloco import TrainConfig, lr_at
from ..net.transport import RPCError
from .serving import Pending
from .stage_core import KeptGraphs, StepSchedule
from .stats import ComputeRate
from .weights import SlotWeights

log = logging.getLogger(__name__)

MAX_SAVED = 32  # forward graphs a stage server keeps for their backward (oldest dropped first)
SAVED_S = 60.0  # seconds a kept forward graph waits for its backward


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def clipped_step(opt: torch.optim.Optimizer, calls: int, max_norm: float, lr: float, others2: float | None = None) -> tuple[bool, tuple[float, float] | None]:
    """An optimizer step on the gradients accumulated since the last, averaged per micro-batch
    (`calls`), clipped to `max_norm`: by the norm of every stage's gradient together when
    `others2` (the other stages' squared norms) is known, as torch's clip_grad_norm_ clips the
    whole model's, else by these gradients' alone. (stepped: False for a non-finite norm, whose
    gradients are dropped; (own norm, the others' norm or -1) when it clipped)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    for p in params:
        p.grad.div_(max(calls, 1))
    norm = norms = None
    if max_norm > 0 and params:
        own = torch.stack([p.grad.detach().norm() for p in params]).norm()
        norm = own if others2 is None else (own.double() ** 2 + others2).sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        norms = (float(own), -1.0 if others2 is None else math.sqrt(others2))
        for p in params:
            p.grad.mul_(coef)
    stepped = norm is None or bool(torch.isfinite(norm))
    if stepped:
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
    opt.zero_grad(set_to_none=True)
    return stepped, norms


class WeightStash:
    """What a kept graph saves of a weight (the parameter, or a view of it such as the transpose a
    linear layer saves): a copy, shared by the graphs kept until the weights change, so a step in
    between does not touch what their backward uses."""

    def __init__(self, weights: SlotWeights):
        self.weights = weights
        self._copies: dict[tuple, torch.Tensor] = {}
        self._version = -1
        self._storages: set[int] = set()

    def hooks(self, module: torch.nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        if self._version != self.weights.version:
            self._copies, self._version = {}, self.weights.version
        self._storages = {q.untyped_storage().data_ptr() for q in module.parameters()}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _same)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self._storages:
            return t
        key = (t.untyped_storage().data_ptr(), tuple(t.shape), t.stride(), t.storage_offset())
        kept = self._copies.get(key)
        if kept is None:
            kept = self._copies[key] = t.detach().clone()
        return kept


class StageCompute:
    """The stage's batches and steps (see the module's docstring)."""

    def __init__(self, weights: SlotWeights, schedule: StepSchedule, train_config: TrainConfig, calls: dict[str, int], what: str):
        self.weights, self.schedule, self.train_config, self.calls, self.what = weights, schedule, train_config, calls, what
        self.kept = KeptGraphs(MAX_SAVED, SAVED_S)
        self.stash = WeightStash(weights)
        self.rate = ComputeRate()
        self.steps = 0  # optimizer steps taken
        self.samples = 0  # samples whose gradients were accumulated (all steps)
        self.clips = {"global": 0, "alone": 0}  # steps clipped by every stage's norm, by this stage's alone
        self.last_norm = (-1.0, -1.0)  # the last step's gradient norm: this stage's, the other stages' (-1: not known)

    def run_batch(self, batch: list[Pending]) -> list[tuple[float | None, torch.Tensor | None]]:
        t0 = time.thread_time()  # CPU time of this thread: time others had the core is not our speed
        if batch[0].alone:
            return [self._run_kept(batch[0], t0)]
        op, sizes = batch[0].op, [p.samples for p in batch]
        x = torch.cat([p.x for p in batch]) if len(batch) > 1 else batch[0].x
        stage = self.weights.module
        if op == "forward":
            with torch.no_grad():
                y = stage(x, checked=True)
            self.rate.add(time.thread_time() - t0, 0)
            return [(None, y_i) for y_i in y.split(sizes)]
        if not stage.first:
            x = x.detach().requires_grad_(True)
        if op == "backward":
            grad = torch.cat([p.extra for p in batch]) if len(batch) > 1 else batch[0].extra
            stage(x, checked=True).backward(grad)
            losses = [None] * len(batch)
        else:  # train: each micro-batch's loss is its own mean, as if it had come alone
            targets = torch.cat([p.extra for p in batch]) if len(batch) > 1 else batch[0].extra
            logits, _ = stage(x, checked=True)
            per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none").view(targets.shape)
            means = [m.mean() for m in per_token.split(sizes)]
            torch.stack(means).sum().backward()
            losses = [m.item() for m in means]
            if not all(math.isfinite(v) for v in losses):  # nothing of it is kept
                self.weights.opt.zero_grad(set_to_none=True)
                self.schedule.acc_samples = self.schedule.acc_calls = 0
                raise FloatingPointError(f"non-finite loss {losses}")
        self.accumulated(sum(sizes), len(batch), t0)
        grads = x.grad.split(sizes) if x.grad is not None else [None] * len(batch)
        return list(zip(losses, grads))

    def _run_kept(self, p: Pending, t0: float) -> tuple[float | None, torch.Tensor | None]:
        """A forward that keeps its graph, or the backward through a kept graph."""
        stage = self.weights.module
        if p.op == "forward":
            x = p.x if stage.first else p.x.detach().requires_grad_(True)
            with self.stash.hooks(stage):
                y = stage(x, checked=True)
            self.kept.keep(p.key, time.monotonic(), (x, y, self.weights.version))
            self.rate.add(time.thread_time() - t0, 0)
            return None, y.detach()
        kept = self.kept.take(p.key)
        if kept is None:
            raise RPCError("not_found", f"no forward of micro-batch {p.key[1]!r} kept here: send the stage's input")
        x, y, version = kept
        if p.extra.shape != y.shape:
            raise RemoteProtocolError(f"{self.what} backward: grad has shape {tuple(p.extra.shape)}, the forward gave {tuple(y.shape)}")
        y.backward(p.extra)
        self.calls["stale"] += version != self.weights.version  # its forward ran on weights older than these
        self.accumulated(x.size(0), 1, t0)
        return None, x.grad

    def accumulated(self, samples: int, calls: int, t0: float) -> None:
        self.samples += samples
        self.rate.add(time.thread_time() - t0, samples)
        if self.schedule.accumulated(samples, calls):  # our part of the step's global norm, in the answers from now on
            self.schedule.norm_due(self.own_norm2())

    def own_norm2(self) -> float:
        """The squared norm of the gradient accumulated here, averaged per micro-batch as the step takes it."""
        norms = [p.grad.detach().norm() for g in self.weights.opt.param_groups for p in g["params"] if p.grad is not None]
        return (torch.stack(norms).norm().item() / max(self.schedule.acc_calls, 1)) ** 2 if norms else 0.0

    def step(self) -> None:
        """The due step (`clipped_step`): by every stage's norm with the global clip."""
        samples, others2 = self.schedule.acc_samples, self.schedule.others2 if self.schedule.clip_across else None
        stepped, norms = clipped_step(self.weights.opt, self.schedule.acc_calls, self.train_config.grad_clip, lr_at(self.steps, self.train_config), others2)
        if norms is not None:
            self.last_norm = norms  # (reported with the step)
            self.clips["alone" if others2 is None else "global"] += 1
        if stepped:
            self.weights.changed()
            self.steps += 1
        else:
            log.warning("%s: non-finite gradient norm; dropping %d samples' gradients", self.what, samples)
