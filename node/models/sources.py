"""Where a corpus's documents come from: files and data sets read as a stream of `Doc`s.

    documents(path, text_field)  the documents at `path`, in a fixed order, with the key that
                                 decides their side of the train/validation split

Formats, by what `path` is:
    a file ending in .jsonl      one document per line: the string in the object's `text_field`
    a file ending in .parquet    one document per row of column `text_field` (needs pyarrow)
    any other file               one document: its bytes
    a saved `datasets` data set  one document per row of column `text_field` (the "train" split
                                 of a DatasetDict; needs the datasets package)
    a directory                  its files ending in TEXT_SUFFIXES, .jsonl or .parquet, searched
                                 recursively (hidden ones skipped), in sorted relative-path order

A whole file splits by its relative path (its side never depends on which other files exist); a
record by its text, so the same texts split the same way in every format and a text repeated in
a data set never lands on both sides. Files are read in blocks that end at a line end where one is
near, so memory stays bounded and a tokenizer never sees a line cut in two.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
RECORD_SUFFIXES = (".jsonl", ".parquet")
DATA_EXTRA = "pip install 'swarmtrain[data]'"  # the extra that brings datasets and pyarrow
BLOCK = 1 << 20  # bytes of a file read at a time
ROWS = 1024  # rows of a parquet file or data set read at a time


class DataError(ValueError):
    """The data the user pointed at cannot be used (missing, empty, too short, malformed)."""


@dataclass(frozen=True)
class Doc:
    """One document: `key` decides its side of the split, `pieces` are its text in order."""

    key: str
    pieces: Iterator[bytes | str]


def documents(path: Path, text_field: str = "text") -> Iterator[Doc]:
    """The documents at `path` (see the module's docstring); DataError when it holds none we read."""
    if not path.exists():
        raise DataError(f"data path does not exist: {path}")
    if path.is_file():
        return _file_docs(path, path.name, text_field)
    if not path.is_dir():
        raise DataError(f"data path is neither a file nor a directory: {path}")
    if (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()):
        return _dataset_docs(path, text_field)
    files = _data_files(path)
    if not files:
        raise DataError(f"no text files ({', '.join(TEXT_SUFFIXES + RECORD_SUFFIXES)}) under {path}")
    return (doc for p in files for doc in _file_docs(p, p.relative_to(path).as_posix(), text_field))


def _data_files(root: Path) -> list[Path]:
    return sorted(
        (
            p
            for p in root.rglob("*")
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES + RECORD_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def file_docs(paths: list[Path], root: Path) -> Iterator[Doc]:
    """Whole files as documents, keyed by their path relative to `root` (the built-in corpus)."""
    for p in paths:
        yield Doc(p.relative_to(root).as_posix(), _blocks(p))


def _file_docs(path: Path, rel: str, text_field: str) -> Iterator[Doc]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_docs(path, text_field)
    if suffix == ".parquet":
        return _parquet_docs(path, text_field)
    return iter([Doc(rel, _blocks(path))])


def _utf8_cut(block: bytes) -> int:
    """Where `block` ends on a whole UTF-8 character: a sequence cut at its end waits for the next block."""
    j = len(block) - 1
    while j >= max(0, len(block) - 4) and block[j] & 0xC0 == 0x80:
        j -= 1
    if j < 0 or block[j] < 0xC0:
        return len(block)
    need = 2 if block[j] < 0xE0 else 3 if block[j] < 0xF0 else 4
    return j if j + need > len(block) else len(block)


def _blocks(path: Path) -> Iterator[bytes]:
    """A file's bytes in blocks that end at a line end (or, in a long line, on a character)."""
    with open(path, "rb") as f:
        carry = b""
        while block := f.read(BLOCK):
            block = carry + block + f.readline(BLOCK)
            cut = len(block) if block.endswith(b"\n") else _utf8_cut(block)
            carry = block[cut:]
            if cut:
                yield block[:cut]
        if carry:
            yield carry


def _record(value: Any, where: str, text_field: str) -> Doc:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is not a string (got {type(value).__name__})")
    return Doc(value, iter([value]))


def _jsonl_docs(path: Path, text_field: str) -> Iterator[Doc]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: a JSON line must be an object with a {text_field!r} field, got {type(obj).__name__}")
            if text_field not in obj:
                raise DataError(f"{path}:{lineno}: no field {text_field!r} (this record has: {', '.join(map(str, obj)) or 'nothing'})")
            yield _record(obj[text_field], f"{path}:{lineno}", text_field)


def _parquet_docs(path: Path, text_field: str) -> Iterator[Doc]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: {DATA_EXTRA}") from None
    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path} is not a parquet file pyarrow can read: {e}") from None
    names = f.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)})")
    row = 0
    for batch in f.iter_batches(batch_size=ROWS, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield _record(value, f"{path}: row {row}", text_field)
            row += 1


def _dataset_docs(path: Path, text_field: str) -> Iterator[Doc]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading the saved data set at {path} needs the datasets package: {DATA_EXTRA}") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: datasets cannot load it: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: the data set has no 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(ds.column_names)})")
    ds = ds.select_columns([text_field])
    row = 0
    for batch in ds.iter(batch_size=ROWS):
        for value in batch[text_field]:
            yield _record(value, f"{path}: row {row}", text_field)
            row += 1
