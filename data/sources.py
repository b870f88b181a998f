"""Where books come from: a source string becomes an iterator over document texts in seeded order.

    "pg19"                  PG-19 streamed from the HF hub (PG19_HUB_ID, parquet, train split)
    "pg19:validation"       another split of it
    "hf:owner/name[:split]" any hub dataset with a text column, streamed the same way (one of
                            conversations is read by data/conversations.py, as local files are)
    "/data/books/"          a directory of .txt files (one book each), or of .jsonl / .parquet files
    "/data/books.jsonl"     JSON lines, each with a "text" field (or .parquet with a "text" column)
    "/data/pg19/train-*.parquet"   a glob of such files

Local files are read through `datasets` (converted once to Arrow under the given cache directory)
and visited in the order np.random.default_rng(seed).permutation(number of documents), so the
order is exact and easy to reproduce. Hub datasets are streamed, so only what is read is
downloaded, in datasets' seeded shuffle order (shard order plus a shuffle buffer of documents).
Empty documents are skipped.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

PG19_HUB_ID = (
    "emozilla/pg19"  # PG-19 as parquet; deepmind/pg19 needs a loading script datasets 4 refuses
)
LOCAL_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def is_hub_source(source: str) -> bool:
    return source == "pg19" or source.startswith(("pg19:", "hf:"))


def hub_id_and_split(source: str) -> tuple[str, str]:
    """The hub dataset id and split a hub source streams from."""
    if source.startswith("hf:"):
        repo, _, split = source[3:].partition(":")
    else:
        repo, split = PG19_HUB_ID, source.partition(":")[2]
    return repo, split or "train"


def local_files(path: str) -> tuple[list[str], str]:
    """The files behind a local source, sorted, and the `datasets` builder that reads them."""
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise FileNotFoundError(f"no file matches {path!r}")
    elif os.path.isdir(path):
        files = sorted(
            f
            for f in glob.glob(os.path.join(path, "*"))
            if os.path.splitext(f)[1] in LOCAL_FORMATS and os.path.isfile(f)
        )
        if not files:
            raise FileNotFoundError(
                f"{path} holds no .txt, .jsonl or .parquet files: nothing to read"
            )
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(
            f"source {path!r} is not a file, a directory, 'pg19', 'hf:owner/name', "
            f"'tokens:FILE.npy' or 'synthetic:copy'"
        )
    builders = {LOCAL_FORMATS.get(os.path.splitext(f)[1]) for f in files}
    if len(builders) != 1 or None in builders:
        raise ValueError(
            f"{path}: mixed or unknown file types {sorted(map(str, builders))}; "
            f"use one of .txt, .jsonl or .parquet per source"
        )
    return files, builders.pop()


def describe(source: str, text_column: str = "text", shuffle_buffer: int = 100) -> dict[str, Any]:
    """What identifies the source's content, for the cache key; cheap (no file is read)."""
    if is_hub_source(source):
        repo, split = hub_id_and_split(source)
        return {
            "hub": repo,
            "split": split,
            "text_column": text_column,
            "shuffle_buffer": shuffle_buffer,
        }
    files, _ = local_files(source)
    # Names, sizes and modification times: an edited corpus gets a new cache without reading it.
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return {
        "path": os.path.abspath(source),
        "files": len(files),
        "files_sha256": h.hexdigest(),
        "text_column": text_column,
    }


def iter_documents(
    source: str,
    seed: int,
    *,
    text_column: str = "text",
    shuffle_buffer: int = 100,
    hf_cache_dir: str | None = None,
) -> Iterator[str]:
    """Document texts in the seeded order described at the top of this file."""
    texts = (_iter_hub if is_hub_source(source) else _iter_local)(
        source,
        seed,
        text_column=text_column,
        shuffle_buffer=shuffle_buffer,
        hf_cache_dir=hf_cache_dir,
    )
    return (t for t in texts if t)


def _iter_local(
    path: str, seed: int, *, text_column: str, hf_cache_dir: str | None, **_
) -> Iterator[str]:
    import datasets

    files, builder = local_files(path)
    kwargs = {"sample_by": "document", "keep_linebreaks": True} if builder == "text" else {}
    ds = datasets.load_dataset(
        builder, data_files=files, split="train", cache_dir=hf_cache_dir, **kwargs
    )
    if builder == "text":
        text_column = "text"  # the text builder names its only column "text"
    if text_column not in ds.column_names:
        raise ValueError(
            f"{path} has no {text_column!r} column (it has {ds.column_names}); "
            f"pass text_column= with the right name"
        )
    order = np.random.default_rng(seed).permutation(len(ds))
    for batch in ds.select_columns([text_column]).select(order).iter(batch_size=64):
        yield from batch[text_column]


@functools.cache
def hub_problem(repo_id: str, timeout: float = 5.0) -> str | None:
    """Why the hub's dataset `repo_id` cannot be reached, or None: one metadata request of at
    most `timeout` seconds (streaming it would retry for half a minute before failing), once
    per process and repo: train.py runs check_run before its process group and again inside it,
    and a pg19 run's held-out rows (pg19:validation) are the same dataset."""
    try:
        from huggingface_hub import HfApi

        HfApi().dataset_info(repo_id, timeout=timeout)
    except Exception as e:  # offline, DNS, a proxy, HF_HUB_OFFLINE: each has its own type
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
    return None


def hub_rows(source: str, seed: int, shuffle_buffer: int = 100) -> Iterator[dict]:
    """Every row (a dict of its columns) of a hub source, streamed in datasets' seeded shuffle
    order; an unreachable hub raises one RuntimeError saying how to read the files locally."""
    import datasets

    repo, split = hub_id_and_split(source)
    try:
        ds = datasets.load_dataset(repo, split=split, streaming=True)
        ds = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)
        it = iter(ds)
        first = next(it)  # network errors show up here, not at load_dataset
    except Exception as e:  # datasets and huggingface_hub raise many types for "offline"
        raise RuntimeError(
            f"could not stream {repo} (split {split!r}) from the Hugging Face hub: {e}\n"
            f"Offline or behind a firewall? Download its parquet files on a machine with internet "
            f"(huggingface-cli download {repo} --repo-type dataset --local-dir DIR) and pass "
            f"'DIR/data/{split}-*.parquet' as the source instead of {source!r}."
        ) from e
    yield first
    yield from it


def _iter_hub(
    source: str, seed: int, *, text_column: str, shuffle_buffer: int, **_
) -> Iterator[str]:
    rows = hub_rows(source, seed, shuffle_buffer)
    first = next(rows)
    if text_column not in first:
        raise ValueError(
            f"{hub_id_and_split(source)[0]} has no {text_column!r} column (it has {list(first)}); "
            f"pass text_column= with the right name"
        )
    yield first[text_column]
    for example in rows:
        yield example[text_column]
