"""`swarmtrain-model` on a pipeline run: each stage's checkpoints written by the coordinator's own
store into a coordinator's data dir, as the stage servers' uploads leave them; every stage's
newest put together into one Hugging Face directory that transformers loads alone, whose logits
equal the swarm's. The built-in GPT (Stage.from_gpt) and Hugging Face GPT-2 (tied head) and Llama
models (their state split by decoder layer, as the pipeline contract names tensors). A missing
stage is one line and exit 2. No hub, no swarm processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coordinator.checkpoints import CheckpointStore
from node.model_cli import main
from node.models.data import EVAL_SEED, evaluate, load_corpus
from node.models.diloco import state_hash
from node.models.export import ExportError
from node.models.gpt import GPT, PRESETS, init_model
from node.models.hf import build_causal_lm, open_model_dir
from node.models.stage_merge import StageMeta, check_blocks, merge_stages, one_cut
from node.models.stages import Stage, plan_stages
from node.state.model_files import pack_model_files
from protocol.signatures import SigningKey

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

ROOT = Path(__file__).resolve().parent.parent
CFG = PRESETS["tiny"]
VOCAB = 320



def perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every tensor random, biases and norms too (init leaves them 0 and 1, which would hide a
    bias or a gain put in the wrong place)."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


def save_stage(coord: Path, index: int, step: int, tensors: dict[str, torch.Tensor], meta: dict, key: SigningKey) -> None:
    """A stage's state as the coordinator keeps it (coordinator/service.py: one store per stage,
    signed by its key): the stage's parameters and outer momentum, the hash its peers agreed on."""
    model = {n: t.detach().clone() for n, t in tensors.items()}
    state = {"model": model, "outer": {n: torch.full_like(t, 0.01) for n, t in model.items()}}
    store = CheckpointStore(coord / "stage-checkpoints" / f"stage-{index}", keep=3, signing_key=key)
    store.save(step, state, meta, state_hash(model))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


# ---- the built-in GPT -----------------------------------------------------------------------------

GPT_STEPS = {0: 12, 1: 10}  # stages step independently: the newest of each is taken


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> tuple[Path, GPT, tuple]:
    """A pipeline coordinator's data dir: the tiny GPT cut into 2 stages, each stage with an older
    checkpoint (of other weights) and its newest (of `model`'s)."""
    coord, key = tmp_path_factory.mktemp("coord"), SigningKey.generate()
    (coord / "checkpoints").mkdir()  # the coordinator makes its replica store in every mode
    model, older = perturbed(init_model(CFG, 0), 0), perturbed(init_model(CFG, 1), 1)
    plan = plan_stages(CFG, 2)
    for i in range(len(plan)):
        meta = {**CFG.to_dict(), "stage": i, "blocks": list(plan[i]), "num_stages": len(plan)}  # what a stage server's manifest says
        save_stage(coord, i, GPT_STEPS[i] - 4, dict(Stage.from_gpt(older, i, plan).named_parameters()), meta, key)
        save_stage(coord, i, GPT_STEPS[i], dict(Stage.from_gpt(model, i, plan).named_parameters()), meta, key)
    return coord, model, plan


@pytest.fixture(scope="module")
def gpt_exported(gpt_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "model"
    assert main(["export", "--checkpoint", str(gpt_run[0]), "--out", str(out)]) == 0
    return out


def test_a_builtin_pipeline_exports_as_one_gpt2_whose_logits_are_the_swarms(gpt_run, gpt_exported):
    _, model, plan = gpt_run
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in gpt_exported.iterdir()}
    hf = load(gpt_exported)
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.n_layer == CFG.n_layer
    stages = [Stage.from_gpt(model, i, plan).eval() for i in range(len(plan))]
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, whole = hf(input_ids=idx).logits, model(idx)[0]
        swarm = stages[1](stages[0](idx))[0]  # what the pipeline computes, stage by stage
        assert (theirs - whole).abs().max().item() < 1e-5
        assert (theirs - swarm).abs().max().item() < 1e-5
        short = idx[:, :7]
        assert (hf(input_ids=short).logits - model(short)[0]).abs().max().item() < 1e-5


