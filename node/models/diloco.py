"""DiLoCo building blocks in pure torch (no networking), and a one-process simulation of a swarm.

    TrainConfig      inner/outer optimizer settings, each field with its unit
    lr_at            the inner learning rate at an inner step: linear warmup, then cosine decay
    InnerTrainer     AdamW on the local model: .step() -> loss
    OuterOptimizer   θ_outer and Nesterov momentum: pseudo_gradient(local), apply(averaged)
    state_hash       short hex of tensors' exact bits; replicas compare it after every outer step
    simulate_diloco  N replicas in one process, pseudo-gradients through a real codec + error feedback
                     (optionally through the all-reduce's arithmetic, sim_allreduce.py)
    train_sync       plain single-stream AdamW training, to make a shared warm-start checkpoint

One outer round, as a replica runs it (the averaging is the network's job, elsewhere):

    for _ in range(cfg.inner_steps): inner.step()
    pg = outer.pseudo_gradient(model.parameters())        # θ_outer − θ_local
    avg = <average of every replica's pg>                  # compressed, error feedback at sender
    copy_into(model.parameters(), outer.apply(avg))        # all replicas now hold the same θ_outer
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from protocol import make_codec

from .adamw import FusedAdamW, fused_supported
from .data import EVAL_SEED, Batches, Corpus, evaluate
from .gpt import GPT, GPTConfig, init_model
from .sim_allreduce import SenderMean, SimAllReduce
from ..runconfig import RunConfig


# (test, what it means) for TrainConfig's float fields; NaN fails every test
_POSITIVE = (lambda v: 0 < v < math.inf, "> 0 and finite")
_NON_NEGATIVE = (lambda v: 0 <= v < math.inf, "≥ 0 and finite")
_BELOW_ONE = (lambda v: 0 <= v < 1, "in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    """How a replica trains. Inner = local AdamW steps; outer = the averaged Nesterov step.

    The fields a run sets (batch_size, inner_lr, warmup_steps, total_steps, inner_steps,
    outer_lr, outer_momentum, seed) take their defaults from `RunConfig`, and
    `RunConfig.train_config()` derives a replica's TrainConfig from its run."""

    batch_size: int = RunConfig.batch_size  # sequences per inner step (per replica)
    inner_lr: float = RunConfig.inner_lr  # peak AdamW learning rate, reached after warmup
    min_lr_ratio: float = 0.1  # the cosine decays the inner lr to inner_lr·min_lr_ratio, then holds
    weight_decay: float = 0.1  # AdamW decoupled weight decay, on matrices only (not biases/norms)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    warmup_steps: int = RunConfig.warmup_steps  # inner steps of linear lr warmup from ~0 to inner_lr
    total_steps: int = RunConfig.total_steps  # inner steps over which the lr decays (cosine); later steps use the floor
    inner_steps: int = RunConfig.inner_steps  # H: inner steps between two outer steps
    outer_lr: float = RunConfig.outer_lr  # outer SGD learning rate (an issue reports that 1.5 and above diverged here)
    outer_momentum: float = RunConfig.outer_momentum  # Nesterov momentum of the outer SGD
    grad_clip: float = 1.0  # max global L2 norm of inner gradients; 0 disables clipping
    seed: int = RunConfig.seed  # model init and data sampling seed

    def __post_init__(self) -> None:
        ints = {"batch_size": 1, "warmup_steps": 0, "total_steps": 1, "inner_steps": 1, "seed": 0}
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"TrainConfig.{name} must be an int ≥ {lo}, got {v!r}")
        numbers = {
            "inner_lr": _POSITIVE, "outer_lr": _POSITIVE, "weight_decay": _NON_NEGATIVE,
            "grad_clip": _NON_NEGATIVE, "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
            "beta1": _BELOW_ONE, "beta2": _BELOW_ONE, "outer_momentum": _BELOW_ONE,
        }  # fmt: skip
        for name, (ok, what) in numbers.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ValueError(f"TrainConfig.{name} must be a number {what}, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        if not isinstance(d, dict):
            raise ValueError(f"TrainConfig.from_dict needs a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s): {', '.join(map(str, unknown))}")
        return cls(**d)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Inner lr for 0-based inner step `step`: linear warmup, cosine decay to the floor, then flat."""
    if step < cfg.warmup_steps:
        return cfg.inner_lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    floor = cfg.inner_lr * cfg.min_lr_ratio
    return floor + (cfg.inner_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw(params, cfg: TrainConfig) -> FusedAdamW | torch.optim.AdamW:
    """The run's AdamW over `params`: decay on matrices (weights, embeddings) only, since
    decaying biases and LayerNorm gains toward 0 hurts; the schedule's first learning rate."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if fused_supported(params):  # one kernel per parameter group, not ~10 per tensor (a stage's step is on the pipeline's critical path)
        return FusedAdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2))
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2))  # a device (or torch) without the fused kernel


