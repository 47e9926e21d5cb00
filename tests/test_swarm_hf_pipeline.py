"""Hugging Face models trained by a pipeline swarm, with real coordinator, stage server and
trainer daemons: the coordinator is given a model directory (made here), the nodes fetch its
files by pin, each stage server builds and holds only its decoder layers, the trainer pushes
micro-batches through them, the loss falls, and the coordinator keeps each stage's checkpoints.

GPT-2 comes with weights (fine-tuning: the stages start from their slices of them, and its tied
head is untied into the last stage); Llama starts from a seeded random init."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.swarm import Swarm, wait_for
from tests.test_swarm_experts_hf import snapshot
from tests.test_swarm_hf import model_cli, text_data

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

RUN = ["--mode", "pipeline", "--num-stages", "2", "--batch-size", "4", "--stage-step-samples", "16", "--micro-batches-in-flight", "2",
       "--warmup-steps", "4", "--inner-lr", "3e-3", "--heartbeat-timeout-s", "10", "--stage-sync-every-s", "2"]  # fmt: skip
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5"]


def model_dir(tmp: Path, family: str) -> Path:
    """A tiny model directory: GPT-2 with seeded weights (tied head, as GPT-2's), Llama config only."""
    import torch
    import transformers

    out = tmp / family
    out.mkdir()
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=3, n_head=2, bos_token_id=None, eos_token_id=None)
        torch.manual_seed(7)
        transformers.GPT2LMHeadModel(config).save_pretrained(out)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=32, vocab_size=256)  # fmt: skip
        (out / "config.json").write_text(json.dumps(config.to_dict()))
    return out


def stats(swarm: Swarm, name: str, kind: str) -> dict:
    try:
        return json.loads((Path(swarm.tmp) / name / f"{kind}-stats.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def weights_hashes(src: Path, num_stages: int) -> dict[int, str]:
    """The hash of each stage's slice of the directory's weights, as a stage server reports it."""
    from node.models.hf import open_model_dir
    from node.models.hf_stages import dims_of, stage_weights
    from node.models.stages import plan_stages

    d = open_model_dir(src)
    return {i: h for i, (_, h) in stage_weights(d, plan_stages(dims_of(d), num_stages)).items()}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_hugging_face_model_trains_in_pipeline_stages(swarm, tmp_path, family):
    data = text_data(tmp_path)
    src = model_dir(tmp_path, family)
    start = weights_hashes(src, 2) if family == "gpt2" else None
    coord = swarm.coordinator("coordinator", None, None, "--model", str(src), *RUN)
    status = coord.wait_ready()
    maddr = status["maddrs"][0]
    servers = ["a", "b"]
    for n in servers:
        swarm.node(n, [maddr], *NODE)
    wait_for(lambda: sorted(stats(swarm, n, "stage").get("stage", -1) for n in servers) == [0, 1], 120, "one stage server per stage")
    swarm.node("t", [maddr], *NODE, "--wanted-role", "trainer", "--data", str(data))
    wait_for(lambda: stats(swarm, "t", "trainer").get("micro_batches", 0) >= 96, 240, "96 micro-batches")

    by_stage = {stats(swarm, n, "stage")["stage"]: stats(swarm, n, "stage") for n in servers}
    # each stage server holds only its decoder layers, under the whole model's names
    body, layers, embed = ("transformer", "h", "wte") if family == "gpt2" else ("model", "layers", "embed_tokens")
    first, last = set(by_stage[0]["params"]), set(by_stage[1]["params"])
    assert f"{body}.{embed}.weight" in first and "lm_head.weight" not in first, sorted(first)
    assert "lm_head.weight" in last and f"{body}.{embed}.weight" not in last, sorted(last)
    assert {p.split(".")[2] for p in first if p.startswith(f"{body}.{layers}.")} == {"0", "1"}  # (3 layers: the first stage takes the odd one)
    assert {p.split(".")[2] for p in last if p.startswith(f"{body}.{layers}.")} == {"2"}
    if start is not None:  # fine-tuning: each stage started from its slice of the weights (the coordinator's first checkpoint)
        for i, st in by_stage.items():
            entry = [e for e in st["history"] if e.get("start")][0]
            assert entry["state_hash"] == start[i], (i, entry)
    t = stats(swarm, "t", "trainer")
    assert t["lost"] == 0, t
    assert t["history"][-1]["loss"] < t["first_loss"] - 0.3, [(e["micro_batches"], round(e["loss"], 3)) for e in t["history"]]
    # the coordinator keeps each stage's checkpoints, listed in /status
    wait_for(lambda: all(v["checkpoints"] and max(c["step"] for c in v["checkpoints"]) > 0 for v in coord.status()["stages"].values()), 60,
             "a checkpoint of each stage after its first sync")  # fmt: skip
    assert sorted(coord.status()["stages"]) == ["0", "1"]

    # the stages' newest checkpoints out, as one directory transformers loads, with the stages' logits
    out = tmp_path / "exported"
    kept = snapshot(Path(swarm.tmp) / "coordinator", tmp_path / "kept", "stage-checkpoints")  # (the stages train on beside)
    exported = model_cli("export", "--checkpoint", str(kept), "--out", str(out))
    steps = {int(i): int(n) for i, n in re.findall(r"stage (\d+) at step (\d+)", exported.stdout)}
    assert sorted(steps) == [0, 1], exported.stdout
    check_logits(out, kept, steps)


def check_logits(out: Path, coordinator_dir: Path, steps: dict[int, int]) -> None:
    """The exported model's logits are those of the stages, built from the checkpoints it was exported from (`steps`: stage -> its step), chained."""
    import torch
    from transformers import AutoModelForCausalLM

    from node.models.hf import open_model_dir
    from node.models.hf_stages import dims_of, init_hf_stage
    from node.models.stages import plan_stages
    from node.state.checkpoint_dir import load_checkpoint_dir

    stages = []
    num_stages = len(steps)
    for i in range(num_stages):  # the checkpoints the export took
        newest = coordinator_dir / "stage-checkpoints" / f"stage-{i}" / f"step-{steps[i]}"
        pin = json.loads((newest / "manifest.json").read_text())["model_config"]["model"]
        model_dir = open_model_dir(coordinator_dir / "model" / pin[3:])
        stage = init_hf_stage(model_dir, i, plan_stages(dims_of(model_dir), num_stages), seed=0, weights=False)
        stage.load_state_dict(load_checkpoint_dir(newest)["model"])
        stages.append(stage.eval())
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = tokens
        for stage in stages[:-1]:
            x = stage(x)
        want, _ = stages[-1](x)
        got = loaded(tokens).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
