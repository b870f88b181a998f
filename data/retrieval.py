"""Retrieval cases: a needle hidden at a depth of a long text, a question at the end, its answer.

    vocab = char_vocab(vocab_size=211)       # or tokenizer_vocab(tokenizer): a run's own
    cases = RetrievalCases("passkey", vocab, lengths=[128, 256], depths=[0, 0.5, 1.0],
                           per_cell=2, seed=0, filler=None)   # filler: held-out rows, or None
                           # key_digits=(5, 7): the pass key's length, fewest to most digits
    c = cases[4]              # made on demand from (seed, 4): the same case on every rank
    c.ids                     # int64 [c.length + 1]: the prompt, then the answer
    c.ids[c.answer_start :]   # the answer; c.length, c.depth, c.task: where it sits in the grid

Tasks. "passkey" (Mohtashami & Jaggi 2023): "The pass key is NNNNN. Remember it. " (a random key
of 5 to 7 digits, or key_digits) hidden in the haystack, then a new line, "What is the pass key?
The pass key is" and the answer " NNNNN". "kv" (RULER's key-value needle, NVIDIA 2024): KV_PAIRS
pairs "The value of key K is V. " with UUID-like K and V (8-4 hex digits) at random depths, the one
asked for at the case's depth, then a new line, "What is the value of key K? The value is" and
the answer " V".

Depth: the share of the haystack before the needle, 0 (the needle first) .. 1 (right before the
question). A case of length L is a row of L + 1 ids, as a training row of seq_len L is: L inputs,
the answer's last id only a label. Everything is put together in token ids, so the case fits L
exactly whatever the tokenizer does at the joins: the needle, the question and the answer are
encoded apart and the haystack is cut to what is left.

The haystack: held-out rows (filler: anything with len() and rows[i] of >= L + 1 ids, such as
data.build_rows' rows), a case taking a seeded slice of one; or, with filler None, the classic
synthetic filler ("The grass is green. The sky is blue. ..."), encoded once and repeated.

Vocabularies: tokenizer_vocab(tok) encodes with a transformers tokenizer (no special tokens);
char_vocab(n) is one id per character (CHARS' index mod n), for models without a tokenizer, such
as the synthetic tasks' (data/synthetic.py). Cases are drawn from np.random.default_rng([seed,
task, index]): nothing is stored, any rank makes any case in the time of one concatenation.
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data.encode import TOKENIZER_FILES, load_tokenizer

TASKS = ("passkey", "kv")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FIRST_LENGTH = 4096  # default lengths: powers of two from min(this, row / 4) up to the row
KEY_DIGITS = (5, 7)  # a pass key's digits: fewest, most
KV_PAIRS = 3  # key-value pairs hidden in a "kv" case: the one asked for and 2 distractors
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
CHARS = " .?:-\n" + string.digits + string.ascii_lowercase + string.ascii_uppercase

Vocab = Callable[[str], np.ndarray]  # text -> int64 ids


def char_vocab(vocab_size: int) -> Vocab:
    """One id per character: its index in CHARS, mod vocab_size (a vocabulary under len(CHARS)
    shares ids between characters; digits keep theirs from 16 ids up)."""

    def encode(text: str) -> np.ndarray:
        return np.array([CHARS.index(ch) % vocab_size for ch in text], dtype=np.int64)

    return encode


def tokenizer_vocab(tokenizer) -> Vocab:
    """A transformers tokenizer's ids, without special tokens."""

    def encode(text: str) -> np.ndarray:
        return np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    return encode


def model_vocab(vocab_size: int, model_dir: str | None) -> Vocab:
    """A model's vocabulary for cases: its tokenizer when its directory has one, else one id
    per character (char_vocab(vocab_size))."""
    has_tokenizer = model_dir is not None and any(
        os.path.isfile(os.path.join(model_dir, n)) for n in TOKENIZER_FILES
    )
    if has_tokenizer:
        return tokenizer_vocab(load_tokenizer(model_dir))
    return char_vocab(vocab_size)


@dataclass(frozen=True)
class Case:
    task: str
    index: int  # in its RetrievalCases
    length: int  # inputs: ids holds length + 1
    depth: float
    ids: np.ndarray  # int64 [length + 1]: the prompt, then the answer
    answer_start: int  # ids[answer_start:] is the answer

    @property
    def answer(self) -> np.ndarray:
        return self.ids[self.answer_start :]


