"""The built-in GPT cut into pipeline stages: each stage holds only its own layers.

    plan_stages(config, S, counts=None)  which blocks (decoder layers) each of S stages holds: [start, end) per stage
    Stage(config, index, plan)           one stage's layers; the first adds the embeddings, the last
                                         the final LayerNorm, the head and the loss
    init_stage(config, index, plan, s)   a stage with exactly the parameters init_model(config, s) has
    Stage.from_gpt(gpt, index, plan)     a stage holding a copy of a whole model's layers

A stage's parameter names are the whole model's (`blocks.2.attn.c_attn.weight` in whichever stage
holds block 2), so the stages' state dicts, put together, are the model's: checkpoints and hashes
of a stage are slices of the model's. Chained, the stages compute what the model computes, bit for
bit: the same modules run the same operations in the same order.

What travels between stages is checked on arrival (`check_input`): token ids into the first stage,
the residual stream (batch, time, n_embd) into the others. A wrong shape, dtype, out-of-range
token or non-finite value raises StageInputError naming it, before any compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT, Block, GPTConfig, init_model


class StageInputError(ValueError):
    """What reached a stage is not what it computes on; the message names the problem."""


def plan_stages(config, num_stages: int, counts: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
    """[start, end) block indices for each of `num_stages` stages of a model of `config.n_layer`
    blocks (a GPTConfig, or hf_stages.CutDims: a block is a decoder layer). `counts`: blocks per stage, in
    order (they must add up to n_layer); without it, blocks are spread evenly and the stages at
    the ends, which also hold the embeddings and the head, get the fewer where it does not divide
    (what is left over goes to the middle stages, then the first, then the last: the head and the
    loss over the vocabulary cost more than the embeddings' look-up)."""
    n = config.n_layer
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"num_stages ({num_stages}) exceeds the model's {n} blocks (decoder layers): every stage holds at least one")
    if counts is None:
        base, extra = divmod(n, num_stages)
        # the extra blocks go to the middle stages first: the ends carry embeddings and head
        order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
        counts = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
    else:
        counts = list(counts)
        if len(counts) != num_stages:
            raise ValueError(f"stage block counts: {len(counts)} given for {num_stages} stages")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"stage block counts must be positive ints, got {counts}")
        if sum(counts) != n:
            raise ValueError(f"stage block counts {counts} add up to {sum(counts)}, the model has {n} blocks")
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return tuple(bounds)


class Stage(nn.Module):
    """One pipeline stage of the built-in GPT. forward(x, targets=None):
    - the first stage takes token ids (batch, time) int64, the others the residual stream
      (batch, time, n_embd) float32;
    - the last stage returns (logits, loss), loss only with targets; the others the residual
      stream they hand on."""

    def __init__(self, config: GPTConfig, index: int, plan: Sequence[tuple[int, int]]):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"Stage needs a GPTConfig, got {type(config).__name__}")
        if not 0 <= index < len(plan):
            raise ValueError(f"stage index {index} is outside 0..{len(plan) - 1}")
        self.config, self.index, self.num_stages = config, index, len(plan)
        self.first, self.last = index == 0, index == len(plan) - 1
        self.start, self.end = plan[index]
        if self.first:
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.context, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
        # keyed by the block's index in the whole model: parameter names match the model's
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(self.start, self.end)})
        if self.last:
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    @classmethod
    def from_gpt(cls, gpt: GPT, index: int, plan: Sequence[tuple[int, int]]) -> Stage:
        """A stage holding a copy of `gpt`'s parameters for its layers."""
        stage = cls(gpt.config, index, plan)
        own = stage.state_dict()
        stage.load_state_dict({k: v.detach().clone() for k, v in gpt.state_dict().items() if k in own})
        return stage

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_input(self, x: torch.Tensor, finite: bool = True) -> None:
        """Raise StageInputError unless `x` is what this stage computes on. `finite` False: the
        caller knows it holds no NaN or Inf (it was decoded with a bound on its values)."""
        check_stage_input(x, self.index, self.first, self.config, finite)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, checked: bool = False):
        """`checked`: the caller has run check_input on `x` already (a stage server, on what a
        peer sent, before queueing it)."""
        if not checked:
            self.check_input(x)
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            if targets.shape != logits.shape[:2]:
                raise StageInputError(f"stage {self.index}: targets must be {tuple(logits.shape[:2])}, got shape {tuple(targets.shape)}")
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def init_stage(config: GPTConfig, index: int, plan: Sequence[tuple[int, int]], seed: int) -> Stage:
    """A stage whose parameters are bit for bit those of init_model(config, seed) for its layers
    (the draws follow the whole model's order, so the whole model is built once to take them)."""
    return Stage.from_gpt(init_model(config, seed), index, plan)


def check_stage_input(x: torch.Tensor, index: int, first: bool, dims, finite: bool = True) -> None:
    """Raise StageInputError unless `x` is what stage `index` of a cut sized by `dims` (n_embd,
    vocab_size, context: a GPTConfig or hf_stages.CutDims) computes on: token ids into the first
    stage, the residual stream into the others."""
    if not isinstance(x, torch.Tensor):
        raise StageInputError(f"stage {index}: expected a tensor, got {type(x).__name__}")
    if first:
        if x.dtype != torch.int64:
            raise StageInputError(f"stage {index}: token ids must be int64, got {x.dtype}")
        if x.dim() != 2:
            raise StageInputError(f"stage {index}: token ids must be (batch, time), got shape {tuple(x.shape)}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= dims.vocab_size):
            raise StageInputError(f"stage {index}: token ids must be in [0, {dims.vocab_size}), got {int(x.min())}..{int(x.max())}")
    else:
        if x.dtype != torch.float32:
            raise StageInputError(f"stage {index}: activations must be float32, got {x.dtype}")
        if x.dim() != 3 or x.size(2) != dims.n_embd:
            raise StageInputError(f"stage {index}: activations must be (batch, time, {dims.n_embd}), got shape {tuple(x.shape)}")
        if finite and not bool(torch.isfinite(x).all()):
            raise StageInputError(f"stage {index}: activations hold NaN or Inf")
    if x.size(0) < 1 or x.size(1) < 1:
        raise StageInputError(f"stage {index}: empty batch, shape {tuple(x.shape)}")
    if x.size(1) > dims.context:
        raise StageInputError(f"stage {index}: sequence length {x.size(1)} exceeds the model's context {dims.context}")
