"""Training data: a byte-level corpus, sharded random windows, and a fixed validation loss.

    load_corpus(path)  the built-in corpus (None) or your text files -> Corpus(train, val, fingerprint)
    shard_of           the data shard a peer id trains on by default
    Batches            random (x, y) windows from one replica's shard of the train bytes, seeded
    evaluate           mean loss over a fixed set of validation windows (the same every call)
    EVAL_SEED          the seed of the windows a replica reports its validation loss on

Built-in corpus: the Python standard library's own *.py sources (no download), without
site-packages, test directories and the build-specific `_sysconfigdata*` / `config-*` files,
in sorted relative-path order, capped at `max_bytes`. It depends on the Python version that
runs the node: replicas compare `Corpus.fingerprint` to know they train on the same bytes.

`--data PATH`: one file (any bytes), or a directory searched recursively for files ending in
TEXT_SUFFIXES (hidden files and directories skipped). A fixed suffix list rather than "whatever
decodes as UTF-8" so that a directory with a .git folder or binaries in it gives a predictable
corpus.

Split: a file is validation when sha256(relative path) mod 20 == 0, so a file's side never
depends on the cap or on which other files exist. When that leaves one side empty (one file, or
a handful), the last 1/20 of the bytes becomes validation instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # cap on the built-in corpus (train + val), in bytes
VAL_MODULUS = 20  # one file in VAL_MODULUS goes to validation
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
# The validation windows every replica reports its loss on (node/roles/replica.py), and that
# `swarmtrain-model eval` uses, so an exported model's loss compares with the swarm's.
EVAL_SEED = 1234
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ValueError):
    """The data the user pointed at cannot be used (missing, empty, too short)."""


@dataclass(frozen=True)
class Corpus:
    """Byte streams for training and validation. The tensors may be shared (the built-in corpus is
    cached in-process): treat them as read-only."""

    train: torch.Tensor  # uint8, the training bytes, files concatenated in order
    val: torch.Tensor  # uint8, the validation bytes
    fingerprint: str  # sha256 hex over (len(train), train, val): equal iff same data and split
    source: str  # where it came from, for logs: "stdlib" or the path given
    num_files: int  # files read (after the cap)


def _is_val(rel: str) -> bool:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8", "surrogateescape")).digest()[:8], "big") % VAL_MODULUS == 0


def _stdlib_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune in place so os.walk never descends into site-packages (most of the files there)
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        # _sysconfigdata* is generated per build: it would differ between otherwise equal machines
        out += [Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return out


def _text_files(root: Path) -> list[Path]:
    return [
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]


def _build(root: Path, files: list[Path], max_bytes: int | None, source: str) -> Corpus:
    files = sorted(files, key=lambda p: p.relative_to(root).as_posix())
    train, val, total, used = bytearray(), bytearray(), 0, 0
    for p in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = p.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]  # the file that crosses the cap is cut at it
        total, used = total + len(data), used + 1
        rel = p.relative_to(root).as_posix() if p != root else p.name
        (val if _is_val(rel) else train).extend(data)
    if total == 0:
        raise DataError(f"no data in {source}: the file(s) are empty")
    if not train or not val:  # too few files for a per-file split: hold out the tail instead
        stream = train + val
        cut = len(stream) - max(1, len(stream) // VAL_MODULUS)
        train, val = stream[:cut], stream[cut:]
    fp = hashlib.sha256(len(train).to_bytes(8, "big"))
    fp.update(train)
    fp.update(val)
    return Corpus(_as_tensor(train), _as_tensor(val), fp.hexdigest(), source, used)


def _as_tensor(b: bytearray) -> torch.Tensor:
    # frombuffer shares memory with (and keeps alive) the bytearray: no second copy of the corpus
    return torch.frombuffer(b, dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def _builtin(max_bytes: int | None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    if not files:
        raise DataError(f"no Python sources found in the standard library at {root}")
    return _build(root, files, max_bytes, "stdlib")


def load_corpus(path: str | Path | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> Corpus:
    """The built-in corpus (path=None, cached) or the text at `path` (a file or a directory).
    `max_bytes` caps the bytes read (None: no cap)."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2):
        raise DataError(f"max_bytes must be an int ≥ 2 or None, got {max_bytes!r}")
    if path is None:
        return _builtin(max_bytes)
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path does not exist: {p}")
    if p.is_file():
        return _build(p, [p], max_bytes, str(p))
    if not p.is_dir():
        raise DataError(f"data path is neither a file nor a directory: {p}")
    files = _text_files(p)
    if not files:
        raise DataError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {p}")
    return _build(p, files, max_bytes, str(p))


def _check_window(n: int, context: int, what: str) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise DataError(f"context must be a positive int, got {context!r}")
    if n < context + 1:
        raise DataError(f"{what} has {n} bytes, fewer than one window of context+1 = {context + 1}")


def _windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are bytes [s, s+context), targets the same shifted by one: predict the next byte."""
    w = data[starts.unsqueeze(1) + torch.arange(context + 1)].long()
    return w[:, :-1], w[:, 1:]


def shard_of(peer_id: str, num_shards: int) -> int:
    """The data shard a node trains on when it is not told one: the same for a peer id everywhere."""
    return zlib.crc32(peer_id.encode()) % num_shards


class Batches:
    """Random windows from one contiguous shard of `data`, deterministic given the seed.

    Shard i of k is bytes [i·n//k, (i+1)·n//k): shards are disjoint and every window lies wholly
    inside its shard, so replicas never train on the same bytes.
    """

    def __init__(self, data: torch.Tensor, shard_index: int, num_shards: int, batch_size: int, context: int, seed: int):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise DataError(f"data must be a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise DataError(f"num_shards must be a positive int, got {num_shards!r}")
        if isinstance(shard_index, bool) or not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
            raise DataError(f"shard_index must be an int in [0, {num_shards}), got {shard_index!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be a positive int, got {batch_size!r}")
        n = data.numel()
        self.lo, self.hi = shard_index * n // num_shards, (shard_index + 1) * n // num_shards
        _check_window(self.hi - self.lo, context, f"shard {shard_index} of {num_shards}")
        self.data, self.batch_size, self.context = data, batch_size, context
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 of shape (batch_size, context)."""
        last_start = self.hi - self.context - 1  # inclusive: the window's last byte is hi - 1
        starts = torch.randint(self.lo, last_start + 1, (self.batch_size,), generator=self.gen)
        return _windows(self.data, starts, self.context)


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, batch_size: int, context: int, num_batches: int, seed: int = 0) -> float:
    """Mean loss of `model` over num_batches·batch_size validation windows drawn from `seed`:
    the same windows on every call, so values are comparable across steps and replicas."""
    _check_window(val.numel(), context, "validation data")
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise DataError(f"num_batches must be a positive int, got {num_batches!r}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, val.numel() - context, (num_batches, batch_size), generator=gen)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for row in starts:
            x, y = _windows(val, row, context)
            _, loss = model(x.to(device), y.to(device))
            total += loss.item()
    finally:
        model.train(was_training)
    return total / num_batches
