"""One GPU, under 8 minutes: the pieces of a 1M-token Qwen3-8B step, timed as training runs them
(1,048,576 tokens over 8 GPUs at sp=8, attention once, 16,384-row MLP tiles, the kernel train.py
pins), and the 8-GPU step projected from them; what only a GPU shows besides: train.py's backend
probe and its fallback, memory outside torch's allocator, attention past 2^31 elements, and a
train.py --cpu-offload run; and Qwen3.5-9B's own pieces at the same row and sp: its delta rule on
each kernel, attention at head_dim 256, one full-attention layer. docs/one-gpu.md lists the parts
and the sum.

    timeout 480 python bench/gpu_check.py --budget-s 420 --out gpu_check.json   # ~4 min expected
    python bench/gpu_check.py --parts attention,backends --out r.json
    python bench/gpu_check.py --device cpu --tiny --out /tmp/r.json    # tiny shapes, in seconds

Each part runs in a fresh process (its own allocator and peak; --tiny: all in one) under its share
of --budget-s plus what earlier parts left, and the JSON is rewritten after each. A part short of
time runs smaller (one layer stack, not two; the attention at a shorter length scaled by T^2) or
is skipped with the reason. Each part records its peak allocated and reserved memory and the
device memory outside torch's allocator (the CUDA context). Projected, not measured: step =
layers x (layer without attention + attention fwd + bwd) + loss + all-to-all
(bench_attention.exchange_volumes at --nvlink-gbps) + optimizer, memory/steptime.py's
MeasuredParts.step_s; the peak per GPU is the planner's with the measured one-layer working set
and loss.
"""

import argparse
import functools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

# train.py's allocator settings (expandable segments, threaded pinning); workers inherit them.
from run.allocator import set_allocator_settings  # imports no torch

set_allocator_settings()

import torch

from bench import bench_attention, bench_loss, bench_offload
from bench.fresh_process import in_fresh_process
from bench.table import figures, table
from bench.timer import measure
from memory.buffers import Buffer, attention_workspace
from memory.model_size import gdn_flops, param_shapes, shard_numel, step_flops
from memory.plan import plan
from memory.report import PUBLIC_RECIPE
from memory.steptime import documents_flops, measured_parts, pinned_gbps
from model.attention import attention, set_backend, torch_cudnn_gate
from model.attention_probe import (
    PROBE_TOLERANCE,
    choose_documents_kernel,
    choose_kernel,
    probe_kernel,
    rank_attention_shape,
    training_layout,
)
from model.config import load_config
from model.delta_rule import gated_delta_rule
from model.gdn_kernels import candidate_rules, rule_inputs
from model.gdn_kernels import probe as probe_gdn

ROOT = Path(__file__).resolve().parents[1]
GB, GiB = 1e9, 2**30
# backends probes cuDNN and flash at the sp=8 rank's full 1M-token shape, as train.py does
SHARES = {"loss": 0.13, "layers": 0.27, "attention": 0.15, "backends": 0.13, "optimizer": 0.07}
# documents last, on the ~40% of the budget the others are expected to leave (~3 of 5.5 minutes)
SHARES.update(int32=0.10, cpu_offload=0.15, documents=0.05)
# Qwen3.5-9B's: its delta rule on each kernel (fla's first call compiles its Triton kernels),
# attention at head_dim 256, one attention layer
SHARES.update(gdn=0.12, attention_hd256=0.12, hybrid_layer=0.06)
ATTN_TFLOPS = 300.0  # a floor for bf16 causal attention on H100/H200, for the int32 part's estimate
STARTUP_S = {"cuda": 15.0, "cpu": 3.0}  # a fresh process's imports and CUDA start
PART_COLUMNS = {"part": "", "status": "", "process_s": ".1f", "process_peak_gb": ".2f"}


@dataclass(frozen=True)
class Geometry:
    """The step checked, and the sizes the parts run at."""

    model: str
    seq_len: int
    sp: int  # = GPUs (dp=1)
    loss_chunks: tuple  # rows per chunk; the first enters the projection
    stack_layers: tuple  # two layer counts: the time per layer from their difference
    mlp_tile: int  # the qwen3-8b-1m preset's
    steps: int
    loss_min_time_s: float
    check_tokens: int  # cuDNN against flash
    int32_tokens: int  # sp=1 heads: q past 2^31 elements at the full size
    offload_run: tuple  # train.py --cpu-offload: model, tokens, steps
    documents: tuple  # rows of documents: how many long ones, how many short ones
    mixed: tuple  # a row of many short documents and one long one: how many short, its length
    hybrid: str = "qwen3.5-9b"  # the Gated DeltaNet parts' model, at seq_len over sp

    @property
    def tokens(self) -> int:
        return self.seq_len // self.sp


