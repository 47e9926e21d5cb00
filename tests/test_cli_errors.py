"""Bad input to the console scripts: exactly one line on stderr that names the problem, no
traceback, a non-zero exit, and no process left behind.

Cases found before torch and hivemind load (`light`, most) go through their script's `main`, one
after another in one process where neither can be imported (tests/cli_runner.py): an import that
comes too early is that case's traceback. The others run the real scripts (from the venv's bin
dir), seconds each on a small machine, a few at a time beside it. All in one module fixture;
each test checks its own case's result.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from protocol.signatures import SigningKey, peer_id_from_public_key
from protocol.tokens import issue_token
from tests.swarm import ROOT, free_port, session_pids

pytestmark = [pytest.mark.timeout(400)]

BIN = Path(sys.executable).parent
EXIT_DEADLINE_S = 120  # a case still running after this has failed to refuse its input
PEER = peer_id_from_public_key(SigningKey.generate().public_key)
OWNER = SigningKey.generate()
OWNED = f"lab@{peer_id_from_public_key(OWNER.public_key)}"


@dataclass(frozen=True)
class Case:
    script: str  # swarmtrain-node | swarmtrain-coordinator
    args: tuple[str, ...]  # "{tmp}" is replaced by the case's own directory
    expect: tuple[str, ...]  # each must appear in the one line
    env: tuple[tuple[str, str], ...] = ()
    # found before torch and hivemind load (seconds): run where neither can be imported, so an
    # import that comes too early shows up as a traceback (tests/cli_runner.py)
    light: bool = False


NODE, COORD = "swarmtrain-node", "swarmtrain-coordinator"
# The coordinator's default status port is fixed (8080): cases that might get that far use 0.
HTTP0 = ("--http", "127.0.0.1:0")


def _cases(closed_port: int, busy_port: int) -> dict[str, Case]:
    unreachable = f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/{PEER}"
    cases = {}
    for script, extra in ((NODE, ()), (COORD, HTTP0)):
        short = "node" if script == NODE else "coordinator"
        data = ("--data-dir", "{tmp}/data")
        cases.update(
            {
                f"{short}-unknown-flag": Case(script, ("--bogus",), ("unrecognized arguments: --bogus",), light=True),
                f"{short}-bad-flag-value": Case(
                    script, ("--heartbeat-timeout-s" if script == COORD else "--heartbeat-interval-s", "soon"), ("invalid float value", "soon"), light=True
                ),
                f"{short}-bad-log-level": Case(script, ("--log-level", "LOUD"), ("--log-level", "LOUD"), light=True),
                f"{short}-missing-identity-dir": Case(script, (*data, *extra, "--identity", "{tmp}/no/such/dir/id.pem"), ("identity", "no/such/dir/id.pem", "No such file or directory"), light=True),
                f"{short}-corrupt-identity": Case(script, (*data, *extra, "--identity", "{tmp}/garbage.pem"), ("garbage.pem", "not a PEM private key"), light=True),
                f"{short}-data-dir-not-writable": Case(script, ("--data-dir", "{tmp}/a-file/data", *extra), ("data dir", "a-file/data", "not writable"), light=True),
                f"{short}-unreachable-initial-peers": Case(script, (*data, *extra, "--initial-peers", unreachable), ("none of the initial peers answered", unreachable)),
                f"{short}-malformed-multiaddr": Case(script, (*data, *extra, "--initial-peers", "/ip4/not-an-ip/tcp/1"), ("not a multiaddr", "/ip4/not-an-ip/tcp/1"), light=True),
                f"{short}-config-missing": Case(script, ("--config", "{tmp}/missing.toml"), ("missing.toml", "does not exist"), light=True),
                f"{short}-config-invalid-toml": Case(script, ("--config", "{tmp}/invalid.toml"), ("invalid.toml", "not valid TOML"), light=True),
                f"{short}-config-unknown-key": Case(script, ("--config", "{tmp}/unknown.toml"), ("unknown.toml", "unknown setting 'colour'"), light=True),
                f"{short}-config-wrong-type": Case(script, ("--config", "{tmp}/wrong-type.toml"), ("wrong-type.toml", "swarm_id must be str"), light=True),
            }
        )
    env_var = "SWARMTRAIN_HEARTBEAT_INTERVAL_S"
    cases.update(
        {
            "node-bad-env-var": Case(NODE, (), (env_var, "must be float", "soon"), env=((env_var, "soon"),), light=True),
            "node-device-cuda-missing": Case(NODE, ("--data-dir", "{tmp}/data", "--initial-peers", unreachable, "--device", "cuda:99"), ("cuda:99",)),
            "node-bad-http": Case(NODE, ("--data-dir", "{tmp}/data", "--initial-peers", unreachable, "--http", "9100"), ("--http must be HOST:PORT", "9100"), light=True),
            "node-http-port-in-use": Case(NODE, ("--data-dir", "{tmp}/data", "--initial-peers", unreachable, "--http", f"127.0.0.1:{busy_port}"),
                                          (f"--http 127.0.0.1:{busy_port}", "address already in use"), light=True),  # fmt: skip
            "node-bad-direct-port": Case(NODE, ("--data-dir", "{tmp}/data", "--direct-port", "70000"), ("--direct-port", "70000"), light=True),
            "node-direct-port-in-use": Case(NODE, ("--data-dir", "{tmp}/data", "--direct-port", str(busy_port)), ("cannot listen for direct connections", f"port {busy_port}", "in use"), light=True),
            "node-relay-without-peer-id": Case(NODE, ("--data-dir", "{tmp}/data", "--relays", "/ip4/127.0.0.1/tcp/1"), ("--relays", "/ip4/127.0.0.1/tcp/1", "/p2p/<its peer id>"), light=True),
            "node-initial-peer-without-peer-id": Case(NODE, ("--data-dir", "{tmp}/data", "--initial-peers", "/ip4/127.0.0.1/tcp/1"), ("lacks its /p2p/<peer id>",), light=True),
            "coordinator-bad-mode": Case(COORD, ("--mode", "anarchy"), ("--mode", "invalid choice", "anarchy"), light=True),
            "coordinator-experts-without-shards": Case(COORD, ("--mode", "experts", "--model", "tiny-moe"), ("experts mode needs --expert-shards",), light=True),
            "coordinator-experts-dense-model": Case(COORD, ("--mode", "experts", "--expert-shards", "2"), ("model 'tiny' has no experts",), light=True),
            "coordinator-moe-model-in-replica-mode": Case(COORD, ("--model", "small-moe"), ("'small-moe' is a mixture of experts", "--mode experts"), light=True),
            "coordinator-too-many-expert-shards": Case(COORD, ("--mode", "experts", "--model", "tiny-moe", "--expert-shards", "5"), ("expert_shards must be in 1..4",), light=True),
            "coordinator-bad-http": Case(COORD, ("--data-dir", "{tmp}/data", "--http", "localhost"), ("--http must be HOST:PORT", "localhost"), light=True),
            "coordinator-http-port-in-use": Case(COORD, ("--data-dir", "{tmp}/data", "--http", f"127.0.0.1:{busy_port}"), (f"--http 127.0.0.1:{busy_port}", "address already in use"), light=True),
            "coordinator-bad-owner-key": Case(COORD, ("--data-dir", "{tmp}/data", *HTTP0, "--owner-public-key", "not-hex"), ("--owner-public-key", "64 hex digits"), light=True),
            "coordinator-pipeline-without-stages": Case(COORD, ("--data-dir", "{tmp}/data", *HTTP0, "--mode", "pipeline"), ("num_stages", "pipeline mode needs at least 1 stage"), light=True),
        }
    )
    cases.update(_out_of_bounds())
    cases.update(FIRST_HOUR)
    return cases


def _out_of_bounds() -> dict[str, Case]:
    """Out of bounds: refused at start, before anything registers. Those `light` are refused
    before torch and hivemind load (so before any p2pd); the others by Node.validate."""
    data = ("--data-dir", "{tmp}/data")
    return {
        "node-negative-bandwidth": Case(NODE, ("--bandwidth-mbps", "-5"), ("--bandwidth-mbps", "bandwidth_mbps", "≥ 0", "-5"), light=True),
        "node-missing-data": Case(NODE, (*data, "--data", "{tmp}/missing/dir"), ("--data", "missing/dir", "does not exist"), light=True),
        "node-data-without-text-field": Case(NODE, (*data, "--initial-peers", UNREACHABLE, "--data", "{tmp}/records.jsonl", "--text-field", "body"), ("--data", "records.jsonl:1", "no field 'body'")),
        "node-negative-threads": Case(NODE, ("--threads", "-2"), ("--threads", "threads", "-2"), light=True),
        "node-shard-index-too-large": Case(NODE, ("--shard-index", "4", "--num-shards", "4"), ("--shard-index", "num_shards (4)", "4"), light=True),
        "node-zero-heartbeat-interval": Case(NODE, ("--heartbeat-interval-s", "0"), ("--heartbeat-interval-s", "heartbeat_interval_s", "> 0"), light=True),
        "node-nan-rpc-timeout": Case(NODE, (), ("SWARMTRAIN_RPC_TIMEOUT_S", "rpc_timeout_s", "nan"), env=(("SWARMTRAIN_RPC_TIMEOUT_S", "nan"),), light=True),
        "node-bad-log-level-env": Case(NODE, (), ("SWARMTRAIN_LOG_LEVEL", "log_level", "LOUD"), env=(("SWARMTRAIN_LOG_LEVEL", "LOUD"),), light=True),
        "node-bad-wanted-role": Case(NODE, (*data, "--wanted-role", "boss"), ("--wanted-role", "boss"), light=True),
        "node-bad-aggregator-flag": Case(NODE, ("--aggregator", "median"), ("--aggregator", "invalid choice", "median"), light=True),
        "node-averager-bad-in-file": Case(NODE, ("--config", "{tmp}/averager.toml"), ("averager.toml", "[averager]", "min_group_size", "≥ 1", "0"), light=True),
        "node-averager-unknown-in-file": Case(NODE, ("--config", "{tmp}/averager-unknown.toml"), ("averager-unknown.toml", "unknown setting 'colour'", "[averager]"), light=True),
        "node-averager-param-without-aggregator": Case(NODE, ("--config", "{tmp}/averager-tau.toml"), ("averager-tau.toml", "tau", "centered_clip"), light=True),
        "node-averager-bad-env": Case(NODE, (), ("SWARMTRAIN_AVERAGER_PACE_SHARE", "pace_share", "1.5"), env=(("SWARMTRAIN_AVERAGER_PACE_SHARE", "1.5"),), light=True),
        "node-averager-bad-bool-env": Case(NODE, (), ("SWARMTRAIN_AVERAGER_PACE", "must be bool", "maybe"), env=(("SWARMTRAIN_AVERAGER_PACE", "maybe"),), light=True),
        "node-transport-bad-env": Case(NODE, (), ("SWARMTRAIN_TRANSPORT_CALL_TIMEOUT_S", "call_timeout_s", "-1"), env=(("SWARMTRAIN_TRANSPORT_CALL_TIMEOUT_S", "-1"),), light=True),
        "node-transport-bad-in-file": Case(NODE, ("--config", "{tmp}/transport.toml"), ("transport.toml", "[transport]", "ban_score", "< 0"), light=True),
        "node-transport-in-flight-below-frame": Case(NODE, (*data, "--config", "{tmp}/in-flight.toml"), ("max_bytes_in_flight_per_peer", "frame size", "1000"), light=True),
        "coordinator-zero-inner-steps": Case(COORD, ("--inner-steps", "0"), ("--inner-steps", "inner_steps", "≥ 1", "0"), light=True),
        "coordinator-bad-run-env": Case(COORD, (), ("SWARMTRAIN_COORDINATOR_OUTER_MOMENTUM", "outer_momentum", "1.5"), env=(("SWARMTRAIN_COORDINATOR_OUTER_MOMENTUM", "1.5"),), light=True),
        "coordinator-bad-run-in-file": Case(COORD, ("--config", "{tmp}/run.toml"), ("run.toml", "join_timeout_s", "> 0", "-1"), light=True),
        "coordinator-bad-block-size": Case(COORD, ("--block-size", "3"), ("--block-size", "block_size", "3"), light=True),
        "coordinator-synchronous-steps-misfit": Case(
            COORD, ("--mode", "pipeline", "--num-stages", "2", "--batch-size", "3", "--stage-step-samples", "16", "--synchronous-steps"),
            ("synchronous_steps", "stage_step_samples (16)", "batch_size (3)"), light=True,
        ),
        "coordinator-stage-clip-in-experts-mode": Case(
            COORD, ("--mode", "experts", "--model", "tiny-moe", "--expert-shards", "2", "--stage-clip", "stage"), ("stage_clip 'stage'", "pipeline mode"), light=True,
        ),
        "coordinator-bad-stage-routing": Case(COORD, ("--stage-routing", "mail"), ("--stage-routing", "invalid choice", "mail"), light=True),
        "coordinator-zero-heartbeat-timeout": Case(COORD, ("--heartbeat-timeout-s", "0"), ("--heartbeat-timeout-s", "heartbeat_timeout_s", "> 0"), light=True),
        "coordinator-init-bad-name": Case(COORD, ("init", "--data-dir", "{tmp}/o", "--name", "a/b"), ("init", "--name 'a/b'", "without spaces or '/'"), light=True),
        "coordinator-token-before-init": Case(COORD, ("token", "--data-dir", "{tmp}/none", "--swarm-id", OWNED), ("token", "no owner key", "run `swarmtrain-coordinator init` first"), light=True),
        "coordinator-token-bad-expiry": Case(COORD, ("token", "--identity", "{tmp}/owner.pem", "--swarm-id", OWNED, "--expires-in", "never"), ("--expires-in 'never'", "30d"), light=True),
        "coordinator-token-bad-role": Case(COORD, ("token", "--identity", "{tmp}/owner.pem", "--swarm-id", OWNED, "--roles", "boss"), ("--roles", "unknown role(s) boss"), light=True),
        "coordinator-token-bad-peer": Case(COORD, ("token", "--identity", "{tmp}/owner.pem", "--swarm-id", OWNED, "--peer", "alice"), ("--peer 'alice'", "not a peer id"), light=True),
        "coordinator-token-other-owner": Case(COORD, ("token", "--identity", "{tmp}/owner.pem", "--swarm-id", f"lab@{PEER}"), (f"owned by {PEER}", "would be refused"), light=True),
        "coordinator-token-missing-swarm-id": Case(COORD, ("token", "--identity", "{tmp}/owner.pem"), ("--swarm-id",), light=True),
        "coordinator-revoke-bad-peer": Case(COORD, ("revoke", "--data-dir", "{tmp}/too-early", "12D3KooWnope"), ("revoke", "'12D3KooWnope' is not a peer id"), light=True),
        "coordinator-revoke-bad-list": Case(COORD, ("revoke", "--data-dir", "{tmp}/revoked", "--list"), ("revoked line 2", "'not-a-peer-id' is not a peer id"), light=True),
        "coordinator-bad-swarm-id": Case(COORD, ("--swarm-id", "lab@alice"), ("swarm_id", "'alice' is not an Ed25519 libp2p peer id"), light=True),
        "node-bad-swarm-id": Case(NODE, ("--swarm-id", "my swarm"), ("swarm_id", "without spaces"), light=True),
        "coordinator-private-unowned": Case(COORD, ("--data-dir", "{tmp}/data", *HTTP0, "--private"), ("--private needs an owned swarm id", "init"), light=True),
        "coordinator-owned-by-another": Case(COORD, ("--data-dir", "{tmp}/data", *HTTP0, "--swarm-id", OWNED), (f"owned by {peer_id_from_public_key(OWNER.public_key)}", "this identity"), light=True),
        "coordinator-zero-keep-checkpoints": Case(COORD, ("--keep-checkpoints", "0"), ("--keep-checkpoints", "keep_checkpoints", "≥ 1"), light=True),
        # a Hugging Face model directory: read at start (transformers loads), refused before anything
        # listens; the other mistakes in one are checked in this process (MODEL_MISTAKES)
        "coordinator-model-dir-missing": Case(COORD, ("--data-dir", "{tmp}/data", *HTTP0, "--model", "{tmp}/no/such-model"), ("model", "no/such-model")),
        # (found once the daemon reads the weights: a fatal error of the coordinator's start)
        "coordinator-model-weights-misfit": Case(COORD, ("--data-dir", "{tmp}/data", *HTTP0, "--model", "{tmp}/misfit-model"), ("model.safetensors", "config.json", "wte")),
    }


# More mistakes in a Hugging Face model directory, found by the coordinator's checks before its
# daemon starts: through its `main` in this process, the same path as the script's past its imports
# (transformers loads once here, not once a case)
MODEL_MISTAKES = {
    "without-config": (("--model", "{tmp}/empty-model"), ("empty-model", "config.json")),
    "hub-id": (("--model", "someorg/somemodel"), ("someorg/somemodel", "download")),
    "tokenizer-past-its-vocabulary": (("--model", "{tmp}/small-vocab-model"), ("tokenizer", "embeds only 100 tokens")),
    "cut-past-its-layers": (("--mode", "pipeline", "--num-stages", "3", "--model", "{tmp}/one-layer-model"), ("num_stages (3)", "1 blocks (decoder layers)")),
    "family-not-cut": (("--mode", "pipeline", "--num-stages", "2", "--model", "{tmp}/opt-model"), ("pipeline role", "gpt2, llama", "'opt'")),
}


@pytest.mark.parametrize("name", sorted(MODEL_MISTAKES))
def test_a_mistake_in_a_model_directory_is_one_line_naming_it(name, tmp_path, capsys, monkeypatch):
    from coordinator.cli import main

    for k in [k for k in os.environ if k.startswith("SWARMTRAIN_")]:
        monkeypatch.delenv(k)
    _prepare(tmp_path / "case")
    args, expect = MODEL_MISTAKES[name]
    code = main(["--data-dir", str(tmp_path / "case" / "data"), *HTTP0, *(a.replace("{tmp}", str(tmp_path / "case")) for a in args)])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    for text in expect:
        assert text in lines[0], (text, lines[0])


# What a new user met in their first hour, accepted without a word: each is now one line, exit 2
UNREACHABLE = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"  # (a node's checks that need no network come first)
TOKEN = issue_token(OWNER, OWNED, roles=("trainer",)).to_text()
FIRST_HOUR = {
    "node-no-initial-peers": Case(NODE, ("--data-dir", "{tmp}/data"), ("no --initial-peers", "the coordinator's", "--coordinator"), light=True),
    "node-huge-heartbeat-interval": Case(NODE, ("--heartbeat-interval-s", "1e9"), ("--heartbeat-interval-s", "at most 300 s"), light=True),
    "node-record-ttl-below-minimum": Case(NODE, ("--record-ttl-s", "1"), ("--record-ttl-s", "at least 3 s"), light=True),
    "node-record-ttl-below-heartbeat": Case(
        NODE, ("--data-dir", "{tmp}/data", "--initial-peers", UNREACHABLE, "--record-ttl-s", "5", "--heartbeat-interval-s", "10"), ("--record-ttl-s 5", "--heartbeat-interval-s 10"), light=True,
    ),
    "node-client-mode-serving-relay": Case(NODE, ("--data-dir", "{tmp}/data", "--initial-peers", UNREACHABLE, "--client-mode", "--serve-relay"), ("--serve-relay", "--client-mode"), light=True),
    "node-threads-beyond-cores": Case(NODE, ("--data-dir", "{tmp}/data", "--initial-peers", UNREACHABLE, "--threads", "100000"), ("--threads 100000", "cores"), light=True),
    "node-token-of-another-swarm": Case(NODE, ("--swarm-id", "other", "--token", TOKEN), ("--token", OWNED, "--swarm-id 'other'"), light=True),
    "node-misspelt-env-var": Case(NODE, (), ("SWARMTRAIN_HEARTBEAT_INTERVAL ", "did you mean SWARMTRAIN_HEARTBEAT_INTERVAL_S"), env=(("SWARMTRAIN_HEARTBEAT_INTERVAL", "3"),), light=True),
    "node-config-string-for-int": Case(NODE, ("--config", "{tmp}/string-int.toml"), ("string-int.toml", "num_shards must be int", "'5'"), light=True),
    "coordinator-config-string-for-int": Case(COORD, ("--config", "{tmp}/run-string.toml"), ("run-string.toml", "inner_steps must be int", "'5'"), light=True),
    "coordinator-misspelt-env-var": Case(COORD, (), ("SWARMTRAIN_COORDINATOR_INNER_STEP ", "did you mean SWARMTRAIN_COORDINATOR_INNER_STEPS"), env=(("SWARMTRAIN_COORDINATOR_INNER_STEP", "5"),), light=True),
    "coordinator-warmup-past-total": Case(COORD, ("--warmup-steps", "100", "--total-steps", "10"), ("--warmup-steps", "warmup_steps (100)", "total_steps (10)"), light=True),
    "coordinator-num-stages-in-replica-mode": Case(COORD, ("--num-stages", "2"), ("--num-stages", "pipeline mode", "replica mode"), light=True),
    "coordinator-num-stages-in-experts-mode": Case(COORD, ("--mode", "experts", "--model", "tiny-moe", "--expert-shards", "2", "--num-stages", "2"), ("--num-stages", "experts mode"), light=True),
    "coordinator-heartbeat-timeout-below-interval": Case(COORD, ("--heartbeat-timeout-s", "1"), ("--heartbeat-timeout-s", "at least 2 s"), light=True),
    "coordinator-token-naming-no-role": Case(COORD, ("token", "--identity", "{tmp}/owner.pem", "--swarm-id", OWNED, "--roles", ","), ("--roles ','", "names no role"), light=True),
    "coordinator-revoke-the-owner": Case(
        COORD, ("revoke", "--data-dir", "{tmp}/too-early", "--identity", "{tmp}/owner.pem", peer_id_from_public_key(OWNER.public_key)), ("own peer id", "cannot revoke itself"), light=True,
    ),
}


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    leftovers: list[int]


def _prepare(tmp: Path) -> None:
    tmp.mkdir(parents=True)
    (tmp / "a-file").write_text("a regular file, not a directory\n")
    (tmp / "garbage.pem").write_bytes(b"\x00\x01 this is not a key \xff\n")
    (tmp / "invalid.toml").write_text("swarm_id = \n")
    (tmp / "unknown.toml").write_text('colour = "blue"\n')
    (tmp / "wrong-type.toml").write_text("swarm_id = 7\n")
    (tmp / "averager.toml").write_text("[averager]\nmin_group_size = 0\n")
    (tmp / "averager-unknown.toml").write_text('[averager]\ncolour = "blue"\n')
    (tmp / "averager-tau.toml").write_text("[averager]\ntau = 2.0\n")
    (tmp / "transport.toml").write_text("[transport]\nban_score = 3.0\n")
    (tmp / "in-flight.toml").write_text("[transport]\nmax_bytes_in_flight_per_peer = 1000\n")
    (tmp / "run.toml").write_text("inner_steps = 10\njoin_timeout_s = -1\n")
    (tmp / "string-int.toml").write_text('num_shards = "5"\n')
    (tmp / "run-string.toml").write_text('inner_steps = "5"\n')
    OWNER.save(tmp / "owner.pem")
    (tmp / "revoked").mkdir()
    (tmp / "revoked" / "revoked").write_text(f"{PEER}\nnot-a-peer-id  # a hand edit gone wrong\n")
    (tmp / "empty-model").mkdir()
    (tmp / "records.jsonl").write_text('{"text": "a record whose text is under another name"}\n')
    _config_only(tmp / "one-layer-model", {"model_type": "gpt2", "vocab_size": 300, "n_positions": 16, "n_embd": 32, "n_layer": 1, "n_head": 2})
    _config_only(tmp / "small-vocab-model", {"model_type": "gpt2", "vocab_size": 100, "n_positions": 16, "n_embd": 32, "n_layer": 1, "n_head": 2})
    _byte_level_tokenizer(tmp / "small-vocab-model" / "tokenizer.json")
    _config_only(tmp / "opt-model", {"model_type": "opt", "vocab_size": 300, "hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 2})
    _misfit_model(tmp / "misfit-model")
    (tmp / "too-early").mkdir()
    for module in ("torch", "hivemind"):
        (tmp / "too-early" / f"{module}.py").write_text(f"raise ImportError('{module} imported before the flags were checked')\n")


def _byte_level_tokenizer(path: Path) -> None:
    """A tokenizer.json whose ids go up to 255 (one per byte)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(path))


