"""A Hugging Face Mixtral cut for expert parallelism: its experts on expert hosts, the rest (the
dense parts: embeddings, attention, norms, routers, head) with the trainers.

transformers 5 keeps a Mixtral layer's experts fused in memory, one tensor per kind for the whole
layer (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)). The swarm
serves them one by one: expert e of layer l is `layer{l}.expert{e}` (moe.expert_name), and the
parameters of a shard are named `layer{l}.expert{e}.gate_up_proj` / `.down_proj`, slices of
those tensors, so that the union of the shards puts them back (`fuse_experts`).

    mixtral_layout(config)    the experts' layout (layers, experts per layer, top-k, width)
    MixtralExpert             one expert: Mixtral's gated MLP, act(x W_g) * (x W_u) W_d
    MixtralExpertShard        the experts of one shard, by swarm name, sliced from a model
    split_experts(model)      a CausalLM's MoE blocks replaced by `SwarmMoe` (router kept, experts gone)
    SwarmMoe                  Mixtral's sparse MoE block whose experts are called through `call`
    mixtral_routing           Mixtral's routing as a moe.Routing: softmax, top-k, renormalised
    local_experts(shards)     a `call` running experts held here (tests, a one-process check)
    forward_loss              the trainer's forward: (logits, cross-entropy, training loss)
    fuse_experts              the shards' tensors back into the model's fused ones

Routing is Mixtral's own: softmax over the router's logits in float32, the top
`num_experts_per_tok`, their probabilities renormalised to sum to one, no capacity limit (a
Mixtral expert takes every token routed to it). An expert whose host cannot be called is masked
before the softmax (it takes no tokens; the others share its gate). The router's load-balancing
loss is Mixtral's (`load_balancing_loss_func`, over every layer's logits), added times
`router_aux_loss_coef` when the config says `output_router_logits`, as MixtralForCausalLM adds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf import CausalLM, ModelDirError
from .moe import ExpertLayout, Routing, combine, expert_name, parse_expert_name

RouteFn = Callable[[torch.Tensor, "Sequence[bool] | None"], Routing]  # (flat tokens, alive) -> routing
ExpertsCall = Callable[[torch.Tensor, RouteFn, int], torch.Tensor]  # (flat tokens, route, layer) -> the experts' mixed output


def mixtral_layout(config: Any) -> ExpertLayout:
    """The experts' layout of a transformers MixtralConfig; ModelDirError when it has none."""
    try:
        return ExpertLayout(int(config.num_hidden_layers), int(config.num_local_experts), int(config.num_experts_per_tok), int(config.hidden_size))
    except (AttributeError, TypeError, ValueError) as e:
        raise ModelDirError(f"config.json does not describe a mixture of experts: {e}") from None


class MixtralExpert(nn.Module):
    """One Mixtral expert: (n, H) tokens -> (n, H), as MixtralExperts computes expert e."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_up_proj = nn.Parameter(gate_up_proj)  # (2I, H)
        self.down_proj = nn.Parameter(down_proj)  # (H, I)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


def _blocks(model: CausalLM) -> list[nn.Module]:
    layers = getattr(getattr(model.hf, "model", None), "layers", None)
    if layers is None:
        raise ModelDirError(f"{type(model.hf).__name__} has no decoder layers (model.layers): not Mixtral's layout")
    return [layer.mlp for layer in layers]


class MixtralExpertShard(nn.Module):
    """The experts `names` of a Mixtral model, copied out of its fused tensors. Its children are
    the layers ("layer0", each a ModuleDict of "expert<e>"), so parameters are named
    `layer{l}.expert{e}.gate_up_proj` / `.down_proj`; `shard[name]` is one expert."""

    def __init__(self, model: CausalLM, names: Iterable[str]):
        super().__init__()
        self.names = tuple(names)
        blocks, act = _blocks(model), model.hf.config.hidden_act
        for name in self.names:
            li, e = parse_expert_name(name, len(blocks), int(model.hf.config.num_local_experts))
            experts = blocks[li].experts
            if f"layer{li}" not in self._modules:
                self.add_module(f"layer{li}", nn.ModuleDict())
            self._modules[f"layer{li}"][f"expert{e}"] = MixtralExpert(experts.gate_up_proj.detach()[e].clone(), experts.down_proj.detach()[e].clone(), act)

    def __getitem__(self, name: str) -> MixtralExpert:
        layer, _, expert = name.partition(".")
        return self._modules[layer][expert]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def mixtral_routing(logits: torch.Tensor, top_k: int, alive: Sequence[bool] | None = None) -> Routing:
    """Mixtral's routing of (N, E) router logits as a moe.Routing (see the module's docstring);
    experts not `alive` take no tokens. Its aux_loss is 0: Mixtral's is over all layers at once."""
    n, num = logits.shape
    if alive is not None and (len(alive) != num or not any(alive)):
        raise ValueError(f"alive must name {num} experts, at least one alive; got {list(alive)}")
    if alive is not None and not all(alive):
        logits = logits.masked_fill(torch.tensor([not a for a in alive], device=logits.device), float("-inf"))
    probs = F.softmax(logits.float(), dim=-1)
    k = min(top_k, num if alive is None else sum(map(bool, alive)))
    top_p, top_e = torch.topk(probs, k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    tokens, weights = [], []
    for e in range(num):
        hit = top_e == e  # (N, k): at most one True per row
        idx = hit.any(dim=-1).nonzero(as_tuple=True)[0]
        tokens.append(idx)
        weights.append((top_p * hit).sum(dim=-1)[idx])
    return Routing(tokens, weights, logits.new_zeros(()), 0, n)


class SwarmMoe(nn.Module):
    """MixtralSparseMoeBlock with its experts elsewhere: the router (`gate`, the block's own
    module, so parameter names stay transformers') here, the experts through `call`, which the
    trainer sets before each forward."""

    def __init__(self, block: nn.Module, layer: int):
        super().__init__()
        self.gate, self.layer = block.gate, layer
        self.top_k, self.jitter_noise = int(block.top_k), float(block.jitter_noise)
        self.call: ExpertsCall | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.call is None:
            raise RuntimeError("SwarmMoe.call is not set: the experts of this model live elsewhere")
        B, T, H = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # as Mixtral's block (out of place: autograd keeps the input)
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, H)
        logits, _, _ = self.gate(flat)  # (through the router module: transformers records its logits for the aux loss)
        y = self.call(flat, lambda x, alive: mixtral_routing(logits, self.top_k, alive), self.layer)
        return y.reshape(B, T, H)


