"""Checkpoint directories: the one on-disk format of a checkpoint. Nodes write, download, verify
and load them (node/state/checkpoint_client.py moves them between peers); the coordinator's store
(coordinator/checkpoints.py) keeps the newest few of them. Blocking file I/O: call it from a
worker thread (`asyncio.to_thread`) when on an event loop.

Layout under a root:

    step-00000042/
        model.safetensors        one safetensors file per named dict of tensors
        optimizer.safetensors
        manifest.json            written last: {format, step, created_at, model_config,
                                 files: {name: {sha256, size}}, state_hash, signer, signature}

Directory names come from `protocol.manifest.step_dir_name` only. The manifest checks and its
signature (Ed25519 over the canonical tuple `manifest_fields`, independent of JSON formatting
and key order) live in protocol/manifest.py.

Why it survives a SIGKILL at any moment: a checkpoint is built in `.tmp-step-...-<pid>-<rand>/`,
every file fsynced, the manifest written last, the directory fsynced, and only then renamed
to `step-XXXXXXXX` (rename is atomic) and the root fsynced. Until the rename nothing visible
changes; after it the checkpoint is complete. A step directory is deleted by renaming it to a
temp name first, so a half-deleted one is never seen.

Temp dirs are named `.tmp-<what>-<pid>-<rand>` after the process that writes them. What a killed
writer leaves behind is removed by `remove_stale_temp_dirs`, under one rule with one exception:
- before writing under a root, a writer removes the temp dirs whose process is dead. Never one of
  a live process: several writers may share a root (a download and a local save of the same node
  share its pid; another process may write there too), and deleting a live writer's temp dir
  would make its rename fail half-way. A name without a pid is never guessed at.
- the coordinator's store also removes every temp dir when it opens (`all_owners=True`): it is
  the only writer of its root, and its pid is no proof of anything after a restart (in a
  container the same pid comes back every time), so a dir of its dead predecessor could look
  alive forever.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from protocol.manifest import (
    MANIFEST,
    MAX_MANIFEST_SIZE,
    MAX_STATE_HASH_LEN,
    MAX_STEP,
    SUFFIX,
    ManifestError,
    canonical_json,
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

from ..osutil import fsync_path, pid_alive, remove_tree, sha256_file

TMP_PREFIX = ".tmp-"
_MAX_PID = 1 << 22  # Linux's largest pid_max: a bigger number in a temp name is not a pid


class CheckpointDirError(Exception):
    """A checkpoint directory on this machine is missing, damaged or cannot be written, or an
    input to one (step, state name, upload, range) is bad. `problem` says what is wrong, naming
    the file; `path` is the directory concerned when there is one; the message is both."""

    def __init__(self, problem: str, path: str | os.PathLike | None = None):
        super().__init__(problem if path is None else f"{path}: {problem}")
        self.problem, self.path = problem, path


# ---- temp dirs ----------------------------------------------------------------------------------


def temp_path(root: Path, what: str) -> Path:
    """A fresh temp name under `root` for `what` (`step-00000042`, `delete-step-00000042`),
    owned by this process."""
    return root / f"{TMP_PREFIX}{what}-{os.getpid()}-{secrets.token_hex(4)}"


def make_tmp_dir(root: Path, what: str) -> Path:
    path = temp_path(root, what)
    os.mkdir(path)
    return path


def _owner(name: str) -> int | None:
    """The pid in a temp dir's name, or None if it has none."""
    parts = name.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isascii() and parts[1].isdigit() and 0 < int(parts[1]) <= _MAX_PID:
        return int(parts[1])
    return None


