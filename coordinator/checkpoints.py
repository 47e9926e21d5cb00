"""Checkpoint store: safetensors files plus a (signed) manifest, written atomically.

Layout under the store's root:

    step-00000042/
        model.safetensors        one safetensors file per named dict of tensors
        optimizer.safetensors
        manifest.json            written last: {format, step, created_at, model_config,
                                 files: {name: {sha256, size}}, state_hash, signer, signature}

Why it survives a SIGKILL at any moment: a checkpoint is built in `.tmp-step-...-<pid>-<rand>/`,
every file fsynced, the manifest written last, the directory fsynced, and only then renamed
to `step-XXXXXXXX` (rename is atomic) and the root fsynced. Until the rename nothing visible
changes; after it the checkpoint is complete. Older checkpoints are deleted only after the new
one is in place, by renaming them to a temp name first, so a half-deleted one is never seen.
Temp dirs left by a crash are removed when a store opens (one store per root).

The manifest checks and its signature (Ed25519 over the canonical tuple `manifest_fields`,
independent of JSON formatting and key order) live in protocol/manifest.py, shared with nodes,
which verify what they download (node/checkpoint_client.py). Uploads (a checkpoint sent by a peer) are checked
like any remote input: names, sizes, hashes, signature; nothing is kept unless all match.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from protocol.manifest import (  # re-exported: these names were defined here first
    DEFAULT_MAX_FILE_SIZE,
    FORMAT,
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
    manifest_to_json,
    sign_manifest,
    step_dir_name,
    step_of_dir_name,
)
from protocol.manifest import is_int as _is_int
from node.osutil import fsync_path, remove_tree, sha256_file
from protocol.signatures import SigningKey

MAX_CHUNK_SIZE = 8 * 1024 * 1024  # bytes per read_chunk; fits in a protocol frame
_TMP_PREFIX = ".tmp-"


class CheckpointError(Exception):
    """A checkpoint is missing, damaged, or an input (step, name, range, upload) is bad.
    The message names the step, the file and the problem. (The pure manifest checks in
    protocol/manifest.py raise ManifestError; the store turns those into CheckpointError.)"""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path  # the step-XXXXXXXX directory
    manifest: dict[str, Any]


def _check_step(step: Any) -> int:
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"bad step {step!r}: must be an integer in [0, {MAX_STEP}]")
    return step


# -- small filesystem helpers ---------------------------------------------------------------------


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# -- the store ------------------------------------------------------------------------------------


class CheckpointStore:
    """Checkpoints under `root`, newest `keep` kept. One store per root (opening one removes
    temp dirs left by crashes, which would also remove another live store's work in progress).

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
        if not _is_int(keep) or keep < 1:
            raise ValueError(f"keep: must be an integer >= 1, got {keep!r}")
        if not _is_int(max_file_size) or max_file_size < 8:
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
        self._remove_leftovers()
        # Hash what is on disk now, at startup, so that the first list()/latest()/files() of a
        # serving coordinator does not stall its event loop hashing gigabytes.
        self.list()

    def _remove_leftovers(self) -> None:
        removed = False
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP_PREFIX):
                remove_tree(entry)
                removed = True
        if removed:
            fsync_path(self.root)

    def _tmp_dir(self, what: str) -> Path:
        path = self.root / f"{_TMP_PREFIX}{what}-{os.getpid()}-{secrets.token_hex(4)}"
        os.mkdir(path)
        return path

    # -- reading ----------------------------------------------------------------------------------

    def _step_dirs(self) -> list[tuple[int, Path]]:
        out = []
        for entry in self.root.iterdir():
            # the name must be exactly what step_dir_name gives, so one step has one directory
            step = step_of_dir_name(entry.name)
            if step is not None and entry.is_dir() and not entry.is_symlink():
                out.append((step, entry))
        return sorted(out)

    @staticmethod
    def _fingerprint(path: Path, manifest: Mapping[str, Any]) -> tuple[tuple | None, str]:
        """(stat of the manifest and of every file, "") or (None, what is wrong). Sizes are
        checked here because that is free; hashes are not."""
        prints = []
        for name in [MANIFEST, *sorted(manifest["files"])]:
            try:
                st = (path / name).lstat()
            except FileNotFoundError:
                return None, f"{name} is missing"
            if not stat.S_ISREG(st.st_mode):
                return None, f"{name} is not a regular file"
            if name != MANIFEST and st.st_size != manifest["files"][name]["size"]:
                return None, f"{name} is {st.st_size} bytes, manifest says {manifest['files'][name]['size']}"
            prints.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(prints), ""

    def _check(self, step: int, full: bool, public_key: bytes | None = None) -> tuple[bool, str, dict[str, Any] | None]:
        """Verify one checkpoint: manifest, sizes, hashes, signature. With full=False a cached
        verdict for unchanged files is reused."""
        path = self.root / step_dir_name(step)
        if not path.is_dir() or path.is_symlink():
            return False, f"no checkpoint directory for step {step}", None
        mpath = path / MANIFEST
        try:
            mstat = mpath.lstat()
            if mstat.st_size > MAX_MANIFEST_SIZE:
                return False, f"{MANIFEST} is {mstat.st_size} bytes, more than {MAX_MANIFEST_SIZE}", None
            raw = mpath.read_bytes()
        except FileNotFoundError:
            return False, f"{MANIFEST} is missing (checkpoint incomplete)", None
        except OSError as e:
            return False, f"cannot read {MANIFEST}: {e.strerror}", None
        try:
            manifest = check_manifest(json.loads(raw), max_file_size=2**63)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and ManifestError are ValueErrors
            return False, f"{MANIFEST} is corrupt: {e}", None
        if manifest["step"] != step:
            return False, f"{MANIFEST} says step {manifest['step']}, directory says {step}", None
        key, problem = self._fingerprint(path, manifest)
        if key is None:
            return False, problem, None
        with self._lock:
            cached = self._verdicts.get(step)
        if not full and cached is not None and cached[0] == key:
            ok, reason = cached[1], cached[2]
        else:
            ok, reason = True, "ok"
            for name, f in sorted(manifest["files"].items()):
                try:
                    digest = sha256_file(path / name)
                except FileNotFoundError:  # pruned by a concurrent save while we were reading it
                    return False, f"{name} disappeared while being read (checkpoint pruned)", None
                if digest != f["sha256"]:
                    ok, reason = False, f"{name} does not match its sha256 in the manifest (corrupt)"
                    break
            if ok:
                ok, why = check_signature(manifest)
                reason = f"ok: {len(manifest['files'])} files match their sha256, {why}" if ok else why
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
        ok, reason, _ = self._check(_check_step(step), full=True, public_key=public_key)
        return ok, reason

    def _info(self, step: int) -> CheckpointInfo:
        """A verified (cached verdict) checkpoint, or CheckpointError saying why not."""
        ok, reason, manifest = self._check(_check_step(step), full=False)
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
        out = {}
        for name in sorted(info.manifest["files"]):
            try:
                out[name[: -len(SUFFIX)]] = load_file(info.path / name, device=device)
            except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
                raise CheckpointError(f"checkpoint step {step}: cannot load {name}: {e}") from None
        return out

    # -- serving ----------------------------------------------------------------------------------

    def files(self, step: int) -> list[tuple[str, int, str]]:
        """(name, size, sha256) of every file of checkpoint `step`, manifest first (a downloader
        fetches it first to learn the others)."""
        info = self._info(step)
        raw = (info.path / MANIFEST).read_bytes()
        out = [(MANIFEST, len(raw), hashlib.sha256(raw).hexdigest())]
        out += [(name, f["size"], f["sha256"]) for name, f in sorted(info.manifest["files"].items())]
        return out

    def read_chunk(self, step: int, filename: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of one file of checkpoint `step` (shorter at the end of
        the file). Only names listed in the manifest (or the manifest itself) are served: the
        name is looked up, never joined blindly, so '../x' or '/etc/passwd' cannot escape."""
        info = self._info(step)
        if not isinstance(filename, str) or (filename != MANIFEST and filename not in info.manifest["files"]):
            raise CheckpointError(f"{filename!r} is not a file of checkpoint step {step}")
        if not _is_int(offset) or offset < 0:
            raise CheckpointError(f"bad offset {offset!r}: must be an integer >= 0")
        if not _is_int(length) or not 0 <= length <= MAX_CHUNK_SIZE:
            raise CheckpointError(f"bad length {length!r}: must be an integer in [0, {MAX_CHUNK_SIZE}]")
        fd = os.open(info.path / filename, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if offset > size:
                raise CheckpointError(f"offset {offset} is past the end of {filename} ({size} bytes)")
            want = min(length, size - offset)
            parts, got = [], 0
            while got < want:
                part = os.pread(fd, want - got, offset + got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            return b"".join(parts)
        finally:
            os.close(fd)

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
        _check_step(step)
        if not state:
            raise CheckpointError(f"checkpoint step {step}: nothing to save (empty state)")
        model_config = dict(model_config or {})
        try:
            for name in state:
                check_state_name(name)
            canonical_json(model_config)
        except ManifestError as e:
            raise CheckpointError(str(e)) from None
        if state_hash is not None and (not isinstance(state_hash, str) or len(state_hash) > MAX_STATE_HASH_LEN):
            raise CheckpointError(f"bad state_hash: must be a string of at most {MAX_STATE_HASH_LEN} characters")
        self._refuse_if_pruned_at_once(step)
        tmp = self._tmp_dir(f"step-{step:08d}")
        try:
            files = {}
            for name in sorted(state):
                fname = name + SUFFIX
                try:
                    save_file(dict(state[name]), tmp / fname)
                except Exception as e:  # safetensors raises ValueError/TypeError/its own errors
                    raise CheckpointError(f"checkpoint step {step}: cannot save {name!r}: {e}") from None
                fsync_path(tmp / fname)
                files[fname] = {"sha256": sha256_file(tmp / fname), "size": (tmp / fname).stat().st_size}
            manifest = {
                "format": FORMAT,
                "step": step,
                "created_at": time.time() if now is None else float(now),
                "model_config": model_config,
                "files": files,
                "state_hash": state_hash,
                "signer": None,
                "signature": None,
            }
            if self.signing_key is not None:
                manifest = sign_manifest(manifest, self.signing_key)
            return self._place(step, tmp, manifest)
        finally:
            remove_tree(tmp)  # gone already after a successful rename; a leftover otherwise

    def _refuse_if_pruned_at_once(self, step: int) -> None:
        good = [c.step for c in self.list()]
        if len(good) >= self.keep and step < good[-self.keep] and step not in good:
            raise CheckpointError(
                f"checkpoint step {step} is older than the {self.keep} kept ones "
                f"({', '.join(map(str, good[-self.keep:]))}); it would be deleted at once"
            )

    def _place(self, step: int, tmp: Path, manifest: dict[str, Any]) -> CheckpointInfo:
        """Finish a fully written temp dir: manifest last, fsync, atomic rename, prune."""
        _write_durably(tmp / MANIFEST, manifest_to_json(manifest))
        fsync_path(tmp)
        final = self.root / step_dir_name(step)
        with self._lock:
            if os.path.lexists(final):
                return self._same_as_existing(step, manifest)
            try:
                os.rename(tmp, final)
            except OSError as e:
                # another process placed the same step between our check and our rename
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return self._same_as_existing(step, manifest)
                raise CheckpointError(f"cannot place checkpoint step {step}: {e.strerror}") from None
            fsync_path(self.root)
            # We hashed these files ourselves as they were written: record the verdict so that
            # list() need not hash them again.
            key, _ = self._fingerprint(final, manifest)
            if key is None:
                self._verdicts.pop(step, None)
            else:
                self._verdicts[step] = (key, True, "ok: hashed while written", manifest)
            self._prune()
            return CheckpointInfo(step, final, manifest)

    def _same_as_existing(self, step: int, manifest: Mapping[str, Any]) -> CheckpointInfo:
        ok, reason, existing = self._check(step, full=True)
        if not ok or existing is None:
            raise CheckpointError(f"checkpoint step {step} already exists but is damaged ({reason}); not replacing it")
        if existing["files"] != manifest["files"]:
            raise CheckpointError(f"checkpoint step {step} already exists with different contents; not replacing it")
        return CheckpointInfo(step, self.root / step_dir_name(step), existing)

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
                trash = self.root / f"{_TMP_PREFIX}delete-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
                os.rename(path, trash)
                self._verdicts.pop(step, None)
                remove_tree(trash)
        fsync_path(self.root)

    def begin_upload(self, step: int, manifest: Any) -> Upload:
        """Start receiving checkpoint `step` from a peer. `manifest` (remote input) is validated:
        names, sizes (<= max_file_size), hashes, signature if present. Refused at once if a
        different checkpoint already holds this step."""
        _check_step(step)
        try:
            clean = check_manifest(manifest, self.max_file_size)
        except ManifestError as e:
            raise CheckpointError(str(e)) from None
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
        return Upload(self, step, clean, self._tmp_dir(f"step-{step:08d}"))


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
                try:
                    with safe_open(self.path / name, framework="pt"):
                        pass
                except Exception as e:  # SafetensorError: the hashes matched, but it is not safetensors
                    raise CheckpointError(f"{name}: not a valid safetensors file: {e}") from None
                fsync_path(self.path / name)
            manifest = dict(self.manifest)
            if self.store.signing_key is not None:
                # The uploader's signature (if any) was checked in begin_upload. The store signs
                # what it accepted, so a joiner only needs to trust the coordinator's key.
                manifest = sign_manifest(manifest, self.store.signing_key)
            return self.store._place(self.step, self.path, manifest)
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