class InnerTrainer:
    """AdamW on the local replica. Its state stays local across outer steps (DiLoCo does not
    average it); `state_dict()` carries it into a checkpoint of this node."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, batches: Batches):
        self.model, self.cfg, self.batches = model, cfg, batches
        self.opt = adamw(model.parameters(), cfg)
        self.step_count = 0  # inner steps taken, drives the lr schedule

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.cfg)

    def step(self) -> float:
        """One inner step on the next batch; returns its loss (before the update)."""
        device = next(self.model.parameters()).device
        x, y = self.batches.next()
        for g in self.opt.param_groups:
            g["lr"] = self.lr
        self.model.train()
        _, loss = self.model(x.to(device), y.to(device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.opt.param_groups for p in g["params"]]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]))
        if not torch.isfinite(norm):  # refuse before the weights are touched; the caller decides
            raise FloatingPointError(f"non-finite gradient norm at inner step {self.step_count} (loss {loss.item()})")
        self.opt.step()
        self.step_count += 1
        return loss.item()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.opt.state_dict(), "step": self.step_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fused = [g.get("fused") for g in self.opt.param_groups]
        self.opt.load_state_dict(state["optimizer"])
        for g, f in zip(self.opt.param_groups, fused):  # the kernel this device has, not the saver's
            g["fused"] = f
        self.step_count = int(state["step"])


class OuterOptimizer:
    """θ_outer (fp32 copies on the CPU) and the Nesterov momentum buffers.

    The step is the same math as torch.optim.SGD(momentum=μ, nesterov=True, dampening=0):
        b ← μ·b + g;  θ ← θ − lr·(g + μ·b)
    but written as separate multiply and add kernels. torch's SGD uses fused multiply-add where
    the CPU has FMA (its result changes between AVX2 and scalar kernels, in about half
    the elements), so replicas on different CPUs would drift apart. Unfused fp32 mul and add are
    exactly rounded by IEEE 754 everywhere: the same inputs give the same bits on any machine.
    The copies live on the CPU whatever device the model is on, for the same reason.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float, nesterov: bool = True):
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got lr={lr}, momentum={momentum}")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), nesterov
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.step_count = 0  # outer steps applied

    def _check(self, tensors: Sequence[torch.Tensor], what: str, like: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        tensors, like = list(tensors), self.params if like is None else like
        if len(tensors) != len(like):
            raise ValueError(f"{what}: expected {len(like)} tensors, got {len(tensors)}")
        for i, (t, p) in enumerate(zip(tensors, like)):
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{what}: tensor {i} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        return tensors

    def pseudo_gradient(self, local_params: Iterable[torch.Tensor], part: range | None = None) -> list[torch.Tensor]:
        """θ_outer − θ_local per tensor (fp32, CPU): how far the local steps moved, sign as a gradient.
        `part`: only those tensors (a fragment; `local_params` are then the fragment's)."""
        outer = self.params if part is None else self.params[part.start : part.stop]
        local = self._check([p.detach() for p in local_params], "pseudo_gradient", outer)
        return [o - p.to("cpu", torch.float32) for o, p in zip(outer, local)]

    @torch.no_grad()
    def apply(self, avg_pseudo_grad: Sequence[torch.Tensor], part: range | None = None) -> list[torch.Tensor]:
        """One Nesterov SGD step with the averaged pseudo-gradient; returns θ_outer (these very
        tensors: copy them into the model, do not modify them). Non-finite input is refused
        before any state changes, so a bad round cannot poison the replica.

        `part`: the step of one fragment (the tensors in that range; `avg_pseudo_grad` is theirs,
        and so is what it returns). It is the same math per tensor, so stepping every fragment
        once gives the bits of one whole step; `step_count` counts whole steps, so it is left to
        the caller (`load_state_dict`) there."""
        params, buffers = (self.params, self.buffers) if part is None else (self.params[part.start : part.stop], self.buffers[part.start : part.stop])
        grads = self._check(avg_pseudo_grad, "apply", params)
        grads = [g.to("cpu", torch.float32) for g in grads]
        for i, g in enumerate(grads):
            if not torch.isfinite(g).all():
                raise ValueError(f"apply: averaged pseudo-gradient {i} has NaN or Inf values")
        mu = self.momentum
        for p, b, g in zip(params, buffers, grads):
            b.mul_(mu).add_(g)  # add with alpha=1 is exact-rounded, fused or not
            update = g + b * mu if self.nesterov else b
            p.sub_(update * self.lr)
        if part is None:
            self.step_count += 1
        return params

    def state_dict(self) -> dict[str, Any]:
        """Copies of θ_outer, momentum and step: everything a joiner needs to continue bit-exactly."""
        return {
            "params": [p.clone() for p in self.params],
            "momentum": [b.clone() for b in self.buffers],
            "step": self.step_count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("params", "momentum", "step"):
            if key not in state:
                raise ValueError(f"outer optimizer state is missing {key!r}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"outer optimizer step must be an int ≥ 0, got {step!r}")
        params = self._check(state["params"], "load_state_dict params")
        buffers = self._check(state["momentum"], "load_state_dict momentum")
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self.buffers = [b.detach().to("cpu", torch.float32, copy=True) for b in buffers]
        self.step_count = step


@torch.no_grad()
def copy_into(params: Iterable[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Overwrite model parameters in place (keeps the inner optimizer's references valid)."""
    params = list(params)
    if len(params) != len(values):
        raise ValueError(f"copy_into: {len(params)} parameters but {len(values)} values")
    for p, v in zip(params, values):
        p.copy_(v)


def state_hash(tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> str:
    """First 16 hex chars of sha256 over each tensor's dtype, shape and raw bytes, in order
    (a mapping: sorted by key, keys included). Equal hashes mean bitwise-equal tensors."""
    items = sorted(tensors.items()) if isinstance(tensors, Mapping) else enumerate(tensors)
    h = hashlib.sha256()
    for key, t in items:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _load_start(model_config: GPTConfig, seed: int, warm_start_state: Mapping[str, torch.Tensor] | None) -> GPT:
    model = init_model(model_config, seed)
    if warm_start_state is not None:
        model.load_state_dict(warm_start_state)
    return model


def simulate_diloco(
    model_config: GPTConfig,
    train_config: TrainConfig,
    corpus: Corpus,
    num_replicas: int,
    outer_steps: int,
    codec: str = "int8",
    block_size: int = 1024,
    codec_params: dict[str, Any] | None = None,
    warm_start_state: Mapping[str, torch.Tensor] | None = None,
    eval_every: int = 1,
    eval_batches: int = 8,
    eval_seed: int = EVAL_SEED,
    allreduce: bool = False,
) -> dict[str, Any]:
    """N DiLoCo replicas in this process, no network. Each replica trains on its own shard, sends
    its pseudo-gradient through ErrorFeedback(codec) as a real sender would, the decoded tensors
    are averaged, and every replica applies the same outer step with its own OuterOptimizer.
    With `allreduce`, the averaging is the averager's all-reduce instead (sim_allreduce.py: each
    owner's slice exact from itself, and sent back through the same codec with the owner's error
    feedback, as a sparse run's gather is); bytes are then what each replica sends in it.

    Returns {"history": [{"outer_step", "inner_step", "val_loss", "train_loss"}...],
    "bytes_sent": [per replica], "state_hash": θ_outer hash, "state": final model state_dict,
    "seconds": wall time}. Raises RuntimeError if replicas ever disagree bitwise (a bug).
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    if isinstance(outer_steps, bool) or not isinstance(outer_steps, int) or outer_steps < 0:
        raise ValueError(f"outer_steps must be an int ≥ 0, got {outer_steps!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every must be a positive int, got {eval_every!r}")
    t0 = time.perf_counter()
    cfg, ctx = train_config, model_config.context
    kwargs = {"block_size": block_size} if codec == "int8" else {}
    kwargs.update(codec_params or {})

    base = _load_start(model_config, cfg.seed, warm_start_state)
    models = [copy.deepcopy(base) for _ in range(num_replicas)]
    inners = [
        InnerTrainer(m, cfg, Batches(corpus.train, i, num_replicas, cfg.batch_size, ctx, cfg.seed + i))
        for i, m in enumerate(models)
    ]
    outers = [OuterOptimizer(m.parameters(), cfg.outer_lr, cfg.outer_momentum) for m in models]
    if allreduce:
        numel = sum(p.numel() for p in base.parameters())
        averager = SimAllReduce(num_replicas, numel, make_codec(codec, **kwargs), make_codec(codec, **kwargs))
    else:
        averager = SenderMean(num_replicas, [name for name, _ in base.named_parameters()], make_codec(codec, **kwargs))

    def val_loss() -> float:
        return evaluate(models[0], corpus.val, cfg.batch_size, ctx, eval_batches, eval_seed)

    history = [{"outer_step": 0, "inner_step": 0, "val_loss": val_loss(), "train_loss": None}]
    for outer_step in range(1, outer_steps + 1):
        train_losses, pgs = [], []
        for r in range(num_replicas):
            train_losses += [inners[r].step() for _ in range(cfg.inner_steps)]
            pgs.append(outers[r].pseudo_gradient(models[r].parameters()))
        avg = averager.tensors(pgs)  # in the swarm every replica receives these same bits
        hashes = set()
        for m, outer in zip(models, outers):
            copy_into(m.parameters(), outer.apply(avg))
            hashes.add(state_hash(outer.params))
        if len(hashes) != 1:
            raise RuntimeError(f"replicas disagree after outer step {outer_step}: {sorted(hashes)}")
        if outer_step % eval_every == 0 or outer_step == outer_steps:
            history.append({
                "outer_step": outer_step,
                "inner_step": outer_step * cfg.inner_steps,
                "val_loss": val_loss(),
                "train_loss": sum(train_losses) / len(train_losses),
            })  # fmt: skip
    return {
        "history": history,
        "bytes_sent": list(averager.bytes_sent),
        "state_hash": state_hash(outers[0].params),
        "state": {k: v.clone() for k, v in models[0].state_dict().items()},
        "seconds": time.perf_counter() - t0,
    }


def train_sync(
    model_config: GPTConfig,
    train_config: TrainConfig,
    corpus: Corpus,
    steps: int,
    warm_start_state: Mapping[str, torch.Tensor] | None = None,
    eval_every: int = 50,
    eval_batches: int = 8,
    eval_seed: int = EVAL_SEED,
) -> dict[str, Any]:
    """Plain AdamW on one stream over the whole train split (no outer steps): the baseline, and
    the way to make a warm-start checkpoint every replica then loads.

    Returns {"history": [{"inner_step", "val_loss", "train_loss"}...], "state": model state_dict,
    "state_hash": its hash, "seconds": wall time}.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int ≥ 0, got {steps!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every must be a positive int, got {eval_every!r}")
    t0 = time.perf_counter()
    cfg, ctx = train_config, model_config.context
    model = _load_start(model_config, cfg.seed, warm_start_state)
    inner = InnerTrainer(model, cfg, Batches(corpus.train, 0, 1, cfg.batch_size, ctx, cfg.seed))

    def val_loss() -> float:
        return evaluate(model, corpus.val, cfg.batch_size, ctx, eval_batches, eval_seed)

    history = [{"inner_step": 0, "val_loss": val_loss(), "train_loss": None}]
    losses: list[float] = []
    for step in range(1, steps + 1):
        losses.append(inner.step())
        if step % eval_every == 0 or step == steps:
            history.append({"inner_step": step, "val_loss": val_loss(), "train_loss": sum(losses) / len(losses)})
            losses = []
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"history": history, "state": state, "state_hash": state_hash(state), "seconds": time.perf_counter() - t0}
