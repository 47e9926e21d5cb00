"""A mixture-of-experts variant of the built-in GPT: the groundwork of expert-parallel training.

Every block's feed-forward layer becomes a MoE layer: E experts (each an MLP of the dense
model's shape), a router that sends each token to its top-k experts, a capacity limit per expert
and the load-balancing auxiliary loss of Switch Transformer (Fedus et al. 2021).

The layer is cut in three so that the experts may live elsewhere (on expert hosts) while the
routing and the combination stay with the caller:

    route(x, alive)      which tokens go to which expert, with which gate weight (a `Routing`);
                         only the experts in `alive` take tokens, their gates renormalised
    experts' outputs     one call per expert on all of its tokens: `expert(x[routing.tokens[e]])`
    combine(outs, r)     the gate-weighted sum back in token order

`MoELayer.forward` runs the three with local experts; a remote caller swaps the middle step.

    MoEConfig       E, k, capacity factor, auxiliary loss weight
    MoEGPT          forward(idx, targets=None) -> (logits, loss, aux_loss)
    init_moe_model  MoEGPT with bitwise-identical parameters for the same (config, seed)
    expert_name     "layer1.expert3": how the swarm names an expert (parse_expert_name: back)
    ExpertLayout    what the roles need to know of any MoE model's experts (a preset's, a Mixtral's)
    ExpertShard     the experts of one shard (what an expert host holds), by swarm name
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import MLP, PRESETS, CausalSelfAttention, GPTConfig, init_gpt_weights


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 4  # E: experts per MoE layer
    top_k: int = 2  # experts each token is sent to
    capacity_factor: float = 1.25  # an expert takes at most ceil(factor x tokens x k / E) tokens of a batch
    aux_loss_weight: float = 0.01  # weight of the load-balancing loss added to the training loss

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"MoEConfig.num_experts must be a positive int, got {self.num_experts!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig.top_k must be an int in [1, num_experts={self.num_experts}], got {self.top_k!r}")
        if not isinstance(self.capacity_factor, (int, float)) or not 0 < self.capacity_factor < math.inf:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0 and finite, got {self.capacity_factor!r}")
        if not isinstance(self.aux_loss_weight, (int, float)) or not 0 <= self.aux_loss_weight < math.inf:
            raise ValueError(f"MoEConfig.aux_loss_weight must be >= 0 and finite, got {self.aux_loss_weight!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def capacity(self, tokens: int, live: int | None = None) -> int:
        """The most tokens one expert takes from a batch of `tokens` tokens, when `live` experts
        (default: all) take tokens: the same share of the batch's token-expert pairs each."""
        live = self.num_experts if live is None else live
        return max(1, math.ceil(self.capacity_factor * tokens * min(self.top_k, live) / max(1, live)))


def expert_name(layer: int, expert: int) -> str:
    return f"layer{layer}.expert{expert}"


def parse_expert_name(name: str, layers: int, experts: int) -> tuple[int, int]:
    """(layer, expert) of a swarm name ("layer1.expert3"); KeyError for a name not of a model of
    `layers` layers x `experts` experts."""
    layer, _, expert = name.partition(".")
    try:
        if not (layer.startswith("layer") and expert.startswith("expert")):
            raise ValueError
        li, ei = int(layer.removeprefix("layer")), int(expert.removeprefix("expert"))
        if not (0 <= li < layers and 0 <= ei < experts) or name != expert_name(li, ei):
            raise ValueError
        return li, ei
    except ValueError:
        raise KeyError(f"no expert {name!r} in a model of {layers} layers x {experts} experts") from None


@dataclass(frozen=True)
class ExpertLayout:
    """A MoE model's experts as the roles see them: `layers` MoE layers of `experts` experts each,
    every token sent to `top_k` of them, tokens of width `width`."""

    layers: int
    experts: int
    top_k: int
    width: int

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "top_k", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExpertLayout.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of_preset(cls, config: GPTConfig, moe: MoEConfig) -> ExpertLayout:
        return cls(config.n_layer, moe.num_experts, moe.top_k, config.n_embd)

    def names(self) -> frozenset[str]:
        return frozenset(expert_name(li, e) for li in range(self.layers) for e in range(self.experts))

    def shard(self, shard: int, shards: int) -> tuple[str, ...]:
        """Expert e of every layer with e mod `shards` == `shard`."""
        return tuple(expert_name(li, e) for li in range(self.layers) for e in range(shard, self.experts, shards))


@dataclass
class Routing:
    """Where a batch of N tokens goes. For each expert e: `tokens[e]` (token indices, ascending)
    and `weights[e]` (their gates, differentiable through the router). `aux_loss` is the
    load-balancing loss; `dropped` counts token-expert pairs over capacity."""

    tokens: list[torch.Tensor]
    weights: list[torch.Tensor]
    aux_loss: torch.Tensor
    dropped: int
    num_tokens: int


