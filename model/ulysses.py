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

from model.qwen3 import sdpa_attention


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal blocks along dim 0: block j goes to rank j; block i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after .contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T/sp, h, hd] -> [B, T, h/sp, hd]."""
    sp = dist.get_world_size(group)
    B, Ts, h, hd = x.shape
    x = x.view(B, Ts, sp, h // sp, hd).permute(2, 0, 1, 3, 4)  # [sp(dest), B, T/sp, h/sp, hd]
    x = _all_to_all(x, group)  # [sp(source = sequence block), B, T/sp, h/sp, hd]
    return x.permute(1, 0, 2, 3, 4).reshape(B, sp * Ts, h // sp, hd)  # [B, T, h/sp, hd]


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T, h/sp, hd] -> [B, T/sp, h, hd]: the inverse of seq_to_heads."""
    sp = dist.get_world_size(group)
    B, T, hs, hd = x.shape
    x = x.view(B, sp, T // sp, hs, hd).transpose(0, 1)  # [sp(dest = sequence block), B, T/sp, h/sp, hd]
    x = _all_to_all(x, group)  # [sp(source = head block), B, T/sp, h/sp, hd]
    return x.permute(1, 2, 0, 3, 4).reshape(B, T // sp, sp * hs, hd)  # [B, T/sp, h, hd]


class _Exchange(torch.autograd.Function):
    """Differentiable exchange: the backward of one direction is the other direction."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return seq_to_heads(x, group) if to_heads else heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = heads_to_seq if ctx.to_heads else seq_to_heads
        return back(grad, ctx.group), None, None


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Raise if a model's heads cannot be split over sp ranks."""
    if num_heads % sp:
        raise ValueError(f"Ulysses sequence parallelism splits attention heads over sp ranks: "
                         f"{num_heads} query heads do not divide by sp={sp}; pick sp dividing {num_heads}")
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ValueError(f"{num_kv_heads} kv heads can neither be split over sp={sp} nor repeated to it; "
                         f"pick sp that divides, or is a multiple of, {num_kv_heads}")


class UlyssesAttention:
    """An attention core for `Qwen3.set_attention`: q [B, T/sp, nh, hd], k, v [B, T/sp, nkv, hd]
    -> [B, T/sp, nh, hd], causal over the sequence put together from all sp ranks in rank order."""

    def __init__(self, group=None):
        self.group = group
        self.sp = dist.get_world_size(group)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nh, nkv = q.shape[2], k.shape[2]
        if self.sp == 1:
            return sdpa_attention(q, k, v)
        check_heads(nh, nkv, self.sp)
        if nkv < self.sp:  # e.g. sp=8 with 4 kv heads: each kv head serves two ranks
            k = k.repeat_interleave(self.sp // nkv, dim=2)  # [B, T/sp, sp, hd]
            v = v.repeat_interleave(self.sp // nkv, dim=2)
        q, k, v = (_Exchange.apply(t, self.group, True) for t in (q, k, v))  # [B, T, heads/sp, hd]
        out = sdpa_attention(q, k, v)  # [B, T, nh/sp, hd], causal over the whole sequence
        return _Exchange.apply(out, self.group, False)  # [B, T/sp, nh, hd]

