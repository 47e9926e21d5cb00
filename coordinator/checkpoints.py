"""Checkpoint store: the newest `keep` checkpoint directories under one root, verified, served
in chunks, and received from peers.

The directory format (files, manifest written last, atomic placement, temp dirs, why it
survives a SIGKILL) is node/state/checkpoint_dir.py, shared with nodes, which write, verify and
upload the same directories; the manifest checks and its signature are protocol/manifest.py.
What the store adds: pruning to the newest `keep` (older checkpoints are deleted only after
the new one is in place, by renaming them to a temp name first), a cache of verdicts so that
listing does not re-hash gigabytes, and uploads. An upload (a checkpoint sent by a peer) is
checked like any remote input: names, sizes, hashes, signature; nothing is kept unless all
match.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.state.checkpoint_dir import (
    CheckpointDirError,
    check_hashes,
    check_save_inputs,
    check_step,
    file_list,
    load_files,
    make_tmp_dir,
    new_checkpoint,
    place,
    read_manifest_file,
    read_range,
    remove_stale_temp_dirs,
    safetensors_problem,
    stat_files,
    temp_path,
)
from node.osutil import fsync_path, remove_tree
from protocol.manifest import (
    DEFAULT_MAX_FILE_SIZE,
    MANIFEST,
    ManifestError,
    check_manifest,
    check_signature,
    is_int,
    sign_manifest,
    step_dir_name,
    step_of_dir_name,
)
from protocol.signatures import SigningKey

MAX_CHUNK_SIZE = 8 * 1024 * 1024  # bytes per read_chunk; fits in a protocol frame

# A checkpoint is missing, damaged, or an input (step, name, range, upload) is bad; the message
# names the step, the file and the problem. The store's name for the directory format's error:
# what the shared code refuses, the store refuses in the same terms.
CheckpointError = CheckpointDirError


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path  # the step-XXXXXXXX directory
    manifest: dict[str, Any]


class CheckpointStore:
    """Checkpoints under `root`, newest `keep` kept. One store per root (opening one removes
    every temp dir, which would also remove another live store's work in progress).

    Blocking file I/O: the service should call save/load/commit/verify in a worker thread
    (`asyncio.to_thread`); the store is thread-safe for that.
    """

    def __init__(
        self,
        root: str | Path,
        keep: int = 3,
        signing_key: SigningKey | None = None,
        max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    ):
        if not is_int(keep) or keep < 1:
            raise ValueError(f"keep: must be an integer >= 1, got {keep!r}")
        if not is_int(max_file_size) or max_file_size < 8:
            raise ValueError(f"max_file_size: must be an integer >= 8 bytes, got {max_file_size!r}")
        self.root = Path(root)
        self.keep = keep
        self.signing_key = signing_key
        self.max_file_size = max_file_size
        self._lock = threading.RLock()
        # step -> (fingerprint of the files' stat, ok, reason, manifest): hashing gigabytes on
        # every list() would be too slow, so a verdict is reused until a file's stat changes.
        self._verdicts: dict[int, tuple[tuple, bool, str, dict[str, Any] | None]] = {}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint root {self.root}: {e.strerror}") from None
        if not self.root.is_dir():
            raise CheckpointError(f"checkpoint root {self.root} is not a directory")
        remove_stale_temp_dirs(self.root, all_owners=True)
        # Hash what is on disk now, at startup, so that the first list()/latest()/files() of a
        # serving coordinator does not stall its event loop hashing gigabytes.
        self.list()

    # -- reading ----------------------------------------------------------------------------------

    def _step_dirs(self) -> list[tuple[int, Path]]:
        out = []
        for entry in self.root.iterdir():
            # the name must be exactly what step_dir_name gives, so one step has one directory
            step = step_of_dir_name(entry.name)
            if step is not None and entry.is_dir() and not entry.is_symlink():
                out.append((step, entry))
        return sorted(out)

    def _check(self, step: int, full: bool, public_key: bytes | None = None) -> tuple[bool, str, dict[str, Any] | None]:
        """Verify one checkpoint: manifest, sizes, hashes, signature. With full=False a cached
        verdict for unchanged files is reused."""
        path = self.root / step_dir_name(step)
        if not path.is_dir() or path.is_symlink():
            return False, f"no checkpoint directory for step {step}", None
        try:
            manifest = read_manifest_file(path)
            key = stat_files(path, manifest)
        except CheckpointDirError as e:
            return False, e.problem, None
        with self._lock:
            cached = self._verdicts.get(step)
        if not full and cached is not None and cached[0] == key:
            ok, reason = cached[1], cached[2]
        else:
            try:
                check_hashes(path, manifest)
                ok, why = check_signature(manifest)
                reason = f"ok: {len(manifest['files'])} files match their sha256, {why}" if ok else why
            except CheckpointDirError as e:
                ok, reason = False, e.problem
            with self._lock:
                self._verdicts[step] = (key, ok, reason, manifest)
        if ok and public_key is not None:
            ok, reason = check_signature(manifest, public_key)
        return ok, reason, manifest if ok else None

    def list(self) -> list[CheckpointInfo]:
        """Complete, verified checkpoints, ascending by step. Damaged ones are skipped (see
        `verify` for why); verdicts are cached until a file's size/mtime/inode changes."""
        out = []
        for step, path in self._step_dirs():
            ok, _, manifest = self._check(step, full=False)
            if ok and manifest is not None:
                out.append(CheckpointInfo(step, path, manifest))
        return out

    def latest(self) -> CheckpointInfo | None:
        good = self.list()
        return good[-1] if good else None

    def verify(self, step: int, public_key: bytes | None = None) -> tuple[bool, str]:
        """Re-hash every file of checkpoint `step`; check the signature if there is one, and
        require it to be by `public_key` if that is given. Returns (ok, reason)."""
        ok, reason, _ = self._check(check_step(step), full=True, public_key=public_key)
        return ok, reason

    def _info(self, step: int) -> CheckpointInfo:
        """A verified (cached verdict) checkpoint, or CheckpointError saying why not."""
        ok, reason, manifest = self._check(check_step(step), full=False)
        if not ok or manifest is None:
            raise CheckpointError(f"checkpoint step {step} is not available: {reason}")
        return CheckpointInfo(step, self.root / step_dir_name(step), manifest)

    def load(self, step: int, device: str = "cpu", public_key: bytes | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """All tensors of checkpoint `step`, by state name ("model", "optimizer", ...). Every
        file is re-hashed first; a mismatch raises CheckpointError naming the file."""
        ok, reason = self.verify(step, public_key=public_key)
        if not ok:
            raise CheckpointError(f"checkpoint step {step} failed verification: {reason}")
        info = self._info(step)
        try:
            return load_files(info.path, info.manifest, device)
        except CheckpointDirError as e:
            raise CheckpointError(f"checkpoint step {step}: {e.problem}") from None

    # -- serving ----------------------------------------------------------------------------------

    def files(self, step: int) -> list[tuple[str, int, str]]:
        """(name, size, sha256) of every file of checkpoint `step`, manifest first (a downloader
        fetches it first to learn the others)."""
        info = self._info(step)
        return file_list(info.path, info.manifest)

    def read_chunk(self, step: int, filename: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of one file of checkpoint `step` (shorter at the end of
        the file). Only names listed in the manifest (or the manifest itself) are served: the
        name is looked up, never joined blindly, so '../x' or '/etc/passwd' cannot escape."""
        info = self._info(step)
        if not isinstance(filename, str) or (filename != MANIFEST and filename not in info.manifest["files"]):
            raise CheckpointError(f"{filename!r} is not a file of checkpoint step {step}")
        if not is_int(offset) or offset < 0:
            raise CheckpointError(f"bad offset {offset!r}: must be an integer >= 0")
        if not is_int(length) or not 0 <= length <= MAX_CHUNK_SIZE:
            raise CheckpointError(f"bad length {length!r}: must be an integer in [0, {MAX_CHUNK_SIZE}]")
        return read_range(info.path / filename, offset, length)

    # -- writing ----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Mapping[str, torch.Tensor]],
        model_config: Mapping[str, Any] | None = None,
        state_hash: str | None = None,
        now: float | None = None,
    ) -> CheckpointInfo:
        """Write checkpoint `step` atomically, then prune to the newest `keep`. If `step` already
        exists with identical files, return it; if it exists and differs, CheckpointError."""
        check_save_inputs(step, state, model_config, state_hash)
        self._refuse_if_pruned_at_once(step)
        with new_checkpoint(self.root, step, state, model_config, state_hash, self.signing_key, now) as (tmp, manifest):
            return self._place(tmp, manifest)

    def _refuse_if_pruned_at_once(self, step: int) -> None:
        good = [c.step for c in self.list()]
        if len(good) >= self.keep and step < good[-self.keep] and step not in good:
            raise CheckpointError(
                f"checkpoint step {step} is older than the {self.keep} kept ones "
                f"({', '.join(map(str, good[-self.keep:]))}); it would be deleted at once"
            )

    def _place(self, tmp: Path, manifest: dict[str, Any]) -> CheckpointInfo:
        """Place a fully written temp dir (see node/state/checkpoint_dir.py: place), then prune."""
        step = manifest["step"]
        with self._lock:
            final, existing = place(tmp, self.root, manifest)
            if existing is not None:  # that step was there already, with the same files
                return CheckpointInfo(step, final, existing)
            # We hashed these files ourselves as they were written: record the verdict so that
            # list() need not hash them again.
            try:
                self._verdicts[step] = (stat_files(final, manifest), True, "ok: hashed while written", manifest)
            except CheckpointDirError:
                self._verdicts.pop(step, None)
            self._prune()
            return CheckpointInfo(step, final, manifest)

    def _prune(self) -> None:
        """Delete every step directory older than the newest `keep` good checkpoints."""
        good = [c.step for c in self.list()]
        if len(good) <= self.keep:
            return
        cutoff = good[-self.keep]
        for step, path in self._step_dirs():
            if step < cutoff:
                # rename first: a crash mid-delete leaves a temp dir (removed at next open),
                # never a half-deleted step-XXXXXXXX that looks like a checkpoint
                trash = temp_path(self.root, f"delete-{path.name}")
                os.rename(path, trash)
                self._verdicts.pop(step, None)
                remove_tree(trash)
        fsync_path(self.root)

    def begin_upload(self, step: int, manifest: Any, verified_by: int | None = None) -> Upload:
        """Start receiving checkpoint `step` from a peer. `manifest` (remote input) is validated:
        names, sizes (<= max_file_size), hashes, signature if present. Refused at once if a
        different checkpoint already holds this step. `verified_by`: how many replicas reported
        its hash, noted in the kept manifest (whatever the uploader's said)."""
        check_step(step)
        try:
            clean = check_manifest(manifest, self.max_file_size)
        except ManifestError as e:
            raise CheckpointError(str(e)) from None
        clean.pop("verified_by", None)
        if verified_by is not None:
            clean["verified_by"] = verified_by
        if clean["step"] != step:
            raise CheckpointError(f"manifest step: says {clean['step']}, upload is for step {step}")
        ok, why = check_signature(clean)
        if not ok:
            raise CheckpointError(f"upload of step {step} refused: {why}")
        if os.path.lexists(self.root / step_dir_name(step)):
            ok, reason, existing = self._check(step, full=False)
            if not ok or existing is None:
                raise CheckpointError(f"checkpoint step {step} already exists but is damaged ({reason}); not replacing it")
            if existing["files"] != clean["files"]:
                raise CheckpointError(f"checkpoint step {step} already exists with different contents")
        self._refuse_if_pruned_at_once(step)
        return Upload(self, step, clean, make_tmp_dir(self.root, step_dir_name(step)))


class Upload:
    """A checkpoint being received file by file, chunk by chunk, into a temp dir. Each file is
    written sequentially and hashed as it arrives; commit() checks everything and places it,
    re-signed by the store's key if it has one (the uploader's own signature is then replaced).
    The service must abort() an upload whose peer went away (its temp dir is otherwise only
    removed when the store next opens)."""

    def __init__(self, store: CheckpointStore, step: int, manifest: dict[str, Any], tmp: Path):
        self.store = store
        self.step = step
        self.manifest = manifest
        self.path = tmp
        self.last_write = time.monotonic()  # lets the service abort stalled uploads
        self._written = {name: 0 for name in manifest["files"]}
        self._hashes = {name: hashlib.sha256() for name in manifest["files"]}
        self._closed = False

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise CheckpointError(f"upload of step {self.step} is already committed or aborted")

    def write(self, filename: str, offset: int, data: bytes) -> None:
        self._refuse_if_closed()
        if filename not in self._written:
            raise CheckpointError(f"{filename!r} is not in the manifest of the upload of step {self.step}")
        expected = self._written[filename]
        if offset != expected:
            raise CheckpointError(f"{filename}: chunks must arrive in order: expected offset {expected}, got {offset!r}")
        size = self.manifest["files"][filename]["size"]
        if offset + len(data) > size:
            raise CheckpointError(f"{filename}: data runs to byte {offset + len(data)}, past the declared size {size}")
        with open(self.path / filename, "ab") as f:
            f.write(data)
        self._hashes[filename].update(data)
        self._written[filename] += len(data)
        self.last_write = time.monotonic()

    def commit(self) -> CheckpointInfo:
        """Check every file (size, sha256, a readable safetensors header), then place the
        checkpoint atomically. On any problem: CheckpointError, and nothing is left behind."""
        self._refuse_if_closed()
        try:
            for name, f in sorted(self.manifest["files"].items()):
                if self._written[name] != f["size"]:
                    raise CheckpointError(f"{name}: received {self._written[name]} of {f['size']} bytes")
                if self._hashes[name].hexdigest() != f["sha256"]:
                    raise CheckpointError(f"{name}: sha256 of the received bytes does not match the manifest")
                problem = safetensors_problem(self.path / name)
                if problem:
                    raise CheckpointError(f"{name}: {problem}")
                fsync_path(self.path / name)
            manifest = dict(self.manifest)
            if self.store.signing_key is not None:
                # The uploader's signature (if any) was checked in begin_upload. The store signs
                # what it accepted, so a joiner only needs to trust the coordinator's key.
                manifest = sign_manifest(manifest, self.store.signing_key)
            return self.store._place(self.path, manifest)
        finally:
            self.abort()

    def abort(self) -> None:
        self._closed = True
        remove_tree(self.path)

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.abort()


def weights_as_first_checkpoint(store: CheckpointStore, src: str | Path, pin: str) -> CheckpointInfo | None:
    """A new run of a Hugging Face model that comes with weights (fine-tuning) starts from them:
    they become checkpoint 0, which every replica takes (none is seeded). Nothing when the store
    already has a checkpoint (a restart) or the directory has no weights."""
    from node.models.hf import ModelDirError, build_causal_lm, open_model_dir

    try:
        model_dir = open_model_dir(Path(src).expanduser())
        if model_dir.weights is None or store.latest() is not None:
            return None
        model = build_causal_lm(model_dir, seed=0, weights=True)
    except ModelDirError as e:
        raise CheckpointError(str(e)) from None
    state = {"model": {n: p.detach().contiguous() for n, p in model.named_parameters()}}
    return store.save(0, state, model_config={"model": pin})


def weights_as_first_stage_checkpoints(stores: Mapping[int, CheckpointStore], src: str | Path, pin: str, plan) -> list[CheckpointInfo]:
    """weights_as_first_checkpoint for a pipeline run: each stage's slice of the weights (with a
    zero outer momentum) becomes checkpoint 0 of its stage, named as a stage server names its
    states, so each stage's first peer takes it. Nothing when a stage's store already has one."""
    from node.models.hf import ModelDirError, open_model_dir
    from node.models.hf_stages import stage_weights

    try:
        model_dir = open_model_dir(Path(src).expanduser())
        if model_dir.weights is None or any(store.latest() is not None for store in stores.values()):
            return []
        states = stage_weights(model_dir, plan)
    except ModelDirError as e:
        raise CheckpointError(str(e)) from None
    kept = []
    for index, (params, params_hash) in sorted(states.items()):
        meta = {"model": pin, "stage": index, "blocks": list(plan[index]), "num_stages": len(plan)}
        state = {"model": params, "outer": {n: torch.zeros_like(t) for n, t in params.items()}}
        kept.append(stores[index].save(0, state, model_config=meta, state_hash=params_hash))
    return kept
