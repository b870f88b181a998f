"""Silence the one library warning a user of this trainer cannot act on, and nothing else.

from run.quiet import quiet_known_warnings
quiet_known_warnings()      # in train.py, before the model is built
"""

from __future__ import annotations

import warnings


def quiet_known_warnings() -> None:
    """Hide DTensor's "random operators may not have complete support on cpu device mesh".

    torch/distributed/tensor/_random.py raises it (stacklevel=2, so it is attributed to the caller
    in torch.distributed.tensor, _dispatch.py for ops like normal_) on every rank the first time a
    random op runs on a DTensor of a CPU mesh: here, init_weights() of a model trained from scratch
    on CPU (the demo, the tests). What it means: without CUDA's offset-based RNG each rank fills
    its shard from its own generator, so with the same seed the shards repeat the same numbers
    (measured: a [4, 3] normal_ over 2 ranks gives rows 0-1 == rows 2-3). The entries are still
    N(0, std), which is all a from-scratch run needs, and weights read from a checkpoint never go
    through it. Only that message, only on a cpu mesh, only from torch.distributed.tensor.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"DTensor random operators may not have complete support on cpu device mesh",
        category=UserWarning,
        module=r"torch\.distributed\.tensor\.",
    )
