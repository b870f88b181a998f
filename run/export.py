"""The final model in the Hugging Face layout: checked for disk first, complete or absent.

    path = export_final(model, "runs/x/final", dtype=torch.bfloat16, tokenizer_dir=model_dir)

Every rank calls it (gathering the parameters is collective); rank 0 writes. Before anything is
gathered, the free space under the run directory is compared with the model's size in `dtype`
(the same margin as a checkpoint's); a shortfall raises DiskSpaceError on every rank and writes
nothing. The files go to FINAL.tmp, which rank 0 renames to FINAL once all of them are there, so
a crash leaves no half-written FINAL; an existing FINAL (a resumed run that finishes again) is
replaced only then.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

import run.checkpoint  # free_bytes through the module: the one place that asks the filesystem
from model.lora import is_adapter_key
from model.weights import save_safetensors
from run.checkpoint import DiskSpaceError, bytes_needed, checkpoints


def export_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the model's tensors in `dtype` (global shapes: a DTensor counts in full)."""
    return sum(t.numel() * dtype.itemsize for t in model.state_dict().values())


def export_final(
    model: torch.nn.Module,
    path: str,
    *,
    dtype: torch.dtype,
    tokenizer_dir: str | None = None,
    progress: bool = True,
    base_only: bool = False,
    source_dir: str | None = None,
) -> str:
    """Write `model` to `path` as described in the module docstring; returns `path`.
    base_only: without LoRA's adapters (a merged LoRA model: run/adapter.py). source_dir: the
    checkpoint the model was read from, whose layout a multimodal Qwen3.5's export keeps."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    parent = os.path.dirname(os.path.abspath(path))
    need = bytes_needed(export_bytes(model, dtype))
    free = [float(run.checkpoint.free_bytes(parent)) if rank == 0 else 0.0]  # rank 0 writes
    if dist.is_initialized():
        dist.broadcast_object_list(free, src=0)
    if free[0] < need:
        have = checkpoints(parent)
        last = (
            f"the last checkpoint ({os.path.basename(have[-1][1])}) is intact: free some space "
            f"and run again with --resume auto"
            if have
            else "no checkpoint was written (--save-every 0)"
        )
        raise DiskSpaceError(
            f"not enough disk for the final model under {parent}: it needs {need / 1e9:.2f} GB, "
            f"{free[0] / 1e9:.2f} GB are free; nothing was written and {last}"
        )
    tmp = path.rstrip("/") + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed export's leftovers
    skip = is_adapter_key if base_only else None
    save_safetensors(
        model,
        tmp,
        dtype=dtype,
        tokenizer_dir=tokenizer_dir,
        progress=progress,
        skip=skip,
        source_dir=source_dir,
    )
    if rank == 0:
        old = path.rstrip("/") + ".old"
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # everyone returns once FINAL is there
    return path
