"""The attention one Ulysses rank runs, timed on the kernel training pins, and the all-to-alls.

    from bench.bench_attention import run, compare_backends, exchange_volumes
    r = run(1_048_576, 8, model="qwen3-8b", device="cuda")   # r["fwd_s"], r["bwd_s"], r["backend"]
    python bench/gpu_check.py --parts attention,backends      # the command line that runs them

run(): one rank's q [1, T, heads/sp, hd], k, v [1, T, kv heads/sp (at least 1), hd] through
model.qwen3.causal_attention, forward then backward (attention once's work per layer), on the kernel
train.py pins (flash standing in if cuDNN fails at full length); the aten op that ran is recorded;
a time limit halves T and scales the times by T^2. compare_backends(): two kernels, same inputs.
exchange_volumes(): the [sp, B, T/sp, heads/sp, hd] all-to-all buffers of a layer (forward,
recompute, backward; checked in tests/test_gpu_check.py), their time PROJECTED at NVLink's rate.
"""

import functools
import inspect
import math
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.table import table
from bench.timer import measure, sync
from memory.model_size import step_flops
from model.attention import get_backend, pick_backend, set_backend
from model.attention_probe import probe_kernel
from model.config import load_config
from model.qwen3 import causal_attention
from model.ulysses_exchange import check_heads

GB = 1e9
ATTN_BWD_FACTOR = inspect.signature(step_flops).parameters["attn_bwd_factor"].default
WARMUP_TOKENS = 16384  # the same kernels as at full length, in a fraction of the time
REL_TOL = 2e-2  # about 5 bf16 rounding steps of the largest value: kernels sum in other orders
OPS = {"flash_attention": "flash", "efficient_attention": "efficient", "cudnn": "cudnn"}
PHASES = ("forward", "recompute", "backward")


