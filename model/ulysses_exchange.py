"""Ulysses sequence parallelism: attention over a sequence split across sp processes, any model.

To use it elsewhere: copy this file and loss/chunked_ce.py; they need torch (and transformers for
register_ulysses). README's "Use a piece in your own code" applies them to Qwen3ForCausalLM.

    model.set_attn_implementation(register_ulysses(group))   # a transformers model, sp = group
    ids, positions, targets = shard_row(input_ids, group)     # this rank's T/sp tokens
    hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    out = ulysses(q, k, v, group, core)    # any attention core on [B, T, heads, hd] tensors
    # a row of documents (B = 1): positions restart, attention stays in each, no label across
    ids, positions, targets = shard_row(input_ids, group, doc_lens=(n1, n2, ...))
    hidden = model.model(input_ids=ids, position_ids=positions, doc_lens=(n1, n2, ...))

Outside attention every sp rank holds a contiguous slice of the sequence, T/sp tokens, for all
heads. Attention needs every token, so around it two all-to-alls trade the split:

    q, k, v  [B, T/sp, heads, hd]  --all-to-all-->  [B, T, heads/sp, hd]   (all tokens, few heads)
    causal attention over the whole sequence, heads/sp heads per rank
    out      [B, T, heads/sp, hd]  --all-to-all-->  [B, T/sp, heads, hd]

Each exchange moves (sp-1)/sp of the tensor; per layer that is 4 tensors (q, k, v, out) forward
and 4 backward. Rank r takes query heads r*nh/sp .. and kv heads r*nkv/sp ..: contiguous blocks
keep every GQA group (query heads g*j .. g*j+g-1 share kv head j) on one rank. When sp exceeds
the kv heads, each kv head is repeated sp/nkv times before the exchange so every rank gets one.

For transformers, each rank passes its slice of input_ids and the GLOBAL position_ids (rank r's
slice starts at r*T/sp), so RoPE rotates every token by its place in the whole row; no attention
mask (the function registered is causal over the row, and transformers builds no mask for it).
A row of several documents passes doc_lens, the lengths of the whole row's documents, to
shard_row (positions from 0 in each document, no target across a boundary) and to the model's
forward, which hands its keyword arguments on to the attention function: after the first
all-to-all every rank holds all T tokens of its heads, so attention within each document is the
causal kernel run on each document's segment of T. Our own model uses the same exchange through
model/ulysses.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "check_heads",
    "heads_to_seq",
    "register_ulysses",
    "seq_to_heads",
    "shard_row",
    "transformers_attention",
    "ulysses",
]


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


def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, core) -> torch.Tensor:
    """core(q, k, v) over the whole sequence, for q [B, T/sp, nh, hd], k, v [B, T/sp, nkv, hd]
    (this rank's tokens, in rank order) -> [B, T/sp, nh, hd]. core takes [B, T, heads, hd]
    tensors, fewer kv heads than query heads (query heads g*j .. g*j+g-1 share kv head j)."""
    sp = dist.get_world_size(group)
    nh, nkv = q.shape[2], k.shape[2]
    if sp == 1:
        return core(q, k, v)
    check_heads(nh, nkv, sp)
    # sp > kv heads (e.g. sp=8, 4 kv heads): each kv head serves sp/nkv ranks, repeated
    # inside the exchange's send buffer rather than in a repeated copy of k and v first
    r = max(1, sp // nkv)
    q = _Exchange.apply(q, group, True)  # [B, T, nh/sp, hd]
    k = _Exchange.apply(k, group, True, r)  # [B, T, max(nkv/sp, 1), hd]
    v = _Exchange.apply(v, group, True, r)
    out = core(q, k, v)  # [B, T, nh/sp, hd], causal over the whole sequence
    return _Exchange.apply(out, group, False)  # [B, T/sp, nh, hd]


def _causal_sdpa(q, k, v, scale: float | None, doc_lens=None) -> torch.Tensor:
    """Causal SDPA on [B, T, heads, hd] tensors (the layout ulysses hands its core); with
    doc_lens (ints summing to T), causal within each document's segment of T."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
    gqa = q.shape[1] != k.shape[1]
    if doc_lens is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)  # [B, T, nh, hd]
    if sum(doc_lens) != q.shape[2]:
        raise ValueError(f"doc_lens sum to {sum(doc_lens)}, but the row has {q.shape[2]} tokens")
    parts, s = [], 0
    for n in doc_lens:
        seg = slice(s, s + n)
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, seg],
                k[:, :, seg],
                v[:, :, seg],
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
        )
        s += n
    return torch.cat(parts, dim=2).transpose(1, 2)  # [B, T, nh, hd]


def transformers_attention(group):
    """An attention function for transformers' AttentionInterface, running Ulysses over `group`.

    It is called as transformers calls sdpa's: (module, query [B, nh, T/sp, hd], key, value
    [B, nkv, T/sp, hd], attention_mask, scaling=, dropout=, **kwargs) -> (out [B, T/sp, nh, hd],
    None), causal over the row put together from all ranks; a doc_lens keyword (the lengths of
    that whole row's documents, passed to the model's forward) keeps it within each document.
    """

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise ValueError(
                "Ulysses attention is causal over the whole row and takes no attention_mask: "
                "pass position_ids instead (and no padding mask)"
            )
        if dropout or kwargs.get("sliding_window"):
            raise ValueError("Ulysses attention runs without dropout or a sliding window")

        doc_lens = kwargs.get("doc_lens")

        def core(q, k, v):
            return _causal_sdpa(q, k, v, scaling, doc_lens)

        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, T/sp, heads, hd]
        return ulysses(q, k, v, group, core), None

    return attention


def register_ulysses(group, name: str = "ulysses") -> str:
    """Register transformers_attention(group) with transformers' AttentionInterface as `name`;
    returns the name, for model.set_attn_implementation(name) or attn_implementation=name."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, transformers_attention(group))
    return name


def shard_row(
    input_ids: torch.Tensor, group, labels=None, *, ignore_index: int = -100, doc_lens=None
):
    """This rank's share of whole rows input_ids [B, T] (the same on every rank of `group`).

    Returns (input_ids, position_ids, targets), each [B, T/sp]: rank r's tokens r*T/sp ..,
    their global positions, and the label each token predicts (the next token of `labels`,
    default input_ids; ignore_index after the row's end), shifted over the whole row before the
    split, so a slice's last token predicts the first token of the next rank's slice.
    doc_lens (B = 1; ints summing to T): the row is documents: positions count from 0 in each,
    and a document's last token predicts nothing (ignore_index: the next one is another's).
    """
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    B, T = input_ids.shape
    if T % sp:
        raise ValueError(f"shard_row: the row length {T} does not divide by sp={sp}; pad it")
    n = T // sp
    mine = slice(rank * n, (rank + 1) * n)
    labels = input_ids if labels is None else labels
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index)  # [B, T]: token t predicts t+1
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    if doc_lens is not None:
        lens = torch.tensor(doc_lens, device=input_ids.device)  # [documents]
        starts = torch.cumsum(lens, 0) - lens  # where each document begins
        positions = positions - torch.repeat_interleave(starts, lens)  # [B, T]: 0 at each start
        targets = targets.clone()
        targets[:, torch.cumsum(lens, 0) - 1] = ignore_index  # each document's last token
    return input_ids[:, mine], positions[:, mine], targets[:, mine]
