"""Ulysses sequence parallelism: attention over a sequence split across sp processes, any model.

To use it elsewhere: copy this file alone; it needs torch (and transformers for register_ulysses).
docs/pieces.md applies it to transformers' Qwen3ForCausalLM, with loss/chunked_ce.py
for that example's loss.

    model.set_attn_implementation(register_ulysses(group))   # a transformers model, sp = group
    batch = shard_row(row, rank, sp)     # row: T + 1 ids -> this rank's ceil(T/sp) inputs, labels
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    out = ulysses(q, k, v, group, core)    # any attention core on [B, T, heads, hd] tensors
    # a row of documents (B = 1): positions restart, attention stays in each, no label across
    batch = shard_row(row, rank, sp, doc_lens=(n1, n2, ...))    # summing to T + 1
    hidden = model.model(input_ids=..., position_ids=..., doc_lens=batch["doc_lens"])

Outside attention every sp rank holds a contiguous slice of the sequence, T/sp tokens, for all
heads (T here is the row as shard_row padded it, sp x ceil(T / sp) tokens). Attention needs every
token, so around it two all-to-alls trade the split:

    q, k, v  [B, T/sp, heads, hd]  --all-to-all-->  [B, T, heads/sp, hd]   (all tokens, few heads)
    causal attention over the whole sequence, heads/sp heads per rank
    out      [B, T, heads/sp, hd]  --all-to-all-->  [B, T/sp, heads, hd]

Each exchange moves (sp-1)/sp of the tensor; per layer that is 4 tensors (q, k, v, out) forward
and 4 backward. Rank r takes query heads r*nh/sp .. and kv heads r*nkv/sp ..: contiguous blocks
keep every GQA group (query heads g*j .. g*j+g-1 share kv head j) on one rank. When sp exceeds
the kv heads, each kv head is repeated sp/nkv times before the exchange so every rank gets one.

For transformers, each rank passes its share of the inputs and the GLOBAL position_ids (rank r's
share starts at r*ceil(T/sp)), so RoPE rotates every token by its place in the whole row; no
attention mask (the function registered is causal over the row, and transformers builds no mask
for it). shard_row cuts the row, padding its end when T does not divide by sp. A row of several
documents passes their lengths to shard_row (positions from 0 in each document, no label across
a boundary), which hands back the segments for attention as batch["doc_lens"]; the model's
forward passes that keyword on to the attention function: after the first all-to-all every rank
holds all T tokens of its heads, so attention within each document is the causal kernel run on
each document's segment of T. Our own model uses the same exchange through model/ulysses.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "check_heads",
    "document_segments",
    "exchange",
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


def exchange(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    """The differentiable exchange of one tensor: to_heads [B, T/sp, h, d] -> [B, T, h/sp, d],
    else back; its backward is the other direction. For layers that are not attention (a linear
    attention's token-local projections, packed per head) and need every token of their heads."""
    return _Exchange.apply(x, group, to_heads)


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
    None), causal over the row put together from all ranks; a doc_lens keyword (shard_row's
    batch["doc_lens"], the segments of that whole row, passed to the model's forward) keeps it
    within each segment.
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
    row, sp_rank: int, sp_size: int, *, doc_lens=None, ignore_index: int = -100, pad_id: int = 0
) -> dict:
    """Rank `sp_rank` of `sp_size`'s share of a row of T + 1 token ids: its inputs and labels.

    row: 1-D, or [B, T + 1] rows (a tensor, a numpy array or memmap, a list). The inputs are
    row[:T] and the labels row[1:], taken BEFORE the cut, so the last token of one rank's share
    predicts the first token of the next rank's. (transformers' input_ids of L ids, passed as
    the row, give L - 1 inputs and the loss of labels=input_ids.) Each rank gets ceil(T / sp_size)
    tokens; the row's end is padded: inputs pad_id, labels ignore_index, positions counting on.
    Under causal attention the padding comes after every real token, so nothing real attends to
    it.

    Returns {"input_ids", "labels", "position_ids"}, int64 [B, ceil(T / sp_size)], on the row's
    device (a tensor's; else the CPU). position_ids are global: rank r's share starts at
    r * ceil(T / sp_size), so RoPE turns each token by its place in the whole row, not in its
    share. Input token t (0 <= t < T) is on rank t // ceil(T / sp_size), at local index
    t % ceil(T / sp_size): at T = 1,048,576 and sp_size = 8, token 700,000 is at index 44,640 of
    rank 5, with position_ids 700,000 (counted from its document's start with doc_lens).

    doc_lens (B = 1): the row is documents, doc_lens[0] ids, then doc_lens[1], ... (summing to
    T + 1, the row's last id included). Positions count from 0 in each document, and no label
    crosses into the next one: the label of a document's last input is ignored (the last
    document's is kept: the row's last id is its own). "doc_lens" is added to the batch: not the
    lengths given but attention's segments of the padded inputs (document_segments), the same
    tuple on every rank; pass that one to the model.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank}")
    rows = _as_rows(row)  # [B, T + 1], not converted yet: of a memmap only [lo, hi] is read
    device = rows.device if isinstance(rows, torch.Tensor) else torch.device("cpu")
    batch, t = rows.shape[0], rows.shape[1] - 1
    if t < 1:
        raise ValueError(f"a row needs at least 2 tokens (an input and its label), got {t + 1}")
    per = -(-t // sp_size)  # ceil(T / sp_size)
    lo = sp_rank * per
    hi = max(lo, min(lo + per, t))  # this rank's real inputs: [lo, hi)
    n = hi - lo
    # Only this share of the row is converted, not the whole million tokens.
    input_ids = torch.full((batch, per), pad_id, dtype=torch.long, device=device)
    labels = torch.full((batch, per), ignore_index, dtype=torch.long, device=device)
    input_ids[:, :n] = _as_long(rows[:, lo:hi])
    labels[:, :n] = _as_long(rows[:, lo + 1 : hi + 1])
    positions = torch.arange(lo, lo + per, device=device).expand(batch, per).clone()
    out = {"input_ids": input_ids, "labels": labels, "position_ids": positions}
    if doc_lens is None:
        return out
    lens = torch.as_tensor(doc_lens, dtype=torch.long, device=device)  # [documents]
    if batch != 1 or int(lens.sum()) != t + 1 or bool((lens < 1).any()):
        raise ValueError(
            f"doc_lens takes one row (B = 1, here {batch}) and lengths of at least 1 summing to "
            f"its {t + 1} ids (the last label included), got {int(lens.sum())}"
        )
    starts = torch.cumsum(lens, 0) - lens  # [documents]: where each begins in the row
    with_inputs = starts[starts < t]  # a document that begins at T (the last label) has none
    place = torch.arange(lo, lo + per, device=device)  # [per]: this share's place in the row
    document = torch.searchsorted(with_inputs, place, right=True) - 1  # [per]
    positions[0] = place - with_inputs[document]  # from 0 in each; the padding counts on
    last_inputs = starts[1:] - 1 - lo  # [documents - 1]: each one's last input, here
    last_inputs = last_inputs[(last_inputs >= 0) & (last_inputs < n)]
    labels[0, last_inputs] = ignore_index  # its label is the next document's first id
    out["doc_lens"] = document_segments(doc_lens, per * sp_size)
    return out


def document_segments(doc_lens, length: int) -> tuple[int, ...]:
    """The segments attention runs causal attention within, for a row of documents doc_lens
    (shard_row's: ids, summing to T + 1) whose inputs are `length` >= T tokens.

    The row's last id is a label only, so it leaves the last document; the padding (length - T)
    joins the last segment, after every real token. A run of one-id documents (best-fit packing's
    padding of end-of-text ids, or empty documents) is one segment: each one's only label is the
    next document's first id, ignored, so nothing counted depends on what they attend to, and one
    kernel call serves the run instead of one per token.
    """
    doc_lens = [int(n) for n in doc_lens]  # plain ints (a tensor's elements would be views)
    segments: list[int] = []
    in_run = False  # whether segments[-1] is a run of one-id documents
    last = len(doc_lens) - 1
    for j, n in enumerate(doc_lens):
        inputs = n - 1 if j == last else n
        if inputs == 0:
            continue  # the last document is the last label alone
        alone = n == 1 and j < last
        if alone and in_run:
            segments[-1] += 1
        else:
            segments.append(inputs)
        in_run = alone
    segments[-1] += length - (sum(doc_lens) - 1)
    return tuple(segments)


def _as_rows(row):
    """row as something 2-D to slice, [B, T + 1]: a 1-D row gets B = 1; a list becomes a tensor."""
    if isinstance(row, (list, tuple)):
        row = torch.tensor(row, dtype=torch.long)
    return row if row.ndim == 2 else row[None]


def _as_long(x) -> torch.Tensor:
    """A tensor's or a numpy array's slice as int64; an array is copied (memmaps are read-only)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.long)
    return torch.from_numpy(x.astype("int64"))
