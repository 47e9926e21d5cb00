"""Hugging Face models: a local model directory in, a causal LM the roles train like our GPT.

    open_model_dir(path)       check a local directory (config.json, optional weights and
                               tokenizer files) -> ModelDir; ModelDirError with one line otherwise
    ModelDir.travelling_files  name -> sha256 of config.json and the tokenizer files: what a
                               coordinator pins and sends to its members (weights travel as state)
    FAMILIES, check_role       which model types each role can train
    CausalLM                   forward(idx, targets=None) -> (logits, loss), like gpt.GPT
    HFNames                    a wrapper's names are its transformers model's (CausalLM, a stage's)
    build_causal_lm            random init from the config (one seed, one set of bits) or the
                               directory's weights

Nothing is downloaded: a hub id ("org/name") is refused with the command that downloads it.
Weights are read from safetensors only (a pickle file can run code when loaded).

Parameter and state-dict names are the transformers model's own in memory (no prefix of the
wrapper): `hf.load_state_dict` takes them, and `hf.save_pretrained` writes them in the layout of
a checkpoint on disk (transformers 5 keeps Mixtral's experts fused in memory, one tensor per layer,
and writes one per expert). A model whose output head is tied to its input embedding (GPT-2) lists
that tensor once, under its first name.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # one file, or the index of shards
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
)  # fmt: skip
# eager attention runs the same kernels on every device; SDPA may pick a flash or memory-efficient
# kernel on a GPU whose backward is not deterministic, and replicas compare bits
ATTENTION = "eager"
# which model types each role trains. The replica holds the whole model: anything transformers
# builds as a causal LM. A stage cuts the model by decoder layers (the GPT-2 and the Llama
# layouts), an expert host serves a sparse MoE block's experts (Mixtral's layout).
ANY_CAUSAL_LM = "any causal LM transformers can build"
FAMILIES: dict[str, tuple[str, ...] | str] = {
    "replica": ANY_CAUSAL_LM,
    "pipeline": ("gpt2", "llama", "qwen2", "mistral"),
    "experts": ("mixtral",),
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelDirError(ValueError):
    """The model directory (or a model config) cannot be used; the message is one line naming why."""


@dataclass(frozen=True)
class ModelDir:
    """A checked local Hugging Face model directory."""

    path: Path
    config: dict[str, Any]  # config.json, parsed
    model_type: str  # config["model_type"], one transformers builds as a causal LM
    weights: Path | None  # model.safetensors or model.safetensors.index.json; None: train from scratch
    tokenizer_files: tuple[str, ...]  # the TOKENIZER_FILES present, in that order

    def travelling_files(self) -> dict[str, str]:
        """File name -> sha256 hex of config.json and the tokenizer files (not the weights)."""
        return {name: _sha256(self.path / name) for name in (CONFIG_FILE, *self.tokenizer_files)}

    def hf_config(self):
        """The transformers config object (a new one on every call: callers may change it)."""
        return hf_config_of(self.config)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding the config makes (its defaults included)."""
        return int(_text_config(self.hf_config()).vocab_size)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_config(config: Any, where: str = CONFIG_FILE) -> str:
    """The config's model_type, when transformers can build it as a causal LM; ModelDirError otherwise."""
    if not isinstance(config, dict):
        raise ModelDirError(f"{where} must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelDirError(f"{where} has no model_type (a Hugging Face config names its model type, e.g. \"gpt2\" or \"llama\")")
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelDirError(f"{where}: model_type {model_type!r} is unknown to transformers {__version__}")
    if model_type not in _causal_lm_types():
        raise ModelDirError(f"{where}: transformers {__version__} cannot build model_type {model_type!r} as a causal language model (the swarm trains next-token prediction)")
    return model_type


def hf_config_of(config: dict[str, Any]):
    """The transformers config object of a config.json dict; ModelDirError on values it refuses."""
    from transformers import CONFIG_MAPPING

    model_type = check_config(config)
    try:
        # as AutoConfig.from_pretrained reads config.json; a copy, since transformers rewrites nested
        # settings (rope parameters) in place and a ModelDir's config is what travels
        with _quiet():  # (its warnings about the config: what it refuses, we say in one line)
            return CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(config))
    except _config_errors() as e:
        raise ModelDirError(f"{CONFIG_FILE}: transformers refuses it: {_first_line(e)}") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without transformers' progress bars and load report: we refuse a bad load in one line ourselves."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message as one line (transformers' own span several, the cause last)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _config_errors() -> tuple[type[BaseException], ...]:
    # transformers 5 configs are strict dataclasses: their checks raise huggingface_hub's errors
    from huggingface_hub.errors import StrictDataclassError

    return (ValueError, TypeError, KeyError, StrictDataclassError)


