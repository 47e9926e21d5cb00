"""Checkpoints on the node's side: download one from a peer, verify it, place it atomically;
upload one; write and load checkpoint directories locally.

The directory layout is the coordinator's (`step-XXXXXXXX/` with `<name>.safetensors` files
and `manifest.json` written last), and the manifest rules are shared through
protocol/manifest.py, so a directory written here loads in the coordinator's CheckpointStore
and the other way round. The node cannot import the coordinator; nothing here does.

What a peer sends is input: every chunk is checked against the manifest (name, offset, size,
sha256) as it arrives, every file is re-hashed, and the manifest's signature is checked against
a trusted key when one is given. Bad data raises `CheckpointTransferError` (a
RemoteProtocolError naming the file and the problem), the peer is scored down, and nothing is
left behind: files are received into `.tmp-step-...-<pid>-<rand>/` under the destination and
only renamed to `step-XXXXXXXX/` once all of it checks out. A temp dir left by a killed process
is removed by the next download or write into the same directory.

Every remote call has a deadline: `timeout_s` bounds a whole transfer, `chunk_timeout_s` the
wait for each chunk (a stalled peer is given up on long before the transfer's deadline).
Refusals and transport failures surface as the transport's own errors (RemoteError,
CallTimeout, PeerUnreachable, ConnectionError).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from protocol import Ack, CheckpointManifest, CheckpointOffer, CheckpointQuery, RemoteProtocolError, StateChunk, StateRequest
from protocol.manifest import (
    DEFAULT_MAX_FILE_SIZE,
    MANIFEST,
    MAX_MANIFEST_SIZE,
    MAX_STATE_HASH_LEN,
    MAX_STEP,
    SUFFIX,
    ManifestError,
    canonical_json,
    check_manifest,
    check_signature,
    check_state_name,
    is_int,
    make_manifest,
    manifest_to_json,
    parse_manifest,
    step_dir_name,
    step_of_dir_name,
)
from protocol.signatures import SigningKey

from .osutil import fsync_path, pid_alive, remove_tree, sha256_file
from .transport import CallTimeout, Transport

CALL_TIMEOUT_S = 10.0  # a manifest query
TRANSFER_TIMEOUT_S = 600.0  # a whole download or upload
CHUNK_TIMEOUT_S = 30.0  # longest wait for the next chunk of a file during a download
UPLOAD_CHUNK = 4 << 20  # bytes of file data per StateChunk frame (frames are capped at 16 MiB)
CHECKPOINT_PREFIX = "checkpoint/"  # StateRequest names: checkpoint/<step>/<file>
TMP_PREFIX = ".tmp-"
_BAD_DATA_PENALTY = 2.0  # score taken from a peer that sent bad checkpoint data


class CheckpointTransferError(RemoteProtocolError):
    """A peer sent checkpoint data that does not match the manifest (or a bad manifest).
    `file` is the file concerned (manifest.json for the manifest itself)."""

    def __init__(self, peer_id: str, file: str, problem: str):
        super().__init__(f"{problem} (checkpoint data from {peer_id})", file)
        self.peer_id, self.file = peer_id, file


class CheckpointDirError(Exception):
    """A checkpoint directory on this machine is missing, damaged, or cannot be written. The
    message names the directory or file and the problem."""


# ---- small filesystem helpers -------------------------------------------------------------------


def remove_stale_temp_dirs(root: str | os.PathLike) -> list[Path]:
    """Remove `.tmp-...-<pid>-<rand>` dirs under `root` whose process is gone (a download or
    write killed half-way). Those of live processes are left alone. Returns what was removed."""
    removed = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith(TMP_PREFIX):
            continue
        parts = entry.name.rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            remove_tree(entry)
            removed.append(entry)
    return removed


def _make_tmp_dir(root: Path, step: int) -> Path:
    path = root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(path)
    return path


def _place(tmp: Path, root: Path, manifest: Mapping[str, Any]) -> Path:
    """Finish a temp dir whose data files are written and fsynced: manifest last, fsync,
    atomic rename to step-XXXXXXXX, fsync the root. An existing checkpoint of that step is
    kept if it holds the same files, refused otherwise."""
    step = manifest["step"]
    with open(tmp / MANIFEST, "wb") as f:
        f.write(manifest_to_json(manifest))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    final = root / step_dir_name(step)
    if os.path.lexists(final):
        return _same_as_existing(final, manifest)
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # placed by someone else meanwhile
            return _same_as_existing(final, manifest)
        raise CheckpointDirError(f"cannot place checkpoint step {step} in {root}: {e.strerror}") from None
    fsync_path(root)
    return final


def _same_as_existing(final: Path, manifest: Mapping[str, Any]) -> Path:
    try:
        existing = verify_checkpoint_dir(final)
    except CheckpointDirError as e:
        raise CheckpointDirError(f"{final} already exists but is damaged ({e}); not replacing it") from None
    if existing["files"] != manifest["files"]:
        raise CheckpointDirError(f"{final} already exists with different contents; not replacing it")
    return final


# ---- local directories --------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike, max_file_size: int = 2**63) -> dict[str, Any]:
    """The checked manifest of checkpoint directory `path`; sizes of its files checked too
    (cheap), hashes not (see `verify_checkpoint_dir`). CheckpointDirError says what is wrong."""
    path = Path(path)
    mpath = path / MANIFEST
    try:
        if mpath.lstat().st_size > MAX_MANIFEST_SIZE:
            raise CheckpointDirError(f"{mpath} is larger than {MAX_MANIFEST_SIZE} bytes")
        manifest = parse_manifest(mpath.read_bytes(), max_file_size)
    except FileNotFoundError:
        raise CheckpointDirError(f"{mpath} is missing (not a checkpoint, or an incomplete one)") from None
    except OSError as e:
        raise CheckpointDirError(f"cannot read {mpath}: {e.strerror}") from None
    except ManifestError as e:
        raise CheckpointDirError(f"{mpath} is corrupt: {e}") from None
    dir_step = step_of_dir_name(path.name)
    if dir_step is not None and dir_step != manifest["step"]:
        raise CheckpointDirError(f"{mpath} says step {manifest['step']}, the directory name says {dir_step}")
    for name, f in manifest["files"].items():
        try:
            st = (path / name).lstat()
        except FileNotFoundError:
            raise CheckpointDirError(f"{path / name} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointDirError(f"{path / name} is not a regular file")
        if st.st_size != f["size"]:
            raise CheckpointDirError(f"{path / name} is {st.st_size} bytes, the manifest says {f['size']}")
    return manifest


def verify_checkpoint_dir(path: str | os.PathLike, public_key: bytes | None = None) -> dict[str, Any]:
    """Re-hash every file of checkpoint directory `path` and check the manifest's signature
    (by `public_key` if given; without one a signed manifest must still verify). Returns the
    manifest; CheckpointDirError names the file and the problem."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, f in sorted(manifest["files"].items()):
        if sha256_file(path / name) != f["sha256"]:
            raise CheckpointDirError(f"{path / name} does not match its sha256 in the manifest (corrupt)")
    ok, why = check_signature(manifest, public_key)
    if not ok:
        raise CheckpointDirError(f"{path / MANIFEST}: {why}")
    return manifest