FULL = Geometry(
    "qwen3-8b",
    1_048_576,
    8,
    (256, 1024, 4096),
    (2, 4),
    16384,
    2,
    2.0,
    65536,
    532_480,
    ("qwen3-0.6b", 65_536, 2),
    (11, 10_000),  # eleven ~95K-token books; 10,000 short documents (chats)
    (5_000, 32_768),  # 5,000 chats and one 32K-token document: flash's grid of the longest
)
TINY = Geometry(
    "tiny",
    512,
    2,
    (32, 128, 256),
    (2, 3),
    64,
    3,
    0.05,
    512,
    512,
    ("tiny", 512, 2),
    (11, 100),
    (50, 128),
    "qwen3.5-tiny",
)


def _dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def part_loss(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """Chunked cross-entropy forward + backward at the per-GPU shape, one run per chunk size."""
    cfg, t0 = load_config(g.model), time.perf_counter()
    N, H, V = g.tokens, cfg.hidden_size, cfg.vocab_size
    flops = 3 * step_flops(cfg, N)["lm_head_fwd"]  # logits, dh, dW
    out = {"N": N, "H": H, "V": V, "flops": flops, "runs": [], "skipped": []}
    for rows in g.loss_chunks:
        spent = time.perf_counter() - t0
        if out["runs"] and 2 * spent > limit_s:  # each run costs about what the first did
            out["skipped"].append(f"{rows}-row chunks: {spent:.0f} s of {limit_s:.0f} s spent")
            continue
        r = bench_loss.run_case(f"ours_{rows}", N, H, V, _dtype(dev), dev, 1, g.loss_min_time_s)
        r["chunk_rows"] = rows
        if "error" not in r:
            r["tflops"] = flops / r["time_s"] / 1e12
        out["runs"].append(r)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    first = out["runs"][0]
    if "error" in first:  # run_case returns an out-of-memory as a value
        raise RuntimeError(f"loss at N={N}: {first['error']}")
    out.update(time_s=first["time_s"], tflops=first["tflops"])
    return {**out, "loss_peak_rise_gb": first["peak_mem_gb"]}


def part_layers(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """Layer stacks at the per-GPU tokens as training wraps them, and their attention alone; the
    larger stack is skipped if its estimate (a layer ~2.5x its attention) would overrun."""
    cfg, t0, dtype = load_config(g.model), time.perf_counter(), _dtype(dev)
    T, heads = g.tokens, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    kw = {"model": cfg, "device": str(dev), "steps": g.steps, "limit_s": 0.15 * limit_s}
    la = bench_attention.run(T, 1, **kw)  # sp=1: every head over the local tokens
    if la["backend"] is None:
        raise RuntimeError(f"local attention did not run: {la['backend_errors']}")
    la_s = la["fwd_s"] + la["bwd_s"]  # attention once: the recompute replays its output
    pinned = bench_attention.pinned_backend(dev, dtype, *heads, T)
    set_backend(pinned)  # what training pins
    runs, skipped = {}, []
    for L in g.stack_layers:
        estimate, left = (1 + g.steps) * L * 2.5 * la_s, limit_s - (time.perf_counter() - t0)
        if runs and estimate > left:
            skipped.append(f"{L} layers: estimated {estimate:.0f} s, {left:.0f} s left")
            continue
        stack, inputs = bench_offload.build_stack(cfg, L, T, dev, dtype)
        mode = (stack, inputs, "offload_tiled", g.steps, 1, g.mlp_tile)  # 1 warm-up step
        runs[L] = bench_offload.measure_mode(*mode, save_attention=True)
        del stack, inputs
        if runs[L]["oom"]:
            raise RuntimeError(f"{L} layers at {T:,} tokens: out of memory")
        # the pool was reserved before the warm-up: nothing allocated since
        runs[L]["host_allocs_after_reserve"] = runs[L].pop("host_allocs_after_warmup")
    lo, hi = min(runs), max(runs)
    if hi > lo:  # the difference leaves out what a stack pays once (input, output, gradients)
        per_layer = (runs[hi]["step_s"] - runs[lo]["step_s"]) / (hi - lo)
    else:
        per_layer = runs[hi]["step_s"] / hi
    by_layers = {str(L): r for L, r in runs.items()}
    return {
        "tokens": T,
        "mlp_tile": g.mlp_tile,
        "backend": la["backend"],
        "runs": by_layers,
        "pin_gbps": pinned_gbps({"runs": by_layers}),  # the dry run's --calibration takes it
        "skipped": skipped,
        "per_layer_s": per_layer,
        "local_attention": la,
        "local_attention_s": la_s,
        "per_layer_nonattn_s": per_layer - la_s,
        "working_set": _working_set(cfg, T, g.mlp_tile, runs, dtype.itemsize, pinned),
    }


def _working_set(cfg, tokens: int, tile: int, runs: dict, esize: int, backend: str) -> dict:
    """The one-layer backward working set, measured against the planner's layer working set.

    Measured: the peak over parameters and inputs at the most layers, less the stack's output
    (held through backward) and the gradients of layers 2..L-1: the peak comes in layer 1's
    backward (the last with an input to prefetch) while the layers after it hold gradients.
    Planned: at sp=1 and these tokens on `backend` (flash: dk, dv expanded), less FSDP2's terms
    and the RoPE tables (in the base)."""
    kw = dict(mlp_tile=tile, compute_bytes=esize, save_attention=True, attn_backend=backend)
    p = plan(cfg, tokens, gpus=1, sp=1, **kw)
    less = (Buffer.REDUCE_SCATTER_INPUT, Buffer.GRAD_SHARDS, Buffer.ROPE)
    planned = p.layer.working_bytes - sum(p.layer.working.get(k, 0) for k in less)
    layer0 = [s for k, s in param_shapes(cfg).items() if k.startswith("model.layers.0.")]
    grads = esize * sum(math.prod(s) for s in layer0)
    out = {"planned_gb": planned / GB, "layer_grads_gb": grads / GB, "measured_gb": None}
    # The attention kernel's own workspace, by name, and the moment the plan puts the layer's
    # peak at: cuDNN's workspace is projected at flash's size; a measured working set above the
    # plan while the plan's peak is the MLP's says attention's backward (and cuDNN's workspace)
    # is the real peak.
    term = attention_workspace(backend)
    workspace = max(m.working.get(term, 0) for m in p.moments)
    out["attention_workspace"] = {"term": term.value, "planned_gb": workspace / GB}
    out["planned_peak_moment"] = p.layer.name
    L, lo = max(runs), min(runs)
    act = runs[L]["act_gib"]
    if act is None:
        return {**out, "reason": "needs CUDA memory statistics"}
    measured = act * GiB - max(L - 2, 0) * grads - tokens * cfg.hidden_size * esize
    out.update(measured_gb=measured / GB, ratio=measured / planned)
    out["within_15pct"] = abs(measured / planned - 1) <= 0.15
    if L > lo:  # offload keeps the peak flat: only the gradients should grow with layers
        out["peak_growth_per_layer_gb"] = (act - runs[lo]["act_gib"]) * GiB / (L - lo) / GB
    return out


def part_attention(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """One sp rank's attention over the whole sequence on the pinned kernel."""
    r = bench_attention.run(g.seq_len, g.sp, model=g.model, device=str(dev), limit_s=limit_s)
    if r["backend"] is None:
        raise RuntimeError(f"no attention backend ran: {r['backend_errors']}")
    return r


def recorded_probe(answers: dict):
    """probe_kernel for choose_kernel, each kernel run once: its answer (None, or why not) is kept
    in answers[name] and reused."""

    def probe(name, *shape, tokens=None):
        if name not in answers:
            answers[name] = probe_kernel(name, *shape, tokens=tokens)
        return answers[name]

    return probe


def part_backends(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """train.py's rule (model/attention_probe.py's choose_kernel) on one sp rank: each kernel
    probed once at that rank's training shape (CPU: at check_tokens, in seconds), the choice
    (torch's cuDNN gate included), the fallback when the first kernel's probe fails (CPU:
    cpu_flash's, to math), then cuDNN against flash (CPU: cpu_flash against math) at
    check_tokens."""
    cfg, dtype = load_config(g.model), _dtype(dev)
    first, second = ("cudnn", "flash") if dev.type == "cuda" else ("cpu_flash", "math")
    seq_len = g.seq_len if dev.type == "cuda" else g.check_tokens
    shape = rank_attention_shape(cfg, seq_len, g.sp)
    heads = (shape["num_heads"], shape["num_kv_heads"])
    answers = {}
    probe = recorded_probe(answers)

    def first_fails(name, *shape, tokens=None):
        return "failure injected" if name == first else probe(name, *shape, tokens=tokens)

    chosen = choose_kernel(dev, dtype, cfg, seq_len, g.sp, probe=probe)
    fallback = choose_kernel(dev, dtype, cfg, seq_len, g.sp, probe=first_fails)
    for name in (first, second):
        probe(name, dev, dtype, *heads, cfg.head_dim, tokens=shape["seq_len"])
    out = {"probe": {n: answers[n] or "ok" for n in (first, second)}}
    out.update(probe_tokens=shape["seq_len"], probe_heads=list(heads))
    out.update(chosen=chosen.name, chosen_why=chosen.why, fallback=fallback.name)
    out.update(fallback_why=fallback.why, cudnn_version=torch.backends.cudnn.version())
    out["cudnn_gate"] = torch_cudnn_gate("cudnn", dev) if dev.type == "cuda" else None
    if dev.type == "cuda":
        out["cublas_workspace_bytes"] = cublas_workspace_bytes(dev)
    ran = bench_attention.compare_backends(g.check_tokens, *heads, cfg.head_dim, device=str(dev))
    return {**ran, **out}


def cublas_workspace_bytes(dev: torch.device) -> int:
    """What cuBLAS's workspace takes from torch's allocator here (memory/plan.py's
    CUBLAS_WORKSPACE_BYTES, projected until this measures it): the bytes a matmul leaves allocated
    beyond its output, once torch has let go of its workspaces."""
    torch.cuda.synchronize(dev)
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.ones(256, 256, device=dev, dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated(dev)
    y = a @ a
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) - before - y.untyped_storage().nbytes()


def part_int32(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """sp=1 heads at int32_tokens (q past 2^31 elements at the full size), forward and backward,
    the last rows against the fp32 reference: the kernel the short probe pins (the one the other
    parts time) and train.py's own rule at this length (choose_kernel with probe_kernel), so the
    JSON says whether that kernel is right here and which one a run of this shape would pin;
    skipped if its estimate at ATTN_TFLOPS would overrun."""
    cfg, dtype, T = load_config(g.model), _dtype(dev), g.int32_tokens
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"tokens": T, "q_elements": T * nh * hd, "past_2_31": T * nh * hd > 2**31}
    fwd = step_flops(cfg, T)["attention_fwd"] / cfg.num_hidden_layers
    estimate = 2 * 3.5 * fwd / (ATTN_TFLOPS * 1e12)  # two kernels; backward 2.5 x forward FLOPs
    if dev.type == "cuda" and estimate > 0.8 * limit_s:
        return {**out, "skipped": f"estimated {estimate:.0f} s, {limit_s:.0f} s allowed"}
    name, t0 = bench_attention.pinned_backend(dev, dtype, nh, nkv, hd, T), time.perf_counter()
    out["backend"], answers = name, {}
    try:  # each candidate probed at T, in train.py's order; one that fails is passed over
        choice = choose_kernel(dev, dtype, cfg, T, 1, probe=recorded_probe(answers))
    except ValueError as e:  # no kernel agrees at this length: a run of this shape is refused
        out.update(agrees=False, reason=str(e), chosen=None, passed_over=[])
        return {**out, "time_s": time.perf_counter() - t0}
    why = answers.get(name)  # None: it agreed (or a kernel before it was chosen)
    out.update(agrees=why is None, reason=why)
    out.update(chosen=choice.name, passed_over=list(choice.passed_over))
    return {**out, "time_s": time.perf_counter() - t0}


def document_rows(tokens: int, long: int, short: int) -> dict:
    """Two rows of `tokens` tokens: `long` documents of nearly equal length, and `short` documents
    of lengths 1 .. 2 x tokens / short - 2 in turn (one-token ones among them) plus the rest."""
    books = [tokens // long] * long
    books[-1] += tokens - sum(books)
    span = max(2 * (tokens // short) - 2, 1)
    chats = [1 + (i * 37) % span for i in range(short - 1)]
    chats.append(tokens - sum(chats))
    return {"long": tuple(books), "short": tuple(chats)}


def mixed_row(tokens: int, short: int, longest: int) -> tuple:
    """A row of `short` documents over tokens - longest (as document_rows' short ones), then one
    of `longest`: flash's variable-length grid is ceil(longest / 128) query blocks for every
    document, so nearly all the short ones' blocks are empty."""
    return (*document_rows(tokens - longest, 1, short)["short"], longest)


def _bucketed(lens: tuple, backend: str, way: str):
    """Attention over the row as two calls, the short documents in one and the longest alone:
    what splitting the call by length would run."""
    cut = sum(lens[:-1])

    def attend(q, k, v):
        parts = [
            attention(q[:, a:b], k[:, a:b], v[:, a:b], backend=backend, doc_lens=d, documents=way)
            for a, b, d in ((0, cut, lens[:-1]), (cut, sum(lens), lens[-1:]))
        ]
        return torch.cat(parts, 1)

    return attend


def _fwd_bwd(attend, q, k, v, dout) -> list:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _timed(fn, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def part_documents(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """One sp rank's attention over a row of documents, as train.py runs it with --documents
    masked (choose_documents_kernel: one flash call with cumulative lengths on a GPU): a row of
    `long` documents and one of `short`, each its first call (graphs built, kernels loaded) and
    then its time per layer (forward + backward), which the projection divides by the stream's
    (the attention part's); and equality against the same row run once per document (flash on a
    GPU), the largest difference of out, dq, dk, dv over the largest value. A third row, many
    short documents and one long one (mixed_row), is also timed as two calls split by length
    (bucketed_per_layer_s): what the empty blocks of one call cost. attention_flops: a row's
    forward and backward in step_flops' count, which memory/steptime.py's calibration reads."""
    cfg, dtype = load_config(g.model), _dtype(dev)
    shape = rank_attention_shape(cfg, g.seq_len, g.sp)
    T, heads = shape.pop("seq_len"), tuple(shape.values())
    backend = bench_attention.pinned_backend(dev, dtype, *heads, T)
    way = choose_documents_kernel(dev, dtype, cfg, g.seq_len, g.sp, backend).name
    per_document = "flash" if dev.type == "cuda" else backend
    q, k, v, dout = training_layout(T, *heads, dtype, dev)
    out = {"tokens": T, "heads": list(heads), "backend": backend, "documents_kernel": way}
    t0 = time.perf_counter()
    rows = {**document_rows(T, *g.documents), "mixed": mixed_row(T, *g.mixed)}
    for name, lens in rows.items():
        if time.perf_counter() - t0 > 0.5 * limit_s:
            out[name] = {"skipped": f"{time.perf_counter() - t0:.0f} s of {limit_s:.0f} s spent"}
            continue
        attend = functools.partial(attention, backend=backend, doc_lens=lens, documents=way)
        first = _timed(lambda a=attend: _fwd_bwd(a, q, k, v, dout), dev)
        steady = min(_timed(lambda a=attend: _fwd_bwd(a, q, k, v, dout), dev) for _ in range(2))
        got = _fwd_bwd(attend, q, k, v, dout)
        each = functools.partial(
            attention, backend=per_document, doc_lens=lens, documents="segments"
        )
        want = _fwd_bwd(each, q, k, v, dout)
        diffs = {
            n: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
        }
        del got, want
        r = {"documents": len(lens), "longest": max(lens), "ones": lens.count(1)}
        r["attention_flops"] = documents_flops(lens, heads[0], heads[2])
        if name == "mixed":
            split = _bucketed(lens, backend, way)
            r["bucketed_per_layer_s"] = min(
                _timed(lambda a=split: _fwd_bwd(a, q, k, v, dout), dev) for _ in range(2)
            )
            r["empty_blocks_s"] = steady - r["bucketed_per_layer_s"]
        r.update(first_call_s=first, per_layer_s=steady, first_call_overhead_s=first - steady)
        r.update(vs_per_document=diffs, agrees=max(diffs.values()) <= PROBE_TOLERANCE)
        out[name] = r
    return out


def part_cpu_offload(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """train.py --cpu-offload on this one device (fp32 state and fused AdamW on the host): its last
    step's record."""
    model, tokens, steps = g.offload_run
    run = Path(tempfile.mkdtemp()) / "run"
    args = f"--model {model} --data synthetic:copy --cpu-offload --seq-len {tokens} --steps {steps}"
    args += " --eval-every 0"  # the steps alone: this part times a step, not an evaluation
    cmd = [sys.executable, "train.py", *args.split(), "--no-save-final", "--out", str(run)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
    if p.returncode:
        raise RuntimeError(f"train.py exit {p.returncode}: {p.stderr[-400:]}")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    keys = ("step", "loss", "step_time_s", "peak_mem_gb", "reserved_mem_gb", "planned_peak_gb")
    return {"model": model, "tokens": tokens, **{k: last[k] for k in keys}}


def part_optimizer(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """Clipping and AdamW over one GPU's fp32 shards: rank 0's dim-0 shard of every parameter,
    as plain tensors (FSDP2's DTensor dispatch is not in the figure)."""
    shapes = param_shapes(load_config(g.model)).values()
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [
        torch.randn((math.ceil(s[0] / g.sp), *s[1:]), generator=gen, device=dev).requires_grad_()
        for s in shapes
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=dev)
    kind = "fused" if dev.type == "cuda" else "foreach"  # as train.py
    opt = torch.optim.AdamW(params, lr=1e-5, **{kind: True})

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    t = measure(step, dev, warmup=1, repeats=3)  # the warm-up allocates the AdamW states
    n = sum(shard_numel(s, g.sp) for s in shapes)
    return {"optimizer": f"AdamW {kind}", "params_per_gpu": n, "time_s": t.min_s}


def part_gdn(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """One Gated DeltaNet layer's delta rule as one sp rank runs it (every token of the row, its
    value heads), forward and backward, on each kernel train.py could take (model/gdn_kernels.py:
    ours, fla where it imports), each probed against the fp32 reference as --gdn-kernel auto
    probes it: its seconds, agreement, and TFLOP/s of step_flops' delta-rule count (what
    --calibration reads into Rates.gdn_tflops). The kernel train.py would pin: `chosen`."""
    cfg = load_config(g.hybrid)
    shape = {"tokens": g.seq_len, "hk": cfg.linear_num_key_heads // g.sp}
    shape.update(hv=cfg.linear_num_value_heads // g.sp, dk=cfg.linear_key_head_dim)
    shape.update(dv=cfg.linear_value_head_dim)
    forward, backward = gdn_flops(cfg, g.seq_len)
    flops = (forward + backward) / cfg.linear_num_value_heads * shape["hv"]  # this rank's heads
    rules, why_not = candidate_rules(dev)
    out = {"model": g.hybrid, **shape, "flops": flops, "kernels": {}, "passed_over": why_not}
    for name, rule in rules.items():
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        why, seconds = probe_gdn(rule, gated_delta_rule, dev, **shape)
        r = {"agrees": why is None, "why": why, "time_s": seconds or None}
        if seconds:
            r["tflops"] = flops / seconds / 1e12
        if dev.type == "cuda":
            r["peak_gb"] = torch.cuda.max_memory_allocated(dev) / GB
            torch.cuda.empty_cache()
        out["kernels"][name] = r
    agreed = {n: r["time_s"] for n, r in out["kernels"].items() if r["agrees"]}
    if not agreed:
        raise RuntimeError(f"no delta-rule kernel agreed: {out['kernels']}")
    out["chosen"] = min(agreed, key=agreed.get)
    out.update(time_s=agreed[out["chosen"]], tflops=flops / agreed[out["chosen"]] / 1e12)
    out["scan_vs_loop"] = _scan_vs_loop(dev, {**shape, "tokens": g.seq_len // 8})
    return out


def _scan_vs_loop(dev: torch.device, shape: dict) -> dict:
    """Ours with the scan against ours with the textbook chunk loop (state_pass="loop"), forward
    and backward at an eighth of the row (the loop's launches, ~40 a chunk, make the whole row
    slow to time): what the scan's few steps buy on this device. Both are linear in the row."""
    loop = functools.partial(gated_delta_rule, state_pass="loop")
    out = {"tokens": shape["tokens"]}
    for name, rule in (("scan", gated_delta_rule), ("loop", loop)):
        inputs = [x.requires_grad_() for x in rule_inputs(dev, **shape)]

        def step(rule=rule, inputs=inputs):
            rule(*inputs).sum().backward()

        step()  # the first call warms up kernels and caches
        out[f"{name}_s"] = min(_timed(step, dev) for _ in range(2))
    out["loop_over_scan"] = out["loop_s"] / out["scan_s"]
    return out


def part_attention_hd256(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """The hybrid's full attention (head_dim 256) as one sp rank runs it over the whole row, on
    the kernel train.py pins for that shape, and cuDNN against flash (CPU: cpu_flash against
    math) at check_tokens: time and agreement at head_dim 256, where the kernels' rates and
    limits differ from head_dim 128's."""
    cfg = load_config(g.hybrid)
    r = bench_attention.run(g.seq_len, g.sp, model=cfg, device=str(dev), limit_s=0.7 * limit_s)
    if r["backend"] is None:
        raise RuntimeError(f"no attention backend ran at head_dim 256: {r['backend_errors']}")
    shape = rank_attention_shape(cfg, g.check_tokens, g.sp)
    heads = (shape["num_heads"], shape["num_kv_heads"], cfg.head_dim)
    r["check"] = bench_attention.compare_backends(g.check_tokens, *heads, device=str(dev))
    return r


def part_hybrid_layer(g: Geometry, dev: torch.device, limit_s: float) -> dict:
    """One of the hybrid's full-attention layers (model/qwen3_5.py's HybridLayer: gated
    attention, partial RoPE, MLP) at one GPU's tokens, forward, recompute and backward as the
    checkpointed layer runs in training, its attention over the local tokens (sp=1, as the
    layers part times Qwen3's): per_layer_s, the same layer's attention alone, and the rest."""
    from model.qwen3 import rope_cos_sin
    from model.qwen3_5 import HybridLayer

    cfg, dtype = load_config(g.hybrid), _dtype(dev)
    index = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_linear_layer(i))
    layer = HybridLayer(cfg, index).to(dev, dtype)
    T = g.tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, T, cfg.hidden_size, generator=gen, device=dev, dtype=dtype)
    cos, sin = rope_cos_sin(cfg, torch.arange(T, device=dev).unsqueeze(0), dtype)
    backend = bench_attention.pinned_backend(
        dev, dtype, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, T
    )
    set_backend(backend)

    def step():
        inp = x.detach().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(layer, inp, cos, sin, use_reentrant=False)
        y.backward(torch.ones_like(y))

    per_layer = measure(step, dev, warmup=1, repeats=2).min_s
    la = bench_attention.run(T, 1, model=cfg, device=str(dev), limit_s=0.4 * limit_s)
    la_s = la["fwd_s"] + la["bwd_s"] if la["backend"] else None
    out = {"model": g.hybrid, "layer_index": index, "tokens": T, "backend": backend}
    out.update(per_layer_s=per_layer, local_attention_s=la_s)
    if la_s is not None:
        # checkpointed: attention runs forward twice and backward once
        out["per_layer_nonattn_s"] = per_layer - la_s - la["fwd_s"]
    return out


PARTS = {f.__name__.removeprefix("part_"): f for f in (part_loss, part_layers, part_attention)}
PARTS.update(backends=part_backends, optimizer=part_optimizer, int32=part_int32)
PARTS.update(cpu_offload=part_cpu_offload, documents=part_documents)
PARTS.update(gdn=part_gdn, attention_hd256=part_attention_hd256, hybrid_layer=part_hybrid_layer)


def _run_parts(names: list, g: Geometry, device: str, limit_s: float) -> dict:
    """The parts one after another in this (fresh) process, each with its share of limit_s."""
    dev = torch.device(device)
    if dev.index is not None:  # set_device refuses a bare "cuda"
        torch.cuda.set_device(dev)
    out = {}
    for name in names:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)  # each part's own peak
        t0 = time.perf_counter()
        try:
            r = {**PARTS[name](g, dev, limit_s * SHARES[name] / sum(SHARES[n] for n in names))}
            r["status"] = "ok"
        except Exception as e:  # recorded; the parts after it still run
            r = {"status": f"failed: {type(e).__name__}: {e}"[:600]}
        r["wall_s"] = time.perf_counter() - t0
        if dev.type == "cuda":
            r["device"] = torch.cuda.get_device_name(dev)
            r["process_peak_gb"] = torch.cuda.max_memory_allocated(dev) / GB
            r["process_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / GB
            free, total = torch.cuda.mem_get_info(dev)  # the device's, this process alone on it
            r["cuda_context_gb"] = (total - free - torch.cuda.memory_reserved(dev)) / GB
        else:  # Linux ru_maxrss is in KiB: the whole process so far, torch included
            r["device"] = "cpu"
            r["process_peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        out[name] = r
    return out


def project(res: dict, g: Geometry, nvlink_gbps: float, peak_tflops: float, esize: int) -> dict:
    """The 8-GPU step time and peak per GPU assembled from the parts, with the arithmetic."""
    cfg = load_config(g.model)
    L, gpus = cfg.num_hidden_layers, g.sp
    kw = {"tflops": peak_tflops, "mlp_tile": g.mlp_tile, "compute_bytes": esize}
    p = plan(cfg, g.seq_len, gpus=gpus, sp=g.sp, save_attention=True, **kw)
    out = {"seq_len": g.seq_len, "gpus": gpus, "peak_tflops": peak_tflops}
    out.update(planner_flops=p.flops.step, planner_floor_s=p.flops.step_time_s)
    out.update(planner_peak_gb=p.total / GB, planner_host_gb_per_node=p.host.per_node / GB)
    out["public_recipe"] = dict(PUBLIC_RECIPE)
    parts = measured_parts(res)
    if parts.missing:
        missing = ", ".join(n for n in PARTS if n in parts.missing)
        return {**out, "status": f"not projected: {missing} did not run", "step_s": None}
    lay, att, loss = (res[k] for k in ("layers", "attention", "loss"))
    a2a_s = res["exchange"]["projected_s_per_step"]
    t = {"layers": L, "layer_nonattn_s": parts.layer_nonattn_s}
    t.update(attention_s=parts.attention_s, loss_s=parts.loss_s)
    t.update(a2a_s=a2a_s, optimizer_s=parts.optimizer_s)
    layer_s = parts.layer_s
    step = parts.step_s(L, a2a_s)  # the all-to-alls sit on the critical path: added
    n = cfg.num_params()  # FSDP2: bf16 all-gathers in forward and backward, fp32 reduce-scatter
    fsdp_bytes = (2 * n * 2 + n * 4) * (gpus - 1) / gpus
    out.update(status="ok", terms=t, layer_s=layer_s, step_s=step, a2a_s=t["a2a_s"])
    out["how"] = (
        f"{L} x ({t['layer_nonattn_s']:.4f} + {t['attention_s']:.4f}) + {t['loss_s']:.4f} + "
        f"{t['a2a_s']:.4f} + {t['optimizer_s']:.4f} = {step:.4g} s"
    )
    out.update(attention_share=L * t["attention_s"] / step, backend=att["backend"])
    docs = res.get("documents", {})
    for row in ("long", "short", "mixed"):  # a row of documents' attention over the stream's
        if docs.get("status") == "ok" and "per_layer_s" in docs.get(row, {}):
            out[f"documents_{row}_vs_stream"] = docs[row]["per_layer_s"] / t["attention_s"]
    out["step_s_attention_recomputed"] = parts.step_s(L, a2a_s, save_attention=False)
    out["implied_mfu"] = p.flops.step / (gpus * peak_tflops * 1e12 * step)
    out["vs_public_recipe"] = PUBLIC_RECIPE["step_time_s"] / step
    out["fsdp_collectives_s"] = fsdp_bytes / (nvlink_gbps * GB)  # overlapped: not added
    ws = lay["working_set"]
    if ws["measured_gb"] is not None:  # the planner's peak, its working set and loss measured
        kept = p.device_kept  # the saved tensors every layer keeps on the device
        fix = (ws["measured_gb"] - ws["planned_gb"]) * GB
        layer_phase = p.layer.bytes + fix
        loss_phase = p.loss.gathered_bytes + loss["loss_peak_rise_gb"] * GB + kept
        out["peak_gb"] = (p.held.bytes + max(layer_phase, loss_phase)) / GB
    return out


def summary(res: dict) -> str:
    """The printout: the parts, their figures, the projection with its arithmetic."""
    p = res["projection"]
    head = f"gpu_check on {res['device']}, torch {res['torch']}: {res['model']}"
    lines = [
        f"{head}, {res['wall_s']:.0f} s of {res['budget_s']:.0f} s",
        table([{"part": n, **res[n]} for n in PARTS], PART_COLUMNS),
    ]
    lines += [f"{n}: {figures(res[n])}" for n in PARTS if res[n]["status"] == "ok"]
    lines.append(bench_attention.format_exchange(res["exchange"]))
    lines.append(f"PROJECTED step, {p['seq_len']:,} tokens on {p['gpus']} GPUs: {p['status']}")
    return "\n".join([*lines, figures(p)])


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny preset, 512 tokens over sp=2")
    ap.add_argument("--out", default="gpu_check.json", help="rewritten after every part")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget-s", type=float, default=None, help="whole run (420; tiny 120)")
    ap.add_argument("--nvlink-gbps", type=float, default=450.0, help="per direction per GPU")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 (H100, H200)")
    a = ap.parse_args()
    g, kind = TINY if a.tiny else FULL, "cuda" if a.device.startswith("cuda") else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():  # asks the driver: no CUDA context
        ap.error("no CUDA device here: use --device cpu --tiny")
    asked = a.parts.split(",")
    if set(asked) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(asked) - set(PARTS))}; known {', '.join(PARTS)}")
    todo = [n for n in PARTS if n in asked]
    budget = a.budget_s or (120.0 if a.tiny else 420.0)
    t0, esize = time.perf_counter(), 2 if kind == "cuda" else 4  # bf16 on a GPU, fp32 on CPU
    res = {"device": None, "torch": torch.__version__, "cuda": torch.version.cuda, **asdict(g)}
    res.update(tiny=a.tiny, budget_s=budget, nvlink_gbps=a.nvlink_gbps, argv=sys.argv[1:])
    kw = {"bytes_per_elem": esize, "nvlink_gbps": a.nvlink_gbps}
    res["exchange"] = bench_attention.exchange_volumes(load_config(g.model), g.seq_len, g.sp, **kw)
    res.update({n: {"status": "not run" if n in todo else "not requested"} for n in PARTS})
    banked = 0.0
    for group in [todo] if a.tiny else [[n] for n in todo]:
        share = sum(SHARES[n] for n in group) * budget  # plus what earlier groups left unused
        timeout = min(share + banked, t0 + budget - time.perf_counter())
        if timeout < 2 * STARTUP_S[kind]:
            why = f"skipped: {max(timeout, 0):.0f} s left of the {budget:.0f} s budget"
            res.update({n: {"status": why} for n in group})
        else:
            print(f"[gpu_check] {'+'.join(group)}: running (limit {timeout:.0f} s)", flush=True)
            t_part = time.perf_counter()
            limit_s = timeout - STARTUP_S[kind]
            got = in_fresh_process(_run_parts, group, g, a.device, limit_s, timeout=timeout)
            used = time.perf_counter() - t_part
            banked = max(0.0, share + banked - used)
            for n in group:
                res[n] = {
                    **got.get(n, {"status": f"failed: {got.get('error')}"}),
                    "process_s": used,
                }
            print(f"[gpu_check] {', '.join(res[n]['status'] for n in group)} in {used:.0f} s")
        ran = [res[n]["device"] for n in todo if "device" in res[n]]
        res["device"] = ran[0] if ran else ("cpu" if kind == "cpu" else "cuda (no part ran)")
        res["wall_s"] = time.perf_counter() - t0
        res["projection"] = project(res, g, a.nvlink_gbps, a.peak_tflops, esize)
        Path(f"{a.out}.tmp").write_text(json.dumps(res, indent=1))
        os.replace(f"{a.out}.tmp", a.out)  # atomic: a reader never sees half a file
    print(summary(res))
    print(f"\nwrote {a.out}")
    return res


if __name__ == "__main__":
    main()
