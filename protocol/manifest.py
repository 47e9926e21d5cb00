"""Checkpoint manifests, sans-IO: validation, the canonical tuple a signature covers, signing.

A checkpoint is a directory `step-XXXXXXXX/` holding one safetensors file per named dict of
tensors and a `manifest.json` written last:

    {format, step, created_at, model_config, files: {name: {sha256, size}}, state_hash,
     signer, signature, verified_by}

`verified_by` (optional) is the keeper's note of how many replicas reported the state's hash
when it kept the checkpoint (1: the swarm had a single replica); like `created_at`, the
signature does not cover it.

Both ends use this module: the coordinator's store writes and serves checkpoints, nodes
download, verify and upload them. A manifest read from a peer or from disk is input:
`check_manifest` bounds and validates every field and raises `ManifestError` naming it; the
caller decides which error family that becomes (a peer's bad input, or a damaged file of ours).

The signature is Ed25519 over `manifest_fields(manifest)`, a tuple in fixed order, so it does
not depend on JSON formatting or key order. No file I/O here: bytes and dicts in, out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .signatures import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, SigningKey, verify

FORMAT = 1
DOMAIN = "swarmtrain/checkpoint/v1"
MANIFEST = "manifest.json"
SUFFIX = ".safetensors"
MAX_FILES = 64  # files per checkpoint (a manifest from a peer is remote input: bound it)
MAX_STEP = 10**15
MAX_STATE_HASH_LEN = 256
MAX_VERIFIERS = 1_000_000  # replicas a keeper may say reported a checkpoint's hash
MAX_MANIFEST_SIZE = 1024 * 1024  # bytes; a manifest is small, a huge one is garbage
DEFAULT_MAX_FILE_SIZE = 64 * 1024**3  # bytes per file of a checkpoint received from a peer

STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")
# A state name becomes a file name: keep it to a boring, portable alphabet.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest (or a name in it) is malformed. The message names the field and the problem."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def step_dir_name(step: int) -> str:
    """The directory of checkpoint `step`: `step-` and at least 8 digits."""
    return f"step-{step:08d}"


def step_of_dir_name(name: str) -> int | None:
    """The step of a directory named exactly as `step_dir_name` names it, else None (so one step
    has one directory: `step-1` or `step-000000001` are not checkpoints)."""
    m = STEP_DIR_RE.match(name)
    if m is None or name != step_dir_name(int(m.group(1))):
        return None
    return int(m.group(1))


def canonical_json(obj: Any) -> str:
    """One fixed JSON text for a JSON value (sorted keys, no spaces, no NaN)."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ManifestError(f"model_config is not plain JSON: {e}") from None


def manifest_fields(manifest: Mapping[str, Any]) -> tuple:
    """The canonical tuple a manifest signature covers (created_at is deliberately not in it:
    it says when a copy was written, not what the checkpoint is)."""
    files = tuple(sorted((name, f["sha256"], f["size"]) for name, f in manifest["files"].items()))
    return (DOMAIN, manifest["step"], files, manifest.get("state_hash"), canonical_json(manifest["model_config"]))


def sign_manifest(manifest: Mapping[str, Any], key: SigningKey) -> dict[str, Any]:
    """A copy of `manifest` signed by `key` (any earlier signature is replaced)."""
    out = dict(manifest)
    out["signer"] = key.public_key.hex()
    out["signature"] = key.sign(manifest_fields(out)).hex()
    return out


def check_signature(manifest: Mapping[str, Any], public_key: bytes | None = None) -> tuple[bool, str]:
    """Is the manifest's signature valid (and by `public_key`, if given)? With no public_key
    an unsigned manifest passes; a signed one must still verify."""
    signer, signature = manifest.get("signer"), manifest.get("signature")
    if signer is None or signature is None:
        return (False, "manifest is not signed") if public_key is not None else (True, "not signed")
    try:
        signer_b, signature_b = bytes.fromhex(signer), bytes.fromhex(signature)
    except (TypeError, ValueError):
        return False, "manifest signer/signature are not hex"
    if public_key is not None and signer_b != public_key:
        return False, f"manifest signed by {signer[:16]}..., not by the expected key {public_key.hex()[:16]}..."
    if not verify(signer_b, manifest_fields(manifest), signature_b):
        return False, "manifest signature does not verify (manifest altered or signed by another key)"
    return True, "signature ok"


