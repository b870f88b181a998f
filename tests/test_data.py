"""Tests for data/: rows from text, the token cache, the other sources, sharding and the loader.

Everything is built here: a small corpus of "books" (as .txt files, a .jsonl and a .parquet) and
a byte-level BPE tokenizer trained on it with `tokenizers`, saved as a transformers fast tokenizer.
The expected token stream is computed independently with AutoTokenizer, one book at a time.
"""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import data
from data import encode, sources
from model.ulysses_exchange import shard_row

EOS = "<|endoftext|>"
SEQ = 63  # rows of 64 tokens


# ---- fixtures: corpus, tokenizer, files -------------------------------------------------------


def _make_books(n=10, seed=0):
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "a",
        "ship",
        "sailed",
        "north",
        "and",
        "we",
        "saw",
        "ice",
        "café",
        "naïve",
        "—",
        "“quoted”",
        "it",
        "was",
        "cold",
        "morning",
        "letter",
        "captain",
        "wrote",
        "of",
        "sea",
    ]
    books = []
    for i in range(n):
        paras = [
            " ".join(rng.choice(words, size=rng.integers(5, 60))) + "."
            for _ in range(rng.integers(3, 25))
        ]
        books.append(f"BOOK {i}\n\n" + "\n\n".join(paras) + ("\n" if i % 2 else "  \n\n"))
    return books


def _train_tokenizer(books, out_dir, vocab_size=300, eos=EOS, max_len=None, truncate_at=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        books,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if truncate_at:
        tok.enable_truncation(truncate_at)
    kwargs = {"eos_token": eos} if eos else {}
    if max_len:
        kwargs["model_max_length"] = max_len
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def books():
    return _make_books()


@pytest.fixture(scope="module")
def tok_dir(books, tmp_path_factory):
    return _train_tokenizer(books, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(books, tmp_path_factory):
    """The same books as a directory of .txt files, a .jsonl and a .parquet, by format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    os.makedirs(root / "txt")
    for i, b in enumerate(books):
        (root / "txt" / f"book{i:02d}.txt").write_text(b, encoding="utf-8")
    with open(root / "books.jsonl", "w", encoding="utf-8") as f:
        for i, b in enumerate(books):
            f.write(json.dumps({"id": i, "text": b}) + "\n")
    pq.write_table(pa.table({"text": books, "id": list(range(len(books)))}), root / "books.parquet")
    return {
        "txt": str(root / "txt"),
        "jsonl": str(root / "books.jsonl"),
        "parquet": str(root / "books.parquet"),
    }


def expected_stream(tok_dir, books, seed):
    """Books in seed order, each tokenised alone by transformers, an eos after each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    order = np.random.default_rng(seed).permutation(len(books))
    return np.concatenate(
        [tok(books[i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for i in order]
    )


@pytest.fixture
def count_encodes(monkeypatch):
    """Counts calls of data.encode.encode_batch (the only place text becomes tokens)."""
    calls = []
    real = encode.encode_batch

    def counting(encoder, texts):
        calls.append(len(texts))
        return real(encoder, texts)

    monkeypatch.setattr(encode, "encode_batch", counting)
    return calls


def forbid_tokenising(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("tokenised although a valid cache exists")

    monkeypatch.setattr(encode, "encode_batch", boom)
    monkeypatch.setattr(encode, "load_tokenizer", boom)


# ---- rows from text --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_rows_reproduce_the_joined_books(fmt, corpus, books, tok_dir, tmp_path):
    seed = 3
    stream = expected_stream(tok_dir, books, seed)
    num_rows = len(stream) // (SEQ + 1) - 1  # nearly all the text: books carry across rows
    rows = data.build_rows(
        corpus[fmt], tok_dir, SEQ, num_rows, cache_dir=str(tmp_path), seed=seed, progress=False
    )
    assert rows.built and rows.shape == (num_rows, SEQ + 1) and rows.tokens.dtype == np.uint32
    assert all(len(rows[i]) == SEQ + 1 for i in range(len(rows)))
    np.testing.assert_array_equal(rows.tokens.reshape(-1), stream[: num_rows * (SEQ + 1)])
    assert rows.meta["eos_id"] == 0 and rows.meta["documents"] == len(books)


def test_seed_sets_the_book_order(corpus, books, tok_dir, tmp_path):
    a = data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 5, cache_dir=str(tmp_path), seed=0, progress=False
    )
    b = data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 5, cache_dir=str(tmp_path), seed=1, progress=False
    )
    assert a.built and b.built and a.path != b.path
    np.testing.assert_array_equal(
        a.tokens.reshape(-1), expected_stream(tok_dir, books, 0)[: 5 * (SEQ + 1)]
    )
    np.testing.assert_array_equal(
        b.tokens.reshape(-1), expected_stream(tok_dir, books, 1)[: 5 * (SEQ + 1)]
    )
    assert not np.array_equal(a.tokens, b.tokens)


def test_tokenisation_stops_when_rows_are_full(corpus, tok_dir, tmp_path, count_encodes):
    rows = data.build_rows(corpus["txt"], tok_dir, 15, 1, cache_dir=str(tmp_path), progress=False)
    assert rows.shape == (1, 16)
    assert sum(count_encodes) < 10 and rows.meta["documents"] == 1  # the first book is long enough


def test_too_little_text_says_how_much(corpus, books, tok_dir, tmp_path):
    have = len(expected_stream(tok_dir, books, 0))
    with pytest.raises(ValueError) as err:
        data.build_rows(
            corpus["parquet"], tok_dir, SEQ, 10_000, cache_dir=str(tmp_path), progress=False
        )
    msg = str(err.value)
    assert (
        f"10 documents gave {have:,} tokens" in msg
        and f"10000 rows of 64 tokens need {640_000:,}" in msg
    )
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".npy", ".json")) or ".tmp" in f]


