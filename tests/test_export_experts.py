"""`swarmtrain-model export` of an experts run: a coordinator's data dir with each shard's experts
and the trainers' dense parts kept (as coordinator/expert_stores.py keeps them) comes out as one
Hugging Face Mixtral directory that transformers loads, with the logits of the model they were
cut from; a shard without a checkpoint, a built-in preset's run and one part alone are refused in
one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from coordinator.expert_stores import ExpertStores
from node.model_cli import main
from node.models.hf import build_causal_lm
from node.models.mixtral import MixtralExpertShard, mixtral_layout
from node.state.model_files import pack_model_files
from tests.test_mixtral import tiny_config

pytestmark = pytest.mark.timeout(120)

SHARDS = 3


def trained(config: dict):
    """A Mixtral whose parameters are not an init's (each moved by its own noise)."""
    model = build_causal_lm(config, seed=1)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def run_dir(tmp_path, model, config: dict):
    """A coordinator's data dir of an experts run of `model` in SHARDS shards: its model files,
    each shard's checkpoint and the dense parts', as the coordinator keeps them."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    coord = tmp_path / "coordinator"
    pin = pack_model_files(src, coord / "model")
    stores = ExpertStores(coord / "expert-checkpoints", SHARDS, keep=2, signing_key=None)
    layout = mixtral_layout(model.hf.config)
    for i, store in stores.shards.items():
        names = layout.shard(i, SHARDS)
        experts = {n: p.detach().clone() for n, p in MixtralExpertShard(model, names).named_parameters()}
        store.save(100 + i, {"model": experts}, model_config={"model": pin, "expert_shard": i, "experts": list(names)})
    dense = {n: t for n, t in model.state_dict().items() if ".mlp.experts." not in n}
    stores.dense.save(105, {"model": dense}, model_config={"model": pin, "dense": True})
    return coord


def export(capsys, *argv):
    code = main(["export", *argv])
    return code, capsys.readouterr()


def test_the_shards_and_dense_parts_come_out_as_one_mixtral_with_the_models_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    config = tiny_config()
    model = trained(config)
    coord = run_dir(tmp_path, model, config)
    out = tmp_path / "exported"
    code, io = export(capsys, "--checkpoint", str(coord), "--out", str(out))
    assert code == 0, io.err
    assert "3 shards (shard 0 step 100, shard 1 step 101, shard 2 step 102), dense parts step 105" in io.out
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "MixtralForCausalLM"
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = model.eval()(x)
        got = loaded(x).logits
    assert (got - want).abs().max() < 1e-5
    assert (out / "tokenizer.json").is_file()  # bytes, as it trained


def one_line_refusal(capsys, coord, tmp_path) -> str:
    code, io = export(capsys, "--checkpoint", str(coord), "--out", str(tmp_path / "never"))
    assert code == 2 and io.err.startswith("error: ") and io.err.count("\n") == 1, io.err
    assert not (tmp_path / "never").exists()
    return io.err


def test_a_shard_without_a_checkpoint_is_refused_by_name(tmp_path, capsys):
    config = tiny_config()
    coord = run_dir(tmp_path, trained(config), config)
    for step in (coord / "expert-checkpoints" / "shard-1").iterdir():
        shutil.rmtree(step)
    assert "shard 1 has no kept checkpoint" in one_line_refusal(capsys, coord, tmp_path)
    shutil.rmtree(coord / "expert-checkpoints" / "shard-1")
    assert "shard 1 has no store" in one_line_refusal(capsys, coord, tmp_path)
    shutil.rmtree(coord / "expert-checkpoints" / "shard-2")  # (then the run looks like one of a single shard, whose experts are not all here)
    assert "shard 0's checkpoint has no tensor layer0.expert1.down_proj, which one of 1 shards (the stores found) holds" in one_line_refusal(capsys, coord, tmp_path)


def test_the_dense_parts_missing_one_part_alone_and_a_preset_run_are_refused(tmp_path, capsys):
    config = tiny_config()
    coord = run_dir(tmp_path, trained(config), config)
    shard = next((coord / "expert-checkpoints" / "shard-0").iterdir())
    assert "one part of an experts run" in one_line_refusal(capsys, shard, tmp_path)
    for step in (coord / "expert-checkpoints" / "dense").iterdir():
        shutil.rmtree(step)
    assert "the trainers' dense parts have no kept checkpoint" in one_line_refusal(capsys, coord, tmp_path)

    preset = tmp_path / "preset"
    stores = ExpertStores(preset / "expert-checkpoints", 1, keep=1, signing_key=None)
    meta = {"n_layer": 2, "moe": {"num_experts": 4}}
    stores.shards[0].save(1, {"model": {"layer0_expert0.c_fc.weight": torch.zeros(2, 2)}}, model_config={**meta, "expert_shard": 0, "experts": []})
    stores.dense.save(1, {"model": {"wte.weight": torch.zeros(2, 2)}}, model_config={**meta, "dense": True})
    assert "a built-in MoE preset (tiny-moe, small-moe), which has no Hugging Face class" in one_line_refusal(capsys, preset, tmp_path)