def remove_stale_temp_dirs(root: str | os.PathLike, *, all_owners: bool = False) -> list[Path]:
    """Remove the temp dirs under `root` whose process is dead (every one with `all_owners`: the
    store's rule when it opens, see the module docstring). Returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        if not entry.name.startswith(TMP_PREFIX):
            continue
        owner = _owner(entry.name)
        if all_owners or (owner is not None and not pid_alive(owner)):
            remove_tree(entry)
            removed.append(entry)
    if removed:
        fsync_path(root)
    return removed


# ---- reading ------------------------------------------------------------------------------------


def read_manifest_file(path: str | os.PathLike, max_file_size: int = 2**63) -> dict[str, Any]:
    """The checked manifest.json of checkpoint directory `path` (its step must be the one the
    directory's name says, if the name is a step's); the files it lists are not looked at."""
    path = Path(path)
    mpath = path / MANIFEST
    try:
        size = mpath.lstat().st_size
        if size > MAX_MANIFEST_SIZE:
            raise CheckpointDirError(f"{MANIFEST} is {size} bytes, more than {MAX_MANIFEST_SIZE}", path)
        manifest = parse_manifest(mpath.read_bytes(), max_file_size)
    except FileNotFoundError:
        raise CheckpointDirError(f"{MANIFEST} is missing (not a checkpoint, or an incomplete one)", path) from None
    except OSError as e:
        raise CheckpointDirError(f"cannot read {MANIFEST}: {e.strerror}", path) from None
    except ManifestError as e:
        raise CheckpointDirError(f"{MANIFEST} is corrupt: {e}", path) from None
    dir_step = step_of_dir_name(path.name)
    if dir_step is not None and dir_step != manifest["step"]:
        raise CheckpointDirError(f"{MANIFEST} says step {manifest['step']}, the directory name says {dir_step}", path)
    return manifest


def stat_files(path: str | os.PathLike, manifest: Mapping[str, Any]) -> tuple:
    """(name, size, mtime_ns, inode) of manifest.json and of every file the manifest lists:
    what changes when a file is rewritten or replaced. CheckpointDirError if one is missing,
    not a regular file, or not of the manifest's size (sizes are free to check; hashes not)."""
    path = Path(path)
    prints = []
    for name in [MANIFEST, *sorted(manifest["files"])]:
        try:
            st = (path / name).lstat()
        except FileNotFoundError:
            raise CheckpointDirError(f"{name} is missing", path) from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointDirError(f"{name} is not a regular file", path)
        if name != MANIFEST and st.st_size != manifest["files"][name]["size"]:
            raise CheckpointDirError(f"{name} is {st.st_size} bytes, manifest says {manifest['files'][name]['size']}", path)
        prints.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(prints)


def read_manifest(path: str | os.PathLike, max_file_size: int = 2**63) -> dict[str, Any]:
    """The checked manifest of checkpoint directory `path`; sizes of its files checked too
    (cheap), hashes not (see `verify_checkpoint_dir`). CheckpointDirError says what is wrong."""
    manifest = read_manifest_file(path, max_file_size)
    stat_files(path, manifest)
    return manifest


