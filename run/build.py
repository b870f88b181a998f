"""The model a run trains: sharded, its attention chosen, planned, and its offload pool pinned.

    dtype = compute_dtype(cfg, device)    # bfloat16 on CUDA, float32 on CPU, unless --dtype says
    cfg, model, pool, planned = build_model(cfg, mc, model_dir, mesh, dp, device, dtype)
    cfg, model, backend = sharded_model(cfg, mc, model_dir, mesh, device, dtype)  # --eval-only
    log0("printed by rank 0 only")        # train.py's console lines too
    reshard(model)                        # after a forward alone (an evaluation's)
    device = compute_device(mesh)         # where an evaluation's rows go

build_model does five things, each where it is for a reason:

1. The layout (memory/choices.py's plan_for_run: memory/layouts.py's choice within what the flags
   pin, or a --layout file): first, because where the fp32 state lives (--cpu-offload) decides
   how the model is built; a run no layout fits was refused before (run/checks.py).
2. Shard the model (model/parallel.py): meta -> FSDP2 shards over dp x sp -> materialise -> read
   from model_dir, or the seeded init when there is none. Before the rest, because every later
   step hooks into its modules.
3. Ulysses attention over the mesh's sp ranks, and its kernel: picked at this rank's heads and
   the run's length (on CUDA by running each candidate once, every rank agreeing). After the
   shards, because the probe runs in the training layout.
4. The layout planned again with that kernel (flash's backward expands dk, dv; sdpa keeps no
   lse, so no attention once), the fp32 state where it now is. Before the offload pool, because
   the pool keeps each layer's tensors where this plan puts them.
5. The offload pool (checkpoint-with-offload per layer, tiled MLP) and its host blocks: every
   block a step uses is pinned now, last, because pinning takes seconds and synchronises, so no
   step should do it.

sharded_model is steps 2 and 3, what a run and --eval-only share. `cfg` is a TrainConfig
(a dataclass): this file reads its fields, hands back a dataclasses.replace of it with what was
decided (the kernel, CPU offload), and imports nothing from train.py, which runs as __main__.
With fake_mode (train.py --rehearse) all of it happens on fake tensors and nothing is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from memory.choices import plan_for_run
from memory.layouts import Candidate, why_not, write_layout
from memory.plan import describe_placements
from memory.report import plan_warnings
from model.attention import (
    BACKENDS,
    DOCUMENT_KERNELS,
    BackendChoice,
    saved_attention_bytes,
    set_backend,
    set_documents_kernel,
)
from model.attention_probe import (
    choose_documents_kernel,
    choose_kernel,
    probe_documents_kernel,
    probe_kernel,
)
from model.checkpoint_offload import apply_offload, offloaded_tensors
from model.config import ConfigError
from model.delta_rule import gated_delta_rule
from model.gdn_kernels import pick_gdn_kernel
from model.parallel import GROUP_TIMEOUT, build_sharded_model, ulysses_group
from model.ulysses import UlyssesAttention, UlyssesLinearMix
from run.adapter import lora_spec


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
    memory plan of its layout, and the offload pool with its host blocks. fake_mode: all of it
    on fake tensors, nothing loaded (train.py --rehearse). cfg comes back with what was decided
    (the kernel, and whether the fp32 state is on the host)."""
    world, sp = mesh.size(), mesh.size(1)
    # The layout first: where the fp32 state lives (--cpu-offload) decides how the model is built.
    planned = plan_for_run(cfg, mc, world, sp, dp, dtype, device.type)
    cfg = dataclasses.replace(cfg, cpu_offload=planned.options.cpu_offload)
    cfg, model, backend = sharded_model(cfg, mc, model_dir, mesh, device, dtype, fake_mode)
    # Planned again with the kernel the probe chose (flash's backward needs more than cuDNN's),
    # the fp32 state where it now is, before any host block is pinned.
    planned = plan_for_run(cfg, mc, world, sp, dp, dtype, device.type)
    if not planned.fits and not cfg.eval_only and cfg.layout == "auto":
        raise ConfigError(
            f"memory: with the {backend.name} kernel the probe chose, no layout fits "
            f"{planned.options.gpu_mem_gb:g} GB per GPU and {planned.options.host_mem_gb:.0f} "
            f"GB host per node ({why_not(Candidate(planned, 0.0))}); try --attn-backend or a "
            f"shorter --seq-len"
        )
    log_attention(cfg, mc, sp, dtype, backend, planned)
    spec = lora_spec(cfg)
    pool = apply_offload(
        model,
        min_bytes=cfg.offload_min_bytes,
        tile_mlp=cfg.tile_mlp or None,
        placements=list(planned.placements),
        # LoRA's dropout draws random numbers: the recompute must draw the same ones
        preserve_rng_state=spec is not None and spec.dropout > 0,
    )
    if any(p.on_host for p in planned.placements):
        with fake_mode or contextlib.nullcontext():
            reserve_host_blocks(pool, cfg, mc, sp, dtype, device, planned.placements)
    return cfg, model, pool, planned


