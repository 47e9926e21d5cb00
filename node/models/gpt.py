"""A small GPT-style decoder (nanoGPT-shaped): byte-level, pre-LayerNorm blocks, causal attention.

    GPTConfig       frozen, validated hyper-parameters; to_dict()/from_dict() for checkpoints/wire
    PRESETS         named configs: "tiny" trains in minutes on 2 CPU cores, "small" is ~0.87M params
    GPT             forward(idx, targets=None) -> (logits, loss)
    init_model      GPT with bitwise-identical parameters for the same (config, seed)

"Same seed, same bits" holds on one kind of CPU only: torch's normal sampler is vectorized
differently per instruction set (AVX2 and plain scalar kernels give other values). A
swarm must therefore hand the initial state to its members, not have each one re-create it.

The output head is NOT tied to the token embedding: tied weights share storage, which
safetensors refuses to save and which makes `state_dict()` list one tensor twice. At vocab 256
untying costs 256·n_embd parameters, nothing worth those traps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. Every replica in a swarm must use the same one (it is part of the state)."""

    vocab_size: int = 256  # tokens in the vocabulary; 256 = one token per byte
    context: int = 64  # longest sequence the model sees, in tokens (bytes)
    n_layer: int = 4  # transformer blocks
    n_embd: int = 128  # width of the residual stream, in channels
    n_head: int = 4  # attention heads per block; must divide n_embd
    dropout: float = 0.0  # probability of zeroing an activation while training, in [0, 1)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in (int, "int"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"GPTConfig.{f.name} must be a positive int, got {v!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Inverse of to_dict. Unknown keys are refused: a typo must not silently give the default."""
        if not isinstance(d, dict):
            raise ValueError(f"GPTConfig.from_dict needs a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s): {', '.join(map(str, unknown))}")
        return cls(**d)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_embd=64, n_head=4, context=64),  # ~0.14M params
    "small": GPTConfig(n_layer=4, n_embd=128, n_head=4, context=64),  # ~0.87M params
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@torch.no_grad()
def init_gpt_weights(model: nn.Module, n_layer: int, seed: int | None) -> None:
    """GPT-2 init: N(0, 0.02) everywhere, zero biases, and the projections that write into the
    residual stream scaled by 1/sqrt(2·n_layer) so its variance does not grow with depth.
    named_modules() has a fixed order, so one seed gives the same draws every time; without a
    seed the global RNG is used."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    resid_std = 0.02 / math.sqrt(2 * n_layer)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, resid_std if name.endswith("c_proj") else 0.02, generator=gen)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02, generator=gen)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class GPT(nn.Module):
    """Token + position embeddings, n_layer blocks, final LayerNorm, linear head to vocab logits.

    `seed` makes the initial parameters a pure function of (config, seed), independent of the
    global RNG; without it the global RNG is used, as for any torch module.
    """

    def __init__(self, config: GPTConfig, seed: int | None = None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.context, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        init_gpt_weights(self, config.n_layer, seed)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) int64 token ids, T ≤ context. Returns logits (B, T, vocab) and, when
        targets (B, T) are given, the mean cross-entropy of predicting them (nats per token)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        T = idx.size(1)
        if T > self.config.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.config.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def init_model(config: GPTConfig, seed: int) -> GPT:
    """A freshly initialized model; the same (config, seed) gives bitwise-identical parameters."""
    return GPT(config, seed=seed)
