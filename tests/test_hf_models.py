"""Hugging Face model directories: opening and refusing them, building tiny GPT-2, Llama and
Mixtral models (seeded init, saved weights, mismatched weights), the tied GPT-2 state dict through
safetensors, which roles take which model types, and the tokenizers. Nothing is downloaded: every
config and tokenizer is made here, in a temporary directory."""

from __future__ import annotations

import hashlib
import json

import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from node.models.data import Batches, evaluate, load_corpus
from node.models.diloco import InnerTrainer, TrainConfig, state_hash
from node.models.hf import FAMILIES, CausalLM, ModelDirError, build_causal_lm, check_role, open_model_dir
from node.models.tokens import ByteTokenizer, HFTokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 320
TEXT = "the quick brown fox jumps over the lazy dog. a swarm of peers trains one model together.\n" * 20
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, vocab_size=VOCAB,
    ),  # fmt: skip
    "mixtral": lambda: transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
    ),  # fmt: skip
}



def train_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on TEXT: a real tokenizer.json with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


def write_dir(path, family: str, tokenizer=True):
    path.mkdir(parents=True, exist_ok=True)
    CONFIGS[family]().save_pretrained(path)
    if tokenizer:
        train_tokenizer().save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: open_model_dir(write_dir(root / family, family)) for family in CONFIGS}


@pytest.fixture(scope="module")
def models(dirs):
    return {family: build_causal_lm(d, seed=0) for family, d in dirs.items()}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


# ---- opening a directory --------------------------------------------------------------------------


def test_open_reads_config_type_weights_and_tokenizer_files(dirs):
    d = dirs["llama"]
    assert d.model_type == "llama" and d.config["hidden_size"] == 32 and d.weights is None
    assert d.tokenizer_files == ("tokenizer.json", "tokenizer_config.json")
    files = d.travelling_files()
    assert sorted(files) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert files["tokenizer.json"] == hashlib.sha256((d.path / "tokenizer.json").read_bytes()).hexdigest()
    assert d.vocab_size == VOCAB


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: p / "nope", "model directory does not exist"),
        (lambda p: "openai-community/gpt2-nothere", "huggingface-cli download openai-community/gpt2-nothere"),
        (lambda p: p, "no config.json in"),
        (lambda p: (p / "config.json").write_text("{not json") and p, "config.json is not JSON"),
        (lambda p: (p / "config.json").write_text("[1]") and p, "must hold a JSON object"),
        (lambda p: (p / "config.json").write_text("{}") and p, "has no model_type"),
        (lambda p: (p / "config.json").write_text('{"model_type": "no-such-model"}') and p, "'no-such-model' is unknown to transformers"),
        (lambda p: (p / "config.json").write_text('{"model_type": "vit"}') and p, "cannot build model_type 'vit' as a causal language model"),
        (lambda p: (p / "config.json").write_text('{"model_type": "gpt2"}') and (p / "pytorch_model.bin").write_bytes(b"x") and p, "only safetensors weights are read"),
        (
            lambda p: (p / "config.json").write_text('{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 3}') and p,
            "config.json: transformers refuses it: Class validation error for validator 'validate_architecture': ValueError: The hidden size (32)",
        ),
    ],
)
def test_open_refuses_in_one_line(tmp_path, make, match):
    with pytest.raises(ModelDirError) as e:
        open_model_dir(make(tmp_path))
    assert match in one_line(e)


def test_roles_and_their_families(dirs):
    assert FAMILIES["pipeline"] == ("gpt2", "llama", "qwen2", "mistral") and FAMILIES["experts"] == ("mixtral",)
    for family, d in dirs.items():
        check_role(d, "replica")
    check_role(dirs["gpt2"], "pipeline")
    check_role(dirs["llama"], "pipeline")
    check_role(dirs["mixtral"], "experts")
    with pytest.raises(ModelDirError) as e:
        check_role(dirs["mixtral"], "pipeline")
    assert "trains model types gpt2, llama, qwen2, mistral" in one_line(e) and "'mixtral'" in str(e.value)
    with pytest.raises(ModelDirError) as e:
        check_role(dirs["gpt2"], "experts")
    assert "trains model types mixtral" in one_line(e)
    with pytest.raises(ModelDirError, match="unknown role"):
        check_role(dirs["gpt2"], "janitor")