def test_tokenizer_without_eos_is_refused(corpus, books, tmp_path):
    no_eos = _train_tokenizer(books, tmp_path / "tok", eos=None)
    with pytest.raises(ValueError, match="no eos_token"):
        data.build_rows(
            corpus["jsonl"], no_eos, SEQ, 2, cache_dir=str(tmp_path / "c"), progress=False
        )
    # ... unless the separator is named explicitly.
    rows = data.build_rows(
        corpus["jsonl"],
        no_eos,
        SEQ,
        2,
        cache_dir=str(tmp_path / "c"),
        eos_token=EOS,
        progress=False,
    )
    assert rows.meta["eos_id"] == 0


def test_no_truncation_and_no_length_warning(corpus, books, tmp_path, caplog):
    # A tokenizer that would truncate at 8 tokens and warn above 16 when called the usual way.
    short = _train_tokenizer(books, tmp_path / "tok", max_len=16, truncate_at=8)
    rows = data.build_rows(
        corpus["jsonl"], short, SEQ, 20, cache_dir=str(tmp_path / "c"), progress=False
    )
    caplog.clear()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(short)
    order = np.random.default_rng(0).permutation(len(books))
    whole = [tok.backend_tokenizer.encode(books[i], add_special_tokens=False) for i in order]
    assert all(len(e.ids) == 8 for e in whole)  # the saved tokenizer really truncates
    tok.backend_tokenizer.no_truncation()
    stream = np.concatenate(
        [tok.backend_tokenizer.encode(books[i], add_special_tokens=False).ids + [0] for i in order]
    )
    np.testing.assert_array_equal(rows.tokens.reshape(-1), stream[: 20 * (SEQ + 1)])
    assert "longer than" not in caplog.text


def test_tokenizer_object_and_text_column(tmp_path, books, tok_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "other.jsonl"
    path.write_text("".join(json.dumps({"content": b}) + "\n" for b in books))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    with pytest.raises(ValueError, match="no 'text' column"):
        data.build_rows(str(path), tok, SEQ, 3, cache_dir=str(tmp_path / "c"), progress=False)
    rows = data.build_rows(
        str(path), tok, SEQ, 3, cache_dir=str(tmp_path / "c"), text_column="content", progress=False
    )
    np.testing.assert_array_equal(
        rows.tokens.reshape(-1), expected_stream(tok_dir, books, 0)[: 3 * (SEQ + 1)]
    )


def test_bad_sources_are_explained(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="not a file, a directory"):
        data.build_rows(str(tmp_path / "missing"), tok_dir, SEQ, 1, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="cache_dir"):
        data.build_rows(str(tmp_path), tok_dir, SEQ, 1)
    with pytest.raises(ValueError, match="synthetic:copy"):
        data.build_rows("synthetic:nope", None, SEQ, 1)


def test_hub_source_offline_gives_a_clear_error(monkeypatch, tok_dir, tmp_path):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'emozilla/pg19' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="could not stream emozilla/pg19") as err:
        data.build_rows("pg19", tok_dir, SEQ, 1, cache_dir=str(tmp_path), progress=False)
    assert "train-*.parquet" in str(err.value)
    assert sources.describe("pg19:test")["split"] == "test"


