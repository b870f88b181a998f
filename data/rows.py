"""build_rows: any source -> num_rows rows of exactly seq_len + 1 token ids, cached on disk.

    rows = build_rows(
        "pg19", "/models/Qwen3-8B", seq_len=1_048_576, num_rows=100, cache_dir="cache"
    )
    rows[0]            # uint32 [seq_len + 1], a slice of a read-only memmap
    rows.built         # True if this call tokenised; False if it mapped an existing cache

Sources (see data/sources.py for text):
    "pg19", "hf:owner/name[:split]", a local directory / .jsonl / .parquet / glob
                        books tokenised, joined with the end-of-text token, cut into rows;
                        cached under cache_dir, rebuilt when the source, tokenizer, seq_len, seed
                        or eos token change; more rows than cached -> rebuilt, fewer -> a prefix
    a local .jsonl / .json / .parquet of conversations or prompt-completion pairs
                        rendered by the chat template (data/conversations.py), packed whole by
                        best fit, cached with a loss mask beside the ids: MaskedRows, whose
                        predictable(i) marks the labels the loss counts (the assistant's)
    "tokens:FILE.npy"   a token array used as is (memory-mapped): its rows if they are seq_len + 1
                        long, otherwise its flat contents cut into consecutive slices; integer ids
                        only, and with vocab_size every id used must lie in [0, vocab_size)
    "synthetic:copy"    the long-range copy task of data/synthetic.py; needs vocab_size (or a
                        tokenizer, whose base vocabulary is used); rows.predictable(i) marks the
                        labels that can be predicted
    "synthetic:repeat"  the same with the second half repeating the first in order: learnable in
                        minutes on a CPU (the demo's data)
    "synthetic:passkey" passkey retrieval cases (data/passkey_rows.py) in the model's vocabulary
                        (its tokenizer's, else one id per character), keys of key_digits digits;
                        rows.predictable(i) marks the answer's labels

Every rank may call build_rows at once: one builds under a file lock, the others wait and map it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from data import conversations, encode, sources
from data.cache import CacheEntry
from data.packing import fill_best_fit
from data.passkey_rows import PasskeyRows
from data.retrieval import KEY_DIGITS, model_vocab
from data.synthetic import CopyRows

log = logging.getLogger(__name__)


class Rows:
    """Rows of token ids: rows[i] is a 1-D array of seq_len + 1 ids; `tokens` is the 2-D array."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        meta: dict[str, Any] | None = None,
        path: str | None = None,
        built: bool = False,
    ):
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise ValueError(
                f"rows must be a 2-D array [num_rows, seq_len + 1], got shape {tokens.shape}"
            )
        self.tokens, self.meta, self.path, self.built = tokens, meta or {}, path, built

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i]

    def predictable(self, i: int) -> None:
        """Text has no marked positions: every label counts."""
        return None

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.tokens, dtype=dtype)

    def __repr__(self) -> str:
        return f"Rows({len(self)} x {self.seq_len + 1}, {self.tokens.dtype}, path={self.path!r})"


class MaskedRows(Rows):
    """Rows with a loss mask beside the ids: counted [rows, seq_len + 1] uint8, 1 where a token
    is a label the loss counts (data/conversations.py)."""

    def __init__(self, tokens: np.ndarray, counted: np.ndarray, **kw):
        super().__init__(tokens, **kw)
        self.counted = counted

    def predictable(self, i: int) -> np.ndarray:
        """bool [seq_len]: which labels (row[1:]) the loss counts."""
        return self.counted[i][1:] != 0


