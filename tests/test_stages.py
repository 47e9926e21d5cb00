"""The built-in GPT cut into pipeline stages: plans, what each stage holds, and that the chained
stages compute, forward and backward, exactly what the whole model computes."""

import pytest
import torch

from node.models.gpt import PRESETS, GPTConfig, init_model
from node.models.stages import Stage, StageInputError, init_stage, plan_stages

CFG = GPTConfig(n_layer=5, n_embd=32, n_head=4, context=16)


def test_blocks_are_spread_evenly_the_middle_stages_taking_the_extra_ones_first():
    # the stages at the ends also hold the embeddings (first) and the head and loss (last):
    # the middle ones take what does not divide, then the first, then the last
    assert plan_stages(CFG, 1) == ((0, 5),)
    assert plan_stages(CFG, 2) == ((0, 3), (3, 5))
    assert plan_stages(CFG, 3) == ((0, 2), (2, 4), (4, 5))
    assert plan_stages(CFG, 5) == tuple((i, i + 1) for i in range(5))
    cfg = GPTConfig(n_layer=8, n_embd=32, n_head=4)
    assert [e - s for s, e in plan_stages(cfg, 3)] == [3, 3, 2]
    assert [e - s for s, e in plan_stages(cfg, 5)] == [1, 2, 2, 2, 1]
    assert plan_stages(CFG, 3, [1, 3, 1]) == ((0, 1), (1, 4), (4, 5))  # as the run config says


@pytest.mark.parametrize(
    "num_stages, counts, message",
    [
        (0, None, "num_stages must be a positive int"),
        (6, None, "exceeds the model's 5 blocks"),
        (2, [2, 2], "add up to 4, the model has 5 blocks"),
        (2, [5, 0], "must be positive ints"),
        (3, [2, 3], "2 given for 3 stages"),
    ],
)
def test_a_plan_that_cannot_be_served_is_refused_with_its_reason(num_stages, counts, message):
    with pytest.raises(ValueError, match=message):
        plan_stages(CFG, num_stages, counts)


def test_each_stage_holds_only_its_own_layers_under_the_models_names():
    model = init_model(CFG, seed=3)
    plan = plan_stages(CFG, 3)
    stages = [Stage.from_gpt(model, i, plan) for i in range(3)]
    names = [set(s.state_dict()) for s in stages]
    assert names[0] & names[1] == names[1] & names[2] == names[0] & names[2] == set()
    assert names[0] | names[1] | names[2] == set(model.state_dict())
    assert {n.split(".")[0] for n in names[0]} == {"wte", "wpe", "blocks"}
    assert {n.split(".")[0] for n in names[1]} == {"blocks"}
    assert {n.split(".")[0] for n in names[2]} == {"blocks", "ln_f", "lm_head"}
    for s, (start, end) in zip(stages, plan):
        assert {int(n.split(".")[1]) for n in s.state_dict() if n.startswith("blocks.")} == set(range(start, end))
    assert sum(s.num_params() for s in stages) == model.num_params()
    # the middle stage of a real preset holds a fraction of the model
    small = PRESETS["small"]
    middle = init_stage(small, 1, plan_stages(small, 4), seed=0)
    assert middle.num_params() < init_model(small, 0).num_params() / 4


def test_a_stage_made_from_the_seed_has_the_whole_models_bits():
    plan = plan_stages(CFG, 2)
    model = init_model(CFG, seed=7)
    for i in range(2):
        stage = init_stage(CFG, i, plan, seed=7)
        whole = model.state_dict()
        assert all(torch.equal(v, whole[k]) for k, v in stage.state_dict().items())


def test_chained_stages_compute_the_models_loss_and_gradients_bit_for_bit():
    torch.manual_seed(0)
    model = init_model(CFG, seed=1)
    plan = plan_stages(CFG, 3)
    stages = [Stage.from_gpt(model, i, plan) for i in range(3)]
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.context))
    targets = torch.randint(0, CFG.vocab_size, (4, CFG.context))

    logits, loss = model(idx, targets)
    loss.backward()

    # forward stage by stage, each boundary crossed as a detached copy (as over the wire)
    inputs, outputs = [idx], []
    for s in stages[:-1]:
        out = s(inputs[-1])
        outputs.append(out)
        inputs.append(out.detach().clone().requires_grad_(True))
    s_logits, s_loss = stages[-1](inputs[-1], targets)
    assert torch.equal(s_logits, logits) and torch.equal(s_loss, loss)
    # backward stage by stage: each gets the gradient of its output from the next one
    s_loss.backward()
    for s in reversed(range(len(stages) - 1)):
        outputs[s].backward(inputs[s + 1].grad)
    whole = dict(model.named_parameters())
    for s in stages:
        for name, p in s.named_parameters():
            assert torch.equal(p.grad, whole[name].grad), name


@pytest.mark.parametrize(
    "stage, x, message",
    [
        (0, torch.zeros(2, 8), "token ids must be int64"),
        (0, torch.zeros(2, 8, 3, dtype=torch.int64), "token ids must be \\(batch, time\\)"),
        (0, torch.full((2, 8), 256, dtype=torch.int64), "token ids must be in \\[0, 256\\)"),
        (0, torch.zeros(2, 17, dtype=torch.int64), "sequence length 17 exceeds the model's context 16"),
        (1, torch.zeros(2, 8, 32, dtype=torch.float16), "activations must be float32"),
        (1, torch.zeros(2, 8, 31), "activations must be \\(batch, time, 32\\)"),
        (1, torch.full((2, 8, 32), float("nan")), "NaN or Inf"),
        (2, torch.zeros(0, 8, 32), "empty batch"),
    ],
)
def test_what_a_stage_cannot_compute_on_is_refused_naming_the_problem(stage, x, message):
    s = init_stage(CFG, stage, plan_stages(CFG, 3), seed=0)
    with pytest.raises(StageInputError, match=message):
        s(x)


def test_targets_of_the_wrong_shape_are_refused_by_the_last_stage():
    s = init_stage(CFG, 1, plan_stages(CFG, 2), seed=0)
    with pytest.raises(StageInputError, match="targets must be \\(2, 8\\)"):
        s(torch.zeros(2, 8, 32), torch.zeros(2, 9, dtype=torch.int64))