def check_manifest(manifest: Any, max_file_size: int = DEFAULT_MAX_FILE_SIZE) -> dict[str, Any]:
    """Validate a manifest (from disk or from a peer) and return it normalized to the known
    fields. Raises ManifestError naming the bad field. Unknown fields are dropped."""

    def bad(field: str, problem: str) -> ManifestError:
        return ManifestError(f"manifest {field}: {problem}" if field else f"manifest: {problem}")

    if not isinstance(manifest, Mapping):
        raise bad("", f"must be an object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise bad("format", f"must be {FORMAT}, got {manifest.get('format')!r}")
    step = manifest.get("step")
    if not is_int(step) or not 0 <= step <= MAX_STEP:
        raise bad("step", f"must be an integer in [0, {MAX_STEP}], got {step!r}")
    created_at = manifest.get("created_at", 0.0)
    if not _is_number(created_at) or not math.isfinite(created_at):
        raise bad("created_at", "must be a finite number")
    model_config = manifest.get("model_config", {})
    if not isinstance(model_config, Mapping):
        raise bad("model_config", "must be an object")
    canonical_json(model_config)  # must be plain JSON
    state_hash = manifest.get("state_hash")
    if state_hash is not None and (not isinstance(state_hash, str) or len(state_hash) > MAX_STATE_HASH_LEN):
        raise bad("state_hash", f"must be a string of at most {MAX_STATE_HASH_LEN} characters or null")
    files = manifest.get("files")
    if not isinstance(files, Mapping) or not files:
        raise bad("files", "must be a non-empty object")
    if len(files) > MAX_FILES:
        raise bad("files", f"at most {MAX_FILES} files, got {len(files)}")
    clean_files = {}
    for name, f in files.items():
        check_file_name(name)
        if not isinstance(f, Mapping):
            raise bad(f"files.{name}", "must be an object with sha256 and size")
        sha, size = f.get("sha256"), f.get("size")
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise bad(f"files.{name}.sha256", "must be 64 lowercase hex digits")
        # 8 bytes is the smallest safetensors file (the header length alone)
        if not is_int(size) or not 8 <= size <= max_file_size:
            raise bad(f"files.{name}.size", f"must be an integer in [8, {max_file_size}], got {size!r}")
        clean_files[name] = {"sha256": sha, "size": size}
    signer, signature = manifest.get("signer"), manifest.get("signature")
    if (signer is None) != (signature is None):
        raise bad("signer", "signer and signature must both be present or both absent")
    if signer is not None:
        if not isinstance(signer, str) or not re.fullmatch(f"[0-9a-f]{{{2 * PUBLIC_KEY_SIZE}}}", signer):
            raise bad("signer", f"must be {2 * PUBLIC_KEY_SIZE} lowercase hex digits")
        if not isinstance(signature, str) or not re.fullmatch(f"[0-9a-f]{{{2 * SIGNATURE_SIZE}}}", signature):
            raise bad("signature", f"must be {2 * SIGNATURE_SIZE} lowercase hex digits")
    verified_by = manifest.get("verified_by")
    if verified_by is not None and not (is_int(verified_by) and 0 <= verified_by <= MAX_VERIFIERS):
        raise bad("verified_by", f"must be an integer in [0, {MAX_VERIFIERS}] or null, got {verified_by!r}")
    return {
        "format": FORMAT,
        "step": step,
        "created_at": float(created_at),
        "model_config": dict(model_config),
        "files": clean_files,
        "state_hash": state_hash,
        "signer": signer,
        "signature": signature,
        **({"verified_by": verified_by} if verified_by is not None else {}),
    }


def check_file_name(name: Any) -> None:
    """A checkpoint file name: `<name>.safetensors` with a plain name (no '/', no '..')."""
    if not isinstance(name, str) or not name.endswith(SUFFIX) or not NAME_RE.match(name[: -len(SUFFIX)]) or ".." in name:
        raise ManifestError(
            f"bad checkpoint file name {name!r}: must be <name>{SUFFIX}, name of letters, digits, '_', '-', '.'"
            " (no '/', no '..', not starting with '.')"
        )


def check_state_name(name: Any) -> None:
    """A state name ("model", "optimizer"): it becomes the file name `<name>.safetensors`."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise ManifestError(f"bad state name {name!r}: letters, digits, '_', '-', '.' only, no '..'")


def make_manifest(
    step: int,
    files: Mapping[str, Mapping[str, Any]],
    model_config: Mapping[str, Any] | None = None,
    state_hash: str | None = None,
    created_at: float = 0.0,
    signing_key: SigningKey | None = None,
) -> dict[str, Any]:
    """A checked manifest for files {name: {sha256, size}}, signed if a key is given."""
    manifest = check_manifest(
        {
            "format": FORMAT,
            "step": step,
            "created_at": created_at,
            "model_config": dict(model_config or {}),
            "files": {name: dict(f) for name, f in files.items()},
            "state_hash": state_hash,
        },
        max_file_size=2**63,
    )
    return sign_manifest(manifest, signing_key) if signing_key is not None else manifest


def manifest_to_json(manifest: Mapping[str, Any]) -> bytes:
    """The manifest as stored in manifest.json (and as sent in a CheckpointOffer): sorted keys,
    so the files are listed in name order."""
    return (json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def parse_manifest(raw: bytes, max_file_size: int = DEFAULT_MAX_FILE_SIZE) -> dict[str, Any]:
    """Bytes of a manifest.json (from disk or a peer) -> checked manifest, or ManifestError."""
    if len(raw) > MAX_MANIFEST_SIZE:
        raise ManifestError(f"manifest: {len(raw)} bytes, more than {MAX_MANIFEST_SIZE}")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"manifest: not JSON: {e}") from None
    return check_manifest(data, max_file_size)


__all__ = [
    "DEFAULT_MAX_FILE_SIZE",
    "DOMAIN",
    "FORMAT",
    "MANIFEST",
    "MAX_FILES",
    "MAX_MANIFEST_SIZE",
    "MAX_STATE_HASH_LEN",
    "MAX_STEP",
    "NAME_RE",
    "STEP_DIR_RE",
    "SUFFIX",
    "ManifestError",
    "canonical_json",
    "check_file_name",
    "check_manifest",
    "check_signature",
    "check_state_name",
    "is_int",
    "make_manifest",
    "manifest_fields",
    "manifest_to_json",
    "parse_manifest",
    "sign_manifest",
    "step_dir_name",
    "step_of_dir_name",
]