def exchange_volumes(config, tokens: int, sp: int, *, bytes_per_elem=2, nvlink_gbps=450.0):
    """Bytes one rank hands all_to_all_single per layer, a row per buffer, and the step's time."""
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if tokens % sp:
        raise ValueError(f"tokens ({tokens}) must be a multiple of sp ({sp})")
    rows = []
    if sp > 1:  # sp=1 exchanges nothing
        check_heads(nh, nkv, sp)
        heads = {"q": nh, "k": max(nkv, sp), "v": max(nkv, sp), "out": nh}  # kv repeated to sp
        for phase in PHASES:
            for t, h in heads.items():
                shape = [sp, 1, tokens // sp, h // sp, hd]
                nbytes = math.prod(shape) * bytes_per_elem
                # seq_to_heads before attention, heads_to_seq after it (backward: the reverse)
                after = (t == "out") == (phase != "backward")
                row = {"phase": phase, "tensor": f"grad {t}" if phase == "backward" else t}
                row.update(op="heads_to_seq" if after else "seq_to_heads", buffer_shape=shape)
                rows.append({**row, "buffer_bytes": nbytes, "sent_bytes": nbytes * (sp - 1) // sp})
    per = {ph: sum(r["sent_bytes"] for r in rows if r["phase"] == ph) for ph in PHASES}
    layer, L = sum(per.values()), config.num_hidden_layers
    out = {"tokens": tokens, "sp": sp, "layers": L, "rows": rows, "nvlink_gbps": nvlink_gbps}
    out.update(sent_per_layer={**per, "total": layer}, sent_per_step=L * layer)
    return {**out, "projected_s_per_step": L * layer / (nvlink_gbps * GB)}


def format_exchange(ex: dict) -> str:
    if not ex["rows"]:
        return f"sp={ex['sp']}: no all-to-all"
    cols = {"phase": "", "tensor": "", "op": "", "buffer_shape": "", "buffer_bytes": ","}
    sent = ", ".join(f"{k} {v / GB:.3g}" for k, v in ex["sent_per_layer"].items())
    return (
        f"all-to-all per rank per layer, sp={ex['sp']}, {ex['tokens']:,} tokens:\n"
        f"{table(ex['rows'], {**cols, 'sent_bytes': ','})}\nGB sent per layer: {sent}; per step "
        f"({ex['layers']} layers) {ex['sent_per_step'] / GB:.3g} GB, PROJECTED "
        f"{ex['projected_s_per_step']:.3g} s at {ex['nvlink_gbps']:g} GB/s (not a measurement)"
    )


class _OpRecorder(TorchDispatchMode):
    """The aten scaled-dot-product ops that run, in the order first seen."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func) and str(func) not in self.ops:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(T: int, hq: int, hkv: int, hd: int, dev: torch.device) -> list:
    """q [1, T, hq, hd], k and v [1, T, hkv, hd] needing grad, an output gradient; N(0, 1)."""
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [(1, T, h, hd) for h in (hq, hkv, hkv, hq)]
    tensors = [torch.randn(s, generator=g, device=dev, dtype=dtype) for s in shapes]
    return [t.requires_grad_() for t in tensors[:3]] + tensors[3:]


def _fwd_bwd(q, k, v, dout) -> tuple:
    """One forward and backward on the pinned backend: (forward s, backward s)."""
    q.grad = k.grad = v.grad = None
    sync(q.device)
    t0 = time.perf_counter()
    out = causal_attention(q, k, v)
    sync(q.device)
    t1 = time.perf_counter()
    out.backward(dout)
    sync(q.device)
    return t1 - t0, time.perf_counter() - t1


def pinned_backend(dev, dtype, hq: int, hkv: int, hd: int, T: int | None = None) -> str:
    """The backend train.py pins for these per-rank shapes (on CUDA after its probe, run here at
    PROBE_TOKENS: the timing that follows runs the kernel at T anyway, and gpu_check's backends
    part probes at the training length as train.py does)."""

    def short_probe(name, *shape, tokens=None):
        return probe_kernel(name, *shape)

    probe = short_probe if torch.device(dev).type == "cuda" else None
    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=hd, seq_len=T, probe=probe)
    return pick_backend(dev, dtype, **kw).name


def _timed(T: int, heads: tuple, dev: torch.device, steps: int, deadline: float) -> dict:
    """Warm up at WARMUP_TOKENS (recording the op), then time at T or at the longest halving of
    T whose estimate fits before `deadline`."""
    Tw = min(WARMUP_TOKENS, T)
    warm = _inputs(Tw, *heads, dev)
    with _OpRecorder() as rec:
        _fwd_bwd(*warm)  # kernels loaded, the op observed
    warm_s = sum(_fwd_bwd(*warm))
    Tm = T
    while Tm > Tw and steps * warm_s * (Tm / Tw) ** 2 > 0.8 * (deadline - time.perf_counter()):
        Tm //= 2  # causal attention time grows as T^2
    try:
        q, k, v, dout = _inputs(Tm, *heads, dev)
        t = measure(functools.partial(_fwd_bwd, q, k, v, dout), dev, warmup=0, repeats=steps)
    except RuntimeError as e:  # out of memory or a kernel limit at full length
        raise RuntimeError(f"at {Tm:,} tokens: {e}") from e
    fwd_s, bwd_s = (min(s[i] for s in t.values) * (T / Tm) ** 2 for i in (0, 1))
    ran = [b for frag, b in OPS.items() if any(frag in op for op in rec.ops)]
    r = {"backend_ops": rec.ops, "backend_ran": ran[0] if ran else "math (no fused op)"}
    r.update(measured_tokens=Tm, extrapolated=Tm != T, fwd_s=fwd_s, bwd_s=bwd_s)
    r["grads_finite"] = all(torch.isfinite(x.grad).all().item() for x in (q, k, v))
    r["act_peak_gb"] = t.peak_bytes / GB if dev.type == "cuda" else None  # over the inputs
    return r


def run(tokens, sp, *, model="qwen3-8b", device="cuda", tiny=False, steps=1, limit_s=None) -> dict:
    """Time one rank's causal attention forward + backward (see the module docstring)."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = load_config("tiny" if tiny else model) if isinstance(model, str) else model
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    check_heads(nh, nkv, sp)
    hq, hkv = nh // sp, max(nkv // sp, 1)  # per rank, after the exchange
    fwd_flops = step_flops(cfg, tokens)["attention_fwd"] / max(cfg.attention_layers, 1) / sp
    r = {"q_shape": [1, tokens, hq, hd], "kv_shape": [1, tokens, hkv, hd], "dtype": str(dtype)}
    r.update(fwd_flops=fwd_flops, bwd_flops=ATTN_BWD_FACTOR * fwd_flops, backend=None)
    r.update(backend_pinned=None, backend_ops=[], backend_errors={})
    t0 = time.perf_counter()
    deadline = t0 + (math.inf if limit_s is None else limit_s)
    try:
        r["backend_pinned"] = pinned_backend(dev, dtype, hq, hkv, hd, tokens)
    except ValueError as e:  # pick_backend refuses: no fused kernel runs these shapes here
        r["backend_errors"]["pinned"] = str(e)
    names = [r["backend_pinned"]]
    if dev.type == "cuda" and names == ["cudnn"]:
        names.append("flash")
    before = get_backend()
    for name in filter(None, names):
        set_backend(name)  # every attention() call runs this kernel, as in training
        try:
            r.update(_timed(tokens, (hq, hkv, hd), dev, steps, deadline), backend=name)
            break
        except RuntimeError as e:
            r["backend_errors"][name] = str(e)[:600]
    set_backend(before)
    if r["backend"] is not None:
        r.update(fwd_bwd_s=r["fwd_s"] + r["bwd_s"], fwd_tflops=fwd_flops / r["fwd_s"] / 1e12)
        r["bwd_tflops"] = r["bwd_flops"] / r["bwd_s"] / 1e12
    return {**r, "wall_s": time.perf_counter() - t0}


def compare_backends(tokens=65536, hq=4, hkv=1, hd=128, *, device="cuda", pair=None) -> dict:
    """The same causal attention forward and backward on two pinned backends (cuDNN against flash
    on CUDA in bf16, cpu_flash against math on CPU in fp32): per tensor (out, dq, dk, dv) max
    |a - b|, the largest reference magnitude and their ratio `rel`; they agree when every
    rel <= REL_TOL. A backend that cannot run is `skipped`, with the reason."""
    dev = torch.device(device)
    q, k, v, dout = _inputs(tokens, hq, hkv, hd, dev)
    pair = pair or (("cudnn", "flash") if dev.type == "cuda" else ("cpu_flash", "math"))
    out = {"tokens": tokens, "q_heads": hq, "kv_heads": hkv, "head_dim": hd, "dtype": str(q.dtype)}
    out.update(backends=list(pair), skipped=None)
    got, before = {}, get_backend()
    try:
        for name in pair:
            pick_backend(dev, q.dtype, num_heads=hq, num_kv_heads=hkv, head_dim=hd, request=name)
            set_backend(name)
            q.grad = k.grad = v.grad = None
            o = causal_attention(q, k, v)
            o.backward(dout)
            got[name] = {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    except (ValueError, RuntimeError) as e:  # ValueError: pick_backend finds it cannot run
        out["skipped"] = (
            f"{name} cannot run {hq} query / {hkv} kv heads of dim {hd} in {q.dtype} at "
            f"{tokens:,} tokens on {dev.type} (torch {torch.__version__}): {e}"
        )[:600]
        return out
    finally:
        set_backend(before)
    out["diffs"] = {}
    for t in ("out", "dq", "dk", "dv"):
        a, b = (got[n][t].float() for n in pair)
        max_abs, ref = (a - b).abs().max().item(), b.abs().max().item()
        out["diffs"][t] = {"max_abs": max_abs, "max_ref": ref, "rel": max_abs / ref}
    out["agree"] = all(d["rel"] <= REL_TOL for d in out["diffs"].values())  # NaN: False
    return out
