"""Rows to per-rank training inputs: shift, then shard the sequence; step through rows resumably.

    loader = RowLoader(rows, dp_rank, dp_size, sp_rank, sp_size)
    for batch in loader:   # {"input_ids", "labels", "position_ids"}: int64 [1, ceil(T / sp_size)]
        ...
        save({"data": loader.state_dict(), ...})    # after the step; load_state_dict() resumes
    loader = RowLoader(rows, ..., eos_id=eos)   # documents: + "doc_lens", the row's (n1, n2, ...)

A row holds T + 1 tokens. inputs = row[:-1] and labels = row[1:] are taken BEFORE sharding, so the
label of the last token of one shard is the first token of the next (shifting after sharding would
lose one target per boundary). position_ids are global: shard r starts at r * ceil(T / sp_size),
never at 0, or RoPE would see every shard as the start of the sequence. When T is not a multiple
of sp_size the end is padded: inputs with pad_id, labels with ignore_index, positions counting on.
Under causal attention the padding comes after every real token, so nothing real attends to it.

With eos_id (train.py's --documents masked) the row is documents (data/documents.py): positions
restart at 0 after every eos, the label at an eos is ignored, and "doc_lens" holds the lengths of
the whole row's documents (every sp rank the same tuple, summing to sp x ceil(T / sp_size): the
padding belongs to the last document), which attention runs causal attention within.

Data-parallel ranks take different rows: at step s, dp rank d reads row start_row + s * dp_size + d.
Steps stop when a full set of dp_size rows is no longer there, so every rank stops together.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.documents import row_documents


def _as_long(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.long)
    return torch.from_numpy(np.array(x, dtype=np.int64))  # a copy: memmaps are read-only


def shard_row(
    row: Any,
    sp_rank: int,
    sp_size: int,
    ignore_index: int = -100,
    *,
    pad_id: int = 0,
    predictable: Any = None,
    eos_id: int | None = None,
) -> dict[str, Any]:
    """sp rank `sp_rank`'s share of one row of T + 1 tokens.

    input_ids, labels and position_ids, each [1, ceil(T/sp)]; `predictable` (bool [T], over the
    labels) adds a "predictable" mask sharded the same way; eos_id makes the row documents (see
    the module docstring) and adds "doc_lens", a tuple of ints.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank}")
    t = len(row) - 1
    if t < 1:
        raise ValueError(f"a row needs at least 2 tokens (an input and its label), got {len(row)}")
    per = -(-t // sp_size)  # ceil(T / sp_size)
    lo = sp_rank * per
    hi = max(lo, min(lo + per, t))  # real tokens of this shard: [lo, hi)
    n = hi - lo
    # Only this shard's slice of the row is converted, not the whole million tokens.
    input_ids = torch.full((per,), pad_id, dtype=torch.long)
    labels = torch.full((per,), ignore_index, dtype=torch.long)
    input_ids[:n] = _as_long(row[lo:hi])
    labels[:n] = _as_long(row[lo + 1 : hi + 1])
    out = {
        "input_ids": input_ids.view(1, per),
        "labels": labels.view(1, per),
        "position_ids": torch.arange(lo, lo + per, dtype=torch.long).view(1, per),
    }
    if eos_id is not None:
        _documents(out, row, eos_id, lo, n, per * sp_size, ignore_index)
    if predictable is not None:
        mask = torch.zeros(per, dtype=torch.bool)
        mask[:n] = torch.from_numpy(np.array(predictable[lo:hi], dtype=bool))
        out["predictable"] = mask.view(1, per)
    return out


def _documents(out: dict, row: Any, eos_id: int, lo: int, n: int, padded: int, ignore) -> None:
    """Positions, labels and "doc_lens" of `out` (a shard of `n` real tokens from `lo`) made
    per document; `padded` is the row's length with the sp padding."""
    docs = row_documents(row, eos_id)
    t = len(docs.position_ids)
    positions = out["position_ids"].view(-1)  # [per]
    positions[:n] = torch.from_numpy(docs.position_ids[lo : lo + n])
    # the padding counts on from the last real token's position, as without documents
    start = int(docs.position_ids[-1]) + 1 + (lo + n - t)  # the first padded token's, lo + n
    positions[n:] = torch.arange(start, start + positions.shape[0] - n)
    labels = out["labels"].view(-1)
    labels[:n][torch.from_numpy(docs.first[lo : lo + n])] = ignore
    lengths = list(docs.lengths)
    lengths[-1] += padded - t  # the padding after the last document, in it (nothing sees it)
    out["doc_lens"] = tuple(lengths)


def batch_to(batch: dict, device) -> dict:
    """A batch's tensors on `device` (the copies non-blocking); "doc_lens" stays host ints."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


class RowLoader:
    """Iterates this (dp rank, sp rank)'s shards, one row per step; see the module docstring.

    rows: anything with len() and rows[i] (Rows, CopyRows, a 2-D array or tensor); if it has
    predictable(i) returning a mask, batches carry "predictable" too. eos_id: rows of documents
    (shard_row's), batches carry "doc_lens".
    """

    def __init__(
        self,
        rows: Any,
        dp_rank: int = 0,
        dp_size: int = 1,
        sp_rank: int = 0,
        sp_size: int = 1,
        start_row: int = 0,
        *,
        ignore_index: int = -100,
        pad_id: int = 0,
        device: torch.device | str | None = None,
        eos_id: int | None = None,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if not 0 <= sp_rank < sp_size:
            raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank}")
        self.rows, self.dp_rank, self.dp_size, self.sp_rank, self.sp_size = (
            rows,
            dp_rank,
            dp_size,
            sp_rank,
            sp_size,
        )
        self.ignore_index, self.pad_id, self.device = ignore_index, pad_id, device
        self.eos_id = eos_id
        self.next_row = int(start_row)  # global: the row dp rank 0 reads at the next step

    def __iter__(self) -> RowLoader:
        return self

    def __len__(self) -> int:
        """Steps left."""
        return max(0, (len(self.rows) - self.next_row) // self.dp_size)

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.next_row + self.dp_size > len(self.rows):
            raise StopIteration
        i = self.next_row + self.dp_rank
        mask_of = getattr(self.rows, "predictable", None)
        batch = shard_row(
            self.rows[i],
            self.sp_rank,
            self.sp_size,
            self.ignore_index,
            pad_id=self.pad_id,
            predictable=mask_of(i) if mask_of else None,
            eos_id=self.eos_id,
        )
        self.next_row += self.dp_size
        if self.device is not None:
            batch = batch_to(batch, self.device)
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the next step starts; the same on every rank, and valid for another dp_size."""
        return {"next_row": self.next_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_row = int(state["next_row"])

    @staticmethod
    def rows_consumed(state: dict[str, int]) -> int:
        """Rows all dp ranks together have read before the step a state_dict() resumes at."""
        return int(state["next_row"])
