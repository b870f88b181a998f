"""Tokenisation speed of data/ against a plain `datasets.map(tokenizer)`, and the cached start.

    python bench/bench_data.py                      # 8 MB of generated text, a 32k BPE trained here
    python bench/bench_data.py --mb 32 --seq-len 1048575

The text is made up (Zipf-distributed random words, ~200 KB "books") and the byte-level BPE is
trained on it, since nothing is downloaded: speed ratios carry over to Qwen3's tokenizer, not the
absolute speeds. tokens/s counts the ids produced. "cold" is the first build_rows (read the
parquet, tokenise, write and hash the cache), "cached" a later one (lock, check, memory-map).
"""

import argparse
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import data
from bench.timer import measure
from data import encode

EOS = "<|endoftext|>"


def make_books(megabytes: float, book_kb: int = 200) -> list[str]:
    """English-like text: a Zipf vocabulary of 50,000 random words in sentences and paragraphs."""
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p_letter = 1.0 / np.arange(1, 27) ** 0.8
    p_letter /= p_letter.sum()
    vocab = np.array(
        ["".join(rng.choice(letters, rng.integers(1, 11), p=p_letter)) for _ in range(50000)]
    )
    p_word = 1.0 / np.arange(1, len(vocab) + 1)
    books = []
    while sum(map(len, books)) < megabytes * 1e6:
        words = vocab[rng.choice(len(vocab), size=book_kb * 1000 // 6, p=p_word / p_word.sum())]
        cuts = np.cumsum(rng.integers(5, 25, size=len(words)))
        sentences = np.split(words, cuts[cuts < len(words)])
        ends = [rng.choice([".", ".", "!", "?", ";"]) for _ in sentences]
        seps = ["\n\n" if rng.random() < 0.15 else " " for _ in sentences]
        books.append(
            "".join(
                " ".join(s).capitalize() + e + sep
                for s, e, sep in zip(sentences, ends, seps, strict=True)
            )
        )
    return books


def train_tokenizer(books: list[str], out_dir: str, vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(books[:10], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="megabytes of text to generate")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=262143, help="row length - 1 for build_rows")
    ap.add_argument("--num-proc", type=int, default=os.cpu_count(), help="for datasets.map")
    a = ap.parse_args()
    datasets.disable_progress_bars()
    work = tempfile.mkdtemp(prefix="bench_data_")
    books = make_books(a.mb)
    tok_dir = train_tokenizer(books, os.path.join(work, "tok"), a.vocab)
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    print(f"{sum(map(len, books)) / 1e6:.1f} MB in {len(books)} books, BPE vocab {len(tok)}")
    ds = datasets.Dataset.from_dict({"text": books})
    runs = {}  # name -> (seconds, tokens produced)
    for num_proc in sorted({1, a.num_proc}):
        kw = {"batched": True, "remove_columns": ["text"], "num_proc": num_proc}
        mapping = functools.partial(ds.map, lambda b: tok(b["text"]), **kw)
        t = measure(mapping, "cpu", warmup=0, repeats=1)
        runs[f"datasets.map(tokenizer, num_proc={num_proc})"] = (
            t.min_s,
            sum(map(len, t.values[0]["input_ids"])),
        )
    encoder = encode.encoder_for(tok)
    t = measure(functools.partial(encode.encode_batch, encoder, books), "cpu", warmup=0, repeats=1)
    total = sum(map(len, t.values[0]))
    assert total == next(iter(runs.values()))[1], "encode_batch and the tokenizer call disagree"
    runs["data.encode.encode_batch (Rust threads)"] = (t.min_s, total)
    num_rows = (total + len(books)) // (a.seq_len + 1)  # one EOS per book
    if num_rows < 1:
        sys.exit(
            f"{total} tokens do not fill a row of {a.seq_len + 1}: raise --mb or lower --seq-len"
        )
    source = os.path.join(work, "books.parquet")
    pq.write_table(pa.table({"text": books}), source)
    build = functools.partial(
        data.build_rows, source, tok_dir, a.seq_len, num_rows, cache_dir=os.path.join(work, "cache")
    )
    t = measure(functools.partial(build, progress=False), "cpu", warmup=0, repeats=1)
    cold = f"build_rows cold: {num_rows} rows (read, tokenise, cache)"
    runs[cold] = (t.min_s, t.values[0].tokens.size)
    base = None
    for name, (seconds, tokens) in runs.items():
        rate = tokens / seconds
        base = base or rate
        print(f"  {name:<52} {seconds:8.3f} s {rate / 1e6:6.2f} M tok/s {rate / base:5.2f}x")
    cached = measure(functools.partial(build, progress=False), "cpu", warmup=1, repeats=7)
    assert not cached.values[0].built, "a second build_rows reads the cache"
    print(f"  cached start: build_rows {cached.median_s * 1e3:.2f} ms (median of 7)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