def write_run_layout(cfg, planned) -> None:
    """Rank 0: the run's layout to OUT/layout.json (and --layout-out), so a run repeats exactly
    with --layout OUT/layout.json."""
    paths = [os.path.join(cfg.out, "layout.json")] + ([cfg.layout_out] if cfg.layout_out else [])
    for path in paths:
        write_layout(path, planned)


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
        lora=lora_spec(cfg),
        adapter_dir=cfg.lora_from or None,
    )
    if fake_mode is not None:
        loaded = "fake tensors, nothing loaded"
    elif load_stats:
        loaded = f"read {load_stats.bytes_read / 2**30:.2f} GiB on rank 0"
    else:
        loaded = "random init"
    log0(f"model ready in {time.perf_counter() - t0:.1f} s, {loaded}")
    group = ulysses_group(mesh)
    model.set_attention(UlyssesAttention(group))
    if mc.hybrid:  # the Gated DeltaNet layers' exchange, on the same group, and their kernel
        model.set_linear_mix(UlyssesLinearMix(group))
        model.set_delta_rule(choose_delta_rule(cfg, mc, sp=mesh.size(1), device=device))
    cfg, backend = choose_attention(cfg, mc, sp=mesh.size(1), device=device, dtype=dtype)
    return cfg, model, backend


