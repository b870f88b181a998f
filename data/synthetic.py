"""A synthetic long-range task: random tokens whose second half copies spans of the first half.

    rows = CopyRows(seq_len=1_048_575, num_rows=20, vocab_size=151_643, seed=0)
    row = rows[3]                  # uint32 [seq_len + 1], made on demand from (seed, 3)
    mask = rows.predictable(3)     # bool [seq_len], over the labels row[1:]

The first half of a row is uniform random tokens, so no model can predict it. The second half is a
run of spans, each copied from a random place in the first half. Once the first few tokens of a
span have been seen, the rest is fully determined, but only by looking back, on average half a
row and up to a whole row: loss on those `predictable` positions falls only if
attention really reaches across the sequence (an induction-head task at long range). The first
`context` tokens of each span are not counted: they are what locates the span.

mode="repeat" (source "synthetic:repeat") is the easy variant the CPU demo trains on: the second
half repeats the first half in order, so every second-half label sits exactly half a row back.
A small model learns that offset in a few hundred steps (a 2-layer, 128-wide Qwen3 on 512-token
rows of a 64-token vocabulary: loss ln 64 -> ~0 by step 300), where learning the span task's
induction heads takes thousands. With sp=2 the answer of every rank-1 label lives on rank 0.

Rows are generated from np.random.default_rng([seed, index]), so any rank makes any row in a few
milliseconds, nothing is stored and nothing needs a tokenizer.
"""

from __future__ import annotations

import math

import numpy as np

MIN_SEQ_LEN = 16  # the shortest row made: halves of 8 tokens, the second one span


class CopyRows:
    """num_rows rows of seq_len + 1 tokens in [0, vocab_size); see the module docstring."""

    def __init__(
        self,
        seq_len: int,
        num_rows: int,
        vocab_size: int,
        seed: int = 0,
        span_len: int | None = None,
        mode: str = "spans",
    ):
        if mode not in ("spans", "repeat"):
            raise ValueError(f"CopyRows mode must be 'spans' or 'repeat', got {mode!r}")
        self.mode = mode
        if seq_len < MIN_SEQ_LEN or num_rows < 1 or vocab_size < 2:
            raise ValueError(
                f"CopyRows needs seq_len >= {MIN_SEQ_LEN}, num_rows >= 1 and vocab_size >= 2; "
                f"got {seq_len}, {num_rows}, {vocab_size}"
            )
        self.seq_len, self.num_rows, self.vocab_size, self.seed = (
            seq_len,
            num_rows,
            vocab_size,
            seed,
        )
        self.half = (seq_len + 1) // 2
        self.span_len = min(span_len or max(16, seq_len // 32), self.half)
        # Tokens needed before a span is (with high probability) unique among `half` random ones,
        # plus one for luck. A repeat needs none: its source is always half a row back.
        self.context = math.ceil(math.log(self.half) / math.log(vocab_size)) + 1
        if mode == "repeat":
            self.span_len, self.context = self.half, 0
        if self.context >= self.span_len:
            raise ValueError(
                f"spans of {self.span_len} tokens cannot be located in {self.half} random "
                f"tokens from a vocabulary of {vocab_size}: use a larger vocab_size or span_len"
            )
        self.meta = {
            "source": "synthetic:copy" if mode == "spans" else "synthetic:repeat",
            "seq_len": seq_len,
            "num_rows": num_rows,
            "vocab_size": vocab_size,
            "seed": seed,
            "span_len": self.span_len,
            "context": self.context,
        }
        # The same positions are predictable in every row: spans start at fixed places.
        p = np.arange(1, seq_len + 1)  # row position of each label
        self._mask = (p >= self.half) & ((p - self.half) % self.span_len >= self.context)
        self._mask.flags.writeable = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.seq_len + 1)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_rows <= i < self.num_rows:
            raise IndexError(f"row {i} out of range for {self.num_rows} rows")
        i %= self.num_rows
        rng = np.random.default_rng([self.seed, i])
        n = self.seq_len + 1
        row = np.empty(n, dtype=np.uint32)
        row[: self.half] = rng.integers(0, self.vocab_size, size=self.half, dtype=np.uint32)
        rest = n - self.half
        starts = rng.integers(0, self.half - self.span_len + 1, size=-(-rest // self.span_len))
        if self.mode == "repeat":
            starts[:] = 0  # the first half again, in order
        src = (starts[:, None] + np.arange(self.span_len)).reshape(-1)[:rest]
        row[self.half :] = row[src]
        return row

    def predictable(self, i: int) -> np.ndarray:
        """bool [seq_len]: which labels (row[1:]) the earlier tokens determine."""
        return self._mask

    def __array__(self, dtype=None, copy=None):
        out = np.stack([self[i] for i in range(self.num_rows)])
        return out if dtype is None else out.astype(dtype)
