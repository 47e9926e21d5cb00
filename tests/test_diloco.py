"""DiLoCo pieces: lr schedule, outer Nesterov step (math, determinism, state), state hashes,
the inner trainer's guard, and short single-process swarm simulations."""

import contextlib
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.models.data import Batches, load_corpus
from node.models.diloco import (
    adamw,
    InnerTrainer,
    OuterOptimizer,
    TrainConfig,
    copy_into,
    lr_at,
    simulate_diloco,
    state_hash,
    train_sync,
)
from node.models.gpt import GPT, PRESETS, init_model

TINY = PRESETS["tiny"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: a second intra-op thread makes them ~1.5x faster on an idle machine
    but up to 10x slower while another process holds a core (measured on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- config and schedule -------------------------------------------------------------------


def test_train_config_round_trip_and_errors():
    cfg = TrainConfig(inner_steps=7, outer_lr=0.7)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown TrainConfig field.*inner_step"):
        TrainConfig.from_dict({"inner_step": 5})
    with pytest.raises(ValueError, match="inner_steps must be an int ≥ 1"):
        TrainConfig(inner_steps=0)
    with pytest.raises(ValueError, match="outer_momentum must be a number in \\[0, 1\\)"):
        TrainConfig(outer_momentum=1.0)
    with pytest.raises(ValueError, match="inner_lr must be a number > 0"):
        TrainConfig(inner_lr=float("nan"))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(inner_lr=1.0, min_lr_ratio=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1) == lr_at(10_000, cfg)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


# --- outer optimizer -----------------------------------------------------------------------


def test_outer_step_matches_hand_computed_nesterov():
    outer = OuterOptimizer([torch.tensor([1.0, 2.0])], lr=0.5, momentum=0.9)
    # step 1: b = g = [.1, -.2]; update = g + .9 b = 1.9 g; θ = θ - .5 update
    (p,) = outer.apply([torch.tensor([0.1, -0.2])])
    assert torch.allclose(p, torch.tensor([0.905, 2.19]))
    # step 2: b = .9 [.1, -.2] + [.2, 0] = [.29, -.18]; update = [.2 + .261, -.162]
    (p,) = outer.apply([torch.tensor([0.2, 0.0])])
    assert torch.allclose(p, torch.tensor([0.6745, 2.271]))
    assert outer.step_count == 2


def test_outer_step_agrees_with_torch_sgd():
    params = [_randn(37, 5, seed=0), _randn(11, seed=1)]
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9)
    ref = [p.clone().requires_grad_() for p in params]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(5):
        grads = [_randn(*p.shape, seed=10 * step + i) for i, p in enumerate(params)]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        sgd.step()
        outer.apply(grads)
    for mine, theirs in zip(outer.params, ref):
        assert torch.allclose(mine, theirs, atol=1e-5)  # same math; torch fuses mul+add, we do not


def test_pseudo_gradient_is_outer_minus_local():
    outer = OuterOptimizer([torch.tensor([1.0, 2.0])], lr=1.0, momentum=0.9)
    (pg,) = outer.pseudo_gradient([torch.tensor([0.5, 3.0], dtype=torch.float64)])
    assert pg.dtype == torch.float32 and torch.equal(pg, torch.tensor([0.5, -1.0]))


def test_outer_copies_its_params():
    p = torch.ones(3)
    outer = OuterOptimizer([p], lr=1.0, momentum=0.9)
    p.add_(1)
    assert torch.equal(outer.params[0], torch.ones(3))


def test_two_optimizers_fed_the_same_inputs_stay_bitwise_equal():
    params = [_randn(64, 33, seed=0), _randn(7, seed=1)]
    a = OuterOptimizer(params, lr=1.0, momentum=0.9)
    b = OuterOptimizer([p.clone() for p in params], lr=1.0, momentum=0.9)
    for step in range(4):
        grads = [_randn(*p.shape, seed=100 + 10 * step + i) for i, p in enumerate(params)]
        a.apply(grads)
        b.apply([g.clone() for g in grads])
        assert state_hash(a.params) == state_hash(b.params)
        assert state_hash(a.buffers) == state_hash(b.buffers)


# Inputs from numpy: torch.randn itself gives other values under other instruction sets.
_ISA_SCRIPT = """
import numpy as np, torch
from node.models.diloco import OuterOptimizer, state_hash
x = lambda seed, n: torch.from_numpy(np.random.default_rng(seed).standard_normal(n, dtype=np.float32))
outer = OuterOptimizer([x(0, 4099), x(1, 33)], lr=0.7, momentum=0.9)
for step in range(3):
    outer.apply([x(10 + step, 4099), x(20 + step, 33)])
print(torch.backends.cpu.get_cpu_capability(), state_hash(outer.params + outer.buffers))
"""


def test_outer_step_bits_do_not_depend_on_the_cpu_instruction_set():
    # torch.optim.SGD uses fused multiply-add where the CPU has FMA, so its bits change with the
    # machine (measured); ours must not. ATEN_CPU_CAPABILITY=default forces torch's scalar kernels.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(_ISA_SCRIPT, {})
    native = out.getvalue().split()
    scalar = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
        cwd=Path(__file__).parents[1], capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()  # fmt: skip
    assert scalar[0] == "DEFAULT"
    assert native[1] == scalar[1], f"outer step bits differ between {native[0]} and {scalar[0]} kernels"


def test_state_dict_round_trip_continues_bit_exactly():
    params = [_randn(10, 3, seed=0)]
    a = OuterOptimizer(params, lr=0.7, momentum=0.9)
    a.apply([_randn(10, 3, seed=1)])
    state = a.state_dict()
    b = OuterOptimizer([torch.zeros(10, 3)], lr=0.7, momentum=0.9)
    b.load_state_dict(state)
    state["params"][0].add_(1)  # the state dict holds copies
    assert b.step_count == 1 and state_hash(b.params) == state_hash(a.params)
    g = [_randn(10, 3, seed=2)]
    assert state_hash(a.apply(g)) == state_hash(b.apply(g))


def test_outer_refuses_bad_input_without_changing_state():
    outer = OuterOptimizer([torch.ones(2, 2), torch.ones(3)], lr=1.0, momentum=0.9)
    before = state_hash(outer.params + outer.buffers)
    with pytest.raises(ValueError, match="expected 2 tensors, got 1"):
        outer.apply([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"tensor 1 has shape \(4,\), expected \(3,\)"):
        outer.apply([torch.zeros(2, 2), torch.zeros(4)])
    with pytest.raises(ValueError, match="pseudo-gradient 1 has NaN or Inf"):
        outer.apply([torch.zeros(2, 2), torch.tensor([0.0, float("inf"), 0.0])])
    with pytest.raises(ValueError, match="missing 'momentum'"):
        outer.load_state_dict({"params": outer.params, "step": 0})
    assert state_hash(outer.params + outer.buffers) == before and outer.step_count == 0
    with pytest.raises(ValueError, match="momentum in"):
        OuterOptimizer([torch.ones(1)], lr=1.0, momentum=1.0)


# --- state hash ----------------------------------------------------------------------------


def test_state_hash_changes_with_any_element():
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([0.5, -1.5])]
    base = state_hash(tensors)
    assert len(base) == 16 and base == state_hash([t.clone() for t in tensors])
    hashes = {base}
    for i, t in enumerate(tensors):
        for j in range(t.numel()):
            changed = [x.clone() for x in tensors]
            changed[i].view(-1)[j] = torch.nextafter(changed[i].view(-1)[j], torch.tensor(math.inf))
            hashes.add(state_hash(changed))
    assert len(hashes) == 1 + 6 + 2


def test_state_hash_sees_dtype_shape_sign_of_zero_and_keys():
    t = torch.zeros(6)
    assert state_hash([t]) != state_hash([t.reshape(2, 3)])
    assert state_hash([t]) != state_hash([t.double()])
    assert state_hash([t]) != state_hash([-t])  # -0.0 has other bits: "equal" is bitwise
    assert state_hash({"a": t, "b": t + 1}) == state_hash({"b": t + 1, "a": t})  # key order free
    assert state_hash({"a": t, "b": t + 1}) != state_hash({"a": t + 1, "b": t})


# --- inner trainer -------------------------------------------------------------------------


def test_inner_trainer_refuses_a_non_finite_step():
    corpus = load_corpus()
    model = init_model(TINY, seed=0)
    with torch.no_grad():
        model.wte.weight[:] = float("nan")
    trainer = InnerTrainer(model, TrainConfig(), Batches(corpus.train, 0, 1, 2, 16, seed=0))
    before = state_hash(dict(model.state_dict()))
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at inner step 0"):
        trainer.step()
    assert state_hash(dict(model.state_dict())) == before and trainer.step_count == 0


def test_the_runs_adamw_steps_as_torchs_reference_adamw_and_a_loaded_state_keeps_this_devices_kernel():
    corpus = load_corpus()
    cfg = TrainConfig(inner_lr=3e-3, warmup_steps=0)
    fast, ref = init_model(TINY, seed=0), init_model(TINY, seed=0)
    opt = adamw(fast.parameters(), cfg)
    assert opt.param_groups[0]["fused"]  # this CPU has the fused kernel
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    ref_opt = torch.optim.AdamW(groups, lr=3e-3, betas=(cfg.beta1, cfg.beta2), foreach=False)  # one tensor at a time
    batches = Batches(corpus.train, 0, 1, 2, 16, seed=0)
    for _ in range(5):
        x, y = batches.next()
        for model, o in ((fast, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            o.step()
    C = TINY.n_embd
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        if name.endswith("c_attn.bias"):  # not its key part: the loss does not depend on it, its gradient is float noise, which Adam scales up to lr-sized steps
            a, b = torch.cat([a[:C], a[2 * C :]]), torch.cat([b[:C], b[2 * C :]])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

    # a state saved by an optimizer without the fused kernel does not take this one's away
    trainer = InnerTrainer(init_model(TINY, seed=0), cfg, Batches(corpus.train, 0, 1, 2, 16, seed=0))
    saved = {"optimizer": ref_opt.state_dict(), "step": 5}
    assert saved["optimizer"]["param_groups"][0]["fused"] in (None, False)
    trainer.load_state_dict(saved)
    assert all(g["fused"] for g in trainer.opt.param_groups) and trainer.step_count == 5
    trainer.step()  # and it steps from the loaded moments


# --- simulations ---------------------------------------------------------------------------

SIM_CFG = TrainConfig(inner_steps=8, warmup_steps=8, total_steps=200, seed=0)


@pytest.fixture(scope="module")
def sims():
    corpus = load_corpus()
    run = lambda codec: simulate_diloco(TINY, SIM_CFG, corpus, 2, 4, codec=codec, eval_batches=4)
    return {"none": run("none"), "int8": run("int8")}


def test_simulated_swarm_learns(sims):
    h = sims["int8"]["history"]
    assert [e["inner_step"] for e in h] == [0, 8, 16, 24, 32]
    assert h[-1]["val_loss"] < h[0]["val_loss"] - 1.0, h


def test_int8_is_close_to_uncompressed_and_four_times_smaller(sims):
    exact, int8 = sims["none"], sims["int8"]
    assert abs(exact["history"][-1]["val_loss"] - int8["history"][-1]["val_loss"]) < 0.1
    n = init_model(TINY, 0).num_params()
    assert exact["bytes_sent"] == [4 * n * 4] * 2  # fp32, 4 outer steps, both replicas
    assert all(i8 < e / 3.9 for i8, e in zip(int8["bytes_sent"], exact["bytes_sent"]))


def test_one_replica_with_plain_outer_step_is_ordinary_training():
    # outer lr 1, no momentum, exact codec: θ_outer ← θ_local after every round, so DiLoCo with
    # one replica must track plain training on the same data stream (up to fp32 rounding).
    cfg = TrainConfig(inner_steps=5, warmup_steps=5, total_steps=100, outer_lr=1.0, outer_momentum=0.0)
    corpus = load_corpus()
    sim = simulate_diloco(TINY, cfg, corpus, 1, 3, codec="none", eval_batches=2)
    sync = train_sync(TINY, cfg, corpus, 15, eval_every=15, eval_batches=2)
    assert sim["history"][-1]["val_loss"] == pytest.approx(sync["history"][-1]["val_loss"], abs=1e-3)


def test_warm_start_state_is_where_the_swarm_starts():
    corpus = load_corpus()
    cfg = TrainConfig(inner_steps=3, warmup_steps=3, total_steps=50)
    warm = train_sync(TINY, cfg, corpus, 6, eval_every=6, eval_batches=2)
    model = GPT(TINY)
    model.load_state_dict(warm["state"])  # a plain state dict: loads into a fresh model
    sim = simulate_diloco(TINY, cfg, corpus, 2, 1, warm_start_state=warm["state"], eval_batches=2)
    assert sim["history"][0]["val_loss"] == warm["history"][-1]["val_loss"]


def test_copy_into_checks_lengths():
    model = init_model(TINY, 0)
    with pytest.raises(ValueError, match="parameters but 1 values"):
        copy_into(model.parameters(), [torch.zeros(1)])


def test_simulation_refuses_bad_arguments():
    corpus = load_corpus()
    with pytest.raises(ValueError, match="num_replicas must be a positive int"):
        simulate_diloco(TINY, SIM_CFG, corpus, 0, 1)
    with pytest.raises(ValueError, match="eval_every"):
        simulate_diloco(TINY, SIM_CFG, corpus, 1, 1, eval_every=0)
