"""Causal attention on one pinned kernel, with its log-sum-exp, computed once per layer per step.

    choice = pick_backend(device, torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128)
    set_backend(choice.name)                  # every attention() call now runs this kernel
    out = attention(q, k, v)                  # q [B, T, nh, hd], k, v [B, T, nkv, hd] -> like q
    out = attention(q, k, v, doc_lens=(n1, n2, ...))   # causal within each document of T
    set_documents_kernel("varlen")            # how calls with doc_lens run ("segments": per one)

Backends (`pick_backend` chooses, `BACKENDS` describes):
  cudnn      aten._scaled_dot_product_cudnn_attention: SDPA's own first choice on H100/H200 with
             cuDNN > 9.15.0 (public measurements: near 2x the flash kernel there); grouped kv heads
             natively where torch's checks allow them, else flash is chosen.
  flash      aten._scaled_dot_product_flash_attention (FlashAttention-2): GQA natively; its backward
             keeps an fp32 dq accumulator and expands dk, dv to the query heads internally.
  cpu_flash  aten._scaled_dot_product_flash_attention_for_cpu: what SDPA runs on CPU (bit-equal).
  math       explicit fp32 softmax, O(T^2) memory: CPU, or CUDA at <= MATH_MAX_TOKENS only.
  sdpa       F.scaled_dot_product_attention, torch's pick per call: no lse, so no attention once.
Every backend but sdpa is a forward returning (out, lse) and a backward taking (q, k, v, out, lse):
the pair that lets backward skip attention's forward. Each op takes fewer kv heads than query heads
(query heads g*r .. g*r+g-1 share kv head r), so kv is never expanded here.

Choosing: torch's own checks on tiny tensors say which kernels accept these heads, dtype and
head_dim; torch's preference rule (cudnn_gate) says whether cuDNN is first; a probe, where given
(model/attention_probe.py's choose_kernel passes probe_kernel on CUDA), runs each candidate once
at the run's own per-rank layout and length and passes over one that fails, naming why.

Attention once. Whole-layer checkpointing runs a layer's forward twice (forward, and again in
backward); at a million tokens attention is ~96% of a layer's FLOPs, so the second run is ~21% of
the step. The checkpoint wrapper (model/checkpoint_offload.py) passes an `AttentionStore` to the
attention() calls of a layer's body: the first run keeps each call's (out, lse) in it (on the host
when offloading); a recompute (store.begin(replaying=True)) gets them back instead of running the
kernel, and still rebuilds q, k, v (a few percent of the layer), so the attention backward gets
(q, k, v, out, lse) as if nothing had been dropped. Nothing here imports torch.distributed.

Documents (doc_lens): causal within each document of the row. On CUDA ("varlen") one flash call
with cumulative lengths (aten._flash_attention_forward / _backward) per layer and direction takes
every document: no kernel, graph or kept state per document. Elsewhere ("segments") the stream's
kernel runs once per document into one out and lse; a one-token document takes a closed form
(out = v), as cuDNN's backward refuses s_q = s_kv = 1. Either way (out, lse) are laid out as one
call's, so attention once keeps them as for a single sequence.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = [
    "BACKENDS",
    "CUDNN_PREFERRED_ABOVE",
    "MATH_MAX_TOKENS",
    "AttentionStore",
    "DOCUMENT_KERNELS",
    "BackendChoice",
    "attention",
    "cumulative_lengths",
    "documents_kernel",
    "get_documents_kernel",
    "cudnn_gate",
    "get_backend",
    "pick_backend",
    "saved_attention_bytes",
    "set_backend",
    "set_documents_kernel",
    "torch_cudnn_gate",
]

BACKENDS = {
    "cudnn": "cuDNN attention",
    "flash": "FlashAttention-2",
    "cpu_flash": "CPU flash attention",
    "math": "explicit fp32 softmax",
    "sdpa": "torch's per-call SDPA choice (no attention-once)",
}
MATH_MAX_TOKENS = 8192  # [heads, T, T] fp32 scores: 1 GiB per 4 heads at 8192 tokens
# torch prefers cuDNN attention only above cuDNN 9.15.0: 9.15.1 fixed reads out of bounds at
# lengths not a multiple of 128 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
# check_prefer_cudnn_attention; cuDNN versions read as major*10000 + minor*100 + patch)
CUDNN_PREFERRED_ABOVE = 91500


# ---------------------------------------------------------------------------------------------
# Choosing the kernel
# ---------------------------------------------------------------------------------------------
def _torch_can_use(
    name: str, device: torch.device, dtype: torch.dtype, nh: int, nkv: int, hd: int
) -> bool:
    """Ask torch whether `name` runs these head counts, on tiny tensors (with grad) on `device`."""
    if name == "math":
        return dtype.is_floating_point
    if device.type == "cuda" and not torch.cuda.is_available():
        return False
    # On real tensors even under FakeTensorMode (train.py --rehearse): asked about fake ones,
    # torch answers "math" for every shape, whose [T, T] scores a rehearsal would then count.
    with unset_fake_temporarily():
        return _torch_checks(name, device, dtype, nh, nkv, hd)


def _torch_checks(name, device, dtype, nh, nkv, hd) -> bool:
    shape = (1, 128, hd)  # the checks look at heads, head_dim, dtype, layout: not at the length
    q, k, v = (
        torch.zeros(shape[0], h, *shape[1:], device=device, dtype=dtype, requires_grad=True)
        for h in (nh, nkv, nkv)
    )
    if name == "cpu_flash":
        from torch.nn.attention import SDPBackend

        return device.type == "cpu" and torch._fused_sdp_choice(
            q, k, v, is_causal=True, enable_gqa=nh != nkv
        ) == int(SDPBackend.FLASH_ATTENTION)
    if device.type != "cuda":
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, nh != nkv)
    if name == "cudnn":
        return torch.backends.cudnn.is_available() and torch.backends.cuda.can_use_cudnn_attention(
            params, False
        )
    if name == "flash":  # the dispatcher pads head_dim to a multiple of 8 for flash; we do not
        return hd % 8 == 0 and torch.backends.cuda.can_use_flash_attention(params, False)
    return False


def _version(v: int | None) -> str:
    return "none" if not v else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def cudnn_gate(
    cudnn_version: int | None, capability: tuple[int, int], cuda_version: str | None
) -> str | None:
    """Why torch would not put cuDNN attention first on this GPU (None: it would).

    torch's rule: cuDNN above 9.15.0, on sm90 or sm100 (Hopper, Blackwell datacenter); with CUDA
    before 13 only on minor 0 or 3 of those. cudnn_version as torch.backends.cudnn.version()
    gives it, capability as torch.cuda.get_device_capability(), cuda_version as torch.version.cuda.
    """
    if not cudnn_version or cudnn_version <= CUDNN_PREFERRED_ABOVE:
        return (
            f"cuDNN {_version(cudnn_version)}: torch prefers cuDNN attention only above 9.15.0 "
            f"(9.15.1 fixed lengths not a multiple of 128)"
        )
    major, minor = capability
    cuda_major = int(cuda_version.split(".")[0]) if cuda_version else 0
    if major not in (9, 10) or (cuda_major < 13 and minor not in (0, 3)):
        return f"sm{major}{minor}, CUDA {cuda_version}: torch prefers cuDNN attention on sm90/sm100"
    return None


def torch_cudnn_gate(name: str, device: torch.device, *shape, tokens=None) -> str | None:
    """A probe (see pick_backend) that runs nothing: cudnn_gate on `device` for "cudnn"."""
    if name != "cudnn":
        return None
    cap = torch.cuda.get_device_capability(device)
    return cudnn_gate(torch.backends.cudnn.version(), cap, torch.version.cuda)


@dataclass(frozen=True)
class BackendChoice:
    """pick_backend's answer: the backend, and why each one tried before it was passed over."""

    name: str
    passed_over: tuple[str, ...] = ()  # "cudnn: <reason>", in the order tried

    @property
    def why(self) -> str:
        return "; ".join(self.passed_over)


