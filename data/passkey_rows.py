"""synthetic:passkey: training rows that are retrieval cases, the loss on the answer alone.

    rows = PasskeyRows(seq_len=256, num_rows=800, vocab=char_vocab(68), seed=0, key_digits=(1, 1))
    row = rows[3]                  # uint32 [seq_len + 1]: one passkey case of length seq_len
    mask = rows.predictable(3)     # bool [seq_len], over the labels row[1:]: the answer's only

Each row is a case of data/retrieval.py's "passkey" task at the row's length: the needle "The
pass key is K. Remember it. " at a depth of the synthetic filler, then "What is the pass key? The
pass key is" and the answer " K". So training on them (--loss-on predictable: the answer's labels,
the rest of the row is context) teaches exactly what --eval-task passkey scores, in the same ids.
The answer is fixed by one earlier span of the row, the key, wherever the needle sits: an
induction-head task whose source moves from row to row, where synthetic:repeat's is always half a
row back.

Depths: row i sits at depth (i mod DEPTHS) / (DEPTHS - 1), so consecutive rows sweep the row from
the needle first (0) to the needle right before the question (1). With sp=2 a depth under about
1/2 puts the needle on rank 0 and the question on rank 1.

Keys: key_digits (fewest, most) digits, the evaluation's too (--passkey-digits). A 1-digit key is
a 1 in 9 guess for a model that knows where the answer goes but not which key; learnable in a
couple of hundred steps at the CPU demo's scale. The default 5 to 7 digits take thousands.

Seeds: row i is the case of RetrievalCases' index made from seed + SEED_OFFSET, so the keys the run
trains on are not the evaluation's (which --seed draws), nor its held-out rows' (seed + 1).
"""

from __future__ import annotations

import numpy as np

from data.retrieval import KEY_DIGITS, RetrievalCases, Vocab

DEPTHS = 33  # depths 0, 1/32, ..., 1: the needle at every 32nd of the haystack
SEED_OFFSET = 1000  # the training keys' seed: --seed's plus this


class PasskeyRows:
    """num_rows passkey cases of seq_len inputs; see the module docstring."""

    def __init__(
        self, seq_len: int, num_rows: int, vocab: Vocab, seed: int = 0, key_digits=KEY_DIGITS
    ):
        self.seq_len, self.num_rows, self.seed = int(seq_len), int(num_rows), int(seed)
        depths = np.linspace(0.0, 1.0, DEPTHS).tolist()
        per_cell = -(-self.num_rows // DEPTHS)
        self.cases = RetrievalCases(
            "passkey",
            vocab,
            [self.seq_len],
            depths,
            per_cell=per_cell,
            seed=self.seed + SEED_OFFSET,
            key_digits=key_digits,
        )
        self.meta = {
            "source": "synthetic:passkey",
            "seq_len": self.seq_len,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "key_digits": list(self.cases.key_digits),
        }

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.seq_len + 1)

    def __len__(self) -> int:
        return self.num_rows

    def case(self, i: int):
        """Row i's data/retrieval.py Case: cells are depth-major, rows cycle through depths."""
        if not -self.num_rows <= i < self.num_rows:
            raise IndexError(f"row {i} out of range for {self.num_rows} rows")
        i %= self.num_rows
        return self.cases[(i % DEPTHS) * self.cases.per_cell + i // DEPTHS]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.case(i).ids.astype(np.uint32)

    def predictable(self, i: int) -> np.ndarray:
        """bool [seq_len]: the answer's labels (label p is row[p + 1])."""
        mask = np.zeros(self.seq_len, dtype=bool)
        mask[self.case(i).answer_start - 1 :] = True
        return mask

    def __array__(self, dtype=None, copy=None):
        out = np.stack([self[i] for i in range(self.num_rows)])
        return out if dtype is None else out.astype(dtype)
