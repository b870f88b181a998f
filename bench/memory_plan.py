"""The memory planner's command line; the planner itself is product code in memory/plan.py.

    python bench/memory_plan.py --model qwen3-8b --seq-len 1048576 --gpus 8 --sp 8
    python -m memory.plan ...      # the same
"""

import os
import sys

if __package__ in (None, ""):  # run as `python bench/memory_plan.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