def pick_backend(
    device,
    dtype: torch.dtype,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int | None = None,
    request: str = "auto",
    can_use=None,
    probe=None,
) -> BackendChoice:
    """The attention backend for these shapes: "cudnn" else "flash" on CUDA, "cpu_flash" on CPU.

    The math fallback is taken only on CPU or, on CUDA, when seq_len <= MATH_MAX_TOKENS (tests,
    smoke runs); at training lengths a CUDA run with neither fused kernel is refused, never slowed
    down silently. request: "auto" or a name in BACKENDS, which must then be able to run.
    can_use(name, device, dtype, num_heads, num_kv_heads, head_dim) -> bool replaces torch's checks
    (tests inject it to exercise the CUDA rules on CPU). probe(name, device, dtype, num_heads,
    num_kv_heads, head_dim, tokens=seq_len) -> None, or why `name` must not be used here: called
    for each candidate torch's checks accept, at the length attention runs (None: no probe, no
    preference rule).
    """
    device = torch.device(device)
    can_use = can_use or _torch_can_use
    what = (
        f"{dtype} with {num_heads} query / {num_kv_heads} kv heads of dim {head_dim} on {device} "
        f"(torch {torch.__version__})"
    )
    shape = (device, dtype, num_heads, num_kv_heads, head_dim)
    if request not in ("auto", *BACKENDS):
        raise ValueError(
            f"attention backend {request!r} is unknown; pick one of auto, {', '.join(BACKENDS)}"
        )
    if request == "sdpa":
        return BackendChoice("sdpa")
    if request != "auto":
        if (
            request in ("cudnn", "flash")
            and device.type != "cuda"
            or request == "cpu_flash"
            and device.type != "cpu"
        ):
            raise ValueError(
                f"attention backend {request!r} does not run on {device.type}; "
                f"use --attn-backend auto"
            )
        if not can_use(request, *shape):
            raise ValueError(
                f"attention backend {request!r} cannot run {what}; use --attn-backend auto"
            )
        reason = probe(request, *shape, tokens=seq_len) if probe else None
        if reason:
            raise ValueError(
                f"attention backend {request!r} failed its probe on {what}: {reason}; "
                f"use --attn-backend auto"
            )
        return BackendChoice(request)
    passed = []
    for name in ("cudnn", "flash") if device.type == "cuda" else ("cpu_flash",):
        reason = None if can_use(name, *shape) else "torch's checks refuse these shapes"
        reason = reason or (probe(name, *shape, tokens=seq_len) if probe else None)
        if reason is None:
            return BackendChoice(name, tuple(passed))
        passed.append(f"{name}: {reason}")
    if device.type == "cpu" or (seq_len is not None and seq_len <= MATH_MAX_TOKENS):
        return BackendChoice("math", tuple(passed))
    raise ValueError(
        f"attention: neither cuDNN nor flash attention can run {what} ({'; '.join(passed)}), "
        f"and the math fallback (O(T^2) memory) stops at {MATH_MAX_TOKENS} tokens; train in "
        f"bfloat16 with head_dim a multiple of 8 (<= 256) on an sm80+ GPU, or pick "
        f"--attn-backend sdpa (torch's choice, no attention-once)"
    )