def build_rows(
    source: str,
    tokenizer: Any,
    seq_len: int,
    num_rows: int,
    *,
    cache_dir: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    eos_token: str | None = None,
    pack: str = "concat",
    text_column: str = "text",
    shuffle_buffer: int = 100,
    progress: bool = True,
    verify: bool = False,
    key_digits: tuple[int, int] = KEY_DIGITS,
    chat_template: str = "",
) -> Rows | CopyRows | PasskeyRows:
    """num_rows rows of seq_len + 1 tokens from `source`; see the module docstring.

    tokenizer: a model directory (or hub id) or a transformers fast tokenizer. eos_token overrides
    the separator between books (Qwen3-8B's tokenizer says "<|im_end|>"; the base model's
    "<|endoftext|>"). pack: "concat" (books end to end, cut at every row's end) or "best-fit"
    (whole books, cut only when longer than a row, rows padded with eos: data/packing.py).
    shuffle_buffer is for hub streaming; verify re-hashes a cache before use. key_digits: the
    pass keys' digits (fewest, most) of synthetic:passkey. chat_template: a .jinja file that
    renders conversations instead of the tokenizer's own template.
    """
    source = os.fspath(source)
    if int(seq_len) < 1 or int(num_rows) < 1:
        raise ValueError(f"seq_len and num_rows must be positive, got {seq_len} and {num_rows}")
    seq_len, num_rows = int(seq_len), int(num_rows)

    if source == "synthetic:passkey":
        return _passkey_rows(tokenizer, seq_len, num_rows, vocab_size, seed, key_digits)
    if source.startswith("synthetic:"):
        return _synthetic_rows(source, tokenizer, seq_len, num_rows, vocab_size, seed)
    if source.startswith("tokens:"):
        return _token_file_rows(source[len("tokens:") :], seq_len, num_rows, vocab_size)
    if cache_dir is None:
        raise ValueError(
            f"source {source!r} is tokenised into a cache: pass cache_dir= (a local directory)"
        )
    if tokenizer is None:
        raise ValueError(
            f"source {source!r} is text: pass the model's tokenizer (its directory or object)"
        )

    if pack not in ("concat", "best-fit"):
        raise ValueError(f"pack {pack!r}: use concat or best-fit")
    kind = conversations.data_kind(source, text_column)
    if kind != "text":
        return _conversation_rows(
            source,
            tokenizer,
            seq_len,
            num_rows,
            cache_dir,
            kind=kind,
            seed=seed,
            eos_token=eos_token,
            chat_template=chat_template,
            verify=verify,
        )
    options = dict(seed=seed, eos_token=eos_token, pack=pack, text_column=text_column)
    options.update(shuffle_buffer=shuffle_buffer, progress=progress, verify=verify)
    return _text_rows(source, tokenizer, seq_len, num_rows, cache_dir, **options)


def _synthetic_rows(source, tokenizer, seq_len, num_rows, vocab_size, seed) -> CopyRows:
    if source not in ("synthetic:copy", "synthetic:repeat"):
        raise ValueError(
            f"unknown synthetic source {source!r}; the ones there are: 'synthetic:copy', "
            f"'synthetic:repeat', 'synthetic:passkey'"
        )
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError(f"{source} needs vocab_size= (or a tokenizer to take it from)")
        vocab_size = encode.load_tokenizer(tokenizer).vocab_size  # without added special tokens
    mode = "spans" if source == "synthetic:copy" else "repeat"
    return CopyRows(seq_len, num_rows, int(vocab_size), seed=seed, mode=mode)


def _passkey_rows(tokenizer, seq_len, num_rows, vocab_size, seed, key_digits) -> PasskeyRows:
    if vocab_size is None:
        raise ValueError("synthetic:passkey needs vocab_size= (the model's)")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError("synthetic:passkey takes the model's directory as tokenizer, or None")
    directory = None if tokenizer is None else os.fspath(tokenizer)
    vocab = model_vocab(int(vocab_size), directory)
    return PasskeyRows(seq_len, num_rows, vocab, seed=seed, key_digits=key_digits)


def cache_name(source: str, seq_len: int, seed: int) -> str:
    """The name a text source's token cache goes under (its key adds the tokenizer and more)."""
    name = (
        source.replace("hf:", "")
        if sources.is_hub_source(source)
        else os.path.basename(source.rstrip("/"))
    )
    return f"{name}-L{seq_len}-seed{seed}"