def test_the_output_says_which_step_of_each_stage_was_taken(gpt_run, tmp_path, capsys):
    code, printed, err = run(capsys, "export", "--checkpoint", gpt_run[0], "--out", tmp_path / "out")
    assert code == 0 and err == "", err
    assert "the 2 stages of" in printed and "stage 0 at step 12, stage 1 at step 10" in printed and "GPT2LMHeadModel" in printed


def test_the_stage_checkpoints_dir_itself_gives_the_same_model(gpt_run, gpt_exported, tmp_path, capsys):
    code, _, err = run(capsys, "export", "--checkpoint", gpt_run[0] / "stage-checkpoints", "--out", tmp_path / "same")
    assert code == 0, err
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == (gpt_exported / "model.safetensors").read_bytes()


def test_a_damaged_newest_stage_checkpoint_is_skipped_for_that_stages_older_one(gpt_run, tmp_path, capsys):
    coord = shutil.copytree(gpt_run[0], tmp_path / "coord")
    (coord / "stage-checkpoints" / "stage-1" / "step-00000010" / "model.safetensors").write_bytes(b"x" * 8)
    code, printed, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "out")
    assert code == 0 and "stage 0 at step 12, stage 1 at step 6" in printed
    assert "skipping" in err and "stage-1/step-00000010" in err


def test_sample_and_eval_take_a_pipelines_checkpoint_path(gpt_run, tmp_path, capsys):
    coord, model, _ = gpt_run
    code, printed, err = run(capsys, "sample", "--checkpoint", coord, "--prompt", "def ", "--max-new-tokens", 20, "--temperature", 0)
    assert code == 0 and "stage 1 at step 10" in err, err
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert printed == bytes(ids).decode(errors="replace") + "\n"
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 4 + b"def f(x):\n    return x ** 2\n" * 60)
    code, printed, err = run(capsys, "eval", "--checkpoint", coord, "--data", text, "--batches", 2, "--batch-size", 4)
    assert code == 0, err
    loss = float(re.match(r"val_loss (\S+) ", printed).group(1))
    assert abs(loss - evaluate(model, load_corpus(text).val, 4, CFG.context, 2, EVAL_SEED)) < 1e-5


def test_a_data_dir_with_replica_and_stage_checkpoints_gives_the_kind_written_last(gpt_run, tmp_path, capsys):
    """A pipeline whose model came with weights keeps them as a replica checkpoint (step 0) beside
    the stages' (coordinator/checkpoints.py weights_as_first_checkpoint)."""
    coord = shutil.copytree(gpt_run[0], tmp_path / "coord")
    initial = {n: p.detach().clone() for n, p in init_model(CFG, 5).named_parameters()}
    replica = CheckpointStore(coord / "checkpoints", keep=3).save(0, {"model": initial}, CFG.to_dict(), state_hash(initial)).path
    os.utime(replica, (1e9, 1e9))  # written before the stages'
    code, printed, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "stages")
    assert code == 0 and "the 2 stages of" in printed and "taking the stages', written last" in err, err
    os.utime(replica, None)  # a replica run after the pipeline's, in the same data dir
    for d in (coord / "stage-checkpoints").glob("stage-*/step-*"):
        os.utime(d, (1e9, 1e9))
    code, printed, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "replica")
    assert code == 0 and printed.startswith("exported step 0 ") and err == "", err
    assert torch.equal(load(tmp_path / "replica").transformer.wte.weight, initial["wte.weight"])


def _remove_dir(coord: Path, stage: int) -> None:
    shutil.rmtree(coord / "stage-checkpoints" / f"stage-{stage}")


def _empty_dir(coord: Path, stage: int) -> None:
    for d in (coord / "stage-checkpoints" / f"stage-{stage}").iterdir():
        shutil.rmtree(d)