_PINNED: str | None = None  # set_backend's choice; None: pick per shape, the first time it is seen


def set_backend(name: str | None) -> None:
    """Pin every attention() call to one backend (None: choose automatically per shape)."""
    global _PINNED
    if name is not None and name not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown; pick one of {', '.join(BACKENDS)}"
        )
    _PINNED = name


def get_backend() -> str | None:
    return _PINNED


DOCUMENT_KERNELS = {
    "varlen": "flash attention with cumulative lengths: every document of a row in one call",
    "segments": "the stream's kernel once per document (a one-token one in closed form)",
}
_DOCUMENTS_PINNED: str | None = None  # set_documents_kernel's choice; None: documents_kernel's


def set_documents_kernel(name: str | None) -> None:
    """Pin how every attention() call with doc_lens runs (None: documents_kernel's pick)."""
    global _DOCUMENTS_PINNED
    if name is not None and name not in DOCUMENT_KERNELS:
        raise ValueError(
            f"documents kernel {name!r} is unknown; pick one of {', '.join(DOCUMENT_KERNELS)}"
        )
    _DOCUMENTS_PINNED = name


def get_documents_kernel() -> str | None:
    return _DOCUMENTS_PINNED


@functools.lru_cache(maxsize=64)
def _auto_backend(
    device: torch.device, dtype, nh: int, nkv: int, hd: int, short: bool, flags
) -> str:
    seq_len = 1 if short else None
    kw = dict(num_heads=nh, num_kv_heads=nkv, head_dim=hd, seq_len=seq_len)
    probe = torch_cudnn_gate if device.type == "cuda" else None  # torch's rule, nothing run
    return pick_backend(device, dtype, **kw, probe=probe).name