def _text_rows(
    source,
    tokenizer,
    seq_len,
    num_rows,
    cache_dir,
    *,
    seed,
    eos_token,
    pack,
    text_column,
    shuffle_buffer,
    progress,
    verify,
) -> Rows:
    """Text tokenised once into the cache (under its lock), then memory-mapped."""
    key = {
        "source": sources.describe(source, text_column, shuffle_buffer),
        "tokenizer": encode.fingerprint(tokenizer),
        "eos_token": eos_token,
        "seq_len": seq_len,
        "seed": seed,
    }
    if pack != "concat":  # concat's key stays what it was, so its caches stay valid
        key["pack"] = pack
    entry = CacheEntry(cache_dir, cache_name(source, seq_len, seed), key)
    with entry.locked():
        tokens = entry.load(num_rows, verify=verify)
        built = tokens is None
        if built:
            tok = encode.load_tokenizer(tokenizer)
            eos = encode.eos_id(tok, eos_token)
            texts = sources.iter_documents(
                source,
                seed,
                text_column=text_column,
                shuffle_buffer=shuffle_buffer,
                hf_cache_dir=os.path.join(cache_dir, "hf_datasets"),
            )
            info: dict[str, Any] = {"eos_id": eos, "source_string": source}
            with entry.writer((num_rows, seq_len + 1), info) as out:
                if pack == "best-fit":
                    docs = encode.encoded_documents(texts, encode.encoder_for(tok), eos)
                    info.update(fill_best_fit(docs, out, eos, desc=source))
                else:
                    info.update(
                        encode.pack_documents(
                            texts, encode.encoder_for(tok), eos, out, progress=progress, desc=source
                        )
                    )
            log.info(
                "tokenised %s: %d rows of %d tokens from %d documents in %.1f s -> %s",
                source,
                num_rows,
                seq_len + 1,
                info["documents"],
                info["build_seconds"],
                entry.npy,
            )
            tokens = entry.load(num_rows)
            if tokens is None:
                raise RuntimeError(
                    f"the cache just written to {entry.npy} does not read back; is the disk full?"
                )
    return Rows(tokens, meta=entry.read_meta(), path=entry.npy, built=built)


def _conversation_rows(
    source, tokenizer, seq_len, num_rows, cache_dir, *, kind, seed, eos_token, chat_template, verify
) -> MaskedRows:
    """Conversations rendered and packed once into the cache with their mask, then mapped."""
    render = conversations.Renderer(tokenizer, chat_template, eos_token)
    key = {
        "source": sources.describe(source),
        "tokenizer": encode.fingerprint(tokenizer),
        "eos_token": eos_token,
        "seq_len": seq_len,
        "seed": seed,
        "kind": kind,
        "pack": "best-fit",
        **render.key,
    }
    entry = CacheEntry(cache_dir, cache_name(source, seq_len, seed), key)
    with entry.locked():
        tokens, counted = entry.load(num_rows, verify=verify), entry.load_mask(num_rows)
        built = tokens is None or counted is None
        if built:
            records = conversations.iter_records(source, seed)
            info: dict[str, Any] = {"eos_id": render.sep, "source_string": source}
            with entry.writer((num_rows, seq_len + 1), info, mask=True) as (out, mask_out):
                info.update(
                    conversations.pack_conversations(render, records, out, mask_out, desc=source)
                )
            tokens, counted = entry.load(num_rows), entry.load_mask(num_rows)
            if tokens is None or counted is None:
                raise RuntimeError(
                    f"the cache just written to {entry.npy} does not read back; is the disk full?"
                )
    return MaskedRows(tokens, counted, meta=entry.read_meta(), path=entry.npy, built=built)


def _token_file(path: str) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"tokens:{path}: cannot memory-map it as a .npy array ({e})") from e
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens:{path} holds {arr.dtype}, not integer token ids")
    return arr


def _cut(arr: np.ndarray, n: int) -> np.ndarray:
    if arr.ndim == 2 and arr.shape[1] == n:
        return arr
    flat = arr.reshape(-1)
    return flat[: flat.size // n * n].reshape(-1, n)


def token_file_rows(path: str, seq_len: int) -> np.ndarray:
    """Every row of seq_len + 1 ids a .npy of token ids holds, memory-mapped: its rows if they are
    that long, else its flat contents cut into consecutive slices (a shorter tail left out)."""
    return _cut(_token_file(path), seq_len + 1)


def _token_file_rows(path: str, seq_len: int, num_rows: int, vocab_size: int | None = None) -> Rows:
    """Rows from a .npy of token ids, memory-mapped, never copied; with vocab_size, every id of the
    rows used must lie in [0, vocab_size) (an id outside would fail deep inside the embedding)."""
    arr, n = _token_file(path), seq_len + 1
    rows = _cut(arr, n)
    if len(rows) < num_rows:
        raise ValueError(
            f"tokens:{path} holds {arr.size:,} tokens ({len(rows)} rows of {n}), but "
            f"{num_rows} rows need {num_rows * n:,}; use fewer rows or a shorter seq_len"
        )
    if vocab_size is not None:
        used = rows[:num_rows]
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"tokens:{path} holds token id {lo if lo < 0 else hi}, outside the model's "
                f"vocabulary [0, {vocab_size:,}); re-tokenise it with the model's tokenizer"
            )
    meta = {"source": f"tokens:{os.path.abspath(path)}", "seq_len": seq_len, "num_rows": num_rows}
    return Rows(rows[:num_rows], meta=meta, path=path, built=False)
