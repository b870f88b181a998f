"""Tokenisation speed of data/ against a plain `datasets.map(tokenizer)`, and the cached start-up time.

    python bench/bench_data.py                      # 8 MB of generated text, a 32k BPE trained here
    python bench/bench_data.py --mb 32 --seq-len 1048575

The text is generated (Zipf-distributed random words in sentences and paragraphs, cut into
"books" of ~200 KB) and the tokenizer is a byte-level BPE trained on it, because nothing can be
downloaded here; the relative speeds carry over to Qwen3's tokenizer, the absolute ones do not.
Each tokeniser sees the same books; tokens/s counts the ids produced. "cold" is the whole first
build_rows (read the parquet through datasets, tokenise, write and hash the cache), "cached" a
second build_rows call (lock, JSON check, memory-map), the cost of every later start.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
from data import encode  # noqa: E402

EOS = "<|endoftext|>"


def make_books(megabytes: float, book_kb: int = 200, seed: int = 0) -> list[str]:
    """Made-up English-like text: a Zipf vocabulary of random words, sentences, paragraphs."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = 1.0 / np.arange(1, 27) ** 0.8
    vocab = np.array(
        [
            "".join(rng.choice(letters, size=rng.integers(1, 11), p=freq / freq.sum()))
            for _ in range(50000)
        ]
    )
    p = 1.0 / np.arange(1, len(vocab) + 1)
    books, total = [], 0
    while total < megabytes * 1e6:
        words = vocab[rng.choice(len(vocab), size=book_kb * 1000 // 6, p=p / p.sum())]
        cuts = np.cumsum(rng.integers(5, 25, size=len(words)))
        sentences = [
            " ".join(s).capitalize() + rng.choice([".", ".", "!", "?", ";"])
            for s in np.split(words, cuts[cuts < len(words)])
        ]
        paras = ["\n\n" if rng.random() < 0.15 else " " for _ in sentences]
        book = "".join(s + sep for s, sep in zip(sentences, paras))
        books.append(book)
        total += len(book)
    return books


def train_tokenizer(books: list[str], out_dir: str, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        books[:10],
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out_dir)
    return out_dir


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="megabytes of text to generate")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--seq-len", type=int, default=262143, help="row length - 1 for the build_rows runs"
    )
    ap.add_argument(
        "--num-proc", type=int, default=os.cpu_count(), help="processes for datasets.map(num_proc=)"
    )
    args = ap.parse_args()

    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    work = tempfile.mkdtemp(prefix="bench_data_")
    books = make_books(args.mb)
    tok_dir = train_tokenizer(books, os.path.join(work, "tok"), args.vocab)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    mb = sum(map(len, books)) / 1e6
    ds = datasets.Dataset.from_dict({"text": books})
    results = []

    def report(name, seconds, tokens):
        results.append((name, seconds, tokens))
        print(f"  {name:<52} {seconds:8.3f} s  {tokens / seconds / 1e6:7.2f} M tok/s", flush=True)

    print(f"{mb:.1f} MB of text in {len(books)} books; BPE vocab {len(tok)}; {os.cpu_count()} CPUs")
    # num_proc forks; the children find the Rust thread pool already used (by training) and run
    # single-threaded, as num_proc intends; tokenizers warns about that once.
    for num_proc in sorted({1, args.num_proc}):
        kw = {} if num_proc == 1 else {"num_proc": num_proc}
        s, out = timed(
            lambda: ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"], **kw)
        )
        n = sum(len(x) for x in out["input_ids"])
        label = "datasets.map(tokenizer, batched=True" + (f", num_proc={num_proc})" if kw else ")")
        report(label, s, n)
    total = n

    enc = encode.encoder_for(tok)
    s, ids = timed(lambda: encode.encode_batch(enc, books))
    assert sum(map(len, ids)) == total, "the backend and the tokenizer call disagree"
    report("data.encode.encode_batch (Rust threads, all books)", s, total)

    seq_len = args.seq_len
    num_rows = (total + len(books)) // (seq_len + 1)
    if num_rows < 1:
        sys.exit(
            f"{total} tokens do not fill one row of {seq_len + 1}: raise --mb or lower --seq-len"
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": books}), os.path.join(work, "books.parquet"))
    cache = os.path.join(work, "cache")
    build = lambda **kw: data.build_rows(
        os.path.join(work, "books.parquet"),
        tok_dir,
        seq_len,
        num_rows,  # noqa: E731
        cache_dir=cache,
        progress=False,
        **kw,
    )
    s, rows = timed(build)
    assert rows.built
    report(
        f"build_rows cold: {num_rows} rows x {seq_len + 1} (read+tokenise+cache)",
        s,
        rows.tokens.size,
    )

    base = results[0][2] / results[0][1]
    print(
        f"\n  speed-up over datasets.map(tokenizer): encode_batch {results[-2][2] / results[-2][1] / base:.1f}x, "
        f"build_rows cold {rows.tokens.size / s / base:.1f}x"
    )

    starts = [timed(build)[0] for _ in range(7)]
    assert not build().built
    mmap = statistics.median(timed(lambda: np.load(rows.path, mmap_mode="r"))[0] for _ in range(7))
    s_verify, _ = timed(lambda: build(verify=True))
    print(
        f"\n  cached start: build_rows {statistics.median(starts) * 1e3:.2f} ms (median of 7; "
        f"np.load mmap alone {mmap * 1e3:.2f} ms) for a {rows.tokens.nbytes / 1e6:.1f} MB cache; "
        f"with verify=True (sha256 of every byte) {s_verify * 1e3:.1f} ms"
    )
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
