"""Checkpoints between a node and a real coordinator process: upload, download, verification,
tampering, and the coordinator SIGKILLed in the middle of writing one (real p2pd, real files)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.checkpoints import CheckpointStore
from node.state.checkpoint_client import (
    CheckpointTransferError,
    checkpoint_frames,
    download_checkpoint,
    fetch_manifest,
    upload_checkpoint,
)
from node.state.checkpoint_dir import CheckpointDirError, load_checkpoint_dir, read_manifest, write_checkpoint_dir
from node.net.host import Host, HostConfig, PeerUnreachable
from node.net.transport import CallTimeout, RemoteError, Transport
from protocol import Heartbeat, Register, RemoteProtocolError, RoleAssignment, SigningKey
from protocol.manifest import ManifestError
from tests.swarm import wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

CONFIG = {"arch": "tiny", "d_model": 64}


def make_state(seed: int, mb: float = 0.5) -> dict[str, dict[str, torch.Tensor]]:
    """Model and optimizer tensors of several dtypes, about `mb` MB of float32 in all."""
    g = torch.Generator().manual_seed(seed)
    n = int(mb * 2**20 / 4 / 4)  # four float32 tensors of n elements
    return {
        "model": {
            "w0": torch.randn(n, generator=g),
            "w1": torch.randn(n, generator=g),
            "emb": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "pos": torch.arange(100, dtype=torch.int64),
        },
        "optimizer": {"m0": torch.randn(n, generator=g), "m1": torch.randn(n, generator=g), "step": torch.tensor([seed], dtype=torch.int32)},
    }


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for k, t in want[name].items():
            u = got[name][k]
            assert u.dtype == t.dtype and u.shape == t.shape, (name, k)
            assert torch.equal(u.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), (name, k)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def tmp_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(".tmp-")] if root.exists() else []


def flip_last_byte(path: Path) -> None:
    """Corrupt a file in place: same inode, same size."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))


def coordinator_key(tmp_path: Path, name: str = "coordinator") -> bytes:
    return SigningKey.load(tmp_path / name / "identity.pem").public_key


# The coordinator keeps a checkpoint only once replicas have reported its state hash in their
# heartbeats: the test's peer joins as the (only) replica and reports each hash it uploads.
CAPABILITIES = {"device": "cpu", "memory_gb": 8.0, "tflops": 0.1, "up_mbps": 100.0, "down_mbps": 100.0}
COORDINATOR_FLAGS = ("--heartbeat-timeout-s", "120")  # the test's peer heartbeats only when it reports


async def join_as_replica(transport: Transport, coord_id: str) -> None:
    reply = await transport.call(coord_id, Register(peer_id=transport.peer_id, capabilities=CAPABILITIES), timeout=10)
    assert isinstance(reply, RoleAssignment) and reply.role == "replica", reply


async def report_hash(transport: Transport, coord_id: str, step: int, state_hash: str) -> None:
    await transport.call(coord_id, Heartbeat(peer_id=transport.peer_id, step=step, state_hash=state_hash), timeout=10)


# ---- local directories (no network) -------------------------------------------------------------


def test_checkpoint_dirs_are_interchangeable_with_the_store(tmp_path):
    key = SigningKey.generate()
    state = make_state(1)
    # written by a node, read by the coordinator's store
    path = write_checkpoint_dir(tmp_path / "node", 3, state, CONFIG, "hash-3", signing_key=key, now=123.0)
    assert path == tmp_path / "node" / "step-00000003"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors", "optimizer.safetensors"]
    assert_bitwise_equal(CheckpointStore(tmp_path / "node").load(3, public_key=key.public_key), state)
    # the same again is a no-op; different contents for the same step are refused
    assert write_checkpoint_dir(tmp_path / "node", 3, state, CONFIG, "hash-3", signing_key=key) == path
    with pytest.raises(CheckpointDirError, match="already exists with different contents"):
        write_checkpoint_dir(tmp_path / "node", 3, make_state(2), CONFIG)
    # written by the store, read by a node
    store = CheckpointStore(tmp_path / "coord", signing_key=key)
    info = store.save(4, state, CONFIG, "hash-4")
    assert_bitwise_equal(load_checkpoint_dir(info.path, public_key=key.public_key), state)
    with pytest.raises(CheckpointDirError, match="not by the expected key"):
        load_checkpoint_dir(info.path, public_key=SigningKey.generate().public_key)
    # a flipped byte is named
    flip_last_byte(info.path / "optimizer.safetensors")
    with pytest.raises(CheckpointDirError, match=r"optimizer\.safetensors does not match its sha256"):
        load_checkpoint_dir(info.path)
    # bad inputs are named
    with pytest.raises(CheckpointDirError, match="bad state name"):
        write_checkpoint_dir(tmp_path / "node", 5, {"../evil": state["model"]})
    with pytest.raises(CheckpointDirError, match="bad step"):
        write_checkpoint_dir(tmp_path / "node", -1, state)
    with pytest.raises(CheckpointDirError, match="manifest.json is missing"):
        read_manifest(tmp_path / "node")


