"""One GPU, under 6 minutes: measure each piece of a 1M-token Qwen3-8B step as training runs it,
project the 8-GPU step.

    python bench/gpu_check.py --budget-s 330 --out results.json   # one GPU: 330 s budget (expect ~3 min)
    timeout 360 python bench/gpu_check.py --budget-s 330 --out results.json 2>&1 | tee gpu_check.log
    python bench/gpu_check.py --parts attention,backends --out r.json
    python bench/gpu_check.py --device cpu --tiny --out /tmp/r.json   # tiny shapes in seconds (the test)

The step projected is this repository's at 1,048,576 tokens on 8 GPUs (dp=1, sp=8): each GPU holds
131,072 tokens outside attention and every token for 4 query heads inside it. What is timed is
what training runs: attention on the kernel train.py pins (model.attention.pick_backend +
set_backend: cuDNN where the runtime has it, else flash), attention once (apply_offload(...,
save_attention=True): the recompute replays the forward's output), MLP tiles of 16,384 rows (the
qwen3-8b-1m preset). Five parts, each in its own process on a GPU (a fresh allocator, its own peak
memory, a time limit that kills it without losing the others; --tiny runs them in one process);
the JSON is rewritten after every part, so a killed run still leaves one.

  loss       chunked cross-entropy forward + backward at the per-GPU shape, N=131,072 H=4096
             V=151,936 bf16 (bench_loss.run_case), 256-row chunks (the default and the public
             recipe's) and 1024-row chunks
  layers     Qwen3-8B decoder layers at 131,072 tokens wrapped as training wraps them (run_stack:
             offload, attention once, tiled MLP, pool reserved before step 1) at 2 and 4 layers:
             time per layer from the difference, peak growth per layer, the one-layer backward
             working set against the planner's; and the attention inside those layers (131,072
             tokens, 32 q / 8 kv heads) timed alone on the pinned kernel, to take it out again
  attention  one sp=8 rank's attention at 1,048,576 tokens, q [1, T, 4, 128], k/v [1, T, 1, 128],
             on the pinned kernel (bench_attention.run)
  backends   cuDNN against flash at 65,536 tokens, 4 query heads on 1 kv head, bf16: max absolute
             and relative differences of the output and of the q, k, v gradients
             (bench_attention.compare_backends); skipped with the reason if either cannot run
  optimizer  global-norm clipping and AdamW (fused on CUDA, as train.py) over one GPU's fp32
             shards, memory.plan.param_shapes cut as FSDP2 cuts them over 8 GPUs
A part that would overrun is shrunk (fewer layers or tokens in the stack; a shorter attention
scaled by T^2, marked `extrapolated`) or skipped with the reason recorded.

Projection, printed and in the JSON as arithmetic (attention once: each layer's forward runs again
in backward, but not its attention):
  step = L x (layer_nonattn + attention) + loss + all-to-all + optimizer
  layer_nonattn = stack time per layer - (fwd + bwd) of the 131,072-token local attention
  attention     = fwd + bwd of the sp=8 rank's attention at 1,048,576 tokens
  all-to-all    = bench_attention.exchange_volumes bytes per step / --nvlink-gbps (PROJECTED)
next to the planner's FLOPs floor with attention once (--peak-tflops x 8 GPUs), the same step
recomputing attention (+ L x fwd) and the public recipe (380 s, 56.2 GB). Not added: FSDP2
all-gathers and reduce-scatters (prefetched, overlapped with compute; their projected time is
shown for scale), the embedding, data loading. The offload copies are inside the measured layer
time. The projected peak per GPU replaces the planner's one-layer working set by the measured one,
and its loss by the measured loss (plus the last layer's kept input, out and lse).

Time on one H200 (arithmetic, not a measurement; 989 TFLOP/s dense bf16, kernels assumed at
~300-600 TFLOP/s): the parent never touches CUDA, and each part runs under a hard timeout of its
share of --budget-s plus what earlier parts left, never past the budget's deadline, so the whole
run ends by budget + the parent's start (~5 s) + the summary: 330 s -> under 6 minutes. Expected
at 330 s (shares 15/35/25/10/10%: 50/116/83/33/33 s):
  loss       ~15 s CUDA start + 2 chunk sizes x (warm-up + >= 2 s timed; 3 x 2 x 151,936 x 4096 x
             131,072 = 4.9e14 FLOPs = ~1 s a run) = ~25 s
  layers     ~15 s start + local attention (2 x 2 x 131,072^2/2 x 32 x 128 = 1.4e14 fwd, 3.5x with bwd:
             ~1.5 s, 3 runs) + stacks of 2 and 4 layers x 3 steps (1 warm-up) x ~2 s per layer =
             ~36 s + pinning 2 x (L-1) x 2.02 GiB of host blocks (~5 s) = ~65 s
  attention  ~15 s start + warm-up at 16,384 tokens + fwd + bwd at 1,048,576 (1.1e15 + 2.8e15 FLOPs:
             ~6-13 s) = ~30 s
  backends   ~15 s start + 2 x (fwd + bwd) at 65,536 tokens (4.4e12 + 1.1e13 FLOPs: < 0.1 s each)
             + comparing 4 tensors = ~20 s
  optimizer  ~15 s start + 4 fused AdamW steps over 1.02e9 fp32 parameters (~10 ms each) = ~20 s
  total ~160 s expected, 330 s at most.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Large contiguous tensors (1 GiB layer inputs, the 1M-token attention) need it; workers inherit it.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from memory.buffers import Buffer  # noqa: E402
from memory.plan import (  # noqa: E402
    GB,
    GiB,
    load_config,
    param_shapes,
    plan,
    shard_numel,
    step_flops,
)
from memory.report import PUBLIC_RECIPE  # noqa: E402

PARTS = ("loss", "layers", "attention", "backends", "optimizer")
SHARE = {
    "loss": 0.15,
    "layers": 0.35,
    "attention": 0.25,
    "backends": 0.10,
    "optimizer": 0.10,
}  # of the budget
STARTUP_S = {"cuda": 15.0, "cpu": 3.0}  # a worker's import and CUDA start, not left to the part


@dataclass(frozen=True)
class Geometry:
    """The step being checked, and the sizes each part runs at."""

    model: str
    seq_len: int
    sp: int  # = GPUs (dp=1)
    loss_chunks: tuple  # rows per chunk; the first one enters the projection
    stack_layers: tuple  # two layer counts: per-layer time from the difference
    mlp_tile: int
    steps: int
    loss_min_time_s: float
    check_tokens: int  # the cuDNN-vs-flash comparison's length

    @property
    def tokens(self) -> int:
        return self.seq_len // self.sp


FULL = Geometry(
    "qwen3-8b", 1_048_576, 8, (256, 1024), (2, 4), 16384, 2, 2.0, 65536
)  # train.py's preset tile
TINY = Geometry("tiny", 512, 2, (32, 128), (2, 3), 64, 3, 0.05, 512)


def _dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- the parts (each runs in a worker process) -----------------------------------------------
def part_loss(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """Chunked CE at the per-GPU shape through bench_loss.run_case, one run per chunk size."""
    from bench.bench_loss import run_case

    cfg, t0 = load_config(g.model), time.perf_counter()
    N, H, V = g.tokens, cfg.hidden_size, cfg.vocab_size
    flops = 3 * step_flops(cfg, N)["lm_head_fwd"]  # logits, dh, dW: the one-pass loss's products
    out = {
        "N": N,
        "H": H,
        "V": V,
        "dtype": str(_dtype(dev)).replace("torch.", ""),
        "flops": flops,
        "runs": [],
        "skipped": [],
    }
    for rows in g.loss_chunks:
        spent = time.perf_counter() - t0
        if out["runs"] and spent * 2 > limit_s:  # each run costs about what the first did
            out["skipped"].append(f"{rows}-row chunks: {spent:.0f} s of {limit_s:.0f} s spent")
            continue
        r = run_case(f"ours_{rows}", N, H, V, _dtype(dev), dev, min_time_s=g.loss_min_time_s)
        r["chunk_rows"] = rows
        if "error" not in r:
            r["tflops"] = flops / r["time_s"] / 1e12
        out["runs"].append(r)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    first = out["runs"][0]
    if "error" in first:  # run_case reports an out-of-memory as a value, not an exception
        raise RuntimeError(f"loss at N={N}: {first['error']}")
    # The projection's figures: the first chunk size (256 rows at full size).
    out.update(
        chunk_rows=first["chunk_rows"],
        time_s=first["time_s"],
        tflops=first["tflops"],
        loss_peak_rise_gb=first["peak_mem_gb"],
    )
    return out


def run_stack(
    cfg,
    tokens: int,
    layers: int,
    dev: torch.device,
    dtype: torch.dtype,
    *,
    tile: int,
    steps: int,
    warmup: int = 1,
    min_bytes: int | None = None,
    seed: int = 0,
) -> dict:
    """A stack of decoder layers the way training wraps them: apply_offload(save_attention=True,
    tile_mlp=tile), the pool reserved before the first step (L-1 layers' input, attention out and
    lse; the last layer keeps its own on the device). Forward + backward from a random gradient;
    mean step time over `steps` after `warmup`, CUDA peak memory over the parameters and inputs."""
    from bench.bench_offload import LayerStack, timed_steps
    from model.checkpoint_offload import apply_offload, remove_offload
    from model.qwen3 import rope_cos_sin

    torch.manual_seed(seed)
    cuda = dev.type == "cuda"
    with torch.device(dev):
        stack = LayerStack(cfg, layers).to(dtype)
        with torch.no_grad():
            for p in stack.parameters():  # Qwen3's init: N(0, 0.02), norms at 1
                p.normal_(0.0, cfg.initializer_range) if p.dim() == 2 else p.fill_(1.0)
        x = torch.randn(
            1, tokens, cfg.hidden_size, dtype=dtype, requires_grad=True
        )  # [1, T, hidden]
        dy = torch.randn(1, tokens, cfg.hidden_size, dtype=dtype)
        cos, sin = rope_cos_sin(cfg, torch.arange(tokens)[None], dtype)  # [1, T, head_dim]
    pool = apply_offload(stack, min_bytes=min_bytes, tile_mlp=tile, save_attention=True)
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    t0 = time.perf_counter()
    for shape, dt in (
        ((1, tokens, cfg.hidden_size), dtype),
        ((1, tokens, nh, hd), dtype),
        ((1, nh, tokens), torch.float32),
    ):
        pool.reserve(layers - 1, shape, dt, dev)  # x, out [B, T, nh, hd], lse [B, nh, T] (fp32)
    reserve_s = time.perf_counter() - t0

    def step():
        stack.zero_grad(set_to_none=True)
        x.grad = None
        stack(x, cos, sin).backward(dy)

    try:
        r = timed_steps(step, stack, x, dev, warmup, steps, pool)
        moved = pool.reset_step()
        return {
            **r,
            "d2h_mib": moved.d2h_bytes / steps / 2**20,
            "h2d_mib": moved.h2d_bytes / steps / 2**20,
            "pool_mib": moved.pool_bytes / 2**20,
            "pinned_mib": moved.pinned_bytes / 2**20,
            "host_allocs_after_reserve": moved.host_allocs,
            "reserve_s": reserve_s,
        }
    except torch.cuda.OutOfMemoryError:
        return {"step_s": None, "oom": True, "peak_gib": None, "act_gib": None}
    finally:
        remove_offload(stack)
        pool.close()
        del stack
        if cuda:
            torch.cuda.empty_cache()


def part_layers(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """Decoder-layer stacks as training runs them (run_stack: offload, attention once, tiled MLP,
    the pinned backend) and their attention alone.

    At the per-GPU tokens if the time allows (estimated from the attention alone) and memory
    does, else at half or a quarter of them, the time without attention scaled back up linearly.
    """
    from bench.bench_attention import pinned_backend
    from bench.bench_attention import run as run_attention
    from model.attention import set_backend

    cfg, t0 = load_config(g.model), time.perf_counter()
    dtype = _dtype(dev)
    esize = torch.empty((), dtype=dtype).element_size()
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    runs, skipped = {}, []
    for T in (g.tokens, g.tokens // 2, g.tokens // 4):
        last = T == g.tokens // 4  # the last resort runs even when over the estimate
        # The attention inside the stack, alone: sp=1, all heads over the local tokens, the pinned kernel.
        la = run_attention(
            T,
            1,
            model=cfg,
            device=str(dev),
            backend="pinned",
            steps=g.steps,
            time_limit_s=0.15 * (limit_s - (time.perf_counter() - t0)),
        )
        if la["backend"] is None:
            raise RuntimeError(f"local attention did not run: {la['backend_errors']}")
        la_s = (
            la["fwd_s"] + la["bwd_s"]
        )  # attention once: forward, backward (the recompute replays it)
        la.pop("exchange")
        set_backend(pinned_backend(dev, dtype, nh, nkv, hd, T))  # the stack runs what training pins
        for L in g.stack_layers:
            # Estimate: warm-up + timed steps, each L layers of about 2.5 times their attention.
            est = (1 + g.steps) * L * 2.5 * la_s + 5
            left = limit_s - (time.perf_counter() - t0)
            if est > left and (runs or not last):
                skipped.append(
                    f"{L} layers at {T:,} tokens: estimated {est:.0f} s, {left:.0f} s left"
                )
                break
            m = run_stack(
                cfg,
                T,
                L,
                dev,
                dtype,
                tile=g.mlp_tile,
                steps=g.steps,
                warmup=1,
                min_bytes=0 if g.model == "tiny" else None,
            )
            if m["oom"]:
                skipped.append(f"{L} layers at {T:,} tokens: out of memory")
                break
            runs[L] = {
                k: m.get(k)
                for k in (
                    "step_s",
                    "peak_gib",
                    "act_gib",
                    "d2h_mib",
                    "h2d_mib",
                    "pool_mib",
                    "pinned_mib",
                    "reserve_s",
                    "host_allocs_after_reserve",
                )
            }
        if runs:
            break
    if not runs:
        raise RuntimeError(f"no layer stack ran: {skipped}")
    lo, hi = min(runs), max(runs)
    if hi > lo:  # the difference leaves out what a stack pays once (its input, output, gradient)
        per_layer = (runs[hi]["step_s"] - runs[lo]["step_s"]) / (hi - lo)
        how = f"({runs[hi]['step_s']:.4f} - {runs[lo]['step_s']:.4f}) s / ({hi} - {lo}) layers"
    else:
        per_layer = runs[hi]["step_s"] / hi
        how = f"{runs[hi]['step_s']:.4f} s / {hi} layers"
    scale = g.tokens / T  # 1 unless a shorter stack had to stand in
    out = {
        "tokens": T,
        "tokens_per_gpu": g.tokens,
        "mlp_tile": g.mlp_tile,
        "save_attention": True,
        "backend": la["backend"],
        "dtype": str(_dtype(dev)).replace("torch.", ""),
        "runs": {str(L): r for L, r in runs.items()},
        "skipped": skipped,
        "per_layer_s": per_layer,
        "per_layer_how": how,
        "local_attention": la,
        "local_attention_s": la_s,
        "per_layer_nonattn_s": (per_layer - la_s) * scale,
        "per_layer_nonattn_how": f"{per_layer:.4f} - ({la['fwd_s']:.4f} + {la['bwd_s']:.4f})"
        + (f", x {scale:g} for {g.tokens:,} tokens" if scale != 1 else ""),
    }
    if (
        per_layer < la_s
    ):  # timing noise (tiny CPU shapes) or an attention slower alone than in the stack
        out["per_layer_nonattn_note"] = (
            "negative: the attention alone took longer than a whole layer"
        )
    out["working_set"] = _working_set(cfg, T, g.mlp_tile, runs, esize)
    return out


def _working_set(cfg, tokens: int, mlp_tile: int, runs: dict, esize: int) -> dict:
    """Measured one-layer backward working set against memory.plan's layer working set.

    Measured: the stack's peak over its parameters and inputs (bench_offload's act_gib) at the
    most layers, less the stack's output (held by the benchmark through backward) and the bf16
    gradients of layers 2..L-1: the peak comes in layer 1's backward, the last one with a next
    input to prefetch (layer 0's), while the layers after it hold their gradients; the plan
    counts one layer's own. Planned: layer_working_set at sp=1 and the same tokens, less FSDP2's
    fp32 reduce-scatter input (no FSDP2 here) and the RoPE tables (in the benchmark's base).
    """
    p = plan(
        cfg,
        tokens,
        gpus=1,
        sp=1,
        offload=True,
        tiled_mlp=True,
        mlp_tile=mlp_tile,
        compute_bytes=esize,
        save_attention=True,
    )
    d = p.layer.working
    grads = esize * sum(
        math.prod(s) for k, s in param_shapes(cfg).items() if k.startswith("model.layers.0.")
    )
    less = {
        "fp32 reduce-scatter input": d.get(Buffer.REDUCE_SCATTER_INPUT, 0),
        "gradient shards": d.get(Buffer.GRAD_SHARDS, 0),
        "RoPE cos and sin": d.get(Buffer.ROPE, 0),
    }
    planned = p.layer.working_bytes - sum(less.values())
    out = {
        "planned_gb": planned / GB,
        "plan_layer_working_set_gb": p.layer.working_bytes / GB,
        "plan_layer_peak": p.layer.name,
        "planned_less_gb": {k: v / GB for k, v in less.items()},
        "layer_grads_gb": grads / GB,
    }
    L = max(int(k) for k in runs)
    act = runs[L]["act_gib"]
    if act is None:  # CPU: bench_offload measures no memory there
        out.update(
            measured_gb=None,
            ratio=None,
            within_15pct=None,
            reason="needs CUDA memory statistics (torch.cuda.max_memory_allocated)",
        )
        return out
    stack_out, held = tokens * cfg.hidden_size * esize, max(L - 2, 0)
    measured = act * GiB - held * grads - stack_out
    out.update(
        measured_gb=measured / GB,
        ratio=measured / planned,
        within_15pct=abs(measured / planned - 1) <= 0.15,
        measured_how=f"{act * GiB / GB:.3f} GB over params and inputs at {L} layers - "
        f"{held} x {grads / GB:.3f} GB later layers' grads - "
        f"{stack_out / GB:.3f} GB stack output",
    )
    if L < 2:
        out["note"] = "one layer only: no prefetch in its backward, so below the plan's moment"
    if len(runs) > 1:  # offload keeps the peak flat: only gradients should grow with layers
        lo = min(int(k) for k in runs)
        out["peak_growth_per_layer_gb"] = (act - runs[lo]["act_gib"]) * GiB / (L - lo) / GB
    return out


def part_attention(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """One sp rank's attention over the whole sequence (bench_attention.run) on the kernel
    training pins (pick_backend + set_backend: cuDNN where available, else flash)."""
    from bench.bench_attention import run as run_attention

    r = run_attention(
        g.seq_len,
        g.sp,
        model=g.model,
        device=str(dev),
        backend="pinned",
        steps=1,
        time_limit_s=limit_s,
    )
    if r["backend"] is None:
        raise RuntimeError(f"no attention backend ran: {r['backend_errors']}")
    return r


def part_backends(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """cuDNN against flash (CPU: cpu_flash against math) on one sp rank's heads of the step
    (4 query heads on 1 kv head for Qwen3-8B at sp=8) over g.check_tokens tokens: outputs and
    q/k/v gradients (bench_attention.compare_backends). A backend that cannot run is skipped."""
    from bench.bench_attention import compare_backends

    cfg = load_config(g.model)
    hq, hkv = cfg.num_attention_heads // g.sp, max(cfg.num_key_value_heads // g.sp, 1)
    return compare_backends(
        g.check_tokens, hq, hkv, cfg.head_dim, device=str(dev), dtype=_dtype(dev)
    )


def part_optimizer(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """Clip by the global norm and AdamW over one GPU's fp32 shards (plain tensors of the shard
    shapes; FSDP2's DTensor dispatch is not in the figure)."""
    cfg = load_config(g.model)
    shapes = [(math.ceil(s[0] / g.sp),) + tuple(s[1:]) for s in param_shapes(cfg).values()]
    n = sum(shard_numel(s, g.sp) for s in param_shapes(cfg).values())
    gen = torch.Generator(device=dev).manual_seed(0)
    # FSDP2's dim-0 shards of every parameter (rank 0's, which has no short last shard).
    params = [torch.randn(s, generator=gen, device=dev).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=dev)
    fused = {"fused": True} if dev.type == "cuda" else {"foreach": True}  # as train.py
    opt = torch.optim.AdamW(params, lr=1e-5, **fused)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    step()  # allocates the AdamW states
    _sync(dev)
    times = []
    while len(times) < 3:
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return {
        "params_per_gpu": n,
        "tensors": len(params),
        "state_gb": 4 * n * 4 / GB,
        "time_s": min(times),
        "optimizer": "AdamW " + next(iter(fused)),
    }


# ---- worker and driver ----------------------------------------------------------------------
def _worker(names: list, g: Geometry, device: str, limit_s: float, out_dir: str) -> None:
    """Run parts in this process, one after another; write each one's dict as <out_dir>/<part>.json."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:  # set_device refuses a bare "cuda"
        torch.cuda.set_device(dev)
    t_start = time.perf_counter()
    for name in names:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)  # each part's own peak
        t0 = time.perf_counter()
        fn = {
            "loss": part_loss,
            "layers": part_layers,
            "attention": part_attention,
            "backends": part_backends,
            "optimizer": part_optimizer,
        }[name]
        # Several parts in one process (--tiny) split its limit by their shares.
        r = fn(
            g,
            dev,
            limit_s * SHARE[name] / sum(SHARE[n] for n in names)
            if len(names) > 1
            else limit_s - (time.perf_counter() - t_start),
        )
        r.update(
            status="ok",
            wall_s=time.perf_counter() - t0,
            torch=torch.__version__,
            device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        )
        if dev.type == "cuda":
            r.update(
                process_peak_gb=torch.cuda.max_memory_allocated(dev) / GB,
                process_peak_reserved_gb=torch.cuda.max_memory_reserved(dev) / GB,
                process_peak_kind="torch.cuda.max_memory_allocated during the part",
            )
        else:  # Linux ru_maxrss is in KiB: the whole process so far, torch included
            r.update(
                process_peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
                process_peak_kind="process peak RSS (CPU: the process so far, torch included)",
            )
        Path(out_dir, f"{name}.json").write_text(json.dumps(r, indent=1))


def _run_group(names: list, g: Geometry, args, timeout: float, tmp: Path) -> dict:
    """Parts in one fresh process with a time limit; a failure becomes a status, not an exception.

    On a GPU every part gets its own process (its own allocator and peak); --tiny runs all parts
    in one, to pay the import once.
    """
    for n in names:  # a stale result from an earlier run must not pass for this one's
        (tmp / f"{n}.json").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        ",".join(names),
        "--device",
        args.device,
        "--worker-out",
        str(tmp),
        "--time-limit",
        f"{timeout - STARTUP_S[_kind(args)]:.1f}",
    ]
    cmd += ["--tiny"] if args.tiny else []
    t0 = time.perf_counter()
    status, tail = None, ""
    try:  # subprocess.run kills the worker at the timeout; its finished parts are on disk
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [
            ln for ln in (p.stderr or p.stdout).strip().splitlines() if not ln.startswith("USDT")
        ]
        if p.returncode != 0:
            status = f"failed (exit {p.returncode}): {(lines or [''])[-1][:300]}"
            tail = "\n".join(lines[-15:])
    except subprocess.TimeoutExpired as e:
        status = f"timeout after {timeout:.0f} s"
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        tail = err[-600:]
    wall = time.perf_counter() - t0
    out = {}
    for n in names:
        f = tmp / f"{n}.json"
        if f.exists():
            out[n] = json.loads(f.read_text())
            out[n]["process_s"] = wall if len(names) == 1 else out[n]["wall_s"]
        else:  # the first part without a result is the one that failed; the rest never started
            out[n] = {
                "status": status or "failed: no result written",
                "wall_s": wall,
                "stderr_tail": tail,
            }
            status, tail = "not reached: the process stopped at an earlier part", ""
    return out


def _kind(args) -> str:
    return "cuda" if args.device.startswith("cuda") else "cpu"


def project(
    res: dict, g: Geometry, nvlink_gbps: float, peak_tflops: float, compute_bytes: int = 2
) -> dict:
    """The 8-GPU step time (and peak per GPU) assembled from the parts, with its arithmetic."""
    cfg = load_config(g.model)
    L, gpus = cfg.num_hidden_layers, g.sp
    # What training runs: attention once (the planner's no_attn_recompute FLOPs), the preset's tiles.
    p = plan(
        cfg,
        g.seq_len,
        gpus=gpus,
        sp=g.sp,
        tflops=peak_tflops,
        mlp_tile=g.mlp_tile,
        compute_bytes=compute_bytes,
        save_attention=True,
    )
    out = {
        "model": g.model,
        "seq_len": g.seq_len,
        "gpus": gpus,
        "sp": g.sp,
        "tokens_per_gpu": g.tokens,
        "save_attention": True,
        "planner_flops": p.flops.step,
        "planner_floor_s": p.flops.step_time_s,
        "planner_floor_how": f"{p.flops.step:.4g} FLOPs (attention once) / ({gpus} x {peak_tflops:g} TFLOP/s)",
        "planner_peak_gb": p.total / GB,
        "planner_host_gb_per_node": p.host.per_node / GB,
        "public_recipe": dict(PUBLIC_RECIPE),
        "peak_tflops": peak_tflops,
    }
    missing = [
        k
        for k in ("loss", "layers", "attention", "optimizer")
        if res.get(k, {}).get("status") != "ok"
    ]
    if missing:
        out.update(status=f"not projected: part(s) {', '.join(missing)} did not run", step_s=None)
        return out
    lay, att, loss, opt = (res[k] for k in ("layers", "attention", "loss", "optimizer"))
    # Attention once: the recompute replays the forward's output, so attention is fwd + bwd per layer
    # (without it, checkpointing would run the forward twice: 2 x fwd + bwd, shown for comparison).
    t = {
        "layers": L,
        "layer_nonattn_s": lay["per_layer_nonattn_s"],
        "attention_s": att["fwd_s"] + att["bwd_s"],
        "loss_s": loss["time_s"],
        "a2a_s": att["exchange"]["projected_s_per_step"],
        "optimizer_s": opt["time_s"],
    }
    layer_s = t["layer_nonattn_s"] + t["attention_s"]
    # The all-to-alls sit on the critical path (attention waits for them): added, not overlapped.
    step = L * layer_s + t["loss_s"] + t["a2a_s"] + t["optimizer_s"]
    # FSDP2 traffic per GPU: bf16 all-gather in forward and again in backward, fp32 reduce-scatter.
    n, f = cfg.num_params(), (gpus - 1) / gpus
    fsdp_bytes = (2 * n * 2 + n * 4) * f
    out.update(
        status="ok",
        terms=t,
        layer_s=layer_s,
        step_s=step,
        a2a_s=t["a2a_s"],
        how=(
            f"{L} x ({t['layer_nonattn_s']:.4f} + {t['attention_s']:.4f}) + {t['loss_s']:.4f} + "
            f"{t['a2a_s']:.4f} + {t['optimizer_s']:.4f} = {step:.4g} s"
        ),
        legend="layers x (layer without attention, per layer + attention once: fwd + bwd) + loss "
        "+ all-to-all (projected) + clip and AdamW",
        attention_how=f"{att['fwd_s']:.4f} + {att['bwd_s']:.4f} (forward, backward: attention once, "
        f"on {att['backend']}"
        + (
            f"; measured at {att['measured_tokens']:,} tokens, scaled by T^2)"
            if att.get("extrapolated")
            else ")"
        ),
        attention_share=L * t["attention_s"] / step,
        # For scale: the same step recomputing attention (one more forward per layer).
        step_s_attention_recomputed=step + L * att["fwd_s"],
        implied_mfu=p.flops.step / (gpus * peak_tflops * 1e12 * step),
        vs_public_recipe=PUBLIC_RECIPE["step_time_s"] / step,
        fsdp_collectives_s=fsdp_bytes / (nvlink_gbps * GB),
        fsdp_collectives_how=f"(2 x bf16 all-gather + fp32 reduce-scatter) x {n:.3g} params x "
        f"{gpus - 1}/{gpus} / {nvlink_gbps:g} GB/s: overlapped, not added",
        backend_in_training=att["backend"],
        backend_ran=att.get("backend_ran"),
    )
    ws = lay["working_set"]
    if ws.get("measured_gb") is None:
        out.update(peak_gb=None, peak_reason=ws.get("reason"))
        return out
    # The plan's peak, its one-layer working set corrected by measured - planned at the stack's
    # shape, its loss replaced by the measured loss's rise over its inputs (plus the last layer's
    # input, attention out and lse, which attention once keeps on the device meanwhile).
    kept = p.loss.working.get(Buffer.LAST_LAYER_KEPT, 0)
    layer_phase = p.layer.bytes + (ws["measured_gb"] - ws["planned_gb"]) * GB
    loss_phase = p.loss.gathered_bytes + loss["loss_peak_rise_gb"] * GB + kept
    peak = p.held.bytes + max(layer_phase, loss_phase)
    out.update(
        peak_gb=peak / GB,
        peak_how=(
            f"held {p.held.bytes / GB:.2f} + "
            f"max(layer: {p.layer.gathered_bytes / GB:.2f} gathered + "
            f"{p.layer.working_bytes / GB:.2f} planned working set + ({ws['measured_gb'] - ws['planned_gb']:.2f} "
            f"measured - planned), loss: {p.loss.gathered_bytes / GB:.2f} gathered + "
            f"{loss['loss_peak_rise_gb']:.2f} measured + {kept / GB:.2f} last layer kept) = {peak / GB:.2f} GB"
        ),
    )
    return out


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def summary(res: dict) -> str:
    """The printout: one block per part, the exchange table, the projection."""
    from bench.bench_attention import format_compare, format_exchange, format_result

    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    out = [
        f"gpu_check on {res['device']}, torch {res['torch']}"
        + (f", CUDA {res['cuda']}" if res.get("cuda") else "")
        + f": {res['model']}, {res['seq_len']:,} tokens over {res['sp']} GPUs (sp={res['sp']}), "
        f"{res['seq_len'] // res['sp']:,} tokens per GPU; budget {res['budget_s']:.0f} s, took "
        f"{res['wall_s']:.0f} s",
        f"{'part':<11}{'status':<8}{'wall s':>8}{'peak GB':>9}   "
        f"(peak: {res.get('process_peak_kind') or '-'})",
    ]
    for k in PARTS:
        r = res.get(k, {"status": "not run"})
        ok = r["status"] == "ok"
        out.append(
            f"{k:<11}{'ok' if ok else '':<8}{f(r.get('process_s', r.get('wall_s')), '.1f'):>8}"
            f"{f(r.get('process_peak_gb'), '.2f'):>9}" + ("" if ok else f"   {r['status']}")
        )
    lo = res.get("loss", {})
    if lo.get("status") == "ok":
        out.append(
            f"\nloss: N={lo['N']:,} H={lo['H']} V={lo['V']:,} {lo['dtype']}, forward + backward"
        )
        for r in lo["runs"]:
            out.append(
                f"  {r['chunk_rows']:>5}-row chunks: "
                + (
                    r["error"]
                    if "error" in r
                    else f"{r['time_s']:.4f} s, {r['tflops']:.1f} TFLOP/s, peak {r['peak_mem_gb']:.2f} GB "
                    f"over inputs"
                )
            )
        out += [f"  skipped {s}" for s in lo["skipped"]]
    la = res.get("layers", {})
    if la.get("status") == "ok":
        out.append(
            f"\nlayers: {la['tokens']:,} tokens, offload + attention once + tiled MLP "
            f"({la['mlp_tile']} rows), {la['backend']} attention, {la['dtype']}"
        )
        for L, r in la["runs"].items():
            out.append(
                f"  {L} layers: step {r['step_s']:.4f} s, peak {f(r['peak_gib'], '.2f')} GiB, "
                f"{f(r['act_gib'], '.2f')} GiB over params and inputs"
            )
        out += [f"  skipped {s}" for s in la["skipped"]]
        a = la["local_attention"]
        out += [
            f"  per layer {la['per_layer_s']:.4f} s = {la['per_layer_how']}",
            f"  its attention alone ({a['backend_ran']}): fwd {a['fwd_s']:.4f} s, bwd {a['bwd_s']:.4f} s;"
            f" without attention {la['per_layer_nonattn_s']:.4f} s = {la['per_layer_nonattn_how']}",
        ]
        ws = la["working_set"]
        if ws.get("measured_gb") is None:
            out.append(
                f"  one-layer working set: memory_plan {ws['planned_gb']:.3f} GB; measured: "
                f"- ({ws['reason']})"
            )
        else:
            out.append(
                f"  one-layer backward working set: measured {ws['measured_gb']:.2f} GB, "
                f"memory_plan {ws['planned_gb']:.2f} GB: ratio {ws['ratio']:.3f} "
                f"(within 15%: {ws['within_15pct']})"
            )
            out.append(f"    measured = {ws['measured_how']}")
            if "peak_growth_per_layer_gb" in ws:
                out.append(
                    f"    peak growth per layer {ws['peak_growth_per_layer_gb']:.3f} GB "
                    f"(one layer's grads: {ws['layer_grads_gb']:.3f} GB)"
                )
    at = res.get("attention", {})
    if at.get("status") == "ok":
        out += ["", "attention: " + format_result(at)]
    elif "exchange" in res:
        out += ["", format_exchange(res["exchange"])]
    bk = res.get("backends", {})
    if bk.get("status") == "ok":
        out += ["", "backends: " + format_compare(bk)]
    op = res.get("optimizer", {})
    if op.get("status") == "ok":
        out.append(
            f"\noptimizer: clip + {op['optimizer']} over {op['params_per_gpu']:,} fp32 parameters "
            f"({op['tensors']} tensors, {op['state_gb']:.2f} GB with grads and states): "
            f"{op['time_s']:.4f} s"
        )
    p = res["projection"]
    if res.get("tiny"):
        out.append("\n(tiny shapes: these figures check the plumbing end to end, not any hardware)")
    out.append(
        f"\nPROJECTED step, {p['seq_len']:,} tokens on {p['gpus']} GPUs like this one "
        f"(a projection from one GPU, not a measurement):"
    )
    if p["status"] != "ok":
        out.append(f"  {p['status']}")
    else:
        out += [
            f"  {p['how']}",
            f"  ({p['legend']})",
            f"  attention {p['attention_how']}; "
            f"attention is {100 * p['attention_share']:.0f}% of the step",
            f"  recomputing attention instead (one more forward per layer): "
            f"{p['step_s_attention_recomputed']:.1f} s",
            f"  FSDP2 collectives {p['fsdp_collectives_s']:.3f} s ({p['fsdp_collectives_how']})",
            f"  implied MFU {100 * p['implied_mfu']:.1f}% of {p['peak_tflops']:g} TFLOP/s",
        ]
        if p.get("peak_gb") is not None:
            out.append(f"  peak per GPU: {p['peak_how']}")
    r = p["public_recipe"]
    out += [
        f"  memory_plan floor: {p['planner_floor_how']} = {p['planner_floor_s']:.1f} s; "
        f"planned peak {p['planner_peak_gb']:.1f} GB per GPU",
        f"  public recipe ({r['gpus']}, {r['seq_len']:,} tokens): {r['step_time_s']:.0f} s per step, "
        f"{r['peak_gb_per_gpu']} GB per GPU"
        + (
            f"; projected here: {p['step_s']:.1f} s (recipe / projected = {p['vs_public_recipe']:.2f})"
            + (f", {p['peak_gb']:.1f} GB" if p.get("peak_gb") is not None else "")
            if p.get("step_s")
            else ""
        ),
    ]
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny preset, 512 tokens over sp=2 (CPU, tests)"
    )
    ap.add_argument(
        "--out", default="gpu_check.json", help="the JSON of results (rewritten per part)"
    )
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument(
        "--budget-s", type=float, default=None, help="whole run (default 330; tiny 120)"
    )
    ap.add_argument(
        "--nvlink-gbps",
        type=float,
        default=450.0,
        help="GB/s per direction per GPU for projected collectives (H100/H200 NVLink 4)",
    )
    ap.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM)"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-limit", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    g = TINY if a.tiny else FULL
    if a.worker:
        _worker(a.worker.split(","), g, a.device, a.time_limit, a.worker_out)
        return {}
    if (
        _kind(a) == "cuda" and not torch.cuda.is_available()
    ):  # asks the driver; no CUDA context here
        ap.error("no CUDA device here: use --device cpu --tiny")
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known {', '.join(PARTS)}")
    budget = a.budget_s or (120.0 if a.tiny else 330.0)
    t0 = time.perf_counter()
    deadline = t0 + budget
    from bench.bench_attention import exchange_volumes

    esize = 2 if _kind(a) == "cuda" else 4  # bf16 on a GPU, fp32 on CPU
    res = {
        "device": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tiny": a.tiny,
        **asdict(g),
        "budget_s": budget,
        "nvlink_gbps": a.nvlink_gbps,
        "argv": sys.argv[1:],
        "exchange": exchange_volumes(
            load_config(g.model), g.seq_len, g.sp, bytes_per_elem=esize, nvlink_gbps=a.nvlink_gbps
        ),
    }
    banked = 0.0
    tmp = Path(a.out).resolve().parent / f".{Path(a.out).name}.parts"
    tmp.mkdir(parents=True, exist_ok=True)
    for name in PARTS:
        if name not in parts:
            res[name] = {"status": "not requested"}
    todo = [p for p in PARTS if p in parts]
    groups = [todo] if a.tiny and todo else [[p] for p in todo]
    for group in groups:
        # Each group gets its share of the budget plus what earlier groups left unused.
        share = sum(SHARE[n] for n in group) * budget
        timeout = min(share + banked, deadline - time.perf_counter())
        label = "+".join(group)
        if timeout < 2 * STARTUP_S[_kind(a)]:
            for n in group:
                res[n] = {
                    "status": f"skipped: {max(timeout, 0):.0f} s left of the {budget:.0f} s budget"
                }
        else:
            print(f"[gpu_check] {label}: running (limit {timeout:.0f} s)", flush=True)
            t_part = time.perf_counter()
            res.update(_run_group(group, g, a, timeout, tmp))
            used = time.perf_counter() - t_part
            banked = max(0.0, share + banked - used)
            print(
                f"[gpu_check] {label}: "
                + ", ".join(res[n]["status"] for n in group)
                + f" in {used:.1f} s",
                flush=True,
            )
        for n in group:  # the parent never touches CUDA: the device name comes from a worker
            for k in ("device", "process_peak_kind"):
                res[k] = res.get(k) or res[n].get(k)
        # Rewritten after every group, so an outer timeout still leaves the parts done so far.
        res["wall_s"] = time.perf_counter() - t0
        res["projection"] = project(res, g, a.nvlink_gbps, a.peak_tflops, esize)
        _write(a.out, res)
    res["device"] = res["device"] or ("cpu" if _kind(a) == "cpu" else "cuda (no part ran)")
    res["wall_s"] = time.perf_counter() - t0
    res["projection"] = project(res, g, a.nvlink_gbps, a.peak_tflops, esize)
    _write(a.out, res)
    for f in tmp.glob("*.json"):
        f.unlink()
    tmp.rmdir()
    print(summary(res))
    print(f"\nwrote {a.out}")
    return res


if __name__ == "__main__":
    main()