def _sdp_flags() -> tuple:
    """torch's SDPA switches (set by torch.nn.attention.sdpa_kernel), which the automatic choice
    follows."""
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.math_sdp_enabled()


def saved_attention_bytes(
    tokens: int, num_heads: int, head_dim: int, dtype_bytes: int, sp: int = 1, batch: int = 1
) -> int:
    """Bytes attention-once keeps per layer per GPU: out [B, T, nh/sp, hd] + fp32 lse [B, nh/sp, T].

    T is the whole sequence (Ulysses splits heads, not tokens, around attention). Qwen3-8B at
    1,048,576 tokens, sp=8, bf16: 1,048,576 x 4 x (128 x 2 + 4) = 1.02 GiB.
    """
    return batch * tokens * (num_heads // sp) * (head_dim * dtype_bytes + 4)


def backward_workspace_bytes(tokens: int, heads: int, head_dim: int, batch: int = 1) -> int:
    """GPU memory the fused attention backward allocates inside itself, per GPU: FlashAttention-2
    keeps dq as an fp32 accumulator [B, T rounded up to 128, heads, head_dim rounded up to 32]
    and the softmax delta in fp32 [B, heads, T]. A CPU kernel has none of it.
    Qwen3-8B, 1,048,576 tokens, 4 heads per GPU: 2.15 GB."""
    rounded_t = math.ceil(tokens / 128) * 128
    rounded_d = math.ceil(head_dim / 32) * 32
    return batch * rounded_t * heads * (rounded_d + 1) * 4


# flash's variable-length backward (mha_varlen_bwd) keeps 128 rows between documents in its fp32
# dq accumulator and softmax delta: the largest block along the queries, so no bounds checks
VARLEN_PAD_ROWS = 128


def varlen_backward_workspace_bytes(tokens: int, documents: int, heads: int, head_dim: int) -> int:
    """What flash's variable-length backward allocates inside itself for `documents` documents of
    `tokens` tokens in all, on `heads` query heads: the fp32 dq accumulator [tokens + 128 x
    documents, heads, head_dim rounded up to 32] and softmax delta [heads, tokens + 128 x
    documents]. The 128 rows are per document: Qwen3-8B at sp 8 (4 heads of 128) pays 264,192
    bytes (258 KiB) a document. Its dk and dv expanded to the query heads (when they outnumber
    the kv heads) come on top, [tokens, heads, head_dim] each in the compute dtype."""
    rounded_d = math.ceil(head_dim / 32) * 32
    return (tokens + VARLEN_PAD_ROWS * documents) * heads * (rounded_d + 1) * 4


# ---------------------------------------------------------------------------------------------
# Forward (out, lse) and backward (q, k, v, out, lse) of each backend; tensors are [B, heads, T, hd]
# ---------------------------------------------------------------------------------------------
def _forward(backend: str, q, k, v):
    """-> (out [B, nh, T, hd], lse [B, nh, T] fp32 (cuDNN: [B, nh, T, 1]), aux for the backward)."""
    aten = torch.ops.aten
    if backend == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out, lse, None
    if backend == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    if backend == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    if backend == "math":
        return (*_math_forward(q, k, v), None)
    raise ValueError(
        f"attention backend {backend!r} has no (out, lse) forward; pick one of cudnn, flash, "
        f"cpu_flash, math (sdpa cannot keep attention for the backward)"
    )


def _backward(backend: str, dout, q, k, v, out, lse, aux):
    aten = torch.ops.aten
    if backend in ("flash", "cudnn") and dout.stride() != out.stride():
        dout = torch.empty_like(out).copy_(
            dout
        )  # the fused CUDA backwards want dout laid out like out
    if backend == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True
        )
    if backend == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset
        )
    if backend == "cudnn":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True
        )
    return _math_backward(dout, q, k, v, out, lse)