def choose_delta_rule(cfg, mc, sp: int, device):
    """The Gated DeltaNet layers' delta rule for this rank's heads over the whole row
    (model/gdn_kernels.py: probed against the fp32 reference where there is a choice). Every
    rank must run the same kernel: where their picks differ (timings), all take ours. Collective
    where initialised."""
    shape = {"hk": mc.linear_num_key_heads // sp, "hv": mc.linear_num_value_heads // sp}
    shape |= {"dk": mc.linear_key_head_dim, "dv": mc.linear_value_head_dim}
    try:
        choice = pick_gdn_kernel(device, tokens=cfg.seq_len, request=cfg.gdn_kernel, **shape)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if dist.is_initialized():
        picks = [None] * dist.get_world_size()
        dist.all_gather_object(picks, choice.name)
        if len(set(picks)) > 1:
            log0(f"delta rule: the ranks' probes picked {sorted(set(picks))}; all take ours")
            return gated_delta_rule
    log0(choice.summary())
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's inputs and gradients, before the pool
    return choice.rule


def choose_attention(cfg, mc, sp, device, dtype) -> tuple[object, BackendChoice]:
    """(cfg, choice): pick the attention kernel for this layout by model/attention_probe.py's
    rule, each candidate run once at this rank's heads and the run's length (CUDA), every rank
    taking the same answer; cfg then names it, for the plan (flash's backward expands dk, dv).
    sdpa keeps no lse, so no attention once. Collective."""
    probe = kernel_probe(device)
    if probe is not None and dist.is_initialized():
        probe = ProbeOnEveryRank(probe, device)
    try:
        choice = choose_kernel(
            device, dtype, mc, cfg.seq_len, sp, request=cfg.attn_backend, probe=probe
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's ~8 GB of q, k, v and gradients, before the pool
    set_backend(choice.name)
    cfg = dataclasses.replace(cfg, attn_backend=choice.name)
    if choice.name == "sdpa":
        cfg = dataclasses.replace(cfg, save_attention=False)
    elif getattr(cfg, "documents", "stream") == "masked":
        choose_documents(cfg, mc, sp, device, dtype, choice.name)
    return cfg, choice


def choose_documents(cfg, mc, sp, device, dtype, backend: str) -> None:
    """--documents masked: how a row of documents runs next to kernel `backend`, chosen as the
    kernel is (model/attention_probe.py's choose_documents_kernel: on CUDA each way probed at
    this rank's shape with one-token documents among others, every rank agreeing), and pinned.
    Collective."""
    probe = None
    if kernel_probe(device) is not None:
        probe = functools.partial(probe_documents_kernel, backend=backend)
        if dist.is_initialized():
            probe = ProbeOnEveryRank(probe, device)
    try:
        way = choose_documents_kernel(device, dtype, mc, cfg.seq_len, sp, backend, probe=probe)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's row, before the pool
    set_documents_kernel(way.name)
    passed = f"; {way.why}" if way.why else ""
    log0(f"documents: {DOCUMENT_KERNELS[way.name]} ({way.name}{passed})")


def kernel_probe(device: torch.device):
    """The probe each candidate kernel is run through: probe_kernel on CUDA; none on CPU, whose
    kernels are torch's reference (a CPU run's shapes are tests' and smoke runs')."""
    return probe_kernel if device.type == "cuda" else None


class ProbeOnEveryRank:
    """A probe every rank runs, whose answer is the same on every rank: a kernel that fails on one
    rank is passed over on all (else one rank would pick flash while the others wait in cuDNN's
    collectives). The answers meet over a gloo group of their own, on the CPU, so that a rank
    whose CUDA context the kernel broke (an illegal address is sticky: every later CUDA call
    fails, NCCL's too) can still say so; then every rank stops at once with one line naming the
    kernel. Collective: every rank calls it with the same candidates, in the same order."""

    def __init__(self, probe, device: torch.device):
        self.probe, self.device = probe, device
        self.group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)

    def __call__(self, name, *shape, **kw) -> str | None:
        try:
            reason = self.probe(name, *shape, **kw)
        except Exception as e:  # a probe's own failure is its answer too
            reason = f"{type(e).__name__}: {str(e).strip()[:200]}"
        broken = reason is not None and not device_usable(self.device)
        answers = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(answers, (reason, broken), group=self.group)
        for rank, (why, broke) in enumerate(answers):
            if broke:
                stop_every_rank(
                    f"attention: probing the {name} kernel left CUDA unusable on rank {rank} "
                    f"({why}); rerun with --attn-backend naming another kernel "
                    f"({', '.join(b for b in BACKENDS if b != name)})"
                )
        failed = [(rank, why) for rank, (why, _) in enumerate(answers) if why]
        if not failed:
            return None
        rank, why = failed[0]
        return why if len(failed) == len(answers) else f"{why} (on rank {rank})"


def device_usable(device: torch.device) -> bool:
    """Whether `device` still runs work: after a sticky CUDA error (an illegal address) every
    call fails, this one included."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return (torch.ones(1, device=device) + 1).item() == 2
    except Exception:
        return False


def stop_every_rank(message: str) -> None:
    """Print `message` as this rank's one line and exit with train.py's refusal code (2) at once:
    with a broken CUDA context neither the process group's teardown nor a barrier can run."""
    rank = dist.get_rank()
    who = f" (rank {rank})" if rank else ""
    print(f"error{who}: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def log_attention(cfg, mc, sp, dtype, backend, planned) -> None:
    """Two lines: the kernel and why the one before it was passed over; the layout (where each
    layer's saved tensors wait, and why) and what a kept attention costs; then the plan's
    warnings."""
    passed = f"; {backend.why}" if backend.why else ""  # why cuDNN (say) was passed over
    log0(f"attention: {BACKENDS[backend.name]} ({backend.name}{passed})")
    if cfg.eval_only:
        log0("layout: forward only (an evaluation keeps nothing for a backward)")
        return
    kept = ""
    if planned.options.save_attention:
        padded_row = math.ceil(cfg.seq_len / sp) * sp
        size = saved_attention_bytes(
            padded_row, mc.num_attention_heads, mc.head_dim, dtype.itemsize, sp=sp
        )
        kept = f"; a kept attention is {size / 2**20:,.1f} MiB per layer per GPU"
    where = describe_placements(planned.placements, mc)
    state = "; fp32 state in host memory (CPU offload)" if planned.options.cpu_offload else ""
    log0(f"layout: {where}{state} ({planned.options.layout_why}){kept}")
    for warning in plan_warnings(planned):
        log0(f"warning: {warning}")


def reserve_host_blocks(pool, cfg, mc, sp, dtype, device, placements) -> None:
    """Pin every host block the steps will use now: pinning takes seconds and synchronises, so
    no step should do it. The blocks hold model/checkpoint_offload.py's offloaded_tensors of the
    layers' placements: the inputs, attention outs and lses they put on the host."""
    saved = offloaded_tensors(mc, cfg.seq_len, sp, dtype=dtype, placements=list(placements))
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


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters. The units that stay gathered after forward
    (the root, [norm + lm_head], the last layer) are freed by backward in training; after a
    forward alone they would stay, into the next row's forward or the next training step."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def compute_device(mesh) -> torch.device:
    """This rank's GPU, or the CPU: where the rows go (the model's shards may be on the host)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
