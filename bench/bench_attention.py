"""The attention one Ulysses sequence-parallel rank runs, and the all-to-alls around it.

    python bench/bench_attention.py                         # cuda: Qwen3-8B, sp=8, 1,048,576 tokens, bf16
    python bench/bench_attention.py --tokens 262144 --backend flash --json attn.json
    python bench/bench_attention.py --device cpu --tiny     # tiny config, 512 tokens, sp=2, fp32: a second

    from bench.bench_attention import run, exchange_volumes, format_result
    r = run(tokens=1_048_576, sp=8)                          # a dict (bench/gpu_check.py uses it)

With sp=8 a 1,048,576-token Qwen3-8B row gives every rank every token inside attention, for
32/8 = 4 query heads and 8/8 = 1 kv head: q [1, T, 4, 128], k and v [1, T, 1, 128]. This runs
model.qwen3.causal_attention on those shapes (model.attention.attention: causal, kv heads shared,
never expanded), which is what UlyssesAttention runs between its all-to-alls: forward, then
backward from a random output gradient. With attention once a training step runs exactly this
per layer: one forward, one backward (the recompute replays the forward's output).

FLOPs follow memory.plan.step_flops: forward 2 x 2 x T^2/2 x heads x head_dim (QK^T and PV over
the causal half), backward attn_bwd_factor (2.5) x forward, FlashAttention's backward doing five
T^2 products to the forward's two. Times are wall time around synchronised calls, the best of
--steps runs at full length after a warm-up at a short length (same kernels).
Peak memory (CUDA): torch.cuda.max_memory_allocated() during the timed run, absolute and as the
rise over the inputs (q, k, v and the output gradient); not measured on CPU.

Backend: --backend pinned (default) is the kernel training pins: model.attention.pick_backend
for these shapes (cuDNN where the runtime has it, else flash; cpu_flash on CPU), set with
model.attention.set_backend, as train.py does. A name (cudnn, flash, cpu_flash, math) pins that
one; default is torch's per-call SDPA choice (no attention-once). If the pinned kernel fails at
full length, flash is tried next on CUDA and the failure recorded in backend_errors; math only
where a T x T score matrix is small. Which aten op ran is observed with a dispatch mode on the
warm-up run, not assumed.

Exchange volumes (arithmetic on the config, checked against the tensors model/ulysses.py hands
to all_to_all_single in tests/test_gpu_check.py): per layer each rank exchanges q, k, v
(seq_to_heads) and out (heads_to_seq) in forward, the same again when checkpointing recomputes
the layer, and grad out, grad q, k, v in backward; each buffer is [sp, B, T/sp, heads/sp, hd]
with kv heads repeated to sp when sp exceeds them, and (sp-1)/sp of it leaves the rank. The
all-to-all time is PROJECTED as bytes sent / --nvlink-gbps (450 GB/s per direction per GPU:
NVLink 4 on H100 and H200); NCCL's all-to-all reaches less than the link rate in practice.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memory.plan import load_config, step_flops
from model.attention import get_backend, pick_backend, set_backend
from model.config import Qwen3Config
from model.qwen3 import causal_attention
from model.ulysses import check_heads

GB, GiB, MiB = 1e9, 2**30, 2**20
ATTN_BWD_FACTOR = inspect.signature(step_flops).parameters["attn_bwd_factor"].default
NVLINK_GBPS = 450.0  # per direction per GPU, NVLink 4 (H100 / H200 SXM)
MATH_MAX_SCORE_BYTES = 4 * GiB  # the math backend materialises [heads, T, T] fp32 scores
# aten op name fragment -> backend name, for what the dispatch mode sees
_OPS = {
    "flash_attention": "flash",
    "efficient_attention": "efficient",
    "cudnn_attention": "cudnn",
    "attention_math": "math",
    "fused_attention_overrideable": "overrideable",
}


# ---- exchange volumes (arithmetic) ----------------------------------------------------------
def exchange_volumes(
    config: Qwen3Config,
    tokens: int,
    sp: int,
    *,
    bytes_per_elem: int = 2,
    batch: int = 1,
    nvlink_gbps: float = NVLINK_GBPS,
) -> dict:
    """Bytes one rank passes to all_to_all_single per layer, by phase, and a projected time.

    Rows: phase (forward, recompute, backward), tensor, op, the [sp, B, T/sp, heads/sp, hd]
    buffer's shape, its bytes, and the bytes sent to other ranks ((sp-1)/sp of it).
    """
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if tokens % sp:
        raise ValueError(f"tokens ({tokens}) must be a multiple of sp ({sp})")
    rows = []
    if sp > 1:  # sp=1 exchanges nothing
        check_heads(nh, nkv, sp)
        hkv = max(nkv, sp)  # kv heads repeated to sp before the exchange when sp > nkv
        fwd = [
            ("q", "seq_to_heads", nh),
            ("k", "seq_to_heads", hkv),
            ("v", "seq_to_heads", hkv),
            ("out", "heads_to_seq", nh),
        ]
        bwd = [
            ("grad out", "seq_to_heads", nh),
            ("grad q", "heads_to_seq", nh),
            ("grad k", "heads_to_seq", hkv),
            ("grad v", "heads_to_seq", hkv),
        ]
        for phase, items in (("forward", fwd), ("recompute", fwd), ("backward", bwd)):
            for name, op, heads in items:
                # seq_to_heads permutes [B, T/sp, h, hd] to this; heads_to_seq views [B, T, h/sp, hd] as it
                shape = (sp, batch, tokens // sp, heads // sp, hd)
                nbytes = math.prod(shape) * bytes_per_elem
                rows.append(
                    {
                        "phase": phase,
                        "tensor": name,
                        "op": op,
                        "buffer_shape": list(shape),
                        # block r of the buffer stays on rank r: (sp-1)/sp of it crosses links
                        "buffer_bytes": nbytes,
                        "sent_bytes": nbytes * (sp - 1) // sp,
                    }
                )
    per = {
        ph: sum(r["sent_bytes"] for r in rows if r["phase"] == ph)
        for ph in ("forward", "recompute", "backward")
    }
    layer = sum(per.values())
    L = config.num_hidden_layers
    return {
        "tokens": tokens,
        "sp": sp,
        "bytes_per_elem": bytes_per_elem,
        "layers": L,
        "rows": rows,
        "sent_per_layer": {**per, "total": layer},
        "sent_per_step": L * layer,
        "nvlink_gbps": nvlink_gbps,
        "projected_s_per_layer": layer / (nvlink_gbps * GB),
        "projected_s_per_step": L * layer / (nvlink_gbps * GB),
    }


def _size(n: float) -> str:
    for unit, b in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= b:
            return f"{n / b:.2f} {unit}"
    return f"{n:.0f} B"


def format_exchange(ex: dict) -> str:
    """The exchange rows as a table, with totals and the projected time."""
    if not ex["rows"]:
        return f"sp={ex['sp']}: no all-to-all"
    out = [
        f"all-to-all per rank per layer, sp={ex['sp']}, {ex['tokens']:,} tokens, "
        f"{8 * ex['bytes_per_elem']}-bit elements (sent = (sp-1)/sp of the buffer)",
        f"  {'phase':<10}{'tensor':<9}{'op':<14}{'buffer [sp,B,T/sp,h/sp,hd]':<30}"
        f"{'buffer':>12}{'sent':>12}",
    ]
    for r in ex["rows"]:
        out.append(
            f"  {r['phase']:<10}{r['tensor']:<9}{r['op']:<14}{str(r['buffer_shape']):<30}"
            f"{_size(r['buffer_bytes']):>12}{_size(r['sent_bytes']):>12}"
        )
    s = ex["sent_per_layer"]
    out += [
        f"  sent per layer: forward {_size(s['forward'])}, recompute {_size(s['recompute'])}, "
        f"backward {_size(s['backward'])}, total {_size(s['total'])} ({s['total'] / GB:.3g} GB)",
        f"  per step ({ex['layers']} layers): {ex['sent_per_step'] / GB:.3g} GB -> PROJECTED "
        f"{ex['projected_s_per_step']:.3g} s at {ex['nvlink_gbps']:g} GB/s per direction per GPU "
        f"({1e3 * ex['projected_s_per_layer']:.3g} ms per layer; a projection, not a measurement)",
    ]
    return "\n".join(out)


# ---- the attention itself -------------------------------------------------------------------
class _OpRecorder(TorchDispatchMode):
    """Records the aten scaled-dot-product ops that actually run (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name and name not in self.ops:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _inputs(T, hq, hkv, hd, dtype, dev, seed):
    """q [1, T, hq, hd], k, v [1, T, hkv, hd] needing grad, and an output gradient."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v = (
        torch.randn(1, T, h, hd, generator=g, device=dev, dtype=dtype).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    return q, k, v, torch.randn(1, T, hq, hd, generator=g, device=dev, dtype=dtype)


def _fwd_bwd(q, k, v, dout, dev) -> tuple[float, float]:
    """One forward and backward of causal_attention on the pinned backend: (fwd s, bwd s)."""
    q.grad = k.grad = v.grad = None  # no accumulation into last run's gradients
    _sync(dev)
    t0 = time.perf_counter()
    out = causal_attention(q, k, v)
    _sync(dev)
    t1 = time.perf_counter()
    out.backward(dout)
    _sync(dev)
    return t1 - t0, time.perf_counter() - t1


BACKEND_CHOICES = ("pinned", "cudnn", "flash", "cpu_flash", "math", "default")


def pinned_backend(dev, dtype, hq: int, hkv: int, hd: int, T: int | None = None) -> str:
    """The backend training pins for these per-rank shapes (train.py: pick_backend, then set_backend)."""
    return pick_backend(dev, dtype, num_heads=hq, num_kv_heads=hkv, head_dim=hd, seq_len=T)


def _candidates(backend: str, dev, dtype, T: int, hq: int, hkv: int, hd: int, bytes_per_elem: int):
    """model.attention backend names to pin, in the order to try."""
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
    if backend == "default":
        return ["sdpa"]  # torch's own choice per call
    c = [pinned_backend(dev, dtype, hq, hkv, hd, T) if backend == "pinned" else backend]
    if dev.type == "cuda" and c[0] == "cudnn":
        c.append("flash")  # what runs if cuDNN fails at this length (recorded in backend_errors)
    if c[0] != "math" and hq * T * T * max(4, bytes_per_elem) <= MATH_MAX_SCORE_BYTES:
        c.append("math")
    return c


def run(
    tokens: int | None = None,
    sp: int | None = None,
    *,
    model: str | Qwen3Config = "qwen3-8b",
    device: str = "cuda",
    dtype: torch.dtype | None = None,
    tiny: bool = False,
    backend: str = "pinned",
    steps: int = 1,
    warmup_tokens: int = 16384,
    time_limit_s: float | None = None,
    nvlink_gbps: float = NVLINK_GBPS,
    seed: int = 0,
) -> dict:
    """Time one rank's causal attention forward + backward; returns a dict (see format_result).

    tiny: the tiny preset, 512 tokens, sp=2. backend: see the module docstring; the one that ran
    is pinned with set_backend while it runs. time_limit_s: if the full length is estimated
    (from the warm-up, scaled by T^2) to take longer, halve it until it does not and scale the
    times back up by (T / measured)^2, recorded as `extrapolated`.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_attention on cuda needs a GPU; use --device cpu --tiny here")
    cfg = load_config("tiny" if tiny else model) if isinstance(model, str) else model
    T = tokens or (512 if tiny else 1_048_576)
    sp = sp or (2 if tiny else 8)
    dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    check_heads(nh, nkv, sp)
    hq, hkv = nh // sp, max(nkv // sp, 1)  # per rank, after the exchange (kv repeated if sp > nkv)
    esize = torch.empty((), dtype=dtype).element_size()
    # FLOPs of one rank: the planner's attention term for the whole model, per layer and per rank.
    fwd_flops = step_flops(cfg, T)["attention_fwd"] / cfg.num_hidden_layers / sp
    bwd_flops = ATTN_BWD_FACTOR * fwd_flops
    t_start = time.perf_counter()

    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny" if tiny else (model if isinstance(model, str) else "custom"),
        "tokens": T,
        "sp": sp,
        "dtype": str(dtype).replace("torch.", ""),
        "q_shape": [1, T, hq, hd],
        "kv_shape": [1, T, hkv, hd],
        "kv_repeated_for_sp": sp > nkv,
        "backend_requested": backend,
        "backend": None,
        "backend_ops": [],
        "gqa": None,
        "backend_errors": {},
        "fwd_flops": fwd_flops,
        "bwd_flops": bwd_flops,
        "attn_bwd_factor": ATTN_BWD_FACTOR,
    }
    Tw = min(warmup_tokens, T)  # warm-up length: same kernels, a fraction of the time
    q = k = v = dout = None
    try:
        names = _candidates(backend, dev, dtype, T, hq, hkv, hd, esize)
    except ValueError as e:  # pick_backend refuses: neither fused kernel runs these shapes here
        names, result["backend_errors"]["pinned"] = [], str(e)[:600]
    result["backend_pinned"] = names[0] if names else None
    before = get_backend()
    for name in names:
        label = name
        set_backend(name)  # every attention() call below runs this kernel, as in training
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with _OpRecorder() as rec:
                    w = _inputs(Tw, hq, hkv, hd, dtype, dev, seed)
                    _fwd_bwd(*w, dev)  # warm-up: kernels loaded, backend observed
                tw = sum(_fwd_bwd(*w, dev))  # warm timing, for the length estimate
                del w
        except RuntimeError as e:
            why = dict.fromkeys(
                str(c.message).strip().splitlines()[0] for c in caught
            )  # torch's reasons
            result["backend_errors"][label] = "; ".join([*why, str(e).splitlines()[0]])[:600]
            continue
        ran = [b for frag, b in _OPS.items() if any(frag in op for op in rec.ops)]
        # Time-box: causal attention time grows as T^2; halve the measured length until it fits.
        Tm = T
        if time_limit_s is not None:
            left = time_limit_s - (time.perf_counter() - t_start)
            while Tm > Tw and Tm % 2 == 0 and steps * tw * (Tm / Tw) ** 2 > 0.8 * left:
                Tm //= 2
        try:  # the timed run at full (or time-boxed) length, peak memory over its inputs
            q, k, v, dout = _inputs(Tm, hq, hkv, hd, dtype, dev, seed)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times = [_fwd_bwd(q, k, v, dout, dev) for _ in range(steps)]
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
            grad_ok = all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
        except RuntimeError as e:  # OOM or a kernel limit at full length: try the next backend
            result["backend_errors"][label] = f"at {Tm:,} tokens: {str(e).splitlines()[0][:300]}"
            q = k = v = dout = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            continue
        scale = (T / Tm) ** 2  # causal FLOPs (and time, at these lengths) grow as T^2
        fwd_s = min(f for f, _ in times) * scale
        bwd_s = min(b for _, b in times) * scale
        result.update(
            backend=name,
            backend_ops=rec.ops,
            backend_ran=ran[0] if ran else "math (no fused op seen: a composite of matmuls)",
            gqa="kv heads shared (not expanded)" if hq != hkv else "none (equal heads)",
            measured_tokens=Tm,
            extrapolated=Tm != T,
            steps=steps,
            warmup_tokens=Tw,
            fwd_s=fwd_s,
            bwd_s=bwd_s,
            fwd_bwd_s=fwd_s + bwd_s,
            fwd_tflops=fwd_flops / fwd_s / 1e12,
            bwd_tflops=bwd_flops / bwd_s / 1e12,
            fwd_bwd_tflops=(fwd_flops + bwd_flops) / (fwd_s + bwd_s) / 1e12,
            inputs_gb=sum(t.numel() * t.element_size() for t in (q, k, v, dout)) / GB,
            peak_mem_gb=None if peak is None else peak / GB,
            act_peak_gb=None if peak is None else (peak - base) / GB,
            grads_finite=grad_ok,
        )
        break
    set_backend(before)
    q = k = v = dout = None  # noqa: F841 (free the inputs before returning)
    # The exchanges around this attention are arithmetic, for the full length whatever ran.
    result["exchange"] = exchange_volumes(cfg, T, sp, bytes_per_elem=esize, nvlink_gbps=nvlink_gbps)
    result["wall_s"] = time.perf_counter() - t_start
    return result


