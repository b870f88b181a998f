"""An attention kernel checked by running it: one forward and backward in the training layout,
its last rows against an fp32 reference.

    choice = choose_kernel("cuda", torch.bfloat16, config, 1_048_576, 8, probe=probe_kernel)
    choice.name, choice.why                            # "cudnn", or "flash" and why cuDNN was not
    reason = probe_kernel("cudnn", "cuda", torch.bfloat16, 4, 1, 128, tokens=1_048_576)  # None: ok
    q, k, v, dout = training_layout(532_480, 32, 8, 128, torch.bfloat16, "cuda")
    reason = check_attention(functools.partial(attention, backend="flash"), q, k, v, dout)
    way = choose_documents_kernel("cuda", torch.bfloat16, config, 1_048_576, 8, "cudnn",
                                  probe=functools.partial(probe_documents_kernel, backend="cudnn"))

choose_documents_kernel is the same rule for how a row of documents runs ("varlen", else
"segments"), its probe a row of documents with one-token ones among them (probe_documents).
choose_kernel is the one rule train.py (run/build.py) and bench/gpu_check.py choose by: the
candidates pick_backend (model/attention.py) allows, each probed once at the shape this rank's
attention runs in training: after Ulysses' exchange, heads/sp query heads and kv heads/sp (at
least one: repeated) over every token of the row, padded to a multiple of sp. A kernel that runs
at 4K tokens can still fail at 1M (an engine config, a workspace, 32-bit indexing), so the probe
runs at the run's own length: one forward and backward per candidate (at the recipe's shape a few
seconds each on an H100, its q and dout 1 GiB each).

Why run it: torch's checks (can_use_cudnn_attention, ...) look at dtypes, head dims and layouts of
tiny tensors, not at the length or at the strides training hands the kernel. probe_kernel runs
`tokens` tokens (PROBE_TOKENS unless given) with the per-rank head counts in the layout Ulysses'
exchange leaves q, k, v
and the output gradient in: [1, T, heads, hd] contiguous, which attention() hands the kernel as
[1, heads, T, hd] views with strides (T*heads*hd, hd, heads*hd, 1). For cuDNN it first applies
torch's own preference rule (model/attention.py's cudnn_gate).

The reference needs only O(rows x T) work: the last `rows` query rows see every key, so their out
and dq need those rows of q and dout and all of k and v; the last `rows` key rows are seen only by
those same queries, so their dk and dv need nothing more. A kernel that misreads a tile, a stride
or an index past 2^31 elements shows there: bench/gpu_check.py runs check_attention at a length
whose q holds more than 2^31 elements.
"""

from __future__ import annotations

import functools
import math

import torch

from model.attention import (
    BackendChoice,
    attention,
    documents_kernel,
    pick_backend,
    torch_cudnn_gate,
)

__all__ = [
    "PROBE_ROWS",
    "PROBE_TOKENS",
    "PROBE_TOLERANCE",
    "check_attention",
    "choose_documents_kernel",
    "choose_kernel",
    "probe_documents",
    "probe_documents_kernel",
    "last_rows_reference",
    "probe_kernel",
    "rank_attention_shape",
    "training_layout",
]

PROBE_TOKENS = 4104  # 32 full 128-row tiles and a ragged 8-row one; rows pad to a multiple of sp
PROBE_ROWS = 8  # rows checked at the end of the sequence
# of a tensor's largest reference value: bf16 rounding and other summation orders stay near 1e-2,
# a misread tile or index is off by O(1)
PROBE_TOLERANCE = 0.05


def training_layout(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device):
    """Random q, dout [1, T, nh, hd] and k, v [1, T, nkv, hd], contiguous, as training has them."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    heads = (num_heads, num_kv_heads, num_kv_heads, num_heads)
    return [
        torch.randn(1, tokens, h, head_dim, generator=gen, device=device, dtype=dtype)
        for h in heads
    ]


def last_rows_reference(q, k, v, dout, rows: int) -> dict:
    """fp32 out and dq of the last `rows` query rows, dk and dv of the last `rows` key rows, causal:
    each [rows, heads, hd] (dk, dv with the kv heads). q, dout [1, T, nh, hd], k, v [1, T, nkv, hd].
    """
    T, nh, hd = q.shape[1:]
    nkv = k.shape[2]
    g, scale, first = nh // nkv, hd**-0.5, T - rows
    qr = q[0, first:].float().view(rows, nkv, g, hd)  # query head j*g+i shares kv head j
    dor = dout[0, first:].float().view(rows, nkv, g, hd)
    kf, vf = k[0].float(), v[0].float()  # [T, nkv, hd]
    s = torch.einsum("rjgd,tjd->jgrt", qr, kf) * scale  # [nkv, g, rows, T]
    seen = torch.arange(T, device=q.device) <= torch.arange(first, T, device=q.device)[:, None]
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    out = torch.einsum("jgrt,tjd->rjgd", p, vf)
    delta = (dor * out).sum(-1).permute(1, 2, 0)[..., None]  # rowsum(dout * out): [nkv, g, rows, 1]
    ds = p * (torch.einsum("rjgd,tjd->jgrt", dor, vf) - delta) * scale
    dq = torch.einsum("jgrt,tjd->rjgd", ds, kf)
    tail_p, tail_ds = p[..., first:], ds[..., first:]  # [nkv, g, query rows, key rows]
    return {
        "out": out.reshape(rows, nh, hd),
        "dq": dq.reshape(rows, nh, hd),
        "dk": torch.einsum("jgrs,rjgd->sjd", tail_ds, qr),
        "dv": torch.einsum("jgrs,rjgd->sjd", tail_p, dor),
    }


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def check_attention(
    attend, q, k, v, dout, *, rows: int = PROBE_ROWS, tol: float = PROBE_TOLERANCE, last_doc=0
) -> str | None:
    """Run attend(q, k, v) -> out [1, T, nh, hd] forward and backward; None if every result is
    finite and the last rows agree with last_rows_reference within tol, else what went wrong.
    last_doc: where the row's last document starts (documents: the reference sees only it)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        out = attend(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)  # a kernel's own error surfaces here
    except Exception as e:  # a kernel's refusal or failure is the probe's answer, not a crash
        return _one_line(e)
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    tail = (t.detach()[:, last_doc:] for t in (q, k, v, dout))
    ref = last_rows_reference(*tail, rows)
    for name, t in got.items():
        if not torch.isfinite(t).all():
            return f"{name} is not finite"
        want = ref[name]
        err = (t[0, -rows:].float() - want).abs().max() / want.abs().max().clamp_min(1e-30)
        if not err <= tol:
            return f"{name} of the last {rows} rows is off by {err:.3g} of its largest value"
    return None