def default_lengths(seq_len: int, shortest: int = 1) -> list[int]:
    """Powers of two from min(FIRST_LENGTH, seq_len / 4) (at least `shortest`) to seq_len,
    seq_len last even when it is not a power of two."""
    n = 1 << max(0, (min(FIRST_LENGTH, seq_len // 4)).bit_length() - 1)
    while n < shortest:
        n *= 2
    lengths = []
    while n < seq_len:
        lengths.append(n)
        n *= 2
    return lengths + [seq_len]


def _hex(rng: np.random.Generator, n: int) -> str:
    return "".join("0123456789abcdef"[d] for d in rng.integers(0, 16, size=n))


def _uuid_like(rng: np.random.Generator) -> str:
    return f"{_hex(rng, 8)}-{_hex(rng, 4)}"


def _passkey(rng: np.random.Generator, depth: float, key_digits=KEY_DIGITS):
    """([(depth, needle text)], question, answer) of one passkey case."""
    digits = int(rng.integers(key_digits[0], key_digits[1] + 1))
    key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    needle = f"The pass key is {key}. Remember it. "
    return [(depth, needle)], "\nWhat is the pass key? The pass key is", " " + key


def _kv(rng: np.random.Generator, depth: float, key_digits=KEY_DIGITS):
    """([(depth, needle text)], question, answer) of one key-value case (key_digits unused:
    its keys and values are UUID-like)."""
    keys: list[str] = []
    while len(keys) < KV_PAIRS:  # distinct keys (a repeat is a 16^12 chance, but then unclear)
        k = _uuid_like(rng)
        if k not in keys:
            keys.append(k)
    values = [_uuid_like(rng) for _ in keys]
    depths = [depth, *rng.uniform(0.0, 1.0, size=KV_PAIRS - 1).tolist()]
    pairs = zip(depths, keys, values, strict=True)
    needles = [(d, f"The value of key {k} is {v}. ") for d, k, v in pairs]
    return needles, f"\nWhat is the value of key {keys[0]}? The value is", " " + values[0]


MAKERS = {"passkey": _passkey, "kv": _kv}


def shortest_length(task: str, vocab: Vocab, key_digits=KEY_DIGITS) -> int:
    """The fewest inputs a case of `task` can have: the longest needles, question and answer of
    a few draws, and 8 ids to spare (a longer key, a longer encoding)."""
    need = 0
    for k in range(8):
        needles, question, answer = MAKERS[task](np.random.default_rng(k), 0.0, key_digits)
        parts = [text for _, text in needles] + [question, answer]
        need = max(need, sum(len(vocab(t)) for t in parts))
    return need + 8


class RetrievalCases:
    """lengths x depths x per_cell cases of `task`, in that order; see the module docstring."""

    def __init__(
        self, task, vocab: Vocab, lengths, depths, *, per_cell, seed, filler=None,
        key_digits=KEY_DIGITS,
    ):  # fmt: skip
        if task not in MAKERS:
            raise ValueError(f"unknown retrieval task {task!r}; the ones there are: {TASKS}")
        if not 1 <= key_digits[0] <= key_digits[1]:
            raise ValueError(f"key_digits {key_digits}: need 1 <= fewest <= most")
        bad = [d for d in depths if not 0.0 <= d <= 1.0]
        if bad or per_cell < 1 or not lengths or not depths:
            raise ValueError(
                f"retrieval cases need depths in [0, 1], per_cell >= 1 and some lengths; got "
                f"depths {list(depths)}, per_cell {per_cell}, lengths {list(lengths)}"
            )
        self.task, self.vocab, self.seed, self.filler = task, vocab, seed, filler
        self.lengths, self.depths = [int(n) for n in lengths], [float(d) for d in depths]
        self.per_cell = int(per_cell)
        self.key_digits = (int(key_digits[0]), int(key_digits[1]))
        self.synthetic = None if filler is not None else vocab(FILLER)
        shortest = shortest_length(task, vocab, self.key_digits)
        if too_short := [n for n in self.lengths if n < shortest]:
            raise ValueError(
                f"{task} cases need at least {shortest} tokens with this vocabulary "
                f"(the needles, the question and the answer); got lengths {too_short}"
            )

    def __len__(self) -> int:
        return len(self.lengths) * len(self.depths) * self.per_cell

    def cell(self, i: int) -> tuple[int, float]:
        """(length, depth) of case i, without making it."""
        per_length = len(self.depths) * self.per_cell
        return self.lengths[i // per_length], self.depths[i % per_length // self.per_cell]

    def __getitem__(self, i: int) -> Case:
        if not 0 <= i < len(self):
            raise IndexError(f"case {i} out of range for {len(self)} cases")
        length, depth = self.cell(i)
        rng = np.random.default_rng([self.seed, TASKS.index(self.task), i])
        needles, question, answer = MAKERS[self.task](rng, depth, self.key_digits)
        needle_ids = [(d, self.vocab(text)) for d, text in needles]
        tail = [self.vocab(question), self.vocab(answer)]
        hay_len = length + 1 - sum(len(t) for _, t in needle_ids) - sum(len(t) for t in tail)
        if hay_len < 0:
            raise ValueError(f"case {i}: {length} tokens cannot hold its needles and question")
        hay = self._haystack(rng, i, hay_len)
        # Needles at their depths of the haystack, in order of place (ties: the one asked first).
        at = sorted((round(d * hay_len), k, ids) for k, (d, ids) in enumerate(needle_ids))
        parts, cut = [], 0
        for place, _, ids in at:
            parts += [hay[cut:place], ids]
            cut = place
        ids = np.concatenate([*parts, hay[cut:], *tail]).astype(np.int64)
        return Case(self.task, i, length, depth, ids, answer_start=len(ids) - len(tail[1]))

    def _haystack(self, rng: np.random.Generator, i: int, n: int) -> np.ndarray:
        """n ids of filler: a seeded slice of a held-out row, or the synthetic text repeated."""
        if self.filler is None:
            reps = -(-n // len(self.synthetic))
            return np.tile(self.synthetic, max(reps, 1))[:n]
        row = self.filler[i % len(self.filler)]
        start = int(rng.integers(0, len(row) - n + 1))
        return np.asarray(row[start : start + n], dtype=np.int64)
