"""Ulysses attention on 2 and 4 gloo processes against full attention in one process."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from model.qwen3 import causal_attention
from model.ulysses import UlyssesAttention
from model.ulysses_exchange import check_heads

# (query heads, kv heads) per world size: GQA split, kv repeat (sp > kv heads), plain MHA
CASES = {2: [(4, 2), (4, 1)], 4: [(8, 2), (4, 4), (8, 8)]}


def _attention_case(rank, world, B, T, nh, nkv, hd):
    g = torch.Generator().manual_seed(nh * 100 + nkv)
    q = torch.randn(B, T, nh, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, nkv, hd, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, nkv, hd, generator=g, dtype=torch.float64)
    grad_out = torch.randn(B, T, nh, hd, generator=g, dtype=torch.float64)
    sl = slice(rank * T // world, (rank + 1) * T // world)
    local = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
    out = UlyssesAttention(dist.group.WORLD)(*local)
    out.backward(grad_out[:, sl])
    return out.detach(), [t.grad for t in local], sl


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_equals_full_attention(world):
    B, T, hd = 2, 16, 8
    per_rank = run_distributed(_run_cases, world, B, T, hd)  # one launch, every case
    for case, (nh, nkv) in enumerate(CASES[world]):
        results = [r[case] for r in per_rank]
        g = torch.Generator().manual_seed(nh * 100 + nkv)
        full = [
            torch.randn(B, T, h, hd, generator=g, dtype=torch.float64).requires_grad_()
            for h in (nh, nkv, nkv)
        ]
        grad_out = torch.randn(B, T, nh, hd, generator=g, dtype=torch.float64)
        out = causal_attention(*full)
        out.backward(grad_out)
        for local_out, local_grads, sl in results:
            torch.testing.assert_close(local_out, out.detach()[:, sl], rtol=1e-12, atol=1e-12)
            for lg, t in zip(local_grads, full, strict=True):
                torch.testing.assert_close(lg, t.grad[:, sl], rtol=1e-12, atol=1e-12)


def _run_cases(rank, world, B, T, hd):
    return [_attention_case(rank, world, B, T, nh, nkv, hd) for nh, nkv in CASES[world]]


def test_head_counts_that_cannot_split():
    check_heads(32, 8, 8)
    check_heads(32, 8, 16)  # kv heads repeated twice
    with pytest.raises(ValueError, match="query heads do not divide by sp=3"):
        check_heads(32, 8, 3)
    with pytest.raises(ValueError, match="kv heads can neither"):
        check_heads(24, 6, 4)
