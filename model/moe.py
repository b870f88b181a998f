"""Qwen3's sparse mixture-of-experts block, tiled over tokens, saving only its input.

To use it elsewhere: copy this file alone; it needs torch only.

    moe = SparseMoeBlock(hidden=2048, intermediate=768, experts=128, top_k=8, norm_topk_prob=True)
    y = moe(x)                      # x [..., hidden] -> [..., hidden], transformers' forward
    moe.stats                       # the last forward's routing: tokens per expert, prob sums
    moe.aux_grad = g                # [experts]: d(router loss)/d(router prob), added in backward
    with moe.skipping():            # a checkpoint's recompute: x saved, no expert runs
        moe(x)
    aux, load = router_loss(blocks, 0.001, sum_ranks=dist.all_reduce)  # after the forward

The forward is transformers' Qwen3MoeSparseMoeBlock: the router (a bias-free linear) gives
logits, softmax in fp32, the top_k experts per token, their probabilities renormalised to sum 1
when norm_topk_prob, cast back to the logits' dtype; each chosen expert is a SwiGLU
down(silu(gate(x)) * up(x)) of `intermediate` units, and a token's output is the weighted sum
of its experts'. Dropless: every expert takes every token routed to it (no capacity factor).
The weights are stacked as transformers 5 holds them, so FSDP2 shards experts like rows:
experts.gate_up_proj [experts, 2 x intermediate, hidden] (gate rows, then up rows),
experts.down_proj [experts, hidden, intermediate], gate.weight [experts, hidden].

The one idea: an autograd.Function over pieces of at most `tile` tokens. The token-expert pairs
are sorted by expert and each expert's pairs run in tiles of `tile` rows, one matrix product
per tile (plain F.linear; torch's private grouped GEMM, torch._grouped_mm, is not used),
so the routed activations of all tokens x top_k ([tokens x top_k, hidden] and
[tokens x top_k, 2 x intermediate]) never exist at once. Forward runs under no_grad and saves
only its input and weights; backward recomputes the router (small: [tokens, experts]), replays
each tile with grad and accumulates each expert's weight gradients in fp32. The router's
gradient has two parts: from the outputs (through the chosen probabilities) and, when the
trainer sets `aux_grad`, from a load-balancing loss that is linear in the router probabilities
once its token counts are fixed (transformers' load_balancing_loss_func).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor  # a rehearsal's tensors: shapes, no values

__all__ = [
    "Experts",
    "Router",
    "RoutingStats",
    "SparseMoeBlock",
    "expert_pieces",
    "route",
    "router_loss",
    "split_experts",
]

# A stacked parameter's name ends -> the per-expert projections stacked in it, in row order:
# what checkpoints hold (experts.{e}.gate_proj.weight ...) and save_pretrained writes.
TILE = 16384  # token-expert pairs per expert product unless set_tiling says (--tile-mlp)
STACKED = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}


@dataclass
class RoutingStats:
    """One forward's routing: tokens sent to each expert and the sum of each expert's router
    probability over the tokens (both [experts], fp32), and the number of tokens."""

    counts: torch.Tensor
    prob_sums: torch.Tensor
    tokens: int


def route(x2: torch.Tensor, w_router: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(weights [N, top_k] in the logits' dtype, experts [N, top_k], probs [N, E] fp32) for
    tokens x2 [N, hidden], as transformers' Qwen3MoeTopKRouter computes them."""
    logits = F.linear(x2, w_router)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts, probs