def _corrupt_all(coord: Path, stage: int) -> None:
    for d in (coord / "stage-checkpoints" / f"stage-{stage}").iterdir():
        (d / "outer.safetensors").write_bytes(b"x" * 8)


MISSING = {"removed": (_remove_dir, "no such directory"), "empty": (_empty_dir, "no checkpoint in it"), "damaged": (_corrupt_all, "verifies")}


@pytest.mark.parametrize("how", sorted(MISSING))
@pytest.mark.parametrize("stage", [0, 1])
def test_a_missing_stage_is_one_line_naming_it_and_exit_2(gpt_run, tmp_path, capsys, how, stage):
    coord = shutil.copytree(gpt_run[0], tmp_path / "coord")
    make, why = MISSING[how]
    make(coord, stage)
    code, printed, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "out" / "model")
    last = err.strip().splitlines()[-1]  # (a damaged checkpoint is noted as skipped first)
    assert code == 2 and printed == "" and "Traceback" not in err, err
    assert f"stage {stage} of the 2-stage cut has no checkpoint (stage-checkpoints/stage-{stage}: " in last and why in last, err
    assert all(line.startswith("note: skipping") for line in err.strip().splitlines()[:-1]), err
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_missing_stage_with_exit_2(gpt_run, tmp_path):
    coord = shutil.copytree(gpt_run[0], tmp_path / "coord")
    _remove_dir(coord, 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "node.model_cli", "export", "--checkpoint", coord, "--out", tmp_path / "out"],
                       check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: ") and "stage 1 of the 2-stage cut has no checkpoint" in p.stderr
    assert not (tmp_path / "out").exists()


def test_stages_of_two_cuts_or_a_lone_stage_are_refused_in_one_line(gpt_run, tmp_path, capsys):
    coord = shutil.copytree(gpt_run[0], tmp_path / "coord")
    meta = {**CFG.to_dict(), "stage": 1, "blocks": [1, 2], "num_stages": 3}
    save_stage(coord, 1, 20, dict(Stage.from_gpt(gpt_run[1], 1, plan_stages(CFG, 2)).named_parameters()), meta, SigningKey.generate())
    code, _, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "stage 0 is of a 2-stage cut, stage 1 of a 3-stage one" in err, err
    lone = gpt_run[0] / "stage-checkpoints" / "stage-0" / "step-00000012"
    code, _, err = run(capsys, "export", "--checkpoint", lone, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "pipeline stage checkpoint (stage 0) alone" in err and "stage-checkpoints/" in err, err


# ---- the pure parts: the cut, the blocks, the merge -----------------------------------------------


def meta(index: int, blocks: tuple[int, int], num: int = 3, **model) -> StageMeta:
    return StageMeta.of({"model": "hf:" + "a" * 64, **model, "stage": index, "blocks": list(blocks), "num_stages": num})


def test_the_blocks_must_cover_the_model_exactly_once():
    check_blocks([meta(0, (0, 2)), meta(1, (2, 3)), meta(2, (3, 5))], 5)
    cases = [
        ([meta(0, (0, 2)), meta(1, (1, 3)), meta(2, (3, 5))], "block 1 is held by more than one stage: stage 0 (blocks 0..1) and stage 1 (blocks 1..2)"),
        ([meta(0, (0, 2)), meta(1, (3, 4)), meta(2, (4, 5))], "no stage holds block 2 of the model's 5"),
        ([meta(0, (0, 2)), meta(1, (2, 3)), meta(2, (3, 6))], "stage 2 holds blocks 3..5, the model has 5 (0..4)"),
    ]
    for metas, expect in cases:
        with pytest.raises(ExportError) as e:
            check_blocks(metas, 5)
        assert str(e.value) == expect


def test_a_stage_meta_and_one_cut_refuse_what_is_not_one():
    assert one_cut([meta(0, (0, 1)), meta(2, (2, 3))]) == 3
    with pytest.raises(ExportError, match="parts of different models"):
        one_cut([meta(0, (0, 1)), meta(1, (1, 2), model="hf:" + "b" * 64)])
    for bad, expect in [({"stage": 3, "blocks": [0, 1], "num_stages": 3}, "not one of 0..2"), ({"stage": 0, "blocks": [2, 2], "num_stages": 1}, "blocks must be"),
                        ({"stage": 0, "blocks": [0, 1], "num_stages": True}, "num_stages"), ({"blocks": [0, 1]}, "not a pipeline stage's")]:  # fmt: skip
        with pytest.raises(ExportError, match=expect):
            StageMeta.of(bad)


def test_the_merge_takes_each_tensor_once_and_each_block_from_its_stage():
    t = torch.zeros(1)
    first, last = meta(0, (0, 1), 2), meta(1, (1, 2), 2)
    merged = merge_stages([(last, {"h.1.w": t, "head": t}), (first, {"emb": t, "h.0.w": t})], "h")
    assert list(merged) == ["emb", "h.0.w", "h.1.w", "head"]
    with pytest.raises(ExportError, match="tensor emb is held by stage 0 and by stage 1"):
        merge_stages([(first, {"emb": t}), (last, {"emb": t})], "h")
    with pytest.raises(ExportError, match="stage 1 holds block 1 but its checkpoint has h.0.w, of block 0"):
        merge_stages([(first, {"emb": t}), (last, {"h.0.w": t})], "h")


# ---- a Hugging Face model -------------------------------------------------------------------------

HF_CONFIGS = {
    # GPT-2 ties its head to the input embedding; the pipeline unties it. 3 layers, 3 stages.
    "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, vocab_size=VOCAB,
    ),
}
LAYERS = {"gpt2": "transformer.h", "llama": "model.layers"}
FIRST = {"gpt2": ("transformer.wte.", "transformer.wpe."), "llama": ("model.embed_tokens.",)}  # the rest outside layers: the last stage's


