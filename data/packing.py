"""Best-fit packing: whole documents into rows, cutting only those longer than a row.

    packer = BestFit(row_len=seq_len + 1, pad_id=eos, buffer_tokens=64 * (seq_len + 1))
    for row in packer.rows(documents):   # documents: id arrays, each ending in its eos
        ...                              # uint32 [row_len]: whole documents, then padding
    packer.padding_share                 # padding / all tokens of the rows made so far
    stats = fill_best_fit(documents, out, eos)   # out: [rows, seq_len + 1]; build_rows' way

train.py's --pack concat joins documents end to end and cuts them wherever a row ends
(data/encode.py's pack_documents): no padding, but nearly every row starts and ends inside a
document. --pack best-fit, with --documents masked, keeps every document shorter than a row
whole: documents are read into a buffer of about `buffer_tokens`, sorted longest first, and each
goes into the open row with the least room that still holds it, or opens a new row (best-fit
decreasing). A document longer than a row fills whole rows with its first row_len-token pieces;
its rest is packed like any other document (it starts at position 0, a new document). When the
buffer is spent its rows are emitted in the order they were opened, each filled up with pad_id.

The padding is eos tokens: under --documents masked a run of them after a document's own eos is
one segment whose labels are all ignored (data/documents.py), so it costs one kernel call and no
loss. Rows of 1M tokens and books of ~100K tokens fill within a few percent; the buffer is
the trade: larger fills better, and holds more documents' ids in memory while packing.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["BUFFER_ROWS", "BestFit", "fill_best_fit"]

BUFFER_ROWS = 64  # a buffer holds about this many rows' worth of documents


class BestFit:
    """Best-fit-decreasing packing of id arrays into rows of row_len ids; see the module doc."""

    def __init__(self, row_len: int, pad_id: int, buffer_tokens: int):
        if row_len < 1 or buffer_tokens < 1:
            raise ValueError(
                f"row_len and buffer_tokens must be positive: {row_len}, {buffer_tokens}"
            )
        self.row_len, self.pad_id, self.buffer_tokens = row_len, pad_id, buffer_tokens
        self.rows_made = 0
        self.padding = 0  # pad ids in the rows made so far
        self.cut = 0  # documents longer than a row, cut into pieces

    @property
    def padding_share(self) -> float:
        return self.padding / max(1, self.rows_made * self.row_len)

    def rows(self, documents: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Rows (uint32 [row_len]) of the documents, in buffers of about buffer_tokens."""
        buffer: list[np.ndarray] = []
        held = 0
        for doc in documents:
            doc = np.asarray(doc, dtype=np.uint32)
            whole = doc.size // self.row_len * self.row_len  # pieces that fill rows by themselves
            if doc.size > self.row_len:
                self.cut += 1
                for s in range(0, whole, self.row_len):
                    yield self._made(doc[s : s + self.row_len], 0)
                doc = doc[whole:]
            if doc.size == 0:
                continue
            buffer.append(doc)
            held += doc.size
            if held >= self.buffer_tokens:
                yield from self._pack(buffer)
                buffer, held = [], 0
        yield from self._pack(buffer)

    def _made(self, row: np.ndarray, padding: int) -> np.ndarray:
        self.rows_made += 1
        self.padding += padding
        return row

    def _pack(self, docs: list[np.ndarray]) -> Iterator[np.ndarray]:
        """The rows of one buffer: best fit, longest document first."""
        opened: list[list[np.ndarray]] = []  # each row's documents, in the order placed
        room: list[tuple[int, int]] = []  # (free ids, row index), sorted: the tightest first
        for doc in sorted(docs, key=len, reverse=True):
            i = bisect.bisect_left(room, (doc.size, -1))  # the least room that holds it
            if i == len(room):
                opened.append([doc])
                free, row = self.row_len - doc.size, len(opened) - 1
            else:
                free, row = room.pop(i)
                opened[row].append(doc)
                free -= doc.size
            bisect.insort(room, (free, row))
        for parts in opened:
            used = sum(p.size for p in parts)
            pad = np.full(self.row_len - used, self.pad_id, dtype=np.uint32)
            yield self._made(np.concatenate([*parts, pad]), pad.size)


def fill_best_fit(
    documents: Iterable[np.ndarray], out: np.ndarray, eos: int, *, desc: str = "text"
) -> dict[str, Any]:
    """Fill `out` [rows, row_len] (uint32) with best-fit rows of `documents` (id arrays, each
    ending in eos), padded with eos; raises NotEnoughText if they run out first. Returns the
    counts for the cache's JSON, the padding share among them."""
    from data.encode import NotEnoughText

    rows, row_len = out.shape
    packer = BestFit(row_len, pad_id=eos, buffer_tokens=BUFFER_ROWS * row_len)
    counted = _Counted(documents)
    t0, filled = time.perf_counter(), 0
    for row in packer.rows(counted):
        out[filled] = row
        filled += 1
        if filled == rows:
            break
    if filled < rows:
        raise NotEnoughText(counted.tokens, out.shape, counted.documents, desc)
    seconds = time.perf_counter() - t0
    return {
        "documents": counted.documents,
        "pack": "best-fit",
        "padding_share": round(packer.padding_share, 6),
        "documents_cut": packer.cut,
        "build_seconds": round(seconds, 3),
        "tokens_per_second": round(out.size / max(seconds, 1e-9)),
    }


class _Counted:
    """An iterator of documents that counts them and their ids as they are read."""

    def __init__(self, documents: Iterable[np.ndarray]):
        self.it, self.documents, self.tokens = iter(documents), 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        doc = next(self.it)
        self.documents += 1
        self.tokens += len(doc)
        return doc