def _expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token-expert pairs per expert, [num_experts] int64 (a fixed shape, unlike bincount's)."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat))


def _host_counts(counts: torch.Tensor, pairs: int) -> list[int]:
    """The counts as ints: one host read. Fake tensors (train.py --rehearse) have no values: the
    pairs are taken as spread evenly, the balance a load-balanced router aims at."""
    if isinstance(counts, FakeTensor):
        per, rest = divmod(pairs, counts.shape[0])
        return [per + (e < rest) for e in range(counts.shape[0])]
    return counts.tolist()


def _expert_tiles(experts: torch.Tensor, counts: torch.Tensor, tile: int):
    """(expert, pair indices) per tile: pairs p = token x top_k + slot, sorted by expert, each
    expert's in pieces of at most `tile`; counts: _expert_counts' of these experts. One host
    read of the counts per call: one in a layer's forward, one in its backward (a recompute
    routes nothing)."""
    flat = experts.reshape(-1)  # [N x k]
    order = torch.argsort(flat, stable=True)
    counts = _host_counts(counts, flat.numel())
    start = 0
    for e, n in enumerate(counts):
        for s in range(start, start + n, tile):
            yield e, order[s : min(s + tile, start + n)]
        start += n


def _swiglu(xt, w_gate_up, w_down):
    gate, up = F.linear(xt, w_gate_up).chunk(2, dim=-1)  # [m, intermediate] each
    return F.linear(F.silu(gate) * up, w_down)  # [m, hidden]


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_router, w_gate_up, w_down, block, output_unused):
        ctx.block = block
        ctx.save_for_backward(x, w_router, w_gate_up, w_down)
        if output_unused:  # a recompute: only x had to be saved
            return torch.zeros_like(x)
        x2 = x.reshape(-1, x.shape[-1])  # [N, hidden]
        weights, experts, probs = route(x2, w_router, block.top_k, block.norm_topk_prob)
        counts = _expert_counts(experts, block.num_experts)  # the statistics' and the tiles'
        block.stats = RoutingStats(
            counts=counts.float(),
            prob_sums=probs.sum(0),
            tokens=x2.shape[0],
        )
        del probs
        out = torch.zeros_like(x2)
        k, flat_weights = block.top_k, weights.reshape(-1)
        for e, pairs in _expert_tiles(experts, counts, block.tile):
            tokens = pairs // k
            y = _swiglu(x2[tokens], w_gate_up[e], w_down[e]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out.view_as(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, w_router, w_gate_up, w_down = ctx.saved_tensors
        block = ctx.block
        need_x, need_r, need_gu, need_d = ctx.needs_input_grad[:4]
        x2, go2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, x.shape[-1])
        with torch.no_grad():
            weights, experts = route(x2, w_router, block.top_k, block.norm_topk_prob)[:2]
        k, flat_weights = block.top_k, weights.reshape(-1)
        dx = torch.zeros_like(x2)
        d_weights = torch.zeros(flat_weights.shape, dtype=torch.float32, device=x.device)
        d_gate_up = torch.zeros_like(w_gate_up) if need_gu else None
        d_down = torch.zeros_like(w_down) if need_d else None
        acc_e, acc = -1, None  # the current expert's weight gradients, fp32
        counts = _expert_counts(experts, block.num_experts)
        for e, pairs in _expert_tiles(experts, counts, block.tile):
            if e != acc_e:
                _flush(acc, acc_e, d_gate_up, d_down)
                acc_e, acc = e, [None, None]
            tokens = pairs // k
            xt = x2[tokens].detach().requires_grad_(True)
            wgu = w_gate_up[e].detach().requires_grad_(need_gu)
            wd = w_down[e].detach().requires_grad_(need_d)
            go, w = go2[tokens], flat_weights[pairs, None]
            with torch.enable_grad():
                y = _swiglu(xt, wgu, wd)  # [m, hidden]
            d_weights[pairs] = (go.float() * y.detach().float()).sum(-1)
            inputs = [xt] + [t for t, need in ((wgu, need_gu), (wd, need_d)) if need]
            grads = list(torch.autograd.grad(y, inputs, (go * w).to(y.dtype)))
            del inputs  # it holds xt: freed here, not in the next tile
            dx.index_add_(0, tokens, grads.pop(0).to(dx.dtype))
            for i, need in ((0, need_gu), (1, need_d)):
                if need:
                    g = grads.pop(0).float()
                    acc[i] = g if acc[i] is None else acc[i].add_(g)
                    del g  # an fp32 [2I, H] or [H, I]: not held into the next tile
        _flush(acc, acc_e, d_gate_up, d_down)
        d_router = _router_backward(block, x2, w_router, experts, d_weights, dx, need_r)
        return (dx.view_as(x) if need_x else None), d_router, d_gate_up, d_down, None, None


def _flush(acc, e, d_gate_up, d_down) -> None:
    """Write one expert's accumulated fp32 weight gradients into the stacked gradients."""
    if acc is None:
        return
    for a, dest in zip(acc, (d_gate_up, d_down), strict=True):
        if a is not None:
            dest[e].copy_(a)


def _router_backward(block, x2, w_router, experts, d_weights, dx, need_r):
    """The router's part, over token tiles: the chosen weights' gradient and, when the trainer
    set block.aux_grad, the load-balancing loss's gradient on every router probability; adds
    the tokens' gradient to dx, returns the router weight's."""
    aux = block.aux_grad
    acc = torch.zeros(w_router.shape, dtype=torch.float32, device=w_router.device)
    wr = w_router.detach().requires_grad_(need_r)
    d_weights = d_weights.view(-1, block.top_k)  # [N, k]
    for s in range(0, x2.shape[0], block.tile):
        xt = x2[s : s + block.tile].detach().requires_grad_(True)
        with torch.enable_grad():
            logits = F.linear(xt, wr)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top = probs.gather(-1, experts[s : s + block.tile])  # the experts forward chose
            if block.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            top = top.to(logits.dtype)
        outputs, grads_out = [top], [d_weights[s : s + block.tile].to(top.dtype)]
        if aux is not None:
            outputs.append(probs)
            grads_out.append(aux.to(probs.device, probs.dtype).expand_as(probs))
        inputs = [xt, wr] if need_r else [xt]
        grads = torch.autograd.grad(outputs, inputs, grads_out)
        dx[s : s + block.tile] += grads[0].to(dx.dtype)
        if need_r:
            acc += grads[1].float()
    return acc.to(w_router.dtype) if need_r else None


class Router(nn.Linear):
    """The router's bias-free linear layer, weight [experts, hidden]. A type of its own, as
    transformers' Qwen3MoeTopKRouter is, so LoRA (model/lora.py adapts plain nn.Linear only,
    PEFT the linear layers it finds) never takes it for a projection to adapt."""

    def __init__(self, hidden: int, experts: int):
        super().__init__(hidden, experts, bias=False)


class Experts(nn.Module):
    """Every expert's SwiGLU weights, stacked on dim 0 (transformers 5's Qwen3MoeExperts)."""

    def __init__(self, hidden: int, intermediate: int, experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts; forward as transformers' Qwen3MoeSparseMoeBlock."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        experts: int,
        top_k: int,
        norm_topk_prob: bool,
        tile: int = TILE,
    ):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in 1..{experts} (the experts), got {top_k}")
        self.gate = Router(hidden, experts)
        self.experts = Experts(hidden, intermediate, experts)
        self.num_experts, self.top_k, self.norm_topk_prob = experts, top_k, norm_topk_prob
        self.tile = tile  # token-expert pairs per matrix product (and tokens per router tile)
        self.output_unused = False
        self.stats: RoutingStats | None = None  # the last forward's (recomputes leave it)
        self.aux_grad: torch.Tensor | None = None  # [experts], read by backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RoutedExperts.apply(
            x,
            self.gate.weight,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            self,
            self.output_unused,
        )

    def set_tiling(self, tile: int) -> None:
        if int(tile) != tile or tile <= 0:
            raise ValueError(f"the MoE tile must be a positive number of tokens, got {tile!r}")
        self.tile = int(tile)

    @contextlib.contextmanager
    def skipping(self):
        """Calls inside save their input and return zeros without routing (a recompute)."""
        before, self.output_unused = self.output_unused, True
        try:
            yield
        finally:
            self.output_unused = before


