"""The run's AdamW (node/models/adamw.py) is torch's fused AdamW step for step, reads and writes
torch's state layout, and builds without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch

from node.models.adamw import FusedAdamW
from node.models.diloco import TrainConfig, adamw
from node.models.gpt import GPTConfig, init_model

TINY = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=32)


def _groups(model, cfg):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay}, {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(model, opt, steps: int, lrs=(3e-3, 1e-3, 2e-3)) -> None:
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randint(0, TINY.vocab_size, (2, TINY.context), generator=g)
        for group in opt.param_groups:
            group["lr"] = lrs[i % len(lrs)]
        opt.zero_grad(set_to_none=True)
        model(x, x)[1].backward()
        opt.step()


def test_it_steps_bit_for_bit_as_torchs_fused_adamw_and_their_states_load_into_each_other():
    cfg = TrainConfig()
    ours_model, torch_model = init_model(TINY, seed=0), init_model(TINY, seed=0)
    ours = adamw(ours_model.parameters(), cfg)
    theirs = torch.optim.AdamW(_groups(torch_model, cfg), lr=3e-3, betas=(cfg.beta1, cfg.beta2), fused=True)
    assert isinstance(ours, FusedAdamW)
    _train(ours_model, ours, 4)
    _train(torch_model, theirs, 4)
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)
    saved_ours, saved_theirs = ours.state_dict(), theirs.state_dict()
    assert saved_ours["param_groups"] == saved_theirs["param_groups"]
    for i, s in saved_theirs["state"].items():
        assert all(torch.equal(saved_ours["state"][i][k], v) for k, v in s.items()), i
    # each loads the other's state and they go on stepping as one
    ours.load_state_dict(saved_theirs)
    theirs.load_state_dict(saved_ours)
    _train(ours_model, ours, 3)
    _train(torch_model, theirs, 3)
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)


def test_a_state_of_other_groups_is_refused():
    cfg = TrainConfig()
    opt = adamw(init_model(TINY, seed=0).parameters(), cfg)
    state = opt.state_dict()
    state["param_groups"] = state["param_groups"][:1]
    try:
        opt.load_state_dict(state)
    except ValueError as e:
        assert "other parameter groups" in str(e)
    else:
        raise AssertionError("a state of one group loaded into two")


def test_building_and_stepping_it_does_not_import_torch_dynamo():
    code = (
        "import sys, torch\n"
        "from node.models.diloco import TrainConfig, adamw\n"
        "m = torch.nn.Linear(4, 4)\n"
        "opt = adamw(m.parameters(), TrainConfig())\n"
        "m(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
