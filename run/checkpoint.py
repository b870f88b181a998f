"""Resumable checkpoints: complete or absent, checksummed, loadable on any layout, rotated.

    path = save_checkpoint(out, step, model, optimizer, loader, rank, keep=2)
    paths = [p for _, p in reversed(checkpoints(out))]           # newest first
    resumed, skipped = resume(paths, model, optimizer, loader, rank, seed=0)
    resumed.step, resumed.change     # the step it was saved after; a line if the layout changed
    start = resume_from(cfg, model, optimizer, loader, rank)     # train.py: --resume, said
    trim_metrics(metrics_path, resumed.step)                      # records after it go
    error_line(exc)     # the one line for a failure, DCP's CheckpointException included

Layout: OUT/checkpoints/step_000040/ holds
  .metadata, __*.distcp   torch.distributed.checkpoint (DCP): model and AdamW state, every rank's
                          piece; DCP reshards them onto whatever layout loads them
  train_state.json        rank 0: the step, the data position (rows consumed by all dp ranks
                          together, valid for any dp) and the layout that wrote it (world, sp, dp)
  rng_rankNNNNN.pt        every rank: its CPU and CUDA RNG state (plain tensors)
  MANIFEST.json           rank 0, last: size and crc32 of every other file

It is written as step_000040.tmp: DCP's files and the per-rank files first, then every rank
checksums its share of them (rank r takes every world-th file of the sorted list, so the reading
is spread over the ranks), rank 0 writes the manifest and renames the directory. A directory
without .tmp is therefore a finished write; one without a manifest is not a checkpoint.

A finished write can be damaged later (a full disk, a truncated copy, a flipped bit), so before
loading, problem() checks what is cheap (the manifest, every file's size, DCP's metadata, the
train state) and verify() adds every file's crc32 (each rank reads its share, so the whole
checkpoint is read once). resume() takes the first candidate that verifies and loads; the ones
it passes over come back with the reason, a DCP load that fails included.

Nothing in a checkpoint can run code when it is read (run/safe_load.py): the per-rank files are
read with torch.load(weights_only=True), DCP's .metadata is checked with an unpickler that knows
only DCP's metadata classes before DCP reads it, and DCP's non-tensor items go through
SafeLoadPlanner. A file that needs more is refused by name. The manifest is run/manifest.py.

Resuming on another layout: DCP reshards model and optimizer; the loader continues at the saved
global row, so the new dp ranks read the rows a run of the new layout would read next; RNG state
is restored per rank when world, sp and dp are the same, else rebuilt from the seed and the step.
Before writing, a checkpoint that the disk has no room for raises DiskSpaceError.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from data.loader import RowLoader
from model.config import ConfigError
from run.manifest import MANIFEST, file_record, read_manifest, write_manifest
from run.safe_load import DCP_METADATA, SafeLoadPlanner, load_plain, read_dcp_metadata

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAIN_STATE = "train_state.json"
FORMAT = 1  # the version of train_state.json's fields, checked on load


class DiskSpaceError(RuntimeError):
    """Not enough free disk for the next checkpoint or the final model; nothing was written.

    Before writing, save_checkpoint compares the free space under OUT/checkpoints with the
    checkpoint's size (every rank's tensors); a shortfall raises this and writes nothing, so the
    last good checkpoint stays as it was. free_bytes() is the one place that asks the filesystem.
    """


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem holding `path` (the one place that asks the filesystem)."""
    return shutil.disk_usage(path).free


def bytes_needed(payload: float) -> float:
    """Disk to ask for before writing `payload` bytes of tensors: 5% and 64 MB more for metadata,
    per-rank files and the filesystem's own blocks."""
    return payload * 1.05 + 64e6


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


