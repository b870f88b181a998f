"""Token data for million-token training: sources -> tokens -> fixed-length rows -> per-rank shards.

    from data import build_rows, RowLoader
    rows = build_rows(
        "pg19", "/models/Qwen3-8B", seq_len=1_048_576, num_rows=100, cache_dir="cache"
    )
    for batch in RowLoader(rows, dp_rank, dp_size, sp_rank, sp_size):
        ...   # batch["input_ids"], ["labels"], ["position_ids"]: [1, ceil(seq_len / sp_size)]

rows.py      build_rows and Rows: the entry point, and the token-file source
sources.py   text sources: PG-19 streamed from the hub, local .txt / .jsonl / .parquet
encode.py    the tokenizer: fingerprint, parallel batch encoding, packing books into rows
cache.py     the on-disk uint32 cache: JSON description, atomic rename, file lock
synthetic.py the long-range copy task (no tokenizer needed)
retrieval.py passkey and key-value retrieval cases (a needle at a depth, a question, its answer)
passkey_rows.py synthetic:passkey, training rows that are passkey cases (the answer predictable)
loader.py    the resumable RowLoader: each rank's share of a row (model/ulysses_exchange.py)
documents.py a row's documents (--documents masked): their lengths, for shard_row
packing.py   --pack best-fit: whole documents into rows, only longer ones cut
"""

from data.loader import RowLoader
from data.rows import Rows, build_rows
from data.synthetic import CopyRows

__all__ = ["build_rows", "Rows", "CopyRows", "RowLoader"]