def test_temp_dirs_of_dead_writers_are_removed(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = root / f".tmp-step-00000009-{dead.stdout.strip()}-abcd1234"
    live = root / f".tmp-step-00000010-{os.getpid()}-abcd1234"  # ours: a write in progress
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    write_checkpoint_dir(root, 1, make_state(0, mb=0.01))
    assert leftovers(root) == [live.name, "step-00000001"]


# ---- against a real coordinator -----------------------------------------------------------------


def test_upload_download_and_tampering(swarm, tmp_path):
    coord = swarm.coordinator("coordinator", None, None, *COORDINATOR_FLAGS)
    coord_id = coord.wait_ready()["peer_id"]
    maddr, coord_pub = coord.maddr(), coordinator_key(tmp_path)
    ckpts = tmp_path / "coordinator" / "checkpoints"
    state = make_state(5, mb=4)
    src = write_checkpoint_dir(tmp_path / "src", 5, state, CONFIG, "hash-5")  # unsigned: the coordinator signs what it keeps

    async def scenario():
        host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(maddr,)))
        transport = Transport(host)
        try:
            await join_as_replica(transport, coord_id)
            await report_hash(transport, coord_id, 5, "hash-5")
            assert await upload_checkpoint(transport, coord_id, src, timeout_s=60) == 5
            assert [c["step"] for c in coord.status()["checkpoints"]] == [5]

            step, manifest = await fetch_manifest(transport, coord_id, timeout=10)
            assert step == 5 and manifest["signer"] == coord_pub.hex() and manifest["state_hash"] == "hash-5"
            assert manifest["files"] == read_manifest(src)["files"]

            dest = tmp_path / "download"
            path = await download_checkpoint(transport, coord_id, dest, trusted_public_key=coord_pub, timeout_s=60)
            assert path == dest / "step-00000005" and leftovers(dest) == ["step-00000005"]
            assert_bitwise_equal(load_checkpoint_dir(path, public_key=coord_pub), state)
            assert_bitwise_equal(CheckpointStore(dest).load(5, public_key=coord_pub), state)  # the store's layout
            assert await download_checkpoint(transport, coord_id, dest, step=5, timeout_s=60) == path  # already there

            # a manifest whose sha256 for one file was altered (and its signature dropped, so only
            # the data can tell): that file is refused, nothing is kept
            flipped = json.loads(json.dumps(manifest))
            sha = flipped["files"]["model.safetensors"]["sha256"]
            flipped["files"]["model.safetensors"]["sha256"] = ("0" if sha[0] != "0" else "1") + sha[1:]
            unsigned = {**flipped, "signer": None, "signature": None}
            bad_dest = tmp_path / "bad-download"
            with pytest.raises(CheckpointTransferError) as e:
                await download_checkpoint(transport, coord_id, bad_dest, manifest=unsigned, timeout_s=60)
            assert e.value.file == "model.safetensors" and "sha256" in str(e.value)
            assert leftovers(bad_dest) == []
            # signed, the altered manifest is refused before any data moves; unsigned, it is
            # refused when the coordinator's signature is required
            with pytest.raises(ManifestError, match="signature does not verify"):
                await download_checkpoint(transport, coord_id, bad_dest, manifest=flipped, timeout_s=60)
            with pytest.raises(ManifestError, match="not signed"):
                await download_checkpoint(transport, coord_id, bad_dest, manifest=unsigned, trusted_public_key=coord_pub, timeout_s=60)
            # a key we do not trust
            with pytest.raises(CheckpointTransferError, match="not by the expected key"):
                await download_checkpoint(transport, coord_id, bad_dest, trusted_public_key=SigningKey.generate().public_key, timeout_s=60)
            assert leftovers(bad_dest) == []

            # bytes rotting on the coordinator's disk after it verified them (same size, same
            # mtime, so its cached verdict still holds): the node's own hash check refuses them
            victim = ckpts / "step-00000005" / "optimizer.safetensors"
            st = victim.stat()
            flip_last_byte(victim)
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
            score = transport.scores.score(coord_id)
            with pytest.raises(CheckpointTransferError) as e:
                await download_checkpoint(transport, coord_id, tmp_path / "rotten", trusted_public_key=coord_pub, timeout_s=60)
            assert e.value.file == "optimizer.safetensors" and "do not match the manifest's sha256" in str(e.value)
            assert leftovers(tmp_path / "rotten") == []
            assert transport.scores.score(coord_id) < score  # the peer that sent bad data is scored down

            # a corrupt local checkpoint is caught while uploading it: the coordinator keeps nothing
            local = write_checkpoint_dir(tmp_path / "src", 6, make_state(6), CONFIG, "hash-6")
            flip_last_byte(local / "model.safetensors")
            await report_hash(transport, coord_id, 6, "hash-6")
            with pytest.raises(CheckpointDirError, match=r"model\.safetensors does not match its sha256"):
                await upload_checkpoint(transport, coord_id, local, timeout_s=60)
            await asyncio.to_thread(wait_for, lambda: not tmp_dirs(ckpts), 10, "the coordinator to drop the aborted upload")
            assert [c["step"] for c in coord.status()["checkpoints"]] == [5]
        finally:
            await transport.close()
            await host.shutdown()

    asyncio.run(scenario())
    assert coord.proc.alive()


