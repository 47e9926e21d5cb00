"""The GPT model: shapes, causality, deterministic init, config validation, and that it learns."""

import pytest
import torch

from node.models.data import Batches, load_corpus
from node.models.gpt import GPT, PRESETS, GPTConfig, init_model

TINY = PRESETS["tiny"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: a second intra-op thread makes them ~1.5x faster on an idle machine
    but up to 10x slower while another process holds a core (measured on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_forward_shapes_with_and_without_targets():
    model = init_model(TINY, seed=0)
    idx = torch.randint(0, 256, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 256) and loss is None
    logits, loss = model(idx, idx)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # untrained: close to uniform over 256 bytes, i.e. ln 256 ≈ 5.545 nats
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_forward_refuses_bad_input():
    model = init_model(TINY, seed=0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model(torch.zeros(1, TINY.context + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(5, dtype=torch.long))


def test_attention_is_causal():
    model = init_model(TINY, seed=0).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # earlier positions cannot see position 10
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_init_is_bitwise_deterministic_and_ignores_global_rng():
    torch.manual_seed(1)
    a = init_model(TINY, seed=7).state_dict()
    torch.manual_seed(2)
    b = init_model(TINY, seed=7).state_dict()
    c = init_model(TINY, seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


def test_presets_param_counts():
    assert init_model(PRESETS["tiny"], 0).num_params() == 136_960
    assert init_model(PRESETS["small"], 0).num_params() == 867_072  # ~0.87M


def test_no_shared_parameters_in_state_dict():
    # safetensors refuses tensors that share memory: the head must not be tied to the embedding
    sd = init_model(TINY, 0).state_dict()
    ptrs = [t.data_ptr() for t in sd.values()]
    assert len(ptrs) == len(set(ptrs))


def test_config_round_trip():
    cfg = GPTConfig(n_layer=3, n_embd=96, n_head=3, dropout=0.1)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    assert GPTConfig.from_dict({}) == GPTConfig()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n_embd": 100, "n_head": 3}, "divisible by n_head"),
        ({"n_layer": 0}, "n_layer must be a positive int"),
        ({"context": 6.5}, "context must be a positive int"),
        ({"vocab_size": True}, "vocab_size must be a positive int"),
        ({"dropout": 1.0}, r"dropout must be a number in \[0, 1\)"),
        ({"dropout": "0.1"}, "dropout must be a number"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        GPTConfig.from_dict(kwargs)


def test_from_dict_rejects_unknown_keys_and_non_dicts():
    with pytest.raises(ValueError, match="unknown GPTConfig field.*n_layers"):
        GPTConfig.from_dict({"n_layers": 2})
    with pytest.raises(ValueError, match="needs a dict"):
        GPTConfig.from_dict([("n_layer", 2)])


def test_model_rejects_non_config():
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"n_layer": 2})


def test_loss_decreases_on_the_corpus():
    torch.manual_seed(0)
    corpus = load_corpus()
    model = init_model(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = Batches(corpus.train, 0, 1, batch_size=16, context=TINY.context, seed=0)
    losses = []
    for _ in range(30):
        x, y = batches.next()
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