# ---- the cache -------------------------------------------------------------------------------


def test_second_build_reads_the_cache_without_tokenising(
    corpus, tok_dir, tmp_path, monkeypatch, count_encodes
):
    first = data.build_rows(
        corpus["txt"], tok_dir, SEQ, 12, cache_dir=str(tmp_path), progress=False
    )
    assert first.built and len(count_encodes) > 0
    forbid_tokenising(monkeypatch)
    again = data.build_rows(
        corpus["txt"], tok_dir, SEQ, 12, cache_dir=str(tmp_path), progress=False
    )
    assert (
        not again.built and isinstance(again.tokens, np.memmap) and not again.tokens.flags.writeable
    )
    np.testing.assert_array_equal(again.tokens, first.tokens)
    fewer = data.build_rows(corpus["txt"], tok_dir, SEQ, 5, cache_dir=str(tmp_path), progress=False)
    np.testing.assert_array_equal(fewer.tokens, first.tokens[:5])  # a prefix of the cached rows
    verified = data.build_rows(
        corpus["txt"], tok_dir, SEQ, 12, cache_dir=str(tmp_path), progress=False, verify=True
    )
    assert not verified.built


def _truncate(npy, meta_path):
    with open(npy, "rb+") as f:
        f.truncate(os.path.getsize(npy) - 100)


def _edit_meta(field, value):
    def damage(npy, meta_path):
        meta = json.load(open(meta_path))
        meta[field] = value
        json.dump(meta, open(meta_path, "w"))

    return damage


def _wrong_shape(npy, meta_path):
    np.save(npy, np.zeros((3, SEQ + 1), dtype=np.uint32))


def _garbage_json(npy, meta_path):
    open(meta_path, "w").write("{not json")


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _wrong_shape,
        _garbage_json,
        lambda npy, meta_path: os.unlink(meta_path),
        lambda npy, meta_path: os.unlink(npy),
        _edit_meta("seq_len", SEQ + 1),
        _edit_meta("tokenizer", "files:0000"),
        _edit_meta("format", 0),
        _edit_meta("num_rows", 2),
    ],
    ids=[
        "truncated",
        "wrong-shape",
        "garbage-json",
        "no-json",
        "no-npy",
        "seq_len",
        "tokenizer",
        "format",
        "fewer-rows",
    ],
)
def test_damaged_or_mismatched_cache_is_rebuilt(damage, corpus, tok_dir, tmp_path, count_encodes):
    first = data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 6, cache_dir=str(tmp_path), progress=False
    )
    good = np.array(first.tokens)
    damage(first.path, first.path[:-4] + ".json")
    count_encodes.clear()
    again = data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 6, cache_dir=str(tmp_path), progress=False
    )
    assert again.built and count_encodes and again.path == first.path
    np.testing.assert_array_equal(again.tokens, good)


def test_changed_checksum_caught_by_verify(corpus, tok_dir, tmp_path):
    first = data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 4, cache_dir=str(tmp_path), progress=False
    )
    good = np.array(first.tokens)
    arr = np.load(first.path, mmap_mode="r+")
    arr[1, 5] += 1
    arr.flush()
    del arr
    assert not data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 4, cache_dir=str(tmp_path), progress=False
    ).built
    fixed = data.build_rows(
        corpus["jsonl"], tok_dir, SEQ, 4, cache_dir=str(tmp_path), progress=False, verify=True
    )
    assert fixed.built
    np.testing.assert_array_equal(fixed.tokens, good)