def load_checkpoint_dir(path: str | os.PathLike, device: str = "cpu", public_key: bytes | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """All tensors of checkpoint directory `path`, by state name ("model", "optimizer", ...),
    after verifying every file's sha256 (and the signature, see `verify_checkpoint_dir`)."""
    path = Path(path)
    manifest = verify_checkpoint_dir(path, public_key)
    out = {}
    for name in sorted(manifest["files"]):
        try:
            out[name[: -len(SUFFIX)]] = load_file(path / name, device=device)
        except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
            raise CheckpointDirError(f"cannot load {path / name}: {e}") from None
    return out


def write_checkpoint_dir(
    root: str | os.PathLike,
    step: int,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    model_config: Mapping[str, Any] | None = None,
    state_hash: str | None = None,
    signing_key: SigningKey | None = None,
    now: float | None = None,
) -> Path:
    """Write checkpoint `step` of `state` ({state name: {tensor name: tensor}}) atomically as
    `root/step-XXXXXXXX/` and return that path. If it already exists with identical files it
    is returned as is; with different files, CheckpointDirError. Blocking: call it through
    `asyncio.to_thread` from the event loop."""
    root = Path(root)
    if not state:
        raise CheckpointDirError(f"checkpoint step {step}: nothing to save (empty state)")
    if not is_int(step) or not 0 <= step <= MAX_STEP:
        raise CheckpointDirError(f"bad step {step!r}: must be an integer in [0, {MAX_STEP}]")
    if state_hash is not None and (not isinstance(state_hash, str) or len(state_hash) > MAX_STATE_HASH_LEN):
        raise CheckpointDirError(f"bad state_hash: must be a string of at most {MAX_STATE_HASH_LEN} characters")
    try:
        for name in state:
            check_state_name(name)
        canonical_json(dict(model_config or {}))
    except ManifestError as e:
        raise CheckpointDirError(f"checkpoint step {step}: {e}") from None
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(root)
        tmp = _make_tmp_dir(root, step)
    except OSError as e:
        raise CheckpointDirError(f"cannot write checkpoints under {root}: {e.strerror}") from None
    try:
        files = {}
        for name in sorted(state):
            fname = name + SUFFIX
            try:
                save_file({k: v.contiguous() for k, v in state[name].items()}, tmp / fname)
            except OSError as e:
                raise CheckpointDirError(f"cannot write {fname} under {root}: {e.strerror}") from None
            except Exception as e:  # safetensors raises ValueError/TypeError/its own errors
                raise CheckpointDirError(f"checkpoint step {step}: cannot save {name!r}: {e}") from None
            fsync_path(tmp / fname)
            files[fname] = {"sha256": sha256_file(tmp / fname), "size": (tmp / fname).stat().st_size}
        created_at = time.time() if now is None else float(now)
        manifest = make_manifest(step, files, model_config, state_hash, created_at, signing_key)
        return _place(tmp, root, manifest)
    finally:
        remove_tree(tmp)  # gone already after a successful rename; a leftover otherwise


# ---- download -----------------------------------------------------------------------------------


def _bad(transport: Transport, peer_id: str, file: str, problem: str) -> CheckpointTransferError:
    transport.scores.penalize(peer_id, _BAD_DATA_PENALTY, time.monotonic())
    return CheckpointTransferError(peer_id, file, problem)


async def fetch_manifest(
    transport: Transport, peer_id: str, step: int | None = None, timeout: float = CALL_TIMEOUT_S, max_file_size: int = DEFAULT_MAX_FILE_SIZE
) -> tuple[int, dict[str, Any]]:
    """(step, checked manifest) of the peer's checkpoint `step`, or of its latest (`step` None).
    A peer without it answers RemoteError(not_found)."""
    reply = await transport.call(peer_id, CheckpointQuery(step=step), timeout)
    if not isinstance(reply, CheckpointManifest):
        raise _bad(transport, peer_id, MANIFEST, f"expected a CheckpointManifest, got {type(reply).__name__}")
    if step is not None and reply.step != step:
        raise _bad(transport, peer_id, MANIFEST, f"asked for step {step}, got the manifest of step {reply.step}")
    try:
        manifest = parse_manifest(reply.manifest, max_file_size)
    except ManifestError as e:
        raise _bad(transport, peer_id, MANIFEST, str(e)) from None
    if manifest["step"] != reply.step:
        raise _bad(transport, peer_id, MANIFEST, f"the reply says step {reply.step}, its manifest says {manifest['step']}")
    return reply.step, manifest


async def download_checkpoint(
    transport: Transport,
    peer_id: str,
    dest_dir: str | os.PathLike,
    step: int | None = None,
    trusted_public_key: bytes | None = None,
    timeout_s: float = TRANSFER_TIMEOUT_S,
    *,
    manifest: Mapping[str, Any] | None = None,
    chunk_timeout_s: float = CHUNK_TIMEOUT_S,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
) -> Path:
    """Download checkpoint `step` (None: the peer's latest) into `dest_dir/step-XXXXXXXX/` and
    return that path. The manifest is asked of the same peer unless given (e.g. one learnt
    from the coordinator, with the files then fetched from a replica); with
    `trusted_public_key` it must be signed by that key. Every file is checked against the
    manifest; on any problem nothing is left under `dest_dir`."""
    dest = Path(dest_dir)
    try:
        async with asyncio.timeout(timeout_s):
            if manifest is None:
                step, manifest = await fetch_manifest(transport, peer_id, step, min(CALL_TIMEOUT_S, timeout_s), max_file_size)
                from_peer = True
            else:
                manifest = check_manifest(manifest, max_file_size)  # ManifestError: the caller's input is bad
                if step is not None and manifest["step"] != step:
                    raise ValueError(f"manifest is for step {manifest['step']}, not step {step}")
                step, from_peer = manifest["step"], False
            ok, why = check_signature(manifest, trusted_public_key)
            if not ok:
                if from_peer:
                    raise _bad(transport, peer_id, MANIFEST, why)
                raise ManifestError(f"manifest: {why}")
            final = dest / step_dir_name(step)
            if os.path.lexists(final):
                return await asyncio.to_thread(_same_as_existing, final, manifest)
            await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(remove_stale_temp_dirs, dest)
            tmp = await asyncio.to_thread(_make_tmp_dir, dest, step)
            try:
                for fname, meta in sorted(manifest["files"].items()):
                    await _download_file(transport, peer_id, step, fname, meta, tmp / fname, chunk_timeout_s, timeout_s)
                return await asyncio.to_thread(_place, tmp, dest, manifest)
            finally:
                await asyncio.to_thread(remove_tree, tmp)
    except TimeoutError:
        raise CallTimeout(f"download of checkpoint {step if step is not None else '(latest)'} from {peer_id} passed its {timeout_s:.0f} s deadline") from None


def _append(f, h, data: bytes) -> None:
    f.write(data)
    h.update(data)


def _finish_file(f, path: Path) -> str | None:
    """fsync, then check it is a readable safetensors file; None if so, else why not."""
    f.flush()
    os.fsync(f.fileno())
    try:
        with safe_open(path, framework="pt"):
            return None
    except Exception as e:  # SafetensorError: the hash matched a manifest that lists garbage
        return f"not a valid safetensors file: {e}"


async def _download_file(
    transport: Transport, peer_id: str, step: int, fname: str, meta: Mapping[str, Any], path: Path, chunk_timeout_s: float, timeout_s: float
) -> None:
    name = f"{CHECKPOINT_PREFIX}{step}/{fname}"
    size, sha = meta["size"], meta["sha256"]
    h = hashlib.sha256()
    written = 0
    with open(path, "wb") as f:
        # The caller's whole-transfer deadline (started earlier, so it fires first) bounds this
        # stream; the stream's own deadline must not fire first: it spans our awaits between
        # chunks, where its cancellation would not be turned into a CallTimeout.
        stream = transport.stream(peer_id, StateRequest(name=name), timeout=timeout_s)
        try:
            while True:
                try:
                    async with asyncio.timeout(chunk_timeout_s):
                        chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise CallTimeout(f"{fname}: no data from {peer_id} for {chunk_timeout_s:.0f} s ({written} of {size} bytes received)") from None
                if not isinstance(chunk, StateChunk):
                    raise _bad(transport, peer_id, fname, f"expected StateChunk frames, got {type(chunk).__name__}")
                if chunk.name != name:
                    raise _bad(transport, peer_id, fname, f"asked for {name!r}, got a chunk of {chunk.name!r}")
                if chunk.total_size != size:
                    raise _bad(transport, peer_id, fname, f"the peer says the file is {chunk.total_size} bytes, the manifest says {size}")
                if chunk.sha256 != sha:
                    raise _bad(transport, peer_id, fname, f"the peer serves another file: sha256 {chunk.sha256[:16]}..., the manifest says {sha[:16]}...")
                if chunk.offset != written:
                    raise _bad(transport, peer_id, fname, f"chunk at offset {chunk.offset}, expected {written}")
                if not chunk.data:
                    raise _bad(transport, peer_id, fname, f"empty chunk at offset {written} of {size}")
                await asyncio.to_thread(_append, f, h, chunk.data)
                written += len(chunk.data)  # StateChunk's own checks keep offset + len <= total_size
        finally:
            await stream.aclose()
        if written != size:
            raise _bad(transport, peer_id, fname, f"the stream ended after {written} of {size} bytes")
        if h.hexdigest() != sha:
            raise _bad(transport, peer_id, fname, "the received bytes do not match the manifest's sha256 (corrupt or tampered)")
        problem = await asyncio.to_thread(_finish_file, f, path)
        if problem:
            raise _bad(transport, peer_id, fname, problem)


# ---- upload -------------------------------------------------------------------------------------


def checkpoint_frames(checkpoint_dir: str | os.PathLike, chunk_size: int = UPLOAD_CHUNK) -> tuple[CheckpointOffer, AsyncIterator[StateChunk]]:
    """The frames that upload checkpoint directory `checkpoint_dir`: a CheckpointOffer, then
    StateChunk frames of at most `chunk_size` bytes for every file, in manifest (name) order.
    Files are hashed as they are read; a file that does not match its manifest raises
    CheckpointDirError before its last chunk is sent, so the receiver never completes it."""
    if not 1 <= chunk_size <= UPLOAD_CHUNK:
        raise ValueError(f"chunk_size must be in [1, {UPLOAD_CHUNK}] bytes, got {chunk_size}")
    path = Path(checkpoint_dir)
    manifest = read_manifest(path)
    offer = CheckpointOffer(step=manifest["step"], manifest=manifest_to_json(manifest))

    async def chunks() -> AsyncIterator[StateChunk]:
        for fname, meta in sorted(manifest["files"].items()):
            size, sha = meta["size"], meta["sha256"]
            h = hashlib.sha256()
            try:
                fd = os.open(path / fname, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as e:
                raise CheckpointDirError(f"cannot read {path / fname}: {e.strerror}") from None
            try:
                offset = 0
                while offset < size:
                    data = await asyncio.to_thread(os.pread, fd, min(chunk_size, size - offset), offset)
                    if not data:
                        raise CheckpointDirError(f"{path / fname} shrank while being read ({offset} of {size} bytes)")
                    h.update(data)
                    if offset + len(data) == size and h.hexdigest() != sha:
                        raise CheckpointDirError(f"{path / fname} does not match its sha256 in the manifest (corrupt)")
                    yield StateChunk(name=fname, offset=offset, total_size=size, sha256=sha, data=data)
                    offset += len(data)
            finally:
                os.close(fd)

    return offer, chunks()


async def upload_checkpoint(transport: Transport, peer_id: str, checkpoint_dir: str | os.PathLike, timeout_s: float = TRANSFER_TIMEOUT_S) -> int:
    """Send checkpoint directory `checkpoint_dir` to a peer (the coordinator), which checks
    every hash before it keeps it. Returns the step the peer acknowledged."""
    offer, frames = checkpoint_frames(checkpoint_dir)
    try:
        reply = await transport.send(peer_id, offer, frames, timeout=timeout_s)
    finally:
        await frames.aclose()
    if not isinstance(reply, Ack) or reply.info.get("step") != offer.step:
        raise _bad(transport, peer_id, MANIFEST, f"expected an Ack of step {offer.step}, got {reply!r}"[:300])
    return offer.step


__all__ = [
    "CHUNK_TIMEOUT_S",
    "CheckpointDirError",
    "CheckpointTransferError",
    "checkpoint_frames",
    "download_checkpoint",
    "fetch_manifest",
    "load_checkpoint_dir",
    "read_manifest",
    "remove_stale_temp_dirs",
    "upload_checkpoint",
    "verify_checkpoint_dir",
    "write_checkpoint_dir",
]