def check_hashes(path: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Re-hash every file of checkpoint directory `path`; CheckpointDirError names the first
    that does not match the manifest."""
    path = Path(path)
    for name, f in sorted(manifest["files"].items()):
        try:
            digest = sha256_file(path / name)
        except FileNotFoundError:  # deleted (pruned) while we were reading it
            raise CheckpointDirError(f"{name} disappeared while being read (checkpoint deleted meanwhile)", path) from None
        if digest != f["sha256"]:
            raise CheckpointDirError(f"{name} does not match its sha256 in the manifest (corrupt)", path)


def verify_checkpoint_dir(path: str | os.PathLike, public_key: bytes | None = None) -> dict[str, Any]:
    """Re-hash every file of checkpoint directory `path` and check the manifest's signature
    (by `public_key` if given; without one a signed manifest must still verify). Returns the
    manifest; CheckpointDirError names the file and the problem."""
    manifest = read_manifest(path)
    check_hashes(path, manifest)
    ok, why = check_signature(manifest, public_key)
    if not ok:
        raise CheckpointDirError(why, path)
    return manifest


def load_files(path: str | os.PathLike, manifest: Mapping[str, Any], device: str = "cpu") -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of the files of an already verified checkpoint directory, by state name."""
    path = Path(path)
    out = {}
    for name in sorted(manifest["files"]):
        try:
            out[name[: -len(SUFFIX)]] = load_file(path / name, device=device)
        except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
            raise CheckpointDirError(f"cannot load {name}: {e}", path) from None
    return out


def load_checkpoint_dir(path: str | os.PathLike, device: str = "cpu", public_key: bytes | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """All tensors of checkpoint directory `path`, by state name ("model", "optimizer", ...),
    after verifying every file's sha256 (and the signature, see `verify_checkpoint_dir`)."""
    return load_files(path, verify_checkpoint_dir(path, public_key), device)


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """None if `path` is a readable safetensors file, else why not (a received file can match
    the sha256 of a manifest that lists garbage)."""
    try:
        with safe_open(path, framework="pt"):
            return None
    except Exception as e:  # safetensors raises its own SafetensorError
        return f"not a valid safetensors file: {e}"


def file_list(path: str | os.PathLike, manifest: Mapping[str, Any]) -> list[tuple[str, int, str]]:
    """(name, size, sha256) of every file of checkpoint directory `path`, manifest.json first
    (a downloader fetches it first to learn the others)."""
    raw = (Path(path) / MANIFEST).read_bytes()
    out = [(MANIFEST, len(raw), hashlib.sha256(raw).hexdigest())]
    return out + [(name, f["size"], f["sha256"]) for name, f in sorted(manifest["files"].items())]


def read_range(path: str | os.PathLike, offset: int, length: int) -> bytes:
    """Bytes [offset, offset+length) of the file `path` (shorter at its end), never through a
    symlink. The caller checks that the name is one the manifest lists."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if offset > size:
            raise CheckpointDirError(f"offset {offset} is past the end of {Path(path).name} ({size} bytes)")
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


# ---- writing ------------------------------------------------------------------------------------


def check_step(step: Any) -> int:
    if not is_int(step) or not 0 <= step <= MAX_STEP:
        raise CheckpointDirError(f"bad step {step!r}: must be an integer in [0, {MAX_STEP}]")
    return step


def check_save_inputs(step: Any, state: Mapping[str, Any], model_config: Mapping[str, Any] | None, state_hash: Any) -> None:
    """Refuse, before anything is written, what would not make a valid checkpoint."""
    check_step(step)
    if not state:
        raise CheckpointDirError(f"checkpoint step {step}: nothing to save (empty state)")
    try:
        for name in state:
            check_state_name(name)
        canonical_json(dict(model_config or {}))
    except ManifestError as e:
        raise CheckpointDirError(f"checkpoint step {step}: {e}") from None
    if state_hash is not None and (not isinstance(state_hash, str) or len(state_hash) > MAX_STATE_HASH_LEN):
        raise CheckpointDirError(f"bad state_hash: must be a string of at most {MAX_STATE_HASH_LEN} characters")


@contextmanager
def new_checkpoint(
    root: Path,
    step: int,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    model_config: Mapping[str, Any] | None = None,
    state_hash: str | None = None,
    signing_key: SigningKey | None = None,
    now: float | None = None,
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Write the files of checkpoint `step` into a new temp dir under `root` (each fsynced and
    hashed) and yield (temp dir, manifest) for `place`. Inputs must have passed
    `check_save_inputs`. On leaving, the temp dir is removed: gone already once placed, a
    leftover otherwise."""
    try:
        tmp = make_tmp_dir(root, step_dir_name(step))
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
        yield tmp, make_manifest(step, files, model_config, state_hash, created_at, signing_key)
    finally:
        remove_tree(tmp)


def place(tmp: Path, root: Path, manifest: Mapping[str, Any]) -> tuple[Path, dict[str, Any] | None]:
    """Finish temp dir `tmp` whose data files are written and fsynced: manifest last, fsync,
    atomic rename to `root/step-XXXXXXXX`, fsync the root. Returns (that directory, None). If
    the step is there already (placed earlier, or by another writer meanwhile) nothing is
    replaced: (the directory, its manifest) if it holds the same files, else CheckpointDirError."""
    step = manifest["step"]
    with open(tmp / MANIFEST, "wb") as f:
        f.write(manifest_to_json(manifest))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    final = root / step_dir_name(step)
    if os.path.lexists(final):
        return final, same_as_existing(final, manifest)
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # placed by another writer meanwhile
            return final, same_as_existing(final, manifest)
        raise CheckpointDirError(f"cannot place checkpoint step {step}: {e.strerror}", root) from None
    fsync_path(root)
    return final, None


def same_as_existing(final: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest of checkpoint directory `final` if it holds the same files as `manifest`
    (every file re-hashed); CheckpointDirError if it is damaged or holds other files."""
    step = manifest["step"]
    try:
        if final.is_symlink() or not final.is_dir():
            raise CheckpointDirError("not a directory", final)
        existing = verify_checkpoint_dir(final)
    except CheckpointDirError as e:
        raise CheckpointDirError(f"checkpoint step {step} already exists but is damaged ({e.problem}); not replacing it", final.parent) from None
    if existing["files"] != manifest["files"]:
        raise CheckpointDirError(f"checkpoint step {step} already exists with different contents; not replacing it", final.parent)
    return existing


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
    is returned as is; with different files, CheckpointDirError."""
    root = Path(root)
    check_save_inputs(step, state, model_config, state_hash)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(root)
    except OSError as e:
        raise CheckpointDirError(f"cannot write checkpoints under {root}: {e.strerror}") from None
    with new_checkpoint(root, step, state, model_config, state_hash, signing_key, now) as (tmp, manifest):
        return place(tmp, root, manifest)[0]


__all__ = [
    "TMP_PREFIX",
    "CheckpointDirError",
    "check_hashes",
    "check_save_inputs",
    "check_step",
    "file_list",
    "load_checkpoint_dir",
    "load_files",
    "make_tmp_dir",
    "new_checkpoint",
    "place",
    "read_manifest",
    "read_manifest_file",
    "read_range",
    "remove_stale_temp_dirs",
    "safetensors_problem",
    "same_as_existing",
    "stat_files",
    "temp_path",
    "verify_checkpoint_dir",
    "write_checkpoint_dir",
]
