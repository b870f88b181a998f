"""The gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers) in chunks, with time
and memory linear in the sequence length, documents restarting the state.

To use it elsewhere: copy this file alone; it needs torch only. Copy it freely.

    o = gated_delta_rule(q, k, v, g, beta)      # q, k [B,T,Hk,dk], v [B,T,Hv,dv], g, beta [B,T,Hv]
    o = gated_delta_rule(q, k, v, g, beta, doc_lens=[700, 1, 323])   # packed documents
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o = gated_delta_rule(q, k, v, g, beta, state_pass="loop")    # the textbook chunk loop
    o = recurrent_gated_delta_rule(q, k, v, g, beta)        # token by token: the reference

Value head j reads query/key head j // (Hv // Hk). q and k are L2-normalised in fp32 inside
(x * rsqrt(sum(x * x) + 1e-6), transformers' l2norm) and q is scaled by dk ** -0.5; everything
is computed in fp32 (fp64 for fp64 inputs) and the output comes back in v's dtype; the state
[B, Hv, dk, dv] stays in the compute dtype.

The recurrence. Per value head, with a state S [dk, dv], a_t = exp(g_t) (g_t <= 0, log-decay),
beta_t in (0, 1), and unit-norm k_t:

    S <- a_t S                                    decay
    S <- S + k_t (beta_t (v_t - S^T k_t))^T       delta rule: write the error of S's prediction
    o_t = S^T q_t

that is S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T. recurrent_gated_delta_rule
runs this one token at a time: readable, exact, slow.

The derivation of the chunk form, the scan that passes the state through the chunks in few
steps, why blocks of chunks bound memory, and how documents restart the state: the comment
below the imports.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

# The chunk form. Take a chunk of C tokens with start state S_0 and gam_i = g_1 + ... + g_i (the
# log-decay from the chunk's start through token i). Write the delta of token j as
# u_j = beta_j (v_j - S'_j^T k_j), S'_j the decayed state it reads. Then every state in the
# chunk is the decayed start state plus decayed rank-one writes,
#
#     S_i = exp(gam_i) S_0 + sum_{j <= i} exp(gam_i - gam_j) k_j u_j^T,
#
# and putting S'_j = exp(gam_j) S_0 + sum_{l < j} exp(gam_j - gam_l) k_l u_l^T into u_j gives
# one lower-triangular system for the C deltas U [C, dv] (rows u_j):
#
#     (I + A) U = V_b - K_bg S_0,      A[j, l] = beta_j (k_j . k_l) exp(gam_j - gam_l), l < j
#                                      V_b = rows beta_j v_j,  K_bg = rows beta_j exp(gam_j) k_j
#
# I + A is unit lower triangular: one triangular solve (the UT transform) gives (I + A)^-1, and
# two products W_v = (I + A)^-1 V_b and W_k = (I + A)^-1 K_bg, both independent of S_0, for every
# chunk at once.
# What still needs the state is a few [C, dk] x [dk, dv] products per chunk:
#
#     U     = W_v - W_k S_0
#     O     = (exp(gam) * Q) S_0 + (Q K^T * D) U     D[i, j] = exp(gam_i - gam_j), j <= i; else 0
#     S_C   = exp(gam_C) S_0 + (exp(gam_C - gam) * K)^T U
#
# Every exponent is <= 0 (entries above the diagonal are masked to -inf before exp), so nothing
# overflows; a long strongly decaying chunk underflows to 0, which is the right value.
#
# The state's pass through the chunks. Taken one chunk after another (the textbook loop,
# state_pass="loop") it is N sequential steps of a few small products: at a million tokens and
# chunk 64, 16,384 steps per layer and pass, each a handful of kernel launches. But putting U
# into S_C shows that each chunk maps its start state to its end state affinely,
#
#     S_C = M S_0 + c,    M = exp(gam_C) I - K_d^T W_k  [dk, dk],    c = K_d^T W_v  [dk, dv],
#
# with M and c known for every chunk at once. Affine maps compose, (M2, c2) after (M1, c1) being
# (M2 M1, M2 c1 + c2), so the state at every chunk's start is a prefix scan of the maps
# (state_pass="scan", the default): composing neighbours pairwise and recursing on the half as
# long row takes 2 log2(N) rounds of batched products and about 2 N compositions. Then U and O
# come for every chunk in one product each. The price is FLOPs: a composition is a
# [dk, dk] x [dk, dk + dv] product, 2 dk^2 (dk + dv) FLOPs, about twice a chunk's own products
# at Qwen3.5's dk = dv = 128 and chunk 64 (memory/model_size.py counts them).
#
# Blocks of chunks bound the memory. Autograd through all the chunks would keep every chunk's
# intermediates (C x C matrices, deltas, maps) for the whole row. The autograd.Function here runs
# the forward under no_grad in blocks of BLOCK_CHUNKS chunks (512 x 64 = 32,768 tokens by
# default) and keeps for backward only its inputs and the state at each block's start
# ([B, Hv, dk, dv] each: T / 32,768 of them). Backward walks the blocks in reverse: it recomputes
# one block's forward with autograd from its saved start state, backpropagates the output
# gradient's slice and the gradient of the block's end state through it, and hands the start
# state's gradient to the block before. Exact (the same arithmetic twice), one block's
# intermediates alive at a time, and one extra forward in all. The block size trades memory for
# steps: at a million tokens 32 blocks per layer, each holding about 3.4 GB of intermediates in
# backward for 4 value heads of 128 (a Qwen3.5-9B rank at sp 8); block_chunks=64 holds an eighth
# of that and takes 8 times the steps.
#
# Documents. With doc_lens (token counts summing to T, the same for every row of the batch), the
# state restarts from zero at each document; the first document starts from initial_state (zero
# without one), and the final state is the last document's. A block is split at the document
# starts inside it and each piece runs the chunk form on its own, chunks restarting at the piece's
# start. That is exact but costs a Python-level pass per document: many short documents are slow
# (a vectorised treatment of short documents would batch them).

__all__ = ["BLOCK_CHUNKS", "gated_delta_rule", "recurrent_gated_delta_rule"]

BLOCK_CHUNKS = 512  # chunks per block: the forward keeps one state per BLOCK_CHUNKS * chunk tokens
L2_EPS = 1e-6


def _compute_dtype(*tensors) -> torch.dtype:
    """fp64 if any input is fp64, else fp32 (bf16 and fp16 inputs compute in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x * x) + eps) over the last dim, as transformers' (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _prepare(q, k, v, g, beta, dtype):
    """Raw [B, L, H*, d] slices -> [B, Hv, L, d] in `dtype`: q, k normalised (q also scaled by
    dk ** -0.5) and repeated to the value heads; g, beta -> [B, Hv, L]."""
    groups = v.shape[2] // k.shape[2]
    q = _l2norm(q.to(dtype)) * q.shape[-1] ** -0.5  # [B, L, Hk, dk]
    k = _l2norm(k.to(dtype))  # [B, L, Hk, dk]
    if groups > 1:  # value head j reads key head j // groups
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v.to(dtype)))  # [B, Hv, L, d]
    g, beta = (x.to(dtype).transpose(1, 2) for x in (g, beta))  # [B, Hv, L]
    return q, k, v, g, beta