def _config_only(path: Path, config: dict) -> None:
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))


def _misfit_model(path: Path) -> None:
    """A GPT-2 directory whose weights are of another width than its config."""
    import json

    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300, "n_positions": 16, "n_embd": 32, "n_layer": 1, "n_head": 2}))
    save_file({"transformer.wte.weight": torch.zeros(300, 48)}, str(path / "model.safetensors"))


def _run(case: Case, tmp: Path) -> Result:
    _prepare(tmp)
    args = [str(BIN / case.script), *(a.replace("{tmp}", str(tmp)) for a in case.args)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
    env.update(case.env)
    t0 = time.monotonic()
    # own session, so that whatever it starts (DHT child, p2pd) can be found and killed
    p = subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Result(None, out, err, time.monotonic() - t0, [])
    seconds = time.monotonic() - t0
    left = session_pids(p.pid)  # the daemon exited: its children must have gone with it
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = session_pids(p.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return Result(p.returncode, out, err, seconds, left)


def _run_light(cases: dict[str, Case], root: Path) -> dict[str, Result]:
    """The `light` cases, each through its script's `main` in one process (tests/cli_runner.py)
    where torch and hivemind cannot be imported: a process each cost about a second of CPU."""
    for name in cases:
        _prepare(root / name)
    todo = [{"script": c.script, "args": [a.replace("{tmp}", str(root / n)) for a in c.args], "env": dict(c.env), "cwd": str(root / n)} for n, c in cases.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / next(iter(cases)) / "too-early"), str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "tests.cli_runner"], cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)  # fmt: skip
    out, err = p.communicate(json.dumps(todo), timeout=EXIT_DEADLINE_S)
    assert p.returncode == 0, err
    seconds, left = time.monotonic() - t0, session_pids(p.pid)
    return {n: Result(r["code"], r["stdout"], r["stderr"], seconds, left) for n, r in zip(cases, json.loads(out), strict=True)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case while holding a busy port: the light ones in one process, the others (which
    load torch and hivemind, seconds each) a few at a time beside it."""
    root = tmp_path_factory.mktemp("cli")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = _cases(free_port(), busy.getsockname()[1])
        heavy = {n: c for n, c in cases.items() if not c.light}
        with ThreadPoolExecutor(max_workers=max(4, 2 * (os.cpu_count() or 1))) as pool:
            futures = {name: pool.submit(_run, case, root / name) for name, case in heavy.items()}
            light = _run_light({n: c for n, c in cases.items() if c.light}, root)
            return {name: (cases[name], light[name] if name in light else futures[name].result()) for name in cases}


CASE_NAMES = sorted(_cases(1, 2))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_line_naming_the_problem(results, name):
    case, r = results[name]
    assert r.returncode is not None, f"{name}: still running after {EXIT_DEADLINE_S} s; stderr so far:\n{r.stderr}"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "Traceback" not in r.stderr, f"{name}:\n{r.stderr}"
    assert len(lines) == 1, f"{name}: expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    for text in case.expect:
        assert text in lines[0], f"{name}: {text!r} not in {lines[0]!r}"
    assert r.returncode != 0, f"{name}: exit status 0"
    assert r.stdout.strip() == "", f"{name}: stdout:\n{r.stdout}"
    assert not r.leftovers, f"{name}: {len(r.leftovers)} processes outlived the daemon"



@pytest.mark.parametrize("name", sorted(FIRST_HOUR))
def test_first_hour_mistakes_exit_2(results, name):
    assert results[name][1].returncode == 2, results[name][1].stderr


def test_the_coordinator_help_lists_the_owner_s_tools_each_with_its_own_help():
    main = subprocess.run([str(BIN / COORD), "--help"], capture_output=True, text=True, timeout=60)
    assert main.returncode == 0
    for tool in ("init", "token", "revoke"):
        assert f"swarmtrain-coordinator {tool} " in main.stdout, main.stdout
        own = subprocess.run([str(BIN / COORD), tool, "--help"], capture_output=True, text=True, timeout=60)
        assert own.returncode == 0 and own.stdout.startswith(f"usage: swarmtrain-coordinator {tool}"), own.stdout


def test_the_allocator_setting_applies_in_a_fresh_process():
    """The node daemon asks glibc's malloc to keep freed pages (node/osutil.py); on this
    platform (Linux, glibc) every option must be accepted."""
    import platform

    from tests.swarm import ROOT

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip(f"needs Linux with glibc (its malloc options): this is {platform.system()}, {platform.libc_ver()[0] or 'not glibc'}")
    code = "from node.osutil import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr
