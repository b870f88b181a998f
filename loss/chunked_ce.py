"""Cross-entropy over a large vocabulary, computed in row chunks so the logits never exist whole.

To use it elsewhere: copy this file alone; it needs torch only. docs/pieces.md applies it to
transformers' Qwen3ForCausalLM.

    loss_sum = chunked_cross_entropy(hidden, lm_head.weight, labels)   # [N, H], [V, H], [N]
    loss = group_mean_loss(loss_sum, labels, group)   # / the labels counted on every rank
    per_token = token_losses(hidden, lm_head.weight, labels)   # [N], forward only (evaluation)

For one row h [H] with logits z = W h [V] and label t:

    loss  = logsumexp(z) - z[t]
    dL/dz = softmax(z) - onehot(t) =: p            [V]
    dL/dh = p @ W                                   [H]
    dL/dW = outer(p, h), summed over rows          [V, H]

Once p is known both gradients are one matrix product away, so the forward pass computes them
chunk by chunk (three products per chunk: z = h W^T, p W, p^T h) and backward only scales them
by the incoming gradient; recomputing the logits in backward would cost a fourth product.

Products run in the input dtype (bf16 on tensor cores) with fp32 accumulation, log-softmax in
fp32, and the weight gradient is accumulated over chunks in fp32 and cast once. Memory: two
[chunk, V] fp32 buffers (logits, log-probabilities) and p in bf16 for bf16 inputs, the [N, H]
hidden gradient and the [V, H] fp32 weight-gradient accumulator; never anything [N, V]. The
forward-only path (token_losses, for evaluation) keeps the two fp32 buffers and the losses only.

Over several ranks (data parallel, or a row split by sequence parallelism) the mean is the sum of
every rank's loss over the labels counted on all of them, not the mean of the ranks' means: those
differ whenever the ranks count different numbers of labels (padding, a prompt left out, the
row's last token).
"""

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_FUSED = {}  # device type -> (mm takes out_dtype, addmm takes out_dtype with an fp32 accumulator)


def fused_ops(device):
    """Whether torch.mm and an in-place torch.addmm take bf16 operands with an fp32 output here
    (CUDA does; CPU does not). Checked once per device type, on sums that bf16 cannot hold."""
    if device.type not in _FUSED:
        _FUSED[device.type] = _run_fused_ops(device)
    return _FUSED[device.type]


def _run_fused_ops(device) -> tuple[bool, bool]:
    a = torch.tensor([[1.0, 2.0**-8]], dtype=torch.bfloat16, device=device)  # [1, 2]
    b = torch.ones(2, 1, dtype=torch.bfloat16, device=device)
    out = torch.empty(1, 1, device=device)
    found = []
    for op, want in (
        (lambda: torch.mm(a, b, out_dtype=torch.float32, out=out), 1 + 2.0**-8),
        (
            lambda: torch.addmm(out.fill_(1 + 2.0**-12), a, b, out_dtype=torch.float32, out=out),
            2 + 2.0**-8 + 2.0**-12,
        ),
    ):
        try:
            found.append(op().item() == want)
        except (RuntimeError, NotImplementedError, TypeError):
            found.append(False)
    return tuple(found)


def _logits_fp32(h, weight, out, low: bool, fused_mm: bool) -> torch.Tensor:
    """out[c, V] = h @ weight.T in fp32: straight out of the bf16 GEMM where torch can, else one
    upcast of the bf16 product."""
    if not low:
        return torch.mm(h, weight.T, out=out)
    if fused_mm:
        return torch.mm(h, weight.T, out_dtype=torch.float32, out=out)
    return out.copy_(torch.mm(h, weight.T))


def _add_weight_grad(grad_w, p, h, low: bool, fused_addmm: bool) -> None:
    """grad_w[V, H] (fp32) += p.T @ h. For bf16 the best is one GEMM that reads bf16 operands and
    accumulates into the fp32 buffer in place (addmm with out_dtype, on CUDA). Without it, round
    each chunk's bf16 product once and add it in fp32: still fp32 across chunks, at the cost of a
    [V, H] bf16 temporary. Upcasting the weight, or keeping the accumulator in bf16, is what we
    must not do."""
    if not low:
        grad_w.addmm_(p.T, h)
    elif fused_addmm:
        torch.addmm(grad_w, p.T, h, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w.add_(torch.mm(p.T, h))


def _chunk_pass(hidden, weight, labels, chunk_size, ignore_index, need_h, need_w):
    """The one pass over row chunks: (losses [n] of the n counted rows, their row indices, the
    hidden gradient or None, the fp32 weight-gradient accumulator or None). With neither gradient
    (evaluation) it keeps only the two [chunk, V] fp32 buffers and the losses."""
    n_rows, dim = hidden.shape
    vocab = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    low = dtype in _LOW_PRECISION
    fused_mm, fused_addmm = fused_ops(device) if low else (False, False)

    # Ignored rows cost nothing: only the rows that count enter the products.
    labels = labels.long()
    if ignore_index is None:  # the caller says every label counts: no scan, no host sync
        rows = torch.arange(n_rows, device=device)  # [n], as the scan would give
    else:
        rows = (labels != ignore_index).nonzero().squeeze(1)  # [n]
    n = rows.numel()
    dense = n == n_rows  # every row counts: chunks are plain slices, no gathers

    grad_h = grad_w = None
    if need_h:
        grad_h = (torch.empty if dense else torch.zeros)(n_rows, dim, dtype=dtype, device=device)
    if need_w:
        grad_w = torch.zeros(vocab, dim, dtype=acc, device=device)
    losses = torch.empty(n, dtype=acc, device=device)

    # Buffers reused by every chunk (a fresh [C, V] per chunk costs page faults on CPU).
    c_max = min(chunk_size, n)
    z_buf = torch.empty(c_max, vocab, dtype=acc, device=device)  # logits
    l_buf = torch.empty_like(z_buf)  # log-probabilities (and p, for fp32 inputs)
    p_buf = None
    if low and (need_h or need_w):
        p_buf = torch.empty(c_max, vocab, dtype=dtype, device=device)

    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        c = e - s
        if dense:
            h, t = hidden[s:e], labels[s:e]
        else:
            idx = rows[s:e]
            h, t = hidden.index_select(0, idx), labels.index_select(0, idx)
        t = t.unsqueeze(1)  # [c, 1]

        z = _logits_fp32(h, weight, z_buf[:c], low, fused_mm)  # [c, V]

        # log-softmax in one fused pass per row (fp32); loss = -log p[t].
        logp = torch.log_softmax(z, dim=1, out=l_buf[:c])  # [c, V]
        logp_t = logp.gather(1, t)  # [c, 1]
        losses[s:e] = logp_t.squeeze(1).neg()
        if not (need_h or need_w):
            continue

        # p = softmax - onehot; for bf16, exp writes p rounded once from fp32, and the
        # target entry p[t] - 1 = expm1(log p[t]) stays accurate when p[t] is near 1.
        p = torch.exp(logp, out=p_buf[:c] if low else logp)  # [c, V]
        p.scatter_(1, t, torch.expm1(logp_t).to(p.dtype))

        if need_h:
            if dense:
                torch.mm(p, weight, out=grad_h[s:e])
            else:
                grad_h.index_copy_(0, idx, torch.mm(p, weight))
        if need_w:
            _add_weight_grad(grad_w, p, h, low, fused_addmm)  # grad_w += p.T @ h
    return losses, rows, grad_h, grad_w


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum (or mean) of cross_entropy(hidden @ weight.T, labels), both gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, mean, need_h, need_w):
        losses, _, grad_h, grad_w = _chunk_pass(
            hidden, weight, labels, chunk_size, ignore_index, need_h, need_w
        )
        n = losses.numel()
        loss = losses.sum()
        if mean and n > 0:
            loss = loss / n
        # Saved (not ctx attributes) so autograd frees them right after backward.
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = weight.dtype
        ctx.divisor = n if mean and n > 0 else 1
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        # A 1-element (not 0-dim) fp32 factor takes part in type promotion, so the multiply
        # runs in fp32 and rounds once to the output dtype; a 0-dim one could run in bf16.
        scale = (grad_loss / ctx.divisor).reshape(1)
        saved_h, saved_w = ctx.saved_tensors
        grad_h = grad_w = None
        if saved_h is not None:
            grad_h = torch.mul(saved_h, scale, out=torch.empty_like(saved_h))
        if saved_w is not None:
            out = torch.empty_like(saved_w, dtype=ctx.w_dtype)
            grad_w = torch.mul(saved_w, scale, out=out)  # the one cast of the fp32 accumulator
        return grad_h, grad_w, None, None, None, None, None, None