def _grouped(q, k):
    """q [B, nh, T, hd] -> [B, nkv, g, T, hd]; k [B, nkv, T, hd] -> [B, nkv, 1, T, hd]."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    return q.reshape(B, nkv, nh // nkv, T, hd), k.unsqueeze(2)


def _acc(t):
    return t.to(torch.promote_types(t.dtype, torch.float32))  # fp32 (fp64 stays fp64)


def _math_probs(q, k, lse=None):
    """Causal scores in fp32 and (with lse) the probabilities; [B, nkv, g, T, T]."""
    qg, kg = _grouped(q, k)
    s = (_acc(qg) @ _acc(kg).transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s if lse is None else torch.exp(s - lse.reshape(*qg.shape[:-1], 1))


def _math_forward(q, k, v):
    s = _math_probs(q, k)
    lse = torch.logsumexp(s, dim=-1)  # [B, nkv, g, T]
    out = torch.exp(s - lse[..., None]) @ _acc(v).unsqueeze(2)  # [B, nkv, g, T, hd]
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:-1])


def _math_backward(dout, q, k, v, out, lse):
    p = _math_probs(q, k, lse)  # [B, nkv, g, T, T]
    do = _acc(_grouped(dout, k)[0])  # [B, nkv, g, T, hd]
    delta = (do * _acc(_grouped(out, k)[0])).sum(-1, keepdim=True)  # rowsum(dout * out)
    dv = (p.transpose(-1, -2) @ do).sum(2)  # [B, nkv, T, hd], summed over the group
    ds = p * (do @ _acc(v).unsqueeze(2).transpose(-1, -2) - delta) * (q.shape[-1] ** -0.5)
    dq = ds @ _acc(k).unsqueeze(2)  # [B, nkv, g, T, hd]
    dk = (ds.transpose(-1, -2) @ _acc(_grouped(q, k)[0])).sum(2)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Attention kept from the forward for the backward
# ---------------------------------------------------------------------------------------------
class AttentionStore:
    """The (out, lse) of each attention() call in one run of a layer body, for its later runs:
    attention(..., store=store) keeps them in the forward and, once begin(replaying=True) says
    a run is a recompute, hands them back instead of running the kernel.

    keep(t) -> handle and fetch(handle) -> t move a kept tensor away and back (the offload pool's
    host copies); by default they keep it where it is. One store per layer call: it lives as long
    as checkpoint's recompute closure, i.e. as long as the layer's part of the autograd graph.
    model/checkpoint_offload.py's LayerReplay owns it and says which run is which.
    """

    def __init__(self, keep=None, fetch=None):
        self.keep = keep or (lambda t: t)
        self.fetch = fetch or (lambda h: h)
        self.kept: list = []  # [(out handle, lse handle, their memory orders)] in call order
        self.replaying = False  # this run is a recompute: hand back, do not keep
        self.i = 0  # attention calls so far in the current run

    def begin(self, *, replaying: bool) -> None:
        """A run of the layer body starts: the forward (replaying=False) or a recompute."""
        self.replaying, self.i = replaying, 0

    def put(self, out, lse) -> None:
        """Keep out and lse, each contiguous in its own memory order (a host copy then round-trips
        the kernel's strides, whatever they are)."""
        out, lse = (
            out.detach(),
            lse.detach(),
        )  # no reference to the graph (it references this store)
        orders = [_dense_order(t) for t in (out, lse)]
        self.kept.append(
            (self.keep(out.permute(orders[0])), self.keep(lse.permute(orders[1])), orders)
        )
        self.i += 1

    def take(self):
        if self.i >= len(self.kept):
            raise RuntimeError(
                f"attention-once: the recompute made attention call {self.i + 1} but the forward "
                f"made {len(self.kept)}; the layer body must call attention the same way each run"
            )
        out, lse, (o_order, l_order) = self.kept[self.i]
        self.i += 1
        return self.fetch(out).permute(_inverse(o_order)), self.fetch(lse).permute(
            _inverse(l_order)
        )


def _dense_order(t: torch.Tensor) -> list:
    """The dims of t from outermost to innermost in memory: t.permute(order) is contiguous."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _inverse(order: list) -> list:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


class _AttentionCore(torch.autograd.Function):
    """Causal attention on [B, heads, T, hd] views; saves (q, k, v, out, lse) for its backward.
    With doc_lens, causal attention within each document's segment of T: `documents` "varlen"
    (one flash call) or "segments" (the backend's kernel on each, see _segments_forward)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, doc_lens=None, store=None, documents="segments"):
        if store is not None and store.replaying:
            out, lse = store.take()  # the recompute: the forward's results, no kernel
        else:
            if doc_lens is None:
                out, lse, aux = _forward(backend, q, k, v)
            else:
                out, lse, aux = _documents_forward(documents, backend, q, k, v, doc_lens)
            ctx.aux = aux
            if store is not None:
                store.put(out, lse)
        ctx.backend, ctx.doc_lens, ctx.documents = backend, doc_lens, documents
        ctx.save_for_backward(
            q, k, v, out, lse
        )  # same tensors, same order, in forward and recompute
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.doc_lens is None:
            dq, dk, dv = _backward(ctx.backend, dout, q, k, v, out, lse, ctx.aux)
        else:
            dq, dk, dv = _documents_backward(ctx, dout, q, k, v, out, lse)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Documents: causal attention within each segment of the sequence
# ---------------------------------------------------------------------------------------------
def _segments(doc_lens) -> list[tuple[int, int]]:
    """[(start, end)] of each document along T; doc_lens sum to T (empty ones are skipped)."""
    bounds, start = [], 0
    for n in doc_lens:
        if n > 0:
            bounds.append((start, start + n))
        start += n
    return bounds


@functools.lru_cache(maxsize=64)  # attention() asks on every call with doc_lens when unpinned
def documents_kernel(backend: str, device, dtype, nh: int, nkv: int, hd: int) -> str:
    """The documents kernel that goes with stream kernel `backend` when none is pinned: "varlen"
    (flash with cumulative lengths) on CUDA where torch's checks let flash run these shapes,
    else "segments"."""
    device = torch.device(device)
    if backend in ("cudnn", "flash") and device.type == "cuda":
        if _torch_can_use("flash", device, dtype, nh, nkv, hd):
            return "varlen"
    return "segments"


def _documents_forward(kernel: str, backend: str, q, k, v, doc_lens):
    if kernel == "varlen":
        return _varlen_forward(q, k, v, doc_lens)
    return _segments_forward(backend, q, k, v, doc_lens)


def _documents_backward(ctx, dout, q, k, v, out, lse):
    if ctx.documents == "varlen":
        return _varlen_backward(ctx.aux, dout, q, k, v, out, lse)
    return _segments_backward(ctx, dout, q, k, v, out, lse)


# The row's cumulative lengths: (key, pinned host tensor, device tensor) of the last row seen.
# Every layer's call, each recompute and each backward of that row take the same device tensor;
# the host one stays referenced until the next row, so its copy cannot be overwritten in flight.
_ROW_LENGTHS: list = []


def cumulative_lengths(doc_lens, batch: int, device) -> torch.Tensor:
    """int32 [batch * documents + 1]: where each document of each row starts in the rows laid end
    to end, then the total (flash's cum_seq_q / cum_seq_k). Empty documents are dropped. Built
    once a row: in pinned host memory on CUDA, copied without blocking (a copy from pageable
    memory would wait for the GPU, every layer), and handed back to every call with the same
    row until another row comes."""
    device = torch.device(device)
    key = (tuple(doc_lens), batch, device, detect_fake_mode())  # a rehearsal's: its own tensor
    if _ROW_LENGTHS and _ROW_LENGTHS[0] == key:
        return _ROW_LENGTHS[2]
    lens = [n for n in doc_lens if n > 0] * batch
    host = torch.zeros(len(lens) + 1, dtype=torch.int32, pin_memory=device.type == "cuda")
    host[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    _ROW_LENGTHS[:] = [key, host, _lengths_to_device(host, device)]
    return _ROW_LENGTHS[2]


def _lengths_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The one host-to-device copy of a row's cumulative lengths."""
    return host.to(device, non_blocking=True)


def _packed(t):
    """[B, heads, T, hd] (a view of [B, T, heads, hd]) -> [B * T, heads, hd], contiguous."""
    B, h, T, hd = t.shape
    return t.transpose(1, 2).reshape(B * T, h, hd).contiguous()


def _varlen_forward(q, k, v, doc_lens):
    """Every document of every row in one flash call with cumulative lengths: out laid out as
    q [B, nh, T, hd] (a view of [B, T, nh, hd]) and lse [B, nh, T] fp32, as one call's; aux
    (cumulative lengths, the longest document, flash's rng state) for the backward."""
    B, nh, T, hd = q.shape
    cum = cumulative_lengths(doc_lens, B, q.device)
    longest = max(doc_lens)
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        _packed(q), _packed(k), _packed(v), cum, cum, longest, longest, 0.0, True, False
    )
    if tuple(lse.shape) != (nh, B * T):  # flash's varlen lse is [heads, tokens]
        raise RuntimeError(
            f"flash attention's variable-length log-sum-exp came back {tuple(lse.shape)}, "
            f"not [heads, tokens] = [{nh}, {B * T}]"
        )
    out = out.view(B, T, nh, hd).transpose(1, 2)  # [B, nh, T, hd], q's memory order
    lse = lse.view(nh, B, T).transpose(0, 1)  # [B, nh, T]
    return out, lse, (cum, longest, rng, unused)


def _varlen_backward(aux, dout, q, k, v, out, lse):
    """flash's variable-length backward on the packed rows; dq, dk, dv as [B, heads, T, hd]."""
    cum, longest, rng, unused = aux
    B, nh, T, hd = q.shape
    lse_packed = lse.transpose(0, 1).reshape(nh, B * T).contiguous()  # back to [heads, tokens]
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _packed(dout),
        _packed(q),
        _packed(k),
        _packed(v),
        _packed(out),
        lse_packed,
        cum,
        cum,
        longest,
        longest,
        0.0,
        True,
        rng,
        unused,
    )
    return (g.view(B, T, *g.shape[1:]).transpose(1, 2) for g in (dq, dk, dv))


def _one_token_forward(q, k, v):
    """A one-token causal segment: its query sees its own key only, so out is v (repeated to the
    query heads) and lse is the one score. No kernel: cuDNN's backward refuses s_q = s_kv = 1."""
    g = q.shape[1] // k.shape[1]
    score = (_acc(q) * _acc(k).repeat_interleave(g, dim=1)).sum(-1) * q.shape[-1] ** -0.5
    return v.repeat_interleave(g, dim=1), score  # [B, nh, 1, hd], [B, nh, 1]


def _one_token_backward(dout, q, k, v):
    """out = v does not depend on q or k: dq = dk = 0, and dv sums dout over each kv head's
    query heads."""
    B, nkv = k.shape[:2]
    dv = dout.reshape(B, nkv, -1, *dout.shape[2:]).sum(2)
    return torch.zeros_like(q), torch.zeros_like(k), dv.to(v.dtype)


def _segments_forward(backend: str, q, k, v, doc_lens):
    """The kernel run on each document's [s, e) of T, its out and lse written into one out like
    q (the same layout as one call's) and one lse [B, nh, T(, 1)]: attention once keeps the pair
    as it keeps a single call's. aux: each segment's own, for its backward. A one-token segment
    takes _one_token_forward, which every backend agrees with."""
    B, nh, T, _ = q.shape
    out = torch.empty_like(q)  # [B, nh, T, hd], q's memory layout
    trailing = (1,) if backend == "cudnn" else ()  # cuDNN's lse is [B, nh, T, 1]
    lse = torch.empty((B, nh, T, *trailing), dtype=_acc(q[:0]).dtype, device=q.device)
    auxes = []
    for s, e in _segments(doc_lens):
        one = (q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])
        if e - s == 1:
            (o, l_seg), aux = _one_token_forward(*one), None
        else:
            o, l_seg, aux = _forward(backend, *one)
        out[:, :, s:e].copy_(o)
        lse[:, :, s:e].copy_(l_seg.reshape(lse[:, :, s:e].shape))
        auxes.append(aux)
        del o, l_seg
    return out, lse, auxes


