"""Corpus sources and tokens: JSON lines, parquet and a saved `datasets` set give the same token
ids for the same texts; the split, the cap in tokens, the id dtype, the fingerprint covering the
tokenizer; the built-in corpus is what it was before tokenizers; and each refusal's one line."""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from node.models import data, sources
from node.models.data import Batches, DataError, load_corpus
from node.models.tokens import ByteTokenizer, HFTokenizer

TEXTS = [f"document {i}: " + "héllo wörld, the swarm trains. " * (1 + i % 5) for i in range(80)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, eos_token="<|endoftext|>")


def write_jsonl(path: Path, texts, field="text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def write_parquet(path: Path, texts, field="text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), path, row_group_size=16)
    return path


def write_dataset(path: Path, texts, field="text") -> Path:
    import datasets

    datasets.Dataset.from_dict({field: texts, "id": list(range(len(texts)))}).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    (root / "shards").mkdir()
    write_jsonl(root / "shards" / "a.jsonl", TEXTS[:30])
    write_jsonl(root / "shards" / "b.jsonl", TEXTS[30:])
    return {
        "jsonl": write_jsonl(root / "all.jsonl", TEXTS),
        "parquet": write_parquet(root / "all.parquet", TEXTS),
        "datasets": write_dataset(root / "saved", TEXTS),
        "jsonl shards": root / "shards",
    }


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_every_format_gives_the_same_ids_for_the_same_texts(formats, tokenizer, with_tokenizer):
    tok = tokenizer if with_tokenizer else None
    corpora = {name: load_corpus(path, tok, max_tokens=None) for name, path in formats.items()}
    first = corpora["jsonl"]
    assert first.num_files == len(TEXTS)
    for name, c in corpora.items():
        assert torch.equal(c.train, first.train) and torch.equal(c.val, first.val), name
        assert c.fingerprint == first.fingerprint, name
    # a record's side follows its text: validation holds exactly the texts that hash there
    val_texts = [t for t in TEXTS if data._is_val(t)]
    train_texts = [t for t in TEXTS if not data._is_val(t)]
    assert val_texts and train_texts
    tk = tok or ByteTokenizer()
    eos = [] if tk.eos_id is None else [tk.eos_id]
    expect_val = [i for t in val_texts for i in tk.encode(t).tolist() + eos]
    expect_train = [i for t in train_texts for i in tk.encode(t).tolist() + eos]
    assert first.val.tolist() == expect_val and first.train.tolist() == expect_train


def test_a_text_file_and_a_json_line_of_the_same_text_agree(tmp_path, tokenizer):
    (tmp_path / "one.txt").write_text(TEXTS[3])
    write_jsonl(tmp_path / "one.jsonl", [TEXTS[3]])
    for tok in (None, tokenizer):
        a, b = load_corpus(tmp_path / "one.txt", tok), load_corpus(tmp_path / "one.jsonl", tok)
        assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val) and a.fingerprint == b.fingerprint


def test_ids_dtype_cap_and_fingerprint_follow_the_tokenizer(formats, tokenizer, tmp_path):
    by_bytes = load_corpus(formats["jsonl"])
    by_bpe = load_corpus(formats["jsonl"], tokenizer)
    assert by_bytes.train.dtype == torch.uint8 and by_bytes.tokenizer == "bytes" and by_bytes.vocab_size == 256
    assert by_bpe.train.dtype == torch.int16 and by_bpe.vocab_size == tokenizer.vocab_size
    assert by_bpe.train.numel() < by_bytes.train.numel()  # BPE merges bytes
    assert by_bpe.fingerprint != by_bytes.fingerprint and by_bpe.tokenizer == tokenizer.fingerprint
    capped = load_corpus(formats["jsonl"], tokenizer, max_tokens=100)
    assert capped.train.numel() + capped.val.numel() == 100
    # the same ids through another tokenizer file (no eos named) are another corpus
    other = HFTokenizer(tokenizer.path)
    assert load_corpus(formats["jsonl"], other).fingerprint != by_bpe.fingerprint
    old_name = load_corpus(formats["jsonl"], max_bytes=100)  # the cap's name from before tokenizers
    assert old_name.train.numel() + old_name.val.numel() == 100
    b = Batches(by_bpe.train, 0, 2, batch_size=3, context=8, seed=0)
    x, y = b.next()
    assert x.dtype == y.dtype == torch.int64 and int(x.max()) < tokenizer.vocab_size
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_builtin_corpus_is_what_it_was_before_tokenizers():
    """The former loader, written out: files in sorted relative-path order, cut at the cap, split
    by path, fingerprint sha256(len(train), train, val). Replicas of older nodes compare it."""
    cap = 1 << 20
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, total = bytearray(), bytearray(), 0
    for p in sorted(data._stdlib_files(root), key=lambda p: p.relative_to(root).as_posix()):
        if total >= cap:
            break
        body = p.read_bytes()[: cap - total]
        total += len(body)
        (val if data._is_val(p.relative_to(root).as_posix()) else train).extend(body)
    fp = hashlib.sha256(len(train).to_bytes(8, "big"))
    fp.update(train)
    fp.update(val)
    c = data._builtin.__wrapped__(cap)
    assert c.fingerprint == fp.hexdigest() and c.train.dtype == torch.uint8
    assert bytes(c.train.numpy()) == bytes(train) and bytes(c.val.numpy()) == bytes(val)