def _missing(path: str | Path) -> ModelDirError:
    text = str(path)
    if not text.startswith((".", "/", "~")) and _HUB_ID.fullmatch(text):
        return ModelDirError(
            f"no local directory {text!r}; if it is a Hugging Face hub id, download it first "
            f"(e.g. `huggingface-cli download {text} --local-dir DIR`) and pass that directory: nothing is downloaded while training"
        )
    return ModelDirError(f"model directory does not exist: {text}")


def open_model_dir(path: str | Path) -> ModelDir:
    """Check a local Hugging Face model directory; ModelDirError (one line) when it cannot be used."""
    p = Path(path).expanduser()
    if not p.exists():
        raise _missing(path)
    if not p.is_dir():
        raise ModelDirError(f"{p} is not a directory: pass the directory that holds {CONFIG_FILE}")
    cfg_path = p / CONFIG_FILE
    if not cfg_path.is_file():
        raise ModelDirError(f"no {CONFIG_FILE} in {p} (a Hugging Face model directory holds one)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{cfg_path} is not JSON: {_first_line(e)}") from None
    model_type = check_config(config, str(cfg_path))
    hf_config_of(config)  # values transformers refuses end here, not on every member
    weights = next((p / name for name in WEIGHT_FILES if (p / name).is_file()), None)
    if weights is None:
        pickled = next((name for name in PICKLE_WEIGHTS if (p / name).is_file()), None)
        if pickled is not None:
            raise ModelDirError(
                f"{p} holds {pickled} but no model.safetensors: only safetensors weights are read (a pickle can run code); "
                "convert with `model.save_pretrained(DIR, safe_serialization=True)`"
            )
    tokenizer_files = tuple(name for name in TOKENIZER_FILES if (p / name).is_file())
    return ModelDir(p, config, model_type, weights, tokenizer_files)


def check_role(model_dir: ModelDir, role: str) -> None:
    """ModelDirError unless `role` can train this model's type, naming the types it supports."""
    if role not in FAMILIES:
        raise ModelDirError(f"unknown role {role!r} (roles: {', '.join(FAMILIES)})")
    families = FAMILIES[role]
    if families == ANY_CAUSAL_LM:
        check_config(model_dir.config)
    elif model_dir.model_type not in families:
        raise ModelDirError(f"the {role} role trains model types {', '.join(families)}; {model_dir.path} is {model_dir.model_type!r}")


def _text_config(config):
    # multimodal configs keep the language model's settings in a sub-config
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def context_of(config) -> int:
    """The longest sequence a model of this (transformers) config takes."""
    text = _text_config(config)
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ModelDirError(f"{CONFIG_FILE} names no context length (n_positions or max_position_embeddings)")