def probe_kernel(
    name: str,
    device,
    dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    tokens: int | None = None,
    attend=attention,
) -> str | None:
    """pick_backend's probe: None if backend `name` runs this rank's heads at `tokens` tokens in
    the training layout and agrees with the reference, else why not (cuDNN: torch's preference
    rule first). attend(q, k, v, backend=name): the attention under test (tests replace it)."""
    device = torch.device(device)
    gate = torch_cudnn_gate(name, device) if device.type == "cuda" else None
    if gate:
        return gate
    tokens = PROBE_TOKENS if tokens is None else tokens
    q, k, v, dout = training_layout(tokens, num_heads, num_kv_heads, head_dim, dtype, device)
    return check_attention(functools.partial(attend, backend=name), q, k, v, dout)


def probe_documents(tokens: int) -> tuple[int, ...]:
    """Document lengths summing to `tokens` for the documents probe: a one-token document first,
    between two others and second to last, lengths not a multiple of 128, and the longest last
    (the one the reference checks)."""
    head = [1, 131, 1, 1, 77, 1, 1000, 1]
    if tokens < 2 * sum(head):
        return (1, tokens // 2 - 1, 1, tokens - tokens // 2 - 1)
    return (*head, tokens - sum(head))


def probe_documents_kernel(
    name: str,
    device,
    dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    backend: str,
    tokens: int | None = None,
    attend=attention,
) -> str | None:
    """The probe for how documents run (model/attention.py's DOCUMENT_KERNELS: "varlen" or
    "segments"), next to the stream kernel `backend`: a row of probe_documents(tokens) in the
    training layout, forward and backward; None if it runs and agrees, else why not."""
    tokens = PROBE_TOKENS if tokens is None else tokens
    lens = probe_documents(tokens)
    q, k, v, dout = training_layout(tokens, num_heads, num_kv_heads, head_dim, dtype, device)
    attend = functools.partial(attend, backend=backend, doc_lens=lens, documents=name)
    return check_attention(attend, q, k, v, dout, last_doc=tokens - lens[-1])


def choose_documents_kernel(
    device, dtype, config, seq_len: int, sp: int, backend: str, *, probe=None
) -> BackendChoice:
    """How a run of documents (--documents masked) runs them next to stream kernel `backend`:
    "varlen" where documents_kernel allows it (CUDA, flash able to run these heads), else or when
    its probe fails "segments", probed too. probe(name, device, dtype, nh, nkv, hd, tokens=...)
    (train.py: probe_documents_kernel with backend bound, agreed over ranks; None: no probe).
    Raises ValueError (one line) when neither runs."""
    device = torch.device(device)
    shape = rank_attention_shape(config, seq_len, sp)
    tokens = shape.pop("seq_len")
    heads = (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"])
    first = documents_kernel(backend, device, dtype, *heads)
    passed = []
    for name in dict.fromkeys((first, "segments")):
        reason = probe(name, device, dtype, *heads, tokens=tokens) if probe else None
        if reason is None:
            return BackendChoice(name, tuple(passed))
        passed.append(f"{name}: {reason}")
    raise ValueError(
        f"attention: no way to run documents next to the {backend} kernel on {device} "
        f"({'; '.join(passed)}); run with --documents stream or another --attn-backend"
    )


def rank_attention_shape(config, seq_len: int, sp: int) -> dict:
    """What one rank's attention runs on in training, as pick_backend's keywords: heads/sp query
    heads, kv heads/sp (at least one: Ulysses repeats them), head_dim, and every token of the row
    padded to a multiple of sp (the exchange hands each rank all of them). config: a Qwen3Config
    or anything with num_attention_heads, num_key_value_heads and head_dim."""
    return dict(
        num_heads=config.num_attention_heads // sp,
        num_kv_heads=max(config.num_key_value_heads // sp, 1),
        head_dim=config.head_dim,
        seq_len=math.ceil(seq_len / sp) * sp,
    )


def choose_kernel(
    device, dtype, config, seq_len: int, sp: int, *, request: str = "auto", probe=None, **pick
) -> BackendChoice:
    """The attention kernel for a run of seq_len-token rows at sp, each candidate probed once at
    this rank's training shape (rank_attention_shape). probe: pick_backend's probe (train.py
    passes probe_kernel on CUDA, none on CPU, whose kernels are torch's reference: run/build.py's
    kernel_probe); pick: other pick_backend keywords. Raises ValueError (one line) when nothing
    can run."""
    device = torch.device(device)
    shape = rank_attention_shape(config, seq_len, sp)
    return pick_backend(device, dtype, **shape, request=request, probe=probe, **pick)
