"""A Hugging Face Mixtral trained in experts mode by real daemons: the coordinator is given a model
directory (a tiny Mixtral's config, made here), two expert hosts each fetch its files by pin and
serve one shard of its experts, a trainer holds the dense parts and calls them; the loss falls,
the coordinator keeps each shard's and the dense parts' checkpoints, and they come out as one
directory transformers loads, with the logits of the swarm's model. A host killed at the end is
routed around, and the node that takes its shard starts from the coordinator's checkpoint of it;
so does a new trainer from the dense parts'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.swarm import Swarm, node_peer_id, wait_for
from tests.test_swarm_pipeline import NODE, stats

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

RUN = [
    "--mode", "experts", "--expert-shards", "2", "--batch-size", "4", "--stage-step-samples", "8", "--warmup-steps", "5",
    "--heartbeat-timeout-s", "10", "--stage-sync-every-s", "2", "--checkpoint-every", "2",
]  # fmt: skip


def mixtral_dir(tmp: Path) -> Path:
    """2 layers of width 32, 4 experts (top-2), 256 tokens (bytes: no tokenizer files), context 32."""
    from tests.test_mixtral import tiny_config

    out = tmp / "tiny-mixtral"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(tiny_config(max_position_embeddings=32)))
    return out


def micro_batches(swarm: Swarm, name: str) -> int:
    return stats(swarm, name, "trainer").get("micro_batches", 0)


def snapshot(coordinator_dir: Path, out: Path, checkpoints: str = "expert-checkpoints") -> Path:
    """A copy of the coordinator's kept checkpoints (its folder `checkpoints`) and model files,
    taken while it goes on keeping new ones (a copy that met a checkpoint being pruned is taken
    again): what an export reads and what it is checked against stay the same."""
    for _ in range(5):
        shutil.rmtree(out, ignore_errors=True)
        try:
            for part in (checkpoints, "model"):
                shutil.copytree(coordinator_dir / part, out / part)
            return out
        except (shutil.Error, FileNotFoundError):
            continue
    raise AssertionError(f"no whole copy of {coordinator_dir} in 5 tries")


def swarm_logits(coordinator_dir: Path, status: dict, x):
    """The swarm's model, as the kept checkpoints under `coordinator_dir` hold it (each shard's
    newest, the dense parts' newest), run in one process: the dense parts with every expert local."""
    from node.model_source import _step_dirs
    from node.models.hf import build_causal_lm, open_model_dir
    from node.models.mixtral import MixtralExpertShard, forward_loss, local_experts, mixtral_layout, split_experts
    from node.state.checkpoint_dir import load_checkpoint_dir

    root = coordinator_dir / "expert-checkpoints"
    files = open_model_dir(coordinator_dir / "model" / status["run"]["model"][3:])
    layout = mixtral_layout(files.hf_config())
    shards = []
    for i in range(2):
        shard = MixtralExpertShard(build_causal_lm(files, seed=0, weights=False), layout.shard(i, 2))
        shard.load_state_dict(load_checkpoint_dir(_step_dirs(root / f"shard-{i}")[0])["model"])
        shards.append(shard)
    dense = build_causal_lm(files, seed=0, weights=False)
    split_experts(dense)
    dense.load_state_dict(load_checkpoint_dir(_step_dirs(root / "dense")[0])["model"])
    return forward_loss(dense.eval(), local_experts(shards), x)[0]


