"""Checkpoints between peers: download one from a peer, verifying it as it arrives, and upload
one. The directories themselves (layout, atomic placement, verification, temp dirs) are
node/state/checkpoint_dir.py, the format the coordinator's store keeps too.

What a peer sends is input: every chunk is checked against the manifest (name, offset, size,
sha256) as it arrives, every file is re-hashed, and the manifest's signature is checked against
a trusted key when one is given. Bad data raises `CheckpointTransferError` (a
RemoteProtocolError naming the file and the problem), the peer is scored down, and nothing is
left behind: files are received into a temp dir under the destination and only placed as
`step-XXXXXXXX/` once all of it checks out.

Every remote call has a deadline: `timeout_s` bounds a whole transfer, `chunk_timeout_s` the
wait for each chunk (a stalled peer is given up on long before the transfer's deadline).
Refusals and transport failures surface as the transport's own errors (RemoteError,
CallTimeout, PeerUnreachable, ConnectionError).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from protocol import Ack, CheckpointManifest, CheckpointOffer, CheckpointQuery, RemoteProtocolError, StateChunk, StateRequest
from protocol.manifest import (
    DEFAULT_MAX_FILE_SIZE,
    MANIFEST,
    ManifestError,
    check_manifest,
    check_signature,
    manifest_to_json,
    parse_manifest,
    step_dir_name,
)

# CheckpointDirError, load_checkpoint_dir and write_checkpoint_dir are re-exported (node/roles/replica.py
# imports them from here)
from .checkpoint_dir import (
    CheckpointDirError,
    load_checkpoint_dir,
    make_tmp_dir,
    place,
    read_manifest,
    remove_stale_temp_dirs,
    safetensors_problem,
    same_as_existing,
    write_checkpoint_dir,
)
from ..osutil import remove_tree
from ..net.transport import CallTimeout, Transport

CALL_TIMEOUT_S = 10.0  # a manifest query
TRANSFER_TIMEOUT_S = 600.0  # a whole download or upload
CHUNK_TIMEOUT_S = 30.0  # longest wait for the next chunk of a file during a download
UPLOAD_CHUNK = 4 << 20  # bytes of file data per StateChunk frame (frames are capped at 16 MiB)
CHECKPOINT_PREFIX = "checkpoint/"  # StateRequest names: checkpoint/<step>/<file>
_BAD_DATA_PENALTY = 2.0  # score taken from a peer that sent bad checkpoint data


class CheckpointTransferError(RemoteProtocolError):
    """A peer sent checkpoint data that does not match the manifest (or a bad manifest).
    `file` is the file concerned (manifest.json for the manifest itself)."""

    def __init__(self, peer_id: str, file: str, problem: str):
        super().__init__(f"{problem} (checkpoint data from {peer_id})", file)
        self.peer_id, self.file = peer_id, file


# ---- download -----------------------------------------------------------------------------------


def _bad(transport: Transport, peer_id: str, file: str, problem: str) -> CheckpointTransferError:
    transport.scores.penalize(peer_id, _BAD_DATA_PENALTY, time.monotonic(), f"checkpoint file {file}: {problem}")
    return CheckpointTransferError(peer_id, file, problem)


async def fetch_manifest(
    transport: Transport,
    peer_id: str,
    step: int | None = None,
    timeout: float = CALL_TIMEOUT_S,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    stage: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """(step, checked manifest) of the peer's checkpoint `step`, or of its latest (`step` None);
    of pipeline stage `stage`'s checkpoints where the peer keeps them per stage (the
    coordinator). A peer without it answers RemoteError(not_found)."""
    reply = await transport.call(peer_id, CheckpointQuery(step=step, stage=stage), timeout)
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
    stage: int | None = None,
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
                step, manifest = await fetch_manifest(transport, peer_id, step, min(CALL_TIMEOUT_S, timeout_s), max_file_size, stage)
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
                await asyncio.to_thread(same_as_existing, final, manifest)
                return final
            await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(remove_stale_temp_dirs, dest)
            tmp = await asyncio.to_thread(make_tmp_dir, dest, step_dir_name(step))
            try:
                for fname, meta in sorted(manifest["files"].items()):
                    await _download_file(transport, peer_id, step, fname, meta, tmp / fname, chunk_timeout_s, timeout_s, stage)
                path, _ = await asyncio.to_thread(place, tmp, dest, manifest)
                return path
            finally:
                await asyncio.to_thread(remove_tree, tmp)
    except TimeoutError:
        raise CallTimeout(f"download of checkpoint {step if step is not None else '(latest)'} from {peer_id} passed its {timeout_s:.0f} s deadline") from None


def _take(write: Callable[[bytes], object], h, data: bytes) -> None:
    write(data)
    h.update(data)


async def receive_file(
    transport: Transport, peer_id: str, name: str, file: str, size: int | None, sha: str, write: Callable[[bytes], object],
    chunk_timeout_s: float, timeout_s: float, max_size: int | None = None,
) -> int:
    """Stream the state blob `name` (a StateRequest name) from `peer_id` into `write` (called off
    the event loop), each chunk checked as it arrives against `size` and `sha` and the whole
    against `sha`; the bytes received. `size` None: the size the first chunk states, up to
    `max_size`. Bad data is a CheckpointTransferError naming `file` (the peer is scored down); a
    peer that stops sending, a CallTimeout."""
    h = hashlib.sha256()
    written = 0
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
                raise CallTimeout(f"{file}: no data from {peer_id} for {chunk_timeout_s:.0f} s ({written} of {size} bytes received)") from None
            if not isinstance(chunk, StateChunk):
                raise _bad(transport, peer_id, file, f"expected StateChunk frames, got {type(chunk).__name__}")
            if chunk.name != name:
                raise _bad(transport, peer_id, file, f"asked for {name!r}, got a chunk of {chunk.name!r}")
            if size is None:
                if max_size is not None and chunk.total_size > max_size:
                    raise _bad(transport, peer_id, file, f"the peer says the file is {chunk.total_size} bytes, over {max_size}")
                size = chunk.total_size
            if chunk.total_size != size:
                raise _bad(transport, peer_id, file, f"the peer says the file is {chunk.total_size} bytes, the manifest says {size}")
            if chunk.sha256 != sha:
                raise _bad(transport, peer_id, file, f"the peer serves another file: sha256 {chunk.sha256[:16]}..., the manifest says {sha[:16]}...")
            if chunk.offset != written:
                raise _bad(transport, peer_id, file, f"chunk at offset {chunk.offset}, expected {written}")
            if not chunk.data:
                raise _bad(transport, peer_id, file, f"empty chunk at offset {written} of {size}")
            await asyncio.to_thread(_take, write, h, chunk.data)
            written += len(chunk.data)  # StateChunk's own checks keep offset + len <= total_size
            if written == size:  # all there: we hang up first (the server waits for that: see TransportConfig.linger_s)
                break
    finally:
        await stream.aclose()
    if written != size:
        raise _bad(transport, peer_id, file, f"the stream ended after {written} of {size} bytes")
    if h.hexdigest() != sha:
        raise _bad(transport, peer_id, file, "the received bytes do not match the manifest's sha256 (corrupt or tampered)")
    return written


def _finish_file(f, path: Path) -> str | None:
    """fsync, then check it is a readable safetensors file; None if so, else why not."""
    f.flush()
    os.fsync(f.fileno())
    return safetensors_problem(path)


async def _download_file(
    transport: Transport, peer_id: str, step: int, fname: str, meta: Mapping[str, Any], path: Path, chunk_timeout_s: float, timeout_s: float,
    stage: int | None = None,
) -> None:
    name = ("" if stage is None else f"stage-{stage}/") + f"{CHECKPOINT_PREFIX}{step}/{fname}"
    with open(path, "wb") as f:
        await receive_file(transport, peer_id, name, fname, meta["size"], meta["sha256"], f.write, chunk_timeout_s, timeout_s)
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
                raise CheckpointDirError(f"cannot read {fname}: {e.strerror}", path) from None
            try:
                offset = 0
                while offset < size:
                    data = await asyncio.to_thread(os.pread, fd, min(chunk_size, size - offset), offset)
                    if not data:
                        raise CheckpointDirError(f"{fname} shrank while being read ({offset} of {size} bytes)", path)
                    h.update(data)
                    if offset + len(data) == size and h.hexdigest() != sha:
                        raise CheckpointDirError(f"{fname} does not match its sha256 in the manifest (corrupt)", path)
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
    "upload_checkpoint",
    "write_checkpoint_dir",
]