def test_new_tokenizer_seq_len_or_corpus_get_their_own_cache(
    corpus, books, tok_dir, tmp_path, count_encodes
):
    base = data.build_rows(corpus["txt"], tok_dir, SEQ, 4, cache_dir=str(tmp_path), progress=False)
    other_tok = _train_tokenizer(books, tmp_path / "tok2", vocab_size=280)
    assert data.build_rows(
        corpus["txt"], other_tok, SEQ, 4, cache_dir=str(tmp_path), progress=False
    ).built
    assert data.build_rows(
        corpus["txt"], tok_dir, SEQ + 8, 4, cache_dir=str(tmp_path), progress=False
    ).built
    with open(os.path.join(corpus["txt"], "book00.txt"), "a") as f:
        os.utime(f.fileno(), ns=(1, 1))  # same bytes, another modification time
    rebuilt = data.build_rows(
        corpus["txt"], tok_dir, SEQ, 4, cache_dir=str(tmp_path), progress=False
    )
    assert rebuilt.built and rebuilt.path != base.path
    np.testing.assert_array_equal(rebuilt.tokens, base.tokens)


def test_concurrent_builders_tokenise_once(corpus, tok_dir, tmp_path, monkeypatch):
    # Threads open the lock file separately, so flock excludes them exactly as it does processes.
    import time

    real = encode.encode_batch

    def slow(encoder, texts):
        time.sleep(0.3)  # keep the builder inside the lock while the others arrive
        return real(encoder, texts)

    monkeypatch.setattr(encode, "encode_batch", slow)
    barrier, results = threading.Barrier(4), [None] * 4

    def worker(i):
        barrier.wait()
        results[i] = data.build_rows(
            corpus["parquet"], tok_dir, SEQ, 8, cache_dir=str(tmp_path), progress=False
        )

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.built for r in results) == 1
    for r in results:
        np.testing.assert_array_equal(r.tokens, results[0].tokens)


