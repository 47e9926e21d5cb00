"""Training data: a tokenized corpus, sharded random windows, and a fixed validation loss.

    load_corpus(path, tokenizer)  the built-in corpus (None) or your data, as token ids ->
                                  Corpus(train, val, fingerprint, ...)
    shard_of                      the data shard a peer id trains on by default
    Batches                       random (x, y) windows from one replica's shard of the train ids, seeded
    evaluate                      mean loss over a fixed set of validation windows (the same every call)
    EVAL_SEED                     the seed of the windows a replica reports its validation loss on

Built-in corpus: the Python standard library's own *.py sources (no download), without
site-packages, test directories and the build-specific `_sysconfigdata*` / `config-*` files,
in sorted relative-path order, capped at `max_tokens`. It depends on the Python version that
runs the node: replicas compare `Corpus.fingerprint` to know they train on the same tokens.

`--data PATH`: text files, a directory of them, JSON lines, parquet or a saved `datasets` data set
(sources.py reads each). A fixed suffix list rather than "whatever decodes as UTF-8" so that a
directory with a .git folder or binaries in it gives a predictable corpus.

Tokens: bytes by default (tokens.py ByteTokenizer, kept as uint8: the built-in corpus and its
fingerprint are what they were before tokenizers), or a model's tokenizer, whose ids are kept in
the narrowest integer type that holds its vocabulary. Documents are joined by the tokenizer's
end-of-text id where it has one. The cap counts tokens, and reading stops at it.

Split: a file is validation when sha256(relative path) mod 20 == 0, a record (a JSON line, a row)
when sha256(its text) mod 20 == 0, so a document's side never depends on the cap or on which
other documents exist. When that leaves one side empty (one file, or a handful), the last 1/20 of
the tokens becomes validation instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .sources import TEXT_SUFFIXES, DataError, Doc, documents, file_docs  # noqa: F401 (TEXT_SUFFIXES, DataError: this module's names before sources.py)
from .tokens import ByteTokenizer, Tokenizer

DEFAULT_MAX_TOKENS = 8 * 1024 * 1024  # cap on a corpus (train + val), in tokens (bytes for the byte tokenizer)
DEFAULT_MAX_BYTES = DEFAULT_MAX_TOKENS  # its name from before tokenizers
VAL_MODULUS = 20  # one document in VAL_MODULUS goes to validation
# The validation windows every replica reports its loss on (node/roles/replica.py), and that
# `swarmtrain-model eval` uses, so an exported model's loss compares with the swarm's.
EVAL_SEED = 1234
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_TOKEN_DTYPES = ((256, np.uint8), (1 << 15, np.int16), (1 << 31, np.int32))  # (vocabulary up to, dtype)
_ID_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class Corpus:
    """Token streams for training and validation. The tensors may be shared (the built-in corpus is
    cached in-process): treat them as read-only."""

    train: torch.Tensor  # token ids (uint8 for bytes), documents concatenated in order
    val: torch.Tensor  # token ids of the validation documents
    fingerprint: str  # sha256 hex over (tokenizer, len(train), train, val): equal iff same tokens and split
    source: str  # where it came from, for logs: "stdlib" or the path given
    num_files: int  # documents read (files, or records of a data set), after the cap
    tokenizer: str = "bytes"  # the tokenizer's fingerprint ("bytes" for the byte tokenizer)
    vocab_size: int = 256  # one more than the largest id the tokenizer gives


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


def _token_dtype(vocab_size: int):
    return next(dtype for limit, dtype in _TOKEN_DTYPES if vocab_size <= limit)


def _read(docs: Iterable[Doc], tokenizer: Tokenizer, cap: int | None) -> tuple[list[np.ndarray], list[np.ndarray], int, int]:
    """(train parts, val parts, tokens, documents read): documents tokenized in order until the cap,
    the one that crosses it cut there."""
    sides: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    total = used = 0
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id])
    for doc in docs:
        if cap is not None and total >= cap:
            break
        side, used, start = sides[_is_val(doc.key)], used + 1, total
        for piece in doc.pieces:
            ids = tokenizer.encode(piece)
            if cap is not None:
                ids = ids[: cap - total]
            side.append(ids)
            total += len(ids)
            if cap is not None and total >= cap:
                break
        if eos is not None and total > start and (cap is None or total < cap):
            side.append(eos)  # the end of a document: the model learns where texts stop
            total += 1
    return sides[0], sides[1], total, used


def _build(docs: Iterable[Doc], tokenizer: Tokenizer, cap: int | None, source: str) -> Corpus:
    train_parts, val_parts, total, used = _read(docs, tokenizer, cap)
    if total == 0:
        raise DataError(f"no data in {source}: the file(s) or records are empty")
    dtype = _token_dtype(tokenizer.vocab_size)
    train, val = (np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype) for parts in (train_parts, val_parts))
    if not train.size or not val.size:  # too few documents for a per-document split: hold out the tail instead
        stream = np.concatenate([train, val])
        cut = len(stream) - max(1, len(stream) // VAL_MODULUS)
        train, val = stream[:cut], stream[cut:]
    fp = hashlib.sha256()
    if not isinstance(tokenizer, ByteTokenizer):  # bytes keep the fingerprint they had before tokenizers
        fp.update(f"tokenizer {tokenizer.fingerprint} {np.dtype(dtype).name}\n".encode())
    fp.update(len(train).to_bytes(8, "big"))
    fp.update(train.tobytes())
    fp.update(val.tobytes())
    return Corpus(torch.from_numpy(train), torch.from_numpy(val), fp.hexdigest(), source, used, tokenizer.fingerprint, tokenizer.vocab_size)


@functools.lru_cache(maxsize=4)
def _builtin(max_tokens: int | None) -> Corpus:
    return _stdlib(ByteTokenizer(), max_tokens)


def _stdlib(tokenizer: Tokenizer, max_tokens: int | None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    if not files:
        raise DataError(f"no Python sources found in the standard library at {root}")
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return _build(file_docs(files, root), tokenizer, max_tokens, "stdlib")


def load_corpus(
    path: str | Path | None = None,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    *,
    max_bytes: int | None = None,
) -> Corpus:
    """The built-in corpus (path=None; as bytes, cached) or the data at `path`, tokenized by
    `tokenizer` (None: bytes). `text_field`: the field of a JSON line or the column of a table
    that holds the text. `max_tokens` caps the tokens read (None: no cap); `max_bytes` is its
    name from before tokenizers and wins when given."""
    cap = max_bytes if max_bytes is not None else max_tokens
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 2):
        raise DataError(f"max_tokens (max_bytes) must be an int ≥ 2 or None, got {cap!r}")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if path is None:
        return _builtin(cap) if isinstance(tokenizer, ByteTokenizer) else _stdlib(tokenizer, cap)
    p = Path(path)
    return _build(documents(p, text_field), tokenizer, cap, str(p))


def _check_window(n: int, context: int, what: str) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise DataError(f"context must be a positive int, got {context!r}")
    if n < context + 1:
        raise DataError(f"{what} has {n} tokens, fewer than one window of context+1 = {context + 1}")


def _windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are tokens [s, s+context), targets the same shifted by one: predict the next token."""
    w = data[starts.unsqueeze(1) + torch.arange(context + 1)].long()
    return w[:, :-1], w[:, 1:]


def shard_of(peer_id: str, num_shards: int) -> int:
    """The data shard a node trains on when it is not told one: the same for a peer id everywhere."""
    return zlib.crc32(peer_id.encode()) % num_shards


class Batches:
    """Random windows from one contiguous shard of `data`, deterministic given the seed.

    Shard i of k is tokens [i·n//k, (i+1)·n//k): shards are disjoint and every window lies wholly
    inside its shard, so replicas never train on the same tokens.
    """

    def __init__(self, data: torch.Tensor, shard_index: int, num_shards: int, batch_size: int, context: int, seed: int):
        if data.dtype not in _ID_DTYPES or data.dim() != 1:
            raise DataError(f"data must be a 1-D tensor of token ids (uint8, int16, int32 or int64), got {data.dtype} of shape {tuple(data.shape)}")
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
        last_start = self.hi - self.context - 1  # inclusive: the window's last token is hi - 1
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
