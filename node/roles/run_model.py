"""The run's model as a role needs it: how to make it (whole, or one stage of its pipeline cut),
what a state of it is called, its context, and the data it reads. A built-in preset is known by name; a Hugging Face model is known by its
pin (node/state/model_files.py), and its config and tokenizer files are fetched from the
coordinator and checked against the pin before anything is built from them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..models.data import Corpus, load_corpus
from ..net.transport import NETWORK_ERRORS
from ..runconfig import RunConfig
from ..state.model_files import fetch_model_files
from .role import RoleContext, RoleError

log = logging.getLogger(__name__)

FETCH_RETRY_S = 2.0


def model_meta(run: RunConfig) -> dict[str, Any]:
    """What a state's manifest says of its model (states of other models are refused): a
    preset's config, or a Hugging Face model's pin."""
    return {"model": run.model} if run.is_hf else run.model_config().to_dict()


@dataclass(frozen=True)
class RunModel:
    make: Callable[[int | None], nn.Module]  # seed -> the model, initialised from that seed (None: any init, a state is loaded next)
    context: int  # tokens per window
    tokenizer: Any  # node.models.tokens tokenizer; None: bytes (the built-in models)
    source: str  # for logs
    dims: Any = None  # what a pipeline cut is sized by (n_layer, n_embd, vocab_size, context): a GPTConfig or hf_stages.CutDims
    stage: Callable[[int, Any, int], nn.Module] | None = None  # (index, plan, seed) -> that stage, initialised from the seed

    def corpus(self, data: str | None, text_field: str = "text") -> Corpus:
        return load_corpus(data or None, tokenizer=self.tokenizer, text_field=text_field)


def builtin_model(run: RunConfig) -> RunModel:
    from ..models.gpt import GPT, init_model
    from ..models.stages import init_stage

    config = run.model_config()
    return RunModel(lambda seed: GPT(config) if seed is None else init_model(config, seed), config.context, None, run.model,
                    config, lambda index, plan, seed: init_stage(config, index, plan, seed))  # fmt: skip


async def run_model(ctx: RoleContext, run: RunConfig, stopping: Callable[[], bool], role: str = "replica") -> RunModel:
    """The run's model for `role` (a node.models.hf.FAMILIES role: replica, pipeline); a Hugging
    Face model's files are fetched from the coordinator first (again every FETCH_RETRY_S until it
    answers). RoleError when the files cannot make the model, or not for this role."""
    if not run.is_hf:
        return builtin_model(run)
    path = await model_files(ctx, run, stopping)
    return await asyncio.to_thread(_hf_model, path, role)


async def model_files(ctx: RoleContext, run: RunConfig, stopping: Callable[[], bool]) -> Path:
    """The directory of a Hugging Face model's files (under DATA_DIR/model), fetched from the
    coordinator by the run's pin and checked against it (again every FETCH_RETRY_S until it
    answers; `stopping()` ends the wait)."""
    root = Path(ctx.node_config.data_dir) / "model"
    while True:
        coord = ctx.membership.coordinator
        if coord is not None:
            try:
                return await fetch_model_files(ctx.transport, coord, run.model, root)
            except NETWORK_ERRORS as e:
                log.warning("cannot fetch the model's files from the coordinator yet: %s", e)
        if stopping():
            raise asyncio.CancelledError
        await asyncio.sleep(FETCH_RETRY_S)


def _hf_model(path: Path, role: str) -> RunModel:
    from ..models.hf import ModelDirError, build_causal_lm, check_role, context_of, open_model_dir
    from ..models.hf_stages import dims_of, init_hf_stage
    from ..models.tokens import load_tokenizer

    try:
        model_dir = open_model_dir(path)
        check_role(model_dir, role)
        tokenizer = load_tokenizer(model_dir)  # (bytes when the model has no tokenizer)
        context = context_of(model_dir.hf_config())
        dims = dims_of(model_dir) if role == "pipeline" else None
    except ModelDirError as e:
        raise RoleError(f"the run's model cannot be built here: {e}") from None

    def built(build: Callable[..., nn.Module], *args) -> nn.Module:
        try:  # the weights come as state: from peers, or the coordinator's first checkpoint
            return build(*args, weights=False)
        except ModelDirError as e:
            raise RoleError(f"the run's model cannot be built here: {e}") from None

    return RunModel(lambda seed: built(build_causal_lm, model_dir, 0 if seed is None else seed), context, tokenizer, f"{model_dir.model_type} ({path.name[:8]})",
                    dims, lambda index, plan, seed: built(init_hf_stage, model_dir, index, plan, seed))  # fmt: skip
