"""Text to token rows: load and fingerprint the tokenizer, encode books in parallel batches, and
pack them end to end, an end-of-text token after each book, into a preallocated uint32 array.

    tok = load_tokenizer("/models/Qwen3-8B")
    stats = pack_documents(texts, encoder_for(tok), eos_id(tok), out)   # out: [rows, seq_len + 1]

Encoding goes straight to the Rust `tokenizers` backend (a private copy with truncation and
padding off): its encode_batch spreads a batch over all cores (RAYON_NUM_THREADS caps it), there
is no "sequence longer than model_max_length" warning, and no attention masks are built. Reading
documents runs in a background thread, so downloading or decoding overlaps with encoding.
Encoding stops as soon as the array is full: only about as much text as needed is tokenised.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from tqdm.auto import tqdm

# Files whose bytes decide what a tokenizer directory does; hashing them needs no loading.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)
MAX_BATCH_CHARS = 16 << 20  # ~4M tokens per batch: the ids come back as Python lists first
MAX_BATCH_DOCS = 1024


class NotEnoughText(ValueError):
    """The source ran out before the rows were full."""

    def __init__(self, tokens: int, shape: tuple[int, ...], documents: int, what: str):
        self.tokens, self.needed, self.documents = tokens, int(np.prod(shape)), documents
        rows = f"{shape[0]} rows of {shape[1]} tokens" if len(shape) == 2 else "the array"
        super().__init__(
            f"{what}: {documents} documents gave {tokens:,} tokens (end-of-text tokens included), "
            f"but {rows} need {self.needed:,}; use fewer rows, a shorter seq_len, or more text"
        )


def load_tokenizer(path_or_obj: Any):
    """A transformers tokenizer from a directory or hub id; a tokenizer object is returned as is."""
    if not isinstance(path_or_obj, (str, os.PathLike)):
        return path_or_obj
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(path_or_obj))


def fingerprint(path_or_obj: Any) -> str:
    """A hash that changes when the tokenizer's behaviour can change.

    For a directory, the bytes of its tokenizer files (fast: no loading); for an object or a hub
    id, its backend's JSON plus the eos token. The two differ for the same tokenizer, so passing
    a directory one day and an object the next builds the cache twice, never reads a wrong one.
    """
    h = hashlib.sha256()
    if isinstance(path_or_obj, (str, os.PathLike)) and os.path.isdir(path_or_obj):
        found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path_or_obj, n))]
        if not found:
            raise FileNotFoundError(
                f"{path_or_obj} holds none of {', '.join(TOKENIZER_FILES)}: "
                f"pass the model directory that has the tokenizer"
            )
        for name in found:
            with open(os.path.join(path_or_obj, name), "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        return "files:" + h.hexdigest()
    tok = load_tokenizer(path_or_obj)
    h.update(_backend(tok).to_str().encode())
    h.update(f"\0eos={tok.eos_token}".encode())
    return "object:" + h.hexdigest()


def eos_id(tok: Any, eos_token: str | None = None) -> int:
    """The id that separates books: the tokenizer's eos token, or eos_token if given."""
    name = eos_token if eos_token is not None else tok.eos_token
    if name is None:
        raise ValueError(
            f"tokenizer {getattr(tok, 'name_or_path', tok)!r} has no eos_token to put between "
            f"books; set eos_token in its tokenizer_config.json or pass "
            f"eos_token='<|endoftext|>' (Qwen3)"
        )
    ids = tok.convert_tokens_to_ids([name])
    if not ids or ids[0] is None or ids[0] == tok.unk_token_id:
        raise ValueError(f"eos token {name!r} is not in the tokenizer's vocabulary")
    return int(ids[0])


def _backend(tok: Any):
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tok).__name__} is not a fast tokenizer (no tokenizer.json backend); "
            f"this code encodes with the Rust tokenizers library: save a fast tokenizer"
        )
    return backend


def encoder_for(tok: Any):
    """A private copy of the Rust tokenizer with truncation and padding off."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(_backend(tok).to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def encode_batch(encoder, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, no special tokens added; parallel over the batch in Rust."""
    fast = getattr(encoder, "encode_batch_fast", None)  # tokenizers >= 0.21: skips offsets
    encodings = (fast or encoder.encode_batch)(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]


def _prefetch(items: Iterable[str], depth: int = 64) -> Iterator[str]:
    """Iterate `items` in a background thread, `depth` ahead; errors are re-raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():  # a consumer that stopped early must not leave us blocked
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def reader():
        try:
            for item in items:
                if not put(item):
                    return
            put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            put(e)

    threading.Thread(target=reader, daemon=True, name="data-prefetch").start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def encoded_documents(texts: Iterable[str], encoder, eos: int) -> Iterator[np.ndarray]:
    """Each text's ids with the eos after it (uint32), encoded in batches as pack_documents
    encodes them; for a packer that needs whole documents (data/packing.py)."""
    docs_iter = _prefetch(texts)
    try:
        batch, size = [], 0
        for text in docs_iter:
            batch.append(text)
            size += len(text)
            if size >= MAX_BATCH_CHARS or len(batch) >= MAX_BATCH_DOCS:
                for ids in encode_batch(encoder, batch):
                    yield np.append(ids, np.uint32(eos))
                batch, size = [], 0
        for ids in encode_batch(encoder, batch) if batch else []:
            yield np.append(ids, np.uint32(eos))
    finally:
        docs_iter.close()  # stops the reader thread


def pack_documents(
    texts: Iterable[str],
    encoder,
    eos: int,
    out: np.ndarray,
    *,
    progress: bool = True,
    desc: str = "text",
) -> dict[str, Any]:
    """Fill `out` (any shape, uint32) with book, eos, book, eos, ... and stop when it is full.

    A book that does not fit carries over into the next row. Raises NotEnoughText if the texts
    run out first. `desc` names the source in the progress bar and errors. Returns counts for
    the cache's JSON.
    """
    flat = out.reshape(-1)
    need, pos, docs, chars = flat.size, 0, 0, 0
    eos_arr = np.array([eos], dtype=np.uint32)
    docs_iter = _prefetch(texts)
    bar = tqdm(
        total=need, unit="tok", unit_scale=True, desc=desc, disable=not progress, smoothing=0.1
    )
    t0 = time.perf_counter()
    try:
        while pos < need:
            # Ask for about as many characters as the remaining tokens need (4 chars per token
            # until measured), so the last batch does not tokenise far past the end.
            per_token = chars / pos if pos else 4.0
            budget = min(MAX_BATCH_CHARS, int((need - pos) * per_token * 1.1) + 1)
            batch, size = [], 0
            for text in docs_iter:
                batch.append(text)
                size += len(text)
                if size >= budget or len(batch) >= MAX_BATCH_DOCS:
                    break
            if not batch:
                break
            for ids in encode_batch(encoder, batch):
                docs += 1
                for piece in (ids, eos_arr):
                    take = min(piece.size, need - pos)
                    flat[pos : pos + take] = piece[:take]
                    pos += take
                    bar.update(take)
                if pos == need:
                    break
            chars += size
    finally:
        bar.close()
        docs_iter.close()  # stops the reader thread
    if pos < need:
        raise NotEnoughText(pos, out.shape, docs, desc)
    seconds = time.perf_counter() - t0
    return {
        "documents": docs,
        "build_seconds": round(seconds, 3),
        "tokens_per_second": round(need / max(seconds, 1e-9)),
    }