def _chunk_form(q, k, v, g, beta, state, chunk: int, scan: bool):
    """One stretch of tokens without a document start inside, in chunks of `chunk`; the state
    passes through them by the scan of their maps (scan) or one chunk after another.

    q, k [B, H, L, dk]; v [B, H, L, dv]; g, beta [B, H, L]; state [B, H, dk, dv] or None (zero)
    -> (o [B, H, L, dv], state at the end [B, H, dk, dv])."""
    b, h, n_tok, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk, n_tok)  # a stretch shorter than a chunk is one chunk of its own length
    pad = -n_tok % c
    if pad:  # padded tokens have k = v = q = 0, beta = 0, g = 0: they leave the state as it is
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (n_tok + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, d]
    g, beta = (x.reshape(b, h, n, c) for x in (g, beta))  # [B, H, N, C]

    gam = g.cumsum(-1)  # [B, H, N, C]: log-decay from the chunk's start through token i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # [C, C], j <= i
    diff = gam.unsqueeze(-1) - gam.unsqueeze(-2)  # [B, H, N, C, C]: gam_i - gam_j
    decay = diff.masked_fill(~causal, float("-inf")).exp()  # D: exp(gam_i - gam_j), j <= i

    # The UT transform: (I + A) [W_v | W_k] = [V_b | K_bg], one unit-lower-triangular solve.
    k_beta = k * beta.unsqueeze(-1)  # [B, H, N, C, dk]
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # [B, H, N, C, C]: A, strictly lower
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * gam.exp().unsqueeze(-1)], -1)  # [.., dv+dk]
    eye = torch.eye(c, dtype=a.dtype, device=a.device)  # [C, C]
    # (I + A)^-1 first, then one product: a batched solve with C right-hand sides, not dv + dk,
    # is several times faster on a CPU than solving for W directly.
    inv = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)  # diag(A) unread
    w = inv @ rhs  # [B, H, N, C, dv + dk]
    w_v, w_k = w.split([dv, dk], -1)  # [B, H, N, C, dv], [B, H, N, C, dk]

    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]: Q K^T * D
    q_g = q * gam.exp().unsqueeze(-1)  # [B, H, N, C, dk]: exp(gam_i) q_i
    k_d = k * (gam[..., -1:] - gam).exp().unsqueeze(-1)  # [B, H, N, C, dk]: exp(gam_C - gam_j) k_j
    chunk_decay = gam[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]: exp(gam_C)

    if not scan:
        o, state = _state_loop(w_v, w_k, attn, q_g, k_d, chunk_decay, state)
    else:
        # chunk i maps its start state to its end state, S -> M_i S + c_i (the comment above),
        # held as one [dk, dv + dk] matrix [c_i | M_i]; K_d^T [W_v | W_k] is [c_i | K_d^T W_k]
        kw = k_d.transpose(-1, -2) @ w  # [B, H, N, dk, dv + dk]
        eye_k = torch.eye(dk, dtype=a.dtype, device=a.device)  # [dk, dk]
        m = chunk_decay * eye_k - kw[..., dv:]  # [B, H, N, dk, dk]: exp(gam_C) I - K_d^T W_k
        maps = torch.cat([kw[..., :dv], m], -1)  # [B, H, N, dk, dv + dk]: [c_i | M_i]
        through = _scan(maps, dv)  # chunk i's end state is M'_i S_0 + c'_i: [c'_i | M'_i]
        if state is None:  # a zero start state: the end states are the offsets alone
            ends = through[..., :dv]  # [B, H, N, dk, dv]
        else:
            ends = through[..., dv:] @ state.unsqueeze(2) + through[..., :dv]
        first = torch.zeros_like(ends[:, :, :1]) if state is None else state.unsqueeze(2)
        starts = torch.cat([first, ends[:, :, :-1]], 2)  # [B, H, N, dk, dv]: each chunk's start
        u = w_v - w_k @ starts  # [B, H, N, C, dv]: every chunk's deltas at once
        o = q_g @ starts + attn @ u  # [B, H, N, C, dv]
        state = ends[:, :, -1].clone()  # [B, H, dk, dv], not a view that would keep every end
    o = o.reshape(b, h, n * c, dv)[:, :, :n_tok]  # [B, H, L, dv]
    return o, state


