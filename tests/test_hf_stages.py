"""Hugging Face models cut into pipeline stages: chained, the stages compute the whole model's
logits, loss and gradients; each holds only its layers, under the whole model's names; the tied
GPT-2 head is untied into the last stage; families that cannot be cut and cuts with more stages
than layers are refused in one line. Tiny configs made here; nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from node.models.hf import ModelDirError, build_causal_lm, open_model_dir
from node.models.hf_stages import HFStage, dims_of, init_hf_stage
from node.models.stages import StageInputError, plan_stages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                bos_token_id=None, eos_token_id=None),
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, vocab_size=VOCAB,
    ),  # fmt: skip
    "qwen2": lambda: transformers.Qwen2Config(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, vocab_size=VOCAB, tie_word_embeddings=True,
    ),  # fmt: skip
    "mistral": lambda: transformers.MistralConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, vocab_size=VOCAB, sliding_window=4,
    ),  # fmt: skip
}



def model_dir(tmp_path, family: str):
    path = tmp_path / family
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIGS[family]().to_dict()))
    return open_model_dir(path)


def chain(stages, idx, targets):
    x = idx
    for stage in stages[:-1]:
        x = stage(x)
    return stages[-1](x, targets)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stages_chained_compute_the_whole_model(tmp_path, family, num_stages):
    d = model_dir(tmp_path, family)
    dims = dims_of(d)
    plan = plan_stages(dims, num_stages)
    whole = build_causal_lm(d, seed=3)
    stages = [init_hf_stage(d, i, plan, seed=3) for i in range(num_stages)]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 12), generator=g)
    targets = torch.randint(0, VOCAB, (2, 12), generator=g)
    want_logits, want_loss = whole(idx, targets)
    logits, loss = chain(stages, idx, targets)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    # every tensor once, under the whole model's name, with the whole model's values (the head apart)
    names = [set(s.state_dict()) for s in stages]
    assert sum(len(n) for n in names) == len(set().union(*names))
    whole_state = whole.state_dict()
    for stage in stages:
        for name, t in stage.state_dict().items():
            src = whole_state.get(name, whole.hf.get_output_embeddings().weight if name == "lm_head.weight" else None)
            assert src is not None, name
            assert torch.equal(t, src), name
    assert "lm_head.weight" in names[-1]
    # the gradients of the chained stages are the whole model's
    want_loss.backward()
    loss.backward()
    want = dict(whole.hf.named_parameters(remove_duplicate=False))
    tied = {"lm_head.weight", *whole.aliases().values()} if whole.aliases() else set()
    for stage in stages:
        for name, p in stage.named_parameters():
            if name in tied:
                continue  # the whole model's one tied tensor gathers the embedding's and the head's gradients
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(60)
def test_a_stage_holds_only_its_layers_and_the_tied_head_is_untied(tmp_path):
    d = model_dir(tmp_path, "gpt2")
    plan = plan_stages(dims_of(d), 3)
    first, middle, last = (init_hf_stage(d, i, plan, seed=0) for i in range(3))
    assert set(first.state_dict()) >= {"transformer.wte.weight", "transformer.wpe.weight"}
    assert all(n.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0.")) for n in first.state_dict())
    assert all(n.startswith("transformer.h.1.") for n in middle.state_dict())
    assert set(last.state_dict()) >= {"lm_head.weight", "transformer.ln_f.weight"}
    assert not any(n.startswith(("transformer.wte", "transformer.h.0.", "transformer.h.1.")) for n in last.state_dict())
    assert middle.num_params() < first.num_params()
    # the last stage's head is its own tensor: a step on it leaves the first stage's embedding alone
    emb = first.state_dict()["transformer.wte.weight"].clone()
    with torch.no_grad():
        last.hf.lm_head.weight.add_(1.0)
    assert torch.equal(first.state_dict()["transformer.wte.weight"], emb)
    assert last.hf.config.tie_word_embeddings is False


@pytest.mark.timeout(60)
def test_inputs_are_checked_before_compute(tmp_path):
    d = model_dir(tmp_path, "llama")
    plan = plan_stages(dims_of(d), 2)
    first, last = (init_hf_stage(d, i, plan, seed=0) for i in range(2))
    with pytest.raises(StageInputError, match=r"token ids must be in \[0, 96\)"):
        first(torch.full((1, 4), VOCAB))
    with pytest.raises(StageInputError, match=r"activations must be \(batch, time, 32\)"):
        last(torch.zeros(1, 4, 16))
    with pytest.raises(StageInputError, match="exceeds the model's context 32"):
        first(torch.zeros(1, 33, dtype=torch.int64))
    with pytest.raises(StageInputError, match="NaN or Inf"):
        last(torch.full((1, 4, 32), float("nan")))


def test_families_that_cannot_be_cut_and_too_many_stages_are_refused(tmp_path):
    path = tmp_path / "opt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(transformers.OPTConfig(num_hidden_layers=2, hidden_size=16, ffn_dim=32, num_attention_heads=2, vocab_size=VOCAB).to_dict()))
    with pytest.raises(ModelDirError, match="the pipeline role cuts model types gpt2, llama, qwen2, mistral; .* is 'opt'"):
        dims_of(open_model_dir(path))
    with pytest.raises(ValueError, match=r"num_stages \(4\) exceeds the model's 3 blocks \(decoder layers\)"):
        plan_stages(dims_of(model_dir(tmp_path, "gpt2")), 4)
    with pytest.raises(ModelDirError, match="not 'opt'"):
        HFStage.cut(build_causal_lm(open_model_dir(path), seed=0), 0, ((0, 2),))
