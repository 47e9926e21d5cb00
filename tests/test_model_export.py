"""`swarmtrain-model`: a replica checkpoint written as the swarm writes it, exported through the
CLI, loaded back by transformers alone; its logits, tokens, samples and loss equal our GPT's.
Bad input is one line and exit 2 and writes nothing. No hub, no swarm processes."""

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

from node.model_cli import main
from node.models.data import EVAL_SEED, evaluate, load_corpus
from node.models.gpt import PRESETS, GPT, init_model
from node.roles.replica import replica_hash
from node.state.checkpoint_dir import write_checkpoint_dir
from protocol.signatures import SigningKey

transformers = pytest.importorskip("transformers")

BIN = Path(sys.executable).parent
CFG = PRESETS["tiny"]
TEXTS = ["hello world", "  two  spaces\n\ttab\r\n", "é€😀 naïve café", "\x00\x01\x7f", "def f(x):\n    return x ** 2\n"]


def trained_like(seed: int) -> GPT:
    """A tiny GPT whose every tensor is random, biases and LayerNorms too (init leaves them 0 and
    1, which would hide a bias or gain put in the wrong place)."""
    model = init_model(CFG, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def replica_state(model: GPT) -> dict[str, dict[str, torch.Tensor]]:
    """What a replica saves (node/roles/replica.py _state_tensors): outer params and momentum."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"model": params, "outer": {n: torch.full_like(p, 0.01) for n, p in params.items()}}


def save(root: Path, step: int, state, model_config=None, key: SigningKey | None = None) -> Path:
    meta = CFG.to_dict() if model_config is None else model_config
    return write_checkpoint_dir(root, step, state, meta, replica_hash(state) if "model" in state else None, signing_key=key)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory):
    """A coordinator's data dir with two signed checkpoints (steps 5 and 10) and their models."""
    coord = tmp_path_factory.mktemp("coord")
    key = SigningKey.generate()
    models = {step: trained_like(step) for step in (5, 10)}
    for step, model in models.items():
        save(coord / "checkpoints", step, replica_state(model), key=key)
    return coord, models


@pytest.fixture(scope="module")
def exported(swarm_run, tmp_path_factory):
    coord, models = swarm_run
    out = tmp_path_factory.mktemp("export") / "model"
    assert main(["export", "--checkpoint", str(coord), "--out", str(out)]) == 0
    return out, models[10]


def test_transformers_loads_a_gpt2_whose_logits_are_ours(exported):
    out, ours = exported
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.config.tie_word_embeddings is False
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, mine = hf(input_ids=idx).logits, ours(idx)[0]
    assert (theirs - mine).abs().max().item() < 1e-5
    short = idx[:, :7]  # a shorter input, so positions and the causal mask are taken, not assumed
    with torch.no_grad():
        assert (hf(input_ids=short).logits - ours(short)[0]).abs().max().item() < 1e-5


def test_a_coordinator_dir_gives_its_newest_checkpoint_and_a_step_dir_gives_itself(swarm_run, exported, tmp_path, capsys):
    coord, models = swarm_run
    out, newest = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(hf.transformer.wte.weight, newest.wte.weight)
    code, printed, err = run(capsys, "export", "--checkpoint", coord / "checkpoints" / "step-00000005", "--out", tmp_path / "five")
    assert code == 0 and "step 5" in printed and err == ""  # no progress bars, no advice
    five = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "five", local_files_only=True)
    assert torch.equal(five.transformer.wte.weight, models[5].wte.weight)
    assert torch.equal(five.transformer.h[1].attn.c_attn.weight, models[5].blocks[1].attn.c_attn.weight.t())


def test_a_damaged_newest_checkpoint_is_skipped_as_the_coordinator_skips_it(swarm_run, tmp_path, capsys):
    coord = shutil.copytree(swarm_run[0], tmp_path / "coord")
    (coord / "checkpoints" / "step-00000010" / "outer.safetensors").write_bytes(b"x" * 8)
    code, printed, err = run(capsys, "export", "--checkpoint", coord, "--out", tmp_path / "out")
    assert code == 0 and "step 5" in printed and "skipping" in err and "outer.safetensors" in err
    five = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert torch.equal(five.lm_head.weight, swarm_run[1][5].lm_head.weight)


