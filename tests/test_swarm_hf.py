"""A Hugging Face model trained by a swarm and taken out again, with real coordinator and replica
daemons: the coordinator is given a model directory (a config and a tokenizer, made here), the
replicas fetch its files from it by pin, train it in lockstep on their data, and the kept
checkpoint is exported to a directory `transformers` loads, with the swarm's logits."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.swarm import Swarm, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

RUN = ["--inner-steps", "5", "--checkpoint-every", "3", "--eval-batches", "2", "--warmup-steps", "2", "--batch-size", "8",
       "--min-replicas", "2", "--max-outer-steps", "4", "--join-timeout-s", "8", "--heartbeat-timeout-s", "10"]  # fmt: skip
NODE = ["--threads", "1", "--heartbeat-interval-s", "0.5", "--num-shards", "2"]


def text_data(tmp: Path) -> Path:
    """A few hundred KB of Python sources, as the replicas' data."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((lib / name).read_text() for name in ("argparse.py", "dataclasses.py", "typing.py", "inspect.py"))
    path = tmp / "data.txt"
    path.write_text(text)
    return path


def gpt2_dir(tmp: Path, data: Path) -> Path:
    """A tiny GPT-2: config, weights (a seeded init: the run fine-tunes them) and a byte-level
    BPE tokenizer trained on the data."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(data)], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp / "tiny-gpt2"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(7)
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


def loss_of_weights(src: Path, data: Path) -> float:
    """The validation loss replicas report, of the directory's own weights."""
    from node.models.data import EVAL_SEED, evaluate, load_corpus
    from node.models.hf import build_causal_lm, open_model_dir
    from node.models.tokens import load_tokenizer

    model_dir = open_model_dir(src)
    model = build_causal_lm(model_dir, seed=0, weights=True)
    return evaluate(model, load_corpus(data, tokenizer=load_tokenizer(model_dir)).val, 8, model.context, 2, EVAL_SEED)


def history(swarm: Swarm, name: str) -> list[dict]:
    try:
        return json.loads((Path(swarm.tmp) / name / "replica-stats.json").read_text())["history"]
    except (FileNotFoundError, ValueError, KeyError):
        return []


def test_a_hugging_face_model_trains_on_replicas_and_comes_out_with_the_swarms_logits(swarm, tmp_path):
    data = text_data(tmp_path)
    src = gpt2_dir(tmp_path, data)
    start_loss = loss_of_weights(src, data)
    coord = swarm.coordinator("coordinator", None, None, "--model", str(src), *RUN)
    status = coord.wait_ready()
    pin = status["run"]["model"]
    assert pin.startswith("hf:"), status["run"]
    src.rename(tmp_path / "moved")  # the coordinator keeps its own copy: the source may move
    maddr = status["maddrs"][0]
    names = ["a", "b"]
    for i, n in enumerate(names):
        swarm.node(n, [maddr], *NODE, "--shard-index", str(i), "--data", str(data))

    wait_for(lambda: all(h and h[-1]["outer_step"] >= 4 for h in map(lambda n: history(swarm, n), names)), 240, "4 outer steps on both replicas")
    hashes = [{e["outer_step"]: e["state_hash"] for e in history(swarm, n)} for n in names]
    assert all(hashes[0][k] == hashes[1][k] for k in range(1, 5)), hashes
    h = history(swarm, "a")
    assert h[0]["outer_step"] == 0 and h[0]["val_loss"] == pytest.approx(start_loss, abs=1e-4)  # fine-tuning: from the weights
    assert h[-1]["val_loss"] < h[0]["val_loss"] - 0.3, [(e["outer_step"], e.get("val_loss")) for e in h]
    for n in names:  # each fetched the files of the pin, and nothing else
        fetched = Path(swarm.tmp) / n / "model" / pin[3:]
        assert sorted(p.name for p in fetched.iterdir()) == sorted(["index.json", *(p.name for p in (tmp_path / "moved").iterdir() if p.suffix == ".json" and p.name != "config.json"), "config.json"])

    # the kept checkpoint out, as a directory transformers loads, with the swarm's logits
    # (step 3's upload may still be on its way when step 4, the run's last, is due: the last follows it)
    wait_for(lambda: 4 in [c["step"] for c in coord.status()["checkpoints"]], 60, "the last outer step's checkpoint kept")
    kept = [4]  # the newest: what export takes
    out = tmp_path / "exported"
    model_cli("export", "--checkpoint", str(Path(swarm.tmp) / "coordinator"), "--out", str(out))
    check_logits(out, Path(swarm.tmp) / "coordinator", max(kept))
    # its validation loss, on the replicas' windows of the same data, is the one they reported
    run = model_cli("eval", "--model", str(out), "--data", str(data), "--batches", "2", "--batch-size", "8")
    reported = {e["outer_step"]: e["val_loss"] for e in history(swarm, "a")}[max(kept)]
    assert float(run.stdout.split()[1]) == pytest.approx(reported, abs=1e-4), (run.stdout, reported)
    run = model_cli("sample", "--model", str(out), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    assert run.stdout.startswith("def ") and len(run.stdout) > len("def \n"), run.stdout  # the prompt and what the model adds (newlines, this early)


def model_cli(*args: str) -> subprocess.CompletedProcess:
    """swarmtrain-model in this process (transformers is loaded once, not per command)."""
    from node.model_cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    assert code == 0, err.getvalue()
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def check_logits(out: Path, coordinator_dir: Path, step: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.models.hf import build_causal_lm, open_model_dir
    from node.state.checkpoint_dir import load_checkpoint_dir
    from protocol.manifest import step_dir_name

    state = load_checkpoint_dir(coordinator_dir / "checkpoints" / step_dir_name(step))
    pin = json.loads((coordinator_dir / "checkpoints" / step_dir_name(step) / "manifest.json").read_text())["model_config"]["model"]
    swarm_model = build_causal_lm(open_model_dir(coordinator_dir / "model" / pin[3:]), seed=0, weights=False)
    swarm_model.load_state_dict(state["model"])
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = AutoTokenizer.from_pretrained(out)("def main(argv=None):\n    return 0\n", return_tensors="pt").input_ids
    with torch.no_grad():
        want, _ = swarm_model.eval()(tokens)
        got = loaded(tokens).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