def split_experts(model: CausalLM) -> list[SwarmMoe]:
    """Replace every layer's sparse MoE block of `model` by a SwarmMoe (its experts dropped: they
    live on the hosts); the new blocks, by layer. ModelDirError for a model of another layout."""
    blocks = _blocks(model)
    out = []
    for li, block in enumerate(blocks):
        if not hasattr(block, "gate") or not hasattr(getattr(block, "experts", None), "gate_up_proj"):
            raise ModelDirError(f"layer {li} of {type(model.hf).__name__} has no Mixtral sparse MoE block (mlp.gate, mlp.experts.gate_up_proj)")
        out.append(SwarmMoe(block, li))
        model.hf.model.layers[li].mlp = out[-1]
    return out


def local_experts(shards: Iterable[MixtralExpertShard]) -> ExpertsCall:
    """A `call` that runs the experts of `shards`, held here (every expert of the model)."""
    experts = {name: shard[name] for shard in shards for name in shard.names}

    def call(flat: torch.Tensor, route: RouteFn, layer: int) -> torch.Tensor:
        routing = route(flat, None)
        outs = [experts[expert_name(layer, e)](flat[idx]) if idx.numel() else None for e, idx in enumerate(routing.tokens)]
        return combine(outs, routing, flat)

    return call


def forward_loss(model: CausalLM, call: ExpertsCall, x: torch.Tensor, y: torch.Tensor | None = None):
    """The forward of a model cut by split_experts, its experts through `call`: (logits,
    cross-entropy of the already-shifted targets `y` or None, the training loss: the cross-entropy
    plus Mixtral's router loss times router_aux_loss_coef when the config asks for it)."""
    config = model.hf.config
    blocks = [m for m in model.modules() if isinstance(m, SwarmMoe)]
    aux_on = bool(getattr(config, "output_router_logits", False))
    for block in blocks:
        block.call = call
    try:
        out = model.hf(input_ids=x, use_cache=False, output_router_logits=aux_on)
    finally:
        for block in blocks:
            block.call = None
    logits = out.logits
    if y is None:
        return logits, None, None
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
    loss = ce + config.router_aux_loss_coef * out.aux_loss if aux_on and out.aux_loss is not None else ce
    return logits, ce, loss


def fuse_experts(shards: Mapping[str, torch.Tensor], layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """The experts' tensors as the transformers model holds them (`model.layers.{l}.mlp.experts.
    gate_up_proj`, `.down_proj`), from the union of the shards' (`layer{l}.expert{e}.<name>`).
    KeyError naming the first expert missing."""
    out = {}
    for li in range(layout.layers):
        for kind in ("gate_up_proj", "down_proj"):
            parts = []
            for e in range(layout.experts):
                key = f"{expert_name(li, e)}.{kind}"
                if key not in shards:
                    raise KeyError(f"no tensor {key} (expert {e} of layer {li}) in the shards")
                parts.append(shards[key])
            out[f"model.layers.{li}.mlp.experts.{kind}"] = torch.stack(parts)
    return out
