"""The built-in GPT as a Hugging Face GPT-2, and back into our evaluation: what `swarmtrain-model`
(node/model_cli.py) is made of. No file formats of ours here, no network: tensors and configs in,
transformers objects out.

    gpt_config_of(model_config)   a checkpoint manifest's model_config -> GPTConfig, or ExportError
                                  naming what kind of checkpoint it is instead
    gpt2_config(cfg)              the GPT2Config whose model computes exactly what GPT(cfg) does
    gpt2_state_dict(state, cfg)   our parameter names and layouts -> GPT2LMHeadModel's
    to_gpt2(state, cfg)           a GPT2LMHeadModel holding `state`
    byte_tokenizer(context)       the built-in byte-level tokenizer (token id == byte value)
    save_hf(state, cfg, out)      config.json, model.safetensors, tokenizer files into `out`
    load_hf(path)                 (model, tokenizer) of a local directory; never a hub download
    LossHead                      a causal LM called as evaluate() calls our GPT: (idx, targets)
    continue_ids                  greedy or sampled continuation, cropped to the model's context

Why GPT-2: ours is its architecture. Pre-LayerNorm blocks, learned positions, fused q|k|v
projection, exact-erf GELU, 1/sqrt(head_dim) attention scaling, LayerNorms with biases, an
output head without bias. Two differences are encoded: GPT-2's Conv1D keeps its weight as
(in, out), the transpose of nn.Linear's; and our head is untied from the embedding.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT, PRESETS, GPTConfig
from .hf import context_of

# Conv1D layers of GPT-2 (weight stored as (in, out)): ours are nn.Linear, (out, in)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SUPPORTED = f"replica and pipeline checkpoints (the built-in GPT {' or '.join(PRESETS)}, or a Hugging Face model), and an experts run of a Hugging Face Mixtral from its coordinator's data dir"
STAGES_HOWTO = "export the coordinator's data dir or its stage-checkpoints/, whose stages are put together into one model"


class ExportError(ValueError):
    """A checkpoint or a model directory cannot be used as asked; the message says why and, where
    it helps, what is supported."""


def gpt_config_of(model_config: Any) -> GPTConfig:
    """The GPTConfig a replica checkpoint's manifest carries. Stage and expert checkpoints carry a
    GPT's fields plus their own (stage, moe): named, and refused."""
    if isinstance(model_config, Mapping):
        if "stage" in model_config:
            raise ExportError(f"this is a pipeline stage checkpoint (stage {model_config['stage']}) alone; {STAGES_HOWTO}")
        if "moe" in model_config:
            raise ExportError(f"this is an expert shard checkpoint (mixture of experts); only {SUPPORTED} can be exported")
        if not model_config:
            raise ExportError(f"its manifest names no model_config; only {SUPPORTED} can be exported")
    try:
        return GPTConfig.from_dict(dict(model_config) if isinstance(model_config, Mapping) else model_config)
    except (TypeError, ValueError) as e:
        raise ExportError(f"its model_config is not a built-in GPT's ({e}); only {SUPPORTED} can be exported") from None


def _reference(cfg: GPTConfig) -> GPT:
    """GPT(cfg) without storage: its parameter names and shapes, its LayerNorm eps."""
    with torch.device("meta"):
        return GPT(cfg)


def gpt2_config(cfg: GPTConfig):
    """A GPT2Config for `cfg`, each setting read from what GPT(cfg) does rather than assumed."""
    from transformers import GPT2Config

    ref = _reference(cfg)
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=ref.blocks[0].mlp.c_fc.out_features,
        activation_function="gelu",  # F.gelu's default: the exact erf form, not GPT-2's tanh "gelu_new"
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=ref.ln_f.eps,
        scale_attn_weights=True,  # scaled_dot_product_attention's default 1/sqrt(head_dim)
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=False,
        # GPT2Config's defaults (50256) are outside a 256-token vocabulary; ours has no specials
        bos_token_id=None,
        eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )


def _hf_name(name: str) -> str:
    if name == "lm_head.weight":
        return name
    if name.startswith("blocks."):
        name = "h." + name[len("blocks.") :]
    return "transformer." + name


def gpt2_state_dict(state: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors for our GPT's `state` (its named parameters). ExportError if a
    tensor is missing, unexpected, of another shape, or not floating point."""
    expected = dict(_reference(cfg).named_parameters())
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = [f"missing {', '.join(missing[:4])}" if missing else "", f"unexpected {', '.join(unexpected[:4])}" if unexpected else ""]
        raise ExportError(f"its model tensors are not those of a GPT {cfg.to_dict()}: {'; '.join(p for p in parts if p)}")
    out = {}
    for name, ref in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(ref.shape) or not t.is_floating_point():
            raise ExportError(f"tensor {name} is {t.dtype} {tuple(t.shape)}, a GPT {cfg.to_dict()} needs a float {tuple(ref.shape)}")
        out[_hf_name(name)] = (t.t() if name.endswith(_CONV1D) else t).contiguous()
    return out


def to_gpt2(state: Mapping[str, torch.Tensor], cfg: GPTConfig):
    """A GPT2LMHeadModel (eval mode) holding our `state`. strict: a tensor of GPT-2's left at its
    random init would change the logits only a little, and a test might miss it."""
    from transformers import GPT2LMHeadModel

    tensors = gpt2_state_dict(state, cfg)
    model = GPT2LMHeadModel(gpt2_config(cfg)).to(next(iter(tensors.values())).dtype)
    model.load_state_dict(tensors, strict=True)  # a mismatch here is our bug: the mapping is out of date
    return model.eval()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet): printable Latin-1
    bytes stand for themselves, the others are moved up past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer(context: int):
    """The built-in tokenizer as a PreTrainedTokenizerFast: one token per byte, id == byte value,
    no special tokens. A byte-level BPE without merges: ByteLevel turns each byte into one character
    of GPT-2's alphabet, and the vocabulary gives that character its byte's value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=context, clean_up_tokenization_spaces=False)


