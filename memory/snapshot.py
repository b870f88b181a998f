"""A CUDA memory-visualiser snapshot of one step (drag the file onto pytorch.org/memory_viz).

    with cuda_memory_history(path, device, rank):   # path "" or a CPU device: does nothing
        train_step(...)

It writes PATH.rank<N>.pickle: every allocation and free of the step with its Python stack, up
to the last 1,000,000 events. Recording stacks slows the step down, so train.py records only the
first step of a launch.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cuda_memory_history(path: str, device: torch.device, rank: int):
    if not path or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(f"{path}.rank{rank}.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
