"""--pack best-fit: whole documents in rows, only those longer than a row cut, no id lost.

On documents of known lengths (each id used once, so every id says where it came from): no
document that fits in a row is cut, every id appears exactly once across the rows, and the
padding share is the padding counted in the rows. Then the same through build_rows on a text
corpus (its own cache, concat's left as it was) and through train.py, which prints the share.
"""

import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
from dist_utils import run_train
from hf_ref import hf_model, save_hf
from test_data import _make_books, _train_tokenizer, expected_stream
from test_train import CFG

from data.packing import BUFFER_ROWS, BestFit
from data.rows import build_rows

PAD = 0


def documents(rng, count: int, row_len: int) -> list[np.ndarray]:
    """`count` documents of random lengths from 1 to 2.5 rows; ids 1, 2, 3, ... in order."""
    lengths = rng.integers(1, int(2.5 * row_len), count)
    lengths[:3] = [1, row_len, 2 * row_len]  # a one-id document, and two that fill rows exactly
    ends = np.cumsum(lengths)
    ids = np.arange(1, ends[-1] + 1, dtype=np.uint32)
    return np.split(ids, ends[:-1])


def where(rows: np.ndarray) -> dict[int, tuple[int, int]]:
    """id -> (row, column), for every id that is not padding."""
    r, c = np.nonzero(rows != PAD)
    return dict(zip(rows[r, c].tolist(), zip(r.tolist(), c.tolist(), strict=True), strict=True))


@pytest.mark.parametrize("row_len,buffer_rows", [(64, 4), (64, 16), (1000, 8)])
def test_best_fit_cuts_only_longer_documents_and_keeps_every_id_once(row_len, buffer_rows):
    docs = documents(np.random.default_rng(row_len + buffer_rows), 300, row_len)
    packer = BestFit(row_len, pad_id=PAD, buffer_tokens=buffer_rows * row_len)
    rows = np.stack(list(packer.rows(docs)))  # [rows, row_len]
    total = sum(d.size for d in docs)
    real = rows[rows != PAD]
    assert real.size == total and np.array_equal(np.sort(real), np.arange(1, total + 1))
    at = where(rows)
    for d in docs:
        if d.size <= row_len:  # whole: one row, in order, side by side
            (row,) = {at[i][0] for i in d.tolist()}
            cols = [at[i][1] for i in d.tolist()]
            assert cols == list(range(cols[0], cols[0] + d.size))
        else:  # cut into full rows of its own, and a rest kept whole
            whole = d.size // row_len * row_len
            for s in range(0, whole, row_len):
                assert np.array_equal(rows[at[int(d[s])][0]], d[s : s + row_len])
            rest = d[whole:].tolist()
            assert len({at[i][0] for i in rest}) <= 1
    padding = int((rows == PAD).sum())
    assert packer.padding_share == pytest.approx(padding / rows.size)
    assert packer.cut == sum(d.size > row_len for d in docs)
    # best fit leaves at most a few percent of the rows empty at these buffers
    print(
        f"row {row_len}, buffer {buffer_rows} rows: {len(rows)} rows, padding share "
        f"{packer.padding_share:.4f}, {packer.cut} documents cut"
    )
    assert len(rows) >= -(-total // row_len) and packer.padding_share < 0.1


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Ten books as .txt files and a tokenizer trained on them (tests/test_data.py's)."""
    books = _make_books()
    root = tmp_path_factory.mktemp("packing")
    (root / "txt").mkdir()
    for i, b in enumerate(books):
        (root / "txt" / f"book{i:02d}.txt").write_text(b, encoding="utf-8")
    return books, str(root / "txt"), _train_tokenizer(books, root / "tok")


def test_text_rows_keep_each_book_shorter_than_a_row_whole(text, tmp_path):
    books, txt, tok = text
    stream = expected_stream(tok, books, seed=0)  # the books in order, an eos after each
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tok).eos_token_id
    cut = np.flatnonzero(stream == eos) + 1
    book_ids = [b.tolist() for b in np.split(stream, cut[:-1])]  # each with its eos
    seq = 1023  # rows of 1024 ids: the books are 371 to 1,901 ids long
    whole = BestFit(seq + 1, pad_id=eos, buffer_tokens=BUFFER_ROWS * (seq + 1))
    n_rows = len(list(whole.rows(np.split(stream, cut[:-1]))))  # every book in them
    cache = str(tmp_path / "cache")
    c_rows = stream.size // (seq + 1)  # concat pads nothing: fewer rows from the same text
    concat = build_rows(txt, tok, seq, c_rows, cache_dir=cache, progress=False)
    packed = build_rows(txt, tok, seq, n_rows, cache_dir=cache, pack="best-fit", progress=False)
    again = build_rows(txt, tok, seq, c_rows, cache_dir=cache, progress=False)
    assert packed.path != concat.path and again.path == concat.path and not again.built
    assert np.array_equal(np.asarray(concat), stream[: c_rows * (seq + 1)].reshape(c_rows, -1))
    rows = [r.tolist() for r in np.asarray(packed)]
    short = [b for b in book_ids if len(b) <= seq + 1]
    assert short and len(short) < len(book_ids)  # both kinds are there
    for b in short:  # each one inside some row, whole
        assert any(_contains(r, b) for r in rows), f"a book of {len(b)} ids was cut"
    # every row ends with a document's eos (then the padding, more eos) or is a cut book's piece
    pads = sum(_trailing(r, eos) - 1 for r in rows if r[-1] == eos)
    assert n_rows * (seq + 1) - pads == stream.size  # every id of every book, once
    share = packed.meta["padding_share"]
    print(f"text, best-fit: padding share {share}, {packed.meta['documents_cut']} books cut")
    assert share == pytest.approx(pads / (n_rows * (seq + 1)), abs=1e-6)


def _trailing(row: list, value: int) -> int:
    n = 0
    while n < len(row) and row[-1 - n] == value:
        n += 1
    return n


def _contains(row: list, piece: list) -> bool:
    n = len(piece)
    return any(row[i : i + n] == piece for i in range(len(row) - n + 1))


@pytest.mark.slow
def test_train_prints_the_padding_share(text, tmp_path):
    _, txt, tok = text
    model = tmp_path / "model"
    save_hf(hf_model(replace(CFG, vocab_size=320), seed=1), str(model))
    for f in os.listdir(tok):  # the tokenizer's files beside the weights
        shutil.copy(os.path.join(tok, f), model / f)
    p = run_train(
        1,
        *["--model", str(model), "--data", txt, "--seq-len", "1023", "--steps", "1"],
        *["--pack", "best-fit", "--documents", "masked", "--dtype", "float32"],
        *["--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"), "--eval-every", "0"],
        "--no-save-final",
    )
    assert "data: best-fit packing, padding" in p.stdout
    refused = run_train(1, "--model", str(model), "--data", txt, "--pack", "best-fit", check=False)
    assert refused.returncode == 2 and "add --documents masked" in refused.stderr