@dataclass(frozen=True)
class Layout:
    world: int
    sp: int
    dp: int

    def describe(self) -> str:
        """'4 processes (dp 2 x sp 2)', '2 processes (sp 2)', '1 process'."""
        parts = [f"{name} {n}" for name, n in (("dp", self.dp), ("sp", self.sp)) if n > 1]
        who = f"{self.world} process" + ("es" if self.world > 1 else "")
        return who + (f" ({' x '.join(parts)})" if parts else "")


@dataclass
class Resumed:
    path: str
    step: int  # the step it was saved after
    next_row: int  # the global row the next step starts at
    written: Layout
    loaded: Layout

    @property
    def change(self) -> str | None:
        """One line saying what changed with the layout, or None if nothing did."""
        if self.written == self.loaded:
            return None
        return (
            f"resume: written by {self.written.describe()}, loading on {self.loaded.describe()}: "
            f"model and AdamW resharded, data from row {self.next_row}, RNG from --seed and "
            f"step {self.step}"
        )


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


# ---------------------------------------------------------------------------------------------
# Ranks sharing the reading
# ---------------------------------------------------------------------------------------------
def _share(names: list[str]) -> list[str]:
    """This rank's share of `names` (all of them without a process group)."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _first_reason(mine: str | None) -> str | None:
    """The lowest rank's reason, the same on every rank (mine without a process group)."""
    if not dist.is_initialized():
        return mine
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, mine)
    return next((r for r in reasons if r is not None), None)


