"""Model-size arithmetic: every parameter's shape, one rank's shard of it under FSDP2, and the
FLOPs of a training step. Nothing is allocated: every size is arithmetic on the config.

    from memory.model_size import param_shapes, shard_numel, fsdp_units, step_flops
    shapes = param_shapes(Qwen3Config.preset("qwen3-8b"))   # Hugging Face name -> shape
    shard_numel(shapes["model.embed_tokens.weight"], world=8)   # one rank's elements
    fsdp_units(Qwen3Config.preset("qwen3-8b"), world=8, master_bytes=4).layer_gathered
    step_flops(Qwen3Config.preset("qwen3-8b"), 1_048_576)["full_recompute"]
    step_flops(config, 1_048_576, doc_len=95_000)     # --documents masked: attention per document

FSDP2 shards every parameter on its first dimension over all ranks, padding that dimension to a
multiple of the world size: every rank stores ceil(dim0 / world) rows, and an all-gathered unit
(a decoder layer, the embedding, [final norm + lm_head]) keeps the padding. With CPU offload each
parameter and gradient shard is one pinned host buffer, rounded up to a power of two
(host_pinned_bytes). FLOPs count matrix products only, 2 per multiply-add (step_flops).

A mixture of experts (Qwen3-30B-A3B) has its experts stacked in each sparse layer, [experts, ...]
tensors FSDP2 shards by expert like rows: a gathered layer holds all of them (the largest layer
is the unit every plan counts), while a token's FLOPs count only its top-k experts and the router.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from model.config import Qwen3Config
from model.delta_rule import BLOCK_CHUNKS, scan_compositions
from model.lora import LoraSpec, trains_whole


def param_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape under its Hugging Face name (lm_head left out when tied)."""
    c, H = config, config.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in _layer_shapes(c, i).items()})
    shapes["model.norm.weight"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    return shapes


def _layer_shapes(c: Qwen3Config, i: int | None = None) -> dict[str, tuple[int, ...]]:
    """Layer i's parameter shapes; i None: the largest layer (a sparse one, if any; of a hybrid's
    two kinds, Gated DeltaNet or attention, the one with more elements)."""
    if i is None:
        i = _largest_layer(c)
    H, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    mlp = {
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }
    if c.is_sparse_layer(i):  # model/moe.py's stacked experts and router
        E, moe = c.num_experts, c.moe_intermediate_size
        mlp = {
            "mlp.gate.weight": (E, H),
            "mlp.experts.gate_up_proj": (E, 2 * moe, H),
            "mlp.experts.down_proj": (E, H, moe),
        }
        if c.shared_expert_intermediate_size:  # Qwen3.5 MoE: a gated shared expert beside them
            s = c.shared_expert_intermediate_size
            mlp |= {
                "mlp.shared_expert.gate_proj.weight": (s, H),
                "mlp.shared_expert.up_proj.weight": (s, H),
                "mlp.shared_expert.down_proj.weight": (H, s),
                "mlp.shared_expert_gate.weight": (1, H),
            }
    if c.is_linear_layer(i):
        mixer = _gdn_shapes(c)
    else:  # Qwen3.5's gated attention: q_proj gives each head's query and its output gate
        mixer = {
            "self_attn.q_proj.weight": (q * (2 if c.attn_output_gate else 1), H),
            "self_attn.k_proj.weight": (kv, H),
            "self_attn.v_proj.weight": (kv, H),
            "self_attn.o_proj.weight": (H, q),
            "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,),
        }
    return {
        **mixer,
        **mlp,
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }


def _gdn_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet block's parameters (model/qwen3_5.py's GatedDeltaNet, transformers'
    names): the q|k|v, z, b and a projections, the depthwise conv [C, 1, K], the decays' dt_bias
    and A_log per value head, the gated norm over a value head, out_proj."""
    H, nv = c.hidden_size, c.linear_num_value_heads
    kd = c.linear_num_key_heads * c.linear_key_head_dim
    vd = nv * c.linear_value_head_dim
    conv = 2 * kd + vd
    return {
        "linear_attn.in_proj_qkv.weight": (conv, H),
        "linear_attn.in_proj_z.weight": (vd, H),
        "linear_attn.in_proj_b.weight": (nv, H),
        "linear_attn.in_proj_a.weight": (nv, H),
        "linear_attn.conv1d.weight": (conv, 1, c.linear_conv_kernel_dim),
        "linear_attn.dt_bias": (nv,),
        "linear_attn.A_log": (nv,),
        "linear_attn.norm.weight": (c.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (H, vd),
    }


@functools.cache
def _largest_layer(c: Qwen3Config) -> int:
    """The index of the layer with the most parameter elements: the first of each kind (sparse
    or dense, Gated DeltaNet or attention) stands for its kind; ties go to the earlier kind."""
    firsts = {}
    for j in range(c.num_hidden_layers):
        firsts.setdefault((c.is_sparse_layer(j), c.is_linear_layer(j)), j)
    kinds = sorted(firsts.values())
    return max(kinds, key=lambda j: (sum(math.prod(s) for s in _layer_shapes(c, j).values()), -j))


def layer_indices(c: Qwen3Config, linear: bool) -> list[int]:
    """The Gated DeltaNet layers (linear=True) or the attention layers of c (all of a Qwen3's)."""
    return [i for i in range(c.num_hidden_layers) if c.is_linear_layer(i) == linear]


def adapter_shapes(
    c: Qwen3Config, lora: LoraSpec, i: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Layer i's LoRA adapters (model/lora.py): lora_A [rank, in] and lora_B [out, rank] of
    every targeted linear layer, under their names in the layer; i None: the largest layer's.
    A sparse layer's router (named gate, not gate_proj) and stacked experts (3-D) take none."""
    out = {}
    for name, shape in _layer_shapes(c, i).items():
        module = name.removesuffix(".weight")
        if len(shape) == 2 and module.rsplit(".", 1)[-1] in lora.targets:
            rows, cols = shape
            out[f"{module}.lora_A.weight"] = (lora.rank, cols)
            out[f"{module}.lora_B.weight"] = (rows, lora.rank)
    return out


def trains(name: str, lora: LoraSpec | None) -> bool:
    """Whether the parameter `name` trains: all do in full fine-tuning; with LoRA the adapters
    and the modules lora.train names (model/lora.py's rule)."""
    if lora is None or ".lora_A." in name or ".lora_B." in name:
        return True
    return trains_whole(name.removesuffix(".weight"), lora)


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements one rank stores for a tensor that FSDP2 shards on dim 0 over `world` ranks.

    FSDP2 pads dim 0 to a multiple of the world size, so every rank's storage has
    ceil(dim0 / world) rows (rank 0 always uses all of them).
    """
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def host_pinned_bytes(n: int) -> int:
    """Bytes torch's pinned host allocator (CachingHostAllocator) takes for one n-byte buffer: n
    rounded up to a power of two. FSDP2's CPU offload pins each parameter shard and each gradient
    shard this way (a 3 GiB buffer would cost 4)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.cache  # the layout chooser plans one model hundreds of times
def cpu_offload_host_bytes(c: Qwen3Config, world: int, master_bytes: int) -> tuple[int, int]:
    """(pinned, pageable) host bytes of FSDP2's CPU offload on one rank: each parameter shard and
    each gradient shard is one pinned buffer (host_pinned_bytes); AdamW's two states, made with
    zeros_like, are pageable."""
    shards = [shard_numel(s, world) * master_bytes for s in param_shapes(c).values()]
    return sum(2 * host_pinned_bytes(n) for n in shards), 2 * sum(shards)


def _gathered_numel(shapes, world: int) -> int:
    # An all-gathered unit keeps the padding: world x the padded shard.
    return sum(shard_numel(s, world) * world for s in shapes)


@dataclass(frozen=True)
class FsdpUnits:
    """FSDP2's units on one rank: a decoder layer, the embedding, [final norm + lm_head]."""

    layer_gathered: int  # elements of an all-gathered decoder layer
    emb_gathered: int  # elements of the all-gathered embedding (or lm_head)
    head_gathered: int  # elements of the all-gathered [final norm + lm_head] unit
    layer_shard: int  # bytes of one rank's fp32 shard of a decoder layer
    emb_shard: int  # bytes of one rank's fp32 shard of the embedding (or lm_head)
    norm_shard: int  # bytes of one rank's fp32 shard of the final norm
    all_shards: int  # bytes of one rank's shards of every parameter (LoRA: frozen in compute)
    # What trains (everything in full fine-tuning; LoRA: adapters and lora.train's tensors):
    trainable_shards: int  # bytes of one rank's fp32 shards of them
    layer_grad_gathered: int  # elements of a decoder layer's, all-gathered (reduce-scatter input)
    layer_grad_shard: int  # bytes of one rank's fp32 gradient shards of a decoder layer
    head_grad_gathered: int  # elements of the untied [norm + lm_head] unit's, all-gathered
    head_grad_shard: int  # bytes of one rank's fp32 gradient shards of embedding, norm, lm_head
    # Per decoder layer, layer 0 first (a hybrid's Gated DeltaNet and attention layers differ;
    # the fields above are the largest layer's): its all-gathered elements, its trained
    # parameters' all-gathered elements, and one rank's bytes of their fp32 gradient shards
    layers_gathered: tuple[int, ...] = ()
    layers_grad_gathered: tuple[int, ...] = ()
    layers_grad_shard: tuple[int, ...] = ()


@functools.cache  # the layout chooser plans one model hundreds of times
def fsdp_units(
    c: Qwen3Config,
    world: int,
    master_bytes: int,
    lora: LoraSpec | None = None,
    compute_bytes: int = 2,
) -> FsdpUnits:
    """FSDP2's units of config `c` on the rank holding the largest shards of `world` ranks, with
    fp32 shards of `master_bytes` per element. lora: the base weights frozen in compute_bytes
    (no gradient), the adapters added to every layer (model/lora.py)."""
    layer_shapes = {**_layer_shapes(c), **(adapter_shapes(c, lora) if lora else {})}
    layer, emb, norm = layer_shapes.values(), (c.vocab_size, c.hidden_size), (c.hidden_size,)
    shapes = dict(param_shapes(c))
    if lora is not None:
        for i in range(c.num_hidden_layers):
            adapters = adapter_shapes(c, lora, i)
            shapes.update({f"model.layers.{i}.{k}": v for k, v in adapters.items()})
    trained = {k: v for k, v in shapes.items() if trains(k, lora)}
    frozen = sum(shard_numel(v, world) for k, v in shapes.items() if k not in trained)
    trainable = sum(shard_numel(v, world) for v in trained.values())
    layer_trained = [v for k, v in layer_shapes.items() if trains(f"model.layers.0.{k}", lora)]
    head = {"model.norm.weight": norm}
    if not c.tie_word_embeddings:
        head["lm_head.weight"] = emb
    head_trained = [v for k, v in head.items() if trains(k, lora)]
    kinds = {}  # the per-layer figures, worked out once per kind of layer
    per_layer = []
    for i in range(c.num_hidden_layers):
        kind = (c.is_sparse_layer(i), c.is_linear_layer(i))
        if kind not in kinds:
            own = {**_layer_shapes(c, i), **(adapter_shapes(c, lora, i) if lora else {})}
            trained_own = [v for k, v in own.items() if trains(f"model.layers.{i}.{k}", lora)]
            kinds[kind] = (
                _gathered_numel(own.values(), world),
                _gathered_numel(trained_own, world),
                sum(shard_numel(s, world) for s in trained_own) * master_bytes,
            )
        per_layer.append(kinds[kind])
    return FsdpUnits(
        layer_gathered=_gathered_numel(layer, world),
        emb_gathered=_gathered_numel([emb], world),
        head_gathered=_gathered_numel([emb, norm], world),
        layer_shard=sum(shard_numel(s, world) for s in layer) * master_bytes,
        emb_shard=shard_numel(emb, world) * master_bytes,
        norm_shard=shard_numel(norm, world) * master_bytes,
        all_shards=trainable * master_bytes + frozen * (compute_bytes if lora else master_bytes),
        trainable_shards=trainable * master_bytes,
        layer_grad_gathered=_gathered_numel(layer_trained, world),
        layer_grad_shard=sum(shard_numel(s, world) for s in layer_trained) * master_bytes,
        head_grad_gathered=_gathered_numel(head_trained, world),
        head_grad_shard=sum(shard_numel(s, world) for s in head_trained) * master_bytes,
        layers_gathered=tuple(g for g, _, _ in per_layer),
        layers_grad_gathered=tuple(g for _, g, _ in per_layer),
        layers_grad_shard=tuple(n for _, _, n in per_layer),
    )


@functools.cache  # step_flops runs for every layout the chooser plans
def _matmul_params_per_token(c: Qwen3Config) -> int:
    """Matrix-product parameters one token meets in all decoder layers: the sum of
    _active_matmul_params, counted once per kind of layer (dense or sparse, Gated DeltaNet or
    attention), not once per layer (the layout chooser plans ~500 layouts of a 64-layer model)."""
    kinds: dict[tuple[bool, bool], list[int]] = {}
    for i in range(c.num_hidden_layers):
        kinds.setdefault((c.is_sparse_layer(i), c.is_linear_layer(i)), []).append(i)
    return sum(len(layers) * _active_matmul_params(c, layers[0]) for layers in kinds.values())


def _active_matmul_params(c: Qwen3Config, i: int) -> int:
    """Matrix-product parameters one token meets in layer i: every 2-D weight of a dense layer;
    in a sparse one the router, the shared expert and its gate (Qwen3.5 MoE) and its top-k
    experts, not all of them."""
    shapes = _layer_shapes(c, i)
    flat = sum(math.prod(s) for s in shapes.values() if len(s) == 2)
    if not c.is_sparse_layer(i):
        return flat
    return flat + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size


# The gated delta rule's products (model/delta_rule.py's chunk form and scan), per chunk of C
# tokens and value head, key dim dk, value dim dv, 2 FLOPs per multiply-add:
#   A = (K * beta) K^T                    [C, dk] x [dk, C]       2 C^2 dk
#   W = (I + A)^-1 [V_b | K_bg]           [C, C] x [C, dv + dk]   2 C^2 (dv + dk)
#   Q K^T                                 [C, dk] x [dk, C]       2 C^2 dk
#   the chunk's map [c | M] = K_d^T W     [dk, C] x [C, dv + dk]  2 C dk (dv + dk)
#   U = W_v - W_k S                       [C, dk] x [dk, dv]      2 C dk dv
#   O = (exp(gam) Q) S + (Q K^T * D) U    [C, dk] x [dk, dv], [C, C] x [C, dv]
#                                                                 2 C dk dv + 2 C^2 dv
# so per token and value head 2 C (3 dk + 2 dv) + 2 dk^2 + 6 dk dv: 212,992 at C 64,
# dk = dv = 128. The scan composes the maps of a block's N chunks scan_compositions(N) times
# (about 2 N), each a [dk, dk] x [dk, dv + dk] product, 2 dk^2 (dk + dv); and a block that starts
# from a state (every block but a row's first) applies each chunk's prefix map to it,
# [dk, dk] x [dk, dv] a chunk. At Qwen3.5's shapes and a million tokens the scan adds 1.52x the
# chunk form's products: 535,808 FLOPs a token and value head in all.
# The triangular solve (I + A)^-1 (C^3 / 3 multiply-adds a chunk) is left out, as torch's flop
# counter leaves it out. Backward recomputes one block's forward with autograd and takes the
# gradients of those products: 1 + 2 forwards (GDN_BWD_FACTOR), plus the inverse's gradient, one
# more [C, C] x [C, C] product a chunk: 2 C^2 per token and head (gdn_flops).
DELTA_RULE_CHUNK = 64  # model/delta_rule.py's gated_delta_rule(chunk=64), what the model calls
GDN_BWD_FACTOR = 3.0


def gdn_flops(c: Qwen3Config, seq_len: int) -> tuple[float, float]:
    """The delta rule's (forward, backward) FLOPs in one Gated DeltaNet layer over a row of
    seq_len tokens, all value heads, in model/delta_rule.py's blocks (the comment above): 5.4e5
    forward FLOPs per token and value head at Qwen3.5's shapes and a million tokens."""
    C, dk, dv = DELTA_RULE_CHUNK, c.linear_key_head_dim, c.linear_value_head_dim
    per_token = 2.0 * C * (3 * dk + 2 * dv) + 2.0 * dk * dk + 6.0 * dk * dv
    chunks = -(-seq_len // C)
    scan = 0.0
    for first in range(0, chunks, BLOCK_CHUNKS):  # one block of up to BLOCK_CHUNKS chunks
        n = min(BLOCK_CHUNKS, chunks - first)
        scan += scan_compositions(n) * 2.0 * dk * dk * (dk + dv)
        if first > 0:  # the block starts from the state the block before left
            scan += n * 2.0 * dk * dk * dv
    forward = c.linear_num_value_heads * (per_token * seq_len + scan)
    backward = GDN_BWD_FACTOR * forward + c.linear_num_value_heads * 2.0 * C * C * seq_len
    return forward, backward


def attention_square(seq_len: int, doc_len: int = 0) -> int:
    """The sum of the squared lengths of a row's documents: what causal attention's cost grows
    with. doc_len 0 (or >= seq_len): one document, seq_len^2; else seq_len // doc_len documents
    of doc_len and the rest. 1,048,576 tokens of 95,000-token books: 0.090 of the row's square."""
    if doc_len <= 0 or doc_len >= seq_len:
        return seq_len * seq_len
    whole, rest = divmod(seq_len, doc_len)
    return whole * doc_len * doc_len + rest * rest


def step_flops(
    config: Qwen3Config,
    seq_len: int,
    *,
    attn_bwd_factor: float = 2.5,
    doc_len: int = 0,
    lora: LoraSpec | None = None,
) -> dict[str, float]:
    """FLOPs of one row (2 per multiply-add), forward pieces and the three totals.

    Forward: dense matmuls 2 x (non-embedding matmul parameters) x T; lm_head 2 x V x H x T
    (the embedding is a lookup); causal attention 2 x T^2/2 x heads x head_dim for QK^T and the
    same for PV, per attention layer (a Qwen3.5's full-attention layers only); the Gated
    DeltaNet layers' delta rule gdn_flops (its backward: one block's forward again, then the
    gradients), linear in T whether or not the row holds documents. Backward: 2x
    forward for matmuls; attention's backward is 2.5x its forward (FlashAttention's backward does
    5 T^2 products against the forward's 2, recomputing QK^T). The one-pass loss does its 3
    products in forward and none in backward: same count. Recomputation adds one forward of the
    layers (the delta rule's included), without lm_head, with or without attention.
    doc_len: rows of documents of this length (--documents masked): attention counts the sum of
    their squares instead of T^2 (attention_square); 0: one sequence per row.
    lora: the frozen weights' gradient products are skipped (backward 1x their forward: the
    input's gradient only), lm_head's too unless it trains; the adapters' own products (forward,
    recompute, and a 2x backward) are added to the dense ones.
    """
    c, T = config, seq_len
    dense = 2.0 * _matmul_params_per_token(c) * T
    lm_head = 2.0 * c.vocab_size * c.hidden_size * T
    square = attention_square(T, doc_len)  # T^2 for one sequence
    attn = c.attention_layers * 2 * (2.0 * square / 2) * c.num_attention_heads * c.head_dim
    gdn, gdn_bwd = (c.linear_layers * f for f in gdn_flops(c, T))  # documents or not: linear
    model = 3 * (dense + lm_head) + (1 + attn_bwd_factor) * attn + gdn + gdn_bwd
    dense_bwd, loss = 2 * dense, 3 * lm_head
    if lora is not None:
        layers = range(c.num_hidden_layers)
        adapters = sum(math.prod(s) for i in layers for s in adapter_shapes(c, lora, i).values())
        adapter_fwd = 2.0 * adapters * T
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        loss = (3 if trains(head, lora) else 2) * lm_head
        dense_bwd = dense + 2 * adapter_fwd  # the frozen weights: their input's gradient only
        dense += adapter_fwd  # what a recompute runs again
        model = dense + dense_bwd + loss + (1 + attn_bwd_factor) * attn
        model += gdn + gdn_bwd
    return {
        "dense_fwd": dense,
        "lm_head_fwd": lm_head,
        "attention_fwd": attn,
        "gdn_fwd": gdn,  # the delta rule's products (0 for a Qwen3)
        "gdn_bwd": gdn_bwd,  # ... and its backward's
        "dense_bwd": dense_bwd,
        "loss": loss,  # the loss's products, its weight's gradient included when it trains
        "model": model,
        "no_attn_recompute": model + dense + gdn,  # a recompute runs the delta rule again
        "full_recompute": model + dense + gdn + attn,
    }