def _check_inputs(hidden, weight, labels, chunk_size) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N={hidden.shape[0]}], got {tuple(labels.shape)}")
    if "DTensor" in (type(hidden).__name__, type(weight).__name__):
        raise TypeError(
            "pass plain tensors: for an FSDP2 lm_head, call this while the weight is "
            "unsharded (inside the module's forward, or after module.unshard())"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def chunked_cross_entropy(
    hidden, weight, labels, *, chunk_size=256, ignore_index=-100, reduction="sum"
):
    """cross_entropy(hidden @ weight.T, labels) for hidden [N, H], weight [V, H], labels [N].

    ignore_index=None: every label counts, and the scan for ignored ones (a data-dependent
    nonzero, which syncs with the host on CUDA) is skipped.
    "sum" returns the sum over non-ignored rows (divide by a global label count yourself);
    "mean" divides by the local count. With no valid label the loss is 0 and gradients are
    zero. The loss is float32 (float64 for float64 inputs). weight may be a plain tensor or
    the gathered lm_head weight of an FSDP2 model; it is read as is, never gathered per chunk.
    Backward may run more than once (retain_graph), but not create_graph.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    _check_inputs(hidden, weight, labels, chunk_size)
    grad_on = torch.is_grad_enabled()
    return ChunkedCrossEntropy.apply(
        hidden,
        weight,
        labels,
        int(chunk_size),
        ignore_index,
        reduction == "mean",
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )


@torch.no_grad()
def token_losses(hidden, weight, labels, *, chunk_size=256, ignore_index=-100):
    """Forward only: cross_entropy(hidden @ weight.T, labels, reduction="none"), [N] in float32
    (float64 for float64 inputs), 0 where the label is ignore_index. No autograd graph, no
    hidden-state gradient, no lm_head accumulator: two [chunk, V] fp32 buffers and the [N]
    losses, for evaluation. The losses stay where hidden is: sum them there (per position
    bucket, say) before anything moves to the host."""
    _check_inputs(hidden, weight, labels, chunk_size)
    losses, rows, _, _ = _chunk_pass(
        hidden, weight, labels, int(chunk_size), ignore_index, need_h=False, need_w=False
    )
    if rows.numel() == hidden.shape[0]:
        return losses
    return losses.new_zeros(hidden.shape[0]).index_copy_(0, rows, losses)


def group_mean_loss(loss_sum, labels, group=None, *, ignore_index=-100):
    """This rank's share of the mean loss over `group`: loss_sum / the labels counted (labels !=
    ignore_index) on every rank of the group; without torch.distributed initialised, on this
    process alone. No labels anywhere: loss_sum / 1 (zero loss, zero gradients, no NaN).

    The shares add up to the group's mean, and the ranks' gradients to its gradient: sum them
    (all_reduce SUM; FSDP2 with set_gradient_divide_factor(1)). A wrapper that averages over the
    group (DDP, FSDP2 by default) needs the share multiplied by the group's size.
    """
    count = (labels != ignore_index).sum().to(torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)
    return loss_sum / count.clamp(min=1).to(loss_sum.dtype)
