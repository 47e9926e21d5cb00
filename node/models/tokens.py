"""Tokenizers: text (or bytes) to the token ids a model trains on.

    ByteTokenizer   id = byte value, vocabulary 256: what the built-in models read
    HFTokenizer     a model directory's fast tokenizer (tokenizer.json, read by `tokenizers`)
    load_tokenizer  the tokenizer of a model directory (None: bytes), checked against its model

Both give a document's ids with `encode_batch`, with no special tokens added: a corpus joins
documents with `eos_id` (when the tokenizer has one) itself, and long files are encoded in
chunks, where a template's beginning-of-text token would land in the middle of a document.
`fingerprint` names the tokenizer exactly: a corpus fingerprint covers it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .hf import ModelDir


class ByteTokenizer:
    """One token per byte; text is encoded as UTF-8."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None  # bytes have no end-of-text token: documents are simply concatenated
    fingerprint = "bytes"

    def encode_batch(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(d if isinstance(d, (bytes, bytearray)) else d.encode("utf-8"), dtype=np.uint8) for d in docs]

    def encode(self, doc: str | bytes) -> np.ndarray:
        return self.encode_batch([doc])[0]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A fast tokenizer from its tokenizer.json. `eos_id`: the end-of-text token that separates
    documents, from tokenizer_config.json or special_tokens_map.json, else the model config's
    eos_token_id; None where none is named."""

    def __init__(self, path: str | Path, eos_token: str | None = None, eos_id: int | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        raw = self.path.read_bytes()
        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises its own exception type: its message is the one line we have
            raise ValueError(f"{self.path} is not a tokenizer `tokenizers` can read: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.name = f"tokenizer.json of {self.path.parent.name}"
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # ids need not be dense: one more than the largest
        if eos_token is not None and self.tok.token_to_id(eos_token) is not None:
            eos_id = self.tok.token_to_id(eos_token)
        self.eos_id = eos_id if eos_id is not None and 0 <= eos_id < self.vocab_size else None
        self.fingerprint = hashlib.sha256(raw + f"|eos={self.eos_id}".encode()).hexdigest()

    def encode_batch(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, (bytes, bytearray)) else d for d in docs]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, doc: str | bytes) -> np.ndarray:
        return self.encode_batch([doc])[0]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def _eos_token(model_dir: ModelDir) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if name not in model_dir.tokenizer_files:
            continue
        try:
            eos = json.loads((model_dir.path / name).read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, AttributeError, UnicodeDecodeError):
            continue  # not ours to refuse: the token can still come from the model config
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            return eos
    return None


def _config_eos_id(config: dict) -> int | None:
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def load_tokenizer(model_dir: ModelDir | None) -> Tokenizer:
    """The tokenizer for a model: bytes for the built-in models (None) and for a directory without
    tokenizer files, its tokenizer.json otherwise. ModelDirError (one line) when the directory has
    tokenizer files but no tokenizer.json, or when the tokenizer gives ids the model has no
    embedding for."""
    from .hf import ModelDirError

    if model_dir is None:
        return ByteTokenizer()
    vocab = model_dir.vocab_size
    if not model_dir.tokenizer_files:
        tok: Tokenizer = ByteTokenizer()  # no tokenizer: a model trained from scratch may read bytes
    elif "tokenizer.json" not in model_dir.tokenizer_files:
        raise ModelDirError(
            f"{model_dir.path} has tokenizer files ({', '.join(model_dir.tokenizer_files)}) but no tokenizer.json: "
            "save the fast tokenizer with `AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`"
        )
    else:
        try:
            tok = HFTokenizer(model_dir.path / "tokenizer.json", _eos_token(model_dir), _config_eos_id(model_dir.config))
        except ValueError as e:
            raise ModelDirError(str(e)) from None
    if tok.vocab_size > vocab:
        raise ModelDirError(f"the tokenizer of {model_dir.path} gives ids up to {tok.vocab_size - 1}, but the model embeds only {vocab} tokens (config.json vocab_size)")
    return tok
