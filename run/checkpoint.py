"""Resumable torch.distributed.checkpoint saves: complete or absent, checked before use, rotated.

    path = save_checkpoint(out, step, model, optimizer, loader, rank, keep=2)
    path, skipped = find_checkpoint(out)  # newest complete one; [(name, why), ...] passed over
    step = load_checkpoint(path, model, optimizer, loader, rank)
    trim_metrics(metrics_path, step)      # records after the resumed step go

Layout: OUT/checkpoints/step_000040/ holds DCP's .metadata and __*.distcp shards (model and AdamW
state, every rank's piece) plus extra_rankNNNNN.pt (step, data position, RNG). It is written as
step_000040.tmp and renamed only after every rank has finished, so a directory without .tmp is a
finished write. A finished write can still be damaged later (a full disk, a truncated copy), so
find_checkpoint also reads each candidate's metadata and checks that every shard file holds the
bytes the metadata points into, newest first, and says which ones it passed over and why.

Rotation keeps the `keep` newest checkpoints at or before the one just written and deletes older
ones only after the new one is complete. Before writing, the free space under OUT/checkpoints is
compared with the checkpoint's size (every rank's tensors); a shortfall raises DiskSpaceError and
writes nothing, so the last good checkpoint stays as it was. free_bytes() is the one place that
asks the filesystem.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step_(\d+)$")


class DiskSpaceError(RuntimeError):
    """Not enough free disk for the next checkpoint; nothing was written."""


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem holding `path` (the one place that asks the filesystem)."""
    return shutil.disk_usage(path).free


def _local_bytes(state) -> int:
    """Bytes this rank contributes to a checkpoint of `state` (DTensors count their local shard)."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        return t.numel() * t.element_size()
    return 0


def checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of the finished checkpoint directories in OUT/checkpoints, oldest first."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, n))
        for n in os.listdir(root)
        if (m := STEP_DIR.match(n))
    ]
    return sorted(found)


def save_checkpoint(out: str, step: int, model, optimizer, loader, rank: int, keep: int = 2) -> str:
    """Write OUT/checkpoints/step_NNNNNN on every rank together; see the module docstring."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = os.path.join(out, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    msd, osd = get_state_dict(model, optimizer)
    # ---- room for it? Every rank's shards, plus 5% and 64 MB for metadata and the extra files
    # on the parameters' device: a plain NCCL group has no backend for host tensors
    dev = next(model.parameters()).device
    need = torch.tensor([_local_bytes(msd) + _local_bytes(osd)], dtype=torch.float64, device=dev)
    dist.all_reduce(need)
    os.makedirs(root, exist_ok=True)
    free = torch.tensor([float(free_bytes(root))], dtype=torch.float64, device=dev)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    need_b = float(need) * 1.05 + 64e6
    if free.item() < need_b:
        have = [name for _, name in checkpoints(out)]
        last = os.path.basename(have[-1]) if have else "none yet"
        raise DiskSpaceError(
            f"not enough disk for checkpoint {os.path.basename(final)} under {root}: it needs "
            f"{need_b / 1e9:.2f} GB, {free.item() / 1e9:.2f} GB are free; nothing was written and "
            f"the last checkpoint ({last}) is intact. Free some space "
            f"(or lower --keep-checkpoints) and continue with --resume auto"
        )
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    extra = {
        "step": step,
        "loader": loader.state_dict(),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(
            os.path.join(root, "LATEST.tmp"), "w"
        ) as f:  # for people; resume scans the directory
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "LATEST.tmp"), os.path.join(root, "LATEST"))
        rotate(out, step, keep)
    dist.barrier()
    return final


def rotate(out: str, step: int, keep: int) -> list[str]:
    """Delete all but the `keep` newest checkpoints at or before `step` (keep 0: delete none), and
    leftover .tmp directories of failed writes. Later steps (a timeline resumed from an earlier
    checkpoint) are left alone: this run overwrites them when it gets there."""
    gone = []
    if keep > 0:
        older = [p for s, p in checkpoints(out) if s <= step]
        gone = older[:-keep]
    root = os.path.join(out, "checkpoints")
    gone += [
        os.path.join(root, n)
        for n in os.listdir(root)
        if n.endswith(".tmp") and STEP_DIR.match(n[:-4])
    ]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None if it looks whole. Reads the metadata
    and file sizes only: a shard shorter than the bytes the metadata points into is truncated."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:  # missing or unreadable .metadata
        return (
            f"its .metadata does not read "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{name} is missing"
        if os.path.getsize(f) < end:
            return f"{name} is truncated ({os.path.getsize(f):,} of {end:,} bytes)"
    extras = [n for n in os.listdir(path) if n.startswith("extra_rank")]
    if not extras:
        return "its extra_rank*.pt files (step, data position) are missing"
    for n in extras:
        try:
            torch.load(os.path.join(path, n), weights_only=False)
        except Exception as e:
            return f"{n} does not load ({type(e).__name__})"
    return None


def find_checkpoint(out: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest loadable checkpoint in OUT/checkpoints (None: start afresh), and those skipped."""
    skipped = []
    for _, path in reversed(checkpoints(out)):
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append((os.path.basename(path), why))
    return None, skipped


def load_checkpoint(path: str, model, optimizer, loader, rank: int) -> int:
    """Model, optimizer, data position and RNG from `path`; returns the step it was saved after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    files = sorted(f for f in os.listdir(path) if f.startswith("extra_rank"))
    extra = torch.load(os.path.join(path, files[min(rank, len(files) - 1)]), weights_only=False)
    loader.load_state_dict(extra["loader"])
    torch.set_rng_state(extra["cpu_rng"])
    if extra["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["cuda_rng"])
    return int(extra["step"])


def trim_metrics(path: str, step: int) -> int:
    """Keep the records of steps <= `step` (and drop a torn last line); returns how many went.

    Rewritten under a temporary name and renamed, so a crash here leaves the old file."""
    if not os.path.isfile(path):
        return 0
    keep, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
                ok = int(rec["step"]) <= step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return dropped