@pytest.mark.slow
def test_concurrent_processes_tokenise_once(corpus, tok_dir, tmp_path):
    script = (
        "import sys, data; r = data.build_rows(sys.argv[1], sys.argv[2], 63, 8, "
        "cache_dir=sys.argv[3], progress=False); "
        "print('BUILT' if r.built else 'MAPPED', int(r.tokens.sum()))"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, corpus["jsonl"], tok_dir, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["BUILT", "MAPPED"] and outs[0][1] == outs[1][1]


# ---- token files and the synthetic source ----------------------------------------------------


def test_token_file_source(tmp_path):
    flat = np.arange(1000, dtype=np.uint32)
    np.save(tmp_path / "flat.npy", flat)
    rows = data.build_rows(f"tokens:{tmp_path / 'flat.npy'}", None, 9, 7)
    assert rows.shape == (7, 10) and isinstance(rows.tokens, np.memmap)
    np.testing.assert_array_equal(rows.tokens.reshape(-1), flat[:70])  # consecutive slices

    grid = np.arange(60, dtype=np.int64).reshape(6, 10)
    np.save(tmp_path / "grid.npy", grid)
    np.testing.assert_array_equal(
        data.build_rows(f"tokens:{tmp_path / 'grid.npy'}", None, 9, 6).tokens, grid
    )
    np.testing.assert_array_equal(
        data.build_rows(f"tokens:{tmp_path / 'grid.npy'}", None, 4, 12).tokens, grid.reshape(12, 5)
    )  # other widths: flat contents
    with pytest.raises(ValueError, match=r"holds 60 tokens \(5 rows of 11\), but 6 rows need 66"):
        data.build_rows(f"tokens:{tmp_path / 'grid.npy'}", None, 10, 6)
    np.save(tmp_path / "float.npy", np.zeros(100))
    with pytest.raises(ValueError, match="not integer token ids"):
        data.build_rows(f"tokens:{tmp_path / 'float.npy'}", None, 9, 1)


def test_synthetic_copy_rows(tok_dir):
    rows = data.build_rows("synthetic:copy", None, 511, 6, vocab_size=64, seed=5)
    again = data.build_rows("synthetic:copy", None, 511, 6, vocab_size=64, seed=5)
    other = data.build_rows("synthetic:copy", None, 511, 6, vocab_size=64, seed=6)
    assert rows.shape == (6, 512) and len(rows) == 6
    assert np.array_equal(rows[2], again[2]) and not np.array_equal(rows[2], other[2])
    k = rows.context
    for i in range(len(rows)):
        row, mask = rows[i], rows.predictable(i)
        assert row.dtype == np.uint32 and row.max() < 64 and mask.shape == (511,)
        assert 0.3 < mask.mean() < 0.5 and not mask[: rows.half - 1].any()
        # Every predictable label follows the same k tokens somewhere in the first half.
        windows = {tuple(row[q - k : q + 1]) for q in range(k, rows.half)}
        for t in np.flatnonzero(mask):
            assert tuple(row[t + 1 - k : t + 2]) in windows
    assert (
        data.build_rows("synthetic:copy", tok_dir, 511, 1).vocab_size == 300
    )  # from the tokenizer
    batch = next(iter(data.RowLoader(rows, sp_rank=1, sp_size=2)))
    assert batch["predictable"].shape == (1, 256)
    # Labels 256..510 and one padded position, which is never predictable.
    assert torch.equal(
        batch["predictable"][0], torch.as_tensor(np.append(rows.predictable(0)[256:], False))
    )


def test_synthetic_repeat_rows():
    """Every second-half token equals the one half a row back; only those labels are predictable."""
    rows = data.build_rows("synthetic:repeat", None, 511, 3, vocab_size=64, seed=1)
    h = rows.half
    for i in range(3):
        row, mask = rows[i], rows.predictable(i)
        assert np.array_equal(row[h:], row[: 512 - h])
        assert np.array_equal(
            np.flatnonzero(mask), np.arange(h - 1, 511)
        )  # labels row[1:] at positions >= h
        assert len(set(row[:h].tolist())) > 32  # the first half is random, not a pattern
    assert not np.array_equal(rows[0], rows[1])


# ---- sharding and the loader -----------------------------------------------------------------


@pytest.mark.parametrize("t", [12, 13, 17])
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_sp_shards_put_together_equal_the_row(t, sp):
    row = torch.randint(1, 1000, (t + 1,))
    shards = [shard_row(row, r, sp) for r in range(sp)]
    per = -(-t // sp)
    assert all(
        s[k].shape == (1, per) and s[k].dtype == torch.long
        for s in shards
        for k in ("input_ids", "labels", "position_ids")
    )
    cat = {k: torch.cat([s[k][0] for s in shards]) for k in shards[0]}
    assert torch.equal(cat["input_ids"][:t], row[:-1]) and torch.equal(cat["labels"][:t], row[1:])
    assert torch.equal(
        cat["position_ids"], torch.arange(per * sp)
    )  # global, continuing into padding
    assert (cat["input_ids"][t:] == 0).all() and (cat["labels"][t:] == -100).all()


def test_padded_shard_layout():
    row = np.arange(100, 111, dtype=np.uint32)  # T = 10 tokens of input, sp = 4 -> 3 per shard
    last = shard_row(row, 3, 4, ignore_index=-1, pad_id=7)
    assert last["input_ids"].tolist() == [[109, 7, 7]]
    assert last["labels"].tolist() == [[110, -1, -1]]
    assert last["position_ids"].tolist() == [[9, 10, 11]]
    first = shard_row(row, 0, 4)
    assert first["labels"].tolist() == [[101, 102, 103]]  # shifted before sharding


def test_loader_takes_rows_by_dp_rank_and_resumes():
    rows = np.arange(7 * 17, dtype=np.uint32).reshape(7, 17)
    for dp in range(2):
        for sp in range(2):
            got = list(data.RowLoader(rows, dp, 2, sp, 2))
            assert len(got) == 3  # 7 rows, 2 per step: the odd one out is not used
            for step, batch in enumerate(got):
                ref = shard_row(rows[step * 2 + dp], sp, 2)
                assert all(torch.equal(batch[k], ref[k]) for k in ref)

    straight = data.RowLoader(rows, 1, 2, 0, 2)
    next(straight)
    state = straight.state_dict()
    assert state == {"next_row": 2} and len(straight) == 2
    resumed = data.RowLoader(rows, 1, 2, 0, 2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    late = data.RowLoader(rows, 0, 1, 0, 1, start_row=5)
    assert [int(b["position_ids"][0, 0]) for b in late] == [0, 0]
    assert torch.equal(
        data.RowLoader(rows, start_row=6).__next__()["labels"][0],
        torch.as_tensor(rows[6, 1:], dtype=torch.long),
    )
    with pytest.raises(ValueError, match="sp_rank"):
        data.RowLoader(rows, sp_rank=2, sp_size=2)
