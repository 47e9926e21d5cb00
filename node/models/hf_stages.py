"""A Hugging Face causal LM cut into pipeline stages by decoder layers, as stages.py cuts ours.

    LAYOUTS                       where each supported family keeps its parts (embeddings, layers,
                                  final norm, head): GPT-2's and Llama's (Qwen2, Mistral share it)
    dims_of(model_dir)            the cut's dimensions: layers, hidden size, vocabulary, context
    HFStage.cut(lm, index, plan)  one stage of a whole CausalLM: its layers kept, the rest dropped
    init_hf_stage(dir, i, plan, seed)  a stage whose tensors are the whole model's (its weights, or
                                  the random init of build_causal_lm(dir, seed)) for its layers
    stage_weights(dir, plan)      each stage's slice of the directory's weights, with its state hash

The first stage adds the embeddings, the last the final norm, the head and the loss. Every stage
builds the attention mask and the positions (Llama's rotary embeddings) the whole model builds, so
the stages chained compute what the model computes. A stage's tensor names are the whole model's
(`transformer.h.3.attn.c_attn.weight` in whichever stage holds layer 3), so the stages' state
dicts, put together, are the model's.

Tied embeddings: a model whose head shares its tensor with the input embedding (GPT-2) is untied
by the cut. The last stage holds the head as its own tensor, a copy of the embedding at the start,
and trains it apart from the first stage's embedding: the two live on different peers. A model
exported from a pipeline run says `tie_word_embeddings: false`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf import CausalLM, HFNames, ModelDir, ModelDirError, _text_config, build_causal_lm, context_of
from .stages import StageInputError, check_stage_input


@dataclass(frozen=True)
class Layout:
    """Attribute names of one family's parts in its transformers *ForCausalLM model."""

    body: str  # the decoder: hf.<body>
    layers: str  # its decoder layers: hf.<body>.<layers>[i]
    embeddings: tuple[str, ...]  # the first stage's: hf.<body>.<name>
    norm: str  # the final norm, on the last stage: hf.<body>.<norm>
    rotary: bool  # positions as rotary embeddings every stage computes (hf.<body>.rotary_emb)


_GPT2 = Layout("transformer", "h", ("wte", "wpe"), "ln_f", rotary=False)
_LLAMA = Layout("model", "layers", ("embed_tokens",), "norm", rotary=True)
LAYOUTS: dict[str, Layout] = {"gpt2": _GPT2, "llama": _LLAMA, "qwen2": _LLAMA, "mistral": _LLAMA}


@dataclass(frozen=True)
class CutDims:
    """What the cut and the calls between stages are sized by (a GPTConfig has the same fields)."""

    n_layer: int  # decoder layers
    n_embd: int  # hidden size: the residual stream between stages is (batch, time, n_embd)
    vocab_size: int
    context: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dims_of(model_dir: ModelDir) -> CutDims:
    """The cut's dimensions of a model directory; ModelDirError when its family cannot be cut."""
    if model_dir.model_type not in LAYOUTS:
        raise ModelDirError(f"the pipeline role cuts model types {', '.join(LAYOUTS)}; {model_dir.path} is {model_dir.model_type!r}")
    config = _text_config(model_dir.hf_config())
    return CutDims(int(config.num_hidden_layers), int(config.hidden_size), int(config.vocab_size), context_of(config))


