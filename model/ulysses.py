"""Ulysses sequence parallelism: attention over a sequence split across sp processes.

Outside attention every sp rank holds a contiguous slice of the sequence, T/sp tokens, for all
heads. Attention needs every token, so around it two all-to-alls trade the split:

    q, k, v  [B, T/sp, heads, hd]  --all-to-all-->  [B, T, heads/sp, hd]   (all tokens, few heads)
    causal SDPA over the whole sequence, heads/sp heads per rank
    out      [B, T, heads/sp, hd]  --all-to-all-->  [B, T/sp, heads, hd]

Each exchange moves (sp-1)/sp of the tensor; per layer that is 4 tensors (q, k, v, out) forward
and 4 backward. Rank r takes query heads r*nh/sp .. and kv heads r*nkv/sp ..: contiguous blocks
keep every GQA group (query heads g*j .. g*j+g-1 share kv head j) on one rank. When sp exceeds
the kv heads, each kv head is repeated sp/nkv times before the exchange so every rank gets one.

Installed from outside, without editing the model:  model.set_attention(UlyssesAttention(group))
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.qwen3 import causal_attention


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal blocks along dim 0 of a contiguous tensor: block j goes to rank j; block i of
    the result came from rank i. The caller drops `send` as soon as this returns."""
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group, repeat: int = 1) -> torch.Tensor:
    """[B, T/sp, h, hd] -> [B, T, h*repeat/sp, hd]; repeat > 1 repeats each head `repeat` times
    (as repeat_interleave would), written straight into the send buffer."""
    sp = dist.get_world_size(group)
    B, Ts, h, hd = x.shape
    hs = h * repeat // sp
    if repeat == 1:  # a copy unless the layout is already [sp(dest), B, T/sp, h/sp, hd]
        send = x.view(B, Ts, sp, hs, hd).permute(2, 0, 1, 3, 4).contiguous()
    else:  # sp = h * repeat, one head per rank: rank j gets head j // repeat
        send = torch.empty(sp, B, Ts, hs, hd, dtype=x.dtype, device=x.device)
        send.view(h, repeat, B, Ts, hd).copy_(x.permute(2, 0, 1, 3).unsqueeze(1))
    out = _all_to_all(send, group)  # [sp(source = sequence block), B, T/sp, h/sp, hd]
    del send
    # B = 1 (training): [1, T, h/sp, hd] is the received buffer itself, no copy
    return out.permute(1, 0, 2, 3, 4).reshape(B, sp * Ts, hs, hd)  # [B, T, h/sp, hd]


def heads_to_seq(x: torch.Tensor, group, repeat: int = 1) -> torch.Tensor:
    """[B, T, h/sp, hd] -> [B, T/sp, h, hd]: the inverse of seq_to_heads; with repeat > 1 (the
    gradient of a repeated exchange) the `repeat` copies of each head are summed."""
    sp = dist.get_world_size(group)
    B, T, hs, hd = x.shape
    send = (
        x.view(B, sp, T // sp, hs, hd).transpose(0, 1).contiguous()
    )  # [sp(dest = sequence block), B, T/sp, h/sp, hd]
    out = _all_to_all(send, group)  # [sp(source = head block), B, T/sp, h/sp, hd]
    del send
    out = out.permute(1, 2, 0, 3, 4).reshape(B, T // sp, sp * hs, hd)  # [B, T/sp, h, hd]
    if repeat > 1:
        out = out.view(B, T // sp, sp * hs // repeat, repeat, hd).sum(3)  # [B, T/sp, h/repeat, hd]
    return out


class _Exchange(torch.autograd.Function):
    """Differentiable exchange: the backward of one direction is the other direction."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool, repeat: int = 1):
        ctx.group, ctx.to_heads, ctx.repeat = group, to_heads, repeat
        return seq_to_heads(x, group, repeat) if to_heads else heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_heads:
            return heads_to_seq(grad, ctx.group, ctx.repeat), None, None, None
        return seq_to_heads(grad, ctx.group), None, None, None


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Raise if a model's heads cannot be split over sp ranks."""
    if num_heads % sp:
        raise ValueError(
            f"Ulysses sequence parallelism splits attention heads over sp ranks: "
            f"{num_heads} query heads do not divide by sp={sp}; pick sp dividing {num_heads}"
        )
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} kv heads can neither be split over sp={sp} nor repeated to it; "
            f"pick sp that divides, or is a multiple of, {num_kv_heads}"
        )


class UlyssesAttention:
    """An attention core for `Qwen3.set_attention`: q [B, T/sp, nh, hd], k, v [B, T/sp, nkv, hd]
    -> [B, T/sp, nh, hd], causal over the sequence put together from all sp ranks in rank order."""

    def __init__(self, group=None):
        self.group = group
        self.sp = dist.get_world_size(group)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nh, nkv = q.shape[2], k.shape[2]
        if self.sp == 1:
            return causal_attention(q, k, v)
        check_heads(nh, nkv, self.sp)
        # sp > kv heads (e.g. sp=8, 4 kv heads): each kv head serves sp/nkv ranks, repeated
        # inside the exchange's send buffer rather than in a repeated copy of k and v first
        r = max(1, self.sp // nkv)
        q = _Exchange.apply(q, self.group, True)  # [B, T, nh/sp, hd]
        k = _Exchange.apply(k, self.group, True, r)  # [B, T, max(nkv/sp, 1), hd]
        v = _Exchange.apply(v, self.group, True, r)
        out = causal_attention(q, k, v)  # [B, T, nh/sp, hd], causal over the whole sequence
        return _Exchange.apply(out, self.group, False)  # [B, T/sp, nh, hd]
