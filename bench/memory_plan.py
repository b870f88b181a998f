"""The memory planner's command line; the planner itself is product code in memory/plan.py.

    python bench/memory_plan.py --model qwen3-8b --seq-len 1048576 --gpus 8 --sp 8
    python bench/memory_plan.py --seq-len 4194304 --mlp-tile 16384 --no-save-attention
    python bench/memory_plan.py --cpu-offload --seq-len 5242880 --no-save-attention
    python -m memory.plan ...      # the same

Attention once (--save-attention / --no-save-attention; default: on when its host memory fits
--host-mem-gb) is shown side by side with attention recomputed: FLOPs, step time, peak per GPU,
host memory per node and the longest row of each. --cpu-offload plans FSDP2's CPU offload of the
fp32 parameter shards, gradients and AdamW states (train.py --cpu-offload); either way the table
ends with what the other setting would give.
"""

import os
import sys

if __package__ in (None, ""):  # run as `python bench/memory_plan.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
