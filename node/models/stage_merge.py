"""A pipeline's stages put back together as one model's state: what `swarmtrain-model` exports
of a pipeline run (node/model_source.py finds and verifies the stages' checkpoints; export.py
writes the model). Tensors and manifests' model_configs in, one state out; no files here.

    StageMeta.of(model_config)    a stage checkpoint's model_config -> its stage, blocks, the size
                                  of the cut and the model it is a part of; ExportError if not one
    one_cut(metas)                the number of stages, when all the stages are of one cut of one model
    check_blocks(metas, n)        the stages' blocks cover the model's n blocks exactly once
    merge_stages(parts, prefix)   the union of the stages' tensors, each held by one stage only,
                                  each block's by the stage that holds the block
    gpt_stages(parts)             (state, GPTConfig) of built-in GPT stages (models/stages.py)
    hf_stages(parts, config)      (state, untie) of a Hugging Face model's stages

A stage keeps its tensors under the whole model's names (`blocks.2.attn.c_attn.weight` of the
built-in GPT, `model.layers.1.self_attn.q_proj.weight` of a Hugging Face model, as its
CausalLM.state_dict names them), so the union of the stages' tensors is the model's state once
every stage is there and no block is held twice. Stages step independently: their states may be
of different steps, each the newest its peers agreed on.

A tied output head (GPT-2's, and any config with tie_word_embeddings) is untied by a pipeline:
the input embedding lives on the first stage, the head on the last, and each is trained there as
its own tensor. The last stage holds the head under its own name (`lm_head.weight`); the model
is exported with both, untied (`hf_stages` says so).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .export import ExportError, gpt_config_of
from .gpt import GPTConfig

STAGE_KEYS = ("stage", "blocks", "num_stages")  # what a stage's manifest adds to its model's config
GPT_BLOCKS = "blocks"  # the built-in GPT's list of blocks (its tensors: blocks.<i>.…)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class StageMeta:
    """What a stage checkpoint's manifest says it is: stage `index` of a cut into `num_stages`,
    holding blocks [start, end) of `model` (a built-in GPT's config, or {"model": "hf:<pin>"})."""

    index: int
    num_stages: int
    blocks: tuple[int, int]
    model: dict[str, Any]

    @classmethod
    def of(cls, model_config: Any) -> StageMeta:
        if not isinstance(model_config, Mapping) or "stage" not in model_config:
            raise ExportError(f"its model_config is not a pipeline stage's (no stage in {model_config!r})")
        index, blocks, num = (model_config.get(k) for k in STAGE_KEYS)
        if not _is_int(num) or num < 1:
            raise ExportError(f"its model_config has no valid num_stages (got {num!r})")
        if not _is_int(index) or not 0 <= index < num:
            raise ExportError(f"its model_config says stage {index!r}, not one of 0..{num - 1}")
        if not (isinstance(blocks, Sequence) and len(blocks) == 2 and all(map(_is_int, blocks)) and 0 <= blocks[0] < blocks[1]):
            raise ExportError(f"stage {index}: its model_config's blocks must be [start, end) with 0 ≤ start < end, got {blocks!r}")
        model = {k: v for k, v in model_config.items() if k not in STAGE_KEYS}
        return cls(index, num, (blocks[0], blocks[1]), model)

    @property
    def pin(self) -> str | None:
        """The Hugging Face model's pin (hf:<hex>) this is a stage of; None: the built-in GPT."""
        pin = self.model.get("model")
        return pin if isinstance(pin, str) and pin.startswith("hf:") else None

    def span(self) -> str:
        start, end = self.blocks
        return f"block {start}" if end - start == 1 else f"blocks {start}..{end - 1}"


def one_cut(metas: Sequence[StageMeta]) -> int:
    """The number of stages of the cut all `metas` are of; ExportError naming the stages that
    disagree on the cut or on the model. (Which stages are missing is the caller's to say: it
    knows why.)"""
    if not metas:
        raise ExportError("no stage checkpoint")
    first = metas[0]
    for m in metas[1:]:
        if m.num_stages != first.num_stages:
            raise ExportError(f"stage {first.index} is of a {first.num_stages}-stage cut, stage {m.index} of a {m.num_stages}-stage one (checkpoints of two runs?)")
        if m.model != first.model:
            diff = sorted(k for k in first.model.keys() | m.model.keys() if first.model.get(k) != m.model.get(k))
            raise ExportError(f"stages {first.index} and {m.index} are parts of different models ({', '.join(diff[:4])} differ; checkpoints of two runs?)")
    return first.num_stages


def check_blocks(metas: Sequence[StageMeta], n_blocks: int) -> None:
    """ExportError unless the stages' blocks cover the model's `n_blocks` blocks exactly once."""
    held: Counter[int] = Counter()
    for m in metas:
        if m.blocks[1] > n_blocks:
            raise ExportError(f"stage {m.index} holds {m.span()}, the model has {n_blocks} (0..{n_blocks - 1})")
        held.update(range(*m.blocks))
    twice = sorted(b for b, n in held.items() if n > 1)
    if twice:
        holders = [f"stage {m.index} ({m.span()})" for m in sorted(metas, key=lambda m: m.index) if m.blocks[0] <= twice[0] < m.blocks[1]]
        raise ExportError(f"block {twice[0]} is held by more than one stage: {' and '.join(holders)}")
    none = [b for b in range(n_blocks) if b not in held]
    if none:
        raise ExportError(f"no stage holds block{'s' if len(none) > 1 else ''} {', '.join(map(str, none[:8]))} of the model's {n_blocks}")


def block_of(prefix: str) -> Callable[[str], int | None]:
    """name -> the index of the block a tensor belongs to (`<prefix>.<i>.…`), None outside blocks."""
    pattern = re.compile(rf"{re.escape(prefix)}\.(\d+)\.")

    def block(name: str) -> int | None:
        m = pattern.match(name)
        return int(m.group(1)) if m else None

    return block


def merge_stages(parts: Sequence[tuple[StageMeta, Mapping[str, torch.Tensor]]], prefix: str) -> dict[str, torch.Tensor]:
    """The union of the stages' tensors. ExportError for a tensor two stages hold, or a block's
    tensor (`<prefix>.<i>.…`) in a stage that does not hold block i."""
    block = block_of(prefix)
    state: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for meta, tensors in sorted(parts, key=lambda p: p[0].index):
        for name, t in tensors.items():
            if name in state:
                raise ExportError(f"tensor {name} is held by stage {owner[name]} and by stage {meta.index}")
            b = block(name)
            if b is not None and not meta.blocks[0] <= b < meta.blocks[1]:
                raise ExportError(f"stage {meta.index} holds {meta.span()} but its checkpoint has {name}, of block {b}")
            state[name], owner[name] = t, meta.index
    return state


def gpt_stages(parts: Sequence[tuple[StageMeta, Mapping[str, torch.Tensor]]]) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """The whole built-in GPT's state and config from all its stages' model tensors (which
    export.gpt2_state_dict then checks name by name)."""
    metas = [m for m, _ in parts]
    cfg = gpt_config_of(metas[0].model)
    check_blocks(metas, cfg.n_layer)
    return merge_stages(parts, GPT_BLOCKS), cfg


def decoder_layers(model: nn.Module, n_layers: int) -> str:
    """The name of a transformers model's list of decoder layers (`transformer.h`, `model.layers`):
    the shortest-named ModuleList of `n_layers` entries (a layer's own lists, of experts say, are
    named below it)."""
    lists = sorted((name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers), key=len)
    if not lists:
        raise ExportError(f"the model has no list of its {n_layers} decoder layers to cut into stages")
    return lists[0]


def hf_stages(parts: Sequence[tuple[StageMeta, Mapping[str, torch.Tensor]]], config: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], bool]:
    """The whole Hugging Face model's state from all its stages' tensors, and whether its output
    head is to be untied (the config ties it, and the stages hold it apart: see the docstring).
    `config`: the run's config.json. The model is built on the meta device: names only."""
    from .hf import ModelDirError, build_causal_lm

    try:
        with torch.device("meta"):
            model = build_causal_lm(dict(config), seed=0)
    except ModelDirError as e:
        raise ExportError(f"the run's model files: {e}") from None
    n_layers = int(model.hf.config.num_hidden_layers)  # (GPT-2's n_layer, by transformers' alias)
    metas = [m for m, _ in parts]
    check_blocks(metas, n_layers)
    state = merge_stages(parts, decoder_layers(model.hf, n_layers))
    return state, any(alias in state for alias in model.aliases())


__all__ = [
    "GPT_BLOCKS",
    "STAGE_KEYS",
    "StageMeta",
    "block_of",
    "check_blocks",
    "decoder_layers",
    "gpt_stages",
    "hf_stages",
    "merge_stages",
    "one_cut",
]
