"""Documents in a row: where each ends, for shard_row to restart positions and stop labels at.

    doc_lens = row_documents(row, eos_id)  # row: T + 1 ids -> (n1, n2, ...), summing to T + 1
    batch = shard_row(row, sp_rank, sp, doc_lens=doc_lens)    # model/ulysses_exchange.py
    eos = document_eos("masked", -1, rows)    # the id that ends documents: --eos-id, or the text's
    even_documents(1_048_576, 95_000)         # (95000, ..., 3576): a planned row's documents

With `--documents masked` every end-of-text token ends its document: the document is its tokens
up to and including the eos, and the next one starts after it. With these lengths shard_row
restarts RoPE positions at 0 in each document and ignores every label that would predict a next
document's first token: the label at an eos (the token after it), while the eos itself is
predicted by its document's last token. It also hands attention the row's segments
(model/attention.py runs causal attention on each one). A document cut by the row's end is the
last one of that row, its last label kept; the next row starts its rest as a new document at
position 0 (a row never knows what came before it). Only the inputs (the row's first T ids) end
documents: an eos as the row's last id, a label only, ends nothing.

A run of eos tokens after a document's own eos (best-fit packing's padding, data/packing.py, or
empty documents) is a run of one-token documents: positions restart at each, every label in it is
ignored, and attention takes the run as one segment (document_segments). A row of 1M tokens costs
one pass over its ids in numpy here; the lengths are plain ints.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["document_eos", "even_documents", "row_documents"]


def row_documents(row: Any, eos_id: int) -> tuple[int, ...]:
    """The lengths of the documents of one row of T + 1 ids, summing to T + 1 (see the module
    docstring): a document ends after each eos among the inputs row[:T]."""
    inputs = np.asarray(row[:-1])  # [T]; a memmap slice is read once here
    t = inputs.shape[0]
    ends = np.flatnonzero(inputs == eos_id) + 1  # a document ends right after each of its eos
    bounds = np.concatenate(([0], ends, [t + 1]))
    return tuple(np.diff(bounds).tolist())  # an eos at T - 1 leaves the last label alone


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
