"""Corpus loading and splitting, sharded batches, evaluation, and the errors on bad data."""

import pytest
import torch

from node.models import data
from node.models.data import Batches, DataError, evaluate, load_corpus
from node.models.gpt import PRESETS, init_model


def _write_files(root, n, size=50):
    """n files whose contents are unique and findable: 'file 007|' repeated."""
    contents = {}
    for i in range(n):
        rel = f"sub{i % 3}/f{i:03d}.txt"
        body = (f"file {i:03d}|" * size).encode()[:size]
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
        contents[rel] = body
    return contents


def test_builtin_corpus_is_deterministic():
    # bypass the in-process cache: two real reads must give the same bytes
    a = data._builtin.__wrapped__(1 << 20)
    b = data._builtin.__wrapped__(1 << 20)
    assert a is not b and a.fingerprint == b.fingerprint
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.numel() + a.val.numel() == 1 << 20


def test_builtin_corpus_is_cached_and_sane():
    c = load_corpus()
    assert load_corpus() is c
    assert c.train.dtype == c.val.dtype == torch.uint8
    assert c.train.numel() + c.val.numel() == data.DEFAULT_MAX_BYTES
    assert 0.01 < c.val.numel() / c.train.numel() < 0.15
    assert c.source == "stdlib" and c.num_files > 100
    assert b"def " in bytes(c.train[:100_000].numpy())


def test_split_is_by_file_and_disjoint(tmp_path):
    contents = _write_files(tmp_path, 60)
    c = load_corpus(tmp_path, max_bytes=None)
    train, val = bytes(c.train.numpy()), bytes(c.val.numpy())
    val_files = [rel for rel in contents if data._is_val(rel)]
    assert val_files, "with 60 files some must hash to validation"
    for rel, body in contents.items():
        assert (body in val) == (rel in val_files)
        assert (body in train) == (rel not in val_files)  # no validation file in train
    assert len(train) + len(val) == sum(map(len, contents.values()))


def test_split_does_not_depend_on_the_cap(tmp_path):
    contents = _write_files(tmp_path, 60)
    capped = load_corpus(tmp_path, max_bytes=1000)  # 20 whole files of 50 bytes
    assert capped.train.numel() + capped.val.numel() == 1000
    train, val = bytes(capped.train.numpy()), bytes(capped.val.numpy())
    for rel in sorted(contents)[:20]:
        assert contents[rel] in (val if data._is_val(rel) else train)


def test_single_file_holds_out_its_tail(tmp_path):
    f = tmp_path / "book.txt"
    f.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(f)
    assert c.val.numel() == 10240 // 20 and c.train.numel() == 10240 - 512
    assert bytes(c.train.numpy()) + bytes(c.val.numpy()) == f.read_bytes()
    assert c.fingerprint == load_corpus(str(f)).fingerprint


def test_directory_skips_hidden_and_unknown_suffixes(tmp_path):
    (tmp_path / "a.md").write_bytes(b"markdown " * 20)
    (tmp_path / "blob.bin").write_bytes(b"\x00binary" * 20)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "notes.txt").write_bytes(b"hidden " * 20)
    c = load_corpus(tmp_path)
    everything = bytes(c.train.numpy()) + bytes(c.val.numpy())
    assert everything == b"markdown " * 20 and c.num_files == 1


def test_fingerprint_sees_content_changes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world " * 10)
    before = load_corpus(f).fingerprint
    f.write_bytes(b"hello World " * 10)
    assert load_corpus(f).fingerprint != before


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    with pytest.raises(DataError, match="no text files"):
        load_corpus(tmp_path)  # empty directory
    (tmp_path / "x.bin").write_bytes(b"123")
    with pytest.raises(DataError, match="no text files"):
        load_corpus(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_corpus(tmp_path)
    with pytest.raises(DataError, match="max_bytes"):
        load_corpus(None, max_bytes=0)


def test_shards_are_disjoint_and_windows_stay_inside():
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 256, (6000,), dtype=torch.uint8, generator=gen)
    raw, context = bytes(stream.numpy()), 16  # random bytes: every 17-byte window is unique
    seen = []
    for shard in range(3):
        b = Batches(stream, shard, 3, batch_size=8, context=context, seed=shard)
        assert (b.lo, b.hi) == (shard * 2000, (shard + 1) * 2000)
        starts = set()
        for _ in range(20):
            x, y = b.next()
            assert x.shape == y.shape == (8, context) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
            for row_x, row_y in zip(x, y):
                window = bytes(row_x.to(torch.uint8).numpy()) + bytes([int(row_y[-1])])
                start = raw.find(window)
                assert b.lo <= start and start + context + 1 <= b.hi
                starts.add(start)
        seen.append(starts)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])


def test_batches_are_deterministic_per_seed():
    c = load_corpus()

    def draws(seed):
        b = Batches(c.train, 1, 4, batch_size=4, context=32, seed=seed)
        return [b.next()[0] for _ in range(3)]

    a, b, other = draws(5), draws(5), draws(6)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], other[0])


@pytest.mark.parametrize(
    "args,match",
    [
        ((2, 2, 4, 8), "shard_index must be an int in"),
        ((0, 0, 4, 8), "num_shards must be a positive int"),
        ((0, 1, 0, 8), "batch_size must be a positive int"),
        ((0, 1, 4, 0), "context must be a positive int"),
        ((0, 20, 4, 8), "shard 0 of 20 has 5 tokens, fewer than one window"),
    ],
)
def test_batches_refuse_bad_arguments(args, match):
    with pytest.raises(DataError, match=match):
        Batches(torch.zeros(100, dtype=torch.uint8), *args, seed=0)


def test_evaluate_is_fixed_and_restores_mode():
    c = load_corpus()
    model = init_model(PRESETS["tiny"], seed=0)
    model.train()
    a = evaluate(model, c.val, batch_size=4, context=32, num_batches=2, seed=3)
    assert model.training
    model.eval()
    b = evaluate(model, c.val, batch_size=4, context=32, num_batches=2, seed=3)
    assert not model.training
    assert a == b and 5.0 < a < 6.0  # untrained: about ln 256
    assert evaluate(model, c.val, batch_size=4, context=32, num_batches=2, seed=4) != a


def test_evaluate_refuses_short_validation_data():
    model = init_model(PRESETS["tiny"], seed=0)
    with pytest.raises(DataError, match="validation data has 10 tokens"):
        evaluate(model, torch.zeros(10, dtype=torch.uint8), batch_size=2, context=32, num_batches=1)