def _segments_backward(ctx, dout, q, k, v, out, lse):
    """Each segment's backward on its slices of (dout, q, k, v, out, lse), written into dq, dk,
    dv laid out like q, k, v."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for (s, e), aux in zip(_segments(ctx.doc_lens), ctx.aux, strict=True):
        one = (dout[:, :, s:e], q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])
        if e - s == 1:
            grads = _one_token_backward(*one)
        else:
            # lse [B, nh, e - s]: the kernels read it densely
            grads = _backward(ctx.backend, *one, out[:, :, s:e], lse[:, :, s:e].contiguous(), aux)
        for whole, part in zip((dq, dk, dv), grads, strict=True):
            whole[:, :, s:e].copy_(part)
        del grads
    return dq, dk, dv


def _sdpa_segments(q, k, v, doc_lens, gqa: bool):
    """torch's SDPA, causal within each document; [B, heads, T, hd] views in and out."""
    outs = [
        F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=gqa
        )
        for s, e in _segments(doc_lens)
    ]
    return torch.cat(outs, dim=2)  # [B, nh, T, hd]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str | None = None,
    doc_lens: tuple[int, ...] | None = None,
    store: AttentionStore | None = None,
    documents: str | None = None,
) -> torch.Tensor:
    """Causal attention. q [B, T, nh, hd], k and v [B, T, nkv, hd] -> [B, T, nh, hd].

    Runs the pinned backend (set_backend), else the one pick_backend chooses for these shapes
    (which respects torch.nn.attention.sdpa_kernel, as torch's checks do).
    With a store it keeps (forward) or replays (recompute) its (out, lse).
    doc_lens (ints summing to T): T is documents one after another, and each token attends only
    to the tokens of its own document before it. documents: how ("varlen": one flash call with
    cumulative lengths; "segments": the backend's kernel once per document), else the pinned
    one (set_documents_kernel), else documents_kernel's pick.
    """
    B, T, nh, hd = q.shape
    nkv = k.shape[2]
    if nh % nkv:
        raise ValueError(f"attention: {nh} query heads are not a multiple of {nkv} kv heads")
    if doc_lens is not None and sum(doc_lens) != T:
        raise ValueError(f"attention: documents of {sum(doc_lens)} tokens in all, for T={T}")
    if doc_lens is not None and len(doc_lens) == 1:
        doc_lens = None  # one document is the whole sequence: the plain call
    backend = (
        backend
        or _PINNED
        or _auto_backend(q.device, q.dtype, nh, nkv, hd, T <= MATH_MAX_TOKENS, _sdp_flags())
    )
    if backend == "sdpa":
        if store is not None:
            raise RuntimeError(
                "attention-once needs a backend that returns the log-sum-exp; backend 'sdpa' "
                "does not: pin another one, or run with --no-save-attention"
            )
        if doc_lens is not None:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
            return _sdpa_segments(qt, kt, vt, doc_lens, nh != nkv).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=nh != nkv,
        )
        return out.transpose(1, 2)
    if doc_lens is not None:
        documents = (
            documents
            or _DOCUMENTS_PINNED
            or documents_kernel(backend, q.device, q.dtype, nh, nkv, hd)
        )
    out = _AttentionCore.apply(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend, doc_lens, store, documents
    )  # [B, nh, T, hd]
    return out.transpose(1, 2)  # [B, T, nh, hd]