def test_the_tokenizer_is_bytes(exported):
    # the class name transformers 4 knows too (5 writes TokenizersBackend)
    assert json.loads((exported[0] / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = transformers.AutoTokenizer.from_pretrained(exported[0], local_files_only=True)
    assert sorted(tok.get_vocab().values()) == list(range(256))
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == list(text.encode()), text
        assert tok.decode(ids) == text
    assert tok.decode(list(range(32, 127))) == bytes(range(32, 127)).decode()


def test_sample_prints_our_greedy_continuation(exported, capsys):
    out, ours = exported
    code, printed, err = run(capsys, "sample", "--model", out, "--prompt", "def ", "--max-new-tokens", 80, "--temperature", 0)
    assert code == 0, err
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(80):  # past the context (64): the input is cropped, as the CLI does
            ids.append(int(ours(torch.tensor([ids[-CFG.context :]]))[0][0, -1].argmax()))
    assert printed == bytes(ids).decode(errors="replace") + "\n"
    code, sampled, _ = run(capsys, "sample", "--model", out, "--prompt", "x", "--max-new-tokens", 30, "--seed", 3)
    assert code == 0 and sampled.startswith("x") and len(sampled) > 2
    assert run(capsys, "sample", "--model", out, "--prompt", "x", "--max-new-tokens", 30, "--seed", 3)[1] == sampled


def test_sample_of_a_checkpoint_path_is_sample_of_its_export(swarm_run, exported, capsys):
    argv = ("sample", "--prompt", "x", "--max-new-tokens", 30, "--seed", 3)
    code, of_export, _ = run(capsys, *argv, "--model", exported[0])
    code2, of_checkpoint, err = run(capsys, *argv, "--checkpoint", swarm_run[0])
    assert code == code2 == 0 and of_checkpoint == of_export and "step 10" in err, err
    with pytest.raises(SystemExit) as e:  # one of the two, not both
        main(["sample", "--model", str(exported[0]), "--checkpoint", str(swarm_run[0])])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_eval_gives_the_loss_evaluate_gives_our_model(exported, tmp_path, capsys):
    out, ours = exported
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 4 + "".join(TEXTS).encode() * 40)
    code, printed, err = run(capsys, "eval", "--model", out, "--data", text, "--batches", 3, "--batch-size", 5)
    assert code == 0, err
    loss = float(re.match(r"val_loss (\S+) ", printed).group(1))
    assert abs(loss - evaluate(ours, load_corpus(text).val, 5, CFG.context, 3, EVAL_SEED)) < 1e-5


def _stage_dir(root: Path) -> Path:
    return save(root, 3, {"params": {"w": torch.zeros(2)}}, {**CFG.to_dict(), "stage": 0, "blocks": [0, 1], "num_stages": 2})


def _corrupt(root: Path, swarm_run) -> Path:
    """A copy of step 10 whose model file has one byte flipped (its size unchanged)."""
    src = swarm_run[0] / "checkpoints" / "step-00000010"
    dst = shutil.copytree(src, root / src.name)
    data = bytearray((dst / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (dst / "model.safetensors").write_bytes(bytes(data))
    return dst


BAD_EXPORTS = {
    # name: (make the --checkpoint path under a fresh dir, what the one line says)
    "missing": (lambda d, s: d / "nope", "no such file or directory"),
    "no-manifest": (lambda d, s: (d / "empty").mkdir() or d / "empty", "no checkpoint here"),
    "step-dir-without-manifest": (lambda d, s: (d / "step-00000001").mkdir() or d / "step-00000001", "manifest.json is missing"),
    "bad-hash": (_corrupt, "model.safetensors does not match its sha256"),
    "stage": (lambda d, s: _stage_dir(d), "pipeline stage checkpoint"),
    "stage-only-coordinator": (lambda d, s: _stage_dir(d / "stage-checkpoints" / "stage-0").parent.parent.parent, "stage 1 of the 2-stage cut has no checkpoint"),
    "experts": (lambda d, s: save(d, 3, {"experts": {"w": torch.zeros(2)}}, {**CFG.to_dict(), "moe": {"num_experts": 4}}), "expert shard checkpoint"),
    "no-model-config": (lambda d, s: save(d, 3, replica_state(trained_like(0)), {}), "no model_config"),
    "other-model": (lambda d, s: save(d, 3, replica_state(init_model(PRESETS["small"], 0))), "not those of a GPT"),
    "not-a-replica-state": (lambda d, s: save(d, 3, {"optimizer": {"w": torch.zeros(2)}}), "not a replica's model"),
}


@pytest.mark.parametrize("name", sorted(BAD_EXPORTS))
def test_a_bad_checkpoint_is_one_line_and_exit_2_and_writes_nothing(name, swarm_run, tmp_path, capsys):
    make, expect = BAD_EXPORTS[name]
    (tmp_path / "in").mkdir()
    path = make(tmp_path / "in", swarm_run)
    code, printed, err = run(capsys, "export", "--checkpoint", path, "--out", tmp_path / "out" / "model")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expect in lines[0], err
    assert "Traceback" not in err and printed == ""
    assert not (tmp_path / "out").exists()


def test_an_out_dir_in_use_is_refused_and_left_alone(swarm_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(capsys, "export", "--checkpoint", swarm_run[0], "--out", out)
    assert code == 2 and err.count("\n") == 1 and "not an empty directory" in err
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # an empty one is taken
    assert run(capsys, "export", "--checkpoint", swarm_run[0], "--out", out)[0] == 0


@pytest.mark.parametrize(
    "argv, expect",
    [
        (("sample", "--model", "{tmp}/missing"), "no such directory"),
        (("eval", "--model", "{tmp}"), "no config.json"),
        (("sample", "--model", "{out}", "--temperature", "-1"), "--temperature"),
        (("sample", "--model", "{out}", "--prompt", ""), "--prompt is empty"),
        (("eval", "--model", "{out}", "--data", "{tmp}/missing.txt"), "--data"),
        (("eval", "--model", "{out}", "--batches", "0"), "--batches"),
    ],
)
def test_bad_sample_and_eval_input_is_one_line_and_exit_2(argv, expect, exported, tmp_path, capsys):
    code, printed, err = run(capsys, *(a.format(tmp=tmp_path, out=exported[0]) for a in argv))
    assert code == 2 and err.count("\n") == 1 and expect in err and printed == "", err


def test_bad_flags_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "--checkpoint", "x"])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_without_transformers_the_script_says_what_to_install(swarm_run, tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "transformers.py").write_text("raise ImportError('No module named transformers')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([BIN / "swarmtrain-model", "export", "--checkpoint", swarm_run[0], "--out", tmp_path / "out"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "needs transformers" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
