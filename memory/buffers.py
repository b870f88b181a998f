"""What one GPU holds inside a recomputed decoder layer's backward and the chunked loss, by moment.

    from memory.buffers import Buffer, layer_backward_moments, layer_saved_bytes
    saved = layer_saved_bytes(Qwen3Config.preset("qwen3-8b"), 131_072, sp=8)
    saved[Buffer.MLP_INPUT]                      # bytes of the MLP's saved input on one GPU
    layer_backward_moments(config, 131_072, 8)   # {"MLP backward": {Buffer: bytes}, ...}
    layer_forward_moments(config, 131_072, 8)    # the same for a forward alone (evaluation)

A moment is one point of the step (the MLP's backward, say) at which memory/plan.py adds up the live
tensors; each moment here is a dict {Buffer: bytes}, and each constant in it says which tensors it
counts. Buffer names every kind of tensor memory/plan.py counts (these activations, FSDP2's gathered
units and fp32 buffers, the loss's tensors); its value is only the label shown to users, so the
planner's sums never depend on wording. Sizes are per GPU at `tokens` local tokens, arithmetic on
the config: nothing is allocated.
"""

from __future__ import annotations

import math
from enum import Enum

from memory.model_size import DELTA_RULE_CHUNK, adapter_shapes
from model.attention import backward_workspace_bytes, varlen_backward_workspace_bytes
from model.config import Qwen3Config
from model.delta_rule import BLOCK_CHUNKS
from model.lora import LoraSpec
from model.moe import TILE as MOE_TILE
from model.qwen3 import RMSNORM_CHUNK_ELEMS


class Buffer(str, Enum):
    """A tensor, or tensors freed together, that one GPU holds at some moment of the step."""

    # one decoder layer's saved tensors once recomputed, in the order its forward saves them
    INPUT_NORM = "input norm"
    NORMED_INPUT = "normed input (q, k, v projections)"
    QK_NORMS = "q and k per-head norms"
    QKV_AT_SDPA = "q, k, v at SDPA [T, heads/sp, hd]"
    ATTN_OUT = "attention out [T, heads/sp, hd] (SDPA)"
    ATTN_LSE = "SDPA logsumexp, fp32"
    O_PROJ_INPUT = "o_proj input (all-to-all back)"
    ATTN_GATE = "Qwen3.5 output gate: sigmoid(gate) and o_proj's input out x it [t, heads, hd]"
    POST_NORM = "post-attention norm"
    MLP_INPUT = "MLP input (normed h)"
    MLP_INTERMEDIATES = "MLP gate, up, act, product"
    # a Gated DeltaNet layer's (Qwen3.5, model/qwen3_5.py) in place of attention's, in the same
    # order; per GPU: [t, X] token-local, or [T, X / sp] after the exchange (the same bytes)
    GDN_CONV = "GDN conv: channel copy, K-1 shifted products, output [t, C] (+ [T] reach masks)"
    GDN_QKV = "GDN delta rule's q, k, v: conv's silu output [t, C] and v's copy [t, nv, dv]"
    GDN_GATES = "GDN decays and step sizes [t, nv]: fp32 softplus input and output, g; beta"
    GDN_STATES = "GDN delta rule's fp32 state at each block's start [nv/sp, dk, dv]"
    GDN_NORM = "GDN gated norm: fp32 input, z and silu(z), normed and weighted rows, fp32 1/rms"
    GDN_OUT_PROJ_INPUT = "GDN out_proj input [t, nv x dv]"
    # LoRA (model/lora.py): what the adapters save for their gradients (see _lora_saved)
    LORA_QKV = "LoRA q, k, v adapters: x A^T [t, rank] (with dropout: dropped x and mask)"
    LORA_O = "LoRA o_proj adapter: x A^T [t, rank] (with dropout: dropped x and mask)"
    LORA_MLP = "LoRA MLP adapters: x A^T [t or tile, rank] (with dropout: dropped x and mask)"
    # around a layer's backward
    LAYER_INPUT = "layer input (copied back from the host, or kept)"
    KEPT_INPUTS = "layer inputs kept on the device (layers not yet in backward)"
    KEPT_ATTENTION = "attention out and lse kept on the device (layers not yet in backward)"
    KEPT_DOCUMENTS = "documents' cumulative lengths and flash's rng state (layers not in backward)"
    NEXT_INPUT = "next layer's input, prefetched from host"
    NEXT_ATTENTION = "next layer's attention out and lse, prefetched with its input"
    ROPE = "RoPE cos and sin (shared by all layers)"
    OUTPUT_GRAD = "output gradient dy"
    MLP_TILE = "MLP tile: gate, up, act, product + grads of product, act, up"
    MLP_WEIGHT_GRAD_ACC = "MLP fp32 weight-gradient accumulators (3 x H x I)"
    MLP_INPUT_GRAD_BUFFER = "MLP input-gradient buffer"
    MLP_BACKWARD = "MLP: gate, up, act + grads of product, act, up"
    LORA_MLP_TILE = "LoRA down adapter in an MLP tile: product's summed gradient, adapter output"
    MLP_INPUT_GRAD = "MLP input gradient"
    NORM_INPUT_GRAD = "norm input gradient"
    NORM_TEMPORARIES = "RMSNorm backward fp32 temporaries (one row chunk)"
    RESIDUAL_GRAD = "residual gradient dh"
    ATTN_OUT_GRAD = "gradient of attention out [T, heads/sp, hd]"
    O_PROJ_INPUT_GRAD = "o_proj input gradient [t, heads, hd] and its all-to-all send copy"
    QKV_GRAD_AT_SDPA = "dq, dk, dv [T, heads/sp, hd]"
    FLASH_WORKSPACE = "FlashAttention fp32 dq accumulator and delta"
    CUDNN_WORKSPACE = "cuDNN attention backward workspace (projected as flash's)"
    FLASH_GQA_GRADS = "FlashAttention dk, dv expanded to the query heads [T, heads/sp, hd]"
    DOCUMENTS_PADDING = "flash varlen fp32 dq accumulator and delta: 128 padding rows a document"
    QKV_GRAD = "dq, dk, dv [t, heads, hd]"
    ATTN_GATE_GRAD = "q_proj output's gradient [t, heads, 2 hd], the output gate's half in"
    LAYER_GRADS = "this layer's unsharded gradients so far"
    # around a Gated DeltaNet layer's recompute and backward
    GDN_PACKED = "GDN projections packed per key head [t, nk, 2 dk + r (dv + 2)] (forward's local)"
    GDN_OUT = "GDN delta rule output [t, nv, dv] and z [t, nv x dv] (forward's locals)"
    GDN_NORM_TEMPORARIES = "GDN gated norm forward: fp32 product and its cast [t, nv x dv]"
    GDN_NORM_GRADS = "GDN gated norm backward: fp32 gradient, its products, a cast [t, nv x dv]"
    GDN_RULE_GRADS = "GDN delta rule backward: output gradient, dq, dk, dv, dg, dbeta"
    GDN_BLOCK = "GDN delta rule backward: one block's fp32 working set"
    GDN_INPUT_GRAD = "GDN in_proj input gradient [t, H], z's part in"
    # a mixture-of-experts layer (model/moe.py) in place of the MLP
    MOE_ROUTING = "MoE routing: the chosen experts and weights, pairs sorted by expert"
    MOE_ROUTER = "MoE router logits and fp32 probabilities [t, experts]"
    MOE_TILE = "MoE tile: its tokens, gate/up, act, product, output (+ their gradients)"
    MOE_WEIGHT_GRAD_ACC = "MoE fp32 weight-gradient accumulators of one expert (3 x H x I)"
    MOE_SHARED = "MoE shared expert: gate, up, act, product [t, S] and its gate (+ gradients)"
    # FSDP2
    GATHERED_LAYER = "gathered layer (bf16)"
    NEXT_UNIT = "next unit, prefetched"
    TIED_EMBEDDING = "tied embedding (root unit)"
    TIED_EMBEDDING_GRAD = "tied embedding's gradient from the loss, until the root's reduce-scatter"
    GATHERED_HEAD = "embedding or [norm + lm_head] unit, gathered (bf16)"
    GATHERED_LAST_LAYER = "last layer, gathered since its forward (bf16)"
    REDUCE_SCATTER_INPUT = "fp32 reduce-scatter input of the unit before"
    GRAD_SHARDS = "gradient shards reduced so far"
    STAGED_SHARDS = "fp32 shards copied to the GPU (CPU offload)"
    STAGED_GRADS = "fp32 gradient shards before the host copy (CPU offload)"
    # the loss
    FINAL_NORM = "final norm input and rstd"
    HIDDEN = "hidden states (final norm output)"
    HIDDEN_GRAD = "hidden gradient [N, H]"
    LM_HEAD_GRAD_ACC = "fp32 lm_head gradient accumulator (V x H)"
    LOSS_CHUNK = "one chunk: fp32 logits and log-probabilities, bf16 p (+ CPU bf16 temporaries)"
    LM_HEAD_GRAD = "lm_head gradient in the weight's dtype"
    HIDDEN_GRAD_SCALED = "hidden gradient and its scaled copy"
    # a forward alone (evaluation: no autograd graph, nothing saved)
    ROW_SLICE = "the row's slice: input ids, labels, positions (int64)"
    FORWARD_INPUT = "layer input (the residual stream)"
    QKV_NORMED = "q, k after their norms, v [t, heads, hd]"
    ROPE_TEMPORARIES = "RoPE temporaries (3 x q; or q rotated and 3 x k)"
    QKV_ROTATED = "q, k after RoPE, v [t, heads, hd]"
    ATTN_OUT_BACK = "attention out on its way back: all-to-all send and receive, or its copy"
    RESIDUAL = "residual stream after attention"
    MLP_FORWARD = "MLP act, up, product (one tile of them when tiled)"
    MLP_OUTPUT = "tiled MLP output and a tile's down projection"
    EVAL_LOSSES = "per-token losses and the counted rows' indices"