def save_hf(state: Mapping[str, torch.Tensor], cfg: GPTConfig, out: str | Path) -> None:
    """Write the Hugging Face directory of our GPT `state` into the existing directory `out`."""
    out = Path(out)
    to_gpt2(state, cfg).save_pretrained(out)  # config.json, generation_config.json, model.safetensors
    save_byte_tokenizer(out, cfg.context)


def save_byte_tokenizer(out: Path, context: int) -> None:
    byte_tokenizer(context).save_pretrained(out)
    # transformers 5 names its class TokenizersBackend, which transformers 4 cannot resolve; both
    # load tokenizer.json under the older name
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")


def save_hf_model(state: Mapping[str, torch.Tensor], files: str | Path, out: str | Path, untie: bool = False) -> None:
    """Write a Hugging Face model's `state` (every parameter once, by transformers' names) into
    the existing directory `out`, with the config and the tokenizer files it was trained with
    (`files`: the run's model files, node/state/model_files.py). `untie`: the output head is a
    tensor of its own in `state` although the config ties it to the input embedding (a pipeline
    trains them apart, stage_merge.py): the config written says tie_word_embeddings false."""
    from .hf import TOKENIZER_FILES, ModelDirError, build_causal_lm, open_model_dir

    try:
        model_dir = open_model_dir(files)
        model = build_causal_lm({**model_dir.config, "tie_word_embeddings": False} if untie else model_dir, seed=0, weights=False)
    except ModelDirError as e:
        raise ExportError(f"the run's model files: {e}") from None
    names = {n: p.shape for n, p in model.named_parameters()}
    for name, shape in names.items():
        if name not in state:
            raise ExportError(f"the state has no tensor {name} of the model")
        if tuple(state[name].shape) != tuple(shape):
            raise ExportError(f"tensor {name} is {tuple(state[name].shape)} in the state, {tuple(shape)} in the model")
    extra = sorted(set(state) - set(names))
    if extra:
        raise ExportError(f"the state holds {extra[0]}, which the model has no place for")
    model.load_state_dict({**model.state_dict(), **state})  # (buffers, which a state does not carry, stay the model's own)
    model.hf.save_pretrained(Path(out))  # config.json, generation_config.json, model.safetensors
    tokenizer = [name for name in TOKENIZER_FILES if (Path(files) / name).is_file()]
    for name in tokenizer:
        shutil.copyfile(Path(files) / name, Path(out) / name)
    if not tokenizer:  # it trained on bytes (node/models/tokens.py)
        save_byte_tokenizer(Path(out), model.context)


def load_hf(path: str | Path):
    """(model in eval mode, tokenizer) of a local Hugging Face directory; ExportError if it holds
    none. local_files_only: a path that is not a directory must never turn into a hub download."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory")
    if not (path / "config.json").is_file():
        raise ExportError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(f"{path}: cannot load the model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return model.eval(), tokenizer


class LossHead(nn.Module):
    """A transformers causal LM called the way data.evaluate calls our GPT: (idx, targets) ->
    (logits, mean cross-entropy of targets). The targets are already shifted (data._windows), so
    transformers' own `labels` (which shift again) are not used."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm(input_ids=idx).logits
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


@torch.no_grad()
def continue_ids(lm: nn.Module, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> list[int]:
    """`max_new_tokens` more ids after `ids`: the most likely one each time at temperature 0, else
    drawn from softmax(logits / temperature) with a generator seeded by `seed`. The input is
    cropped to the model's context, which learned positions cannot exceed (generate() would fail)."""
    if not ids:
        raise ExportError("the prompt is empty: the model needs at least one token to continue")
    context, gen = context_of(lm.config), torch.Generator().manual_seed(seed)
    device = next(lm.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        logits = lm(input_ids=torch.tensor([out[-context:]], device=device)).logits[0, -1].float().cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen))
        out.append(nxt)
    return out[len(ids) :]


__all__ = [
    "STAGES_HOWTO",
    "SUPPORTED",
    "ExportError",
    "LossHead",
    "byte_tokenizer",
    "bytes_to_unicode",
    "continue_ids",
    "gpt2_config",
    "gpt2_state_dict",
    "gpt_config_of",
    "load_hf",
    "save_hf",
    "save_byte_tokenizer",
    "save_hf_model",
    "to_gpt2",
]