def router_loss(
    blocks: list[SparseMoeBlock], coef: float, *, sum_ranks=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' load_balancing_loss_func x coef over the last forward of every block in
    `blocks` (the model's sparse layers), and each layer's load (its busiest expert's tokens
    over the mean); both fp32 tensors, the same on every rank.

    The loss is E x sum_e f_e x P_e, with f_e the share of token-expert choices that went to
    expert e and P_e its mean router probability, both over every layer and token: statistics
    of the whole batch, so sum_ranks (an in-place sum over ranks, such as dist.all_reduce)
    first adds up every rank's counts, probability sums and tokens. With the counts fixed the
    loss is linear in the probabilities, so its gradient on one token's probability of expert e
    is coef x E x f_e / (layers x tokens): with coef > 0 each block's aux_grad is set to it and
    the block's backward adds it, on each rank for its own tokens."""
    e = blocks[0].num_experts
    stats = torch.stack(
        [
            torch.cat(
                [b.stats.counts, b.stats.prob_sums, b.stats.counts.new_full((1,), b.stats.tokens)]
            )
            for b in blocks
        ]
    )  # [layers, 2E + 1]
    if sum_ranks is not None:
        sum_ranks(stats)
    counts, prob_sums, rows = stats[:, :e], stats[:, e : 2 * e], stats[:, 2 * e].sum()
    share = counts.sum(0) / rows  # f_e (sums to top_k: each token makes top_k choices)
    loss = coef * e * (share * prob_sums.sum(0) / rows).sum()
    if coef:
        for b in blocks:
            b.aux_grad = coef * e * share / rows
    return loss, counts.amax(1) / counts.mean(1).clamp(min=1e-9)


# ---------------------------------------------------------------------------------------------
# Checkpoint keys: one tensor per expert and projection, as Hugging Face checkpoints hold them
# ---------------------------------------------------------------------------------------------
def expert_pieces(name: str, shape) -> list[tuple[str, int, slice]] | None:
    """For a stacked parameter `name` of full `shape` ([experts, rows, cols]): every
    (checkpoint key, expert, rows of that expert's block) it is read from; None for any other
    parameter. model.layers.0.mlp.experts.gate_up_proj ->
    (model.layers.0.mlp.experts.0.gate_proj.weight, 0, rows 0:I), (... up_proj ..., 0, I:2I)."""
    for end, projections in STACKED.items():
        if name.endswith("." + end):
            prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
            rows = shape[1] // len(projections)
            return [
                (f"{prefix}.{e}.{proj}.weight", e, slice(i * rows, (i + 1) * rows))
                for e in range(shape[0])
                for i, proj in enumerate(projections)
            ]
    return None


def split_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) pairs to write for parameter `name`: a stacked one as one
    tensor per expert and projection (what transformers' save_pretrained writes and every
    release reads), any other as it is."""
    pieces = expert_pieces(name, tensor.shape)
    if pieces is None:
        return [(name, tensor)]
    return [(key, tensor[e, rows].contiguous()) for key, e, rows in pieces]