def test_files_are_read_in_blocks_on_line_and_character_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BLOCK", 5)
    body = ("héllo wörld\n" * 3 + "ünïcödé " * 9 + "\n€\n").encode()
    (tmp_path / "f.txt").write_bytes(body)
    pieces = list(sources._blocks(tmp_path / "f.txt"))
    assert len(pieces) > 3 and b"".join(pieces) == body
    for piece in pieces:
        piece.decode("utf-8")  # never a character cut in two


def test_record_refusals_name_the_file_and_line(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"body": "no text here"}\n')
    with pytest.raises(DataError) as e:
        load_corpus(bad)
    assert str(e.value) == f"{bad}:3: no field 'text' (this record has: body)"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not JSON"):
        load_corpus(bad)
    bad.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'text' is not a string \(got int\)"):
        load_corpus(bad)
    bad.write_text('["text"]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: a JSON line must be an object"):
        load_corpus(bad)
    with pytest.raises(DataError, match=r"all.parquet: no column 'body' \(columns: text, id\)"):
        load_corpus(write_parquet(tmp_path / "all.parquet", TEXTS[:3]), text_field="body")
    with pytest.raises(DataError, match=r"saved: no column 'body' \(columns: text, id\)"):
        load_corpus(write_dataset(tmp_path / "saved", TEXTS[:3]), text_field="body")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no data in .*empty.jsonl: the file"):
        load_corpus(tmp_path / "empty.jsonl", tokenizer)


def test_the_built_in_corpus_is_tokenized_by_a_models_tokenizer(tokenizer):
    as_bytes = load_corpus(None, max_tokens=20_000)
    tokenized = load_corpus(None, tokenizer, max_tokens=20_000)
    assert tokenized.source == "stdlib" and tokenized.vocab_size == tokenizer.vocab_size
    assert int(tokenized.train.max()) < tokenizer.vocab_size and tokenized.fingerprint != as_bytes.fingerprint
    # the same text: the first document's first characters, tokenized, start the tokenized corpus
    want = tokenizer.encode(bytes(as_bytes.train[:300].tolist()).decode("utf-8"))[:-2].tolist()  # (the last tokens may merge on)
    assert len(want) > 20 and tokenized.train[: len(want)].tolist() == want


def test_a_dataset_dict_trains_on_its_train_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:10]}), "test": datasets.Dataset.from_dict({"text": ["x" * 50]})}).save_to_disk(str(tmp_path / "dd"))
    write_jsonl(tmp_path / "train.jsonl", TEXTS[:10])
    assert load_corpus(tmp_path / "dd").fingerprint == load_corpus(tmp_path / "train.jsonl").fingerprint
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["x" * 50]})}).save_to_disk(str(tmp_path / "nodd"))
    with pytest.raises(DataError, match="has no 'train' split \\(splits: test\\)"):
        load_corpus(tmp_path / "nodd")


def test_missing_data_packages_name_the_extra(tmp_path, monkeypatch):
    saved = write_dataset(tmp_path / "saved", TEXTS[:3])
    table = write_parquet(tmp_path / "t.parquet", TEXTS[:3])
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs the datasets package: pip install 'swarmtrain\[data\]'"):
        load_corpus(saved)
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'swarmtrain\[data\]'"):
        load_corpus(table)