def _first_line(e: BaseException) -> str:
    """'Type: first line' of an exception; for DCP's CheckpointException, of the lowest failing
    rank's."""
    if isinstance(e, CheckpointException) and e.failures:  # {rank: (exception, traceback)}
        e = e.failures[min(e.failures)][0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def error_line(e: BaseException) -> str:
    """The one line a failed run prints for `e`: 'Type: first line'. DCP's CheckpointException
    (a BaseException, raised on every rank when any rank's read or write fails; its own first
    line lists only rank numbers) names the ranks that failed and the lowest one's error:
    'CheckpointException from rank 1: OSError: [Errno 28] No space left on device'."""
    if not (isinstance(e, CheckpointException) and e.failures):
        return _first_line(e)
    ranks = sorted(e.failures)
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{type(e).__name__} from {which}: {_first_line(e)}"


def _read_train_state(path: str) -> dict:
    with open(os.path.join(path, TRAIN_STATE)) as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise ValueError(f"its format is {state.get('format')!r}; this trainer reads {FORMAT}")
    for key in ("step", "data", "world", "sp", "dp"):
        if key not in state:
            raise ValueError(f"it has no {key!r}")
    return state


# ---------------------------------------------------------------------------------------------
# Is it whole?
# ---------------------------------------------------------------------------------------------
def problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None if it looks whole. Cheap, and the
    same in every process: the manifest, every file's size, DCP's metadata and the train state;
    verify() adds the checksums."""
    try:
        files = read_manifest(path)
    except FileNotFoundError:
        return f"it has no {MANIFEST} (written last: its write did not finish, or it is none)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} does not read ({_first_line(e)})"
    for name, want in files.items():
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{name} is missing"
        have = os.path.getsize(f)
        if have < want["size"]:
            return f"{name} is truncated ({have:,} of {want['size']:,} bytes)"
        if have != want["size"]:
            return f"{name} has {have:,} bytes, the manifest says {want['size']:,}"
    if DCP_METADATA not in files or TRAIN_STATE not in files:
        return f"its {MANIFEST} lists no {DCP_METADATA} or {TRAIN_STATE}"
    try:
        meta = read_dcp_metadata(path)
        shards = {info.relative_path for info in (meta.storage_data or {}).values()}
    except Exception as e:  # unreadable, or a pickle that names more than DCP's metadata
        return f"its {DCP_METADATA} does not read ({_first_line(e)}); it was not loaded"
    if missing := sorted(shards - set(files)):
        return f"{missing[0]} is not in its {MANIFEST}"
    try:
        state = _read_train_state(path)
    except Exception as e:
        return f"its {TRAIN_STATE} does not read ({_first_line(e)})"
    if missing := [rng_file(r) for r in range(state["world"]) if rng_file(r) not in files]:
        return f"{missing[0]} is missing"
    return None


def verify(path: str) -> str | None:
    """problem(), then every file's crc32 and every RNG file read as plain tensors; collective
    under a process group (each rank reads its share) and then the same answer on every rank."""
    why = problem(path)
    if why is None:
        files = read_manifest(path)
        for name in _share(sorted(files)):
            got = file_record(os.path.join(path, name))["crc32"]
            if got != files[name]["crc32"]:
                why = (
                    f"{name} fails its checksum (crc32 {got:08x}, the manifest says "
                    f"{files[name]['crc32']:08x})"
                )
                break
            if name.startswith("rng_rank"):
                try:
                    load_plain(os.path.join(path, name))
                except ValueError as e:
                    why = str(e)
                    break
    return _first_reason(why)


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------
def _trainable_only(model):
    """DCP's state-dict options: the tensors that train and their AdamW state, no frozen weight
    (LoRA's base is read again from --model, so a checkpoint holds the adapters alone). Loading
    is strict unless some weights are frozen (they are then absent on purpose)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def save_checkpoint(out: str, step: int, model, optimizer, loader, rank: int, keep: int = 2) -> str:
    """Write OUT/checkpoints/step_NNNNNN on every rank together; see the module docstring."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = os.path.join(out, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    msd, osd = get_state_dict(model, optimizer, options=_trainable_only(model))
    # ---- room for it? Every rank's shards, with bytes_needed's margin
    # on the parameters' device: a plain NCCL group has no backend for host tensors
    dev = next(model.parameters()).device
    need = torch.tensor([_local_bytes(msd) + _local_bytes(osd)], dtype=torch.float64, device=dev)
    dist.all_reduce(need)
    os.makedirs(root, exist_ok=True)
    free = torch.tensor([float(free_bytes(root))], dtype=torch.float64, device=dev)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    need_b = bytes_needed(float(need))
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
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    torch.save({"cpu": torch.get_rng_state(), "cuda": cuda_rng}, os.path.join(tmp, rng_file(rank)))
    if rank == 0:
        state = {
            "format": FORMAT,
            "step": step,
            "data": loader.state_dict(),
            "world": dist.get_world_size(),
            "sp": loader.sp_size,
            "dp": loader.dp_size,
        }
        with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
            json.dump(state, f, indent=1)
    dist.barrier()
    # ---- checksums: the union of every rank's listing (a shared filesystem's directory cache
    # may not show one node the files another just wrote, but each sees its own), every rank
    # reads its share, and rank 0 writes them last
    seen: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(seen, os.listdir(tmp))
    names = sorted(set().union(*seen))
    mine = {n: file_record(os.path.join(tmp, n)) for n in _share(names)}
    parts: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, mine)
    if rank == 0:
        write_manifest(tmp, {n: r for part in parts for n, r in part.items()})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = os.path.join(root, "LATEST.tmp")
        with open(latest_tmp, "w") as f:  # for people; resume scans the directory
            f.write(os.path.basename(final))
        os.replace(latest_tmp, os.path.join(root, "LATEST"))
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


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------
def rng_seed(seed: int, step: int) -> int:
    """The RNG seed for a resume on another layout: one 63-bit value per (seed, step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0] >> 1)


def load_checkpoint(path: str, model, optimizer, loader, rank: int, *, seed: int = 0) -> Resumed:
    """Model, optimizer, data position and RNG from `path` (checked with verify() first: this
    trusts the files). The layout may differ from the one that wrote it; see the module
    docstring. Raises whatever DCP raises if its load fails."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = _read_train_state(path)
    written = Layout(state["world"], state["sp"], state["dp"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    loaded = Layout(world, loader.sp_size, loader.dp_size)
    msd, osd = get_state_dict(model, optimizer, options=_trainable_only(model))
    both = {"model": msd, "optim": osd}
    dcp.load(both, checkpoint_id=path, planner=SafeLoadPlanner())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=both["model"],
        optim_state_dict=both["optim"],
        options=_trainable_only(model),
    )
    loader.load_state_dict(state["data"])
    step = int(state["step"])
    if written == loaded:  # the same ranks in the same places: each its own RNG stream
        rng = load_plain(os.path.join(path, rng_file(rank)))
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        torch.manual_seed(rng_seed(seed, step))  # CPU and every CUDA device
    return Resumed(path, step, loader.next_row, written, loaded)


def rows_to_read(out: str, resume_flag: str, steps: int, rows_per_step: int) -> int:
    """Rows a run of `steps` steps of `rows_per_step` rows each reads, counting where the
    checkpoints --resume may pick left the data: one written by more dp ranks has consumed more
    rows by its step than this layout would have."""
    need = steps * rows_per_step
    if not resume_flag:
        return need
    paths = [p for _, p in checkpoints(out)] if resume_flag == "auto" else [resume_flag]
    for path in paths:
        try:
            state = _read_train_state(path)
        except (OSError, ValueError):  # not one resume() would load either
            continue
        left = max(0, steps - int(state["step"])) * rows_per_step
        need = max(need, RowLoader.rows_consumed(state["data"]) + left)
    return need


def resume(
    paths: list[str], model, optimizer, loader, rank: int, *, seed: int = 0
) -> tuple[Resumed | None, list[tuple[str, str]]]:
    """The first of `paths` that verifies and loads, and the (name, why) of those passed over;
    (None, skipped) if none does. Collective: every rank calls it with the same paths.

    A DCP load that fails may have written part of the model; a later candidate that loads
    overwrites all of it, but if none does the model is neither its start nor any checkpoint,
    so that raises ConfigError naming the checkpoints rather than train from it."""
    skipped: list[tuple[str, str]] = []
    overwritten = False
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        why = verify(path)
        if why is None:
            try:
                return load_checkpoint(path, model, optimizer, loader, rank, seed=seed), skipped
            # DCP raises the same on every rank: it gathers their failures into a
            # CheckpointException (a BaseException)
            except (Exception, CheckpointException) as e:
                why = f"it did not load ({_first_line(e)})"
                overwritten = True
        skipped.append((name, why))
    if overwritten:
        listed = "; ".join(f"{n}: {w}" for n, w in skipped)
        raise ConfigError(
            f"--resume: no checkpoint loads ({listed}), and a failed load overwrote part of the "
            f"model; move the damaged checkpoints out of checkpoints/ and run again"
        )
    return None, skipped


def resume_from(cfg, model, optimizer, loader, rank: int) -> int:
    """The step a run starts at: 0, or the step of the checkpoint --resume names, or (auto) of
    the newest one under cfg.out that verifies and loads; rank 0 says which it passed over and
    why. `cfg` is run/train_config.py's TrainConfig (its resume, out and seed)."""

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    if not cfg.resume:
        return 0
    auto = cfg.resume == "auto"
    paths = [p for _, p in reversed(checkpoints(cfg.out))] if auto else [cfg.resume]
    resumed, skipped = resume(paths, model, optimizer, loader, rank, seed=cfg.seed)
    if resumed is None and not auto:
        raise ConfigError(
            f"--resume {cfg.resume}: not a loadable checkpoint ({skipped[0][1]}); pass another "
            f"step_* directory under OUT/checkpoints, or --resume auto"
        )
    for name, why in skipped:
        say(f"resume: skipped {name}: {why}")
    if resumed is None:
        say(f"resume: no loadable checkpoint in {cfg.out}/checkpoints; starting at step 0")
        return 0
    if resumed.change:
        say(resumed.change)
    say(f"resumed from {resumed.path} at step {resumed.step}")
    return resumed.step


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