def model_dir(path: Path, family: str) -> Path:
    from tests.test_hf_models import train_tokenizer

    path.mkdir(parents=True)
    HF_CONFIGS[family]().save_pretrained(path)
    train_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def split_by_layer(state: dict[str, torch.Tensor], family: str, cut: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """The pipeline contract: transformers' own names, each decoder layer on the stage that holds
    it, embeddings on the first stage, the final norm and the head on the last."""
    stages: list[dict[str, torch.Tensor]] = [{} for _ in cut]
    for name, t in state.items():
        m = re.match(rf"{re.escape(LAYERS[family])}\.(\d+)\.", name)
        if m:
            stage = next(i for i, (a, b) in enumerate(cut) if a <= int(m.group(1)) < b)
        else:
            stage = 0 if name.startswith(FIRST[family]) else len(cut) - 1
        stages[stage][name] = t
    return stages


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_run(request, tmp_path_factory):
    """A pipeline coordinator's data dir for a Hugging Face model: its files packed under their pin
    (as coordinator/config.py resolve_model does), its state split into stage checkpoints; the
    last stage holds `lm_head.weight` as its own tensor, trained apart from the embedding."""
    family = request.param
    root = tmp_path_factory.mktemp(f"hf-{family}")
    src, coord = model_dir(root / "src", family), root / "coord"
    pin = pack_model_files(src, coord / "model")
    whole = perturbed(build_causal_lm(open_model_dir(src), seed=0), 3)
    state = whole.state_dict()
    head = whole.hf.get_output_embeddings().weight
    if "lm_head.weight" not in state:  # tied: the last stage's own copy, trained on by then
        state["lm_head.weight"] = head.detach().clone() + 0.05 * torch.randn(head.shape, generator=torch.Generator().manual_seed(7))
    n = whole.hf.config.num_hidden_layers
    cut = [(i, i + 1) for i in range(n)]
    key = SigningKey.generate()
    for i, tensors in enumerate(split_by_layer(state, family, cut)):
        save_stage(coord, i, 5 + i, tensors, {"model": pin, "stage": i, "blocks": list(cut[i]), "num_stages": len(cut)}, key)
    out = root / "exported"
    assert main(["export", "--checkpoint", str(coord), "--out", str(out)]) == 0
    return family, src, coord, whole, state["lm_head.weight"], out


def swarm_logits(whole, head: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """What the pipeline computes: the decoder's last hidden state times the last stage's head."""
    with torch.no_grad():
        return F.linear(whole.hf.base_model(input_ids=idx).last_hidden_state, head)


def test_a_hugging_face_pipeline_exports_with_the_swarms_logits(hf_run):
    family, src, _, whole, head, out = hf_run
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf = load(out)
    assert hf.config.model_type == family
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert hf.get_output_embeddings().weight.data_ptr() != hf.get_input_embeddings().weight.data_ptr()
    assert torch.equal(hf.get_output_embeddings().weight, head)
    assert torch.equal(hf.get_input_embeddings().weight, whole.hf.get_input_embeddings().weight)
    idx = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf(input_ids=idx).logits
    assert (theirs - swarm_logits(whole, head, idx)).abs().max().item() < 1e-5
    if family == "llama":  # untied already: the whole model is the swarm's
        assert (theirs - whole(idx)[0]).abs().max().item() < 1e-5
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_a_tied_config_is_untied_in_the_export_and_the_output_says_so(hf_run, tmp_path, capsys):
    family, src, coord, *_ = hf_run
    assert json.loads((src / "config.json").read_text()).get("tie_word_embeddings", family == "gpt2") is (family == "gpt2")
    code, printed, err = run(capsys, "export", "--checkpoint", coord / "stage-checkpoints", "--out", tmp_path / "out")
    assert code == 0, err
    assert "the run's Hugging Face model (hf:" in printed and ("untied from the input embedding" in printed) is (family == "gpt2")
    assert "stage 0 at step 5, stage 1 at step 6" in printed


def test_sample_at_temperature_0_is_greedy_decoding_of_the_swarms_model(hf_run, capsys):
    _, src, coord, whole, head, _ = hf_run
    code, printed, err = run(capsys, "sample", "--checkpoint", coord, "--prompt", "the quick", "--max-new-tokens", 12, "--temperature", 0)
    assert code == 0, err
    tok = transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
    ids = tok("the quick").input_ids
    for _ in range(12):
        ids.append(int(swarm_logits(whole, head, torch.tensor([ids]))[0, -1].argmax()))
    assert printed == tok.decode(ids) + "\n"


def test_without_the_runs_model_files_a_hugging_face_pipeline_is_refused_in_one_line(hf_run, tmp_path, capsys):
    coord = shutil.copytree(hf_run[2], tmp_path / "coord")
    shutil.rmtree(coord / "model")
    code, printed, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "out")
    assert code == 2 and printed == "" and err.count("\n") == 1 and "whose config and tokenizer the coordinator keeps" in err, err


def test_a_replica_checkpoint_of_the_model_still_exports_by_its_pin(hf_run, tmp_path, capsys):
    """The replica path finds the run's model files the same way (node/state/model_files.py)."""
    _, _, coord, whole, _, _ = hf_run
    shutil.copytree(coord / "model", tmp_path / "coord" / "model")
    pin = "hf:" + next((coord / "model").iterdir()).name
    state = {n: t.detach().clone() for n, t in whole.state_dict().items()}
    CheckpointStore(tmp_path / "coord" / "checkpoints", keep=3).save(4, {"model": state}, {"model": pin}, state_hash(state))
    code, printed, err = run(capsys, "export", "--checkpoint", tmp_path / "coord", "--out", tmp_path / "out")
    assert code == 0 and printed.startswith("exported step 4 ") and "untied" not in printed, err
    idx = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (load(tmp_path / "out")(input_ids=idx).logits - whole(idx)[0]).abs().max().item() < 1e-5
