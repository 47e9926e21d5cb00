"""The checkpoint store: real tensors, real files, a real SIGKILL mid-write, no mocks."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from coordinator.checkpoints import (
    MANIFEST,
    MAX_CHUNK_SIZE,
    CheckpointError,
    CheckpointStore,
    check_signature,
)
from node.state.checkpoint_dir import CheckpointDirError, write_checkpoint_dir
from node.state.state_server import DirectorySource
from protocol.signatures import SigningKey

REPO = Path(__file__).resolve().parent.parent


def tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w32": torch.randn(4, 5, generator=g),
            "w16": torch.randn(3, generator=g).to(torch.float16),
            "wbf16": torch.randn(2, 2, generator=g).to(torch.bfloat16),
            "w64": torch.randn(2, generator=g, dtype=torch.float64),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 3),
        },
        "optimizer": {
            "step": torch.tensor([seed], dtype=torch.int64),
            "i8": torch.randint(-128, 127, (7,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),
            "mask": torch.tensor([True, False, True]),
        },
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert a[name][k].dtype == b[name][k].dtype and torch.equal(a[name][k], b[name][k]), f"{name}.{k}"


def download(store: CheckpointStore, step: int, chunk: int = 100) -> dict[str, bytes]:
    """What a remote peer does: every file, in chunks, checked against files()."""
    out = {}
    for name, size, sha in store.files(step):
        data = b""
        while len(data) < size:
            part = store.read_chunk(step, name, len(data), chunk)
            assert part, f"{name}: short read at {len(data)}"
            data += part
        assert hashlib.sha256(data).hexdigest() == sha
        out[name] = data
    return out


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# -- save / load -------------------------------------------------------------------------------


def test_round_trip_of_several_dtypes_and_the_layout(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    state = tensors(1)
    info = store.save(42, state, model_config={"layers": 2, "dim": 64}, state_hash="h42", now=1000.0)
    assert info.step == 42 and info.path == tmp_path / "ckpt" / "step-00000042"
    assert sorted(p.name for p in info.path.iterdir()) == [MANIFEST, "model.safetensors", "optimizer.safetensors"]
    manifest = json.loads((info.path / MANIFEST).read_text())
    assert manifest == info.manifest
    assert manifest["format"] == 1 and manifest["step"] == 42 and manifest["created_at"] == 1000.0
    assert manifest["model_config"] == {"layers": 2, "dim": 64} and manifest["state_hash"] == "h42"
    assert manifest["signer"] is None and manifest["signature"] is None
    for name in ("model.safetensors", "optimizer.safetensors"):
        data = (info.path / name).read_bytes()
        assert manifest["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert_same(store.load(42), state)
    assert store.verify(42)[0] is True
    assert leftovers(tmp_path / "ckpt") == []
    # a new store (a restarted coordinator) sees the same
    again = CheckpointStore(tmp_path / "ckpt")
    assert [c.step for c in again.list()] == [42] and again.latest().manifest == manifest
    assert_same(again.load(42), state)


def test_keep_k_prunes_only_after_the_new_one_is_in_place(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3, 4, 5):
        store.save(step, tensors(step))
        assert store.latest().step == step
    assert [c.step for c in store.list()] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]
    with pytest.raises(CheckpointError, match=r"step 3 is older than the 2 kept ones \(4, 5\)"):
        store.save(3, tensors(3))
    # a store opened with a larger keep never prunes until it saves
    wide = CheckpointStore(tmp_path, keep=5)
    for step in (6, 7, 8):
        wide.save(step, tensors(step))
    assert [c.step for c in wide.list()] == [4, 5, 6, 7, 8]
    narrow = CheckpointStore(tmp_path, keep=2)
    assert [c.step for c in narrow.list()] == [4, 5, 6, 7, 8]
    narrow.save(9, tensors(9))
    assert [c.step for c in narrow.list()] == [8, 9]


def test_saving_a_step_again(tmp_path):
    store = CheckpointStore(tmp_path)
    first = store.save(7, tensors(7), now=1.0)
    again = store.save(7, tensors(7), now=2.0)  # identical content: the existing one is returned
    assert again.manifest == first.manifest and again.manifest["created_at"] == 1.0
    with pytest.raises(CheckpointError, match="step 7 already exists with different contents"):
        store.save(7, tensors(8))
    assert_same(store.load(7), tensors(7))
    assert leftovers(tmp_path) == []


def test_bad_save_inputs_are_named(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="bad step -1"):
        store.save(-1, tensors())
    with pytest.raises(CheckpointError, match="nothing to save"):
        store.save(1, {})
    for name in ("../evil", "a/b", ".hidden", "", "a..b"):
        with pytest.raises(CheckpointError, match="bad state name"):
            store.save(1, {name: {"w": torch.zeros(1)}})
    with pytest.raises(CheckpointError, match="model_config is not plain JSON"):
        store.save(1, tensors(), model_config={"f": float("nan")})
    with pytest.raises(CheckpointError, match="cannot save 'model'"):
        store.save(1, {"model": {"w": "not a tensor"}})
    assert store.list() == [] and leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create checkpoint root"):
        CheckpointStore(tmp_path / "file" / "ckpt")


# -- damage ------------------------------------------------------------------------------------


def test_a_flipped_byte_is_detected_and_named(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(1))
    store.save(2, tensors(2))
    flip_byte(tmp_path / "step-00000002" / "optimizer.safetensors")
    ok, reason = store.verify(2)
    assert not ok and reason == "optimizer.safetensors does not match its sha256 in the manifest (corrupt)"
    with pytest.raises(CheckpointError, match="optimizer.safetensors does not match its sha256"):
        store.load(2)
    reopened = CheckpointStore(tmp_path)  # list() hashes what it has not seen yet
    assert [c.step for c in reopened.list()] == [1]
    assert reopened.latest().step == 1
    with pytest.raises(CheckpointError, match="step 2 is not available"):
        reopened.read_chunk(2, "optimizer.safetensors", 0, 10)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / MANIFEST).unlink(), "manifest.json is missing"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "manifest.json is corrupt"),
        (lambda d: (d / MANIFEST).write_text('{"format": 1}'), "manifest.json is corrupt: manifest step"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda d: (d / "model.safetensors").write_bytes(b"short"), "model.safetensors is 5 bytes, manifest says"),
    ],
)
def test_damaged_checkpoints_are_skipped_with_a_reason(tmp_path, damage, reason):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(1))
    store.save(2, tensors(2))
    damage(tmp_path / "step-00000002")
    ok, why = store.verify(2)
    assert not ok and why.startswith(reason)
    assert [c.step for c in store.list()] == [1]
    with pytest.raises(CheckpointError, match="already exists but is damaged"):
        store.save(2, tensors(2))  # a damaged step is never silently replaced
    assert store.verify(99) == (False, "no checkpoint directory for step 99")


# -- signatures --------------------------------------------------------------------------------


def test_signed_manifest_verifies_and_tampering_is_caught(tmp_path):
    key = SigningKey.generate()
    store = CheckpointStore(tmp_path, signing_key=key)
    info = store.save(5, tensors(5), model_config={"dim": 8}, state_hash="abc")
    assert info.manifest["signer"] == key.public_key.hex()
    assert store.verify(5, public_key=key.public_key)[0] is True
    assert check_signature(info.manifest, key.public_key) == (True, "signature ok")
    other = SigningKey.generate().public_key
    ok, why = store.verify(5, public_key=other)
    assert not ok and "not by the expected key" in why
    with pytest.raises(CheckpointError, match="not by the expected key"):
        store.load(5, public_key=other)

    for field, value in (("model_config", {"dim": 9}), ("state_hash", "abd"), ("step", 5)):
        manifest = json.loads((info.path / MANIFEST).read_text())
        original = manifest[field]
        manifest[field] = value
        (info.path / MANIFEST).write_text(json.dumps(manifest))
        ok, why = CheckpointStore(tmp_path).verify(5, public_key=key.public_key)
        if value == original:  # rewriting the same value (and JSON layout) changes nothing signed
            assert ok, why
        else:
            assert not ok and "signature does not verify" in why
            assert CheckpointStore(tmp_path).list() == []  # a bad signature is damage, even without a key
        manifest[field] = original
        (info.path / MANIFEST).write_text(json.dumps(manifest))
    assert CheckpointStore(tmp_path).verify(5, public_key=key.public_key)[0] is True


def test_unsigned_checkpoint_fails_when_a_key_is_required(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors())
    assert store.verify(1)[0] is True
    assert store.verify(1, public_key=SigningKey.generate().public_key) == (False, "manifest is not signed")


# -- serving -----------------------------------------------------------------------------------


def test_files_and_chunks_reassemble_every_file(tmp_path):
    store = CheckpointStore(tmp_path)
    info = store.save(3, tensors(3))
    files = store.files(3)
    assert [f[0] for f in files] == [MANIFEST, "model.safetensors", "optimizer.safetensors"]
    got = download(store, 3, chunk=37)
    for name in got:
        assert got[name] == (info.path / name).read_bytes()
    size = files[1][1]
    assert store.read_chunk(3, "model.safetensors", size - 3, 100) == got["model.safetensors"][-3:]  # short at the end
    assert store.read_chunk(3, "model.safetensors", size, 10) == b""
    assert store.read_chunk(3, "model.safetensors", 0, 0) == b""


@pytest.mark.parametrize(
    "name",
    [
        "../step-00000001/model.safetensors",
        "/etc/passwd",
        "..",
        "",
        "model.safetensors/../manifest.json",
        "./model.safetensors",
        "step-00000003/model.safetensors",
        None,
    ],
)
def test_read_chunk_refuses_names_outside_the_checkpoint(tmp_path, name):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(1))
    store.save(3, tensors(3))
    (tmp_path / "step-00000003" / "extra.txt").write_text("not in the manifest")
    with pytest.raises(CheckpointError, match="is not a file of checkpoint step 3"):
        store.read_chunk(3, name, 0, 10)
    with pytest.raises(CheckpointError, match="is not a file of checkpoint step 3"):
        store.read_chunk(3, "extra.txt", 0, 10)


def test_read_chunk_refuses_bad_ranges_and_unknown_steps(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(1))
    size = store.files(1)[1][1]
    with pytest.raises(CheckpointError, match="bad offset -1"):
        store.read_chunk(1, "model.safetensors", -1, 10)
    with pytest.raises(CheckpointError, match=f"offset {size + 1} is past the end of model.safetensors"):
        store.read_chunk(1, "model.safetensors", size + 1, 10)
    with pytest.raises(CheckpointError, match="bad length -5"):
        store.read_chunk(1, "model.safetensors", 0, -5)
    with pytest.raises(CheckpointError, match="bad length"):
        store.read_chunk(1, "model.safetensors", 0, MAX_CHUNK_SIZE + 1)
    with pytest.raises(CheckpointError, match="step 2 is not available: no checkpoint directory"):
        store.read_chunk(2, "model.safetensors", 0, 10)
    with pytest.raises(CheckpointError, match="step 2 is not available"):
        store.files(2)


# -- uploads -----------------------------------------------------------------------------------


def upload_all(store: CheckpointStore, step: int, manifest: dict, blobs: dict[str, bytes], chunk: int = 64):
    up = store.begin_upload(step, manifest)
    for name in sorted(manifest["files"]):
        data = blobs[name]
        for off in range(0, len(data), chunk):
            up.write(name, off, data[off : off + chunk])
    return up


def test_upload_from_one_store_into_another(tmp_path):
    key = SigningKey.generate()
    src = CheckpointStore(tmp_path / "src", signing_key=key)
    src.save(10, tensors(10), model_config={"dim": 4})
    blobs = download(src, 10)
    manifest = json.loads(blobs[MANIFEST])
    dst = CheckpointStore(tmp_path / "dst")  # no key of its own: keeps the uploader's signature
    info = upload_all(dst, 10, manifest, blobs).commit()
    assert info.step == 10 and info.manifest["files"] == manifest["files"]
    assert dst.verify(10, public_key=key.public_key)[0] is True
    assert_same(dst.load(10), tensors(10))
    assert leftovers(tmp_path / "dst") == []
    # the same upload again is accepted and returns the existing checkpoint
    assert upload_all(dst, 10, manifest, blobs).commit().manifest["files"] == manifest["files"]
    # a store with a key vouches for what it accepted: joiners trust one key, the coordinator's
    coordinator_key = SigningKey.generate()
    signing = CheckpointStore(tmp_path / "coordinator", signing_key=coordinator_key)
    info = upload_all(signing, 10, manifest, blobs).commit()
    assert info.manifest["signer"] == coordinator_key.public_key.hex()
    assert signing.verify(10, public_key=coordinator_key.public_key)[0] is True
    assert json.loads((info.path / MANIFEST).read_text()) == info.manifest


def test_upload_with_a_wrong_hash_is_refused_and_leaves_nothing(tmp_path):
    src = CheckpointStore(tmp_path / "src")
    src.save(4, tensors(4))
    blobs = download(src, 4)
    manifest = json.loads(blobs[MANIFEST])
    blobs["model.safetensors"] = bytes([blobs["model.safetensors"][0] ^ 1]) + blobs["model.safetensors"][1:]
    dst = CheckpointStore(tmp_path / "dst")
    up = upload_all(dst, 4, manifest, blobs)
    with pytest.raises(CheckpointError, match="model.safetensors: sha256 of the received bytes does not match"):
        up.commit()
    assert list((tmp_path / "dst").iterdir()) == []
    with pytest.raises(CheckpointError, match="already committed or aborted"):
        up.write("model.safetensors", 0, b"x")


def test_upload_refuses_bad_chunks_and_incomplete_files(tmp_path):
    src = CheckpointStore(tmp_path / "src")
    src.save(4, tensors(4))
    blobs = download(src, 4)
    manifest = json.loads(blobs[MANIFEST])
    dst = CheckpointStore(tmp_path / "dst")
    size = manifest["files"]["model.safetensors"]["size"]
    with dst.begin_upload(4, manifest) as up:
        with pytest.raises(CheckpointError, match="expected offset 0, got 10"):
            up.write("model.safetensors", 10, b"abc")
        with pytest.raises(CheckpointError, match=f"past the declared size {size}"):
            up.write("model.safetensors", 0, b"\0" * (size + 1))
        with pytest.raises(CheckpointError, match="'other.safetensors' is not in the manifest"):
            up.write("other.safetensors", 0, b"abc")
        up.write("model.safetensors", 0, blobs["model.safetensors"][:10])
        with pytest.raises(CheckpointError, match=f"model.safetensors: received 10 of {size} bytes"):
            up.commit()
    assert list((tmp_path / "dst").iterdir()) == []
    with dst.begin_upload(4, manifest) as up:
        up.write("model.safetensors", 0, b"abc")
    assert list((tmp_path / "dst").iterdir()) == []  # leaving the block aborts


def test_upload_of_matching_hash_but_not_safetensors_is_refused(tmp_path):
    junk = b"\xff" * 100
    manifest = {
        "format": 1,
        "step": 1,
        "model_config": {},
        "files": {"model.safetensors": {"sha256": hashlib.sha256(junk).hexdigest(), "size": len(junk)}},
    }
    store = CheckpointStore(tmp_path)
    up = upload_all(store, 1, manifest, {"model.safetensors": junk})
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors file"):
        up.commit()
    assert list(tmp_path.iterdir()) == []


def _manifest(**files) -> dict:
    return {"format": 1, "step": 1, "model_config": {}, "files": files}


GOOD = {"sha256": "0" * 64, "size": 100}


@pytest.mark.parametrize(
    "manifest, problem",
    [
        (_manifest(**{"../x.safetensors": GOOD}), "bad checkpoint file name '../x.safetensors'"),
        ({"format": 1, "step": 1, "files": {"a/b.safetensors": GOOD}}, "bad checkpoint file name 'a/b.safetensors'"),
        (_manifest(**{"x.txt": GOOD}), "bad checkpoint file name 'x.txt'"),
        (_manifest(**{".hidden.safetensors": GOOD}), "bad checkpoint file name"),
        (_manifest(**{MANIFEST: GOOD}), "bad checkpoint file name 'manifest.json'"),
        (_manifest(**{"m.safetensors": {"sha256": "0" * 64, "size": 10**6 + 1}}), r"files.m.safetensors.size: must be an integer in \[8, 1000000\]"),
        (_manifest(**{"m.safetensors": {"sha256": "0" * 64, "size": -1}}), "files.m.safetensors.size"),
        (_manifest(**{"m.safetensors": {"sha256": "XYZ", "size": 100}}), "files.m.safetensors.sha256: must be 64 lowercase hex"),
        (_manifest(**{f"f{i}.safetensors": GOOD for i in range(65)}), "files: at most 64 files"),
        (_manifest(), "files: must be a non-empty object"),
        ({"format": 2, "step": 1, "files": {"m.safetensors": GOOD}}, "format: must be 1"),
        ({"format": 1, "step": 2, "files": {"m.safetensors": GOOD}}, "manifest step: says 2, upload is for step 1"),
        ({**_manifest(**{"m.safetensors": GOOD}), "signer": "ab" * 32}, "signer and signature must both be present"),
        ({**_manifest(**{"m.safetensors": GOOD}), "signer": "ab" * 32, "signature": "cd" * 64}, "refused: manifest signature does not verify"),
        ([1, 2], "must be an object"),
    ],
)
def test_upload_manifests_are_validated_as_remote_input(tmp_path, manifest, problem):
    store = CheckpointStore(tmp_path, max_file_size=10**6)
    with pytest.raises(CheckpointError, match=problem):
        store.begin_upload(1, manifest)
    assert list(tmp_path.iterdir()) == []


def test_upload_of_a_different_checkpoint_for_an_existing_step_is_refused_at_once(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(3, tensors(3))
    other = CheckpointStore(tmp_path / "other")
    other.save(3, tensors(4))
    manifest = json.loads(download(other, 3)[MANIFEST])
    with pytest.raises(CheckpointError, match="step 3 already exists with different contents"):
        store.begin_upload(3, manifest)


# -- crash safety ------------------------------------------------------------------------------


def test_leftovers_of_interrupted_writes_and_deletes_are_removed_on_open(tmp_path):
    store = CheckpointStore(tmp_path)
    good = store.save(1, tensors(1))
    # A save killed after writing everything but before the rename: a complete-looking temp dir.
    tmp = tmp_path / f".tmp-step-00000002-{os.getpid()}-deadbeef"
    tmp.mkdir()
    for p in good.path.iterdir():
        (tmp / p.name).write_bytes(p.read_bytes())
    # A prune killed between its rename and its rmtree.
    (tmp_path / ".tmp-delete-step-00000000-1-cafecafe").mkdir()
    (tmp_path / ".tmp-delete-step-00000000-1-cafecafe" / "model.safetensors").write_bytes(b"partial")
    assert [c.step for c in store.list()] == [1]  # temp dirs are never mistaken for checkpoints
    reopened = CheckpointStore(tmp_path)
    assert leftovers(tmp_path) == []
    assert reopened.latest().step == 1 and reopened.verify(1)[0]


# Saves a ~200 MB checkpoint; the test kills it as soon as it is writing.
_BIG_WRITER = r"""
import sys, torch
from coordinator.checkpoints import CheckpointStore
store = CheckpointStore(sys.argv[1])
store.save(2, {"model": {"w": torch.ones(50_000_000)}, "optimizer": {"m": torch.zeros(1000)}})
print("finished", flush=True)
"""


def test_sigkill_mid_write_never_damages_the_last_good_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    CheckpointStore(root).save(1, tensors(1), model_config={"dim": 4})
    proc = subprocess.Popen(
        [sys.executable, "-c", _BIG_WRITER, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(root.glob(".tmp-step-00000002-*/*.safetensors")):  # it has started writing
            if proc.poll() is not None:
                pytest.fail(f"writer exited before it was killed: {proc.stdout.read()} {proc.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail("writer never started writing its temp dir")
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert leftovers(root), "the kill should have left a temp dir behind"

    store = CheckpointStore(root)
    assert leftovers(root) == []
    assert [c.step for c in store.list()] == [1]
    assert store.latest().step == 1
    assert store.verify(1)[0] is True
    assert_same(store.load(1), tensors(1))
    assert not (root / "step-00000002").exists()


# -- the directory format shared with nodes (node/state/checkpoint_dir.py) ---------------------------


def test_one_temp_dir_rule_for_node_writers_and_the_store(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    names = {
        "dead": f".tmp-step-00000009-{dead.stdout.strip()}-abcd1234",  # a writer killed half-way
        "ours": f".tmp-step-00000010-{os.getpid()}-abcd1234",  # a write of ours in progress
        "init": ".tmp-delete-step-00000000-1-cafecafe",  # pid 1 is alive
        "no pid": ".tmp-something",
        "not a pid": f".tmp-step-00000011-{10**30}-abcd1234",
        "not digits": ".tmp-step-00000012-\u00b2-abcd1234",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    # a writer removes only the temp dirs of dead processes
    path = write_checkpoint_dir(tmp_path, 1, tensors(1))
    assert leftovers(tmp_path) == sorted(n for k, n in names.items() if k != "dead")
    # the store, the only writer of its root, removes them all when it opens
    store = CheckpointStore(tmp_path)
    assert leftovers(tmp_path) == []
    assert [c.step for c in store.list()] == [1] and store.list()[0].path == path


def test_a_symlink_in_place_of_a_step_is_not_taken_for_the_same_checkpoint(tmp_path):
    real = write_checkpoint_dir(tmp_path / "a", 3, tensors(3))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / real.name).symlink_to(real)
    with pytest.raises(CheckpointDirError, match="step 3 already exists but is damaged"):
        write_checkpoint_dir(tmp_path / "b", 3, tensors(3))
    with pytest.raises(CheckpointError, match="step 3 already exists but is damaged"):
        CheckpointStore(tmp_path / "b").save(3, tensors(3))
    assert leftovers(tmp_path / "b") == []


def test_a_directory_source_serves_what_the_store_serves(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(4, tensors(4))
    source = DirectorySource(tmp_path)
    assert source.latest_step() == 4 and source.manifest(4) == store.latest().manifest
    assert source.files(4) == {name: (size, sha) for name, size, sha in store.files(4)}
    for name, (size, _) in source.files(4).items():
        assert source.read_chunk(4, name, 0, size + 10) == store.read_chunk(4, name, 0, size)
        assert source.read_chunk(4, name, size // 2, 5) == store.read_chunk(4, name, size // 2, 5)
    (tmp_path / "step-00000004" / "extra.txt").write_text("not in the manifest")
    with pytest.raises(KeyError):
        source.read_chunk(4, "extra.txt", 0, 10)
    with pytest.raises(KeyError):
        source.read_chunk(4, "../step-00000004/model.safetensors", 0, 10)


def test_a_kept_upload_notes_how_many_replicas_verified_it_whatever_the_uploader_said(tmp_path):
    src = CheckpointStore(tmp_path / "src")
    src.save(6, tensors(6), state_hash="h6")
    blobs = download(src, 6)
    manifest = {**json.loads(blobs[MANIFEST]), "verified_by": 99}  # the uploader's claim counts for nothing
    store = CheckpointStore(tmp_path / "coordinator", signing_key=SigningKey.generate())
    up = store.begin_upload(6, manifest, verified_by=1)
    for name, data in blobs.items():
        if name != MANIFEST:
            up.write(name, 0, data)
    assert up.commit().manifest["verified_by"] == 1
    assert CheckpointStore(tmp_path / "coordinator").list()[0].manifest["verified_by"] == 1  # read back from disk
    assert store.verify(6)[0] is True  # a note beside the signed fields, not in them
    for bad in (-1, "1", 1.5, True):
        with pytest.raises(CheckpointError, match="verified_by"):
            store.begin_upload(7, {**manifest, "step": 7, "verified_by": bad})


def test_a_checkpoint_removed_while_it_is_served_ends_the_call_with_not_found(tmp_path):
    import asyncio
    import shutil

    from node.net.transport import CallContext, RPCError
    from node.state.state_server import CheckpointServer
    from protocol import StateRequest

    path = write_checkpoint_dir(tmp_path, 0, {"model": {"w": torch.zeros(8)}})
    server = CheckpointServer(None, DirectorySource(tmp_path))  # (no transport: the handler alone)

    async def receive():
        raise AssertionError("one frame")

    async def main():
        chunks = await server.on_state_request(CallContext("peer", StateRequest(name="checkpoint/0/model.safetensors"), receive))
        shutil.rmtree(path)  # e.g. a replica's initial state, dropped once uploaded, while a peer reads it
        with pytest.raises(RPCError, match="no longer here") as e:
            async for _ in chunks:
                pass
        return e.value.code

    assert asyncio.run(main()) == "not_found"