def _state_loop(w_v, w_k, attn, q_g, k_d, chunk_decay, state):
    """The textbook pass of the state through the chunks, one chunk after another: N steps of
    a few small products each. Returns (o [B, H, N, C, dv], end state [B, H, dk, dv])."""
    outs = []
    for i in range(w_v.shape[2]):
        if state is None:  # a zero start state: skip its products
            u = w_v[:, :, i]  # [B, H, C, dv]
            outs.append(attn[:, :, i] @ u)  # [B, H, C, dv]
            state = k_d[:, :, i].transpose(-1, -2) @ u  # [B, H, dk, dv]
            continue
        u = w_v[:, :, i] - w_k[:, :, i] @ state  # [B, H, C, dv]
        outs.append(q_g[:, :, i] @ state + attn[:, :, i] @ u)  # [B, H, C, dv]
        state = state * chunk_decay[:, :, i] + k_d[:, :, i].transpose(-1, -2) @ u
    return torch.stack(outs, 2), state  # [B, H, N, C, dv]


def _scan(maps, dv: int):
    """The inclusive scan of the chunks' affine maps S -> M_i S + c_i along dim 2: maps
    [B, H, N, dk, dv + dk], each [c_i | M_i] -> the same shape, chunk i's [c'_i | M'_i] with
    its end state M'_i S_0 + c'_i for the start state S_0 of chunk 0. Work-efficient and
    log-depth: compose neighbours pairwise (chunk 2j then 2j + 1), scan the half as long row of
    pairs, then finish each even chunk from the odd chunk before it: 2 log2(N) rounds of batched
    products, about 2 N compositions in all (scan_compositions)."""
    n = maps.shape[2]
    if n == 1:
        return maps
    if n % 2:  # an odd count: scan all but the last chunk, then put the last after them
        head = _scan(maps[:, :, :-1], dv)  # [B, H, N - 1, dk, dv + dk]
        return torch.cat([head, _compose(maps[:, :, -1:], head[:, :, -1:], dv)], 2)
    pairs = maps.unflatten(2, (n // 2, 2))  # [B, H, N/2, 2, dk, dv + dk]
    even, odd = pairs.unbind(3)  # chunks 0, 2, ... and 1, 3, ...: [B, H, N/2, dk, dv + dk]
    odd = _scan(_compose(odd, even, dv), dv)  # through chunk 2j + 1
    rest = _compose(even[:, :, 1:], odd[:, :, :-1], dv)  # through chunk 2j = 2j after 2j - 1
    even = torch.cat([even[:, :, :1], rest], 2)  # [B, H, N/2, dk, dv + dk]
    return torch.stack([even, odd], 3).flatten(2, 3)  # [B, H, N, dk, dv + dk], in order


def _compose(later, earlier, dv: int):
    """The map `earlier` then `later`, both [..., dk, dv + dk] as [c | M]:
    M_l (M_e S + c_e) + c_l = [M_l c_e + c_l | M_l M_e], one product and an add."""
    out = later[..., dv:] @ earlier  # [..., dk, dv + dk]: [M_l c_e | M_l M_e]
    out[..., :dv] += later[..., :dv]
    return out


def scan_compositions(n: int) -> int:
    """How many map compositions _scan makes for n chunks (2 n - log2(n) - 2 for a power of
    two): the planner counts their FLOPs."""
    if n <= 1:
        return 0
    if n % 2:
        return scan_compositions(n - 1) + 1
    return n // 2 + (n // 2 - 1) + scan_compositions(n // 2)


def _block(q, k, v, g, beta, state, cuts: list, starts_fresh: bool, chunk: int, scan, dtype):
    """One block: raw slices [B, L, H*, d] (g, beta [B, L, Hv]) and its start state
    [B, Hv, dk, dv] (or None) -> (o [B, L, Hv, dv] in `dtype`, end state). `cuts`: the document
    starts inside the block (relative, > 0); starts_fresh: a document starts at the block's
    first token, so the start state is not read."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, dtype)  # [B, Hv, L, d], [B, Hv, L]
    if starts_fresh:
        state = None
    edges = [0, *cuts, v.shape[2]]
    outs = []
    for s, e in zip(edges[:-1], edges[1:], strict=True):  # one document's piece at a time
        if s > 0:
            state = None  # a document starts here: the state restarts from zero
        o, state = _chunk_form(
            q[:, :, s:e],
            k[:, :, s:e],
            v[:, :, s:e],
            g[:, :, s:e],
            beta[:, :, s:e],
            state,
            chunk,
            scan,
        )
        outs.append(o)
    o = torch.cat(outs, 2) if len(outs) > 1 else outs[0]  # [B, Hv, L, dv]
    return o.transpose(1, 2), state  # [B, L, Hv, dv]


def _blocks(n_tok: int, starts: tuple, size: int):
    """(t0, t1, cuts, starts_fresh) per block of `size` tokens; `starts`: sorted document
    starts (> 0) in the row."""
    out = []
    for t0 in range(0, n_tok, size):
        t1 = min(t0 + size, n_tok)
        lo, hi = bisect.bisect_left(starts, t0), bisect.bisect_left(starts, t1)
        inside = [p - t0 for p in starts[lo:hi]]
        fresh = bool(inside) and inside[0] == 0
        out.append((t0, t1, inside[1:] if fresh else inside, fresh))
    return out


class _GatedDeltaRule(torch.autograd.Function):
    """Forward in blocks under no_grad, saving the inputs and the state at each block's start;
    backward recomputes one block at a time, last block first."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, starts, chunk, block_chunks, scan):
        dtype = _compute_dtype(q, k, v, g, beta)
        b, n_tok, hv, dv = v.shape
        dk = k.shape[-1]
        state = None if initial_state is None else initial_state.to(dtype)
        out = torch.empty(b, n_tok, hv, dv, dtype=v.dtype, device=v.device)
        blocks = _blocks(n_tok, starts, block_chunks * chunk)
        block_states = []  # the state at each block's start (None: zero)
        for t0, t1, cuts, fresh in blocks:
            block_states.append(state)
            sl = slice(t0, t1)
            o, state = _block(
                q[:, sl],
                k[:, sl],
                v[:, sl],
                g[:, sl],
                beta[:, sl],
                state,
                cuts,
                fresh,
                chunk,
                scan,
                dtype,
            )
            out[:, sl] = o
        if state is None:  # T = 0 is refused, so only an initial_state of None with no tokens
            state = torch.zeros(b, hv, dk, dv, dtype=dtype, device=v.device)
        ctx.blocks, ctx.chunk, ctx.scan, ctx.dtype = blocks, chunk, scan, dtype
        ctx.has_initial = initial_state is not None
        ctx.state_dtype = None if initial_state is None else initial_state.dtype
        ctx.save_for_backward(q, k, v, g, beta, *block_states)
        return out, state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_state):
        q, k, v, g, beta, *block_states = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        need = ctx.needs_input_grad[:5]
        grads = [torch.zeros_like(x) if n else None for x, n in zip(inputs, need, strict=True)]
        # the gradient of the state at the current block's end, fp32 (or fp64)
        d_state = None if grad_state is None else grad_state.to(ctx.dtype)
        for i in range(len(ctx.blocks) - 1, -1, -1):
            t0, t1, cuts, fresh = ctx.blocks[i]
            sl = slice(t0, t1)
            leaves = [
                x[:, sl].detach().requires_grad_(n) for x, n in zip(inputs, need, strict=True)
            ]
            s0 = block_states[i]
            want_s0 = s0 is not None and not fresh and (i > 0 or ctx.needs_input_grad[5])
            if s0 is not None:
                s0 = s0.detach().requires_grad_(want_s0)
            with torch.enable_grad():
                o, s1 = _block(*leaves, s0, cuts, fresh, ctx.chunk, ctx.scan, ctx.dtype)
            wrt = [x for x in leaves if x.requires_grad] + ([s0] if want_s0 else [])
            outputs, out_grads = [o], [grad_out[:, sl].to(ctx.dtype)]
            if d_state is not None:
                outputs.append(s1)
                out_grads.append(d_state)
            found = torch.autograd.grad(outputs, wrt, out_grads, allow_unused=True)
            found = list(found)
            for j, x in enumerate(leaves):
                if x.requires_grad:
                    got = found.pop(0)
                    if got is not None:
                        grads[j][:, sl] = got
            d_state = found.pop(0) if want_s0 else None
        d_initial = None
        if ctx.needs_input_grad[5]:
            d_initial = torch.zeros_like(block_states[0], dtype=ctx.state_dtype)
            if d_state is not None:
                d_initial = d_state.to(ctx.state_dtype)
        return (*grads, d_initial, None, None, None, None)


def _check(q, k, v, g, beta, doc_lens, initial_state) -> tuple:
    """The sorted document starts (> 0) after checking every shape."""
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k [B, T, Hk, dk] and v [B, T, Hv, dv]: {q.shape}, {k.shape}, {v.shape}"
        )
    b, n_tok, hk, dk = k.shape
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    if g.shape != (b, n_tok, hv) or beta.shape != (b, n_tok, hv):
        raise ValueError(f"g, beta [B, T, Hv] = {(b, n_tok, hv)}: {g.shape}, {beta.shape}")
    if initial_state is not None and initial_state.shape != (b, hv, dk, dv):
        raise ValueError(
            f"initial_state [B, Hv, dk, dv] = {(b, hv, dk, dv)}: {initial_state.shape}"
        )
    if n_tok == 0:
        raise ValueError("no tokens")
    if doc_lens is None:
        return ()
    lens = [int(n) for n in doc_lens]
    if sum(lens) != n_tok or min(lens) < 1:
        raise ValueError(f"doc_lens must be positive and sum to T = {n_tok}: {lens}")
    starts, at = [], 0
    for n in lens[:-1]:
        at += n
        starts.append(at)
    return tuple(starts)


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    doc_lens: Sequence[int] | None = None,
    initial_state=None,
    chunk: int = 64,
    block_chunks: int | None = None,
    state_pass: str = "scan",
    output_final_state: bool = False,
):
    """The gated delta rule in chunks, linear in T in time and memory.

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv] (g: log-decay <= 0, any float
    dtype; beta in (0, 1)) -> out [B, T, Hv, dv] in v's dtype, or (out, final state
    [B, Hv, dk, dv] in fp32, fp64 for fp64 inputs) when output_final_state. Value head j reads
    key head j // (Hv // Hk). q and k are L2-normalised inside (eps 1e-6), q scaled by
    dk ** -0.5; all arithmetic in fp32 (fp64 for fp64 inputs). doc_lens: token counts summing
    to T; the state restarts from zero at each document, the first starting from initial_state.
    Each document is its own pass: many short documents are slow. Differentiable in q, k, v, g,
    beta and initial_state (once: no double backward).

    block_chunks: chunks per block (None: BLOCK_CHUNKS); backward holds one block's
    intermediates at a time and the forward keeps one state per block. state_pass: "scan" (the
    state passes through a block's chunks by a log-depth scan of their maps: few, larger steps)
    or "loop" (the textbook pass, one chunk after another: the same results within rounding,
    many small steps)."""
    starts = _check(q, k, v, g, beta, doc_lens, initial_state)
    block_chunks = BLOCK_CHUNKS if block_chunks is None else block_chunks
    if chunk < 1 or block_chunks < 1:
        raise ValueError(f"chunk and block_chunks must be positive: {chunk}, {block_chunks}")
    if state_pass not in ("scan", "loop"):
        raise ValueError(f"state_pass is 'scan' or 'loop': {state_pass!r}")
    scan = state_pass == "scan"
    out, state = _GatedDeltaRule.apply(
        q, k, v, g, beta, initial_state, starts, chunk, block_chunks, scan
    )
    return (out, state) if output_final_state else out


def recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    doc_lens: Sequence[int] | None = None,
    initial_state=None,
    output_final_state: bool = False,
):
    """The per-token recurrence, the readable reference (slow, for tests): same arguments and
    results as gated_delta_rule, plain autograd."""
    starts = set(_check(q, k, v, g, beta, doc_lens, initial_state))
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta), v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, dtype)  # [B, Hv, T, d], [B, Hv, T]
    b, hv, n_tok, dk = k.shape
    dv = v.shape[-1]
    zero = torch.zeros(b, hv, dk, dv, dtype=dtype, device=v.device)
    state = zero if initial_state is None else initial_state.to(dtype)  # S [B, Hv, dk, dv]
    outs = []
    for t in range(n_tok):
        if t in starts:
            state = zero  # a document starts: the state restarts from zero
        k_t, q_t = k[:, :, t].unsqueeze(-1), q[:, :, t].unsqueeze(-1)  # [B, Hv, dk, 1]
        state = state * g[:, :, t].exp()[..., None, None]  # S <- exp(g_t) S
        pred = (state * k_t).sum(-2)  # S^T k_t [B, Hv, dv]
        delta = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - pred)  # [B, Hv, dv]
        state = state + k_t * delta.unsqueeze(-2)  # S <- S + k_t delta^T
        outs.append((state * q_t).sum(-2))  # o_t = S^T q_t [B, Hv, dv]
    out = torch.stack(outs, 1).to(out_dtype)  # [B, T, Hv, dv]
    return (out, state) if output_final_state else out
