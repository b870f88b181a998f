"""Documents in a row: where each ends, its positions from 0, and the labels that stay inside it.

    docs = row_documents(row, eos_id)     # row: T + 1 ids (inputs, then the last label)
    docs.lengths                          # (n1, n2, ...): each document's tokens, summing to T
    docs.position_ids                     # int64 [T]: 0, 1, ... restarting after every eos
    docs.first                            # bool [T]: the label at i is the next document's start
    eos = document_eos("masked", -1, rows)    # the id that ends documents: --eos-id, or the text's
    even_documents(1_048_576, 95_000)         # (95000, ..., 3576): a planned row's documents

With `--documents masked` every end-of-text token ends its document: the document is its tokens
up to and including the eos, and the next one starts after it. Attention stays inside a document
(model/attention.py runs causal attention on each document's segment of the row), RoPE positions
restart at 0, and no label predicts a next document's first token: the label at an eos (the
token after it) is ignored, while the eos itself is predicted by its document's last token.
A document cut by the row's end is the last segment of that row; the next row starts its rest
as a new document at position 0 (a row never knows what came before it).

A run of eos tokens after a document's own eos (best-fit packing's padding, data/packing.py,
or empty documents) is one segment in `lengths`: every label in it is ignored and nothing after
it attends to it, so one kernel call serves the whole run instead of one per token; positions
still restart at each of them. Only the inputs (the row's first T ids) decide the segments. A
row of 1M tokens costs one pass over its ids in numpy here; the lengths are plain ints, handed
to attention as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RowDocuments", "document_eos", "even_documents", "row_documents"]


@dataclass(frozen=True)
class RowDocuments:
    lengths: tuple[int, ...]  # tokens of each document, in order; sum = T
    position_ids: np.ndarray  # int64 [T]: the place of each token inside its document
    first: np.ndarray  # bool [T]: input i is an eos, so label i starts the next document


def row_documents(row: Any, eos_id: int) -> RowDocuments:
    """The documents of one row of T + 1 ids (see the module docstring)."""
    inputs = np.asarray(row[:-1])  # [T]; a memmap slice is read once here
    t = inputs.shape[0]
    is_eos = inputs == eos_id  # [T]
    ends = np.flatnonzero(is_eos) + 1  # a document ends right after each of its eos tokens
    starts = np.concatenate(([0], ends[ends < t]))  # [documents]: where each one begins
    lengths = np.diff(np.append(starts, t))  # [documents]
    # Position i minus the start of i's document: one repeat of each start per document token.
    position_ids = np.arange(t, dtype=np.int64) - np.repeat(starts, lengths)
    return RowDocuments(_merge_eos_runs(lengths, is_eos[starts]), position_ids, is_eos)


def _merge_eos_runs(lengths: np.ndarray, starts_with_eos: np.ndarray) -> tuple[int, ...]:
    """lengths with each run of one-token eos documents summed into one segment."""
    alone = (lengths == 1) & starts_with_eos  # [documents]: an eos by itself
    merged: list[int] = []
    last_alone = False  # whether merged[-1] is a run of lone eos tokens
    for n, eos_alone in zip(lengths.tolist(), alone.tolist(), strict=True):
        if eos_alone and last_alone:
            merged[-1] += 1
        else:
            merged.append(n)
        last_alone = eos_alone
    return tuple(merged)


def document_eos(documents: str, eos_id: int, rows: Any) -> int | None:
    """The id that ends a document (train.py's --documents, --eos-id): None for "stream"; the
    id given (>= 0); else the one a text source's rows were joined with (rows.meta["eos_id"])."""
    if documents != "masked":
        return None
    if eos_id >= 0:
        return eos_id
    meta = getattr(rows, "meta", None) or {}
    if "eos_id" not in meta:
        raise ValueError(
            "--documents masked: these rows carry no end-of-text id (token ids or synthetic "
            "rows); pass --eos-id N"
        )
    return int(meta["eos_id"])


def even_documents(seq_len: int, doc_len: int) -> tuple[int, ...]:
    """A row of seq_len tokens as documents of doc_len and the rest (what --dry-run --doc-len
    and the rehearsal plan for; memory/model_size.py's attention_square counts the same)."""
    whole, rest = divmod(seq_len, doc_len)
    return (doc_len,) * whole + ((rest,) if rest else ())