# ---- building and running -------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(CONFIGS))
def test_forward_gives_logits_and_their_mean_cross_entropy(models, family):
    model = models[family]
    assert isinstance(model, CausalLM) and model.context == 64 and model.vocab_size == VOCAB and model.training
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, VOCAB) and logits.dtype == torch.float32
    # our targets are already shifted: the loss covers every position, unlike HF's labels
    assert torch.equal(loss, F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)))
    assert model(x)[1] is None
    with pytest.raises(ValueError, match="exceeds the model's context 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_same_seed_same_bits_other_seed_other_bits(dirs, models, family):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    again = build_causal_lm(dirs[family].config, seed=0)  # from the config dict, as a member gets it
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone
    other = build_causal_lm(dirs[family], seed=1)
    assert state_hash(again.state_dict()) == state_hash(models[family].state_dict())
    assert state_hash(other.state_dict()) != state_hash(models[family].state_dict())


def test_saved_weights_are_loaded_and_can_be_left_out(tmp_path, models):
    source = models["llama"]
    source.hf.save_pretrained(tmp_path)
    d = open_model_dir(tmp_path)
    assert d.weights == tmp_path / "model.safetensors"
    loaded = build_causal_lm(d, seed=7)
    assert state_hash(loaded.state_dict()) == state_hash(source.state_dict())
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(loaded.eval()(x)[0], source.eval()(x)[0])
    source.train()
    assert state_hash(build_causal_lm(d, seed=7, weights=False).state_dict()) != state_hash(source.state_dict())


def test_mixtral_weights_round_trip(tmp_path, models):
    models["mixtral"].hf.save_pretrained(tmp_path)
    loaded = build_causal_lm(open_model_dir(tmp_path), seed=3)
    assert state_hash(loaded.state_dict()) == state_hash(models["mixtral"].state_dict())


def test_weights_that_do_not_fit_the_config_are_refused_by_tensor(tmp_path, models):
    models["gpt2"].hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(ModelDirError) as e:
        build_causal_lm(open_model_dir(tmp_path), seed=0)
    assert "does not fit config.json: tensor transformer." in one_line(e)
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(ModelDirError) as e:
        build_causal_lm(open_model_dir(tmp_path), seed=0)
    assert "transformer.h.2." in one_line(e) and "missing" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "model.safetensors"
    st = st_load(weights.read_bytes())
    weights.write_bytes(st_save({**st, "extra.weight": torch.zeros(2)}, metadata={"format": "pt"}))
    with pytest.raises(ModelDirError) as e:
        build_causal_lm(open_model_dir(tmp_path), seed=0)
    assert "it holds tensor extra.weight, which the config's model has no place for" in one_line(e)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(ModelDirError) as e:
        build_causal_lm(open_model_dir(tmp_path), seed=0)
    assert one_line(e).startswith(f"cannot load the weights in {weights}: ")


def test_sharded_weights_are_found_by_their_index(tmp_path, models):
    models["gpt2"].hf.save_pretrained(tmp_path, max_shard_size="20KB")
    d = open_model_dir(tmp_path)
    assert d.weights == tmp_path / "model.safetensors.index.json"
    assert state_hash(build_causal_lm(d, seed=1).state_dict()) == state_hash(models["gpt2"].state_dict())


def test_tied_gpt2_state_dict_lists_each_tensor_once_and_round_trips(dirs, models):
    model = models["gpt2"]
    assert model.hf.lm_head.weight is model.hf.transformer.wte.weight
    state = model.state_dict()
    assert "transformer.wte.weight" in state and "lm_head.weight" not in state
    assert model.aliases() == {"lm_head.weight": "transformer.wte.weight"}
    names = [n for n, _ in model.named_parameters()]
    assert set(names) == set(state) and len(names) == len(list(model.parameters()))
    blob = st_save(state)  # safetensors refuses two names on one storage
    fresh = build_causal_lm(dirs["gpt2"], seed=5)
    fresh.load_state_dict(st_load(blob))
    assert fresh.hf.lm_head.weight is fresh.hf.transformer.wte.weight  # still tied
    assert state_hash(fresh.state_dict()) == state_hash(state)
    x = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    assert torch.equal(fresh.eval()(x)[0], model.eval()(x)[0])
    model.train()
    fresh.load_state_dict(model.hf.state_dict())  # hf's own dict, the tied tensor twice, also loads


def test_a_causal_lm_trains_and_evaluates_like_gpt(dirs, models, tmp_path):
    """The replica's path: tokenized corpus -> Batches -> InnerTrainer -> evaluate."""
    (tmp_path / "a.txt").write_text(TEXT)
    corpus = load_corpus(tmp_path / "a.txt", load_tokenizer(dirs["llama"]))
    model = build_causal_lm(dirs["llama"], seed=0)
    cfg = TrainConfig(batch_size=2, warmup_steps=1)
    inner = InnerTrainer(model, cfg, Batches(corpus.train, 0, 1, 2, 16, seed=0))
    losses = [inner.step() for _ in range(3)]
    assert all(0 < v < 10 for v in losses)
    val = evaluate(model, corpus.val, 2, 16, 1, seed=0)
    assert 0 < val < 10 and model.training


# ---- tokenizers -----------------------------------------------------------------------------------


def test_hf_tokenizer_ids_are_the_tokenizer_files(dirs):
    tok = load_tokenizer(dirs["gpt2"])
    assert isinstance(tok, HFTokenizer)
    reference = tokenizers.Tokenizer.from_file(str(dirs["gpt2"].path / "tokenizer.json"))
    assert tok.encode("the lazy fox").tolist() == reference.encode("the lazy fox", add_special_tokens=False).ids
    assert tok.eos_id == reference.token_to_id("<|endoftext|>") and tok.vocab_size <= VOCAB
    assert tok.decode(tok.encode("a swarm of peers")) == "a swarm of peers"
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert ByteTokenizer().encode("hé").tolist() == list("hé".encode())


def test_tokenizer_refusals(tmp_path):
    small = tmp_path / "small"
    write_dir(small, "gpt2")
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ModelDirError) as e:
        load_tokenizer(open_model_dir(small))
    assert "but the model embeds only 100 tokens" in one_line(e)
    (small / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError) as e:
        load_tokenizer(open_model_dir(small))
    assert "no tokenizer.json" in one_line(e)
    bare = write_dir(tmp_path / "bare", "llama", tokenizer=False)
    assert isinstance(load_tokenizer(open_model_dir(bare)), ByteTokenizer)  # from scratch, on bytes