def compare_backends(
    tokens: int = 65536,
    hq: int = 4,
    hkv: int = 1,
    hd: int = 128,
    *,
    device: str = "cuda",
    dtype: torch.dtype | None = None,
    pair: tuple | None = None,
    seed: int = 0,
    rel_tol: float = 2e-2,
) -> dict:
    """The same causal attention forward and backward on two pinned backends: max differences.

    Default pair: cuDNN against flash on CUDA (bf16), cpu_flash against math on CPU (fp32: the
    same code path, for the tiny test). Inputs N(0, 1), one random output gradient. Per tensor
    (out, dq, dk, dv): max |a - b|, the largest reference magnitude, and their ratio `rel`; they
    agree when rel <= rel_tol (2e-2: about 5 bf16 rounding steps of the largest value; the two
    kernels tile and accumulate in different orders). A backend that cannot run is a `skipped`
    reason, not an exception.
    """
    from model.attention import _torch_can_use

    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    a_name, b_name = pair or (("cudnn", "flash") if dev.type == "cuda" else ("cpu_flash", "math"))
    out = {
        "tokens": tokens,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": hd,
        "dtype": str(dtype).replace("torch.", ""),
        "backends": [a_name, b_name],
        "rel_tol": rel_tol,
        "skipped": None,
    }
    for name in (a_name, b_name):
        if not _torch_can_use(name, dev, dtype, hq, hkv, hd):
            out["skipped"] = (
                f"{name} cannot run {hq} query / {hkv} kv heads of dim {hd} in {dtype} on {dev} "
                f"(torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()})"
            )
            return out
    q, k, v, dout = _inputs(tokens, hq, hkv, hd, dtype, dev, seed)
    before, got = get_backend(), {}
    try:
        for name in (a_name, b_name):
            set_backend(name)
            q.grad = k.grad = v.grad = None
            with _OpRecorder() as rec:
                o = causal_attention(q, k, v)
                o.backward(dout)
            _sync(dev)
            got[name] = {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            out.setdefault("ops", {})[name] = rec.ops
    except RuntimeError as e:
        out["skipped"] = f"{name} failed at {tokens:,} tokens: {str(e).splitlines()[0][:300]}"
        return out
    finally:
        set_backend(before)
    diffs = {}
    for t in ("out", "dq", "dk", "dv"):
        a, b = got[a_name][t].float(), got[b_name][t].float()
        max_abs, ref = (a - b).abs().max().item(), b.abs().max().item()
        diffs[t] = {
            "max_abs": max_abs,
            "max_ref": ref,
            "rel": max_abs / ref if ref else 0.0,
            "finite": bool(torch.isfinite(a).all().item() and torch.isfinite(b).all().item()),
        }
    out.update(diffs=diffs, agree=all(d["rel"] <= rel_tol and d["finite"] for d in diffs.values()))
    return out


def format_compare(c: dict) -> str:
    a, b = c["backends"]
    head = (
        f"{a} vs {b}: causal attention, {c['tokens']:,} tokens, {c['q_heads']} query heads on "
        f"{c['kv_heads']} kv head(s), head_dim {c['head_dim']}, {c['dtype']}"
    )
    if c["skipped"]:
        return f"{head}: skipped ({c['skipped']})"
    rows = [
        f"  {t:<4} max |{a} - {b}| {d['max_abs']:.3e}  max |{b}| {d['max_ref']:.3e}  relative {d['rel']:.2e}"
        for t, d in c["diffs"].items()
    ]
    return "\n".join(
        [head + f": {'agree' if c['agree'] else 'DISAGREE'} (relative <= {c['rel_tol']:g})", *rows]
    )


def format_result(r: dict) -> str:
    """A readable summary of run()'s dict, with the exchange table."""
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    head = (
        f"{r['device']}, torch {r['torch']}: one sp={r['sp']} rank of {r['model']}, "
        f"{r['tokens']:,} tokens, q {r['q_shape']}, k/v {r['kv_shape']}, {r['dtype']}, causal"
    )
    if r["backend"] is None:
        lines = [head, "no SDPA backend ran: " + json.dumps(r["backend_errors"])]
    else:
        lines = [
            head,
            f"backend {r['backend']}, ran {r['backend_ran']} (requested {r['backend_requested']}; ops: "
            f"{', '.join(o.replace('aten.', '') for o in r['backend_ops'])}), gqa: {r['gqa']}"
            + (
                f"; measured at {r['measured_tokens']:,} tokens and scaled by T^2"
                if r["extrapolated"]
                else ""
            ),
            f"  forward  {r['fwd_s']:9.4f} s  {r['fwd_flops']:.3e} FLOPs  "
            f"{r['fwd_tflops']:8.1f} TFLOP/s",
            f"  backward {r['bwd_s']:9.4f} s  {r['bwd_flops']:.3e} FLOPs  {r['bwd_tflops']:8.1f} TFLOP/s"
            f"  ({r['attn_bwd_factor']:g} x forward FLOPs)",
            f"  total    {r['fwd_bwd_s']:9.4f} s  {r['fwd_bwd_tflops']:8.1f} TFLOP/s; peak memory "
            f"{f(r['peak_mem_gb'], '.2f')} GB ({f(r['act_peak_gb'], '.2f')} GB over the "
            f"{r['inputs_gb']:.2f} GB of inputs)"
            + (" [CUDA only]" if r["peak_mem_gb"] is None else ""),
        ]
        for k, v in r["backend_errors"].items():
            lines.append(f"  refused: {k}: {v}")
    return "\n".join(lines + [format_exchange(r["exchange"])])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny preset, 512 tokens, sp=2, fp32 on CPU"
    )
    ap.add_argument("--model", default="qwen3-8b", help="preset or config.json / model directory")
    ap.add_argument(
        "--tokens", type=int, default=None, help="whole sequence length (default 1,048,576)"
    )
    ap.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default 8)")
    ap.add_argument(
        "--backend",
        default="pinned",
        choices=BACKEND_CHOICES,
        help="pinned: the kernel train.py pins (cuDNN where available, else flash)",
    )
    ap.add_argument("--steps", type=int, default=1, help="timed runs at full length (best kept)")
    ap.add_argument(
        "--nvlink-gbps",
        type=float,
        default=NVLINK_GBPS,
        help="GB/s per direction per GPU for the projected all-to-all time",
    )
    ap.add_argument("--json", default=None, help="also write the result dict here")
    a = ap.parse_args(argv)
    r = run(
        a.tokens,
        a.sp,
        model=a.model,
        device=a.device,
        tiny=a.tiny,
        backend=a.backend,
        steps=a.steps,
        nvlink_gbps=a.nvlink_gbps,
    )
    print(format_result(r))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
