"""Rows to per-rank training inputs, one row per step, resumably.

    loader = RowLoader(rows, dp_rank, dp_size, sp_rank, sp_size)
    for batch in loader:   # {"input_ids", "labels", "position_ids"}: int64 [1, ceil(T / sp_size)]
        ...
        save({"data": loader.state_dict(), ...})    # after the step; load_state_dict() resumes
    loader = RowLoader(rows, ..., eos_id=eos)   # documents: + "doc_lens", attention's segments

A row holds T + 1 tokens; shard_row (model/ulysses_exchange.py, the copyable Ulysses piece)
cuts this sp rank's share of it: inputs and labels shifted before the cut, global positions, the
end padded when T is not a multiple of sp_size. With eos_id (train.py's --documents masked) the
row is documents (data/documents.py): positions restart at 0 after every eos, the label at an eos
is ignored, and "doc_lens" holds the segments of the whole row that attention runs causal
attention within (every sp rank the same tuple, summing to sp x ceil(T / sp_size): the padding
belongs to the last one).

Data-parallel ranks take different rows: at step s, dp rank d reads row start_row + s * dp_size + d.
Steps stop when a full set of dp_size rows is no longer there, so every rank stops together.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.documents import row_documents
from model.ulysses_exchange import shard_row


def batch_to(batch: dict, device) -> dict:
    """A batch's tensors on `device` (the copies non-blocking); "doc_lens" stays host ints."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def shard_label_mask(mask: Any, sp_rank: int, sp_size: int) -> torch.Tensor:
    """A bool per label of a row (over row[1:], [T]) cut as shard_row cuts the labels: mask[i]
    is input i's label's, so it is cut as the inputs are, the padding False."""
    as_row = np.append(np.asarray(mask, dtype=bool), False)  # [T + 1]: one byte a token
    return shard_row(as_row, sp_rank, sp_size)["input_ids"].bool()


class RowLoader:
    """Iterates this (dp rank, sp rank)'s shards, one row per step; see the module docstring.

    rows: anything with len() and rows[i] (Rows, CopyRows, a 2-D array or tensor); if it has
    predictable(i) returning a mask over its labels, batches carry "predictable" too (bool, cut as
    the labels are). eos_id: rows of documents (data/documents.py), batches carry "doc_lens".
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
        row = self.rows[i]
        doc_lens = None if self.eos_id is None else row_documents(row, self.eos_id)
        batch = shard_row(
            row,
            self.sp_rank,
            self.sp_size,
            doc_lens=doc_lens,
            ignore_index=self.ignore_index,
            pad_id=self.pad_id,
        )
        mask_of = getattr(self.rows, "predictable", None)
        mask = mask_of(i) if mask_of else None  # Rows says None: no label is marked
        if mask is not None:
            batch["predictable"] = shard_label_mask(mask, self.sp_rank, self.sp_size)
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