class Router(nn.Module):
    def __init__(self, n_embd: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(n_embd, moe.num_experts, bias=False)

    def forward(self, x: torch.Tensor, alive: Sequence[bool] | None = None) -> Routing:
        """x: (N, C) tokens. `alive`: per expert, whether it may take tokens (a dead or
        misbehaving expert host's experts do not); None: all. Each token goes to its top-k live
        experts (fewer if fewer live), gates softmaxed over the live experts and renormalised
        over the chosen ones; an expert past its capacity drops the tokens that chose it last."""
        moe, n = self.moe, x.size(0)
        logits = self.gate(x)
        if alive is not None:
            if len(alive) != moe.num_experts:
                raise ValueError(f"alive has {len(alive)} entries for {moe.num_experts} experts")
            if not any(alive):
                raise ValueError("no expert is alive")
            mask = torch.tensor([not a for a in alive], device=x.device)
            logits = logits.masked_fill(mask, float("-inf"))
        probs = F.softmax(logits, dim=-1)  # (N, E); dead experts 0
        live = moe.num_experts if alive is None else sum(map(bool, alive))
        k = min(moe.top_k, live)
        top_p, top_e = probs.topk(k, dim=-1)  # (N, k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        cap = moe.capacity(n, live)  # the live experts share the batch: a dead one's tokens are not dropped for it
        tokens, weights, dropped = [], [], 0
        for e in range(moe.num_experts):
            hit = top_e == e  # (N, k): at most one True per row
            idx = hit.any(dim=-1).nonzero(as_tuple=True)[0]
            if idx.numel() > cap:  # first come, first served, in token order
                dropped += idx.numel() - cap
                idx = idx[:cap]
            tokens.append(idx)
            weights.append((gates * hit).sum(dim=-1)[idx])
        # Switch Transformer's balance loss over the experts that could take tokens: E' x sum of
        # (share of token-expert assignments) x (mean router probability); 1 when uniform
        share = torch.stack([(top_e == e).any(dim=-1).float().mean() for e in range(moe.num_experts)]) / k
        aux = live * (share.detach() * probs.mean(dim=0)).sum()
        return Routing(tokens, weights, aux, dropped, n)


def combine(outputs: Sequence[torch.Tensor | None], routing: Routing, like: torch.Tensor) -> torch.Tensor:
    """The gate-weighted sum of the experts' outputs, back in token order: (N, C) like `like`.
    `outputs[e]` answers `routing.tokens[e]` (None: the expert was skipped, its tokens get the
    other experts' share only)."""
    y = torch.zeros_like(like)
    for e, out in enumerate(outputs):
        idx = routing.tokens[e]
        if out is None or idx.numel() == 0:
            continue
        y = y.index_add(0, idx, out * routing.weights[e].unsqueeze(-1).to(out.dtype))
    return y


class MoELayer(nn.Module):
    """Router + E local experts. forward(x) -> (y, aux_loss); x and y (B, T, C)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.router = Router(cfg.n_embd, moe)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor, alive: Sequence[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        routing = self.router(flat, alive)
        outs = [expert(flat[idx]) if idx.numel() else None for expert, idx in zip(self.experts, routing.tokens)]
        return combine(outs, routing, flat).view(B, T, C), routing.aux_loss


class MoEBlock(nn.Module):
    """A pre-norm block whose feed-forward layer is a MoE layer."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.moe = nn.LayerNorm(cfg.n_embd), MoELayer(cfg, moe)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux


class MoEGPT(nn.Module):
    """The built-in GPT with a MoE feed-forward layer in every block."""

    def __init__(self, config: GPTConfig, moe: MoEConfig, seed: int | None = None):
        super().__init__()
        if not isinstance(config, GPTConfig) or not isinstance(moe, MoEConfig):
            raise TypeError("MoEGPT needs a GPTConfig and a MoEConfig")
        self.config, self.moe_config = config, moe
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.context, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(MoEBlock(config, moe) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        init_gpt_weights(self, config.n_layer, seed)  # as GPT's

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def expert(self, name: str) -> MLP:
        """The expert a swarm name ("layer1.expert3") stands for; KeyError for a name it lacks."""
        li, ei = parse_expert_name(name, self.config.n_layer, self.moe_config.num_experts)
        return self.blocks[li].moe.experts[ei]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """idx: (B, T) token ids. Returns logits, the cross-entropy when `targets` are given
        (with the load-balancing loss added, times its weight), and the mean balance loss."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        T = idx.size(1)
        if T > self.config.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.config.context}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        aux = aux / len(self.blocks)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1)) + self.moe_config.aux_loss_weight * aux
        return logits, loss, aux


class ExpertShard(nn.Module):
    """The experts of one shard, by swarm name, with the one-process model's initial values."""

    def __init__(self, model: MoEGPT, names: tuple[str, ...]):
        super().__init__()
        self.names = names
        self.experts = nn.ModuleDict({n.replace(".", "_"): model.expert(n) for n in names})

    def __getitem__(self, name: str) -> nn.Module:
        return self.experts[name.replace(".", "_")]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


MOE_PRESETS: dict[str, tuple[GPTConfig, MoEConfig]] = {
    "tiny-moe": (PRESETS["tiny"], MoEConfig(num_experts=4, top_k=2)),  # 2 layers x 4 experts of width 64
    "small-moe": (PRESETS["small"], MoEConfig(num_experts=8, top_k=2)),  # 4 layers x 8 experts of width 128
}


def init_moe_model(config: GPTConfig, moe: MoEConfig, seed: int) -> MoEGPT:
    """A freshly initialised MoE model; the same (config, moe, seed) gives bitwise-identical parameters."""
    return MoEGPT(config, moe, seed=seed)
