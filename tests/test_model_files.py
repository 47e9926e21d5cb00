"""A Hugging Face model's config and tokenizer files, pinned by hash: packed by the coordinator,
served with its checkpoints, fetched by nodes over real libp2p and checked against the pin."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from node.net.transport import RemoteError, Transport
from node.state.model_files import (
    INDEX,
    ModelFilesError,
    ModelFilesSource,
    fetch_model_files,
    local_model_dir,
    pack_model_files,
)
from node.state.state_server import CheckpointServer, DirectorySource
from protocol import RemoteProtocolError
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)


def model_dir(tmp_path: Path, vocab: int = 300) -> Path:
    d = tmp_path / "src"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": vocab, "n_positions": 32}))
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}}}))
    (d / "model.safetensors").write_bytes(b"weights are state: they never travel with the files")
    (d / "notes.txt").write_text("nor does anything else")
    return d


def test_packing_pins_the_config_and_tokenizer_files_and_nothing_else(tmp_path):
    src = model_dir(tmp_path)
    pin = pack_model_files(src, tmp_path / "model")
    assert pin.startswith("hf:") and len(pin) == 67
    d = local_model_dir(tmp_path / "model", pin)
    assert d is not None and sorted(p.name for p in d.iterdir()) == ["config.json", INDEX, "tokenizer.json"]
    assert pack_model_files(src, tmp_path / "model") == pin  # the same files, the same pin, nothing new
    assert len(list((tmp_path / "model").iterdir())) == 1
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 301}))
    assert pack_model_files(src, tmp_path / "model") != pin  # another config, another pin
    (src / "config.json").unlink()
    with pytest.raises(ModelFilesError, match="has no config.json"):
        pack_model_files(src, tmp_path / "model")


def serve_and_fetch(tmp_path: Path, scenario):
    """`scenario(server_transport, client_transport)` with the coordinator's side serving
    tmp_path/model, over two real p2pd hosts."""

    async def main():
        hosts = await start_hosts(2)
        server, client = Transport(hosts[0]), Transport(hosts[1])
        checkpoints = CheckpointServer(server, DirectorySource(tmp_path / "checkpoints"), model_source=ModelFilesSource(tmp_path / "model")).start()
        try:
            await server.start()
            await client.start()
            return await scenario(server, client)
        finally:
            checkpoints.close()
            for t in (server, client):
                await t.close()
            for h in hosts:
                await h.shutdown()

    return asyncio.run(main())


def test_a_node_fetches_the_pinned_files_and_refuses_what_does_not_match_the_pin(tmp_path):
    pin = pack_model_files(model_dir(tmp_path), tmp_path / "model")
    served = tmp_path / "model" / pin[3:]

    async def scenario(server, client):
        got = await fetch_model_files(client, server.peer_id, pin, tmp_path / "node")
        assert got == tmp_path / "node" / pin[3:]
        for name in ("config.json", "tokenizer.json", INDEX):
            assert (got / name).read_bytes() == (served / name).read_bytes()
        assert await fetch_model_files(client, server.peer_id, pin, tmp_path / "node") == got  # already here: nothing asked

        # a pin the server does not hold
        with pytest.raises(RemoteError, match="no model file"):
            await fetch_model_files(client, server.peer_id, "hf:" + "0" * 64, tmp_path / "other")
        # the served config changed under its pin: refused, nothing left behind
        (served / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "n_positions": 32}))
        with pytest.raises(RemoteProtocolError, match="config.json"):
            await fetch_model_files(client, server.peer_id, pin, tmp_path / "other")
        assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())
        # an index that is not the pinned one
        (served / INDEX).write_text((served / INDEX).read_text().replace('"size"', '"size" ', 1))
        with pytest.raises(RemoteProtocolError, match=INDEX):
            await fetch_model_files(client, server.peer_id, pin, tmp_path / "third")
        # names outside the index are not served (no path tricks)
        (served / "secret.txt").write_text("not in the index")
        with pytest.raises(RemoteError, match="no model file"):
            await anext(client.stream(server.peer_id, _request(f"model/{pin[3:]}/secret.txt"), timeout=10))
        with pytest.raises(RemoteError, match="no model file"):
            await anext(client.stream(server.peer_id, _request(f"model/{pin[3:]}/../../identity.pem"), timeout=10))

    serve_and_fetch(tmp_path, scenario)


def _request(name: str):
    from protocol import StateRequest

    return StateRequest(name=name)
