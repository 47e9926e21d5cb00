"""The model of an experts run as its roles make it: a built-in MoE preset (node/models/moe.py), or
a Hugging Face Mixtral (node/models/mixtral.py) whose config and tokenizer files are fetched from
the coordinator by pin first (run_model.py) and checked to be of a type the experts role trains.

    ExpertModel    the experts' layout, what a state's manifest says of the model, the parts it
                   makes (a shard's experts, a trainer's dense parts), the trainer's forward
    expert_model   the run's, or RoleError naming why it cannot be built here
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..models.moe import ExpertLayout, ExpertShard, init_moe_model
from ..runconfig import RunConfig, RunConfigError
from .expert_client import forward_loss, mixtral_forward_loss
from .role import RoleContext, RoleError
from .run_model import model_files


@dataclass(frozen=True)
class ExpertModel:
    layout: ExpertLayout
    meta: dict[str, Any]  # what a state's manifest says of the model (a host adds its shard; states of other models are refused)
    make_shard: Callable[[tuple[str, ...]], nn.Module]  # the named experts at the run's initial values; shard[name] is one
    make_dense: Callable[[], nn.Module]  # a trainer's part: all but the experts, at the run's initial values
    forward: Callable[..., Any]  # (dense, client, mb, x, y) -> (cross-entropy, training loss, experts skipped)
    context: int  # tokens per window
    tokenizer: Any  # node.models.tokens tokenizer; None: bytes
    source: str  # for logs

    def shard(self, run: RunConfig, index: int) -> tuple[str, ...]:
        """The experts of shard `index`; RoleError when the run's shards do not fit the model."""
        try:
            return run.expert_shard(index, self.layout.layers, self.layout.experts)
        except RunConfigError as e:
            raise RoleError(str(e)) from None


def preset_model(run: RunConfig) -> ExpertModel:
    """A built-in MoE preset's; RoleError for a run whose model is none."""
    try:
        gpt, moe = run.moe_preset()
    except RunConfigError as e:
        raise RoleError(str(e)) from None

    def dense() -> nn.Module:
        model = init_moe_model(gpt, moe, run.seed)
        for block in model.blocks:
            block.moe.experts = nn.ModuleList()  # they live on the expert hosts
        return model

    def shard(names: tuple[str, ...]) -> nn.Module:
        return ExpertShard(init_moe_model(gpt, moe, run.seed), names)

    meta = {**gpt.to_dict(), "moe": moe.to_dict()}
    return ExpertModel(ExpertLayout.of_preset(gpt, moe), meta, shard, dense, forward_loss, gpt.context, None, run.model)


async def expert_model(run: RunConfig, ctx: RoleContext, stopping: Callable[[], bool] = lambda: False) -> ExpertModel:
    """The run's model: a preset's at once, a Hugging Face model's once its files are here."""
    if not run.is_hf:
        return preset_model(run)
    path = await model_files(ctx, run, stopping)
    return await asyncio.to_thread(_mixtral, run, path)


def _mixtral(run: RunConfig, path: Path) -> ExpertModel:
    from ..models.hf import ModelDirError, build_causal_lm, check_role, context_of, open_model_dir
    from ..models.mixtral import MixtralExpertShard, mixtral_layout, split_experts
    from ..models.tokens import load_tokenizer

    try:
        model_dir = open_model_dir(path)
        check_role(model_dir, "experts")
        config = model_dir.hf_config()
        layout = mixtral_layout(config)
        run.check_experts(layout.experts)
        tokenizer = load_tokenizer(model_dir)  # (bytes when the model has no tokenizer)
        context = context_of(config)
    except (ModelDirError, RunConfigError) as e:
        raise RoleError(f"the run's model cannot be built here: {e}") from None

    def whole():
        # the whole model, from the run's seed, so that every part is the slice of one model
        # (a host or a trainer holds it only while it takes its part out)
        try:
            return build_causal_lm(model_dir, seed=run.seed, weights=False)
        except ModelDirError as e:
            raise RoleError(f"the run's model cannot be built here: {e}") from None

    def dense() -> nn.Module:
        model = whole()
        split_experts(model)
        return model

    return ExpertModel(layout, {"model": run.model}, lambda names: MixtralExpertShard(whole(), names), dense, mixtral_forward_loss,
                       context, tokenizer, f"{model_dir.model_type} ({path.name[:8]})")  # fmt: skip
