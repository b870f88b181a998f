"""Dense Qwen3 in plain PyTorch: one file, no framework, not distributed (see model/parallel.py).

    model = Qwen3(Qwen3Config.preset("tiny"))     # real shapes: Qwen3Config.from_hf(model_dir)
    model.init_weights(seed=0)                    # or read a checkpoint: model/weights.py
    ids = torch.randint(0, model.config.vocab_size, (1, 257))   # a row: inputs, then next tokens
    hidden = model(ids[:, :-1])                   # [B, T, hidden], the final norm applied
    loss = chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten(),
                                 reduction="mean")   # loss/chunked_ce.py: no [T, vocab] logits
    loss.backward()

The module tree mirrors Hugging Face's Qwen3ForCausalLM, so `state_dict()` keys are exactly the
checkpoint keys (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`, ...,
`lm_head.weight`) and loading needs no renaming table.

One decoder layer:  x + attn(norm(x)),  then  h + mlp(norm(h)),  where attention is
    q, k, v projections -> per-head RMSNorm on q and k -> RoPE -> causal attention -> o_proj.

Two things are left replaceable from outside, so that parallelism never edits this file:
  * `Attention.attn_fn(q, k, v)`: the attention core on [B, T, heads, head_dim] tensors
    (default: causal_attention, grouped kv heads on one pinned kernel); sequence parallelism
    swaps in an all-to-all. A row of several documents (forward's doc_lens, the lengths of the
    whole row's documents) calls attn_fn(q, k, v, doc_lens=...): causal within each document.
    A core that takes store= (causal_attention, model/ulysses.py's) can keep its output for a
    checkpoint's recompute: model/checkpoint_offload.py binds an AttentionStore to it per call.
  * each module's forward, as usual for wrappers such as checkpointing and FSDP2.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import attention
from model.config import Qwen3Config
from model.moe import Experts, SparseMoeBlock
from model.seeded_init import seeded_normal_


# ---------------------------------------------------------------------------------------------
# RoPE (default and YaRN)
# ---------------------------------------------------------------------------------------------
# Positions are global: under sequence parallelism each rank passes its share's own places in the
# row (model/ulysses_exchange.py's shard_row), and Attention rotates q and k here, before attn_fn's
# exchange, so every token already carries its rotation when the ranks trade tokens for heads.
# The qwen3-8b-1m recipe runs YaRN x32 over Qwen3's 32,768 original positions (--yarn-factor).
@functools.lru_cache(maxsize=16)
def rope_inv_freq(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32, on CPU) and the cos/sin scaling factor.

    Computed in float32 with the same expressions as transformers' rope utilities, so a
    checkpoint gets bit-for-bit the frequencies its reference implementation uses. Only the
    angles (position x frequency) are then taken to float64: that product is where precision
    is lost at a million positions.
    """
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    y = config.yarn
    if y is None:
        return 1.0 / pos_freqs, 1.0

    # YaRN: keep high frequencies (many rotations within the original context) as they are,
    # divide low ones by `factor`, and blend linearly in between (arXiv 2309.00071, sec. 3.2).
    def correction_dim(num_rotations: float) -> float:
        return (
            dim
            * math.log(y.original_max_position_embeddings / (num_rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, y.attention_scaling


def rope_cos_sin(config: Qwen3Config, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos and sin [B, T, head_dim] for integer positions [B, T].

    Angles in float64: at position 10^6 a float32 angle is off by up to 0.03 rad (its spacing
    there is 0.0625), which is a different position to the model. float64 is exact to 1e-10.
    """
    inv_freq, scale = rope_inv_freq(config)
    inv_freq = inv_freq.to(device=position_ids.device, dtype=torch.float64)
    angles = position_ids.to(torch.float64)[..., None] * inv_freq  # [B, T, hd/2]
    angles = torch.cat((angles, angles), dim=-1)  # [B, T, hd]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd]; cos, sin [B, T, hd]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, hd]
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------
# Elements per row chunk of the RMSNorm's fp32 temporaries: 64 MiB of fp32 each, 4,096 rows of
# Qwen3-8B's hidden size. memory/buffers.py counts one chunk's temporaries.
RMSNORM_CHUNK_ELEMS = 1 << 24


class _RMSNormFn(torch.autograd.Function):
    """weight * (x / rms(x)) with transformers' arithmetic (normalise in fp32, cast back to x's
    dtype, then scale), saving for backward only x and the fp32 1/rms per row.

    Left to autograd, the same expression saves an fp32 copy of x plus the cast result: 6 bytes
    per bf16 element instead of 2. At 131,072 tokens per GPU that is about 8 GB per recomputed
    Qwen3-8B layer, the difference between 2.9M and 4.7M tokens fitting on 8 x 80 GB.
    Forward and backward run over row chunks of CHUNK_ELEMS elements, so the fp32 temporaries
    (x.float(), the normalised rows, the upcast gradient) exist for one chunk at a time, never for
    the whole [tokens, hidden] tensor (10 fp32 copies of a 1 GiB input in backward otherwise).
    """

    CHUNK_ELEMS = RMSNORM_CHUNK_ELEMS  # what forward and backward read (tests set it)

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1])  # [N, dim]
        step = max(1, _RMSNormFn.CHUNK_ELEMS // x2.shape[1])
        # Returned as allocated, not as a view: FSDP2 warns about view outputs, and its hooks can
        # miss them.
        out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
        out2 = out.view(x2.shape)  # [N, dim], the chunks are written through it
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)  # [N, 1]
        for s in range(0, x2.shape[0], step):
            xf = x2[s : s + step].float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[s : s + step] = r
            torch.mul(weight, (xf * r).to(x.dtype), out=out2[s : s + step])
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # [N, dim]
        step = max(1, _RMSNormFn.CHUNK_ELEMS // x2.shape[1])
        need_w = ctx.needs_input_grad[1]
        dx = torch.empty_like(x2)
        dw = torch.zeros(x2.shape[1], dtype=torch.float32, device=x.device) if need_w else None
        for s in range(0, x2.shape[0], step):
            r, dyc = rstd[s : s + step], dy2[s : s + step]
            n = x2[s : s + step].float() * r  # the normalised rows, recomputed
            if need_w:
                dw += (dyc * n.to(x.dtype)).sum(0, dtype=torch.float32)
            g = (dyc * weight).to(x.dtype).float()  # what autograd passes back through the cast
            # d/dx of x * rstd(x):  rstd * (g - n * mean(g * n))
            dx[s : s + step] = r * (g - n * (g * n).mean(-1, keepdim=True))
        return dx.view_as(x), (dw.to(weight.dtype) if need_w else None), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_lens: tuple[int, ...] | None = None,
    store=None,
) -> torch.Tensor:
    """Causal attention. q [B, T, nh, hd], k and v [B, T, nkv, hd] -> [B, T, nh, hd]; with
    doc_lens (ints summing to T) causal within each document.

    Query heads g*r .. g*r+g-1 share kv head r (g = nh / nkv), without materialising repeated k
    and v. model/attention.py runs it on one pinned kernel that also returns the log-sum-exp, so
    a checkpointed layer can keep attention from its forward instead of recomputing it: `store`,
    an AttentionStore the checkpoint wrapper passes (model/checkpoint_offload.py), keeps it.
    """
    return attention(q, k, v, doc_lens=doc_lens, store=store)


class Attention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.attn_fn = causal_attention  # replaceable attention core (see module docstring)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_lens=None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))  # [B, T, nh, hd]
        k = self.k_norm(
            self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        )  # [B, T, nkv, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # RoPE after the q/k norms
        if doc_lens is None:
            out = self.attn_fn(q, k, v)  # [B, T, nh, hd]
        else:
            out = self.attn_fn(q, k, v, doc_lens=doc_lens)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


def sparse_moe(config: Qwen3Config) -> SparseMoeBlock:
    """A Qwen3-MoE layer's experts and router in place of the MLP (model/moe.py)."""
    c = config
    return SparseMoeBlock(
        c.hidden_size,
        c.moe_intermediate_size,
        c.num_experts,
        c.num_experts_per_tok,
        c.norm_topk_prob,
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = sparse_moe(config) if config.is_sparse_layer(index) else MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_lens=None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, doc_lens)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Body(nn.Module):
    """Embedding, decoder layers and final norm: the `model.` prefix of the checkpoint keys."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
class Qwen3(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter, two names

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_lens: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden states [B, T, hidden].

        position_ids are GLOBAL positions: a sequence shard starting at token s passes s, s+1, ...
        (with documents: each token's place in its document). doc_lens: the lengths of the whole
        row's documents (B = 1; under sequence parallelism the row of every sp rank together),
        which attention stays within; None: the row is one sequence.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        # One cos/sin table shared by every layer (never recomputed or copied per layer).
        cos, sin = rope_cos_sin(self.config, position_ids, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, doc_lens=doc_lens)
        return self.model.norm(x)

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full logits [B, T, vocab], for tests and short inputs; training uses the chunked loss."""
        return F.linear(self(input_ids, position_ids), self.lm_head.weight)

    def set_attention(self, attn_fn) -> None:
        """Replace the attention core of every layer, e.g. with a sequence-parallel one."""
        for layer in self.model.layers:
            layer.self_attn.attn_fn = attn_fn

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Weights for a run from scratch, as transformers initialises Qwen3: N(0, 0.02) for
        linear and embedding weights, ones for the norms. Each weight's numbers depend only on
        `seed` and its name (model/seeded_init.py), so a sharded model (DTensor parameters, any
        world size, shards on any device) holds the same full weights as one process.
        seed None: torch.initial_seed(), the seed the last torch.manual_seed set."""
        seed = torch.initial_seed() if seed is None else seed
        std = self.config.initializer_range
        drawn = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        drawn |= {id(p) for m in self.modules() if isinstance(m, Experts) for p in m.parameters()}
        norms = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        for name, p in self.named_parameters():  # a tied lm_head once, as model.embed_tokens
            if id(p) in drawn:
                seeded_normal_(p, seed=seed, name=name, std=std)
            elif id(p) in norms:
                p.fill_(1.0)
            else:
                raise TypeError(f"init_weights has no rule for parameter {name}")
