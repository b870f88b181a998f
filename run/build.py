"""The model a run trains: sharded, its attention chosen, planned, and its offload pool pinned.

    dtype = compute_dtype(cfg, device)    # bfloat16 on CUDA, float32 on CPU, unless --dtype says
    cfg, model, pool, planned = build_model(cfg, mc, model_dir, mesh, dp, device, dtype)
    cfg, model, backend = sharded_model(cfg, mc, model_dir, mesh, device, dtype)  # --eval-only
    log0("printed by rank 0 only")        # train.py's console lines too

build_model does four things, each where it is for a reason:

1. Shard the model (model/parallel.py): meta -> FSDP2 shards over dp x sp -> materialise -> read
   from model_dir, or the seeded init when there is none. First, because every later step hooks
   into its modules.
2. Ulysses attention over the mesh's sp ranks, and its kernel: picked at this rank's heads and
   length (on CUDA by running each candidate once). After the shards, because the probe runs in
   the training layout; before the plan, because the plan counts what the kernel keeps (flash's
   backward expands dk, dv; sdpa keeps no lse, so no attention once).
3. The memory plan, and attention once: --save-attention, or (unset) on when the planner finds
   host memory for it. Before the offload pool, because the pool offloads what the plan decided.
4. The offload pool (checkpoint-with-offload per layer, tiled MLP) and its host blocks: every
   block a step uses is pinned now, last, because pinning takes seconds and synchronises, so no
   step should do it.

sharded_model is steps 1 and 2, what a run and --eval-only share. `cfg` is train.py's TrainConfig
(a dataclass): this file reads its fields, hands back a dataclasses.replace of it with what was
decided (the kernel, attention once), and imports nothing from train.py, which runs as __main__.
With fake_mode (train.py --rehearse) all of it happens on fake tensors and nothing is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from memory.choices import plan_for_run
from memory.report import plan_warnings
from model.attention import (
    BACKENDS,
    BackendChoice,
    pick_backend,
    saved_attention_bytes,
    set_backend,
)
from model.attention_probe import probe_kernel
from model.checkpoint_offload import apply_offload, offloaded_tensors
from model.config import ConfigError
from model.parallel import build_sharded_model, ulysses_group
from model.ulysses import UlyssesAttention


def log0(*args) -> None:
    """print on rank 0 (torchrun's RANK; a plain process is rank 0), flushed at once."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def compute_dtype(cfg, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(cfg, mc, model_dir, mesh, dp, device, dtype, fake_mode=None):
    """(cfg, model, pool, plan): the sharded model with Ulysses attention and its kernel, the
    memory plan, and the offload pool with its host blocks. fake_mode: all of it on fake
    tensors, nothing loaded (train.py --rehearse). cfg comes back with what was decided."""
    world, sp = mesh.size(), mesh.size(1)
    cfg, model, backend = sharded_model(cfg, mc, model_dir, mesh, device, dtype, fake_mode)
    # Attention once when asked, or (unset) when the planner finds host memory for it.
    planned = plan_for_run(cfg, mc, world, sp, dp, dtype, device.type)
    log_attention(cfg, mc, sp, dtype, backend, planned)
    pool = apply_offload(
        model,
        offload=cfg.offload,
        min_bytes=cfg.offload_min_bytes,
        tile_mlp=cfg.tile_mlp or None,
        save_attention=planned.options.save_attention,
    )
    if cfg.offload:
        with fake_mode or contextlib.nullcontext():
            reserve_host_blocks(pool, cfg, mc, sp, dtype, device, planned.options.save_attention)
    return cfg, model, pool, planned


def sharded_model(cfg, mc, model_dir, mesh, device, dtype, fake_mode=None):
    """(cfg, model, backend): the sharded model, read from model_dir or initialised from
    --seed, with Ulysses attention over the mesh's sp ranks and its kernel chosen; what a run
    and --eval-only share. cfg comes back naming the kernel."""
    t0 = time.perf_counter()
    model, load_stats = build_sharded_model(
        mc,
        mesh,
        device=device,
        model_dir=model_dir,
        param_dtype=dtype,
        cpu_offload=cfg.cpu_offload,
        seed=cfg.seed,
        fake_mode=fake_mode,
    )
    if fake_mode is not None:
        loaded = "fake tensors, nothing loaded"
    elif load_stats:
        loaded = f"read {load_stats.bytes_read / 2**30:.2f} GiB on rank 0"
    else:
        loaded = "random init"
    log0(f"model ready in {time.perf_counter() - t0:.1f} s, {loaded}")
    model.set_attention(UlyssesAttention(ulysses_group(mesh)))
    cfg, backend = choose_attention(cfg, mc, sp=mesh.size(1), device=device, dtype=dtype)
    return cfg, model, backend


def choose_attention(cfg, mc, sp, device, dtype) -> tuple[object, BackendChoice]:
    """(cfg, choice): pick the attention kernel for this layout, on CUDA by running each
    candidate once at this rank's heads (model/attention_probe.py); cfg then names it, for the
    plan (flash's backward expands dk, dv). sdpa keeps no lse, so no attention once."""
    try:
        choice = pick_backend(
            device,
            dtype,
            num_heads=mc.num_attention_heads // sp,
            num_kv_heads=max(mc.num_key_value_heads // sp, 1),
            head_dim=mc.head_dim,
            seq_len=cfg.seq_len,
            request=cfg.attn_backend,
            probe=probe_kernel if device.type == "cuda" else None,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    set_backend(choice.name)
    cfg = dataclasses.replace(cfg, attn_backend=choice.name)
    if choice.name == "sdpa":
        cfg = dataclasses.replace(cfg, save_attention=False)
    return cfg, choice


def log_attention(cfg, mc, sp, dtype, backend, planned) -> None:
    """One line: the kernel, why the one before it was passed over, attention once or not and
    what it keeps; then the plan's warnings."""
    if planned.options.save_attention:
        padded_row = math.ceil(cfg.seq_len / sp) * sp
        kept = saved_attention_bytes(
            padded_row, mc.num_attention_heads, mc.head_dim, dtype.itemsize, sp=sp
        )
        where = "host" if cfg.offload else "device"
        how = f"attention once per layer, {kept / 2**20:,.1f} MiB per layer per GPU on the {where}"
    else:
        how = "attention recomputed in backward"
    why = f" ({planned.options.save_attention_why})" if planned.options.save_attention_why else ""
    passed = f"; {backend.why}" if backend.why else ""  # why cuDNN (say) was passed over
    log0(f"attention: {BACKENDS[backend.name]} ({backend.name}{passed}); {how}{why}")
    for warning in plan_warnings(planned):
        log0(f"warning: {warning}")


def reserve_host_blocks(pool, cfg, mc, sp, dtype, device, save_attention: bool) -> None:
    """Pin every host block the steps will use now: pinning takes seconds and synchronises, so
    no step should do it. The blocks hold model/checkpoint_offload.py's offloaded_tensors: each
    layer's input, or with attention once the input, out and lse of all layers but the last."""
    saved = offloaded_tensors(mc, cfg.seq_len, sp, dtype=dtype, save_attention=save_attention)
    show_progress = dist.get_rank() == 0 and sys.stderr.isatty()
    pinned = blocks = seconds = 0
    for kind in saved:
        r = pool.reserve(kind.count, kind.shape, kind.dtype, device, progress=show_progress)
        pinned, blocks, seconds = (
            pinned + r["pinned_bytes"],
            blocks + r["blocks"],
            seconds + r["seconds"],
        )
    log0(f"offload: pinned {pinned / 2**30:.2f} GiB in {blocks} host blocks in {seconds:.1f} s")