CUDA_SMALLEST_BLOCK = 512  # bytes: torch's CUDA caching allocator rounds every tensor up to it


def documents_state_bytes(documents: int, device: str = "cuda") -> int:
    """What one layer's attention keeps on a GPU until its backward for a row of `documents`
    documents (--documents masked; 0: a stream, nothing): the one flash call's int32 cumulative
    lengths (documents + 1) and its rng state (two small tensors), each in its own allocator
    block. The lengths are one tensor per row, which every layer's call shares: counted with each
    layer, a bound a few KiB over. The per-document path (CPU) keeps nothing. 11 documents: 1,536
    bytes per layer."""
    if documents <= 0 or device != "cuda":
        return 0
    blocks = -(-(documents + 1) * 4 // CUDA_SMALLEST_BLOCK)
    return (blocks + 2) * CUDA_SMALLEST_BLOCK


def attention_workspace(attn_backend: str) -> Buffer:
    """The buffer that names the attention backward's own workspace for this kernel: cuDNN's is
    its own term (its size projected as FlashAttention-2's until a GPU measures it), so the first
    GPU run shows which one the peak holds."""
    return Buffer.CUDNN_WORKSPACE if attn_backend == "cudnn" else Buffer.FLASH_WORKSPACE


def _norm_saved(rows: int, dim: int, b: int, fused: bool, input_elsewhere: bool) -> int:
    """Bytes an RMSNorm over [rows, dim] saves for backward, leaving out its weight (a parameter).

    Fused (model/qwen3.py's _RMSNormFn, or F.rms_norm's CUDA kernel): the input itself, unless
    another op keeps it anyway, and the fp32 rstd. Unfused (transformers, or the same arithmetic
    left to autograd: normalise in fp32, cast, scale): an fp32 copy of the input, the normalised
    bf16 tensor and the fp32 rstd.
    """
    # per element: the input (b bytes), or the fp32 copy (4) and the normalised tensor (b);
    # per row: the fp32 rstd (4 bytes)
    if fused:
        return (0 if input_elsewhere else rows * dim * b) + rows * 4
    return rows * dim * (4 + b) + rows * 4


def layer_saved_bytes(
    config: Qwen3Config,
    tokens: int,
    sp: int,
    *,
    fused_norm: bool = True,
    tiled_mlp: bool = True,
    compute_bytes: int = 2,
    lora: LoraSpec | None = None,
    device: str = "cuda",
    linear: bool = False,
) -> dict[Buffer, int]:
    """What autograd keeps for one decoder layer's backward once it has been recomputed.

    Per GPU at `tokens` local tokens, in the order the forward saves it, leaving out the layer
    input (held by the checkpoint), the parameters and the shared RoPE tables. Checked against
    model/qwen3.py's DecoderLayer with model/ulysses.py's attention in tests/test_memory_plan.py.
    RoPE saves only cos/sin; SDPA (flash, with enable_gqa: kv heads are not repeated to the query
    heads) saves q, k, v, out and an fp32 logsumexp; with sp = 1 o_proj's input is a view of
    SDPA's out, with sp > 1 it is the all-to-all's result; a tiled MLP saves only its input.
    lora: a frozen weight's linear saves nothing of its input, so an input is kept only where an
    adapter without dropout saves it (tiled, the MLP's input always); the adapters save what
    _lora_saved counts, whose dropout mask is 1 byte an element on CUDA, b on a CPU.
    linear: a Qwen3.5 Gated DeltaNet layer: its block's (gdn_saved_bytes) in attention's place;
    its projections take no adapters, so they save their (normed) input.
    """
    c, b, t = config, compute_bytes, tokens
    H, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    X, Q = t * H * b, t * nh * hd * b  # hidden-sized; q-sized ([t, nh, hd] == [T, nh/sp, hd])
    K = t * max(nkv, sp) * hd * b  # k or v at SDPA: [T, nkv/sp, hd]; one repeated head if sp > nkv
    mask = 1 if device == "cuda" else b  # dropout's mask: CUDA's bool, a CPU's scaled noise

    def input_saved(names: set[str]) -> bool:  # by these linear layers' own backward
        return lora is None or (lora.dropout == 0 and bool(names & set(lora.targets)))

    if linear:
        mixer = {Buffer.NORMED_INPUT: X, **gdn_saved_bytes(c, t, sp, b)}
    else:
        mixer = {
            Buffer.NORMED_INPUT: X if input_saved({"q_proj", "k_proj", "v_proj"}) else 0,
            Buffer.LORA_QKV: _lora_saved(c, lora, {"q_proj", "k_proj", "v_proj"}, t, b, mask),
            Buffer.QK_NORMS: _norm_saved(t * nh, hd, b, fused_norm, False)
            + _norm_saved(t * nkv, hd, b, fused_norm, False),
            Buffer.QKV_AT_SDPA: Q + 2 * K,  # q, and k and v
            Buffer.ATTN_OUT: Q,
            Buffer.ATTN_LSE: t * nh * 4,  # [nh/sp, T] in fp32 (4 bytes)
            Buffer.O_PROJ_INPUT: Q if sp > 1 and input_saved({"o_proj"}) else 0,
            Buffer.LORA_O: _lora_saved(c, lora, {"o_proj"}, t, b, mask),
            # Qwen3.5's gated attention: out x sigmoid(gate) saves the sigmoid and its other
            # factor (o_proj's input before, counted above), o_proj the product
            Buffer.ATTN_GATE: 2 * Q if c.attn_output_gate else 0,
        }
    return {
        Buffer.INPUT_NORM: _norm_saved(t, H, b, fused_norm, input_elsewhere=True),
        **mixer,
        Buffer.POST_NORM: _norm_saved(t, H, b, fused_norm, input_elsewhere=False),
        # a MoE block (model/moe.py) saves its input whatever is frozen, and no intermediates:
        # its loop recomputes them per tile; its sparse layers have no MLP adapters
        Buffer.MLP_INPUT: X
        if tiled_mlp or c.num_experts or input_saved({"gate_proj", "up_proj"})
        else 0,
        # untiled: 4 x [t, intermediate]: gate, up, act = silu(gate), product = act * up (the
        # product saved by down_proj)
        Buffer.MLP_INTERMEDIATES: 0
        if tiled_mlp or c.num_experts
        else (3 + input_saved({"down_proj"})) * t * inter * b,
        Buffer.LORA_MLP: 0
        if tiled_mlp or c.num_experts
        else _lora_saved(c, lora, MLP_PROJECTIONS, t, b, mask),
    }


def gdn_saved_bytes(config: Qwen3Config, tokens: int, sp: int, compute_bytes: int = 2) -> dict:
    """What a Gated DeltaNet block (model/qwen3_5.py's GatedDeltaNet, model/ulysses.py's
    exchange for sp > 1) saves for backward once recomputed, in forward order, per GPU at `tokens`
    local tokens: t x C channels token-local, or T x C/sp after the exchange (the same bytes).
    Counted against autograd's saved tensors and the CPU meter (tests/test_memory_plan.py):
      GDN_CONV: the conv (causal_depthwise_conv) saves its channel copy (the packed split, made
        contiguous), each of its K - 1 shifted products and its sum, silu's input: (K + 1) x [t, C];
        the K - 1 [T, 1] masks that stop a tap at a document start; its filters [C/sp, K];
      GDN_QKV: silu's output, of which q and k are views the delta rule saves, and v's contiguous
        copy [t, nv, dv];
      GDN_GATES: g = -exp(A_log) * softplus(a + dt_bias) keeps three fp32 [t, nv] (softplus's
        input and output, g), and beta = sigmoid(b) one in the compute dtype;
      GDN_STATES: model/delta_rule.py's forward keeps the fp32 state [nv/sp, dk, dv] at the start
        of each block of BLOCK_CHUNKS x 64 = 32,768 tokens but the first: ceil(T / 32,768) - 1;
      GDN_NORM: GatedRMSNorm saves x and z upcast to fp32, silu(z) in fp32, the normed rows and
        their product with the weight in the compute dtype (12 + 2b bytes an element; with b = 4
        the upcasts are x and z themselves: 20), and the fp32 1/rms per row of dv;
      GDN_OUT_PROJ_INPUT: the norm's output, out_proj's input."""
    c, b, t = config, compute_bytes, tokens
    nk, nv, dk, dv = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    C, vd, K, T = 2 * nk * dk + nv * dv, nv * dv, c.linear_conv_kernel_dim, t * sp
    block = BLOCK_CHUNKS * DELTA_RULE_CHUNK
    return {
        Buffer.GDN_CONV: (K + 1) * t * C * b + (K - 1) * T * b + C // sp * K * b,
        Buffer.GDN_QKV: t * C * b + t * vd * b,
        Buffer.GDN_GATES: t * nv * (3 * 4 + b),
        Buffer.GDN_STATES: (-(-T // block) - 1) * (nv // sp) * dk * dv * 4,
        Buffer.GDN_NORM: t * vd * (12 + 2 * b) + t * nv * 4,
        Buffer.GDN_OUT_PROJ_INPUT: t * vd * b,
    }


# The delta rule's backward recomputes one block (BLOCK_CHUNKS chunks of 64: 32,768 tokens) with
# autograd and takes its gradients: its fp32 C x C decays, masks, inverse and products, the
# [C, dk + dv] rows and their gradients, and the scan's [dk, dk + dv] maps of every chunk through
# its levels, for the block's nv/sp heads. Fitted to the CPU meter at dk = dv = 32, 64 and 128
# (chunk 64, 256 and 512 chunks a block, 4 value heads, bf16 inputs), within 0.3%: a head holds
# 7 fp32 tensors of [rows, 64], 21 of [rows, (dk + dv) / 2] and 6.5 maps a chunk (3.4 GB for a
# Qwen3.5-9B rank at sp 8). With fp32 inputs the block's upcasts of v and of the output gradient
# are the tensors themselves: 2 of the 21 are not made (within 0.3%).
GDN_BLOCK_CC, GDN_BLOCK_CD, GDN_BLOCK_MAPS = 7, 21, 6.5


def _gdn_block(c: Qwen3Config, tokens: int, sp: int, b: int = 2) -> int:
    """GDN_BLOCK's bytes: one block's backward working set (the comment above)."""
    T, C = tokens * sp, DELTA_RULE_CHUNK
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    rows = min(BLOCK_CHUNKS * C, -(-T // C) * C)  # a short row is one block of whole chunks
    cd = GDN_BLOCK_CD
    if b == 4:
        cd -= 2
    per_row = GDN_BLOCK_CC * C + cd * (dk + dv) / 2 + GDN_BLOCK_MAPS * dk * (dk + dv) / C
    return int(c.linear_num_value_heads // sp * rows * 4 * per_row)


def _gdn_moments(c: Qwen3Config, t: int, sp: int, b: int, saved: dict, io: dict, grads: int):
    """A recomputed Gated DeltaNet layer's own moments (layer_backward_moments' docstring)."""
    nk, nv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
    C, vd, X = (
        2 * nk * dk + nv * c.linear_value_head_dim,
        nv * c.linear_value_head_dim,
        t * c.hidden_size * b,
    )
    HV = c.hidden_size * vd * b  # out_proj's (and in_proj_z's) weight gradient
    return {
        "Gated DeltaNet recompute (gated norm)": {
            **io,
            **_saved_through(saved, Buffer.GDN_NORM),
            Buffer.OUTPUT_GRAD: X,
            Buffer.GDN_PACKED: t * (C + 2 * nv) * b,
            Buffer.GDN_OUT: 2 * t * vd * b,
            Buffer.GDN_NORM_TEMPORARIES: t * vd * (4 + b),
        },
        "Gated DeltaNet gated norm backward": {
            **io,
            **_saved_through(saved, Buffer.GDN_NORM),
            Buffer.RESIDUAL_GRAD: X,
            # at the product's backward: the gradient from out_proj (b), its fp32 upcast (the
            # gradient itself when b = 4), the weighted rows' gradient (b) and silu(z)'s (fp32);
            # held to the rehearsal at Qwen3.5-9B's and 35B-A3B's shapes
            Buffer.GDN_NORM_GRADS: t * vd * (2 * b + 4 + (4 if b < 4 else 0)),
            Buffer.LAYER_GRADS: grads + HV,
        },
        "Gated DeltaNet delta rule backward": {
            **io,
            **_saved_through(saved, Buffer.GDN_STATES),
            Buffer.RESIDUAL_GRAD: X,
            Buffer.GDN_INPUT_GRAD: X,
            # the output's gradient, and the zeroed gradients of q, k [t, nk, dk], v [t, nv, dv],
            # g (fp32) and beta [t, nv]
            Buffer.GDN_RULE_GRADS: t * vd * b + 2 * t * nk * dk * b + t * vd * b + t * nv * (4 + b),
            Buffer.GDN_BLOCK: _gdn_block(c, t, sp, b),
            Buffer.LAYER_GRADS: grads + 2 * HV,
        },
    }


def _moe_tile(c: Qwen3Config, tokens: int, tile: int, b: int, backward: bool) -> int:
    """Bytes of one tile of model/moe.py's expert loop at its largest point: one expert's m
    token-expert pairs, m at most `tile` (untiled: the block's own tile). Every tile holds the
    pairs' token indices [m] int64 and weights [m, 1] (b bytes). An expert's pairs are counted
    at an even spread over the experts, what a load-balanced router gives (and what a rehearsal
    takes); a busier expert's tile is larger, up to min(tile, tokens) rows (see _moe_rows).

    Forward, at the product act x up: the gathered tokens xt [m, H], gate/up [m, 2I], act and
    product [m, I] each (the down projection [m, H] comes after act is freed: 2H + 3I).
    Backward, the largest of its points (H hidden, I the expert's intermediate size):
      weights' gradient, (go.float() x y.float()).sum(-1): xt, go, y [m, H] (b), gate/up, act,
        product (4 x [m, I], b), and three fp32 [m, H]: go and y upcast and their product (with
        b = 4 the upcasts are the tensors themselves: one);
      autograd through the down product: xt, go, y and the weighted gradient go x w [m, H],
        gate/up, act, and the gradients of product, act and up (6 x [m, I]), down's gradient;
      autograd through gate/up: xt, go, y, go x w, d(gate/up) [m, 2I], dxt [m, H], and the
        expert's bf16 weight gradients, 3 x H x I;
      the weight gradients upcast: xt, go, y, the bf16 gradients and their fp32 copies.
    The expert's fp32 accumulators of earlier tiles are MOE_WEIGHT_GRAD_ACC's."""
    rows = _moe_rows(c, tokens, tile)
    H, inter = c.hidden_size, c.moe_intermediate_size
    pair = 8 + b  # a pair's token index (int64) and weight
    if not backward:
        return rows * (pair + max(H + 4 * inter, 2 * H + 3 * inter) * b)
    upcasts = 3 * H * 4 if b < 4 else H * 4
    grads = 3 * H * inter * b  # one expert's weight gradients, gate/up and down
    return max(
        rows * (pair + (3 * H + 4 * inter) * b + upcasts),
        rows * (pair + (4 * H + 6 * inter) * b) + H * inter * b,
        rows * (pair + (5 * H + 2 * inter) * b) + grads,
        rows * (pair + 3 * H * b) + grads + 3 * H * inter * 4,
    )


def _moe_rows(c: Qwen3Config, tokens: int, tile: int) -> int:
    """Rows of one expert's tile: its share of the tokens x top_k pairs at an even spread over
    the experts, at most the tile. A load-balanced router spreads them so; the experts' load
    in each step's record (router_loss's) says by how much a real one does not."""
    return min(tile or MOE_TILE, _moe_even_pairs(c, tokens))


def _moe_even_pairs(c: Qwen3Config, tokens: int) -> int:
    """One expert's token-expert pairs when the tokens x top_k pairs spread evenly (rounded up)."""
    return -(-tokens * c.num_experts_per_tok // c.num_experts)


def _moe_accumulators(c: Qwen3Config, tokens: int, tile: int) -> int:
    """The fp32 weight-gradient accumulators of the expert in the loop (3 x H x I, 4 bytes):
    live through a tile only when that expert's pairs take more than one tile; the first tile's
    upcast gradients are _moe_tile's."""
    several = _moe_even_pairs(c, tokens) > (tile or MOE_TILE)
    return 3 * c.hidden_size * c.moe_intermediate_size * 4 if several else 0


def _moe_routing(c: Qwen3Config, tokens: int, b: int) -> int:
    """The routing held through the expert loop: each token's top-k weights (compute dtype)
    and experts (int64), the pairs' order (int64) and, in backward, their fp32 gradients."""
    return tokens * c.num_experts_per_tok * (b + 8 + 8 + 4)


MLP_PROJECTIONS = {"gate_proj", "up_proj", "down_proj"}


def _lora_saved(
    c: Qwen3Config, lora: LoraSpec | None, names: set[str], rows: int, b: int, mask: int
) -> int:
    """Bytes the LoRA adapters of the linear layers `names` (those lora targets) save for backward
    over `rows` tokens (model/lora.py's LoraLinear, or a tile's _low_rank_delta): lora_B's input
    x A^T [rows, rank]. lora_A's input is the linear's own input (counted by the caller) unless
    dropout makes its own: then the dropped x [rows, in] and dropout's mask (`mask` bytes an
    element)."""
    if lora is None:
        return 0
    H, inter, q = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim
    inputs = dict(q_proj=H, k_proj=H, v_proj=H, o_proj=q, gate_proj=H, up_proj=H, down_proj=inter)
    total = 0
    for name in names & set(lora.targets):
        total += rows * lora.rank * b
        if lora.dropout > 0:
            total += rows * inputs[name] * (b + mask)
    return total


def _saved_through(saved: dict[Buffer, int], last: Buffer) -> dict[Buffer, int]:
    """What is left of `saved` (in forward order) when backward reaches the op that saved `last`:
    backward runs the ops last to first and frees each one's saved tensors behind it."""
    order = list(saved)
    return {k: saved[k] for k in order[: order.index(last) + 1]}


def layer_backward_moments(
    config: Qwen3Config,
    tokens: int,
    sp: int,
    *,
    offload: bool = True,
    tiled_mlp: bool = True,
    mlp_tile: int = 8192,
    fused_norm: bool = True,
    compute_bytes: int = 2,
    device: str = "cuda",
    norm_chunk: int = RMSNORM_CHUNK_ELEMS,
    attn_backend: str = "cudnn",
    lora: LoraSpec | None = None,
    documents: int = 0,
    linear: bool = False,
) -> dict[str, dict[Buffer, int]]:
    """The activation bytes of one recomputed decoder layer's backward at its moments.

    In the order they come, each with what the recompute saved and is still live, the layer
    input and the next one's (offload), and the moment's own tensors:
      "MLP backward": the product's backward holds gate, up, act and the gradients of product,
        act and up: 6 x [t, intermediate]; tiled, 7 x [tile, intermediate] (the tile's product
        stays referenced), fp32 weight-gradient accumulators and a full input-gradient buffer;
      "post-attention norm backward": its input gradients and one row chunk of fp32 temporaries;
      "attention out-gradient exchange" (sp > 1): o_proj's input gradient [t, heads, hd] goes
        back to SDPA's layout through an all-to-all (model/ulysses_exchange.py): the gradient,
        its send copy and the receive buffer, three q-sized tensors, with o_proj's gradient made;
      "attention backward": SDPA's backward writes dq, dk, dv, with the kernel's own workspace
        (invisible to a CPU meter): FlashAttention's fp32 dq accumulator and delta; cuDNN's,
        under its own name, projected at the same size until bench/gpu_check.py's
        layers.working_set measures it; attn_backend
        "flash" with fewer kv heads than query heads at the kernel also expands dk and dv to the
        query heads (two q-sized buffers in the compute dtype, summed into dk, dv at the end);
        a row of `documents` documents (--documents masked) runs flash's variable-length kernel
        on a GPU whatever the stream's kernel: its workspace pads each document by 128 rows
        (model/attention.py's varlen_backward_workspace_bytes) and it expands dk, dv as flash;
      "q/k norm backward": after SDPA and the exchanges, the q norm's fp32 temporaries for one row
        chunk (model/qwen3.py's _RMSNormFn: the normalised rows, the upcast gradient and two
        partial results of the last expression, live together at its final product).
    The forward exchanges' staging copies and a tile's bf16 weight-gradient products come at
    moments that hold less than these.
    lora (model/lora.py): the frozen weights make no gradient, so the layer's own gradients are
    the adapters' (counted whole at every moment) and the tiled MLP accumulates only its
    adapters' in fp32; the adapters' saved x A^T are layer_saved_bytes'. In a tile's backward
    (model/tiled_mlp.py) a down_proj adapter adds a [tile, intermediate] and a [tile, hidden]:
    the product's gradient is the given one (still referenced) summed with the adapter's part,
    and the adapter's output is held while autograd takes the tile's gradients.
    A mixture of experts' moments are a sparse layer's (model/moe.py), the largest: under LoRA
    its experts are frozen (no expert accumulators) and its adapters are attention's alone. A
    Qwen3.5 MoE's shared expert (model/qwen3_5.py's SharedExpertMoe) runs as a plain SwiGLU in the
    recompute and its backward comes before the routed experts': "MoE shared expert backward"
    holds gate, up, act and the gradients of product, act and up (6 x [t, S]), with its output
    gradient; by the routed experts' backward it has left its input's gradient [t, H] and its
    weights' gradients (3 x H x S and the gate's H).
    linear (a Qwen3.5 Gated DeltaNet layer, model/qwen3_5.py): the MLP's moments over its saved
    tensors (gdn_saved_bytes), then its own, measured with the CPU meter:
      "Gated DeltaNet recompute (gated norm)": the recompute's forward at the gated norm's last
        product, where the forward still holds the packed projections, the delta rule's output
        and z as locals, with the norm's fp32 product and its cast, and the layer's output
        gradient (at Qwen3.5's shapes within 1% of the MLP's backward and the norm's, the three
        largest: the rehearsal's peak is the MLP's at the 9B's, the norm's at the 35B-A3B's);
      "Gated DeltaNet gated norm backward": the norm's fp32 gradient, its two products and a cast;
      "Gated DeltaNet delta rule backward": the zeroed gradients of q, k, v, g, beta, the output's
        gradient, z's part of the input gradient, and one block's working set (_gdn_block).
    """
    c, b, t = config, compute_bytes, tokens
    H, inter, hd, nh = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads
    X, Q = t * H * b, t * nh * hd * b
    K = t * max(c.num_key_value_heads, sp) * hd * b
    Kl = t * c.num_key_value_heads * hd * b  # k or v before any repeat, [t, nkv, hd]
    saved = layer_saved_bytes(
        c,
        t,
        sp,
        fused_norm=fused_norm,
        tiled_mlp=tiled_mlp,
        compute_bytes=b,
        lora=lora,
        device=device,
        linear=linear,
    )
    if lora is not None:  # elements of the layer's adapters, and of its MLP's
        shapes = adapter_shapes(c, lora)  # the largest layer's: a MoE's sparse one, no MLP adapters
        adapter_elements = sum(math.prod(s) for s in shapes.values())
        mlp_adapter_elements = sum(math.prod(s) for k, s in shapes.items() if k.startswith("mlp."))
    io = {  # offload=False: the input is among the kept ones (memory/plan.py counts it so)
        Buffer.LAYER_INPUT: X if offload else 0,
        Buffer.NEXT_INPUT: X if offload else 0,
        Buffer.ROPE: 2 * t * hd * b,  # cos and sin, [t, hd] each
    }
    if c.num_experts:  # model/moe.py: the experts' loop, its stacked gradients made up front
        moe = c.moe_intermediate_size
        mlp = {
            Buffer.OUTPUT_GRAD: X,
            Buffer.MOE_ROUTING: _moe_routing(c, t, b),
            Buffer.MOE_TILE: _moe_tile(c, t, mlp_tile, b, backward=True),
            # LoRA: the experts are frozen, so no expert's gradients are accumulated
            Buffer.MOE_WEIGHT_GRAD_ACC: 0
            if lora is not None
            else _moe_accumulators(c, t, mlp_tile),
            Buffer.MLP_INPUT_GRAD_BUFFER: X,
            # a shared expert's part of the input gradient, waiting for the routed experts'
            Buffer.MOE_SHARED: X if c.shared_expert_intermediate_size else 0,
        }
        inter = c.num_experts * moe  # the layer's MLP gradients: every expert's
    elif tiled_mlp:  # model/tiled_mlp.py: it holds a tile's product while taking its grad
        rows = min(mlp_tile, t)
        down_adapter = lora is not None and "down_proj" in lora.targets
        mlp = {
            Buffer.OUTPUT_GRAD: X,
            # 7 x [tile, intermediate]: the tile's gate, up, act = silu(gate) and product =
            # act * up (4), and the gradients of product, act and up (3)
            Buffer.MLP_TILE: 7 * rows * inter * b,
            # 3 fp32 (4-byte) accumulators, one per weight: gate_proj, up_proj, down_proj; under
            # LoRA only the adapters' accumulators
            Buffer.MLP_WEIGHT_GRAD_ACC: (mlp_adapter_elements if lora else 3 * H * inter) * 4,
            Buffer.MLP_INPUT_GRAD_BUFFER: X,
            # what the tile's MLP adapters save, over the tile's rows
            Buffer.LORA_MLP: _lora_saved(
                c, lora, MLP_PROJECTIONS, rows, b, 1 if device == "cuda" else b
            ),
            # a down_proj adapter: the product's summed gradient [tile, intermediate] beside the
            # given one, and the adapter's output [tile, hidden]
            Buffer.LORA_MLP_TILE: rows * (inter + H) * b if down_adapter else 0,
        }
    else:  # the product itself is freed at its backward; gate, up and act are counted here
        # 6 x [t, intermediate]: gate, up, act (3), and the gradients of product, act and up (3);
        # LoRA: what the MLP adapters saved in the forward
        mlp = {
            Buffer.OUTPUT_GRAD: X,
            Buffer.MLP_BACKWARD: 6 * t * inter * b,
            Buffer.LORA_MLP: saved[Buffer.LORA_MLP],
        }
    post = {
        Buffer.OUTPUT_GRAD: X,
        Buffer.MLP_INPUT_GRAD: X,
        Buffer.NORM_INPUT_GRAD: X,
        # 4 fp32 (4-byte) tensors per element of one row chunk: the normalised rows, the upcast
        # gradient and two partial results of the input gradient's expression
        Buffer.NORM_TEMPORARIES: 4 * min(t * H, norm_chunk) * 4,
    }
    # Qwen3.5's output gate: its gradient, written into the q_proj output's [t, heads, 2 hd] by
    # the slice's backward, waits there for the query's through attention's backward
    gate_grad = {Buffer.ATTN_GATE_GRAD: 2 * t * nh * hd * b if c.attn_output_gate else 0}
    exchange = {  # sp > 1: the gradient, its send copy (2 x q-sized) and the receive buffer
        **gate_grad,
        Buffer.RESIDUAL_GRAD: X,
        Buffer.O_PROJ_INPUT_GRAD: 2 * Q,
        Buffer.ATTN_OUT_GRAD: Q,
    }
    cuda = device == "cuda"
    varlen = cuda and documents > 0  # a row of documents: flash's variable-length kernel
    flash = attn_backend == "flash" or varlen
    expands = cuda and flash and nh > max(c.num_key_value_heads, sp)
    if varlen:  # the row's T tokens on nh/sp heads (Ulysses splits the heads evenly)
        unpadded = varlen_backward_workspace_bytes(t * sp, 0, nh // sp, hd)
        padding = varlen_backward_workspace_bytes(t * sp, documents, nh // sp, hd) - unpadded
        workspace = {Buffer.FLASH_WORKSPACE: unpadded, Buffer.DOCUMENTS_PADDING: padding}
    else:
        workspace = {
            attention_workspace(attn_backend): backward_workspace_bytes(t, nh, hd) if cuda else 0
        }
    attn = {
        **gate_grad,
        Buffer.RESIDUAL_GRAD: X,
        Buffer.ATTN_OUT_GRAD: Q,
        Buffer.QKV_GRAD_AT_SDPA: Q + 2 * K,  # dq, and dk and dv
        **workspace,
        Buffer.FLASH_GQA_GRADS: 2 * Q if expands else 0,  # dk and dv, q-sized once expanded
    }
    qk = {
        **gate_grad,
        Buffer.RESIDUAL_GRAD: X,
        Buffer.QKV_GRAD: Q + 2 * Kl,  # dq, and dk and dv
        Buffer.NORM_TEMPORARIES: 4 * min(t * nh * hd, norm_chunk) * 4,  # as the post norm's
    }
    # The layer's own unsharded gradients (compute dtype) made by each moment: backward runs the
    # MLP (down_proj first), then o_proj, SDPA, the q/k norms, then the projections. HI: one MLP
    # weight's gradient (3 x HI: gate_proj, up_proj, down_proj); HQ: o_proj's. Tiled, the MLP's
    # weight gradients are in the fp32 accumulators until its backward ends.
    HI, HQ = H * inter * b, H * nh * hd * b
    # MoE: HI is every expert's, and the experts' stacked gradients are made whole up front
    grads = [3 * HI if c.num_experts else 0 if tiled_mlp else HI, 3 * HI, 3 * HI + HQ, 3 * HI + HQ]
    S = c.shared_expert_intermediate_size if c.num_experts else 0
    HS = (3 * S + 1) * H * b  # a shared expert's weight gradients and its gate's [1, H]
    grads = [g + HS for g in grads]
    if lora is not None:  # the frozen weights make none: only the adapters' (see above)
        grads = [adapter_elements * b] * 4
    shared = {}
    if S:  # before the routed experts' backward: its product's, with down_proj's gradient made
        shared = {
            "MoE shared expert backward": {
                **io,
                **_saved_through(saved, Buffer.MLP_INPUT),
                Buffer.OUTPUT_GRAD: X,
                Buffer.MOE_SHARED: 6 * t * S * b,
                Buffer.LAYER_GRADS: H * S * b if lora is None else grads[0],
            }
        }
    if linear:
        return {
            **shared,
            "MLP backward": {
                **io,
                **_saved_through(saved, Buffer.MLP_INPUT),
                **mlp,
                Buffer.LAYER_GRADS: grads[0],
            },
            "post-attention norm backward": {
                **io,
                **_saved_through(saved, Buffer.POST_NORM),
                **post,
                Buffer.LAYER_GRADS: grads[1],
            },
            **_gdn_moments(c, t, sp, b, saved, io, grads[1]),
        }
    return {
        **shared,
        "MLP backward": {
            **io,
            **_saved_through(saved, Buffer.MLP_INPUT),
            **mlp,
            Buffer.LAYER_GRADS: grads[0],
        },
        "post-attention norm backward": {
            **io,
            **_saved_through(saved, Buffer.POST_NORM),
            **post,
            Buffer.LAYER_GRADS: grads[1],
        },
        **(
            {
                "attention out-gradient exchange": {
                    **io,
                    **_saved_through(saved, Buffer.ATTN_LSE),
                    **exchange,
                    Buffer.LAYER_GRADS: grads[2],
                }
            }
            if sp > 1
            else {}
        ),
        "attention backward": {
            **io,
            **_saved_through(saved, Buffer.ATTN_LSE),
            **attn,
            Buffer.LAYER_GRADS: grads[2],
        },
        "q/k norm backward": {
            **io,
            **_saved_through(saved, Buffer.QK_NORMS),
            **qk,
            Buffer.LAYER_GRADS: grads[3],
        },
    }


def layer_forward_moments(
    config: Qwen3Config,
    tokens: int,
    sp: int,
    *,
    tiled_mlp: bool = True,
    mlp_tile: int = 8192,
    compute_bytes: int = 2,
    norm_chunk: int = RMSNORM_CHUNK_ELEMS,
    linear: bool = False,
) -> dict[str, dict[Buffer, int]]:
    """The activation bytes of one decoder layer's forward without autograd, at its largest
    moments. Throughout: the layer input and the RoPE tables. linear (a Qwen3.5 Gated DeltaNet
    layer): attention's three moments become its two, both with the normed input and the packed
    projections (locals of the forward): "Gated DeltaNet conv forward", the conv's channel copy,
    running sum, shifted input and product (4 x [t, C]) and its [T] mask; "Gated DeltaNet gated
    norm forward", the delta rule's output and z, and the norm's locals at its last product: x
    upcast, the normed rows and their product with the weight, z upcast and its silu, the fp32
    product and its cast ((16 + 3b) bytes an element of [t, nv x dv]).
      "q norm forward": the normed input, q_proj's output, the q norm's output and its
        temporaries for one row chunk;
      "RoPE forward": the normed input, q, k, v after their norms and apply_rope's temporaries
        (x cos, rotate_half(x) and its product with sin: 3 x q; for k, q rotated and 3 x k);
      "attention forward": q, k, v rotated, and with sp > 1 at SDPA's layout, SDPA's output and
        the exchange back (its send and receive buffers); with sp = 1 the output's [t, nh x hd]
        copy for o_proj instead (the log-sum-exp is freed by then);
      "post-attention norm forward": the residual stream h, the norm's output and one row
        chunk of its fp32 temporaries;
      "MLP forward": the residual stream h, the post-attention norm's output and three
        [t (or tile), intermediate] tensors at act x up; tiled, the output and one tile's down
        projection too.
    Each moment frees what the one before made: nothing is saved for a backward.
    """
    c, b, t = config, compute_bytes, tokens
    H, inter, hd, nh = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads
    X, Q = t * H * b, t * nh * hd * b
    K = t * max(c.num_key_value_heads, sp) * hd * b  # k or v at SDPA, one repeated head if sp > nkv
    Kl = t * c.num_key_value_heads * hd * b  # k or v before the exchange, [t, nkv, hd]
    rows = min(mlp_tile, t) if tiled_mlp else t
    mlp = {
        Buffer.MLP_FORWARD: 3 * rows * inter * b,  # act, up and product = act x up
        # the output [t, H] and one tile's down projection [tile, H]
        Buffer.MLP_OUTPUT: X + rows * H * b if tiled_mlp else 0,
    }
    if c.num_experts:  # model/moe.py: the router's [t, E] first, then the loop over experts
        mlp = {
            # a Qwen3.5 MoE's shared expert first: its act, up and product [t, S]
            Buffer.MOE_SHARED: 3 * t * c.shared_expert_intermediate_size * b,
            Buffer.MOE_ROUTER: t * c.num_experts * (b + 4),
            Buffer.MOE_ROUTING: _moe_routing(c, t, b),
            Buffer.MOE_TILE: _moe_tile(c, t, mlp_tile, b, backward=False),
            Buffer.MLP_OUTPUT: X,
        }
    # RMSNorm's forward per element of a chunk: its square, then the normalised rows (fp32
    # inputs: one at a time); for bf16 also the fp32 upcast the two are made from, and the cast.
    # Per row: the fp32 1/rms of every row, and of the chunk's rows.
    norm_bytes = 4 if b == 4 else 4 + 4 + b  # bf16: upcast, square or normalised rows, cast
    io = {Buffer.FORWARD_INPUT: X, Buffer.ROPE: 2 * t * hd * b}  # RoPE: cos and sin
    attention = {
        "q norm forward": {
            **io,
            Buffer.NORMED_INPUT: X,
            Buffer.QKV_NORMED: 2 * Q,  # q_proj's output and the norm's
            # 8 bytes per row (t x nh rows of hd): the fp32 1/rms of every row (4), and of the
            # chunk's rows (4, counted for every row: a bound)
            Buffer.NORM_TEMPORARIES: min(t * nh * hd, norm_chunk) * norm_bytes + 8 * t * nh,
        },
        "RoPE forward": {
            **io,
            Buffer.NORMED_INPUT: X,
            Buffer.QKV_NORMED: Q + 2 * Kl,
            # x cos, rotate_half(x) and its product with sin: 3 x q, or q rotated and 3 x k
            Buffer.ROPE_TEMPORARIES: max(3 * Q, Q + 3 * Kl),
        },
        "attention forward": {
            **io,
            Buffer.NORMED_INPUT: X,
            Buffer.QKV_ROTATED: Q + 2 * Kl,
            Buffer.QKV_AT_SDPA: Q + 2 * K if sp > 1 else 0,
            Buffer.ATTN_OUT: Q,
            # sp > 1: the exchange's send and receive buffers; sp = 1: the [t, nh x hd] copy
            Buffer.ATTN_OUT_BACK: 2 * Q if sp > 1 else Q,
        },
    }
    if linear:
        nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
        vd = nv * c.linear_value_head_dim
        C = 2 * nk * c.linear_key_head_dim + vd
        packed = {Buffer.NORMED_INPUT: X, Buffer.GDN_PACKED: t * (C + 2 * nv) * b}
        attention = {
            "Gated DeltaNet conv forward": {
                **io,
                **packed,
                Buffer.GDN_CONV: 4 * t * C * b + t * sp * b,
            },
            "Gated DeltaNet gated norm forward": {
                **io,
                **packed,
                Buffer.GDN_OUT: 2 * t * vd * b,
                Buffer.GDN_NORM_TEMPORARIES: t * vd * (16 + 3 * b) + t * nv * 4,
            },
        }
    return {
        **attention,
        "post-attention norm forward": {
            **io,
            Buffer.RESIDUAL: X,
            Buffer.POST_NORM: X,
            Buffer.NORM_TEMPORARIES: min(t * H, norm_chunk) * norm_bytes + 8 * t,  # as the q norm's
        },
        "MLP forward": {
            **io,
            Buffer.RESIDUAL: X,
            Buffer.POST_NORM: X,
            **mlp,
        },
    }


def eval_loss_moments(
    config: Qwen3Config,
    tokens: int,
    *,
    loss_chunk: int = 256,
    compute_bytes: int = 2,
    device: str = "cuda",
    norm_chunk: int = RMSNORM_CHUNK_ELEMS,
) -> dict[str, dict[Buffer, int]]:
    """The end of a forward alone: "final norm forward" (the last layer's output, the hidden
    states, the RoPE tables and one row chunk of the norm's fp32 temporaries) and "loss forward
    (evaluation)", loss/chunked_ce.py's token_losses: the hidden states, the fp32 logits and
    log-probabilities of one chunk (with the chunk's rows gathered, and on CPU a bf16 product),
    the losses and the counted rows' indices (int64)."""
    c, b = config, compute_bytes
    V, H = c.vocab_size, c.hidden_size
    X, rows = tokens * H * b, min(loss_chunk, tokens)
    low, fused = b < 4, device == "cuda"
    return {
        "final norm forward": {
            Buffer.FORWARD_INPUT: X,
            Buffer.ROPE: 2 * tokens * c.head_dim * b,  # cos and sin
            Buffer.HIDDEN: X,
            # 4 fp32 (4-byte) tensors per element of one row chunk, as a norm backward's: a bound
            # on the forward's (compare norm_bytes in layer_forward_moments)
            Buffer.NORM_TEMPORARIES: 4 * min(tokens * H, norm_chunk) * 4,
        },
        "loss forward (evaluation)": {
            Buffer.HIDDEN: X,
            Buffer.EVAL_LOSSES: tokens * (8 + 4 + 4),  # indices, losses, the [t] they go into
            # per row of the chunk: fp32 logits and log-probabilities (4 + 4 bytes per vocabulary
            # entry), on CPU a bf16 product (b), and the row itself gathered (H x b)
            Buffer.LOSS_CHUNK: rows * (V * (8 + (b if low and not fused else 0)) + H * b),
        },
    }


def loss_moments(
    config: Qwen3Config,
    tokens: int,
    *,
    loss_chunk: int = 256,
    fused_norm: bool = True,
    compute_bytes: int = 2,
    device: str = "cuda",
    head_grad: bool = True,
) -> dict[str, dict[Buffer, int]]:
    """The chunked loss's tensors (loss/chunked_ce.py) at its two largest moments.

    "loss forward", inside the chunk loop: the final norm's input and output (the hidden states
    the loss reads), the [N, H] hidden gradient and the fp32 V x H weight-gradient accumulator it
    makes in forward, and one chunk's buffers: fp32 logits and log-probabilities, for bf16 the
    probabilities p, and where no bf16 GEMM writes fp32 (CPU) the larger of its two bf16
    temporaries: the chunk's logits [chunk, V] before their upcast, and the [V, H] product added
    into the accumulator; one is freed before the other is made. "loss backward": the accumulator
    and its cast to the weight's dtype, the hidden gradient and its scaled copy (train.py drops
    the hidden states). Both hold the RoPE tables, saved by every layer's checkpoint for its
    recompute. head_grad=False (a frozen lm_head, LoRA): no accumulator, no cast.
    """
    c, b = config, compute_bytes
    V, H = c.vocab_size, c.hidden_size
    X, rows = tokens * H * b, min(loss_chunk, tokens)
    low, fused = b < 4, device == "cuda"
    # fp32 logits and log-probabilities (4 + 4 bytes per vocabulary entry), bf16 p (b)
    chunk = rows * V * (8 + (b if low else 0))
    if low and not fused:
        chunk += max(rows * V * b, V * H * b if head_grad else 0)
    norm = _norm_saved(tokens, H, b, fused_norm, input_elsewhere=False)
    rope = 2 * tokens * c.head_dim * b  # cos and sin [t, hd]: every layer's checkpoint holds them
    return {
        "loss forward": {
            Buffer.ROPE: rope,
            Buffer.FINAL_NORM: norm,
            Buffer.HIDDEN: X,
            Buffer.HIDDEN_GRAD: X,
            Buffer.LM_HEAD_GRAD_ACC: V * H * 4 if head_grad else 0,  # fp32
            Buffer.LOSS_CHUNK: chunk,
        },
        "loss backward": {
            Buffer.ROPE: rope,
            Buffer.FINAL_NORM: norm,
            Buffer.LM_HEAD_GRAD_ACC: V * H * 4 if head_grad else 0,
            Buffer.LM_HEAD_GRAD: V * H * b if head_grad else 0,
            Buffer.HIDDEN_GRAD_SCALED: 2 * X,  # the gradient and its scaled copy
        },
    }