class HFNames:
    """Names of a module holding a transformers model as `self.hf`: its parameters, buffers and
    state dict under hf's own names (no prefix of the wrapper), every tied tensor once."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.hf.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.hf.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def aliases(self) -> dict[str, str]:
        """Name of each tied parameter that state_dict leaves out -> the name it is kept under."""
        first: dict[int, str] = {}
        out: dict[str, str] = {}
        for name, p in self.hf.named_parameters(remove_duplicate=False):
            out.update({name: first[id(p)]} if id(p) in first else {})
            first.setdefault(id(p), name)
        return out

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """hf's state dict with every tensor once: safetensors refuses two names on one storage."""
        state = self.hf.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for alias in self.aliases():
            state.pop(prefix + alias, None)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Takes what state_dict gives (tied tensors once) or hf's own (tied tensors twice)."""
        state = dict(state_dict)
        for alias, kept in self.aliases().items():
            if alias not in state and kept in state:
                state[alias] = state[kept]  # both names are one parameter: the copy keeps them tied
        return self.hf.load_state_dict(state, strict=strict, assign=assign)


class CausalLM(HFNames, nn.Module):
    """A transformers causal LM used as the roles use gpt.GPT: forward(idx, targets=None) ->
    (logits, loss), loss the mean cross-entropy over all positions of already-shifted targets.

    `hf` is the transformers model; `context` the longest sequence it takes, `vocab_size` its
    logits' width. Names (parameters, state dict) are `hf`'s own, without a prefix."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.context = context_of(hf.config)
        self.vocab_size = int(hf.get_output_embeddings().weight.shape[0])
        self.train()  # a new module trains, as gpt.GPT does (from_pretrained hands it back in eval)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        if idx.size(1) > self.context:
            raise ValueError(f"sequence length {idx.size(1)} exceeds the model's context {self.context}")
        # no labels: transformers would shift them again, and our targets are shifted already
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_causal_lm(model_dir: ModelDir | dict[str, Any], seed: int, weights: bool = True) -> CausalLM:
    """The model of a directory (or of a config.json dict), in float32 on the CPU: its weights
    when it has them and `weights` is true, else a random init that is a pure function of (config,
    seed) on one kind of machine (as gpt.init_model: hand the state out, never re-create it)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int ≥ 0, got {seed!r}")
    config = model_dir.hf_config() if isinstance(model_dir, ModelDir) else hf_config_of(model_dir)
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), _quiet():  # the global RNG of the caller stays as it was
        torch.manual_seed(seed)
        if isinstance(model_dir, ModelDir) and weights and model_dir.weights is not None:
            return CausalLM(_from_weights(model_dir, config))
        try:
            hf = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION, dtype=torch.float32)
        except (RuntimeError, *_config_errors()) as e:
            raise ModelDirError(f"{CONFIG_FILE}: transformers cannot build the model: {_first_line(e)}") from None
    return CausalLM(hf)


def _from_weights(model_dir: ModelDir, config) -> nn.Module:
    """The model with the directory's weights; ModelDirError naming the first tensor that does not
    fit the config (missing, of another shape, or one the config has no place for)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        hf, info = AutoModelForCausalLM.from_pretrained(
            model_dir.path, config=config, attn_implementation=ATTENTION, dtype=torch.float32,
            local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True,
        )  # fmt: skip
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:
        raise ModelDirError(f"cannot load the weights in {model_dir.weights}: {_first_line(e)}") from None
    name = model_dir.weights.name
    for key, *shapes in sorted(info.get("mismatched_keys") or []):
        weights_shape, config_shape = (tuple(s) for s in shapes) if len(shapes) == 2 else ("?", "?")
        raise ModelDirError(f"{name} does not fit {CONFIG_FILE}: tensor {key} has shape {weights_shape} in the weights, the config makes {config_shape}")
    for key in sorted(info.get("missing_keys") or []):
        raise ModelDirError(f"{name} does not fit {CONFIG_FILE}: tensor {key} is missing")
    for key in sorted(info.get("unexpected_keys") or []):
        raise ModelDirError(f"{name} does not fit {CONFIG_FILE}: it holds tensor {key}, which the config's model has no place for")
    for err in info.get("error_msgs") or []:
        raise ModelDirError(f"cannot load {name}: {_first_line(Exception(err))}")
    return hf
