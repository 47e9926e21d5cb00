"""A model's travelling files: the config and tokenizer files of a Hugging Face model directory,
kept by the coordinator under their pin and fetched by every node from it.

The run's settings name the model by its pin, `hf:<sha256 of the index>`: the index lists each
file with its size and sha256, so a node checks the index against the pin and every file
against the index, and no file can change under a running swarm (the owner's directory may
move or change afterwards). Weights never travel this way: they are state, and come from peers
or checkpoints.

    <root>/<pin hex>/
        index.json       {"files": {name: {"size": n, "sha256": hex}}}, canonical JSON
        config.json      ... and the tokenizer files the model directory had
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protocol import RemoteProtocolError

from ..models.hf import TOKENIZER_FILES
from ..osutil import fsync_path, remove_tree, sha256_file
from ..runconfig import HF_PIN
from .checkpoint_client import receive_file
from .checkpoint_dir import make_tmp_dir, read_range, remove_stale_temp_dirs

# what travels: the config and the tokenizer's files
TRAVELLING = ("config.json", "generation_config.json", *TOKENIZER_FILES)
INDEX = "index.json"
PREFIX = "model/"  # StateRequest names: model/<pin hex>/<file>
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_INDEX_BYTES = 64 << 10
MAX_FILE_BYTES = 256 << 20  # a tokenizer.json of a large vocabulary is tens of MB
FETCH_TIMEOUT_S = 120.0
CHUNK_TIMEOUT_S = 30.0


class ModelFilesError(ValueError):
    """The model files are missing, malformed or do not match their pin."""


def index_bytes(files: Mapping[str, Mapping[str, Any]]) -> bytes:
    return json.dumps({"files": {n: {"sha256": m["sha256"], "size": m["size"]} for n, m in files.items()}}, sort_keys=True, separators=(",", ":")).encode()


def pin_hex(pin: str) -> str:
    if HF_PIN.fullmatch(pin) is None:
        raise ModelFilesError(f"{pin!r} is not a model pin (hf:<64 hex digits>)")
    return pin[len("hf:") :]


def parse_index(data: bytes) -> dict[str, dict[str, Any]]:
    """The files an index lists; ModelFilesError when it is not one."""
    try:
        files = json.loads(data)["files"]
    except (ValueError, KeyError, TypeError):
        raise ModelFilesError("the model's index is not JSON with a 'files' object") from None
    if not isinstance(files, dict) or "config.json" not in files:
        raise ModelFilesError("the model's index lists no config.json")
    for name, meta in files.items():
        if name not in TRAVELLING:
            raise ModelFilesError(f"the model's index lists {name!r}, not a config or tokenizer file")
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int) and 0 <= meta["size"] <= MAX_FILE_BYTES
                and isinstance(meta.get("sha256"), str) and SHA256_HEX.fullmatch(meta["sha256"])):  # fmt: skip
            raise ModelFilesError(f"the model's index has a bad entry for {name!r}")
    return files


def pack_model_files(src: str | os.PathLike, root: str | os.PathLike) -> str:
    """Copy the travelling files of model directory `src` under `root`; their pin. Packing the
    same files again changes nothing."""
    src, root = Path(src), Path(root)
    present = [n for n in TRAVELLING if (src / n).is_file()]
    if "config.json" not in present:
        raise ModelFilesError(f"{src} has no config.json")
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(root)
    tmp = make_tmp_dir(root, "model")
    try:
        files = {}
        for name in present:
            shutil.copyfile(src / name, tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        index = index_bytes(files)
        (tmp / INDEX).write_bytes(index)
        pin = hashlib.sha256(index).hexdigest()
        final = root / pin
        if final.exists():
            return f"hf:{pin}"
        os.replace(tmp, final)
        fsync_path(root)
        return f"hf:{pin}"
    finally:
        if tmp.exists():
            remove_tree(tmp)


class ModelFilesSource:
    """The packed models under `root`, for the checkpoint server: `files(pin hex)` and
    `read_chunk` (the CheckpointSource methods the server streams with)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def files(self, pin: str) -> dict[str, tuple[int, str]]:
        if not SHA256_HEX.fullmatch(pin):
            raise KeyError(pin)
        index = (self.root / pin / INDEX).read_bytes()
        out = {n: (m["size"], m["sha256"]) for n, m in parse_index(index).items()}
        return {**out, INDEX: (len(index), pin)}

    def read_chunk(self, pin: str, name: str, offset: int, length: int) -> bytes:
        if name not in self.files(pin):  # only what the index names: no path tricks
            raise KeyError(name)
        return read_range(self.root / pin / name, offset, length)


def local_model_dir(root: str | os.PathLike, pin: str) -> Path | None:
    """The directory of `pin` under `root` when it is complete (fetched or packed before)."""
    d = Path(root) / pin_hex(pin)
    try:
        files = parse_index((d / INDEX).read_bytes())
    except (OSError, ModelFilesError):
        return None
    return d if all((d / n).is_file() and (d / n).stat().st_size == m["size"] for n, m in files.items()) else None


async def fetch_model_files(transport, peer_id: str, pin: str, root: str | os.PathLike, timeout_s: float = FETCH_TIMEOUT_S) -> Path:
    """The model directory of `pin` under `root`, fetched from `peer_id` unless already there.
    Every file is checked against the index and the index against the pin; on any problem
    nothing is left behind (a RemoteProtocolError names the file, or the transport's errors)."""
    want = pin_hex(pin)
    root = Path(root)
    have = await asyncio.to_thread(local_model_dir, root, pin)
    if have is not None:
        return have
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(remove_stale_temp_dirs, root)
    tmp = await asyncio.to_thread(make_tmp_dir, root, "model")
    try:
        async with asyncio.timeout(timeout_s):
            index = await _receive(transport, peer_id, want, INDEX, None, want, tmp)
            try:
                files = parse_index(index)
            except ModelFilesError as e:
                raise RemoteProtocolError(f"{peer_id[-8:]} sent a bad model index: {e}", INDEX) from None
            for name, meta in sorted(files.items()):
                await _receive(transport, peer_id, want, name, meta["size"], meta["sha256"], tmp)
        final = root / want
        if not final.exists():
            await asyncio.to_thread(os.replace, tmp, final)
            await asyncio.to_thread(fsync_path, root)
        return final
    finally:
        if tmp.exists():
            await asyncio.to_thread(remove_tree, tmp)


async def _receive(transport, peer_id: str, pin: str, name: str, size: int | None, sha: str, tmp: Path) -> bytes:
    """One file of the model, checked as it arrives as a checkpoint's files are; its bytes (these
    files are small). The index's size is not known before: it is bounded instead."""
    data = bytearray()
    await receive_file(transport, peer_id, f"{PREFIX}{pin}/{name}", name, size, sha, data.extend, CHUNK_TIMEOUT_S, FETCH_TIMEOUT_S, max_size=MAX_INDEX_BYTES)
    await asyncio.to_thread((tmp / name).write_bytes, bytes(data))
    return bytes(data)