def _layer_masks(config, h: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The attention mask of each layer type, as the family's model builds them."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    args = {"config": config, "inputs_embeds": h, "attention_mask": None, "cache": None, "position_ids": positions}
    types = set(getattr(config, "layer_types", None) or ())
    masks = {"full_attention": create_causal_mask(**args)}
    if "sliding_attention" in types or (not types and getattr(config, "sliding_window", None) is not None):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
    return masks


class HFStage(HFNames, nn.Module):
    """One pipeline stage of a Hugging Face causal LM, called as stages.Stage is:
    forward(x, targets=None, checked=False); token ids into the first stage, the residual stream
    (batch, time, n_embd) float32 into the others; the last returns (logits, loss)."""

    def __init__(self, hf: nn.Module, layout: Layout, dims: CutDims, index: int, plan: Sequence[tuple[int, int]]):
        super().__init__()
        self.hf, self.layout, self.dims = hf, layout, dims
        self.index, self.num_stages = index, len(plan)
        self.first, self.last = index == 0, index == len(plan) - 1
        self.start, self.end = plan[index]

    @classmethod
    def cut(cls, lm: CausalLM, index: int, plan: Sequence[tuple[int, int]]) -> HFStage:
        """Stage `index` of `lm`, which gives up the parts the stage does not hold (the stage
        keeps the same tensors: copy the model first to keep it whole)."""
        hf = lm.hf
        model_type = hf.config.model_type
        if model_type not in LAYOUTS:
            raise ModelDirError(f"the pipeline role cuts model types {', '.join(LAYOUTS)}, not {model_type!r}")
        layout = LAYOUTS[model_type]
        config = _text_config(hf.config)
        dims = CutDims(int(config.num_hidden_layers), int(config.hidden_size), lm.vocab_size, lm.context)
        if not 0 <= index < len(plan):
            raise ValueError(f"stage index {index} is outside 0..{len(plan) - 1}")
        first, last = index == 0, index == len(plan) - 1
        start, end = plan[index]
        body, head = getattr(hf, layout.body), hf.get_output_embeddings()
        if last:  # untied: the head is its own tensor, trained on this stage (the module's docstring)
            head.weight = nn.Parameter(head.weight.detach().clone())
            hf.config.tie_word_embeddings = False
            config.tie_word_embeddings = False
        else:
            hf.lm_head = None
        if not first:
            for name in layout.embeddings:
                setattr(body, name, None)
        if not last:
            setattr(body, layout.norm, None)
        layers = getattr(body, layout.layers)
        for i in range(len(layers)):
            if not start <= i < end:
                layers[i] = nn.Identity()  # (the indices, and so the names, of the kept layers stay the model's)
        return cls(hf, layout, dims, index, plan)

    @property
    def body(self) -> nn.Module:
        return getattr(self.hf, self.layout.body)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_input(self, x: torch.Tensor, finite: bool = True) -> None:
        check_stage_input(x, self.index, self.first, self.dims, finite)

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        body = self.body
        if self.layout is _GPT2:
            return body.drop(body.wte(idx) + body.wpe(positions))
        return body.embed_tokens(idx)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, checked: bool = False):
        if not checked:
            self.check_input(x)
        positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        h = self._embed(x, positions) if self.first else x
        config = _text_config(self.hf.config)
        masks = _layer_masks(config, h, positions)
        types = getattr(config, "layer_types", None)
        sliding = "sliding_attention" in masks and not types
        body, kwargs = self.body, {"position_ids": positions}
        if self.layout.rotary:
            kwargs["position_embeddings"] = body.rotary_emb(h, position_ids=positions)
        layers = getattr(body, self.layout.layers)
        for i in range(self.start, self.end):
            kind = types[i] if types else ("sliding_attention" if sliding else "full_attention")
            h = layers[i](h, attention_mask=masks[kind], use_cache=False, **kwargs)
        if not self.last:
            return h
        logits = self.hf.lm_head(getattr(body, self.layout.norm)(h))
        loss = None
        if targets is not None:
            if targets.shape != logits.shape[:2]:
                raise StageInputError(f"stage {self.index}: targets must be {tuple(logits.shape[:2])}, got shape {tuple(targets.shape)}")
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def init_hf_stage(model_dir: ModelDir, index: int, plan: Sequence[tuple[int, int]], seed: int, weights: bool = True) -> HFStage:
    """Stage `index` of the directory's model: its weights when it has them and `weights` is
    true, else the random init of build_causal_lm(model_dir, seed), the same bits on every peer
    (the whole model is built once to take its draws, then cut)."""
    return HFStage.cut(build_causal_lm(model_dir, seed, weights=weights), index, plan)


def stage_weights(model_dir: ModelDir, plan: Sequence[tuple[int, int]]) -> dict[int, tuple[dict[str, torch.Tensor], str]]:
    """stage -> (its parameters, their state hash) of the directory's weights, cut by `plan`:
    what each stage of a fine-tuning run starts from (the model is loaded once)."""
    import copy

    from .diloco import state_hash

    whole = build_causal_lm(model_dir, seed=0, weights=True)
    out = {}
    for index in range(len(plan)):
        params = {n: p.detach().contiguous() for n, p in HFStage.cut(copy.deepcopy(whole), index, plan).named_parameters()}
        out[index] = (params, state_hash(params))
    return out
