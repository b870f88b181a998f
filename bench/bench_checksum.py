"""What the checkpoint manifest's crc32 costs: this CPU's rate, projected onto the recipe.

    python bench/bench_checksum.py                  # a 1 GiB file, 3 passes from the page cache
    python bench/bench_checksum.py --gib 4 --gpus 8

run/manifest.file_record (what checkpoint saves and verify() use) reads a file of random bytes
written here, so it comes from the page cache, as a shard just written (at save) or recently
read does: the rate is crc32's plus the copy out of the cache, not the disk's. The projection
is the recipe's checkpoint, Qwen3-8B's fp32 parameters and AdamW's two fp32 moments
(12 bytes per parameter), split evenly over --gpus ranks, each checksumming its share at save
and again when --resume verifies it. A disk slower than this rate makes the read the cost, and
the checksum nearly free on top of it.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.config import Qwen3Config  # noqa: E402
from run.manifest import file_record  # noqa: E402

BYTES_PER_PARAM = 4 + 4 + 4  # fp32 master weight, exp_avg, exp_avg_sq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the file checksummed")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument(
        "--gpus", type=int, default=8, help="ranks the recipe's checkpoint is split over"
    )
    args = p.parse_args()

    size = int(args.gib * 2**30)
    with tempfile.NamedTemporaryFile(dir=tempfile.gettempdir()) as f:
        block = os.urandom(1 << 24)
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        file_record(f.name)  # into the page cache
        rates = []
        for _ in range(args.passes):
            t0 = time.perf_counter()
            record = file_record(f.name)
            rates.append(record["size"] / (time.perf_counter() - t0))
    rate = statistics.median(rates)
    params = Qwen3Config.preset("qwen3-8b").num_params()
    total = params * BYTES_PER_PARAM
    per_rank = total / args.gpus
    print(
        f"crc32 from the page cache: {rate / 1e6:,.0f} MB/s (median of {args.passes} passes over "
        f"{size / 2**30:.1f} GiB; {', '.join(f'{r / 1e6:,.0f}' for r in rates)})"
    )
    print(
        f"recipe checkpoint: {params / 1e9:.2f} B params x {BYTES_PER_PARAM} B = "
        f"{total / 1e9:.1f} GB, {per_rank / 1e9:.1f} GB per rank on {args.gpus}: "
        f"{per_rank / rate:.1f} s per rank at save and again at --resume"
    )


if __name__ == "__main__":
    main()