def test_coordinator_sigkilled_while_writing_a_checkpoint_loses_nothing(swarm, tmp_path):
    coord = swarm.coordinator("coordinator", None, None, *COORDINATOR_FLAGS)
    coord_id = coord.wait_ready()["peer_id"]
    maddr, coord_pub = coord.maddr(), coordinator_key(tmp_path)
    ckpts = tmp_path / "coordinator" / "checkpoints"
    small, big = make_state(1), make_state(2, mb=160)
    small_dir = write_checkpoint_dir(tmp_path / "src", 1, small, CONFIG, "hash-1")
    big_dir = write_checkpoint_dir(tmp_path / "src", 2, big, CONFIG, "hash-2")
    total = sum(f["size"] for f in read_manifest(big_dir)["files"].values())
    assert total > 150e6
    seen_interrupted = []

    def partial_bytes() -> int:
        return sum(f.stat().st_size for d in tmp_dirs(ckpts) for f in d.iterdir())

    def kill_mid_write() -> None:
        # the coordinator has been sent half of step 2: wait until it has written a quarter of
        # it into its temp dir, then SIGKILL it there, with the checkpoint half on disk
        wait_for(lambda: partial_bytes() >= total // 4, 60, "the coordinator to write part of step 2")
        coord.proc.kill()
        seen_interrupted.append((partial_bytes(), [p.name for p in ckpts.iterdir()]))

    async def scenario():
        host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(maddr,)))
        transport = Transport(host)
        try:
            await join_as_replica(transport, coord_id)
            await report_hash(transport, coord_id, 1, "hash-1")
            assert await upload_checkpoint(transport, coord_id, small_dir, timeout_s=60) == 1
            await report_hash(transport, coord_id, 2, "hash-2")

            offer, frames = checkpoint_frames(big_dir)

            async def gated():
                sent = 0
                async for chunk in frames:
                    if sent >= total // 2 and not seen_interrupted:
                        await asyncio.to_thread(kill_mid_write)
                    yield chunk
                    sent += len(chunk.data)

            with pytest.raises((ConnectionError, RemoteError, RemoteProtocolError, PeerUnreachable, CallTimeout)):
                await transport.send(coord_id, offer, gated(), timeout=60)
            await frames.aclose()
            written, names = seen_interrupted[0]
            assert written >= total // 4 and "step-00000002" not in names
            assert any(n.startswith(".tmp-step-00000002") for n in names), names  # killed mid-write

            again = swarm.restart(coord, "coordinator-again")
            status = await asyncio.to_thread(again.wait_ready)
            assert status["peer_id"] == coord_id
            # the interrupted write left the previous checkpoint whole, and nothing of itself
            assert [c["step"] for c in status["checkpoints"]] == [1]
            assert leftovers(ckpts) == ["step-00000001"]

            dest = tmp_path / "download"
            path = await download_checkpoint(transport, coord_id, dest, trusted_public_key=coord_pub, timeout_s=60)
            assert path.name == "step-00000001" and leftovers(dest) == ["step-00000001"]
            assert_bitwise_equal(load_checkpoint_dir(path, public_key=coord_pub), small)
            with pytest.raises(RemoteError) as e:
                await fetch_manifest(transport, coord_id, step=2)
            assert e.value.code == "not_found"

            # and the restarted coordinator takes step 2 in full when it is sent again (the hash
            # reports it had in memory died with it: the replica reports again)
            await report_hash(transport, coord_id, 2, "hash-2")
            assert await upload_checkpoint(transport, coord_id, big_dir, timeout_s=60) == 2
            assert [c["step"] for c in again.status()["checkpoints"]] == [1, 2]
            assert leftovers(ckpts) == ["step-00000001", "step-00000002"]
        finally:
            await transport.close()
            await host.shutdown()

    asyncio.run(scenario())