def test_a_hugging_face_mixtral_trains_on_expert_hosts_and_comes_out_as_one_model(swarm: Swarm, tmp_path):
    src = mixtral_dir(tmp_path)
    coord = swarm.coordinator("coordinator", None, None, "--model", str(src), *RUN)
    status = coord.wait_ready()
    assert status["run"]["model"].startswith("hf:"), status["run"]
    maddr = status["maddrs"][0]
    hosts = {f"h{i}": swarm.node(f"h{i}", [maddr], *NODE) for i in range(2)}
    trainer = swarm.node("t0", [maddr], *NODE, "--wanted-role", "trainer")
    wait_for(lambda: sorted(stats(swarm, n, "expert").get("expert_shard", -1) for n in hosts) == [0, 1], 120, "a host on each of the two shards")
    for n in hosts:  # each holds its shard's experts only, named per expert
        st = stats(swarm, n, "expert")
        s = st["expert_shard"]
        assert st["experts"] == [f"layer{li}.expert{e}" for li in (0, 1) for e in (s, s + 2)], st["experts"]
        assert sorted(st["params"]) == sorted(f"{e}.{k}" for e in st["experts"] for k in ("gate_up_proj", "down_proj"))
    wait_for(lambda: micro_batches(swarm, "t0") >= 64, 240, "64 micro-batches")
    h = stats(swarm, "t0", "trainer")["history"]
    assert h[-1]["loss"] < h[0]["loss"] - 0.5, [(e["micro_batches"], round(e["loss"], 3)) for e in h]
    assert all(stats(swarm, n, "expert")["calls"]["refused"] == 0 for n in hosts)

    # the coordinator keeps each shard's and the dense parts' checkpoints, on their reports
    def kept() -> dict | None:
        s = coord.status()
        return s if all(s["expert_shards"][f"shard{i}"]["checkpoints"] for i in range(2)) and s["dense"]["checkpoints"] else None

    status = wait_for(kept, 60, "a checkpoint of each shard and of the dense parts")
    for i in range(2):
        listed = status["expert_shards"][f"shard{i}"]
        assert listed["checkpoints"][-1]["state_hash"], listed
    assert status["dense"]["peers"] == [m["peer_id"] for m in status["members"] if m["role"] == "trainer"]

    # ... which come out as one directory transformers loads, with the swarm's logits
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_swarm_hf import model_cli

    out = tmp_path / "exported"
    coordinator_dir = snapshot(Path(swarm.tmp) / "coordinator", tmp_path / "kept")  # (training goes on beside)
    model_cli("export", "--checkpoint", str(coordinator_dir), "--out", str(out))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([list(b"def main(argv=None):\n    return 0\n")[:32]])
    with torch.no_grad():
        want = swarm_logits(coordinator_dir, status, x)
        got = loaded(x).logits
    assert (got - want).abs().max() < 1e-5

    # a host killed: its experts are routed around, training goes on
    victim, lost = node_peer_id(hosts["h1"]), stats(swarm, "h1", "expert")["expert_shard"]
    before = micro_batches(swarm, "t0")
    hosts["h1"].kill()
    wait_for(lambda: micro_batches(swarm, "t0") >= before + 16, 120, "16 more micro-batches with a shard's host killed")
    assert f"on {victim[-8:]} failed" in trainer.log()  # (a call to it failed once; then it is left alone, its experts given no tokens)

    # once it is evicted, a new node takes its shard from the coordinator's kept checkpoint
    wait_for(lambda: victim not in coord.members(), 60, "the killed host evicted")
    kept_hash = coord.status()["expert_shards"][f"shard{lost}"]["checkpoints"][-1]["state_hash"]
    swarm.node("h2", [maddr], *NODE)

    def started() -> dict | None:
        entries = [e for e in stats(swarm, "h2", "expert").get("history", []) if e.get("start")]
        return entries[-1] if entries else None

    start = wait_for(started, 120, "the new host to take the shard")
    assert stats(swarm, "h2", "expert")["expert_shard"] == lost
    assert (start["state_from"], start["state_hash"]) == (status["peer_id"], kept_hash), start
    wait_for(lambda: stats(swarm, "h2", "expert").get("calls", {}).get("forward", 0) > 0, 60, "the new host serving the trainer")

    # the trainer killed too: a new one starts from the dense parts the coordinator keeps, not the initial ones
    trainer.kill()
    dense = coord.status()["dense"]["checkpoints"][-1]
    first = stats(swarm, "t0", "trainer")["first_loss"]
    swarm.node("t1", [maddr], *NODE, "--wanted-role", "trainer")
    wait_for(lambda: micro_batches(swarm, "t1") >= 8, 120, "8 micro-batches of the new trainer")
    st = stats(swarm, "t1", "trainer")
    assert st["dense_from"] == {"step": dense["step"], "state_hash": dense["state_hash"]}, (st["dense_from"], dense)
    assert st["first_loss"] < first - 0.5, (st["first_loss"], first)
    assert "Traceback" not in trainer.log() and "role failed" not in trainer.log(), trainer.log()[-3000:]
    for n in ("h0",):
        assert "Traceback" not in hosts[n].log(), hosts[n].log()[-3000:]
