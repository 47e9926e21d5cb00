"""An experts run's states as one Hugging Face model: what `swarmtrain-model export` makes of an
experts run's coordinator (node/experts_export.py finds and verifies the checkpoints). Tensors
and the run's model files in, a directory transformers loads out; no file formats of ours here.

    save_experts_model(shards, dense, files, out)   every shard's experts and the trainers' dense
                                                    parts -> the model's directory; ExportError
                                                    naming the shard whose experts are missing

The shards' experts are named per expert (`layer{l}.expert{e}.gate_up_proj`, node/models/
mixtral.py); transformers holds a layer's experts fused, so they are stacked back in expert order.
Only a Hugging Face Mixtral has such a class: the built-in MoE presets have none.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .export import ExportError, save_hf_model
from .hf import ModelDirError, open_model_dir
from .mixtral import fuse_experts, mixtral_layout


def experts_state(shards: Mapping[int, Mapping[str, torch.Tensor]], dense: Mapping[str, torch.Tensor], files: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state, by transformers' names, of shard -> its experts' tensors and the
    dense parts' tensors; ExportError naming what is missing."""
    try:
        layout = mixtral_layout(open_model_dir(files).hf_config())
    except ModelDirError as e:
        raise ExportError(f"the run's model files: {e}") from None
    count = len(shards)
    union: dict[str, torch.Tensor] = {}
    for shard, state in sorted(shards.items()):
        want = {f"{name}.{kind}" for name in layout.shard(shard, count) for kind in ("gate_up_proj", "down_proj")}
        missing = sorted(want - set(state))
        if missing:
            raise ExportError(f"shard {shard}'s checkpoint has no tensor {missing[0]}, which one of {count} shards (the stores found) holds: "
                              f"a shard of {count} holds expert e of every layer with e mod {count} == {shard} (is a shard's store missing?)")  # fmt: skip
        extra = sorted(set(state) - want)
        if extra:
            raise ExportError(f"shard {shard}'s checkpoint holds {extra[0]}, which is not one of its experts (of {count} shards)")
        union.update(state)
    try:
        experts = fuse_experts(union, layout)
    except KeyError as e:
        raise ExportError(str(e.args[0])) from None
    clash = sorted(set(experts) & set(dense))
    if clash:
        raise ExportError(f"the dense parts hold {clash[0]}, an expert tensor")
    return {**dense, **experts}


def save_experts_model(shards: Mapping[int, Mapping[str, torch.Tensor]], dense: Mapping[str, torch.Tensor], files: str | Path, out: str | Path) -> None:
    """Write the model of an experts run into the existing directory `out` (config.json,
    model.safetensors, the tokenizer it trained with); `files`: the run's model files."""
    save_hf_model(experts_state(shards, dense, files), files, out)
